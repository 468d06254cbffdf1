"""Issue 16, item 4: cancellation (dataflow/protocol/cancel.py), on both engines.

A queued run becomes ``cancelled / no_external_output``; a running attempt before dispatch
authorization is closed under the fence (its later writes are refused) and the run becomes the same;
after authorization a publication may exist, so cancellation is refused with the reconcile
instruction. Each cancellation is a ``run.cancelled`` entry naming who asked, checkpointed. The last
section holds the red team's findings (commit cf6f558): a projection that says ``queued`` or ``cancelled``
over a live attempt is not trusted, and one day whose evidence fails does not stop a backfill's cancel.

Cancellation in the other tiers: `dataflow cancel` as a real process, tests/acceptance/test_cli_cancel.py;
a real worker SIGSTOPped while its run is cancelled, tests/faults/test_cancel_pause.py. A backfill's
cancel day by day: POST /v1/backfills/cancel in tests/integration/test_api_schedules.py, `dataflow
backfill cancel` in tests/acceptance/test_cli_schedules.py.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from durable_dataflow.api.app import create_app
from durable_dataflow.core import checkpoints, crashpoints, ledger
from durable_dataflow.core.errors import Conflict, StaleAttempt
from durable_dataflow.dataflow.protocol import cancel, evidence
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import Tokens, make_tokens

CANCELLER = AccessContext("acme", "night-operator", ("operator",), (), "test")
CANCEL_PROVENANCE = Provenance("night-operator", "api")


def _cancel(platform: Platform, run_id: str) -> cancel.Cancellation:
    return cancel.cancel(platform.runs, run_id, access=CANCELLER, provenance=CANCEL_PROVENANCE)


def _entries(platform: Platform, run_id: str) -> list[ledger.Entry]:
    with platform.db.read() as conn:
        return ledger.read(conn, "dataflow", run_id)


def _assert_cancelled(platform: Platform, run: Run, from_status: str) -> None:
    stored = platform.runs.get(run.run_id)
    assert (stored.status, stored.recovery_status) == ("cancelled", "no_external_output")
    assert stored.error_code == "cancelled" and "night-operator" in (stored.error_message or "")
    head = _entries(platform, run.run_id)[-1]
    assert head.kind == evidence.RUN_CANCELLED
    assert head.payload["principal"] == "night-operator" and head.payload["from_status"] == from_status
    assert head.payload["provenance"]["trigger"] == "api" and head.payload["no_external_output"] is True
    with platform.db.read() as conn:
        checkpoint = checkpoints.latest(conn, "dataflow", run.run_id)
    assert checkpoint is not None and checkpoint.head_seq == head.seq and checkpoint.status == "cancelled"
    assert flows.verify(platform, run.run_id).ok


def test_a_queued_run_is_cancelled_and_never_claimed(platform: Platform, tmp_path: Path) -> None:
    queued = platform.runs.submit(flows.request(flows.definition(), tmp_path, "queued")).run
    done = _cancel(platform, queued.run_id)
    assert done.cancelled and done.run.status == "cancelled"
    _assert_cancelled(platform, queued, "queued")
    assert [e.kind for e in _entries(platform, queued.run_id)] == [evidence.RUN_RECORDED, evidence.RUN_CANCELLED]
    assert platform.runs.claim_next() is None, "a cancelled run was claimed"
    again = _cancel(platform, queued.run_id)
    assert not again.cancelled and again.detail == "already cancelled"
    assert len(_entries(platform, queued.run_id)) == 2, "a second cancel appended"
    # A replay of the key returns the cancelled run: nothing is re-run under it.
    replay = platform.runs.submit(flows.request(flows.definition(), tmp_path, "queued"))
    assert not replay.created and replay.run.status == "cancelled"


def test_a_running_attempt_is_fenced_off_and_commits_nothing(platform: Platform, tmp_path: Path) -> None:
    """Atomic: the claimed attempt's terminal commit is refused as stale, and no result is stored."""
    platform.runs.submit(flows.request(flows.definition(), tmp_path, "running"))
    claim = platform.runs.claim_next()
    assert claim is not None
    done = _cancel(platform, claim.run.run_id)
    assert done.cancelled
    before = flows.row_counts(platform)
    with pytest.raises(StaleAttempt):
        platform.runs.execute(claim)
    assert flows.row_counts(platform) == before, "the fenced-off attempt wrote"
    _assert_cancelled(platform, claim.run, "running")


def test_a_forward_attempt_cancelled_before_authorization_publishes_nothing(platform: Platform, tmp_path: Path) -> None:
    """The cancel lands inside the attempt, just before its pre-dispatch commit: that commit is refused."""
    definition = flows.definition(flows.parquet_target())
    platform.runs.submit(flows.request(definition, tmp_path, "forward"))
    claim = platform.runs.claim_next()
    assert claim is not None
    outcomes: list[cancel.Cancellation] = []

    def cancel_now(point: str) -> None:
        if point == crashpoints.BEFORE_PREDISPATCH_COMMIT and not outcomes:
            outcomes.append(_cancel(platform, claim.run.run_id))

    crashpoints.set_hook(cancel_now)
    platform.runs.execute(claim)
    assert outcomes and outcomes[0].cancelled
    _assert_cancelled(platform, claim.run, "running")
    assert flows.manifests(tmp_path / "sink") == [], "a cancelled run published"
    kinds = [e.kind for e in _entries(platform, claim.run.run_id)]
    assert evidence.DISPATCH_AUTHORIZED not in kinds, kinds


def test_after_authorization_cancel_is_refused_and_the_run_publishes_once(platform: Platform, tmp_path: Path) -> None:
    """The cancel lands right after the pre-dispatch commit: refused with the reconcile instruction, and the
    attempt goes on (its lease was not closed) to publish once and succeed."""
    definition = flows.definition(flows.parquet_target())
    platform.runs.submit(flows.request(definition, tmp_path, "authorized"))
    claim = platform.runs.claim_next()
    assert claim is not None
    refusals: list[str] = []

    def cancel_now(point: str) -> None:
        if point == crashpoints.AFTER_PREDISPATCH_COMMIT and not refusals:
            with pytest.raises(Conflict) as refused:
                _cancel(platform, claim.run.run_id)
            refusals.append(refused.value.message)

    crashpoints.set_hook(cancel_now)
    final = platform.runs.execute(claim)
    assert refusals and f"dataflow reconcile {claim.run.run_id}" in refusals[0]
    assert "publication may be under way" in refusals[0] and "Wait for it to end" in refusals[0]
    assert final.status == "succeeded"
    assert len(flows.manifests(tmp_path / "sink")) == 1
    assert evidence.RUN_CANCELLED not in [e.kind for e in _entries(platform, claim.run.run_id)]


def test_an_inline_run_cancelled_mid_run_returns_the_cancelled_run(platform: Platform, tmp_path: Path) -> None:
    """`dataflow run` whose run an operator cancels while it executes answers with the cancelled run (exit 1
    with its status), not a bare stale-attempt error."""
    done: list[cancel.Cancellation] = []

    def cancel_now(point: str) -> None:
        if point == crashpoints.BEFORE_TERMINAL_COMMIT and not done:
            with platform.db.read() as conn:
                run_id = conn.execute(sa.text("SELECT run_id FROM dataflow_runs")).scalar_one()
            done.append(_cancel(platform, run_id))

    crashpoints.set_hook(cancel_now)
    submission = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "inline"))
    assert done and done[0].cancelled
    assert submission.run.status == "cancelled" and submission.run.run_id == done[0].run.run_id


def test_finished_and_unresolved_runs_are_refused(platform: Platform, tmp_path: Path) -> None:
    succeeded = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "ok")).run
    with pytest.raises(Conflict, match="already succeeded"):
        _cancel(platform, succeeded.run_id)
    flows.install_faulty("timeout_after_commit")
    unknown = flows.forward(platform, tmp_path, "faulty", "unknown")
    assert unknown.status == "outcome_unknown"
    before = flows.row_counts(platform)
    with pytest.raises(Conflict, match=f"dataflow reconcile {unknown.run_id}"):
        _cancel(platform, unknown.run_id)
    assert flows.row_counts(platform) == before, "a refused cancel wrote"


def test_a_published_run_is_refused_as_settled_without_reconcile_advice(platform: Platform, tmp_path: Path) -> None:
    """Proves issue 33 finding 6: a succeeded forward run (its dispatch was authorized) is refused with "already
    succeeded … nothing to cancel", never "a publication may exist … reconcile" (reconcile would find nothing)."""
    published = flows.forward(platform, tmp_path, "parquet", "published")
    assert published.status == "succeeded" and published.publication_idempotency_key is not None
    with pytest.raises(Conflict, match="already succeeded") as settled:
        _cancel(platform, published.run_id)
    assert "reconcile" not in settled.value.message and "may exist" not in settled.value.message


def test_another_tenant_cannot_cancel(platform: Platform, tmp_path: Path) -> None:
    from durable_dataflow.core.errors import NotFound

    queued = platform.runs.submit(flows.request(flows.definition(), tmp_path, "mine")).run
    with pytest.raises(NotFound):
        cancel.cancel(platform.runs, queued.run_id, access=CANCELLER, provenance=CANCEL_PROVENANCE, tenant="other")
    assert platform.runs.get(queued.run_id).status == "queued"


def test_cancels_racing_claims_leave_every_run_consistent(platform: Platform, tmp_path: Path) -> None:
    """Two threads: one claims and executes every run, the other cancels every run. Whatever the order,
    each run ends either cancelled (with nothing stored or published) or finished by its attempt, and
    every chain verifies."""
    count = 8
    ids = [
        platform.runs.submit(flows.request(flows.definition(), tmp_path, f"race-{i}")).run.run_id for i in range(count)
    ]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            while (claim := platform.runs.claim_next()) is not None:
                with contextlib.suppress(StaleAttempt):  # cancelled under it
                    platform.runs.execute(claim)
        except BaseException as error:  # reported below
            errors.append(error)

    def cancel_all() -> None:
        try:
            for run_id in ids:
                with contextlib.suppress(Conflict):  # finished first
                    _cancel(platform, run_id)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work), threading.Thread(target=cancel_all)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for run_id in ids:
        run = platform.runs.get(run_id)
        assert run.status in ("cancelled", "succeeded"), run.status
        kinds = [e.kind for e in _entries(platform, run_id)]
        if run.status == "cancelled":
            assert kinds[-1] == evidence.RUN_CANCELLED and evidence.RESULT_COMMITTED not in kinds, kinds
            assert run.output_digest is None
        else:
            assert evidence.RUN_CANCELLED not in kinds, kinds
        assert flows.verify(platform, run_id).ok, run_id


# ---- the red team against cancellation (commit cf6f558), on SQLite and PostgreSQL ---------------------------
# Finding 2: ``cancel._cancel_queued`` trusted a projection that says ``queued``: over a live attempt (its row
# edited, or written by a bug) it left the attempt's lease open, answered "no attempt had started", and the
# attempt went on to authorize, publish and succeed after ``run.cancelled``. Now the queued path closes any
# open lease of the attempt first, as the running path does.
# Finding 3: a projection edited to ``cancelled`` over a live attempt was answered "already cancelled" while
# the attempt went on; now it is refused unless the ledger's head is ``run.cancelled``.
# Finding 4: one day whose evidence fails verification stopped POST /v1/backfills/cancel (409) with the later
# days still queued, to be run and published; now that day is reported ``evidence_failed`` and the other days
# are cancelled.
# (Findings 1 and 5, a cron that matches no date and a backfill day's format: test_api_schedules.py.)

FORGE_STATUS = sa.text("UPDATE dataflow_runs SET status=:s WHERE run_id=:r")
EDIT_ENTRIES = sa.text(
    "UPDATE ledger_entries SET payload_json = replace(payload_json, 'daily', 'dai1y') WHERE subject_id=:r"
)


flow = flows.daily_flow


@dataclass(frozen=True)
class Served:
    platform: Platform
    client: TestClient
    tokens: Tokens

    def call(self, method: str, path: str, token: str, body: Any = None) -> Any:
        return self.client.request(method, path, json=body, headers={"Authorization": f"Bearer {token}"})


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    platform = Platform(db_url, lease_ttl_s=5)
    app = create_app(platform, data_root=tmp_path / "tenants", sink_root=tmp_path / "sinks")
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Served(platform, client, make_tokens(platform))
    platform.close()
    crashpoints.set_hook(None)


def test_a_queued_projection_over_a_live_attempt_is_fenced_off(served: Served, tmp_path: Path) -> None:
    """Proves finding 2: the row of a claimed forward run is edited back to ``queued`` just before its
    pre-dispatch commit; the cancel closes the attempt's lease, so that commit is refused, nothing is
    published, and the run stays cancelled with a chain that verifies."""
    platform = served.platform
    platform.runs.submit(flows.request(flows.definition(flows.parquet_target()), tmp_path, "forged-queued"))
    claim = platform.runs.claim_next()
    assert claim is not None
    done: list[cancel.Cancellation] = []

    def forge_then_cancel(point: str) -> None:
        if point == crashpoints.BEFORE_PREDISPATCH_COMMIT and not done:
            with platform.db.begin() as conn:
                conn.execute(FORGE_STATUS, {"s": "queued", "r": claim.run.run_id})
            done.append(cancel.cancel(platform.runs, claim.run.run_id, access=CANCELLER, provenance=CANCEL_PROVENANCE))

    crashpoints.set_hook(forge_then_cancel)
    platform.runs.execute(claim)
    crashpoints.set_hook(None)
    assert done and done[0].cancelled
    assert flows.manifests(tmp_path / "sink") == [], "the attempt published after its run was cancelled"
    kinds = flows.kinds(platform, claim.run.run_id)
    assert kinds[-1] == evidence.RUN_CANCELLED and evidence.DISPATCH_AUTHORIZED not in kinds, kinds
    assert platform.runs.get(claim.run.run_id).status == "cancelled"
    assert flows.verify(platform, claim.run.run_id).ok


def test_a_cancelled_projection_over_a_live_attempt_is_not_taken_for_cancelled(served: Served, tmp_path: Path) -> None:
    """Proves finding 3: a running run's row edited to ``cancelled`` is not answered "already cancelled":
    the ledger's head is not ``run.cancelled``, so the cancel is refused naming `dataflow verify`."""
    platform = served.platform
    platform.runs.submit(flows.request(flows.definition(), tmp_path, "forged-cancelled"))
    claim = platform.runs.claim_next()
    assert claim is not None
    with platform.db.begin() as conn:
        conn.execute(FORGE_STATUS, {"s": "cancelled", "r": claim.run.run_id})
    with pytest.raises(Conflict, match="dataflow verify"):
        cancel.cancel(platform.runs, claim.run.run_id, access=CANCELLER, provenance=CANCEL_PROVENANCE)
    assert evidence.RUN_CANCELLED not in flows.kinds(platform, claim.run.run_id)


def test_one_day_with_broken_evidence_does_not_stop_a_backfill_cancel(served: Served) -> None:
    """Proves finding 4: the first day's recorded entry is edited; cancelling the backfill reports that
    day ``evidence_failed`` (nothing written for it) and still cancels the two other days."""
    body = {"definition": flow(), "from": "2026-03-01", "to": "2026-03-03"}
    submitted = served.call("POST", "/v1/backfills", served.tokens.operator, body)
    assert submitted.status_code == 201, submitted.text
    ids = [day["run_id"] for day in submitted.json()["runs"]]
    with served.platform.db.begin() as conn:
        conn.execute(EDIT_ENTRIES, {"r": ids[0]})
    answer = served.call("POST", "/v1/backfills/cancel", served.tokens.operator, body)
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert [day["outcome"] for day in report["runs"]] == ["evidence_failed", "cancelled", "cancelled"]
    assert report["totals"]["evidence_failed"] == 1 and "failed verification" in report["runs"][0]["detail"]
    assert [str(served.platform.runs.get(run_id).status) for run_id in ids] == ["queued", "cancelled", "cancelled"]



def test_a_backfill_cancel_leaves_finished_days_without_reconcile_advice(served: Served) -> None:
    """Proves issue 33 finding 6: a day whose run already succeeded (its publication authorized and made) is
    reported ``finished`` with "already succeeded … nothing to cancel", never the "publication may exist …
    reconcile" advice that reconcile would then answer with "nothing to reconcile"; the other days are cancelled."""
    body = {"definition": flow(), "from": "2026-03-01", "to": "2026-03-03"}
    submitted = served.call("POST", "/v1/backfills", served.tokens.operator, body)
    assert submitted.status_code == 201, submitted.text
    ids = [day["run_id"] for day in submitted.json()["runs"]]
    claim = served.platform.runs.claim_next()
    assert claim is not None and claim.run.run_id == ids[0]
    assert served.platform.runs.execute(claim).status == "succeeded"
    answer = served.call("POST", "/v1/backfills/cancel", served.tokens.operator, body)
    assert answer.status_code == 200, answer.text
    days = answer.json()["runs"]
    assert [day["outcome"] for day in days] == ["finished", "cancelled", "cancelled"]
    assert "already succeeded" in days[0]["detail"] and "nothing to cancel" in days[0]["detail"]
    assert "reconcile" not in days[0]["detail"] and "may exist" not in days[0]["detail"]
