"""The one transition table (dataflow/protocol/transitions.py): every terminal state carries a verified
checkpoint, ``verify`` compares the run projection with what the ledger implies, and damaged rows,
entries or payloads are reported as "not verified at seq N", never as an internal error.

The last section holds the holes a red team found in the table (issue 13), each now closed: a damaged run
row must not stop the sweeper, a worker or a reconcile (H1); an edited target, tenant or workspace column
must not be settled, fenced or published under (H2, H2b); resume verifies before it dispatches (H3);
derive() never raises on a payload (H4). The rows are edited the way someone with write access to
dataflow_runs (but not the ledger's chain) could.

`dataflow verify` and `show` as real processes: tests/acceptance/test_cli_runs.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durable_dataflow.core import checkpoints, crashpoints, ledger
from durable_dataflow.core.errors import Conflict
from durable_dataflow.core.schema import ledger_entries
from durable_dataflow.dataflow.protocol import derivation, evidence, runs, sweeper
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.dataflow.protocol.transitions import TABLE, Outcome
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows
from support.cli import make_cli


def _entries(platform: Platform, run_id: str) -> list[ledger.Entry]:
    with platform.db.read() as conn:
        return ledger.read(conn, "dataflow", run_id)


def _exhausted(platform: Platform, tmp_path: Path) -> Run:
    """A queued run whose only attempt expired before dispatch authorization, swept: failed."""
    submitted = platform.runs.submit(flows.request(flows.definition(), tmp_path, "exhausted", max_attempts=1))
    claim = platform.runs.claim_next()
    assert claim is not None and claim.run.run_id == submitted.run.run_id
    flows.expire_leases(platform)
    assert [d.decision for d in sweeper.sweep(platform.db)] == ["failed"]
    return platform.runs.get(submitted.run.run_id)


def _terminal_runs(platform: Platform, tmp_path: Path) -> dict[str, Run]:
    made: dict[str, Run] = {}
    made["atomic_succeeded"] = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "ok")).run
    made["failed_before_dispatch"] = flows.forward(platform, tmp_path, "no_such_provider", "missing")
    flows.install_faulty("reject")
    made["rejected"] = flows.forward(platform, tmp_path, "faulty", "rejected")
    flows.install_faulty("timeout_after_commit")
    made["publication_unknown"] = flows.forward(platform, tmp_path, "faulty", "unknown")
    flows.install_faulty("fail_before_send")
    never_sent = flows.forward(platform, tmp_path, "faulty", "absent")
    made["reconciled_absent"] = flows.reconcile_as_operator(platform, never_sent.run_id).run
    registry.register_provider("faulty", DeltaProvider)
    made["reconciled_present"] = flows.reconcile_as_operator(platform, made["publication_unknown"].run_id).run
    made["swept_exhausted"] = _exhausted(platform, tmp_path)
    return made


def test_every_terminal_state_writes_a_verified_checkpoint_at_its_head(platform: Platform, tmp_path: Path) -> None:
    """Finding 3 of issue 13: failed, rejected, outcome_unknown, reconciled and exhausted runs are checkpointed
    (only success was), at the head of their chain, with the projected state, and they verify."""
    made = _terminal_runs(platform, tmp_path)
    expected = {
        "atomic_succeeded": ("succeeded", "verified"),
        "failed_before_dispatch": ("failed", "no_external_output"),
        "rejected": ("failed", "no_external_output"),
        "reconciled_absent": ("failed", "reconciled_absent"),
        "reconciled_present": ("succeeded", "reconciled_present"),
        "swept_exhausted": ("failed", "no_external_output"),
    }
    for name, (status, recovery) in expected.items():
        run = platform.runs.get(made[name].run_id)
        assert (run.status, run.recovery_status) == (status, recovery), name
        with platform.db.read() as conn:
            checkpoint = checkpoints.latest(conn, "dataflow", run.run_id)
        assert checkpoint is not None, f"{name}: no checkpoint"
        assert checkpoint.head_seq == _entries(platform, run.run_id)[-1].seq, name
        assert (checkpoint.status, checkpoint.facts["recovery_status"]) == (status, recovery), name
        assert flows.verify(platform, run.run_id).ok, name
    # The outcome_unknown state was checkpointed too, before reconcile settled it.
    with platform.db.read() as conn:
        unknown_seq = next(
            e.seq for e in ledger.read(conn, "dataflow", made["publication_unknown"].run_id)
            if e.kind == evidence.PUBLICATION_UNKNOWN
        )  # fmt: skip
        heads = conn.execute(
            sa.text("SELECT head_seq, status FROM checkpoints WHERE subject_id = :s ORDER BY head_seq"),
            {"s": made["publication_unknown"].run_id},
        ).all()
    assert (unknown_seq, "outcome_unknown") in [(int(h), s) for h, s in heads]


def test_deleting_a_failed_runs_terminal_entry_is_not_verified(platform: Platform, tmp_path: Path) -> None:
    """Finding 3: deleting the terminal entry of a failed run verified (no checkpoint covered it)."""
    failed = flows.forward(platform, tmp_path, "no_such_provider", "missing")
    head = _entries(platform, failed.run_id)[-1]
    assert head.kind == evidence.RUN_FAILED
    with platform.db.begin() as conn:
        conn.execute(
            ledger_entries.delete().where(
                ledger_entries.c.subject_id == failed.run_id, ledger_entries.c.seq == head.seq
            )
        )
    verification = flows.verify(platform, failed.run_id)
    assert not verification.ok and verification.broken_seq is not None


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("status", "succeeded"),
        ("recovery_status", "verified"),
        ("output_digest", "sha256:" + "0" * 64),
        ("publication_ref", "delta://elsewhere"),
        ("attempt", 7),
    ],
)
def test_a_flipped_projection_field_is_not_verified(
    platform: Platform, tmp_path: Path, column: str, value: Any
) -> None:
    """Finding 3: flipping an outcome_unknown row's projection (to succeeded / verified, or any digest or ref)
    removed it from every UNRESOLVED surface and still verified; now verify names the field and the head seq."""
    flows.install_faulty("timeout_after_commit")
    unknown = flows.forward(platform, tmp_path, "faulty", "unknown")
    assert flows.verify(platform, unknown.run_id).ok
    with platform.db.begin() as conn:
        conn.execute(dataflow_runs.update().where(dataflow_runs.c.run_id == unknown.run_id).values({column: value}))
    verification = flows.verify(platform, unknown.run_id)
    assert not verification.ok
    assert column in verification.reason and verification.broken_seq == _entries(platform, unknown.run_id)[-1].seq


def test_verify_through_the_cli_reports_a_flipped_row_and_a_malformed_payload(
    platform: Platform, tmp_path: Path, db_url: str
) -> None:
    """Through `dataflow verify`: "NOT verified (broken at seq N)" and exit 1, never an internal error, for a projection
    flipped to success and for a payload that is not a JSON object."""
    flows.install_faulty("timeout_after_commit")
    flipped = flows.forward(platform, tmp_path, "faulty", "flipped")
    damaged = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "damaged")).run
    with platform.db.begin() as conn:
        conn.execute(
            dataflow_runs.update().where(dataflow_runs.c.run_id == flipped.run_id)
            .values(status="succeeded", recovery_status="verified", warning=None)
        )  # fmt: skip
        conn.execute(
            ledger_entries.update()
            .where(ledger_entries.c.subject_id == damaged.run_id, ledger_entries.c.seq == 2)
            .values(payload_json="{not json")
        )
    cli = make_cli(db_url, tmp_path)
    for run_id in (flipped.run_id, damaged.run_id):
        done = cli("verify", run_id)
        assert done.code == 1, done.output
        assert "NOT verified (broken at seq" in done.output and "Traceback" not in done.output
        assert "internal" not in done.output.lower()


def test_runs_and_show_survive_a_corrupted_row(platform: Platform, tmp_path: Path, db_url: str) -> None:
    """A run row edited by hand (an unknown status, JSON that does not parse) does not break `runs` or `show`:
    it is listed, marked corrupt and unresolved, with a warning that sends the operator to verify."""
    good = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "good")).run
    bad = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "bad")).run
    with platform.db.begin() as conn:
        conn.execute(
            dataflow_runs.update().where(dataflow_runs.c.run_id == bad.run_id)
            .values(status="bogus", parameters_json="{")
        )  # fmt: skip
    read = platform.runs.get(bad.run_id)
    assert read.corrupt and "status" in read.corrupt and "parameters_json" in read.corrupt and read.unresolved
    cli = make_cli(db_url, tmp_path)
    listed = cli("runs", "--json")
    assert listed.code == 0, listed.output
    rows = {row["run_id"]: row for row in listed.json()}
    assert rows[good.run_id]["unresolved"] is False
    assert rows[bad.run_id]["unresolved"] is True and "dataflow verify" in rows[bad.run_id]["warning"]
    shown = cli("show", bad.run_id)
    assert shown.code == 0 and "Traceback" not in shown.output, shown.output
    assert "cannot be read" in shown.output


def test_the_table_and_its_reading_backwards_agree() -> None:
    """derive() folds each transition's entries to exactly the state the table projects (a row changed on one
    side only fails here), and an entry that follows no transition is named by its seq."""
    prefix = {
        Outcome.ATOMIC_SUCCEEDED: [Outcome.RECORDED, Outcome.STARTED],
        Outcome.FAILED_BEFORE_DISPATCH: [Outcome.RECORDED, Outcome.STARTED],
        Outcome.SWEPT_RECOVERED: [Outcome.RECORDED, Outcome.STARTED],
        Outcome.SWEPT_EXHAUSTED: [Outcome.RECORDED, Outcome.STARTED],
        Outcome.EVIDENCE_FAILED: [Outcome.RECORDED, Outcome.STARTED],
        Outcome.CANCELLED: [Outcome.RECORDED, Outcome.STARTED],
    }
    forward = [Outcome.RECORDED, Outcome.STARTED, Outcome.DISPATCH_AUTHORIZED]
    for outcome, transition in TABLE.items():
        path: list[Outcome] = [*prefix.get(outcome, forward), outcome] if outcome != Outcome.RECORDED else [outcome]
        entries = _fake_entries(path)
        derived = derivation.derive(entries)
        assert not derived.problem, (outcome, derived.problem)
        if transition.status is not None:
            assert derived.values["status"] == transition.status, outcome
        if transition.recovery is not None:
            assert derived.values["recovery_status"] == transition.recovery, outcome
    late_cancel = _fake_entries([*forward, Outcome.CANCELLED])
    assert derivation.derive(late_cancel).problem_seq == 4, "a cancel after dispatch authorization"
    after_cancel = _fake_entries([Outcome.RECORDED, Outcome.STARTED, Outcome.CANCELLED, Outcome.DISPATCH_AUTHORIZED])
    assert derivation.derive(after_cancel).problem_seq == 4, "an entry after the cancellation"
    stray = _fake_entries([Outcome.RECORDED])
    stray.append(ledger.Entry("dataflow", "r", 2, 1, evidence.RUN_SUCCEEDED, {}, "", "", None, 0))
    assert derivation.derive(stray).problem_seq == 2


def _fake_entries(path: list[Outcome]) -> list[ledger.Entry]:
    entries: list[ledger.Entry] = []
    for step, outcome in enumerate(path):
        for kind in TABLE[outcome].kinds:
            attempt = 0 if outcome == Outcome.RECORDED else 1 + (step > 2 and outcome in _NEW_ATTEMPT)
            entries.append(ledger.Entry("dataflow", "r", len(entries) + 1, attempt, kind, {}, "", "", None, 0))
    return entries


_NEW_ATTEMPT = frozenset({Outcome.RECONCILE_STARTED, Outcome.RESUME_AUTHORIZED})


def test_a_forward_evidence_failed_run_can_be_reconciled(platform: Platform, tmp_path: Path) -> None:
    """Finding 6: a forward run that ended evidence_failed after publishing answered 409 to reconcile, although
    its warning says to reconcile; now its sink is inspected and the publication found settles it."""
    flows.install_faulty("none")
    hook_calls: list[str] = []

    def break_evidence(point: str) -> None:
        # Just before the terminal commit, damage the stored result bytes' digest check: the success
        # checkpoint then refuses, and the run ends evidence_failed after the sink has the publication.
        if point == crashpoints.BEFORE_TERMINAL_COMMIT and not hook_calls:
            hook_calls.append(point)
            with platform.db.begin() as conn:
                conn.execute(sa.text("UPDATE run_results SET format = 'unknown-format'"))

    crashpoints.set_hook(break_evidence)
    run = flows.forward(platform, tmp_path, "faulty", "evidence")
    crashpoints.set_hook(None)
    assert (run.status, run.recovery_status) == ("evidence_failed", "evidence_failed"), run
    assert "reconcile" in str(run.warning)
    with platform.db.begin() as conn:
        conn.execute(sa.text("UPDATE run_results SET format = 'arrow-ipc-stream+digest-v3'"))
    settled = flows.reconcile_as_operator(platform, run.run_id)
    assert (settled.finding, settled.run.status, settled.run.recovery_status) == (
        "present",
        "succeeded",
        "reconciled_present",
    )
    assert len(flows.delta_publications(tmp_path / "sink", run.publication_idempotency_key)) == 1
    assert flows.verify(platform, run.run_id).ok


def test_reconcile_sweeps_an_authorized_attempt_whose_lease_expired(platform: Platform, tmp_path: Path) -> None:
    """Finding 4 (the embedded default never sweeps): a run that published and lost its answer stays running /
    dispatch_authorized; reconcile decides the expired attempt itself, then inspects the sink."""

    def crash(point: str) -> None:
        if point == crashpoints.AFTER_PROVIDER_CALL:
            raise SystemExit("simulated crash after the provider call")

    crashpoints.set_hook(crash)
    with pytest.raises(SystemExit):
        flows.forward(platform, tmp_path, "delta", "lost")
    crashpoints.set_hook(None)
    [lost] = _all_runs(platform)
    assert (lost.status, lost.recovery_status) == ("running", "dispatch_authorized")
    live = _reconcile_conflict(platform, lost.run_id)
    assert "running" in live, "a live attempt is not swept"
    flows.expire_leases(platform)
    settled = flows.reconcile_as_operator(platform, lost.run_id)
    assert (settled.finding, settled.run.status) == ("present", "succeeded")
    kinds = [e.kind for e in _entries(platform, lost.run_id)]
    assert kinds[-4:] == [
        evidence.ATTEMPT_OUTCOME_UNKNOWN,
        evidence.RECONCILE_STARTED,
        evidence.RECONCILE_PRESENT,
        evidence.RUN_SUCCEEDED,
    ]
    assert len(flows.delta_publications(tmp_path / "sink", lost.publication_idempotency_key)) == 1


def _all_runs(platform: Platform) -> list[Run]:
    with platform.db.read() as conn:
        return runs.list_page(conn)


def _reconcile_conflict(platform: Platform, run_id: str) -> str:
    before = _entries(platform, run_id)
    with pytest.raises(Conflict) as refused:
        flows.reconcile_as_operator(platform, run_id)
    assert _entries(platform, run_id) == before
    return refused.value.message


# ---- damaged rows and payloads stop nothing and settle nothing (issue 13's red team, H1-H4) --------


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
    flows.expire_leases(platform)
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
    derivation.derive(entries)


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
    flows.expire_leases(platform)
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
    flows.expire_leases(platform)
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
