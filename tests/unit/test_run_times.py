"""A run's durations on the pages (issue 30, item 4): the one human duration form, the milestones and
phases read from a run's ledger entries, and the history's duration from the projection alone."""

from __future__ import annotations

import pytest

from durable_dataflow.api import web
from durable_dataflow.core.units import US_PER_S
from durable_dataflow.dataflow.protocol import evidence, views
from durable_dataflow.dataflow.protocol.runs import Run, RunStatus
from durable_dataflow.dataflow.protocol.views import (
    Milestone,
    Phase,
    duration_text,
    elapsed_us,
    run_milestones,
    run_phases,
)

S = US_PER_S
T0 = 1_790_000_000 * S  # any database-clock time


@pytest.mark.parametrize(
    ("us", "text"),
    [
        (0, "0 ms"),
        (-5 * S, "0 ms"),  # two hosts' clocks: never a negative duration
        (999, "0 ms"),
        (850_000, "850 ms"),
        (999_999, "999 ms"),
        (S, "1.0 s"),
        (12_345_678, "12.3 s"),
        (59_999_999, "59.9 s"),  # cut, not rounded up to "60.0 s"
        (60 * S, "1 min 00 s"),
        (245 * S, "4 min 05 s"),
        (3_599 * S, "59 min 59 s"),
        (3_600 * S, "1 h 00 min"),
        (2 * 3_600 * S + 3 * 60 * S + 59 * S, "2 h 03 min"),
        (86_399 * S, "23 h 59 min"),
        (86_400 * S, "1 d 00 h"),
        (3 * 86_400 * S + 4 * 3_600 * S + 59 * 60 * S, "3 d 04 h"),
        (400 * 86_400 * S, "400 d 00 h"),
    ],
)
def test_duration_text(us: int, text: str) -> None:
    """Milliseconds under a second, tenths of seconds under a minute, then two units with a padded second."""
    assert duration_text(us) == text


def test_web_ages_use_the_same_form() -> None:
    """The pages' ages (``web.age_text``, seconds as a float) read like their durations."""
    assert web.age_text(0.85) == "850 ms" and web.age_text(245) == "4 min 05 s" and web.age_text(-1) == "0 ms"


def _at(*kinds_and_seconds: tuple[str, float]) -> list[tuple[str, int]]:
    return [(kind, T0 + round(seconds * S)) for kind, seconds in kinds_and_seconds]


E = evidence
ATOMIC_SUCCEEDED = _at((E.RUN_RECORDED, 0), (E.ATTEMPT_STARTED, 2), (E.RESULT_COMMITTED, 14.5), (E.RUN_SUCCEEDED, 14.5))
PUBLISHED = _at(
    (E.RUN_RECORDED, 0), (E.ATTEMPT_STARTED, 1), (E.DISPATCH_AUTHORIZED, 30),
    (E.PUBLICATION_CONFIRMED, 95), (E.RUN_SUCCEEDED, 95),
)  # fmt: skip


def test_an_atomic_success_has_two_phases() -> None:
    assert run_milestones(ATOMIC_SUCCEEDED) == [
        Milestone("recorded", T0), Milestone("started", T0 + 2 * S), Milestone("succeeded", T0 + 14_500_000)
    ]  # fmt: skip
    assert run_phases(ATOMIC_SUCCEEDED, now_us=T0 + 999 * S) == [
        Phase("recorded → started", T0, T0 + 2 * S), Phase("started → succeeded", T0 + 2 * S, T0 + 14_500_000)
    ]  # fmt: skip


def test_a_publication_ends_at_its_confirmation() -> None:
    """Forward recovery: recorded → started → dispatch authorized → confirmed; nothing is open."""
    assert [p.name for p in run_phases(PUBLISHED, now_us=T0 + 999 * S)] == [
        "recorded → started", "started → dispatch authorized", "dispatch authorized → confirmed"
    ]  # fmt: skip
    assert run_phases(PUBLISHED, T0)[-1] == Phase("dispatch authorized → confirmed", T0 + 30 * S, T0 + 95 * S)


def test_a_run_in_progress_ends_with_an_open_phase_to_now() -> None:
    """Queued, running, authorized: the last phase runs to the database's now and names the state."""
    now = T0 + 100 * S
    assert run_phases(_at((E.RUN_RECORDED, 0)), now) == [Phase("recorded → now (still queued)", T0, now)]
    running = _at((E.RUN_RECORDED, 0), (E.ATTEMPT_STARTED, 5))
    assert run_phases(running, now)[-1] == Phase("started → now (still running)", T0 + 5 * S, now)
    authorized = [*running, *_at((E.DISPATCH_AUTHORIZED, 7))]
    assert run_phases(authorized, now)[-1] == Phase("dispatch authorized → now (still running)", T0 + 7 * S, now)
    # A database clock behind the last entry (another host's) never gives a negative phase.
    assert run_phases(authorized, T0)[-1].end_us == T0 + 7 * S


def test_an_unresolved_run_and_its_reconciliation() -> None:
    """outcome_unknown ends the authorized phase and stays open; reconcile attempts that decide nothing do
    not move it; a reconciliation that finds the publication confirms it; a requeue and retry keep the
    first start."""
    unknown = _at(
        (E.RUN_RECORDED, 0), (E.ATTEMPT_STARTED, 1), (E.DISPATCH_AUTHORIZED, 2), (E.PUBLICATION_UNKNOWN, 10),
        (E.RECONCILE_STARTED, 500), (E.RECONCILE_UNDECIDED, 501),
    )  # fmt: skip
    now = T0 + 3_600 * S
    assert run_phases(unknown, now)[-2:] == [
        Phase("dispatch authorized → outcome unknown", T0 + 2 * S, T0 + 10 * S),
        Phase("outcome unknown → now (still outcome_unknown)", T0 + 10 * S, now),
    ]
    present = [*unknown, *_at((E.RECONCILE_STARTED, 900), (E.RECONCILE_PRESENT, 901), (E.RUN_SUCCEEDED, 901))]
    assert run_milestones(present)[-1] == Milestone("confirmed", T0 + 901 * S)
    assert run_phases(present, now)[-1] == Phase("dispatch authorized → confirmed", T0 + 2 * S, T0 + 901 * S)
    retried = _at(
        (E.RUN_RECORDED, 0), (E.ATTEMPT_STARTED, 1), (E.ATTEMPT_RECOVERED, 40), (E.ATTEMPT_STARTED, 41),
        (E.RUN_FAILED, 50),
    )  # fmt: skip
    assert run_phases(retried, now) == [
        Phase("recorded → started", T0, T0 + S), Phase("started → failed", T0 + S, T0 + 50 * S)
    ]  # fmt: skip


def test_the_other_ends() -> None:
    """Cancelled while queued, reconciled absent, resumed and published, evidence failed."""
    now = T0 + 3_600 * S
    cancelled = _at((E.RUN_RECORDED, 0), (E.RUN_CANCELLED, 3))
    assert run_phases(cancelled, now) == [Phase("recorded → cancelled", T0, T0 + 3 * S)]
    absent = _at(
        (E.RUN_RECORDED, 0), (E.ATTEMPT_STARTED, 1), (E.DISPATCH_AUTHORIZED, 2), (E.PUBLICATION_UNKNOWN, 3),
        (E.RECONCILE_STARTED, 60), (E.RECONCILE_ABSENT, 61),
    )  # fmt: skip
    assert run_phases(absent, now)[-1] == Phase("dispatch authorized → reconciled absent", T0 + 2 * S, T0 + 61 * S)
    again = _at(
        (E.RESUME_STARTED, 70), (E.DISPATCH_AUTHORIZED, 70), (E.PUBLICATION_CONFIRMED, 80), (E.RUN_SUCCEEDED, 80)
    )
    resumed = [*absent, *again]
    assert [m.name for m in run_milestones(resumed)] == ["recorded", "started", "dispatch authorized", "confirmed"]
    assert run_milestones(resumed)[2].at_us == T0 + 2 * S  # the first authorization
    broken = _at((E.RUN_RECORDED, 0), (E.ATTEMPT_STARTED, 1), (E.EVIDENCE_FAILED, 9))
    assert run_phases(broken, now)[-1] == Phase("evidence failed → now (still evidence_failed)", T0 + 9 * S, now)
    assert run_phases([], now) == [] and run_milestones([]) == []


def _run(status: RunStatus, created: int, updated: int) -> Run:
    return Run.model_construct(status=status, created_at_us=created, updated_at_us=updated, corrupt=None)


@pytest.mark.parametrize(
    ("status", "cell"),
    [
        (RunStatus.SUCCEEDED, "12.3 s"),
        (RunStatus.FAILED, "12.3 s"),
        (RunStatus.CANCELLED, "12.3 s"),
        (RunStatus.QUEUED, "queued for 1 min 40 s"),
        (RunStatus.RUNNING, "running for 1 min 40 s"),
        (RunStatus.OUTCOME_UNKNOWN, "—"),
        (RunStatus.EVIDENCE_FAILED, "—"),
    ],
)
def test_the_history_duration(status: RunStatus, cell: str) -> None:
    """Finished: recorded → its last transition; in progress: recorded → the database's now; unresolved:
    none (every reconcile attempt writes its row, so ``updated_at_us`` is not when it became so)."""
    run = _run(status, T0, T0 + 12_345_678)
    assert web.duration_cell(run, T0 + 100 * S) == cell


def test_an_unreadable_run_has_no_duration() -> None:
    assert elapsed_us(_run(RunStatus.SUCCEEDED, T0, T0 + S).model_copy(update={"corrupt": "status"}), T0) is None


def test_terminal_ages_show_their_largest_unit_only() -> None:
    """The terminal tables' ages (``views.age_text``): one unit, cut, never rounded up; negative is 0s."""
    ages = [views.age_text(s) for s in (-5, 0, 59.9, 60, 3_599, 3_600, 86_399, 3 * 86_400 + 5)]
    assert ages == ["0s", "0s", "59s", "1m", "59m", "1h", "23h", "3d"]
