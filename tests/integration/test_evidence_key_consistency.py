"""Issue 13, item 7: a process's evidence-key setting must match the ledger it extends, on both engines.

Finding (a): a run submitted without DATAFLOW_EVIDENCE_KEY and executed by a worker with one ended
`evidence_failed` after publishing. Now `worker`, `serve`, `run`, `submit` and `reconcile` refuse (exit 2)
when their setting differs from the ledger's newest entry (or, for reconcile, from the run's chain), and
never print the key. Finding (b): a keyed chain verified without the key said "verified", its MACs
ignored; now `dataflow verify` exits 1 and the API answers ok=false, naming the missing key.

Everything goes through the real CLI in a subprocess (`support.cli`), and the API through its app.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from durable_dataflow.api import tokens as api_tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.core import fencing, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.secrets import Secret
from durable_dataflow.platform import Platform
from support.cli import PUBLISH_EXAMPLE, Cli, CliResult, make_cli

DAY = "2026-11-02"
KEY_A = "canary-evidence-key-a-5e21"
KEY_B = "canary-evidence-key-b-9c07"
WITH_A = {"DATAFLOW_EVIDENCE_KEY": KEY_A}
WITH_B = {"DATAFLOW_EVIDENCE_KEY": KEY_B}
SERVE_TIMEOUT_S = 30  # a refused server exits at once; one that starts would listen until killed
UNCHECKED = "keyed entries not checked: set DATAFLOW_EVIDENCE_KEY"
INVALID_INPUT_EXIT = 2


@pytest.fixture
def definition(tmp_path: Path) -> Path:
    folder = tmp_path / "daily_orders_publish"
    shutil.copytree(PUBLISH_EXAMPLE, folder)
    shutil.rmtree(folder / "warehouse", ignore_errors=True)
    return folder / "dataflow.yaml"


@pytest.fixture
def cli(sqlite_url: str, tmp_path: Path) -> Cli:
    """The CLI on SQLite: what these tests prove is the processes' refusal, which reads the chain through
    ledger.check_key_setting; that check is proven on both engines by the tests at the end of this file."""
    return make_cli(sqlite_url, tmp_path)


def published_rows(definition: Path) -> int:
    files = list((definition.parent / "warehouse" / "daily_revenue" / "data").glob("*.parquet"))
    return sum(pq.read_table(f).num_rows for f in files)


def submit(cli: Cli, definition: Path, key: str, env: dict[str, str] | None, *extra: str) -> CliResult:
    return cli("submit", str(definition), "--param", f"day={DAY}", "--idempotency-key", key, "--json", *extra,
               extra_env=env)  # fmt: skip


def work(cli: Cli, env: dict[str, str] | None) -> CliResult:
    return cli("worker", "--until-idle", "--poll-interval", "0.05", extra_env=env)


def assert_refused(result: CliResult, *needles: str) -> None:
    """Exit 2 (invalid input/config) with one `error [invalid_input]` line naming the variable, never a key."""
    assert result.code == INVALID_INPUT_EXIT, result.output
    assert "error [invalid_input]:" in result.stderr and "DATAFLOW_EVIDENCE_KEY" in result.stderr, result.output
    for needle in needles:
        assert needle in result.stderr, result.output
    assert KEY_A not in result.output and KEY_B not in result.output, "the key must never be echoed"


def status_of(cli: Cli, run_id: str, env: dict[str, str] | None) -> str:
    shown = cli("show", run_id, "--json", extra_env=env)
    assert shown.code == 0, shown.output
    status: str = shown.json()["status"]
    return status


# ---- finding (a) and the worker ---------------------------------------------------------------


def test_worker_with_a_key_refuses_runs_recorded_without_it(cli: Cli, definition: Path) -> None:
    """Finding (a): a run submitted without the key is not executed by a worker with one (which used to publish
    and then end evidence_failed): the worker exits 2 before claiming, nothing is published, and a worker with
    the ledger's setting runs it to success. (The empty database accepted the keyed worker.)"""
    assert work(cli, WITH_A).code == 0, "an empty ledger accepts either setting"
    submitted = submit(cli, definition, "a-1", None)
    assert submitted.code == 0, submitted.output
    run_id = submitted.json()["run_id"]

    refused = work(cli, WITH_A)
    assert_refused(refused, "is not keyed")
    assert status_of(cli, run_id, None) == "queued"
    assert published_rows(definition) == 0, "nothing may be published by a refused worker"

    worked = work(cli, None)
    assert worked.code == 0, worked.output
    assert status_of(cli, run_id, None) == "succeeded"
    assert published_rows(definition) > 0
    assert cli("verify", run_id).code == 0


def test_worker_without_the_key_refuses_a_keyed_ledger(cli: Cli, definition: Path) -> None:
    """The other direction: runs recorded with a key are not extended by a worker without it. (The empty
    database accepted the unkeyed worker.)"""
    assert work(cli, None).code == 0, "an empty ledger accepts either setting"
    submitted = submit(cli, definition, "a-2", WITH_A)
    assert submitted.code == 0, submitted.output
    run_id = submitted.json()["run_id"]
    assert_refused(work(cli, None), "is keyed", "is not set")
    assert status_of(cli, run_id, WITH_A) == "queued" and published_rows(definition) == 0
    assert work(cli, WITH_A).code == 0
    assert status_of(cli, run_id, WITH_A) == "succeeded"
    assert cli("verify", run_id, extra_env=WITH_A).code == 0


def test_worker_with_another_key_refuses(cli: Cli, definition: Path) -> None:
    """A wrong key is a mismatch too: its MAC of the newest entry differs from the stored one."""
    submitted = submit(cli, definition, "a-3", WITH_A)
    assert submitted.code == 0, submitted.output
    assert_refused(work(cli, WITH_B), "not the key")
    assert status_of(cli, submitted.json()["run_id"], WITH_A) == "queued"
    assert published_rows(definition) == 0


# ---- serve, run, submit, reconcile --------------------------------------------------------------


def serve(cli: Cli, env: dict[str, str] | None) -> CliResult:
    """`dataflow serve` expected to refuse: bounded, so a server that starts fails the test instead of hanging."""
    argv = [sys.executable, "-m", "durable_dataflow.cli", "--db", cli.db_url, "serve", "--port", "0",
            "--data-root", str(cli.cwd / "data")]  # fmt: skip
    try:
        done = subprocess.run(argv, cwd=cli.cwd, env={**cli.env, **(env or {})}, capture_output=True, text=True,
                              timeout=SERVE_TIMEOUT_S, check=False)  # fmt: skip
    except subprocess.TimeoutExpired as started:
        raise AssertionError(f"dataflow serve started instead of refusing: {started.stderr!r}") from None
    return CliResult(done.returncode, done.stdout, done.stderr)


@pytest.mark.parametrize(
    ("written", "configured", "needle"),
    [
        pytest.param(None, WITH_A, "is not keyed", id="key-on-unkeyed"),
        pytest.param(WITH_A, None, "is not set", id="no-key-on-keyed"),
        pytest.param(WITH_A, WITH_B, "not the key", id="wrong-key"),
    ],
)
def test_serve_refuses_a_mismatched_setting(
    cli: Cli, definition: Path, written: dict[str, str] | None, configured: dict[str, str] | None, needle: str
) -> None:
    """`dataflow serve` (which records, executes and reconciles runs) refuses to start, exit 2, without the key."""
    assert submit(cli, definition, "s-1", written).code == 0
    assert_refused(serve(cli, configured), needle)


def test_run_and_submit_refuse_and_adopting_takes_an_explicit_option(cli: Cli, definition: Path) -> None:
    """`dataflow run` and `dataflow submit` refuse the other setting too; `submit --adopt-evidence-key` records
    the first run of the new setting, after which keyed workers start and the run verifies with the key."""
    first = cli("run", str(definition), "--param", f"day={DAY}", "--idempotency-key", "r-1", "--json")
    assert first.code == 0, first.output
    rows = published_rows(definition)
    assert_refused(cli("run", str(definition), "--param", "day=2026-11-03", extra_env=WITH_A), "is not keyed")
    assert_refused(submit(cli, definition, "r-2", WITH_A), "is not keyed")
    assert published_rows(definition) == rows

    adopted = submit(cli, definition, "r-2", WITH_A, "--adopt-evidence-key")
    assert adopted.code == 0, adopted.output
    assert_refused(work(cli, None), "is not set")
    assert work(cli, WITH_A).code == 0
    run_id = adopted.json()["run_id"]
    assert status_of(cli, run_id, WITH_A) == "succeeded"
    assert cli("verify", run_id, extra_env=WITH_A).code == 0
    # The history from before keeps its own setting: it verifies without the key.
    assert cli("verify", first.json()["run_id"]).code == 0


def test_reconcile_refuses_a_chain_of_the_other_setting(cli: Cli, definition: Path) -> None:
    """`dataflow reconcile` extends the run's own chain: without that chain's key it exits 2 (it used to go on
    to the status check) and with the key it answers as before (5: nothing to reconcile)."""
    ran = cli("run", str(definition), "--param", f"day={DAY}", "--idempotency-key", "c-1", "--json", extra_env=WITH_A)
    assert ran.code == 0, ran.output
    run_id = ran.json()["run_id"]
    assert_refused(cli("reconcile", run_id), "is keyed")
    assert cli("reconcile", run_id, extra_env=WITH_A).code == 5


# ---- finding (b): verification without the key ----------------------------------------------------


def test_verify_without_the_key_does_not_say_verified(
    cli: Cli, definition: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding (b): `dataflow verify` of a keyed chain without the key exits 1 naming the missing key (it used
    to print "evidence verified", MACs ignored); `--json` and the API's evidence answer carry ok=false and the
    reason; with the key it verifies."""
    ran = cli("run", str(definition), "--param", f"day={DAY}", "--idempotency-key", "v-1", "--json", extra_env=WITH_A)
    assert ran.code == 0, ran.output
    run_id = ran.json()["run_id"]

    plain = cli("verify", run_id)
    assert plain.code == 1, plain.output
    assert "evidence NOT verified: " + UNCHECKED in plain.stdout  # no "(broken at seq N)": nothing is broken
    as_json = cli("verify", run_id, "--json")
    assert as_json.code == 1, as_json.output
    document = as_json.json()
    assert document["ok"] is False and document["keyed"] is True and UNCHECKED in document["reason"]
    assert document["broken_seq"] is None
    assert cli("verify", run_id, extra_env=WITH_A).code == 0

    monkeypatch.delenv("DATAFLOW_EVIDENCE_KEY", raising=False)
    with Platform(cli.db_url) as platform:
        token, _ = api_tokens.create_token(platform.db, "default", "viewer", "key-check")
        (tmp_path / "data").mkdir(exist_ok=True)
        with TestClient(create_app(platform, data_root=tmp_path / "data")) as client:
            answer = client.get(f"/v1/runs/{run_id}/evidence", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200, answer.text
    verification = answer.json()["verification"]
    assert verification["ok"] is False and UNCHECKED in verification["reason"]
    assert verification["broken_seq"] is None


def test_a_chain_mixing_settings_verifies_under_neither(db: Database) -> None:
    """What finding (a) left behind, built directly: an unkeyed first entry, keyed ones after. With the key the
    unkeyed entry fails its MAC; without it the keyed entries go unchecked: neither says ok."""
    key = Secret("DATAFLOW_EVIDENCE_KEY", KEY_A)
    with db.begin() as conn:
        leases.acquire(conn, db, "test", "mixed", "writer", 30)
    with fencing.fenced(db, "test", "mixed", 1) as conn:
        ledger.append(conn, db, "test", "mixed", 1, "step.0", {"i": 0})
        ledger.append(conn, db, "test", "mixed", 1, "step.1", {"i": 1}, evidence_key=key)
    with db.read() as conn:
        keyed = ledger.verify(conn, "test", "mixed", evidence_key=key)
        unkeyed = ledger.verify(conn, "test", "mixed")
    assert not keyed.ok and keyed.broken_seq == 1 and "keyed MAC" in keyed.reason
    assert not unkeyed.ok and unkeyed.broken_seq is None and unkeyed.reason == ledger.KEYED_UNCHECKED_REASON


# ---- the check itself ---------------------------------------------------------------------------


def test_check_key_setting_reads_the_newest_entry_of_every_module(db: Database) -> None:
    """The check reads one entry per module (the head of its last subject, by primary key) and decides from the
    newest of them: an older keyed module does not make a ledger whose newest entry is unkeyed keyed."""
    key = Secret("DATAFLOW_EVIDENCE_KEY", KEY_A)
    with db.read() as conn:
        assert ledger.check_key_setting(conn, None) == "" and ledger.check_key_setting(conn, key) == ""
    for module, evidence_key in (("alpha", key), ("beta", None)):
        with db.begin() as conn:
            leases.acquire(conn, db, module, "s1", "writer", 30)
        with fencing.fenced(db, module, "s1", 1) as conn:
            ledger.append(conn, db, module, "s1", 1, "step", {}, evidence_key=evidence_key)
        db.advance_clock(1)  # the next module's entry is newer by the database clock
    with db.read() as conn:
        assert [e.module for e in ledger.newest_entries(conn)] == ["beta", "alpha"]
        assert ledger.check_key_setting(conn, None) == ""
        assert "is not keyed" in ledger.check_key_setting(conn, key)
        assert "is keyed" in ledger.check_key_setting(conn, None, subject=("alpha", "s1"))
        assert ledger.check_key_setting(conn, key, subject=("alpha", "s1")) == ""
        wrong = ledger.check_key_setting(conn, Secret("DATAFLOW_EVIDENCE_KEY", KEY_B), subject=("alpha", "s1"))
        assert "not the key" in wrong and KEY_B not in wrong and KEY_A not in wrong


def test_the_newest_entries_are_found_through_the_primary_key(db: Database) -> None:
    """The start-up check stays cheap on a large ledger: each statement ``newest_entries`` runs is planned as an
    index search of the primary key, never a scan with a sort."""
    statements: list[tuple[str, object]] = []

    def record(conn: object, cursor: object, statement: str, parameters: object, *args: object) -> None:
        if "FROM ledger_entries" in statement and not statement.startswith("EXPLAIN"):
            statements.append((statement, parameters))

    engine = db.read_engine
    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        with db.read() as conn:
            ledger.newest_entries(conn)
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    assert statements, "newest_entries reads the ledger"
    # SET LOCAL needs a transaction, which PostgreSQL reads (autocommit) do not open: EXPLAIN in one.
    with db.read() if db.dialect == "sqlite" else db.begin() as conn:
        for statement, parameters in statements:
            if db.dialect == "sqlite":
                rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters).all()  # type: ignore[arg-type]
                plan = " ".join(str(row[-1]) for row in rows)
                assert "USING INDEX" in plan and "TEMP B-TREE" not in plan, plan
            else:
                conn.exec_driver_sql("SET LOCAL enable_seqscan = off")  # an empty test table would favour a scan
                rows = conn.exec_driver_sql(f"EXPLAIN {statement}", parameters).all()  # type: ignore[arg-type]
                plan = " ".join(str(row[0]) for row in rows)
                assert "Index" in plan and "Sort" not in plan, plan
