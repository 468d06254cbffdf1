"""The one transition table (dataflow/protocol/transitions.py): every terminal state carries a verified
checkpoint, ``verify`` compares the run projection with what the ledger implies, and damaged rows,
entries or payloads are reported as "not verified at seq N", never as an internal error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durable_dataflow.core import checkpoints, crashpoints, ledger
from durable_dataflow.core.errors import Conflict
from durable_dataflow.core.schema import ledger_entries
from durable_dataflow.dataflow.protocol import evidence, runs, sweeper, transitions
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.dataflow.protocol.transitions import TABLE, Outcome
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.delta import DeltaProvider
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
    platform.db.advance_clock(60)
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
        derived = transitions.derive(entries)
        assert not derived.problem, (outcome, derived.problem)
        if transition.status is not None:
            assert derived.values["status"] == transition.status, outcome
        if transition.recovery is not None:
            assert derived.values["recovery_status"] == transition.recovery, outcome
    late_cancel = _fake_entries([*forward, Outcome.CANCELLED])
    assert transitions.derive(late_cancel).problem_seq == 4, "a cancel after dispatch authorization"
    after_cancel = _fake_entries([Outcome.RECORDED, Outcome.STARTED, Outcome.CANCELLED, Outcome.DISPATCH_AUTHORIZED])
    assert transitions.derive(after_cancel).problem_seq == 4, "an entry after the cancellation"
    stray = _fake_entries([Outcome.RECORDED])
    stray.append(ledger.Entry("dataflow", "r", 2, 1, evidence.RUN_SUCCEEDED, {}, "", "", None, 0))
    assert transitions.derive(stray).problem_seq == 2


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
    platform.db.advance_clock(60)
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
