"""A registered location that went missing is never created again (issue 26, finding 1).

The reproduction: run A publishes and its answer is lost (outcome_unknown); the sink location is moved
away (a volume not mounted); run B of the same datasource would have re-created it empty, and a reconcile
of A would then have proven A's key absent there and published it a second time. Now every provider's
location is recorded where it was first prepared, with the provider's own identity of it (a Parquet
folder's marker, a Delta table's id, the PostgreSQL record tables' system identifier and oids): B fails
before dispatch (`failed / no_external_output`, `location_missing`) and A's reconcile stays undecided,
for a missing location and for one replaced by another folder or table, until the location is back or the
platform operator forgets it. Runs from different base directories keep their own places.

The last section holds the ways the first fix left open (a FIFO marker, a Delta log without a first
commit, a run authorized before locations were recorded, a datasource name that is no text).

`dataflow datasources forget` and a missing location as real processes: tests/acceptance/test_cli_datasources.py;
sinks never inventing absence for a location that is missing: tests/integration/test_provider_common.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from durable_dataflow.core import ledger
from durable_dataflow.dataflow.protocol import reconcile
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, asked_by
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    AlreadyPublished,
    InspectOutcome,
    Present,
    PublicationRefs,
    Published,
    PublishOutcome,
    PublishTarget,
)
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.parquet_folder import MARKER, ParquetFolderProvider
from durable_dataflow.datasources.postgres_table import PostgresTableProvider
from durable_dataflow.datasources.schema import datasource_locations, datasources
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows
from support.cli import make_cli

FILE_PROVIDERS: dict[str, type[ParquetFolderProvider | DeltaProvider]] = {
    "parquet": ParquetFolderProvider,
    "delta": DeltaProvider,
}
OPERATOR = AccessContext("acme", "ops-alice", ("operator",), (), "test")


def _run(platform: Platform, base_dir: Path, provider: str, key: str, target: dict[str, Any] | None = None) -> Run:
    defn = flows.definition(target or flows.parquet_target(provider))
    return platform.runs.run_inline(flows.request(defn, base_dir, key)).run


def _reconcile(platform: Platform, run_id: str, *, resume: bool = False) -> reconcile.Reconciliation:
    return reconcile.reconcile(
        platform.runs, run_id, access=OPERATOR, provenance=Provenance("ops-alice", "cli"), resume=resume
    )


def _publications(name: str, sink: Path) -> int:
    return len(flows.manifests(sink)) if name == "parquet" else len(flows.delta_publications(sink))


def _forget(platform: Platform, tenant: str = "acme") -> int:
    with platform.db.begin() as conn:
        return registry.forget_locations(
            conn, platform.db, tenant, "analytics.totals", asked_by(OPERATOR, Provenance("ops-alice", "cli")),
            evidence_key=platform.runs.config.evidence_key,
        )  # fmt: skip


def _assert_refused(run: Run, tmp_path: Path, created_by: str, what: str) -> None:
    assert (run.status, run.recovery_status, run.error_code) == ("failed", "no_external_output", "location_missing")
    assert run.error_message is not None and "'analytics.totals'" in run.error_message
    assert f"was created at this location by run {created_by}" in run.error_message
    assert what in run.error_message
    assert str(tmp_path) not in run.error_message and "sink" not in run.error_message.replace("sink location", "")


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_a_missing_registered_location_is_never_recreated_and_never_proven_absent(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """The issue's reproduction on a file sink: A's answer is lost, its folder moved away. B fails before dispatch
    without re-creating the folder, A's reconcile (and resume) stays undecided with the same reason; with the
    folder back A is present, B's key publishes there, and each key is in the sink exactly once."""
    faulty = FaultInjectingProvider(FILE_PROVIDERS[name](), "timeout_after_commit", fail_times=1)
    registry.register_provider("faulty", lambda: faulty)
    run_a = _run(platform, tmp_path, "faulty", "A")
    assert run_a.status == "outcome_unknown"
    sink, moved = tmp_path / "sink", tmp_path / "moved"
    sink.rename(moved)

    run_b = _run(platform, tmp_path, "faulty", "B")
    _assert_refused(run_b, tmp_path, run_a.run_id, LOCATION_MISSING)
    assert not sink.exists(), "the registered location was created again"
    assert "dispatch.authorized" not in flows.kinds(platform, run_b.run_id)

    undecided = _reconcile(platform, run_a.run_id, resume=True)
    assert (undecided.finding, undecided.resumed) == ("undecided", False)
    assert registry.AUTHORIZED_HERE in undecided.detail and LOCATION_MISSING in undecided.detail
    assert (undecided.run.status, undecided.run.recovery_status) == ("outcome_unknown", "outcome_unknown")
    assert not sink.exists() and faulty.counters.inner_publish_calls == 1

    moved.rename(sink)
    present = _reconcile(platform, run_a.run_id)
    assert (present.finding, present.run.status) == ("present", "succeeded")
    assert _run(platform, tmp_path, "faulty", "C").status == "succeeded"
    assert _publications(name, sink) == 2 and faulty.counters.inner_publish_calls == 2


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_a_registered_location_replaced_by_another_is_never_published_into_or_inspected(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """A's folder is moved away and another one is made in its place (by hand, by another tool, or by an
    earlier version of this platform): it is not the one A may have published to. B fails naming a replaced
    location; A's reconcile is undecided and writes no fence into the new one."""
    faulty = FaultInjectingProvider(FILE_PROVIDERS[name](), "timeout_after_commit", fail_times=1)
    registry.register_provider("faulty", lambda: faulty)
    run_a = _run(platform, tmp_path, "faulty", "A")
    assert run_a.status == "outcome_unknown"
    sink = tmp_path / "sink"
    sink.rename(tmp_path / "moved")
    FILE_PROVIDERS[name]().prepare(PublishTarget("analytics.totals", "sink", "append", {"base_dir": str(tmp_path)}))
    before = sorted(p.relative_to(sink).as_posix() for p in sink.rglob("*"))

    run_b = _run(platform, tmp_path, "faulty", "B")
    _assert_refused(run_b, tmp_path, run_a.run_id, f"another {'folder' if name == 'parquet' else 'table'} is there")
    undecided = _reconcile(platform, run_a.run_id, resume=True)
    assert (undecided.finding, undecided.resumed) == ("undecided", False)
    assert "another" in undecided.detail and "is there now" in undecided.detail
    assert sorted(p.relative_to(sink).as_posix() for p in sink.rglob("*")) == before, "the new location was written"
    assert _publications(name, sink) == 0 and faulty.counters.inner_publish_calls == 1


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_runs_from_two_base_directories_each_create_their_own_location(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """Local runs of one definition from two folders resolve one location to two places: each is created and
    recorded by its first run, and moving one away refuses runs there only."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    assert _run(platform, here, name, "h1").status == "succeeded"
    assert _run(platform, there, name, "t1").status == "succeeded"
    assert _publications(name, here / "sink") == 1 and _publications(name, there / "sink") == 1
    with platform.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(datasource_locations)).scalar_one() == 2
    (here / "sink").rename(here / "away")
    assert _run(platform, here, name, "h2").error_code == "location_missing"
    assert _run(platform, there, name, "t2").status == "succeeded"
    assert not (here / "sink").exists()


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_forgetting_a_datasource_lets_the_next_run_create_it_and_is_recorded_with_who_asked(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """Only the platform operator's forget ends the refusal: it deletes the recorded places, is recorded in the
    ledger with who asked, and the next run creates the location afresh."""
    assert _run(platform, tmp_path, name, "k1").status == "succeeded"
    (tmp_path / "sink").rename(tmp_path / "lost")
    assert _run(platform, tmp_path, name, "k2").error_code == "location_missing"
    assert _forget(platform) == 1
    assert _run(platform, tmp_path, name, "k3").status == "succeeded"
    assert _publications(name, tmp_path / "sink") == 1
    with platform.db.read() as conn:
        entries = ledger.read(conn, registry.LEDGER_MODULE, registry.ledger_subject("acme", "analytics.totals"))
    assert [e.kind for e in entries] == [registry.LOCATIONS_FORGOTTEN]
    payload = entries[0].payload
    assert (payload["tenant"], payload["datasource"], payload["places_forgotten"]) == ("acme", "analytics.totals", 1)
    assert payload["principal"] == "ops-alice" and payload["provenance"]["actor"] == "ops-alice"


def _as_registered_before_locations_were_recorded(platform: Platform) -> None:
    """What migration 0010 leaves of a datasource a run registered before 0008: no recorded place, marked."""
    where = sa.and_(datasources.c.tenant == "acme", datasources.c.name == "analytics.totals")
    with platform.db.begin() as conn:
        conn.execute(sa.delete(datasource_locations).where(
            datasource_locations.c.tenant == "acme", datasource_locations.c.name == "analytics.totals"
        ))  # fmt: skip
        conn.execute(sa.update(datasources).where(where).values(locations_unrecorded=True))


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_a_datasource_registered_before_locations_were_recorded_is_not_created_where_nothing_is_found(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """The upgrade path: A's answer was lost under a version that recorded no locations, and its folder is not
    mounted when the upgraded platform runs B. B is refused before dispatch without creating the folder, A stays
    undecided; with the folder back B's run records it as found and publishes; a folder at another base directory
    is refused too until the platform operator forgets the datasource, after which it is created."""
    faulty = FaultInjectingProvider(FILE_PROVIDERS[name](), "timeout_after_commit", fail_times=1)
    registry.register_provider("faulty", lambda: faulty)
    run_a = _run(platform, tmp_path, "faulty", "A")
    assert run_a.status == "outcome_unknown"
    _as_registered_before_locations_were_recorded(platform)
    sink, moved = tmp_path / "sink", tmp_path / "moved"
    sink.rename(moved)

    run_b = _run(platform, tmp_path, "faulty", "B")
    assert (run_b.status, run_b.recovery_status) == ("failed", "no_external_output")
    assert run_b.error_code == "location_missing" and run_b.error_message is not None
    assert f"was registered by run {run_a.run_id} before" in run_b.error_message
    assert str(tmp_path) not in run_b.error_message
    assert not sink.exists(), "a location of a datasource registered before locations were recorded was created"
    undecided = _reconcile(platform, run_a.run_id)
    assert undecided.finding == "undecided" and not sink.exists()

    moved.rename(sink)
    if name == "parquet":
        (sink / MARKER).unlink()  # laid out before folders carried a marker: there all the same
    assert _run(platform, tmp_path, "faulty", "C").status == "succeeded"
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert _run(platform, other, "faulty", "D").error_code == "location_missing"
    assert not (other / "sink").exists()
    _forget(platform)
    assert _run(platform, other, "faulty", "E").status == "succeeded"
    assert _publications(name, sink) == 2 and _publications(name, other / "sink") == 1  # A's and C's; E's


def test_forgetting_a_datasource_the_tenant_never_registered_is_not_found(platform: Platform) -> None:
    with pytest.raises(registry.NotFound):
        _forget(platform, tenant="other")


SINK_SECRET = "TEST_REGISTERED_LOCATIONS_SINK_DSN"


def _rename_record_tables(dsn: str, rename: tuple[str, str]) -> None:
    with psycopg.connect(dsn) as conn:
        for table in ("sink_publications", "sink_fences"):
            conn.execute(f"ALTER TABLE {rename[0]}{table} RENAME TO {rename[1]}{table}")


def test_a_postgres_sink_whose_record_tables_went_missing_or_were_replaced_refuses_new_runs(
    platform: Platform, tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PostgreSQL sink: A's answer is lost, then the record tables are gone from the database the DSN reaches
    (renamed here; a restore from before them). B fails before dispatch and creates no record table; with new,
    empty record tables in their place (another oid), B still fails and A's reconcile inspects nothing; with the
    original tables back, A is present and B's key publishes."""
    monkeypatch.setenv(SINK_SECRET, pg_url)
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    faulty = FaultInjectingProvider(PostgresTableProvider(), "timeout_after_commit", fail_times=1)
    registry.register_provider("faulty", lambda: faulty)
    target = {**flows.parquet_target("faulty", "public.totals"), "options": {"dsn": {"secret": SINK_SECRET}}}
    run_a = _run(platform, tmp_path, "faulty", "A", target)
    assert run_a.status == "outcome_unknown"
    _rename_record_tables(dsn, ("", "away_"))

    run_b = _run(platform, tmp_path, "faulty", "B", target)
    _assert_refused(run_b, tmp_path, run_a.run_id, LOCATION_MISSING)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('sink_publications'), to_regclass('sink_fences')").fetchone() == (
            None, None
        )  # fmt: skip
    undecided = _reconcile(platform, run_a.run_id)
    assert undecided.finding == "undecided" and registry.AUTHORIZED_HERE in undecided.detail

    PostgresTableProvider().prepare(
        PublishTarget("analytics.totals", "public.totals", "append", {"dsn": {"secret": SINK_SECRET}})
    )
    run_c = _run(platform, tmp_path, "faulty", "C", target)
    _assert_refused(run_c, tmp_path, run_a.run_id, "another table is there")
    undecided = _reconcile(platform, run_a.run_id, resume=True)
    assert (undecided.finding, undecided.resumed) == ("undecided", False)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM sink_fences").fetchone() == (0,), "the new record tables were fenced"
        conn.execute("DROP TABLE sink_publications, sink_fences")
    _rename_record_tables(dsn, ("away_", ""))

    present = _reconcile(platform, run_a.run_id)
    assert (present.finding, present.run.status) == ("present", "succeeded")
    assert _run(platform, tmp_path, "faulty", "D", target).status == "succeeded"
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM sink_publications").fetchone() == (2,)
        assert conn.execute("SELECT count(DISTINCT _publication_key) FROM public.totals").fetchone() == (2,)


class _NoDatasourceRef:
    """A provider that publishes through Parquet but answers with an empty datasource reference."""

    name = "parquet"
    capabilities = ParquetFolderProvider.capabilities

    def __init__(self) -> None:
        self.inner = ParquetFolderProvider()

    @staticmethod
    def _strip(refs: PublicationRefs) -> PublicationRefs:
        return PublicationRefs(refs.publication_ref, "", refs.materialization_ref)

    def prepare(self, target: PublishTarget) -> None:
        self.inner.prepare(target)

    def publish(self, key: str, token: int, table: Any, digest: str, target: PublishTarget) -> PublishOutcome:
        outcome = self.inner.publish(key, token, table, digest, target)
        if isinstance(outcome, Published | AlreadyPublished):
            return type(outcome)(self._strip(outcome.refs), outcome.digest)
        return outcome

    def inspect(self, key: str, target: PublishTarget, fence: int | None = None) -> InspectOutcome:
        found = self.inner.inspect(key, target, fence)
        return Present(self._strip(found.refs), found.digest, found.token) if isinstance(found, Present) else found


def test_success_needs_all_three_references(platform: Platform, tmp_path: Path) -> None:
    """Finding 4: a provider answering without a datasource reference never commits success, neither by its
    publish answer nor by a reconcile that finds the key present: the run is left unresolved (evidence_failed)."""
    registry.register_provider("faulty", _NoDatasourceRef)
    run = _run(platform, tmp_path, "faulty", "k1")
    assert (run.status, run.recovery_status) == ("evidence_failed", "evidence_failed")
    assert run.datasource_ref is None and "datasource_ref" in str(run.error_message)
    again = _reconcile(platform, run.run_id)
    assert again.run.status != "succeeded" and again.run.recovery_status != "reconciled_present"
    assert "dataflow.succeeded" not in flows.kinds(platform, run.run_id)
    assert "run.succeeded" not in flows.kinds(platform, run.run_id)


def test_a_postgres_sink_role_that_is_no_superuser_can_locate_its_record_tables(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The identity reads pg_control_system() and the catalogs: an ordinary role that may create tables in its
    schema (what a sink role is) gets it, and a replacement of the record tables changes it."""
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE ROLE sink_writer LOGIN NOSUPERUSER")
        conn.execute("GRANT CREATE, USAGE ON SCHEMA public TO sink_writer")
    monkeypatch.setenv(SINK_SECRET, psycopg.conninfo.make_conninfo(dsn, user="sink_writer"))
    provider = PostgresTableProvider()
    target = PublishTarget("analytics.totals", "public.totals", "append", {"dsn": {"secret": SINK_SECRET}})
    assert provider.locate(target).identity is None
    provider.prepare(target)
    first = provider.locate(target)
    assert first.identity is not None and first.identity.startswith("postgres-records:")
    assert first.place.endswith("/public.totals") and provider.locate(target) == first
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE sink_publications, sink_fences")
    provider.prepare(target)
    assert provider.locate(target).identity not in (None, first.identity)


def test_a_postgres_run_whose_dsn_now_reaches_another_database_is_never_proven_absent_there(
    platform: Platform, tmp_path: Path, pg_url: str, postgres_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's answer is lost; then the DSN secret is pointed at another database (a failover to an empty replica,
    an edited secret). A run there is a new place (it creates its record tables and publishes), but A's reconcile
    holds A to the location its dispatch was authorized at: undecided, nothing fenced in the new database; with
    the secret back, A is present."""
    monkeypatch.setenv(SINK_SECRET, pg_url)
    faulty = FaultInjectingProvider(PostgresTableProvider(), "timeout_after_commit", fail_times=1)
    registry.register_provider("faulty", lambda: faulty)
    target = {**flows.parquet_target("faulty", "public.totals"), "options": {"dsn": {"secret": SINK_SECRET}}}
    run_a = _run(platform, tmp_path, "faulty", "A", target)
    assert run_a.status == "outcome_unknown"
    other = postgres_server.create_database("registered_locations_other")
    try:
        monkeypatch.setenv(SINK_SECRET, other)
        assert _run(platform, tmp_path, "faulty", "B", target).status == "succeeded"
        undecided = _reconcile(platform, run_a.run_id, resume=True)
        assert (undecided.finding, undecided.resumed) == ("undecided", False)
        assert "resolves to another place than the one its dispatch was authorized at" in undecided.detail
        with psycopg.connect(other.replace("postgresql+psycopg://", "postgresql://")) as conn:
            assert conn.execute("SELECT count(*) FROM sink_fences").fetchone() == (0,)
            assert conn.execute("SELECT count(*) FROM sink_publications").fetchone() == (1,)
    finally:
        monkeypatch.setenv(SINK_SECRET, pg_url)
        postgres_server.drop_database("registered_locations_other")
    present = _reconcile(platform, run_a.run_id)
    assert (present.finding, present.run.status) == ("present", "succeeded")


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_a_file_target_that_now_resolves_elsewhere_is_never_proven_absent_there(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """A's folder is swapped for a symlink to another prepared folder inside the sink root: the location as
    written is the same, the place it resolves to is not the one A's dispatch was authorized at. Reconcile is
    undecided and writes nothing into the other folder."""
    faulty = FaultInjectingProvider(FILE_PROVIDERS[name](), "timeout_after_commit", fail_times=1)
    registry.register_provider("faulty", lambda: faulty)
    run_a = _run(platform, tmp_path, "faulty", "A")
    assert run_a.status == "outcome_unknown"
    sink, elsewhere = tmp_path / "sink", tmp_path / "elsewhere"
    sink.rename(tmp_path / "moved")
    FILE_PROVIDERS[name]().prepare(PublishTarget("x", "elsewhere", "append", {"base_dir": str(tmp_path)}))
    before = sorted(p.relative_to(elsewhere).as_posix() for p in elsewhere.rglob("*"))
    sink.symlink_to(elsewhere, target_is_directory=True)
    undecided = _reconcile(platform, run_a.run_id, resume=True)
    assert (undecided.finding, undecided.resumed) == ("undecided", False)
    assert "resolves to another place" in undecided.detail and str(tmp_path) not in undecided.detail
    assert sorted(p.relative_to(elsewhere).as_posix() for p in elsewhere.rglob("*")) == before


# ---- the ways the first fix left open (issue 26, finding 1, red team) ---------------------------------
# - A `_location.json` that is a FIFO (anyone with write access to the sink folder can make one) blocked `locate`
#   in `open()` forever: every later run of the datasource and every reconcile of its runs hung.
# - A Delta `_delta_log` without a first commit (what a concurrent first run of the datasource leaves between
#   creating the folder and committing version 0, or a crash there) failed `locate` with an unexpected
#   TableNotFoundError before `prepare` (which creates the table there) could run: the first run of a
#   datasource failed `execution_failed`, and after such a crash every run did.
# - A run authorized before locations were recorded (its `dispatch.authorized` has no `sink_location`: an upgrade
#   while it was outcome_unknown) whose folder then went missing: the first run after the upgrade found no record,
#   created the folder afresh and recorded it, and the old run's reconcile, holding it to that record, proved its
#   key absent in the new folder and published it a second time (finding 1 again, across the upgrade).
# - `dataflow datasources forget NAME --yes` with a NAME that is not UTF-8 (a shell argument with a byte such as
#   0xff) crashed with `error [internal]: unexpected UnicodeEncodeError` (the ledger subject encoded the name).


WAIT_S = 20.0


def test_a_marker_that_is_a_fifo_fails_the_run_instead_of_hanging_it(platform: Platform, tmp_path: Path) -> None:
    assert _run(platform, tmp_path, "parquet", "k1").status == "succeeded"
    marker = tmp_path / "sink" / MARKER
    marker.unlink()
    os.mkfifo(marker)

    done: list[Run] = []
    worker = threading.Thread(target=lambda: done.append(_run(platform, tmp_path, "parquet", "k2")), daemon=True)
    worker.start()
    worker.join(WAIT_S)
    if worker.is_alive():  # unblock the reader so the thread ends, then fail
        fd = os.open(marker, os.O_WRONLY)
        os.close(fd)
        worker.join(WAIT_S)
        pytest.fail("the run hung opening a FIFO marker")
    run = done[0]
    assert (run.status, run.recovery_status) == ("failed", "no_external_output")
    assert run.error_message is not None and str(tmp_path) not in run.error_message
    assert len(flows.manifests(tmp_path / "sink")) == 1


def test_a_delta_log_without_a_first_commit_is_no_table_yet(platform: Platform, tmp_path: Path) -> None:
    (tmp_path / "sink" / "_delta_log").mkdir(parents=True)
    run = _run(platform, tmp_path, "delta", "k1")
    assert (run.status, run.error_code) == ("succeeded", None), run.error_message
    assert len(flows.delta_publications(tmp_path / "sink")) == 1
    (tmp_path / "sink").rename(tmp_path / "away")  # and the location it created is recorded
    (tmp_path / "sink" / "_delta_log").mkdir(parents=True)
    refused = _run(platform, tmp_path, "delta", "k2")
    assert (refused.status, refused.recovery_status, refused.error_code) == (
        "failed", "no_external_output", "location_missing",
    )  # fmt: skip
    assert not list((tmp_path / "sink" / "_delta_log").iterdir()), "the registered table was created again"


def test_forget_with_a_name_that_is_no_text_is_invalid_input_not_an_internal_error(db_url: str, tmp_path: Path) -> None:
    result = make_cli(db_url, tmp_path)("datasources", "forget", "a\udcffb", "--yes")
    assert result.code == 2, result.output
    assert "invalid_input" in result.output and "internal" not in result.output


class _BeforeLocate:
    """The provider as this platform called it before `locate` existed (no location recorded at dispatch)."""

    name = "parquet"
    capabilities = ParquetFolderProvider.capabilities

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def prepare(self, target: PublishTarget) -> None:
        self.inner.prepare(target)

    def publish(self, *args: Any) -> Any:
        return self.inner.publish(*args)

    def inspect(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.inspect(*args, **kwargs)


def test_a_run_authorized_before_locations_were_recorded_is_not_proven_absent_in_a_recreated_folder(
    platform: Platform, tmp_path: Path
) -> None:
    faulty = FaultInjectingProvider(ParquetFolderProvider(), "timeout_after_commit", fail_times=1)
    registry.register_provider("faulty", lambda: _BeforeLocate(faulty))
    defn = flows.definition(flows.parquet_target("faulty"))
    run_a = platform.runs.run_inline(flows.request(defn, tmp_path, "A")).run
    assert run_a.status == "outcome_unknown"
    (tmp_path / "sink").rename(tmp_path / "moved")
    registry.register_provider("faulty", lambda: faulty)  # the upgrade
    assert platform.runs.run_inline(flows.request(defn, tmp_path, "B")).run.status == "succeeded"

    asked = Provenance("ops-alice", "cli")
    held = reconcile.reconcile(platform.runs, run_a.run_id, access=OPERATOR, provenance=asked, resume=True)
    assert (held.finding, held.resumed, held.run.status) == ("undecided", False, "outcome_unknown")
    assert str(tmp_path) not in held.detail
    assert len(flows.manifests(tmp_path / "sink")) == 1 and faulty.counters.inner_publish_calls == 2

    (tmp_path / "sink").rename(tmp_path / "b")  # the operator puts A's folder back and says so
    (tmp_path / "moved").rename(tmp_path / "sink")
    with platform.db.begin() as conn:
        registry.forget_locations(
            conn, platform.db, "acme", "analytics.totals", asked_by(OPERATOR, asked),
            evidence_key=platform.runs.config.evidence_key,
        )  # fmt: skip
    present = reconcile.reconcile(platform.runs, run_a.run_id, access=OPERATOR, provenance=asked)
    assert (present.finding, present.run.status) == ("present", "succeeded")
