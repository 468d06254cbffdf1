"""Holes a red team found in the transition table (issue 13), each now closed: a damaged run row must not
stop the sweeper, a worker or a reconcile (H1); an edited target, tenant or workspace column must not be
settled, fenced or published under (H2, H2b); resume verifies before it dispatches (H3); derive() never
raises on a payload (H4). The rows are edited the way someone with write access to dataflow_runs (but not
the ledger's chain) could."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_dataflow.core import crashpoints, ledger
from durable_dataflow.dataflow.protocol import runs, sweeper, transitions
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows


def _parquet_faulty(fault: str, inspect_fault: str = "none") -> FaultInjectingProvider:
    return flows.install_faulty(fault, inspect_fault, ParquetFolderProvider())


def _edit_row(platform: Platform, run_id: str, **values: object) -> None:
    with platform.db.begin() as conn:
        conn.execute(dataflow_runs.update().where(dataflow_runs.c.run_id == run_id).values(**values))


def _crash_after_provider_call(platform: Platform, tmp_path: Path, key: str) -> Run:
    def crash(point: str) -> None:
        if point == crashpoints.AFTER_PROVIDER_CALL:
            raise SystemExit("crash")

    crashpoints.set_hook(crash)
    with pytest.raises(SystemExit):
        flows.forward(platform, tmp_path, "parquet", key)
    crashpoints.set_hook(None)
    with platform.db.read() as conn:
        found = [r for r in runs.list_page(conn) if r.idempotency_key == key]
    assert len(found) == 1 and found[0].status == "running"
    return found[0]


# ---- H1: one bad row poisons every sweep (and every worker loop) ------------------------------


@pytest.mark.parametrize(("column", "value"), [("row_count", 999), ("attempt", 7)])
def test_h1_one_tampered_row_does_not_stop_the_sweeper(
    platform: Platform, tmp_path: Path, column: str, value: object
) -> None:
    """A damaged projection (what `dataflow verify` reports) never makes sweep() raise: the lease after it is
    still decided. (Found: EvidenceError or StaleAttempt escaped _sweep_one, stopped the sweep and the worker,
    and left every later-expired authorized run running for ever.)"""
    poisoned = _crash_after_provider_call(platform, tmp_path, "poisoned")
    platform.db.advance_clock(1)  # the poisoned lease expires first: sweep visits it first
    other = _crash_after_provider_call(platform, tmp_path, "other")
    _edit_row(platform, poisoned.run_id, **{column: value})
    platform.db.advance_clock(60)
    decisions = sweeper.sweep(platform.db)
    assert {d.run_id for d in decisions} >= {other.run_id}
    assert platform.runs.get(other.run_id).status == "outcome_unknown"


# ---- H2: reconcile trusts unauthenticated projection columns -------------------------------------


def test_h2_invalid_target_from_an_edited_target_column(platform: Platform, tmp_path: Path) -> None:
    """The run published and lost the answer (the manifest exists); the target column is edited to an absolute
    location. verify notices (every dispatch.authorized holds the real target), and reconcile acts on nothing:
    the run is never failed / no_external_output while its publication exists. (Found: reconcile judged the
    edited column and declared invalid_target.)"""
    _parquet_faulty("timeout_after_commit")
    unknown = flows.forward(platform, tmp_path, "faulty", "laundered")
    assert unknown.status == "outcome_unknown"
    assert len(flows.manifests(tmp_path / "sink")) == 1  # the publication exists
    target = dict(unknown.target or {})
    target["location"] = "/nowhere/sink"
    import json

    _edit_row(platform, unknown.run_id, target_json=json.dumps(target, sort_keys=True))
    assert not flows.verify(platform, unknown.run_id).ok, "verify compares the target with every authorization's"
    settled = flows.reconcile_as_operator(platform, unknown.run_id)
    run = platform.runs.get(unknown.run_id)
    # What must hold: a run whose key is published at its real target is never failed / no_external_output.
    assert not (run.status == "failed" and run.recovery_status == "no_external_output"), (
        settled.finding,
        run.error_message,
        flows.verify(platform, unknown.run_id),
    )


def test_h2b_edited_tenant_column_publishes_a_second_time(platform: Platform, tmp_path: Path) -> None:
    """The tenant column is edited: verify notices (run.recorded holds the identity), and reconcile --resume
    neither fences nor publishes another key, so the sink keeps one publication. (Found: the key was rebuilt
    from the edited tenant, proven absent and published a second time.)"""
    _parquet_faulty("timeout_after_commit")
    unknown = flows.forward(platform, tmp_path, "faulty", "twice")
    assert unknown.status == "outcome_unknown"
    assert len(flows.manifests(tmp_path / "sink")) == 1
    _edit_row(platform, unknown.run_id, tenant="other")
    assert not flows.verify(platform, unknown.run_id).ok, "verify compares the identity with run.recorded's"
    registry.register_provider("faulty", ParquetFolderProvider)
    done = flows.reconcile_as_operator(platform, unknown.run_id, resume=True)
    published = flows.manifests(tmp_path / "sink")
    assert len(published) == 1, (done.finding, done.detail, [m.get("key") for m in published])


# ---- H3: resume re-dispatches on a chain that does not verify -----------------------------------


def test_h3_resume_verifies_the_chain_before_dispatch(platform: Platform, tmp_path: Path) -> None:
    """A reconciled_absent run whose ledger was damaged is not resumed: nothing is published on evidence that does
    not verify, as authorize_dispatch already refuses. (Found: resume dispatched, then ended evidence_failed with
    its output at the sink.)"""
    _parquet_faulty("fail_before_send")
    never_sent = flows.forward(platform, tmp_path, "faulty", "resume-broken")
    registry.register_provider("faulty", ParquetFolderProvider)
    absent = flows.reconcile_as_operator(platform, never_sent.run_id)
    assert absent.finding == "absent"
    with platform.db.begin() as conn:  # damage an entry (the chain no longer verifies)
        conn.execute(
            sa.text("UPDATE ledger_entries SET payload_json = :p WHERE subject_id = :s AND seq = 2"),
            {"p": '{"holder": "someone else"}', "s": never_sent.run_id},
        )
    assert not flows.verify(platform, never_sent.run_id).ok
    flows.reconcile_as_operator(platform, never_sent.run_id, resume=True)
    assert flows.manifests(tmp_path / "sink") == [], "published on evidence that does not verify"


# ---- H4: derive() crashes on a digit-like row_count ---------------------------------------------


def test_h4_derive_never_raises_on_a_payload() -> None:
    """derive() never raises on a payload: '²'.isdigit() is True but int('²') raised, so verify_run and every
    checkpoint's facts check crashed instead of naming the entry."""
    entries = [
        ledger.Entry("dataflow", "r", 1, 0, "run.recorded", {}, "", "", None, 0),
        ledger.Entry("dataflow", "r", 2, 1, "attempt.started", {}, "", "", None, 0),
        ledger.Entry("dataflow", "r", 3, 1, "dispatch.authorized", {"row_count": "²"}, "", "", None, 0),
    ]
    transitions.derive(entries)


# ---- held: legitimate long chains derive and verify ---------------------------------------------


def test_held_a_long_legitimate_chain_verifies_at_every_step(platform: Platform, tmp_path: Path) -> None:
    """recorded, claimed, swept recovered, claimed again, authorized, unknown, reconcile undecided twice,
    reconcile absent, resume published: verify holds after every step."""
    provider = _parquet_faulty("fail_before_send", "undecided")
    defn = flows.definition(flows.parquet_target("faulty"))
    submitted = platform.runs.submit(flows.request(defn, tmp_path, "long"))
    run_id = submitted.run.run_id
    claim = platform.runs.claim_next()
    assert claim is not None
    platform.db.advance_clock(60)
    assert [d.decision for d in sweeper.sweep(platform.db)] == ["recovered"]
    assert flows.verify(platform, run_id).ok
    claim = platform.runs.claim_next()
    assert claim is not None and claim.attempt == 2
    platform.runs.execute(claim)
    assert platform.runs.get(run_id).status == "outcome_unknown"
    assert flows.verify(platform, run_id).ok
    for _ in range(2):
        assert flows.reconcile_as_operator(platform, run_id).finding == "undecided"
        assert flows.verify(platform, run_id).ok
    provider.inspect_fault = "none"
    provider.fault = "none"
    assert flows.reconcile_as_operator(platform, run_id).finding == "absent"
    assert flows.verify(platform, run_id).ok
    done = flows.reconcile_as_operator(platform, run_id, resume=True)
    assert done.run.status == "succeeded", done
    assert flows.verify(platform, run_id).ok
    assert len(flows.manifests(tmp_path / "sink")) == 1


# ---- held: the platform's settings do not turn a legacy/absolute target invalid ------------


def test_held_legacy_absolute_target_is_not_invalid(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAFLOW_ALLOW_ABSOLUTE_LOCATIONS", "1")
    _parquet_faulty("timeout_after_commit")
    location = str(tmp_path / "abs-sink")
    defn = flows.definition(flows.parquet_target("faulty", location))
    unknown = platform.runs.run_inline(flows.request(defn, tmp_path, "abs")).run
    assert unknown.status == "outcome_unknown"
    monkeypatch.delenv("DATAFLOW_ALLOW_ABSOLUTE_LOCATIONS")  # the run keeps the workspace it was recorded with
    registry.register_provider("faulty", ParquetFolderProvider)
    done = flows.reconcile_as_operator(platform, unknown.run_id)
    assert done.finding == "present", done
    assert flows.verify(platform, unknown.run_id).ok


def test_an_edited_workspace_is_never_acted_on(platform: Platform, tmp_path: Path) -> None:
    """The workspace (roots, absolute locations) decides where a run's target resolves, and run.recorded holds
    its digest: a row whose workspace was edited is refused by reconcile (evidence_failed, nothing inspected)."""
    _parquet_faulty("timeout_after_commit")
    unknown = flows.forward(platform, tmp_path, "faulty", "workspace")
    _edit_row(platform, unknown.run_id, workspace_json=None)
    registry.register_provider("faulty", ParquetFolderProvider)
    done = flows.reconcile_as_operator(platform, unknown.run_id)
    assert done.finding == "undecided" and "workspace" in done.detail
    assert platform.runs.get(unknown.run_id).status == "evidence_failed"
    assert len(flows.manifests(tmp_path / "sink")) == 1


def test_h1b_a_worker_survives_a_poisoned_sweep(platform: Platform, tmp_path: Path) -> None:
    """A worker whose first sweep meets a damaged row still claims and runs the queued run. (Found: the sweep's
    EvidenceError escaped Worker.run(), and every restarted worker died the same way.)"""
    from durable_dataflow.dataflow.worker import Worker, WorkerOptions

    poisoned = _crash_after_provider_call(platform, tmp_path, "poisoned-worker")
    _edit_row(platform, poisoned.run_id, row_count=999)
    platform.db.advance_clock(60)
    queued = platform.runs.submit(flows.request(flows.definition(), tmp_path, "queued")).run
    Worker(platform.runs, WorkerOptions(once=True, sweep_interval_s=1, poll_interval_s=0.05)).run()
    assert platform.runs.get(queued.run_id).status == "succeeded"


def test_h1c_reconcile_of_a_damaged_row_returns_a_finding(platform: Platform, tmp_path: Path) -> None:
    """Reconcile of a damaged row returns a finding and leaves the run evidence_failed, its lease released. (Found:
    the evidence-failure checkpoint failed the same projection check and raised out of reconcile.)"""
    _parquet_faulty("timeout_after_commit")
    unknown = flows.forward(platform, tmp_path, "faulty", "damaged-reconcile")
    _edit_row(platform, unknown.run_id, row_count=999)
    registry.register_provider("faulty", ParquetFolderProvider)
    result = flows.reconcile_as_operator(platform, unknown.run_id)
    assert result.run.status == "evidence_failed"
