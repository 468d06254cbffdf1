"""Parquet-folder specifics: the manifest is the commit point, orphans are cleaned, locations are confined."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from durable_dataflow.core.errors import InputError
from durable_dataflow.core.hashing import sha256_bytes
from durable_dataflow.datasources import parquet_folder
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    Absent,
    Inconclusive,
    Location,
    Present,
    PublicationRefs,
    Published,
    PublishTarget,
    Rejected,
    Undecided,
)
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider, key_hash


def rows(n: int) -> pa.Table:
    return pa.table({"id": pa.array(range(n), pa.int64())})


def prepared(target: PublishTarget) -> PublishTarget:
    """The target with its folder layout created, as the platform does before authorizing dispatch."""
    ParquetFolderProvider().prepare(target)
    return target


def test_data_file_without_manifest_is_not_published_and_is_replaced(tmp_path: Path) -> None:
    """A crash left data/<h>.parquet and a temp file but no manifest: Absent, and the next publish replaces them."""
    target = PublishTarget("d", str(tmp_path / "f"), "append", {})
    provider = ParquetFolderProvider()
    provider.prepare(target)  # creates the folder layout, as before any dispatch
    provider.inspect("k", target, fence=1)
    stem = key_hash("k")
    pq.write_table(rows(99), tmp_path / "f" / "data" / f"{stem}.parquet")
    (tmp_path / "f" / "data" / f".{stem}.dead.tmp").write_bytes(b"partial")
    assert provider.inspect("k", target) == Absent(1)
    assert isinstance(provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target), Published)
    assert pq.read_table(tmp_path / "f" / "data" / f"{stem}.parquet").num_rows == 2
    assert not list((tmp_path / "f" / "data").glob("*.tmp"))
    assert provider.read(target).num_rows == 2


def test_manifest_write_failure_is_inconclusive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If writing the manifest (the commit point) fails, publish raises Inconclusive rather than guessing."""
    target = prepared(PublishTarget("d", str(tmp_path / "f"), "append", {}))
    provider = ParquetFolderProvider()

    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(provider, "_write_manifest", fail)
    with pytest.raises(Inconclusive, match="manifest"):
        provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target)


def test_data_write_failure_before_the_commit_point_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure while writing the data file (before the manifest) is a conclusive Rejected; the key stays absent."""
    target = prepared(PublishTarget("d", str(tmp_path / "f"), "append", {}))
    provider = ParquetFolderProvider()

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(parquet_folder.pq, "write_table", fail)
    assert isinstance(provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target), Rejected)
    assert provider.inspect("k", target) == Absent(None)


def test_manifest_records_key_digest_token_rows_and_file(tmp_path: Path) -> None:
    """The manifest holds the key itself (names are hashes), the digest, the token, the row count and the file."""
    target = prepared(PublishTarget("d", "f", "append", {"base_dir": str(tmp_path)}))
    ParquetFolderProvider().publish("tenant/run 1", 3, rows(4), sha256_bytes(b"x"), target)
    manifest = json.loads((tmp_path / "f" / "_manifests" / f"{key_hash('tenant/run 1')}.json").read_text())
    assert {k: manifest[k] for k in ("kind", "key", "digest", "token", "rows")} == {
        "kind": "publication",
        "key": "tenant/run 1",
        "digest": sha256_bytes(b"x"),
        "token": 3,
        "rows": 4,
    }
    assert (tmp_path / "f" / manifest["file"]).is_file()


def test_location_traversal_is_refused(tmp_path: Path) -> None:
    """A relative location that climbs out of base_dir is InputError for publish and inspect alike."""
    target = PublishTarget("d", "../../etc", "append", {"base_dir": str(tmp_path)})
    with pytest.raises(InputError):
        ParquetFolderProvider().publish("k", 1, rows(1), sha256_bytes(b"k"), target)
    with pytest.raises(InputError):
        ParquetFolderProvider().inspect("k", target, fence=2)


def test_refs_name_a_relative_location_relative_to_the_sink_root(tmp_path: Path) -> None:
    """Refs of a relative location never carry base_dir (the server's sink root); publish and inspect agree.
    An absolute location (the local operator's) is named by its absolute path."""
    stem = key_hash("k")
    relative = prepared(PublishTarget("d", "./out/f/", "append", {"base_dir": str(tmp_path)}))
    published = ParquetFolderProvider().publish("k", 1, rows(2), sha256_bytes(b"k"), relative)
    assert isinstance(published, Published)
    assert published.refs == PublicationRefs(
        f"parquet://out/f/_manifests/{stem}.json", "parquet://out/f", f"parquet://out/f/data/{stem}.parquet"
    )
    assert ParquetFolderProvider().inspect("k", relative, fence=2) == Present(published.refs, sha256_bytes(b"k"), 1)
    root = prepared(PublishTarget("d", ".", "append", {"base_dir": str(tmp_path)}))
    at_root = ParquetFolderProvider().publish("k", 1, rows(1), sha256_bytes(b"r"), root)
    assert isinstance(at_root, Published) and at_root.refs.datasource_ref == "parquet://."
    absolute = prepared(PublishTarget("d", str(tmp_path / "abs"), "append", {}))
    named = ParquetFolderProvider().publish("k", 1, rows(1), sha256_bytes(b"a"), absolute)
    assert isinstance(named, Published) and named.refs.datasource_ref == f"parquet://{tmp_path / 'abs'}"


def test_failure_reasons_carry_no_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError's filename and a library's message never reach a reason: a fixed description, the type and
    the OS's text for the errno. Rejected still means nothing was created."""
    target = prepared(PublishTarget("d", "f", "append", {"base_dir": str(tmp_path)}))
    provider = ParquetFolderProvider()

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "f" / "data" / "x.tmp"))

    def arrow_says(*args: object, **kwargs: object) -> None:
        raise pa.ArrowInvalid(f"cannot write {tmp_path}/f/data/x.tmp")

    monkeypatch.setattr(parquet_folder.pq, "write_table", no_space)
    rejected = provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target)
    assert rejected == Rejected(
        "writing the data file failed before the commit point: OSError: No space left on device"
    )
    monkeypatch.setattr(parquet_folder.pq, "write_table", arrow_says)
    assert provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target) == Rejected(
        "writing the data file failed before the commit point: ArrowInvalid"
    )
    assert provider.inspect("k", target) == Absent(None)
    monkeypatch.undo()
    monkeypatch.setattr(provider, "_write_manifest", no_space)
    with pytest.raises(Inconclusive) as caught:
        provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target)
    assert caught.value.message == "writing the manifest of key 'k' failed: OSError: No space left on device"
    monkeypatch.undo()
    (tmp_path / "f" / "_manifests" / f"{key_hash('k')}.json").write_text("{not json")
    inspected = provider.inspect("k", target)
    assert isinstance(inspected, Undecided) and str(tmp_path) not in inspected.reason
    assert inspected.reason == f"parquet inspection of key 'k' failed: manifest {key_hash('k')}.json is not valid JSON"
    with pytest.raises(Inconclusive, match="is not valid JSON") as unreadable:
        provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target)
    assert str(tmp_path) not in unreadable.value.message


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize("removed", [".", "_manifests"], ids=["folder", "manifests"])
def test_publish_to_a_prepared_folder_that_went_missing_is_inconclusive_and_creates_nothing(
    tmp_path: Path, removed: str
) -> None:
    """The folder (or its `_manifests`) was prepared, nothing was published, then it went missing (moved away,
    unmounted): publish cannot tell that from a folder holding an earlier publication, so it raises Inconclusive
    naming the missing location (no path), writes nothing and does not re-create it; inspect stays Undecided."""
    target = prepared(PublishTarget("d", "f", "append", {"base_dir": str(tmp_path)}))
    provider = ParquetFolderProvider()
    gone = (tmp_path / "f" / removed).resolve()
    shutil.rmtree(gone)
    before = _tree(tmp_path)
    with pytest.raises(Inconclusive) as caught:
        provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target)
    assert caught.value.message == f"parquet publish of key 'k': {LOCATION_MISSING}"
    assert str(tmp_path) not in caught.value.message
    assert not gone.exists() and _tree(tmp_path) == before
    for fence in (None, 2):
        found = provider.inspect("k", target, fence=fence)
        assert isinstance(found, Undecided) and found.reason.endswith(LOCATION_MISSING)
    assert not gone.exists() and _tree(tmp_path) == before


def test_a_moved_folder_holding_the_publication_is_never_published_twice(tmp_path: Path) -> None:
    """The key is published, the folder is moved away: a second publish of the key is Inconclusive (it cannot see
    the publication, so it must not make another), and with the folder back the sink holds exactly one."""
    target = prepared(PublishTarget("d", "f", "append", {"base_dir": str(tmp_path)}))
    provider = ParquetFolderProvider()
    first = provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target)
    assert isinstance(first, Published)
    (tmp_path / "f").rename(tmp_path / "moved")
    with pytest.raises(Inconclusive, match="the sink location is missing"):
        provider.publish("k", 2, rows(2), sha256_bytes(b"k"), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moved"]
    (tmp_path / "moved").rename(tmp_path / "f")
    assert provider.inspect("k", target) == Present(first.refs, sha256_bytes(b"k"), 1)
    assert len(list((tmp_path / "f" / "_manifests").glob("*.json"))) == 1
    assert provider.read(target).num_rows == 2


def test_a_folder_caught_half_prepared_never_reads_as_another_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a concurrent first run of a datasource, which locates the folder while another run prepares
    it, never sees a folder laid out before markers (``occupied``: it then failed ``location_missing``,
    found by CI with two forward runs of one target on two threads): located at every step of preparing
    (each directory made, the marker linked), the folder is either nothing yet or the marker's identity,
    and a second preparer completes it to the same identity."""
    target = PublishTarget("d", str(tmp_path / "f"), "append", {})
    provider = ParquetFolderProvider()
    seen: list[Location] = []
    real_mkdir, real_link = Path.mkdir, parquet_folder.os.link

    def mkdir(self: Path, *args: object, **kwargs: object) -> None:
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]
        seen.append(provider.locate(target))

    def link(source: object, destination: object) -> None:
        seen.append(provider.locate(target))
        real_link(source, destination)  # type: ignore[arg-type]
        seen.append(provider.locate(target))

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(parquet_folder.os, "link", link)
    provider.prepare(target)
    monkeypatch.undo()
    done = provider.locate(target)
    assert done.identity is not None and len(seen) >= 5
    assert all(not found.occupied and found.identity in (None, done.identity) for found in seen), seen
    provider.prepare(target)  # a second preparer (the concurrent run) completes nothing new
    assert provider.locate(target) == done
