"""Lineage (issue 32, docs/lineage.md): OpenLineage events derived from committed ledger entries through the
outbox, delivered to a real local HTTP receiver, on both engines.

Every received event is validated against the OpenLineage JSON Schema (2-0-2, vendored under
tests/support/openlineage). Event ids are uuid5 of the entry's key, so the events a run must produce are
computed from its chain and compared one for one with what the receiver got.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import structlog

from durable_dataflow import cli
from durable_dataflow.core import crashpoints, ledger
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.protocol import cancel, evidence
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.lineage import events
from durable_dataflow.platform import Platform
from support import flows

SCHEMA_FILE = Path(__file__).resolve().parents[1] / "support" / "openlineage" / "OpenLineage.json"
REPO = Path(__file__).resolve().parents[2]


def _run_event_validator() -> jsonschema.protocols.Validator:
    document = json.loads(SCHEMA_FILE.read_text("utf-8"))
    document.pop("oneOf", None)
    document["$ref"] = "#/$defs/RunEvent"
    cls = jsonschema.validators.validator_for(document)
    return cls(document, format_checker=cls.FORMAT_CHECKER)  # type: ignore[no-any-return]


VALIDATOR = _run_event_validator()


class Receiver:
    """A local OpenLineage HTTP receiver: keeps every event it accepts; answers 500 to the first
    ``fail_first`` requests."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.requests = 0
        self.fail_first = 0
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver.lock:
                    receiver.requests += 1
                    failing = receiver.requests <= receiver.fail_first
                    if not failing:
                        receiver.received.append(json.loads(body))
                        receiver.arrived.notify_all()
                self.send_response(500 if failing else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def wait_for(self, count: int, timeout_s: float) -> bool:
        """Whether ``count`` events arrived within ``timeout_s``."""
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.received) >= count, timeout_s)

    def event_ids(self) -> list[str]:
        return [e["run"]["facets"]["durableDataflow_ledgerEntry"]["eventId"] for e in self.received]


@pytest.fixture(autouse=True)
def _openlineage_environment_restored() -> Iterator[None]:
    """The OpenLineage client writes OPENLINEAGE__TRANSPORT__TRANSPORTS__* into os.environ when it reads
    OPENLINEAGE_URL (monkeypatch restores only what it set): every OPENLINEAGE variable is put back as it
    was, so no later test in this process, nor its subprocesses, finds lineage configured."""
    before = {k: v for k, v in os.environ.items() if k.startswith("OPENLINEAGE")}
    yield
    for name in [k for k in os.environ if k.startswith("OPENLINEAGE")]:
        del os.environ[name]
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _structlog_reset() -> Iterator[None]:
    """`lineage flush` configures structlog to write to the sys.stderr of its moment (pytest's capture,
    closed after the test): back to the defaults before and after, so no test logs into a closed file."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    found.thread.start()
    yield found
    found.server.shutdown()
    found.server.server_close()


def _clear_lineage_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("OPENLINEAGE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OPENLINEAGE_CONFIG", str(tmp_path / "no-such-openlineage.yml"))
    monkeypatch.chdir(tmp_path)  # no ./openlineage.yml here


@pytest.fixture
def lineage_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, receiver: Receiver) -> Receiver:
    """Lineage configured the simplest way: OPENLINEAGE_URL at the local receiver."""
    _clear_lineage_env(monkeypatch, tmp_path)
    monkeypatch.setenv("OPENLINEAGE_URL", receiver.url)
    return receiver


@pytest.fixture
def lineage_platform(db_url: str, lineage_on: Receiver) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=5) as opened:
        yield opened
    crashpoints.set_hook(None)
    registry.unregister_provider("faulty")


def _flush(db_url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    """``dataflow lineage flush --json`` in this process: its exit status and its document."""
    capsys.readouterr()
    status = cli.main(["--db", db_url, "lineage", "flush", "--json"])
    return status, json.loads(capsys.readouterr().out)


def _expected_ids(platform: Platform, *run_ids: str) -> set[str]:
    """The event id of every entry of these runs whose kind becomes an event."""
    with platform.db.read() as conn:
        chains = [ledger.read(conn, "dataflow", run_id) for run_id in run_ids]
    mapped = [e for chain in chains for e in chain if e.kind in events.EVENT_TYPES]
    return {events.event_id(e.module, e.subject_id, e.seq) for e in mapped}


def _of_run(received: list[dict[str, Any]], run: Run) -> list[dict[str, Any]]:
    return [e for e in received if e["run"]["runId"] == events.run_uuid(run.run_id)]


def _validate_all(received: list[dict[str, Any]]) -> None:
    for event in received:
        VALIDATOR.validate(event)
        for facets in (event["run"]["facets"], event["job"]["facets"]):
            for facet in facets.values():
                assert facet["_schemaURL"].startswith("https://"), facet


def test_atomic_and_forward_runs_emit_start_and_complete(
    lineage_platform: Platform, db_url: str, tmp_path: Path, lineage_on: Receiver,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """A succeeded atomic run and a forward run publishing to a Parquet sink each give START then COMPLETE,
    schema-valid; the forward COMPLETE names its output datasource, its version (the publication ref) and
    the publication key; inputs carry kind and fingerprint; the job carries the definition hash."""
    atomic = lineage_platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "a")).run
    forward_defn = flows.definition(flows.parquet_target("parquet"))
    forward = lineage_platform.runs.run_inline(flows.request(forward_defn, tmp_path, "f")).run
    assert (atomic.status, forward.status) == ("succeeded", "succeeded")
    assert cli.main(["--db", db_url, "lineage", "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["configured"] is True and status["pending"] > 0

    code, outcome = _flush(db_url, capsys)
    assert (code, outcome["pending"], outcome["failed"]) == (0, 0, False), outcome
    received = lineage_on.received
    _validate_all(received)
    assert sorted(_ids(received)) == sorted(_expected_ids(lineage_platform, atomic.run_id, forward.run_id))
    for run in (atomic, forward):
        mine = _of_run(received, run)
        assert [e["eventType"] for e in mine] == ["START", "COMPLETE"]
        job = mine[0]["job"]
        assert job["namespace"] == "durable-dataflow" and job["name"] == f"acme.{run.definition_name}"
        assert job["facets"]["durableDataflow_definition"]["definitionHash"] == run.definition_hash
        source = mine[1]["inputs"][0]["facets"]["durableDataflow_source"]
        assert (source["kind"], source["fingerprint"].startswith("sha256:")) == ("inline", True)
    assert _of_run(received, atomic)[1]["outputs"] == []
    (output,) = _of_run(received, forward)[1]["outputs"]
    assert (output["namespace"], output["name"]) == ("durable-dataflow/acme", "analytics.totals")
    assert output["facets"]["version"]["datasetVersion"] == forward.publication_ref
    publication = output["facets"]["durableDataflow_publication"]
    assert publication["publicationKey"] == forward.publication_idempotency_key
    assert publication["publicationRef"] == forward.publication_ref


def _ids(received: list[dict[str, Any]]) -> list[str]:
    return [e["run"]["facets"]["durableDataflow_ledgerEntry"]["eventId"] for e in received]


def test_receiver_outage_delays_and_loses_nothing(
    db_url: str, tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """A receiver answering 500 to its first requests: flush exits 3 with events pending; a later flush
    delivers the rest; every expected event arrives, and any duplicate carries the same event id. The
    transport is configured through OPENLINEAGE__TRANSPORT__* (retries off, so each 500 is one failure)."""
    _clear_lineage_env(monkeypatch, tmp_path)
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TYPE", "http")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__URL", receiver.url)
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__RETRY", json.dumps({"total": 0, "status_forcelist": []}))
    receiver.fail_first = 2
    with Platform(db_url, lease_ttl_s=5) as platform:
        done = [platform.runs.run_inline(flows.request(flows.definition(), tmp_path, f"k{i}")).run for i in range(2)]
        expected = _expected_ids(platform, *(run.run_id for run in done))
        code, outcome = _flush(db_url, capsys)
        assert (code, outcome["failed"], outcome["delivered"]) == (3, True, 0), outcome
        assert outcome["pending"] > 0
        code, outcome = _flush(db_url, capsys)  # the second request fails too: still pending
        assert code == 3, outcome
        code, outcome = _flush(db_url, capsys)
        assert (code, outcome["pending"]) == (0, 0), outcome
    assert set(receiver.event_ids()) == expected and len(expected) == 4
    by_id: dict[str, dict[str, Any]] = {}
    for event in receiver.received:
        key = event["run"]["facets"]["durableDataflow_ledgerEntry"]["eventId"]
        assert by_id.setdefault(key, event)["eventType"] == event["eventType"]
    _validate_all(receiver.received)


def test_events_committed_but_never_delivered_are_delivered_by_a_fresh_platform(
    db_url: str, tmp_path: Path, lineage_on: Receiver, capsys: pytest.CaptureFixture[str]
) -> None:
    """The crash between commit and delivery, in process: a run commits with lineage on and its platform
    closes without delivering; a fresh platform's flush delivers every event of it."""
    with Platform(db_url, lease_ttl_s=5) as first:
        run = first.runs.run_inline(flows.request(flows.definition(), tmp_path, "k")).run
        expected = _expected_ids(first, run.run_id)
    assert lineage_on.received == []
    with Platform(db_url, lease_ttl_s=5):
        code, outcome = _flush(db_url, capsys)
    assert (code, outcome["delivered"]) == (0, 2), outcome
    assert set(lineage_on.event_ids()) == expected


def test_sigkill_after_the_terminal_commit_loses_no_event(
    db_url: str, tmp_path: Path, lineage_on: Receiver, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dataflow run` with lineage configured, SIGKILLed right after its terminal commit: a later flush
    delivers its START and COMPLETE."""
    flow = tmp_path / "flow"
    shutil.copytree(REPO / "examples" / "revenue_by_region", flow)
    env = {**os.environ, "DATAFLOW_CRASH_AT": crashpoints.AFTER_TERMINAL_COMMIT}
    command = [sys.executable, "-m", "durable_dataflow.cli", "--db", db_url, "run", str(flow / "dataflow.yaml"),
               "--param", "day=2026-11-02"]  # fmt: skip
    killed = subprocess.run(command, env=env, capture_output=True, timeout=120, cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    code, outcome = _flush(db_url, capsys)
    assert (code, outcome["delivered"], outcome["pending"]) == (0, 2, 0), outcome
    assert [e["eventType"] for e in lineage_on.received] == ["START", "COMPLETE"]
    _validate_all(lineage_on.received)


def test_lineage_off_writes_no_outbox_row(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """With no OpenLineage configuration at all, a run writes no outbox row; status says not configured
    and flush is refused (exit 2)."""
    _clear_lineage_env(monkeypatch, tmp_path)
    with Platform(db_url, lease_ttl_s=5) as platform:
        assert platform.db.ledger_outbox is False
        platform.runs.run_inline(flows.request(flows.definition(flows.parquet_target()), tmp_path, "k"))
        with platform.db.read() as conn:
            assert ledger.outbox_count(conn) == 0
    capsys.readouterr()
    assert cli.main(["--db", db_url, "lineage", "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["configured"] is False
    assert cli.main(["--db", db_url, "lineage", "flush"]) == 2


def test_fail_abort_and_outcome_unknown(
    lineage_platform: Platform, db_url: str, tmp_path: Path, lineage_on: Receiver,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """A rejected publication gives FAIL with its error code; a cancelled queued run gives ABORT (and no
    START: it never started); a publication whose answer was lost gives OTHER with the outcome facet and
    names the datasource it may have published to."""
    registry.register_provider("faulty", lambda: FaultInjectingProvider(registry.load_provider("parquet"), "reject"))
    failed = lineage_platform.runs.run_inline(
        flows.request(flows.definition(flows.parquet_target("faulty")), tmp_path, "rejected")
    ).run
    assert failed.status == "failed"
    queued = lineage_platform.runs.submit(flows.request(flows.definition(), tmp_path, "queued")).run
    access = AccessContext("acme", "tester", ("operator",), (), "test")
    cancel.cancel(lineage_platform.runs, queued.run_id, access=access, provenance=Provenance("tester", "cli"))
    registry.register_provider(
        "faulty", lambda: FaultInjectingProvider(registry.load_provider("parquet"), "timeout_after_commit")
    )
    unknown = lineage_platform.runs.run_inline(
        flows.request(flows.definition(flows.parquet_target("faulty")), tmp_path, "unknown")
    ).run
    assert unknown.status == "outcome_unknown"
    assert _flush(db_url, capsys)[0] == 0
    received = lineage_on.received
    _validate_all(received)
    fail = _of_run(received, failed)
    assert [e["eventType"] for e in fail] == ["START", "FAIL"]
    assert fail[1]["run"]["facets"]["durableDataflow_error"]["code"] == "publication_rejected"
    assert [e["eventType"] for e in _of_run(received, queued)] == ["ABORT"]
    other = _of_run(received, unknown)
    assert [e["eventType"] for e in other] == ["START", "OTHER"]
    facet = other[1]["run"]["facets"]["durableDataflow_outcome"]
    assert (facet["outcome"], facet["mayHavePublished"], facet["kind"]) == (
        "outcome_unknown", True, evidence.PUBLICATION_UNKNOWN,
    )  # fmt: skip
    assert [o["name"] for o in other[1]["outputs"]] == ["analytics.totals"]


def test_each_event_names_only_its_own_tenant(
    lineage_platform: Platform, db_url: str, tmp_path: Path, lineage_on: Receiver,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Two tenants publish to a datasource of the same name: each event's job, inputs and outputs name
    its own tenant only, and no event's text holds the other tenant's name or run id."""
    target = flows.parquet_target("parquet")
    runs_by_tenant = {}
    for tenant in ("acme", "globex"):
        request = flows.request(flows.definition({**target, "location": f"sink-{tenant}"}), tmp_path, "k",
                                tenant=tenant)  # fmt: skip
        runs_by_tenant[tenant] = lineage_platform.runs.run_inline(request).run
    assert _flush(db_url, capsys)[0] == 0
    _validate_all(lineage_on.received)
    for tenant, run in runs_by_tenant.items():
        other = "globex" if tenant == "acme" else "acme"
        mine = _of_run(lineage_on.received, run)
        assert [e["eventType"] for e in mine] == ["START", "COMPLETE"]
        for event in mine:
            assert event["job"]["name"] == f"{tenant}.totals"
            datasets = event["inputs"] + event["outputs"]
            assert all(d["namespace"] == f"durable-dataflow/{tenant}" for d in datasets)
            text = json.dumps(event)
            assert other not in text and runs_by_tenant[other].run_id not in text


def test_a_scheduled_partitioned_published_run(
    lineage_platform: Platform, db_url: str, tmp_path: Path, lineage_on: Receiver,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Issue 32's "done when": a schedule tick's run replacing one day's partition of a Delta datasource
    gives START and COMPLETE, schema-valid, naming its source with its fingerprint, its output's version
    (the Delta publication ref) and the schedule as its parent job."""
    document = flows.daily_partition_definition("analytics.daily", "delta").model_dump(mode="json", exclude_none=True)
    document["schedule"] = {"cron": "0 2 * * *", "timezone": "UTC", "parameters": {"day": "{{ tick.date - 1 day }}"}}
    definition = Definition.model_validate(document)
    t0 = dt.datetime(2026, 3, 1, 0, 0, tzinfo=dt.UTC)
    schedules.apply(lineage_platform.runs, definition, workspace.local(tmp_path), AccessContext.local("acme"), now=t0)
    evaluation = schedules.evaluate(lineage_platform.db, lineage_platform.runs, t0 + dt.timedelta(hours=3))
    assert [d.decision for d in evaluation.decisions] == ["submitted"]
    while (claim := lineage_platform.runs.claim_next()) is not None:
        lineage_platform.runs.execute(claim)
    run = lineage_platform.runs.get(evaluation.decisions[0].run_id or "")
    assert run.status == "succeeded" and run.publication_ref
    assert _flush(db_url, capsys)[0] == 0
    _validate_all(lineage_on.received)
    start, complete = _of_run(lineage_on.received, run)
    assert (start["eventType"], complete["eventType"]) == ("START", "COMPLETE")
    (source,) = complete["inputs"]
    assert source["facets"]["durableDataflow_source"]["fingerprint"].startswith("sha256:")
    (output,) = complete["outputs"]
    assert output["name"] == "analytics.daily"
    assert output["facets"]["version"]["datasetVersion"] == run.publication_ref
    assert complete["run"]["facets"]["parent"]["job"]["name"] == f"acme.schedule.{definition.name}"


def test_two_deliverers_share_the_outbox_on_postgres(
    pg_url: str, tmp_path: Path, lineage_on: Receiver
) -> None:
    """On PostgreSQL a deliverer skips the keys another one holds (FOR UPDATE SKIP LOCKED): while one
    transaction holds the oldest keys, a delivery sends only the others; once it lets go, the rest are
    delivered, and no event arrives twice."""
    from openlineage.client import OpenLineageClient

    from durable_dataflow.lineage import delivery

    with Platform(pg_url, lease_ttl_s=5) as platform:
        done = [platform.runs.run_inline(flows.request(flows.definition(), tmp_path, f"k{i}")).run for i in range(2)]
        expected = _expected_ids(platform, *(run.run_id for run in done))
        client = OpenLineageClient()
        with platform.db.begin() as holder:
            held = ledger.pending_outbox(holder, 4, skip_locked=True)
            first = delivery.deliver_pending(platform.db, client, namespace="durable-dataflow")
            assert (len(held), first.delivered + first.skipped, first.failed) == (4, 4, False)
            assert delivery.pending_count(platform.db) == len(held)
            received_while_held = set(lineage_on.event_ids())
            held_ids = {events.event_id(*key) for key in held}
            assert not received_while_held & held_ids
            holder.rollback()
        rest = delivery.flush(platform.db, client, namespace="durable-dataflow")
        assert not rest.failed and delivery.pending_count(platform.db) == 0
    ids = lineage_on.event_ids()
    assert len(ids) == len(set(ids)) and set(ids) == expected


def test_a_crash_between_emit_and_delete_resends_the_same_events(
    lineage_platform: Platform, tmp_path: Path, lineage_on: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At least once: when the process dies after its emits and before the keys' deletion (here the
    deletion raises), the next delivery sends the same events again, with the same event ids and content."""
    from openlineage.client import OpenLineageClient

    from durable_dataflow.lineage import delivery

    run = lineage_platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k")).run
    client = OpenLineageClient()
    real_delete = ledger.delete_outbox

    def crash(*args: Any) -> int:
        raise RuntimeError("killed before the deletion")

    monkeypatch.setattr(ledger, "delete_outbox", crash)
    with pytest.raises(RuntimeError):
        delivery.flush(lineage_platform.db, client, namespace="durable-dataflow")
    first = [dict(e) for e in lineage_on.received]
    assert [e["eventType"] for e in first] == ["START", "COMPLETE"]
    monkeypatch.setattr(ledger, "delete_outbox", real_delete)
    assert not delivery.flush(lineage_platform.db, client, namespace="durable-dataflow").failed
    again = lineage_on.received[len(first):]
    assert again == first and delivery.pending_count(lineage_platform.db) == 0
    assert set(lineage_on.event_ids()) == _expected_ids(lineage_platform, run.run_id)


def test_background_delivery_sends_what_commits_and_never_raises(
    lineage_platform: Platform, tmp_path: Path, lineage_on: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dataflow serve`'s background delivery (lineage/background.py): its thread delivers a committed
    run's events in its first round, then waits; a round whose database fails is logged, not raised."""
    from openlineage.client import OpenLineageClient

    from durable_dataflow.core.errors import StorageUnavailable
    from durable_dataflow.lineage import background, delivery

    run = lineage_platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k")).run
    waited, stopping = threading.Event(), threading.Event()

    def wait(seconds: float) -> None:
        waited.set()
        stopping.wait(seconds)

    deliverer = background.BackgroundDelivery(
        lineage_platform.db, OpenLineageClient(), "durable-dataflow", interval_s=60, wait=wait
    )
    deliverer.start()
    assert waited.wait(30), "the first round never ended"
    stopping.set()
    deliverer.stop()
    assert set(lineage_on.event_ids()) == _expected_ids(lineage_platform, run.run_id)

    def down(*args: Any, **kwargs: Any) -> Any:
        raise StorageUnavailable("the database is down")

    monkeypatch.setattr(delivery, "flush", down)
    outcome = background.BackgroundDelivery(lineage_platform.db, OpenLineageClient(), "ns").deliver_once()
    assert (outcome.failed, outcome.error_type) == (True, "StorageUnavailable")


def test_serve_delivers_in_the_background(db_url: str, tmp_path: Path, lineage_on: Receiver) -> None:
    """`dataflow serve` with lineage configured delivers the events of a run another process committed,
    without any flush; SIGTERM still stops it cleanly (exit 0) and nothing stays pending."""
    with Platform(db_url, lease_ttl_s=5) as platform:
        run = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k")).run
        expected = _expected_ids(platform, run.run_id)
    argv = [sys.executable, "-m", "durable_dataflow.cli", "--db", db_url, "serve", "--port", "0",
            "--data-root", str(tmp_path / "data"), "--sink-root", str(tmp_path / "sinks")]  # fmt: skip
    server = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert lineage_on.wait_for(len(expected), 90), "serve delivered nothing"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=90) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        assert server.stderr is not None
        server.stderr.close()
    assert set(lineage_on.event_ids()) == expected
    with Platform(db_url, lease_ttl_s=5) as platform, platform.db.read() as conn:
        assert ledger.outbox_count(conn) == 0


def test_dataflow_run_delivers_its_own_events_before_it_exits(
    db_url: str, tmp_path: Path, lineage_on: Receiver
) -> None:
    """Proves `dataflow run` with lineage configured delivers its run's START and COMPLETE itself before it
    exits (no serve, no flush), leaving nothing pending; a receiver that refuses leaves them pending instead
    (exit 0 all the same: the run succeeded)."""
    flow = tmp_path / "flow"
    shutil.copytree(REPO / "examples" / "revenue_by_region", flow)
    command = [sys.executable, "-m", "durable_dataflow.cli", "--db", db_url, "run", str(flow / "dataflow.yaml"),
               "--param", "day=2026-11-02"]  # fmt: skip
    done = subprocess.run(command, env=dict(os.environ), capture_output=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [e["eventType"] for e in lineage_on.received] == ["START", "COMPLETE"]
    _validate_all(lineage_on.received)
    lineage_on.fail_first = lineage_on.requests + 1000  # every later request answers 500
    again = subprocess.run([*command[:-1], "day=2026-11-03"], env=dict(os.environ), capture_output=True,
                           timeout=120, cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr
    with Platform(db_url, lease_ttl_s=5) as platform, platform.db.read() as conn:
        assert ledger.outbox_count(conn) > 0  # the refused events wait for a worker, serve or a flush


def test_a_worker_delivers_the_events_of_the_runs_it_executes(
    db_url: str, tmp_path: Path, lineage_on: Receiver
) -> None:
    """Proves `dataflow worker --until-idle` with lineage configured delivers the events of the queued runs it
    executed before it exits (its background delivery, then one last round after its loop), nothing pending."""
    with Platform(db_url, lease_ttl_s=5) as platform:
        queued = [platform.runs.submit(flows.request(flows.definition(), tmp_path, f"k-{n}")).run for n in range(2)]
    argv = [sys.executable, "-m", "durable_dataflow.cli", "--db", db_url, "worker", "--until-idle",
            "--poll-interval", "0.05"]  # fmt: skip
    done = subprocess.run(argv, env=dict(os.environ), capture_output=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with Platform(db_url, lease_ttl_s=5) as platform:
        expected = _expected_ids(platform, *(run.run_id for run in queued))
        with platform.db.read() as conn:
            assert ledger.outbox_count(conn) == 0
    assert set(lineage_on.event_ids()) == expected
    _validate_all(lineage_on.received)


def test_metrics_show_the_backlog_and_count_deliveries(lineage_platform: Platform, lineage_on: Receiver,
                                                        tmp_path: Path) -> None:  # fmt: skip
    """Proves /metrics carries dataflow_lineage_pending (the outbox's backlog, platform-wide) and
    dataflow_lineage_events_total: a committed run's events are pending until a round delivers them, which
    the delivering process counts as delivered; a round a receiver refuses counts one failed and leaves
    the backlog."""
    from openlineage.client import OpenLineageClient

    from durable_dataflow.api.metrics import Metrics
    from durable_dataflow.lineage.background import BackgroundDelivery

    metrics = Metrics(lineage_platform.db, scrape_interval_s=0.0)
    before = metrics.render().decode()
    assert "dataflow_lineage_pending 0.0" in before
    assert 'dataflow_lineage_events_total{outcome="failed"} 0.0' in before
    run = lineage_platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "m-1")).run
    pending = len(_expected_ids(lineage_platform, run.run_id))
    with lineage_platform.db.read() as conn:
        entries = ledger.outbox_count(conn)
    assert f"dataflow_lineage_pending {float(entries)}" in metrics.render().decode()
    lineage_on.fail_first = lineage_on.requests + 1000  # refuse everything for now
    delivering = BackgroundDelivery(lineage_platform.db, OpenLineageClient(), "durable-dataflow",
                                    observe=metrics.lineage.observe_delivery)  # fmt: skip
    try:
        delivering.deliver_once()
        refused = metrics.render().decode()
        assert 'dataflow_lineage_events_total{outcome="failed"} 1.0' in refused
        assert "dataflow_lineage_pending 0.0" not in refused
        lineage_on.fail_first = 0
        delivering.deliver_once()
    finally:
        delivering.client.close()
    after = metrics.render().decode()
    assert "dataflow_lineage_pending 0.0" in after
    assert f'dataflow_lineage_events_total{{outcome="delivered"}} {float(pending)}' in after


@pytest.mark.parametrize("kind", sorted(events.EVENT_TYPES))
def test_every_event_bearing_entry_kind_gives_a_schema_valid_event(
    lineage_platform: Platform, tmp_path: Path, kind: str
) -> None:
    """Proves each entry kind a transition appends that maps to an event (every START, COMPLETE, FAIL, ABORT
    and OTHER of the transition table: outcome unknown, mismatches, each reconcile finding) gives an event of
    its type that validates against the OpenLineage schema, on a forward run's real chain (sources, dispatch
    and publication entries before it), with its facets (error, outcome, reconcile) where they belong."""
    from openlineage.client.serde import Serde

    defn = flows.definition(flows.parquet_target("parquet"))
    run = lineage_platform.runs.run_inline(flows.request(defn, tmp_path, f"kind-{kind}")).run
    with lineage_platform.db.read() as conn:
        chain = ledger.read(conn, "dataflow", run.run_id)
    head = chain[-1]
    entry = ledger.Entry(module=head.module, subject_id=head.subject_id, seq=head.seq + 1, attempt=head.attempt,
                         kind=kind, payload={"reason": "why, as recorded", "code": "some_code"},
                         prev_hash=head.entry_hash, entry_hash="sha256:" + "0" * 64, entry_mac=None,
                         recorded_at_us=head.recorded_at_us + 1)  # fmt: skip
    event = events.event_for(run, entry, [*chain, entry], "durable-dataflow")
    assert event is not None
    document = json.loads(Serde.to_json(event))
    assert document["eventType"] == str(events.EVENT_TYPES[kind].value)
    _validate_all([document])
    facets = document["run"]["facets"]
    assert facets["durableDataflow_ledgerEntry"]["eventId"] == events.event_id("dataflow", run.run_id, entry.seq)
    assert ("durableDataflow_error" in facets) == (document["eventType"] == "FAIL")
    assert ("durableDataflow_outcome" in facets) == (kind in events.OUTCOME_UNKNOWN_KINDS)
    assert ("durableDataflow_reconcile" in facets) == (kind in events.RECONCILE_FINDINGS)
