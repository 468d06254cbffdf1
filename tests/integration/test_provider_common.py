"""The DESIGN §9 contract, proved on each real sink: Parquet folder (local, and on an S3 store), Delta table,
PostgreSQL table.

Every test reads the sink directly (the manifests and data files, the Delta log, the PostgreSQL
tables) rather than trusting the provider's answer.

Sinks never invent absence (issue 13, item 4; the last section): a location that is missing, moved,
unmounted or cannot be prepared is Undecided, never Absent, and nothing re-creates it or publishes twice.
A location recorded and then replaced: tests/integration/test_registered_locations.py; crash points around
prepare and inspect with real processes: tests/faults/test_prepare_inspect_points.py; the wrapper that
injects sink faults: tests/integration/test_provider_faults.py; discovery and input guards:
tests/unit/test_provider_contract.py.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from durable_dataflow.core import crashpoints
from durable_dataflow.core.hashing import sha256_bytes
from durable_dataflow.dataflow.protocol import reconcile, sweeper
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import contract, registry
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    Absent,
    AlreadyPublished,
    Fenced,
    Present,
    Provider,
    Published,
    PublishTarget,
    Rejected,
    Undecided,
)
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider, key_hash
from durable_dataflow.datasources.postgres_table import PostgresTableProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows

CONCURRENT_PUBLISHERS = 8
DSN_SECRET = "TEST_SINK_DSN"


def result_table(n: int = 3, offset: int = 0) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(offset, offset + n), pa.int64()),
            "region": pa.array([f"r{i}" for i in range(n)], pa.string()),
            "revenue": pa.array([Decimal(f"{i}.25") for i in range(n)], pa.decimal128(18, 2)),
        }
    )


def digest_of(label: str) -> str:
    return sha256_bytes(label.encode("utf-8"))


@dataclass
class Sink:
    """A provider, its target, and direct readers of the sink for one key."""

    provider: Provider
    target: PublishTarget
    publications: Callable[[str], int]  # how many publications of the key the sink holds
    rows: Callable[[str], int]  # how many data rows belong to the key's publications


def _parquet_sink(tmp_path: Path) -> Sink:
    folder = tmp_path / "pq_sink"
    target = PublishTarget("analytics.out", "pq_sink", "append", {"base_dir": str(tmp_path)})

    def manifests(key: str) -> list[dict[str, object]]:
        found = []
        for path in (folder / "_manifests").glob("*.json"):
            manifest = json.loads(path.read_text())
            if manifest["key"] == key and manifest["kind"] == "publication":
                found.append(manifest)
        return found

    def rows(key: str) -> int:
        return sum(pq.read_table(folder / str(m["file"])).num_rows for m in manifests(key))

    return Sink(ParquetFolderProvider(), target, lambda k: len(manifests(k)), rows)


def _parquet_s3_sink(s3: Any) -> Sink:
    """A Parquet folder on the moto S3 store (issue 31): the key's state objects and data files read with boto3."""
    client, prefix = s3.client(), "pq_sink"
    target = PublishTarget("analytics.out", s3.url(prefix), "append", s3.options())

    def states(key: str) -> list[dict[str, Any]]:
        found = client.list_objects_v2(Bucket=s3.bucket, Prefix=f"{prefix}/_dataflow/keys/").get("Contents") or []
        bodies = [json.loads(client.get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read()) for o in found]
        return [b for b in bodies if b["key"] == key and b["state"] == "published"]

    def rows(key: str) -> int:
        tables = [client.get_object(Bucket=s3.bucket, Key=f"{prefix}/{b['file']}")["Body"].read() for b in states(key)]
        return sum(pq.read_table(pa.BufferReader(data)).num_rows for data in tables)

    return Sink(ParquetFolderProvider(), target, lambda k: len(states(k)), rows)


def delta_publication_commits(table_path: Path, key: str) -> list[dict[str, int]]:
    """Read `_delta_log/*.json` directly: commits whose txn for `key` has a version >= 1, with rows."""
    commits = []
    for path in sorted((table_path / "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        txn = [a["txn"] for a in actions if "txn" in a and a["txn"]["appId"] == key]
        if txn and txn[0]["version"] >= 1:
            added = sum(json.loads(a["add"]["stats"])["numRecords"] for a in actions if "add" in a)
            commits.append({"version": int(path.stem), "rows": added})
    return commits


def _delta_sink(tmp_path: Path) -> Sink:
    target = PublishTarget("analytics.out", str(tmp_path / "delta_sink"), "append", {})

    def rows(key: str) -> int:
        return sum(c["rows"] for c in delta_publication_commits(tmp_path / "delta_sink", key))

    return Sink(
        DeltaProvider(), target, lambda k: len(delta_publication_commits(tmp_path / "delta_sink", k)), rows
    )


def _postgres_sink(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Sink:
    monkeypatch.setenv(DSN_SECRET, pg_url)
    plain = pg_url.replace("postgresql+psycopg://", "postgresql://")
    target = PublishTarget("analytics.out", "public.revenue", "append", {"dsn": {"secret": DSN_SECRET}})

    def count(query: str, key: str) -> int:
        with psycopg.connect(plain) as conn:
            exists = conn.execute("SELECT to_regclass('public.revenue')").fetchone()
            if exists is None or exists[0] is None:
                return 0
            row = conn.execute(query, (key,)).fetchone()
            return int(row[0]) if row else 0

    return Sink(
        PostgresTableProvider(),
        target,
        lambda k: count("SELECT count(*) FROM sink_publications WHERE idempotency_key = %s", k),
        lambda k: count("SELECT count(*) FROM public.revenue WHERE _publication_key = %s", k),
    )


@pytest.fixture(params=["parquet", "parquet-s3", "delta", "postgres"])
def sink(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sink]:
    """One real sink per provider, prepared as the platform prepares it before authorizing dispatch; the
    PostgreSQL one gets a fresh database from `pg_url`."""
    if request.param == "parquet":
        made = _parquet_sink(tmp_path)
    elif request.param == "parquet-s3":
        made = _parquet_s3_sink(request.getfixturevalue("s3"))
    elif request.param == "delta":
        made = _delta_sink(tmp_path)
    else:
        made = _postgres_sink(request.getfixturevalue("pg_url"), monkeypatch)
    contract.prepare(made.provider, made.target)
    yield made


def test_first_publish_then_replays_are_already_published(sink: Sink) -> None:
    """A key publishes once: replays with the same or a higher token get the same refs and digest, no rows."""
    first = sink.provider.publish("run-1/out", 1, result_table(), digest_of("a"), sink.target)
    assert isinstance(first, Published)
    assert first.digest == digest_of("a")
    for token in (1, 2, 7):
        again = sink.provider.publish("run-1/out", token, result_table(), digest_of("a"), sink.target)
        assert again == AlreadyPublished(first.refs, digest_of("a"))
    assert sink.publications("run-1/out") == 1
    assert sink.rows("run-1/out") == 3


def test_already_published_returns_the_stored_digest_not_the_callers(sink: Sink) -> None:
    """A replay with another digest gets the stored digest back, so the caller can see the mismatch."""
    sink.provider.publish("run-2/out", 1, result_table(), digest_of("stored"), sink.target)
    again = sink.provider.publish("run-2/out", 2, result_table(5), digest_of("other"), sink.target)
    assert isinstance(again, AlreadyPublished)
    assert again.digest == digest_of("stored")
    assert sink.rows("run-2/out") == 3


def test_inspect_unknown_key_is_absent_without_fence(sink: Sink) -> None:
    """Inspecting a key never published (even before the sink exists) proves Absent(None)."""
    assert sink.provider.inspect("nobody", sink.target) == Absent(None)
    assert sink.publications("nobody") == 0


def test_fence_refuses_lower_tokens_and_admits_equal_or_higher(sink: Sink) -> None:
    """Inspect with fence 3 records the fence: token 2 is Fenced with nothing written, token 3 publishes."""
    assert sink.provider.inspect("run-3/out", sink.target, fence=3) == Absent(3)
    assert sink.provider.inspect("run-3/out", sink.target) == Absent(3)
    stale = sink.provider.publish("run-3/out", 2, result_table(), digest_of("x"), sink.target)
    assert stale == Fenced(3)
    assert sink.publications("run-3/out") == 0
    assert sink.rows("run-3/out") == 0
    fresh = sink.provider.publish("run-3/out", 3, result_table(), digest_of("x"), sink.target)
    assert isinstance(fresh, Published)
    assert sink.publications("run-3/out") == 1


def test_fence_only_grows(sink: Sink) -> None:
    """A fence request below the existing fence keeps the higher one and reports it."""
    assert sink.provider.inspect("run-4/out", sink.target, fence=5) == Absent(5)
    assert sink.provider.inspect("run-4/out", sink.target, fence=2) == Absent(5)
    assert sink.provider.inspect("run-4/out", sink.target, fence=9) == Absent(9)
    assert sink.provider.publish("run-4/out", 8, result_table(), digest_of("y"), sink.target) == Fenced(9)


def test_already_published_wins_over_fenced(sink: Sink) -> None:
    """After a publication, a fenced inspection reports Present and a low-token replay gets AlreadyPublished."""
    first = sink.provider.publish("run-5/out", 4, result_table(), digest_of("z"), sink.target)
    assert isinstance(first, Published)
    found = sink.provider.inspect("run-5/out", sink.target, fence=10)
    assert found == Present(first.refs, digest_of("z"), 4)
    replay = sink.provider.publish("run-5/out", 1, result_table(), digest_of("z"), sink.target)
    assert replay == AlreadyPublished(first.refs, digest_of("z"))
    assert sink.publications("run-5/out") == 1


def test_distinct_keys_publish_independently(sink: Sink) -> None:
    """Two keys in one sink are two publications; a fence on one does not touch the other."""
    sink.provider.inspect("k-fenced", sink.target, fence=6)
    a = sink.provider.publish("k-a", 1, result_table(2), digest_of("a"), sink.target)
    b = sink.provider.publish("k-b", 1, result_table(4, offset=10), digest_of("b"), sink.target)
    assert isinstance(a, Published)
    assert isinstance(b, Published)
    assert a.refs.publication_ref != b.refs.publication_ref
    assert (sink.rows("k-a"), sink.rows("k-b"), sink.rows("k-fenced")) == (2, 4, 0)


def test_incompatible_schema_is_rejected_with_nothing_written(sink: Sink) -> None:
    """A second key whose columns do not fit the existing table is Rejected before anything is written."""
    if isinstance(sink.provider, ParquetFolderProvider):
        other = sink.provider.publish("k-x", 1, result_table(), digest_of("x"), _overwrite(sink.target))
        assert isinstance(other, Rejected)  # a folder has one file per key: only append is offered
        assert sink.publications("k-x") == 0
        return
    assert isinstance(sink.provider.publish("k-1", 1, result_table(), digest_of("1"), sink.target), Published)
    wrong = pa.table({"something_else": pa.array([1.5], pa.float64())})
    outcome = sink.provider.publish("k-2", 1, wrong, digest_of("2"), sink.target)
    assert isinstance(outcome, Rejected)
    assert sink.publications("k-2") == 0
    assert sink.provider.inspect("k-2", sink.target) == Absent(None)


def _overwrite(target: PublishTarget) -> PublishTarget:
    return PublishTarget(target.datasource, target.location, "overwrite", target.options)


def test_concurrent_publishers_on_one_key_publish_once(sink: Sink) -> None:
    """8 threads publish one key at once (a barrier releases them): exactly one Published, the rest AlreadyPublished."""
    barrier = threading.Barrier(CONCURRENT_PUBLISHERS)

    def publish(token: int) -> object:
        barrier.wait()
        return sink.provider.publish("race/out", token, result_table(), digest_of("r"), sink.target)

    with ThreadPoolExecutor(CONCURRENT_PUBLISHERS) as pool:
        outcomes = list(pool.map(publish, range(1, CONCURRENT_PUBLISHERS + 1)))
    published = [o for o in outcomes if isinstance(o, Published)]
    already = [o for o in outcomes if isinstance(o, AlreadyPublished)]
    assert len(published) == 1, outcomes
    assert len(already) == CONCURRENT_PUBLISHERS - 1, outcomes
    assert all(o.refs == published[0].refs and o.digest == digest_of("r") for o in already)
    assert sink.publications("race/out") == 1
    assert sink.rows("race/out") == 3


def test_concurrent_fence_and_stale_publisher_never_both_win(sink: Sink) -> None:
    """A fencing inspection (fence 5) races token-2 publishers: either Present, or Absent(5) and nothing written."""
    barrier = threading.Barrier(CONCURRENT_PUBLISHERS)

    def act(i: int) -> object:
        barrier.wait()
        if i == 0:
            return sink.provider.inspect("fence-race", sink.target, fence=5)
        return sink.provider.publish("fence-race", 2, result_table(), digest_of("f"), sink.target)

    with ThreadPoolExecutor(CONCURRENT_PUBLISHERS) as pool:
        outcomes = list(pool.map(act, range(CONCURRENT_PUBLISHERS)))
    inspection = outcomes[0]
    if isinstance(inspection, Absent):
        assert inspection.fenced_at == 5
        assert all(isinstance(o, Fenced) for o in outcomes[1:]), outcomes
        assert sink.publications("fence-race") == 0
    else:
        assert isinstance(inspection, Present), outcomes
        assert sink.publications("fence-race") == 1
    assert sum(isinstance(o, Published) for o in outcomes) == sink.publications("fence-race")


def test_key_hash_is_injective_for_lookalike_keys(tmp_path: Path) -> None:
    """Keys that differ only in path-like characters get distinct manifests (sha256 file names)."""
    provider = ParquetFolderProvider()
    target = PublishTarget("d", str(tmp_path / "f"), "append", {})
    contract.prepare(provider, target)  # as the platform does before authorizing dispatch
    for key in ("a/b", "a_b", "../a/b", "a\\b"):
        assert isinstance(provider.publish(key, 1, result_table(1), digest_of(key), target), Published)
    assert len({key_hash(k) for k in ("a/b", "a_b", "../a/b", "a\\b")}) == 4
    assert len(list((tmp_path / "f" / "_manifests").glob("*.json"))) == 4


@pytest.mark.parametrize("name", ["parquet", "delta"])
def test_a_sink_folder_removed_after_authorization_is_not_recreated_by_the_run(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """End to end: the platform prepares the folder and authorizes dispatch, then the folder goes missing before
    the provider call. The publish is Inconclusive, so the run is outcome_unknown; the folder is not re-created
    and nothing is published; an inspection of it stays Undecided."""
    sink = tmp_path / "sink"

    def remove_the_sink(point: str) -> None:
        if point == crashpoints.AFTER_PREDISPATCH_COMMIT:
            shutil.rmtree(sink)

    crashpoints.set_hook(remove_the_sink)
    try:
        defn = flows.definition(flows.parquet_target(name))
        run = platform.runs.run_inline(flows.request(defn, tmp_path, "k1")).run
    finally:
        crashpoints.set_hook(None)
    assert run.status == "outcome_unknown"
    assert run.error_message and contract.LOCATION_MISSING in run.error_message
    assert str(tmp_path) not in run.error_message
    assert "dispatch.authorized" in flows.kinds(platform, run.run_id)
    assert not sink.exists()
    target = PublishTarget("analytics.totals", "sink", "append", {"base_dir": str(tmp_path)})
    provider: Provider = ParquetFolderProvider() if name == "parquet" else DeltaProvider()
    found = provider.inspect("any", target, fence=2)
    assert isinstance(found, Undecided) and found.reason.endswith(contract.LOCATION_MISSING)
    assert not sink.exists()


# ---- sinks never invent absence (issue 13, item 4) -------------------------------------------------------
# The platform prepares the sink location before it authorizes dispatch (a file sink's folder, a Delta table, a
# PostgreSQL sink's record tables), and an inspection of a location that is missing, or that cannot be the
# prepared one (an empty folder where the Delta table was: an unmounted mount point), is Undecided and creates
# nothing.


FILE_PROVIDERS: dict[str, type[ParquetFolderProvider | DeltaProvider]] = {
    "parquet": ParquetFolderProvider,
    "delta": DeltaProvider,
}


def _run(platform: Platform, tmp_path: Path, provider: str) -> Run:
    defn = flows.definition(flows.parquet_target(provider))
    return platform.runs.run_inline(flows.request(defn, tmp_path, "k1")).run


def _reconcile(platform: Platform, run_id: str, *, resume: bool = False) -> reconcile.Reconciliation:
    access = AccessContext("acme", "tester", ("operator",), (), "test")
    return reconcile.reconcile(
        platform.runs, run_id, access=access, provenance=Provenance("tester", "cli"), resume=resume
    )


def _publications(name: str, sink: Path) -> int:
    return len(flows.manifests(sink)) if name == "parquet" else len(flows.delta_publications(sink))


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
@pytest.mark.parametrize("fence", [None, 3])
def test_inspecting_a_missing_location_is_undecided_and_creates_nothing(
    tmp_path: Path, name: str, fence: int | None
) -> None:
    """A file sink's inspection of a location that does not exist (never prepared, or moved away after it was)
    answers Undecided with the fixed reason, with or without a fence, and the location is still missing after."""
    provider = FILE_PROVIDERS[name]()
    target = PublishTarget("ds", "sink", "append", {"base_dir": str(tmp_path)})
    found = provider.inspect("k", target, fence=fence)
    assert isinstance(found, Undecided) and found.reason.endswith(LOCATION_MISSING)
    assert list(tmp_path.iterdir()) == []
    provider.prepare(target)
    assert provider.inspect("k", target, fence=fence).__class__.__name__ == "Absent"
    (tmp_path / "sink").rename(tmp_path / "moved")
    found = provider.inspect("k", target, fence=fence)
    assert isinstance(found, Undecided) and found.reason.endswith(LOCATION_MISSING)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moved"]


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_a_moved_sink_folder_is_undecided_and_never_published_twice(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """The issue's experiment: the sink commits, the answer is lost (outcome_unknown), the sink folder is moved away.
    Reconcile is undecided (not absent), resume re-dispatches nothing and creates no folder; with the folder back,
    reconcile finds the publication present: the sink holds exactly one publication of the key."""
    faulty = FaultInjectingProvider(FILE_PROVIDERS[name](), "timeout_after_commit")
    registry.register_provider("faulty", lambda: faulty)
    run = _run(platform, tmp_path, "faulty")
    assert run.status == "outcome_unknown"
    sink, moved = tmp_path / "sink", tmp_path / "moved"
    sink.rename(moved)
    undecided = _reconcile(platform, run.run_id)
    assert undecided.finding == "undecided" and LOCATION_MISSING in undecided.detail
    assert (undecided.run.status, undecided.run.recovery_status) == ("outcome_unknown", "outcome_unknown")
    resumed = _reconcile(platform, run.run_id, resume=True)
    assert resumed.finding == "undecided" and not resumed.resumed
    assert not sink.exists() and faulty.counters.inner_publish_calls == 1
    moved.rename(sink)
    present = _reconcile(platform, run.run_id)
    assert present.finding == "present"
    assert (present.run.status, present.run.recovery_status) == ("succeeded", "reconciled_present")
    assert _publications(name, sink) == 1 and faulty.counters.inner_publish_calls == 1


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_a_crash_before_the_provider_call_still_reconciles_absent(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """The worker dies right after the pre-dispatch commit: the sink folder was prepared before it and holds no
    publication, so reconcile proves the key absent and a resume publishes it exactly once."""

    def die(point: str) -> None:
        if point == crashpoints.AFTER_PREDISPATCH_COMMIT:
            raise KeyboardInterrupt  # the worker dies right after authorization

    crashpoints.set_hook(die)
    with pytest.raises(KeyboardInterrupt):
        _run(platform, tmp_path, name)
    crashpoints.set_hook(None)
    sink = tmp_path / "sink"
    assert sink.is_dir() and _publications(name, sink) == 0
    flows.expire_leases(platform)
    decisions: list[Any] = sweeper.sweep(platform.db)
    assert [d.decision for d in decisions] == ["outcome_unknown"]
    absent = _reconcile(platform, decisions[0].run_id)
    assert (absent.finding, absent.run.recovery_status) == ("absent", "reconciled_absent")
    resumed = _reconcile(platform, decisions[0].run_id, resume=True)
    assert resumed.resumed and resumed.run.status == "succeeded"
    assert _publications(name, sink) == 1


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_a_location_that_cannot_be_prepared_fails_before_dispatch(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """A file where the sink folder should be: prepare cannot create the location, so the run fails with no
    external output before the pre-dispatch commit, with the OS's errno text and no path in the reason."""
    (tmp_path / "sink").write_bytes(b"not a folder")
    run = _run(platform, tmp_path, name)
    assert (run.status, run.recovery_status) == ("failed", "no_external_output")
    assert run.error_message and run.error_message.startswith("the sink location cannot be created: ")
    assert str(tmp_path) not in run.error_message
    assert "dispatch.authorized" not in flows.kinds(platform, run.run_id)
    assert (tmp_path / "sink").read_bytes() == b"not a folder"


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_an_unmounted_sink_volume_is_undecided_and_never_published_twice(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """The sink commits, the answer is lost (outcome_unknown), then the sink's volume is unmounted: the mount point
    stays behind as an empty folder. That is never "prepared, nothing published": reconcile is undecided (the
    datasource is registered, so the location existed), resume re-dispatches nothing and writes nothing into the
    empty folder; mounted again, reconcile finds the publication present, the only one of the key."""
    faulty = FaultInjectingProvider(FILE_PROVIDERS[name](), "timeout_after_commit")
    registry.register_provider("faulty", lambda: faulty)
    run = _run(platform, tmp_path, "faulty")
    assert run.status == "outcome_unknown"
    sink, volume = tmp_path / "sink", tmp_path / "volume"
    sink.rename(volume)
    sink.mkdir()  # the mount point, empty once its volume is gone
    undecided = _reconcile(platform, run.run_id)
    assert undecided.finding == "undecided" and LOCATION_MISSING in undecided.detail
    assert registry.AUTHORIZED_HERE in undecided.detail
    assert (undecided.run.status, undecided.run.recovery_status) == ("outcome_unknown", "outcome_unknown")
    resumed = _reconcile(platform, run.run_id, resume=True)
    assert resumed.finding == "undecided" and not resumed.resumed
    assert list(sink.iterdir()) == [] and faulty.counters.inner_publish_calls == 1
    sink.rmdir()
    volume.rename(sink)  # mounted again
    present = _reconcile(platform, run.run_id)
    assert (present.finding, present.run.status, present.run.recovery_status) == (
        "present", "succeeded", "reconciled_present"
    )  # fmt: skip
    assert _publications(name, sink) == 1 and faulty.counters.inner_publish_calls == 1


SINK_SECRET = "TEST_HONEST_ABSENCE_SINK_DSN"


def _postgres_record_tables(dsn: str, rename: tuple[str, str]) -> None:
    with psycopg.connect(dsn) as conn:
        for table in ("sink_publications", "sink_fences"):
            conn.execute(f"ALTER TABLE {rename[0]}{table} RENAME TO {rename[1]}{table}")


def test_a_postgres_sink_without_its_record_tables_is_undecided_and_never_published_twice(
    platform: Platform, tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PostgreSQL sink commits, the answer is lost (outcome_unknown), then the DSN reaches a database without
    the record tables (a restore from before the first run; renamed here, so they can come back). Reconcile is
    undecided, never absent, and creates no record table; resume publishes nothing; with the tables back, reconcile
    finds the publication present: the sink holds exactly one publication of the key, and its rows once."""
    monkeypatch.setenv(SINK_SECRET, pg_url)
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    faulty = FaultInjectingProvider(PostgresTableProvider(), "timeout_after_commit")
    registry.register_provider("faulty", lambda: faulty)
    target = {**flows.parquet_target("faulty", "public.totals"), "options": {"dsn": {"secret": SINK_SECRET}}}
    run = platform.runs.run_inline(flows.request(flows.definition(target), tmp_path, "k1")).run
    assert run.status == "outcome_unknown"
    _postgres_record_tables(dsn, ("", "restored_away_"))
    undecided = _reconcile(platform, run.run_id)
    assert undecided.finding == "undecided" and LOCATION_MISSING in undecided.detail
    assert registry.AUTHORIZED_HERE in undecided.detail
    resumed = _reconcile(platform, run.run_id, resume=True)
    assert resumed.finding == "undecided" and not resumed.resumed
    assert faulty.counters.inner_publish_calls == 1
    with psycopg.connect(dsn) as conn:
        created = conn.execute("SELECT to_regclass('sink_publications'), to_regclass('sink_fences')").fetchone()
    assert created == (None, None)
    _postgres_record_tables(dsn, ("restored_away_", ""))
    present = _reconcile(platform, run.run_id)
    assert (present.finding, present.run.status, present.run.recovery_status) == (
        "present", "succeeded", "reconciled_present"
    )  # fmt: skip
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM sink_publications").fetchone() == (1,)
        keys = conn.execute("SELECT count(DISTINCT _publication_key) FROM public.totals").fetchone()
    assert keys == (1,) and faulty.counters.inner_publish_calls == 1
