"""Sinks never invent absence (issue 13, item 4): the platform prepares the sink location before it
authorizes dispatch (a file sink's folder, a Delta table, a PostgreSQL sink's record tables), and an
inspection of a location that is missing, or that cannot be the prepared one (an empty folder where the
Delta table was: an unmounted mount point), is Undecided and creates nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from durable_dataflow.core import crashpoints
from durable_dataflow.dataflow.protocol import reconcile, sweeper
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import LOCATION_MISSING, PublishTarget, Undecided
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider
from durable_dataflow.datasources.postgres_table import PostgresTableProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows

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
    platform.db.advance_clock(6)
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
