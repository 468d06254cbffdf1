"""Issue 13, item 5: the embedded default never swept. A run whose process died after dispatch
authorization stayed `running / dispatch_authorized`, resolved and unwarned, in every read view for as
long as nobody started a worker.

Now the read views (`dataflow runs`, `dataflow show`, /v1/runs, /v1/runs/{id}, /ui/runs, /ui/runs/{id})
derive the state of an attempt whose lease expired, reading only, and `dataflow serve` sweeps.

The crashed attempt is a real process killed at a named crash point (``DATAFLOW_CRASH_AT``) whose
database clock runs an hour behind (``Database.advance_clock``): every lease it took expired long ago
on the clock of every other process, so no test waits for a lease to expire.
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from durable_dataflow.api import tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.core import crashpoints, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.schema import leases as lease_rows
from durable_dataflow.dataflow.protocol import evidence, runs
from durable_dataflow.platform import Platform
from faults import harness
from support.api_runs import web_login
from support.cli import Cli, make_cli

CLOCK_BEHIND_S = -3600.0  # the crashed process's database clock: an hour behind everyone else's
KEY = "embedded-1"
SERVE_WAIT_S = 90.0
AFTER_AUTHORIZATION = "the attempt's lease expired after dispatch authorization"
RETRIED = "will be retried by the next sweep"

CRASHER = """
import sys
from pathlib import Path

from durable_dataflow.dataflow.definitions.definitions import load_definition
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.platform import Platform

url, definition, behind_s, key = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
loaded = load_definition(definition)
access = AccessContext.local()
request = RunRequest(
    definition=loaded.definition, base_dir=loaded.base_dir, parameters={"n": "1"}, access=access,
    provenance=Provenance(actor=access.principal, trigger="cli"), idempotency_key=key,
)
with Platform(url, lease_ttl_s=30) as platform:
    platform.db.advance_clock(behind_s)
    platform.runs.run_inline(request)
raise SystemExit("the crash point was not reached")
"""


@dataclass(frozen=True)
class Crashed:
    run_id: str
    sink: Path
    definition: Path


def crash(db_url: str, tmp_path: Path, point: str) -> Crashed:
    """A forward run executed by a process that SIGKILLs itself at ``point``; returns its run id."""
    definition = harness.inline_definition(tmp_path / "defs", "embedded", publish_to="sink")
    env = dict(make_cli(db_url, tmp_path).env)
    env["DATAFLOW_CRASH_AT"] = point
    done = subprocess.run(
        [sys.executable, "-c", CRASHER, db_url, str(definition), str(CLOCK_BEHIND_S), KEY],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    database = Database(db_url)
    try:
        with database.read() as conn:
            [run] = runs.list_page(conn, limit=2)
    finally:
        database.dispose()
    return Crashed(run.run_id, definition.parent / "sink", definition)


def durable_state(db_url: str, run_id: str) -> tuple[Any, ...]:
    """Everything a read could have changed: the run's projection, its ledger and its lease row."""
    database = Database(db_url)
    try:
        with database.read() as conn:
            run = runs.get(conn, run_id)
            entries = [(e.seq, e.kind) for e in ledger.read(conn, runs.MODULE, run_id)]
            lease = conn.execute(sa.select(lease_rows).where(lease_rows.c.subject_id == run_id)).one()
    finally:
        database.dispose()
    return run.status, run.recovery_status, run.updated_at_us, entries, tuple(lease)


def unfolded(table: str) -> str:
    """A Rich table's text with its cells' folded lines joined (borders and line breaks as one space)."""
    return re.sub(r"[\s│┃]+", " ", table)


@pytest.fixture
def cli(db_url: str, tmp_path: Path) -> Cli:
    return make_cli(db_url, tmp_path)


# ---- core: the one query --------------------------------------------------------------------------


def test_expiry_of_judges_leases_on_the_database_clock_in_one_statement(db: Database) -> None:
    """Live, expired and released leases of a set of subjects are told apart on the database clock, by
    one SELECT that writes nothing; a subject never leased has no entry."""
    with db.begin() as conn:
        for subject in ("live", "expired", "released"):
            leases.acquire(conn, db, "m", subject, "holder", 10 if subject == "live" else 5)
        leases.release(conn, db, "m", "released", 1)
    db.advance_clock(6)  # past the 5 s leases, not the 10 s one
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    sa.event.listen(db.read_engine, "before_cursor_execute", record)
    try:
        with db.read() as conn:
            found = leases.expiry_of(conn, db, "m", ["live", "expired", "released", "never"])
    finally:
        sa.event.remove(db.read_engine, "before_cursor_execute", record)
    assert {s: (e.expired, e.released, e.attempt) for s, e in found.items()} == {
        "live": (False, False, 1),
        "expired": (True, False, 1),
        "released": (False, True, 1),
    }
    queries = [s for s in statements if s.strip().upper() != "BEGIN"]  # SQLite's read transaction
    assert len(queries) == 1 and queries[0].lstrip().upper().startswith("SELECT")


# ---- the read views ---------------------------------------------------------------------------------


def test_cli_read_views_show_an_expired_authorized_run_as_unresolved_and_write_nothing(
    cli: Cli, db_url: str, tmp_path: Path
) -> None:
    """Killed after the provider published (`after_provider_call`), with no sweeper anywhere: `runs` and
    `show` (human and --json) say UNRESOLVED, that the lease expired after dispatch authorization, that
    external output may exist and to run `dataflow reconcile RUN`; the projection is untouched."""
    crashed = crash(db_url, tmp_path, crashpoints.AFTER_PROVIDER_CALL)
    assert len(harness.parquet_publications(crashed.sink)) == 1  # the output exists
    before = durable_state(db_url, crashed.run_id)
    assert before[:2] == ("running", "dispatch_authorized")

    [listed] = cli("runs", "--json").json()
    shown = cli("show", crashed.run_id, "--json").json()
    for run in (listed, shown):
        assert (run["status"], run["recovery_status"]) == ("running", "dispatch_authorized")
        assert run["unresolved"] is True and run["lease_expired"] is True
        assert AFTER_AUTHORIZATION in run["warning"] and "external output may exist" in run["warning"]
        assert f"`dataflow reconcile {crashed.run_id}`" in run["warning"]
        assert run["publication_idempotency_key"] in run["warning"] and "failed" not in run["warning"]
    assert [e["kind"] for e in shown["ledger"]][-1] == evidence.DISPATCH_AUTHORIZED

    history = cli("runs")
    assert history.code == 0 and "UNRESOLVED" in history.stdout and "1 unresolved run(s)" in history.stdout
    detail = cli("show", crashed.run_id)
    assert detail.code == 0 and AFTER_AUTHORIZATION in unfolded(detail.stdout)
    assert "reconcile with:" in detail.stdout and f"reconcile {crashed.run_id}" in detail.stdout
    assert durable_state(db_url, crashed.run_id) == before  # read-only: nothing was swept or written


def test_ops_ledger_counts_an_expired_authorized_run_as_unresolved(cli: Cli, db_url: str, tmp_path: Path) -> None:
    """Issue 26, finding 2: the crashed run `runs` shows as UNRESOLVED is counted by `dataflow ops ledger`
    (human and --json), with the warning the read views give it; nothing is written."""
    crashed = crash(db_url, tmp_path, crashpoints.AFTER_PROVIDER_CALL)
    before = durable_state(db_url, crashed.run_id)

    ops = cli("ops", "ledger", "--json")
    assert ops.code == 0, ops.output
    projection = ops.json()
    assert projection["unresolved_total"] == 1 and projection["oldest_unresolved"]["run_id"] == crashed.run_id
    assert AFTER_AUTHORIZATION in projection["oldest_unresolved"]["warning"]
    table = cli("ops", "ledger")
    assert table.code == 0 and "Unresolved runs: 1" in table.stdout and crashed.run_id in table.stdout
    assert durable_state(db_url, crashed.run_id) == before  # Ops only reads


def test_replays_of_an_expired_authorized_run_say_unresolved_and_exit_3(cli: Cli, db_url: str, tmp_path: Path) -> None:
    """Issue 26, finding 3: a replay of the crashed run's key by `run` or `submit` shows it UNRESOLVED with
    the warning (`unresolved` and `lease_expired` true in --json) and exits 3, never 9 ("still running") or
    0; nothing is written."""
    crashed = crash(db_url, tmp_path, crashpoints.AFTER_PROVIDER_CALL)
    before = durable_state(db_url, crashed.run_id)
    replay_args = (str(crashed.definition), "--param", "n=1", "--idempotency-key", KEY)
    for command in ("run", "submit"):
        as_json = cli(command, *replay_args, "--json")
        assert as_json.code == 3, (command, as_json.output)
        run = as_json.json()
        assert run["run_id"] == crashed.run_id and run["replayed"] is True
        assert run["status"] == "running" and run["unresolved"] is True and run["lease_expired"] is True
        assert AFTER_AUTHORIZATION in run["warning"]
        assert "WARNING: UNRESOLVED" in as_json.stderr and f"reconcile {crashed.run_id}" in as_json.stderr
        human = cli(command, *replay_args)
        assert human.code == 3, (command, human.output)
        assert "UNRESOLVED" in human.stdout and AFTER_AUTHORIZATION in unfolded(human.stdout)
        assert "reconcile with:" in human.stdout
    assert durable_state(db_url, crashed.run_id) == before  # replays only read


def test_api_and_pages_show_an_expired_authorized_run_as_unresolved(db_url: str, tmp_path: Path) -> None:
    """/v1/runs, /v1/runs/{id}, /ui/runs and /ui/runs/{id} derive the same state, read-only."""
    crashed = crash(db_url, tmp_path, crashpoints.AFTER_PROVIDER_CALL)
    before = durable_state(db_url, crashed.run_id)
    platform = Platform(db_url)
    try:
        token = tokens.create_token(platform.db, "default", "operator", "on-call")[0]
        headers = {"Authorization": f"Bearer {token}"}
        app = create_app(platform, data_root=tmp_path / "data", sink_root=tmp_path / "sinks")
        with TestClient(app) as client, TestClient(app, follow_redirects=False) as browser:
            [listed] = client.get("/v1/runs", headers=headers).json()["runs"]
            one = client.get(f"/v1/runs/{crashed.run_id}", headers=headers).json()["run"]
            evidence_run = client.get(f"/v1/runs/{crashed.run_id}/evidence", headers=headers).json()["run"]
            for run in (listed, one, evidence_run):
                assert run["status"] == "running" and run["unresolved"] is True and run["lease_expired"] is True
                assert AFTER_AUTHORIZATION in run["warning"]
                assert f"dataflow reconcile {crashed.run_id}" in run["warning"]
                assert "age_s" in run
            assert web_login(browser, token).status_code == 303
            history = browser.get("/ui/runs").text
            page = browser.get(f"/ui/runs/{crashed.run_id}").text
    finally:
        platform.close()
    assert "1 unresolved run on this page" in history and "UNRESOLVED: running" in history
    for html in (history, page):
        assert 'role="alert"' in html and AFTER_AUTHORIZATION.replace("'", "&#39;") in html
        assert "lease expired, not yet swept" in html
    assert "Reconcile</button>" in page
    assert durable_state(db_url, crashed.run_id) == before


def test_an_attempt_expired_before_authorization_is_shown_as_retried_by_the_next_sweep(
    cli: Cli, db_url: str, tmp_path: Path
) -> None:
    """Killed right after its claim: the views say the lease expired before dispatch authorization and the
    next sweep retries it; the run is not unresolved (nothing can have been published)."""
    crashed = crash(db_url, tmp_path, crashpoints.AFTER_CLAIM)
    [listed] = cli("runs", "--json").json()
    assert (listed["status"], listed["recovery_status"]) == ("running", "leased")
    assert listed["lease_expired"] is True and listed["unresolved"] is False
    assert "lease expired before dispatch authorization" in listed["warning"] and RETRIED in listed["warning"]
    history = cli("runs")
    assert "UNRESOLVED" not in history.stdout and RETRIED in unfolded(history.stdout)
    platform = Platform(db_url)
    try:
        token = tokens.create_token(platform.db, "default", "viewer", "dashboards")[0]
        with TestClient(create_app(platform, data_root=tmp_path / "data", sink_root=tmp_path / "sinks")) as client:
            one = client.get(f"/v1/runs/{crashed.run_id}", headers={"Authorization": f"Bearer {token}"}).json()
    finally:
        platform.close()
    assert one["run"]["lease_expired"] is True and one["run"]["unresolved"] is False
    assert RETRIED in one["run"]["warning"]
    assert harness.parquet_publications(crashed.sink) == []


# ---- dataflow serve sweeps ----------------------------------------------------------------------------


def _lines(stream: Any, into: queue.Queue[str | None]) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_serve_sweeps_an_expired_authorized_run_to_outcome_unknown_and_stops_cleanly(
    cli: Cli, db_url: str, tmp_path: Path
) -> None:
    """With no worker, `dataflow serve --sweep-interval` decides the crashed attempt: outcome_unknown,
    never retried, the sink untouched; SIGTERM stops the server and its sweeper (exit 0)."""
    crashed = crash(db_url, tmp_path, crashpoints.AFTER_PROVIDER_CALL)
    argv = [
        sys.executable, "-m", "durable_dataflow.cli", "--db", db_url, "serve", "--port", "0",
        "--data-root", str(tmp_path / "data"), "--sink-root", str(tmp_path / "sinks"), "--sweep-interval", "0.2",
    ]  # fmt: skip
    server = subprocess.Popen(
        argv, cwd=tmp_path, env=cli.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str | None] = queue.Queue()
    assert server.stderr is not None
    reader = threading.Thread(target=_lines, args=(server.stderr, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + SERVE_WAIT_S
        decided = f'"attempt": 1, "event": "sweep.decided", "level": "warning", "outcome": "outcome_unknown", "run_id": "{crashed.run_id}"'  # noqa: E501
        wanted = (decided, "Uvicorn running on")  # serve logs JSON lines, sorted keys, as a worker does
        while not all(any(w in line for line in seen) for w in wanted):  # swept, and serving (its signals set)
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, "".join(seen)
            seen.append(line)
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=SERVE_WAIT_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        reader.join(SERVE_WAIT_S)
        server.stderr.close()
    assert code == 0, "".join(seen)
    database = Database(db_url)
    try:
        with database.read() as conn:
            run = runs.get(conn, crashed.run_id)
            kinds = [e.kind for e in ledger.read(conn, runs.MODULE, crashed.run_id)]
    finally:
        database.dispose()
    assert (run.status, run.recovery_status, run.attempt) == ("outcome_unknown", "outcome_unknown", 1)
    assert kinds[-1] == evidence.ATTEMPT_OUTCOME_UNKNOWN and run.warning and "reconcile" in run.warning
    assert len(harness.parquet_publications(crashed.sink)) == 1
    [listed] = cli("runs", "--json").json()
    assert listed["lease_expired"] is False and listed["unresolved"] is True  # swept: the lease is closed


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (("--sweep-interval", "-1"), "--sweep-interval must be 0 (never sweep)"),
        # inf killed the sweeper thread after the start (serving on, never sweeping); nan spun it.
        (("--sweep-interval", "inf"), "--sweep-interval must be 0 (never sweep)"),
        (("--sweep-interval", "nan"), "--sweep-interval must be 0 (never sweep)"),
        (("--port", "65536"), "--port must be 0 (any free port) to 65535"),  # uvicorn's OverflowError
        (("--port", "-1"), "--port must be 0"),
        (("--log-level", "bogus"), "--log-level must be one of: critical"),  # uvicorn's KeyError
        (("--host", ""), "--host must name an interface"),  # "" bound every interface
        (("--host", "no-such-host.invalid"), "--host does not resolve"),  # uvicorn exited 3: "unresolved"
    ],
)
def test_serve_refuses_options_it_cannot_serve_with(cli: Cli, options: tuple[str, ...], expected: str) -> None:
    """--sweep-interval 0 disables the sweeper; a negative, infinite or NaN one, a port outside 0..65535,
    an unknown log level and an empty host are usage errors (exit 2) before anything is served, with no
    traceback (uvicorn's own errors printed one)."""
    refused = cli("serve", *options)
    assert refused.code == 2 and expected in refused.stderr, refused.output
    assert "Traceback" not in refused.output
    assert "--sweep-interval" in cli("serve", "--help").stdout


@pytest.mark.parametrize("ttl", ["nan", "inf", "0", "-1"])
def test_worker_refuses_a_lease_ttl_that_is_not_a_positive_number(cli: Cli, ttl: str) -> None:
    """A NaN TTL passed the "<= 0" check and started the worker before its refusal."""
    refused = cli("worker", "--once", "--lease-ttl", ttl)
    assert refused.code == 2 and "--lease-ttl must be a positive number of seconds" in refused.stderr, refused.output
    assert "worker.started" not in refused.output
