"""The Ops ledger projection on SQLite and PostgreSQL: counts by module and recovery status, unresolved
runs with database-clock ages, tenant scoping, expired leases, read-only-ness, and the CLI commands."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from durable_dataflow.api import tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.cli import app as cli_app
from durable_dataflow.cli.common import short_id
from durable_dataflow.core import crashpoints
from durable_dataflow.core.schema import checkpoints, leases, ledger_entries
from durable_dataflow.dataflow.definitions.definitions import load_definition
from durable_dataflow.dataflow.protocol import cancel, runs, views
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.ops import ledger
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import copy_examples, make_atomic_run, make_outcome_unknown_run, web_login


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


def _crashed_forward_run(platform: Platform, examples: Path, tenant: str, point: str, day: str) -> Run:
    """A forward run whose process 'dies' at ``point`` (an in-process crash-point hook raising SystemExit):
    its attempt keeps its lease, which nobody heartbeats any more."""

    def crash(reached: str) -> None:
        if reached == point:
            raise SystemExit(f"simulated crash at {point}")

    loaded = load_definition(examples / "daily_orders_publish" / "dataflow.yaml")
    request = RunRequest(
        loaded.definition, loaded.base_dir, {"day": day},
        AccessContext(tenant, "test", roles=("operator",), auth_method="test"), Provenance("test", "cli"),
        idempotency_key=f"{tenant}-{day}",
    )  # fmt: skip
    crashpoints.set_hook(crash)
    try:
        with pytest.raises(SystemExit):
            platform.runs.run_inline(request)
    finally:
        crashpoints.set_hook(None)
    with platform.db.read() as conn:
        crashed = runs.find_by_key(conn, tenant, f"{tenant}-{day}")
    assert crashed is not None
    return crashed


def test_ops_and_metrics_count_an_expired_authorized_run_as_the_read_views_do(
    platform: Platform, tmp_path: Path
) -> None:
    """Issue 26, finding 2: a forward run that died after its provider call (running / dispatch_authorized)
    whose lease expired on the database clock is unresolved in the Ops projection (CLI/API/page), in
    `dataflow_unresolved_runs` and in the read views alike; one that died before authorization is not, and
    neither is one whose lease is still live. Crashes are in-process crash-point hooks; the lease expires by
    advancing this platform's database clock, so nothing waits."""
    examples = copy_examples(tmp_path)
    published = _crashed_forward_run(platform, examples, "acme", crashpoints.AFTER_PROVIDER_CALL, "2026-11-02")
    claimed = _crashed_forward_run(platform, examples, "globex", crashpoints.AFTER_CLAIM, "2026-11-03")
    assert (published.status, published.recovery_status) == ("running", "dispatch_authorized")
    assert (claimed.status, claimed.recovery_status) == ("running", "leased")
    live = ledger.read_projection(platform.db)
    assert live.unresolved_total == 0, "a live attempt is running, not unresolved"
    platform.db.advance_clock(platform.runs.config.lease_ttl_s + 5)
    before = _snapshot(platform)

    view = ledger.read_projection(platform.db)
    assert view.unresolved_total == 1 and [u.run_id for u in view.unresolved] == [published.run_id]
    assert view.oldest_unresolved is not None and view.oldest_unresolved.run_id == published.run_id
    shown = view.oldest_unresolved
    assert (shown.status, shown.recovery_status) == ("running", "dispatch_authorized")
    assert "lease expired after dispatch authorization" in shown.warning
    assert f"dataflow reconcile {published.run_id}" in shown.warning
    assert ledger.read_projection(platform.db, tenant="acme").unresolved_total == 1
    assert ledger.read_projection(platform.db, tenant="globex").unresolved_total == 0
    with platform.db.read() as conn:
        listed = views.load(conn, platform.db, runs.list_page(conn))
    assert {v.run.run_id for v in listed if v.unresolved} == {published.run_id}, "the views count the same run"

    platform_token = tokens.create_platform_token(platform.db, "oncall")[0]
    operator = tokens.create_token(platform.db, "acme", "operator", "acme-operator")[0]
    app = create_app(platform, data_root=examples / "revenue_by_region")
    with TestClient(app) as client, TestClient(app, follow_redirects=False) as browser:
        metrics = client.get("/metrics", headers={"Authorization": f"Bearer {platform_token}"}).text
        api = client.get("/v1/ops/ledger", headers={"Authorization": f"Bearer {operator}"}).json()
        assert web_login(browser, operator).status_code == 303
        page = browser.get("/ui/ops").text
    assert "dataflow_unresolved_runs 1.0" in metrics
    assert "dataflow_oldest_unresolved_age_seconds 0.0" not in metrics
    assert api["unresolved_total"] == 1 and [u["run_id"] for u in api["unresolved"]] == [published.run_id]
    assert published.run_id in page and claimed.run_id not in page
    assert _snapshot(platform) == before  # Ops and metrics only read: nothing was swept


def test_ops_ledger_splits_failed_from_cancelled_and_lists_failures_by_error_code(
    db_url: str, tmp_path: Path
) -> None:
    """Proves issue 33 finding 6: a failed and a cancelled run share the recovery status no_external_output,
    yet `dataflow ops ledger` (table and --json) shows them as two states, and lists the recent failure under
    its error code; `dataflow runs` has an error column with the failed run's code."""
    with Platform(db_url) as platform:
        bad = flows.definition(sql="select region, 'x'::INTEGER as total, 1::BIGINT as n from sales")
        failed = platform.runs.run_inline(flows.request(bad, tmp_path, "failing")).run
        queued = platform.runs.submit(flows.request(flows.definition(), tmp_path, "to-cancel")).run
        cancel.cancel(
            platform.runs, queued.run_id, access=AccessContext("acme", "op", ("operator",), (), "test"),
            provenance=Provenance("op", "api"),
        )  # fmt: skip
    assert (failed.status, failed.error_code) == ("failed", "execution_failed")
    runner = CliRunner()
    shown = runner.invoke(cli_app, ["--db", db_url, "ops", "ledger", "--json"])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.stdout)
    assert {(s["status"], s["recovery_status"], s["runs"]) for s in data["runs_by_state"]} == {
        ("failed", "no_external_output", 1), ("cancelled", "no_external_output", 1),
    }  # fmt: skip
    assert data["recent_failures"] == {"execution_failed": 1}
    table = runner.invoke(cli_app, ["--db", db_url, "ops", "ledger"], terminal_width=200)
    assert table.exit_code == 0, table.output
    rows = [" ".join(line.replace("│", " ").split()) for line in table.stdout.splitlines()]
    assert "failed no_external_output 1" in rows and "cancelled no_external_output 1" in rows
    assert "execution_failed 1" in rows
    history = runner.invoke(cli_app, ["--db", db_url, "runs"], terminal_width=250)
    assert history.exit_code == 0, history.output
    header = next(line for line in history.stdout.splitlines() if "recovery" in line).replace("┃", " ").split()
    assert header.index("error") == header.index("recovery") + 1
    [failed_row] = [line for line in history.stdout.splitlines() if short_id(failed.run_id) in line]
    assert "execution_failed" in failed_row
