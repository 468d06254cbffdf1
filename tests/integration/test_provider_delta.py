"""Delta provider specifics: stale snapshots conflict (CommitFailedError path), the fence encoding, the log."""

from __future__ import annotations

import json
import multiprocessing
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from durable_dataflow.core.hashing import sha256_bytes
from durable_dataflow.datasources import delta as delta_module
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    Absent,
    AlreadyPublished,
    Fenced,
    Inconclusive,
    Present,
    PublicationRefs,
    Published,
    PublishTarget,
    Undecided,
)
from durable_dataflow.datasources.delta import FENCE_SUFFIX, PLACEHOLDER_COLUMN, DeltaProvider

PROCESS_PUBLISHERS = 8


def table(n: int = 3) -> pa.Table:
    return pa.table({"id": pa.array(range(n), pa.int64()), "v": pa.array(["x"] * n, pa.string())})


def target(path: Path) -> PublishTarget:
    return PublishTarget("ds", str(path), "append", {})


def prepared(path: Path) -> Path:
    """The table created (placeholder schema, no rows), as the platform does before authorizing dispatch."""
    DeltaProvider().prepare(target(path))
    return path


def log_actions(path: Path) -> list[list[dict[str, object]]]:
    return [
        [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        for p in sorted((path / "_delta_log").glob("*.json"))
    ]


def test_stale_snapshot_publish_conflicts_and_the_retry_finds_the_key(tmp_path: Path) -> None:
    """After A publishes K, B's commit on its stale handle conflicts (None); B's fresh decision is AlreadyPublished."""
    provider = DeltaProvider()
    path = prepared(tmp_path / "t")
    provider.publish("other", 1, table(), sha256_bytes(b"o"), target(path))
    stale = DeltaTable(str(path))
    first = provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))
    assert isinstance(first, Published)
    # B checked on the old snapshot (K absent there) and commits on that same object: conflict.
    assert stale.transaction_version("K") is None
    decided = provider._publish_on(stale, path, "K", 2, table(), sha256_bytes(b"k"), target(path))
    assert decided is None
    assert provider.publish("K", 2, table(), sha256_bytes(b"k"), target(path)) == AlreadyPublished(
        first.refs, sha256_bytes(b"k")
    )
    published = [a for a in log_actions(path) if any("txn" in x and x["txn"]["appId"] == "K" for x in a)]  # type: ignore[index]
    assert len(published) == 1


def test_stale_publish_conflicts_with_a_concurrent_fence_commit(tmp_path: Path) -> None:
    """A publisher that checked before a fence commit cannot commit after it: the fence restates the key's txn."""
    provider = DeltaProvider()
    path = prepared(tmp_path / "t")
    provider.publish("other", 1, table(), sha256_bytes(b"o"), target(path))
    stale = DeltaTable(str(path))
    assert provider.inspect("K", target(path), fence=5) == Absent(5)
    assert provider._publish_on(stale, path, "K", 2, table(), sha256_bytes(b"k"), target(path)) is None
    assert provider.publish("K", 2, table(), sha256_bytes(b"k"), target(path)) == Fenced(5)
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 3  # only "other"'s rows


def test_stale_fence_conflicts_with_a_concurrent_publication(tmp_path: Path) -> None:
    """An inspection that saw K absent cannot fence after K is published: it decides again and finds Present."""
    provider = DeltaProvider()
    path = prepared(tmp_path / "t")
    provider.publish("other", 1, table(), sha256_bytes(b"o"), target(path))
    stale = DeltaTable(str(path))
    published = provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))
    assert isinstance(published, Published)
    assert provider._inspect_on(stale, delta_module._Place.of(target(path)), "K", 5) is None
    assert provider.inspect("K", target(path), fence=5) == Present(published.refs, sha256_bytes(b"k"), 1)
    assert DeltaTable(str(path)).transaction_version("K" + FENCE_SUFFIX) is None


def test_fence_encoding_in_the_log(tmp_path: Path) -> None:
    """A fence is a commit without rows, txns (K,0) and (K#fence,m), kind=fence; a publication has txn (K,t)."""
    provider = DeltaProvider()
    path = tmp_path / "t"
    provider.prepare(target(path))
    assert provider.inspect("K", target(path), fence=3) == Absent(3)
    published = provider.publish("K", 4, table(), sha256_bytes(b"k"), target(path))
    assert isinstance(published, Published)
    commits = log_actions(path)
    fence_commit = next(c for c in commits if any(a.get("commitInfo", {}).get("dataflow_kind") == "fence" for a in c))  # type: ignore[union-attr]
    assert {"appId": "K", "version": 0} in [a["txn"] for a in fence_commit if "txn" in a]
    assert {"appId": "K#fence", "version": 3} in [a["txn"] for a in fence_commit if "txn" in a]
    assert not any("add" in a for a in fence_commit)
    dt = DeltaTable(str(path))
    assert (dt.transaction_version("K"), dt.transaction_version("K#fence")) == (4, 3)
    assert published.refs.materialization_ref == f"delta://{path}@v{dt.version()}"
    assert DeltaTable(str(path), version=dt.version()).to_pyarrow_table().num_rows == 3


def test_prepare_creates_the_placeholder_table_and_the_first_publication_replaces_its_schema(tmp_path: Path) -> None:
    """`prepare` creates the table itself (placeholder column, no rows, no txn) and a second prepare only loads it;
    a fence on it keeps the placeholder schema and the first publication sets the result's schema."""
    provider = DeltaProvider()
    path = tmp_path / "new"
    provider.prepare(target(path))
    dt = DeltaTable(str(path))
    assert [f.name for f in dt.schema().fields] == [PLACEHOLDER_COLUMN]
    assert (dt.version(), dt.to_pyarrow_table().num_rows, dt.transaction_version("K")) == (0, 0, None)
    provider.prepare(target(path))
    assert DeltaTable(str(path)).version() == 0
    assert provider.inspect("K", target(path)) == Absent(None)
    assert provider.inspect("K", target(path), fence=2) == Absent(2)
    assert [f.name for f in DeltaTable(str(path)).schema().fields] == [PLACEHOLDER_COLUMN]
    assert isinstance(provider.publish("K", 2, table(), sha256_bytes(b"k"), target(path)), Published)
    dt = DeltaTable(str(path))
    assert [f.name for f in dt.schema().fields] == ["id", "v"]
    assert dt.to_pyarrow_table().num_rows == 3
    assert dt.transaction_version("K#fence") == 2
    provider.prepare(target(path))  # a later run's prepare leaves a table with publications as it is
    assert [f.name for f in DeltaTable(str(path)).schema().fields] == ["id", "v"]
    assert DeltaTable(str(path)).version() == dt.version()


def test_prepare_keeps_an_existing_table(tmp_path: Path) -> None:
    """A table that exists before the first run (made by another writer) is loaded by `prepare`, not replaced."""
    path = tmp_path / "t"
    DeltaTable.create(str(path), schema=table().schema)
    DeltaProvider().prepare(target(path))
    dt = DeltaTable(str(path))
    assert (dt.version(), [f.name for f in dt.schema().fields]) == (0, ["id", "v"])
    assert isinstance(DeltaProvider().publish("K", 1, table(), sha256_bytes(b"k"), target(path)), Published)


def test_lost_commit_info_is_undecided_not_guessed(tmp_path: Path) -> None:
    """Txn says published but the commit info is gone (log retention): Undecided / Inconclusive, never guessed."""
    provider = DeltaProvider()
    path = prepared(tmp_path / "t")
    provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))
    # Simulate log cleanup: the JSON commits are gone, the txn survives in a checkpoint.
    DeltaTable(str(path)).create_checkpoint()
    for commit in (path / "_delta_log").glob("*.json"):
        commit.unlink()
    assert isinstance(provider.inspect("K", target(path)), Undecided)
    with pytest.raises(Inconclusive, match="commit info"):
        provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))


def _publish_in_process(path: str, token: int) -> str:
    outcome = DeltaProvider().publish("proc-race", token, table(), sha256_bytes(b"p"), target(Path(path)))
    return type(outcome).__name__


def test_processes_racing_on_one_key_publish_once(tmp_path: Path) -> None:
    """8 processes publish one key on an existing table: one Published, seven AlreadyPublished, one commit."""
    path = prepared(tmp_path / "t")
    DeltaProvider().publish("seed", 1, table(1), sha256_bytes(b"s"), target(path))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(PROCESS_PUBLISHERS) as pool:
        names = pool.starmap(_publish_in_process, [(str(path), t) for t in range(1, PROCESS_PUBLISHERS + 1)])
    assert sorted(names) == ["AlreadyPublished"] * (PROCESS_PUBLISHERS - 1) + ["Published"]
    dt = DeltaTable(str(path))
    assert dt.to_pyarrow_table().num_rows == 1 + 3
    assert delta_module.find_publication_commit(path, "proc-race") is not None


def test_commit_conflicts_beyond_the_limit_are_inconclusive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If every commit attempt conflicts, publish gives up after COMMIT_ATTEMPTS_MAX and says Inconclusive."""
    provider = DeltaProvider()
    path = prepared(tmp_path / "t")
    calls: list[int] = []

    def always_conflict(*args: object, **kwargs: object) -> None:
        calls.append(1)
        return None

    monkeypatch.setattr(provider, "_publish_on", always_conflict)
    with pytest.raises(Inconclusive, match="conflicts"):
        provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))
    assert len(calls) == delta_module.COMMIT_ATTEMPTS_MAX


def test_refs_name_a_relative_location_relative_to_the_sink_root(tmp_path: Path) -> None:
    """Refs of a relative location never carry base_dir (the server's sink root); publish, replay and inspect agree."""
    provider = DeltaProvider()
    relative = PublishTarget("ds", "./out/t/", "append", {"base_dir": str(tmp_path)})
    provider.prepare(relative)
    published = provider.publish("K", 1, table(), sha256_bytes(b"k"), relative)
    assert isinstance(published, Published)
    version = DeltaTable(str(tmp_path / "out" / "t")).version()
    assert published.refs == PublicationRefs("delta://out/t#txn=K", "delta://out/t", f"delta://out/t@v{version}")
    assert provider.publish("K", 2, table(), sha256_bytes(b"k"), relative) == AlreadyPublished(
        published.refs, sha256_bytes(b"k")
    )
    assert provider.inspect("K", relative, fence=3) == Present(published.refs, sha256_bytes(b"k"), 1)


def test_delta_rs_text_never_reaches_a_reason(tmp_path: Path) -> None:
    """delta-rs quotes absolute paths ('Unable to open file /abs/…/_delta_log/_last_checkpoint'); the reasons name
    what failed and the exception type only, and the outcome stays Inconclusive / Undecided (nothing is proven).
    A location that is a file cannot be prepared (the platform then fails the run before dispatch); a publish to
    it anyway says the location is missing, with no path, and leaves the file as it was."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "file.parquet").write_bytes(b"PAR1")
    on_file = PublishTarget("ds", "out/file.parquet", "append", {"base_dir": str(tmp_path)})
    provider = DeltaProvider()
    with pytest.raises(OSError):
        provider.prepare(on_file)
    with pytest.raises(Inconclusive) as missing:
        provider.publish("K", 1, table(), sha256_bytes(b"k"), on_file)
    assert missing.value.message == f"delta publish of key 'K': {LOCATION_MISSING}"
    assert (tmp_path / "out" / "file.parquet").read_bytes() == b"PAR1"
    inspected = provider.inspect("K", PublishTarget("ds", str(tmp_path / "out" / "file.parquet"), "append", {}), 2)
    assert inspected == Undecided(f"delta inspection of key 'K': {LOCATION_MISSING}")
    broken = PublishTarget("ds", "out/t", "append", {"base_dir": str(tmp_path)})
    provider.prepare(broken)
    checkpoint = tmp_path / "out" / "t" / "_delta_log" / "_last_checkpoint"
    checkpoint.symlink_to(checkpoint)  # a symlink loop: delta-rs cannot open the checkpoint hint
    with pytest.raises(Inconclusive) as caught:
        provider.publish("K", 1, table(), sha256_bytes(b"k"), broken)
    assert str(tmp_path) in str(caught.value.__cause__)  # delta-rs's own text quotes the path...
    assert caught.value.message == (  # ...the reason does not
        "delta publish of key 'K' failed: the table's files could not be read or written (OSError)"
    )
    for fence in (None, 2):
        inspected = provider.inspect("K", broken, fence)
        assert isinstance(inspected, Undecided) and str(tmp_path) not in inspected.reason
        assert inspected.reason == (
            "delta inspection of key 'K' failed: the table's files could not be read or written (OSError)"
        )


def test_publish_to_a_prepared_folder_that_went_missing_is_inconclusive_and_creates_nothing(tmp_path: Path) -> None:
    """The table's folder was prepared, nothing was published, then it went missing (moved away, unmounted):
    publish cannot tell that from a folder holding an earlier publication, so it raises Inconclusive naming the
    missing location (no path) and does not re-create the folder; inspect stays Undecided."""
    path = prepared(tmp_path / "t")
    provider = DeltaProvider()
    shutil.rmtree(path)
    with pytest.raises(Inconclusive) as caught:
        provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))
    assert caught.value.message == f"delta publish of key 'K': {LOCATION_MISSING}"
    assert str(tmp_path) not in caught.value.message
    assert not path.exists() and list(tmp_path.iterdir()) == []
    for fence in (None, 2):
        found = provider.inspect("K", target(path), fence=fence)
        assert isinstance(found, Undecided) and found.reason.endswith(LOCATION_MISSING)
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_a_moved_table_holding_the_publication_is_never_published_twice(tmp_path: Path) -> None:
    """K is published, the table's folder is moved away: a second publish of K is Inconclusive (it cannot see
    the publication, so it must not make another), and with the folder back the log holds exactly one."""
    path = prepared(tmp_path / "t")
    provider = DeltaProvider()
    first = provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))
    assert isinstance(first, Published)
    path.rename(tmp_path / "moved")
    with pytest.raises(Inconclusive, match="the sink location is missing"):
        provider.publish("K", 2, table(), sha256_bytes(b"k"), target(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moved"]
    (tmp_path / "moved").rename(path)
    assert provider.inspect("K", target(path)) == Present(first.refs, sha256_bytes(b"k"), 1)
    txns = [x["txn"] for commit in log_actions(path) for x in commit if "txn" in x]
    assert [t for t in txns if t["appId"] == "K"] == [{"appId": "K", "version": 1}]  # type: ignore[index]
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 3


def _unmount(path: Path, away: Path) -> None:
    """The volume holding the table is unmounted: the mount point stays behind as an empty folder."""
    path.rename(away)
    path.mkdir()


def test_an_empty_folder_in_place_of_the_table_is_missing_not_absent(tmp_path: Path) -> None:
    """K is published, then the table's volume is unmounted, leaving the mount point: an empty folder. It reads
    as missing, never as "prepared, nothing published": inspect is Undecided with and without a fence, publish
    raises Inconclusive, and neither creates anything in it; mounted again, the log holds exactly one publication."""
    path = prepared(tmp_path / "t")
    provider = DeltaProvider()
    first = provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))
    assert isinstance(first, Published)
    _unmount(path, tmp_path / "volume")
    for fence in (None, 2):
        assert provider.inspect("K", target(path), fence=fence) == Undecided(
            f"delta inspection of key 'K': {LOCATION_MISSING}"
        )
    with pytest.raises(Inconclusive) as caught:
        provider.publish("K", 3, table(), sha256_bytes(b"k"), target(path))
    assert caught.value.message == f"delta publish of key 'K': {LOCATION_MISSING}"
    assert list(path.iterdir()) == []
    path.rmdir()
    (tmp_path / "volume").rename(path)
    assert provider.inspect("K", target(path), fence=4) == Present(first.refs, sha256_bytes(b"k"), 1)
    txns = [x["txn"] for commit in log_actions(path) for x in commit if "txn" in x]
    assert [t for t in txns if t["appId"] == "K"] == [{"appId": "K", "version": 1}]  # type: ignore[index]
    assert DeltaTable(str(path)).transaction_version("K" + FENCE_SUFFIX) is None


def test_an_empty_folder_where_nothing_was_published_is_still_not_absent(tmp_path: Path) -> None:
    """An empty folder at a prepared location (its table unmounted before any publication, or a folder from before
    `prepare` created the table): the provider cannot tell it from a table out of sight, so it is Undecided and a
    publish is Inconclusive; nothing is created in it. Preparing it (only when nothing was published) settles it."""
    path = tmp_path / "t"
    path.mkdir()
    provider = DeltaProvider()
    for fence in (None, 2):
        found = provider.inspect("K", target(path), fence=fence)
        assert isinstance(found, Undecided) and found.reason.endswith(LOCATION_MISSING)
    with pytest.raises(Inconclusive, match="the sink location is missing"):
        provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))
    assert list(path.iterdir()) == []
    provider.prepare(target(path))
    assert provider.inspect("K", target(path), fence=2) == Absent(2)
    assert isinstance(provider.publish("K", 2, table(), sha256_bytes(b"k"), target(path)), Published)


def test_a_delta_log_that_is_a_file_is_missing_and_left_alone(tmp_path: Path) -> None:
    """`_delta_log` is a file, not the log folder: no table can be seen there, so inspect is Undecided with and
    without a fence, publish raises Inconclusive, and the file stays as it was."""
    path = tmp_path / "t"
    path.mkdir()
    (path / "_delta_log").write_bytes(b"not a log")
    provider = DeltaProvider()
    for fence in (None, 2):
        assert provider.inspect("K", target(path), fence=fence) == Undecided(
            f"delta inspection of key 'K': {LOCATION_MISSING}"
        )
    with pytest.raises(Inconclusive) as caught:
        provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))
    assert caught.value.message == f"delta publish of key 'K': {LOCATION_MISSING}"
    assert [p.name for p in path.iterdir()] == ["_delta_log"]
    assert (path / "_delta_log").read_bytes() == b"not a log"


def test_a_log_folder_without_a_table_is_undecided_and_no_table_is_created(tmp_path: Path) -> None:
    """`_delta_log` is there but holds no commit (emptied, or a partial restore): no table can be loaded, so
    inspect is Undecided and publish Inconclusive, naming what failed; neither creates a table in it."""
    path = tmp_path / "t"
    (path / "_delta_log").mkdir(parents=True)
    provider = DeltaProvider()
    for fence in (None, 2):
        assert provider.inspect("K", target(path), fence=fence) == Undecided(
            "delta inspection of key 'K' failed: no Delta table could be loaded at the location (TableNotFoundError)"
        )
    with pytest.raises(Inconclusive, match=r"no Delta table could be loaded at the location \(TableNotFoundError\)"):
        provider.publish("K", 1, table(), sha256_bytes(b"k"), target(path))
    assert list(path.iterdir()) == [path / "_delta_log"] and list((path / "_delta_log").iterdir()) == []
