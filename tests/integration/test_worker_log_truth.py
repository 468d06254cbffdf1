"""The worker's logs and totals say what each attempt did (issue 33, finding 5): a fenced attempt
never reports another attempt's success as its own, and every attempt is counted once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from durable_dataflow.core.errors import StorageUnavailable
from durable_dataflow.dataflow.protocol import forward, sweeper
from durable_dataflow.dataflow.worker import Worker, WorkerOptions
from durable_dataflow.platform import Platform
from faults import harness

FAST = {"sweep_interval_s": 0.05, "poll_interval_s": 0.02, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=10) as opened:
        yield opened


def _fence_at_authorization(monkeypatch: pytest.MonkeyPatch, db_url: str, times: int = 1) -> None:
    """Before attempt 1 authorizes its dispatch, another process sees its lease expired, sweeps it
    (proven absent, queued again) and carries attempt 2 to success; attempt 1 is then fenced off.
    Only the first ``times`` authorizations of this process are preceded so."""
    real_authorize = forward.authorize_dispatch
    takeovers = iter(range(times))

    def authorize_after_takeover(attempt: Any, result: Any, located: Any) -> Any:
        if next(takeovers, None) is None:
            return real_authorize(attempt, result, located)
        with Platform(db_url, lease_ttl_s=10) as other:
            other.db.advance_clock(11)  # that process's view of the database clock: past the lease
            sweeper.sweep(other.db, evidence_key=other.runs.config.evidence_key)
            claim = other.runs.claim_next()
            assert claim is not None and claim.attempt == 2
            assert other.runs.execute(claim).status == "succeeded"
        return real_authorize(attempt, result, located)

    monkeypatch.setattr(forward, "authorize_dispatch", authorize_after_takeover)


def test_a_fenced_forward_attempt_logs_fenced_not_the_newer_attempts_success(
    platform: Platform, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 1 is fenced off at its authorization while attempt 2 (another process) succeeds: the
    worker logs attempt 1 as `attempt.abandoned outcome=fenced`, no `run.finished`, and counts it once."""
    definition = harness.inline_definition(tmp_path / "defs", "fenced_fwd", publish_to="sink")
    run_id = platform.runs.submit(harness.request_for(definition, {"n": "1"}, "k-1")).run.run_id
    _fence_at_authorization(monkeypatch, db_url)
    with capture_logs() as logs:
        summary = Worker(platform.runs, WorkerOptions(once=True, **FAST)).run()
    run = platform.runs.get(run_id)
    assert (run.status, run.attempt) == ("succeeded", 2)  # attempt 2's doing, in another process
    assert not [e for e in logs if e["event"] == "run.finished"], logs
    [abandoned] = [e for e in logs if e["event"] == "attempt.abandoned"]
    assert (abandoned["attempt"], abandoned["outcome"], abandoned["reason"]) == (1, "fenced", "stale_attempt")
    assert (abandoned["run_status"], abandoned["run_attempt"]) == ("succeeded", 2)
    assert summary.claimed == 1 and summary.outcomes == {"fenced": 1} and summary.abandoned == 1


def test_every_attempt_is_counted_once_under_its_own_outcome(
    platform: Platform, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker carries two runs: the first attempt is fenced off (another process's attempt 2
    succeeds), the second succeeds. The totals it logs at its stop hold one of each, adding up to the
    attempts it claimed (today's code counted the other process's success as its own: two)."""
    definition = harness.inline_definition(tmp_path / "defs", "counted", publish_to="sink")
    for number in (1, 2):
        platform.runs.submit(harness.request_for(definition, {"n": str(number)}, f"k-{number}"))
    _fence_at_authorization(monkeypatch, db_url, times=1)
    with capture_logs() as logs:
        summary = Worker(platform.runs, WorkerOptions(until_idle=True, **FAST)).run()
    [stopped] = [e for e in logs if e["event"] == "worker.stopped"]
    assert stopped["outcomes"] == {"fenced": 1, "succeeded": 1}, stopped
    assert sum(summary.outcomes.values()) == summary.claimed == 2


def test_a_worker_logs_the_end_of_a_database_outage_once(platform: Platform, tmp_path: Path) -> None:
    """Claims raise StorageUnavailable three times (a wrapper we control), then work: the worker logs
    each failed try with the outage's age and failures so far, then `storage.recovered` once, with
    the failures and a duration at least the back-off it waited (0.01 + 0.02 + 0.04 s)."""
    definition = harness.inline_definition(tmp_path / "defs", "outage")
    platform.runs.submit(harness.request_for(definition, {"n": "1"}, "k-1"))
    real_claim = platform.runs.claim_next
    failures = iter(range(3))

    def flaky_claim() -> Any:
        if next(failures, None) is not None:
            raise StorageUnavailable("the platform database is unavailable: connection refused")
        return real_claim()

    platform.runs.claim_next = flaky_claim  # type: ignore[method-assign]
    with capture_logs() as logs:
        Worker(platform.runs, WorkerOptions(until_idle=True, **FAST)).run()
    down = [e for e in logs if e["event"] == "storage.unavailable"]
    assert [e["failures"] for e in down] == [1, 2, 3] and down[0]["outage_s"] == 0.0
    [recovered] = [e for e in logs if e["event"] == "storage.recovered"]
    assert recovered["failures"] == 3 and recovered["outage_s"] >= 0.07  # the first guarded step that worked
