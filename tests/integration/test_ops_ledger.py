"""The Ops ledger projection on SQLite and PostgreSQL: counts by module and recovery status, unresolved
runs with database-clock ages, tenant scoping, expired leases, read-only-ness, and the CLI commands."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from durable_dataflow.cli import app as cli_app
from durable_dataflow.core.schema import checkpoints, leases, ledger_entries
from durable_dataflow.dataflow.definitions import load_definition
from durable_dataflow.dataflow.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.ops import ledger
from durable_dataflow.platform import Platform
from support.api_runs import copy_examples, make_atomic_run, make_outcome_unknown_run


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url) as opened:
        yield opened


def _snapshot(platform: Platform) -> list[object]:
    with platform.db.read() as conn:
        return [conn.execute(sa.select(t)).all() for t in (ledger_entries, leases, checkpoints, dataflow_runs)]


def test_projection_counts_unresolved_and_ages(platform: Platform, tmp_path: Path) -> None:
    """Two tenants' runs: platform-wide counts, the unresolved run with its age and warning, and no writes."""
    examples = copy_examples(tmp_path)
    make_atomic_run(platform, examples, "acme")
    unknown = make_outcome_unknown_run(platform, examples, "acme")
    make_atomic_run(platform, examples, "globex")
    before = _snapshot(platform)
    platform.db.advance_clock(120)  # ages use the database clock
    view = ledger.read_projection(platform.db)
    assert _snapshot(platform) == before  # Ops only reads
    assert view.tenant is None
    assert view.runs_by_status == {"outcome_unknown": 1, "succeeded": 2}
    assert view.runs_by_recovery_status == {"outcome_unknown": 1, "verified": 2}
    [module] = view.modules
    # Every terminal state is checkpointed, the unresolved one too.
    assert (module.module, module.subjects, module.checkpoints) == ("dataflow", 3, 3)
    assert module.entries is None, "entries are counted only on request (a full ledger scan)"
    [counted] = ledger.read_projection(platform.db, count_entries=True).modules
    with platform.db.read() as conn:
        assert counted.entries == conn.execute(sa.select(sa.func.count()).select_from(ledger_entries)).scalar_one()
    assert counted.subjects == module.subjects
    assert view.unresolved_total == 1
    assert view.oldest_unresolved is not None and view.oldest_unresolved.run_id == unknown.run_id
    assert view.oldest_unresolved.age_s >= 120
    assert view.oldest_unresolved.output_digest == unknown.output_digest
    assert "UNRESOLVED" in view.oldest_unresolved.warning
    globex = ledger.read_projection(platform.db, tenant="globex")
    assert globex.unresolved_total == 0 and globex.runs_by_status == {"succeeded": 1}
    assert globex.modules[0].subjects == 1


def test_projection_counts_live_and_expired_leases(platform: Platform, tmp_path: Path) -> None:
    """A claimed run's lease is live, then, after the database clock passes its expiry, expired and unswept."""
    loaded = load_definition(copy_examples(tmp_path) / "revenue_by_region" / "dataflow.yaml")
    request = RunRequest(
        loaded.definition, loaded.base_dir, {"day": "2026-11-02"},
        AccessContext("acme", "test"), Provenance("test", "cli"),
    )  # fmt: skip
    platform.runs.submit(request, claim=True)
    live = ledger.read_projection(platform.db).modules[0]
    assert (live.leases_live, live.leases_expired) == (1, 0)
    platform.db.advance_clock(platform.runs.config.lease_ttl_s + 5)
    expired = ledger.read_projection(platform.db).modules[0]
    assert (expired.leases_live, expired.leases_expired) == (0, 1)


def test_cli_ops_ledger_and_tokens(db_url: str, tmp_path: Path) -> None:
    """`dataflow ops ledger --json` prints the projection; `tokens create|list|revoke` never list a token."""
    with Platform(db_url) as platform:
        unknown = make_outcome_unknown_run(platform, copy_examples(tmp_path), "acme")
    runner = CliRunner()
    shown = runner.invoke(cli_app, ["--db", db_url, "ops", "ledger", "--json"])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.stdout)
    assert data["unresolved_total"] == 1 and data["oldest_unresolved"]["run_id"] == unknown.run_id
    table = runner.invoke(cli_app, ["--db", db_url, "ops", "ledger"])
    assert table.exit_code == 0 and "Unresolved runs: 1" in table.stdout and unknown.run_id in table.stdout
    created = runner.invoke(cli_app, ["--db", db_url, "tokens", "create", "--tenant", "acme", "--role", "operator"])
    assert created.exit_code == 0, created.output
    token = created.stdout.strip().splitlines()[0]
    assert token.startswith("ddf_")
    listed = runner.invoke(cli_app, ["--db", db_url, "tokens", "list", "--json"])
    assert listed.exit_code == 0 and token not in listed.stdout
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert row["tenant"] == "acme" and row["role"] == "operator" and row["revoked_at_us"] is None
    revoked = runner.invoke(cli_app, ["--db", db_url, "tokens", "revoke", row["token_id"]])
    assert revoked.exit_code == 0, revoked.output
    after = json.loads(runner.invoke(cli_app, ["--db", db_url, "tokens", "list", "--json"]).stdout)
    assert after["revoked_at_us"] is not None
    bad = runner.invoke(cli_app, ["--db", db_url, "tokens", "create", "--tenant", "acme", "--role", "root"])
    assert bad.exit_code != 0
