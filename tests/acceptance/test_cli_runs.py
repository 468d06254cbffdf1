"""Acceptance: `dataflow run`, replay, conflict, `runs`, `show`, `verify` and `result` as subprocesses.

The run/replay/conflict and evidence tests run on SQLite and PostgreSQL (the `engine_url` fixture);
the export tests run on SQLite only, since they exercise the CLI rather than the engine.
"""

from __future__ import annotations

import csv
import decimal
import io
import json
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from durable_dataflow.core.db import Database
from durable_dataflow.core.schema import ledger_entries
from support.cli import REVENUE_EXAMPLE, Cli, make_cli

DAY = "2026-11-02"
KEY = "acceptance-revenue"
RUN_JSON_FIELDS = (
    "run_id", "tenant", "idempotency_key", "mode", "status", "recovery_status", "attempt", "definition_hash",
    "request_hash", "access_context_digest", "provenance", "source_fingerprint_digest", "output_digest",
    "row_count", "warning",
)  # fmt: skip


@pytest.fixture(params=["sqlite", "postgres"])
def engine_url(request: pytest.FixtureRequest) -> str:
    """The platform database, once per engine."""
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def cli(engine_url: str, tmp_path: Path) -> Cli:
    return make_cli(engine_url, tmp_path)


@pytest.fixture
def sqlite_cli(sqlite_url: str, tmp_path: Path) -> Cli:
    return make_cli(sqlite_url, tmp_path)


def run_revenue(cli: Cli, day: str = DAY, key: str = KEY) -> dict[str, object]:
    result = cli("run", str(REVENUE_EXAMPLE), "--param", f"day={day}", "--idempotency-key", key, "--json")
    assert result.code == 0, result.output
    data: dict[str, object] = result.json()
    return data


def expected_revenue(day: str) -> list[tuple[str, decimal.Decimal, int]]:
    """The report computed independently from the example's CSV files (the oracle for `result`)."""
    data = REVENUE_EXAMPLE.parent / "data"
    with (data / "customers.csv").open() as f:
        region = {row["customer_id"]: row["region"] for row in csv.DictReader(f)}
    revenue: dict[str, decimal.Decimal] = defaultdict(decimal.Decimal)
    orders: dict[str, int] = defaultdict(int)
    with (data / "orders.csv").open() as f:
        for row in csv.DictReader(f):
            if row["order_day"] == day and row["status"] == "completed":
                revenue[region[row["customer_id"]]] += decimal.Decimal(row["amount"])
                orders[region[row["customer_id"]]] += 1
    return [(r, revenue[r], orders[r]) for r in sorted(revenue)]


def test_run_replay_and_conflict(cli: Cli) -> None:
    """A run succeeds with every documented JSON field; a replay returns it and writes nothing; another request
    under the same key exits 5 and writes nothing — checked through `runs --json` and the ledger in `show`."""
    first = run_revenue(cli)
    missing = [f for f in RUN_JSON_FIELDS if f not in first]
    assert not missing, f"run JSON lacks {missing}"
    assert first["status"] == "succeeded" and first["replayed"] is False and first["unresolved"] is False
    assert first["idempotency_key"] == KEY and first["mode"] == "atomic" and first["attempt"] == 1
    assert first["row_count"] == len(expected_revenue(DAY))
    assert first["provenance"]["trigger"] == "cli"  # type: ignore[index]
    ledger_before = cli("show", str(first["run_id"]), "--json").json()["ledger"]

    replay = cli("run", str(REVENUE_EXAMPLE), "--param", f"day={DAY}", "--idempotency-key", KEY, "--json")
    assert replay.code == 0, replay.output
    assert replay.json()["run_id"] == first["run_id"] and replay.json()["replayed"] is True
    assert "replayed: existing run returned, nothing executed" in replay.stderr

    conflict = cli("run", str(REVENUE_EXAMPLE), "--param", "day=2026-11-03", "--idempotency-key", KEY, "--json")
    assert conflict.code == 5, conflict.output
    assert conflict.stderr.startswith("error [conflict]:") and conflict.stdout == ""
    assert "Traceback" not in conflict.stderr

    listed = cli("runs", "--json")
    assert listed.code == 0, listed.output
    assert [r["run_id"] for r in listed.json()] == [first["run_id"]]
    assert cli("show", str(first["run_id"]), "--json").json()["ledger"] == ledger_before


def test_show_verify_then_tamper(cli: Cli, engine_url: str) -> None:
    """`show` lists the ledger and checkpoint and `verify` exits 0; after one ledger row is altered with
    SQLAlchemy, `verify` exits 1 and names the broken seq."""
    run_id = str(run_revenue(cli)["run_id"])
    shown = cli("show", run_id, "--json")
    assert shown.code == 0, shown.output
    kinds = [(e["seq"], e["kind"]) for e in shown.json()["ledger"]]
    assert kinds == [(1, "run.recorded"), (2, "attempt.started"), (3, "result.committed"), (4, "run.succeeded")]
    assert shown.json()["checkpoint"]["status"] == "succeeded" and shown.json()["checkpoint"]["head_seq"] == 4
    human = cli("show", run_id[-12:])  # the short id the history shows is accepted
    assert human.code == 0 and "result.committed" in human.stdout and "checkpoint: succeeded" in human.stdout

    verified = cli("verify", run_id)
    assert verified.code == 0, verified.output
    assert "evidence verified: 4 entries" in verified.stdout

    database = Database(engine_url)
    try:
        with database.begin() as conn:
            conn.execute(
                ledger_entries.update()
                .where(ledger_entries.c.subject_id == run_id, ledger_entries.c.seq == 2)
                .values(payload_json=json.dumps({"holder": "someone-else"}))
            )
    finally:
        database.dispose()
    broken = cli("verify", run_id)
    assert broken.code == 1, broken.output
    assert "NOT verified" in broken.stdout and "seq 2" in broken.stdout
    as_json = cli("verify", run_id, "--json")
    assert as_json.code == 1 and as_json.json()["ok"] is False and as_json.json()["broken_seq"] == 2


def test_result_exports_exact_rows(sqlite_cli: Cli, tmp_path: Path) -> None:
    """`result` gives exactly the rows computed independently from the example CSVs, as CSV, JSON and Parquet."""
    run_id = str(run_revenue(sqlite_cli)["run_id"])
    expected = expected_revenue(DAY)
    as_csv = sqlite_cli("result", run_id, "--format", "csv")
    assert as_csv.code == 0, as_csv.output
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [(r["region"], decimal.Decimal(r["revenue"]), int(r["orders"])) for r in rows] == expected

    as_json = sqlite_cli("result", run_id, "--format", "json")
    assert [(r["region"], decimal.Decimal(r["revenue"]), r["orders"]) for r in as_json.json()] == expected

    target = tmp_path / "out.parquet"
    written = sqlite_cli("result", run_id, "--format", "parquet", "--output", str(target))
    assert written.code == 0, written.output
    table = pq.read_table(target)
    assert [(r["region"], r["revenue"], r["orders"]) for r in table.to_pylist()] == expected

    unknown = sqlite_cli("result", run_id, "--format", "xlsx")
    assert unknown.code == 2 and "error [invalid_input]" in unknown.stderr


def test_runs_filters_and_exit_codes(sqlite_cli: Cli) -> None:
    """`runs` filters by status and definition; an unknown run exits 4, a bad --param exits 2, a bad filter 2."""
    run_revenue(sqlite_cli)
    assert len(sqlite_cli("runs", "--status", "succeeded", "--json").json()) == 1
    assert sqlite_cli("runs", "--status", "failed", "--json").json() == []
    assert sqlite_cli("runs", "--definition", "nope", "--json").json() == []
    table = sqlite_cli("runs")
    assert table.code == 0 and "revenue_by_region" in table.stdout and "succeeded" in table.stdout

    missing = sqlite_cli("show", "01a00000-0000-7000-8000-000000000000")
    assert missing.code == 4 and missing.stderr.startswith("error [not_found]:")
    bad_param = sqlite_cli("run", str(REVENUE_EXAMPLE), "--param", "day")
    assert bad_param.code == 2 and "NAME=VALUE" in bad_param.stderr
    wrong_type = sqlite_cli("run", str(REVENUE_EXAMPLE), "--param", "day=yesterday")
    assert wrong_type.code == 2 and "day" in wrong_type.stderr and "Traceback" not in wrong_type.stderr
    assert sqlite_cli("runs", "--status", "bogus").code == 2
    assert len(sqlite_cli("runs", "--json").json()) == 1  # the refused runs wrote nothing


def test_runs_shows_and_filters_by_parameters(cli: Cli) -> None:
    """`runs` has a parameters column and `--param NAME=VALUE` keeps the runs holding that canonical value
    (repeatable, all must match); a --param without NAME= exits 2 naming its position, never echoing it."""
    first = run_revenue(cli, day="2026-11-02", key="day-02")
    second = run_revenue(cli, day="2026-11-03", key="day-03")
    listed = cli("runs", "--param", "day=2026-11-03", "--json")
    assert listed.code == 0, listed.output
    assert [r["run_id"] for r in listed.json()] == [second["run_id"]]
    assert listed.json()[0]["parameters"] == {"day": "2026-11-03"}
    both = cli("runs", "--param", "day=2026-11-02", "-p", "day=2026-11-03", "--json")
    assert both.code == 2 and "more than once" in both.stderr
    table = cli("runs", "--param", "day=2026-11-02", "--definition", "revenue_by_region")
    assert table.code == 0 and "parameters" in table.stdout and "day=2026-11-02" in table.stdout
    assert str(first["run_id"])[-8:] in table.stdout and str(second["run_id"])[-8:] not in table.stdout
    assert cli("runs", "--param", "day=2026-11-04", "--json").json() == []
    secret = cli("runs", "--param", "day=2026-11-02", "--param", "s3cr3t-token")
    assert secret.code == 2 and "--param number 2" in secret.stderr and "s3cr3t" not in secret.output
    control = cli("runs", "--param", "day=2026\x1b[2J")
    assert control.code == 2 and "control character" in control.stderr


def test_tampered_result_is_reported_by_verify(sqlite_cli: Cli, sqlite_url: str) -> None:
    """Changing the stored result bytes makes `verify` exit 1 with the digest reason (facts, not the chain)."""
    run_id = str(run_revenue(sqlite_cli)["run_id"])
    other = run_revenue(sqlite_cli, day="2026-11-03", key="other-day")
    database = Database(sqlite_url)
    try:
        with database.begin() as conn:
            stolen = conn.execute(sa.text("SELECT bytes FROM run_results WHERE run_id = :r"), {"r": other["run_id"]})
            conn.execute(
                sa.text("UPDATE run_results SET bytes = :b WHERE run_id = :r"), {"b": stolen.scalar_one(), "r": run_id}
            )
    finally:
        database.dispose()
    broken = sqlite_cli("verify", run_id)
    assert broken.code == 1 and "output digest" in broken.stdout, broken.output
