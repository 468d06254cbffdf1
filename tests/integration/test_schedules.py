"""Exactly-once ticks on both engines: racing evaluators, catch-up, overlap policies, re-apply, pause."""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durable_dataflow.core import units
from durable_dataflow.core.errors import InputError, NotFound
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.protocol.requests import AccessContext
from durable_dataflow.dataflow.protocol.runs import RunStatus
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.dataflow.schedules.schedule_schema import schedule_ticks
from durable_dataflow.dataflow.schedules.schedule_schema import schedules as schedules_table
from durable_dataflow.platform import Platform

UTC = dt.UTC
T0 = dt.datetime(2026, 3, 1, 0, 0, tzinfo=UTC)
HOUR = dt.timedelta(hours=1)


def scheduled(
    cron: str = "0 * * * *", *, overlap: str = "skip", window: str = "1d", name: str = "hourly"
) -> Definition:
    return Definition.model_validate({
        "name": name, "version": 1,
        "parameters": {"day": {"type": "date"}, "at": {"type": "string", "default": ""}},
        "sources": {"nums": {"kind": "inline", "rows": [{"n": 1}], "schema": {"n": "int64"}}},
        "steps": [{"name": "result", "sql": "select $day::DATE as day, $at as at, sum(n) as total from nums"}],
        "output": {"schema": {"day": "date", "at": "string", "total": "int64"}, "max_rows": 10, "max_bytes": "64KiB"},
        "schedule": {
            "cron": cron, "timezone": "Europe/Berlin", "overlap": overlap, "catchup_window": window,
            "parameters": {"day": "{{ tick.date - 1 day }}", "at": "{{ tick.iso }}"},
        },
    })  # fmt: skip


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=5) as opened:
        yield opened


def _apply(platform: Platform, tmp_path: Path, definition: Definition, tenant: str = "default") -> Any:
    return schedules.apply(
        platform.runs, definition, workspace.local(tmp_path), AccessContext.local(tenant), now=T0
    )


def _tick_rows(platform: Platform) -> list[Any]:
    with platform.db.read() as conn:
        return list(conn.execute(sa.select(schedule_ticks).order_by(schedule_ticks.c.tick_us)))


def _finish_all(platform: Platform) -> None:
    while (claim := platform.runs.claim_next()) is not None:
        platform.runs.execute(claim)


def test_due_ticks_are_submitted_with_their_key_and_parameters(platform: Platform, tmp_path: Path) -> None:
    """Proves the key and the parameters come from the tick: three hourly ticks after the apply."""
    _apply(platform, tmp_path, scheduled(overlap="allow"))
    evaluation = schedules.evaluate(platform.db, platform.runs, T0 + 3 * HOUR)
    assert [d.decision for d in evaluation.decisions] == ["submitted"] * 3
    first = platform.runs.get(evaluation.decisions[0].run_id or "")
    assert first.idempotency_key == "schedule:default:hourly:2026-03-01T01:00:00Z"
    assert first.parameters == {"day": "2026-02-28", "at": "2026-03-01T01:00:00Z"}
    assert first.provenance["trigger"] == "schedule"
    again = schedules.evaluate(platform.db, platform.runs, T0 + 3 * HOUR)
    assert again.decisions == []  # nothing new is due: an evaluation is idempotent
    _finish_all(platform)
    assert platform.runs.get(first.run_id).status == RunStatus.SUCCEEDED


def test_racing_evaluators_create_one_run_and_one_decision_per_tick(db_url: str, tmp_path: Path) -> None:
    """Proves exactly once: eight evaluators, each its own platform (connection pool), released at once
    on the same six due ticks, leave six decisions and six runs, each tick's key once."""
    evaluators = [Platform(db_url, lease_ttl_s=5) for _ in range(8)]
    try:
        _apply(evaluators[0], tmp_path, scheduled(overlap="allow"))
        barrier = threading.Barrier(len(evaluators))
        failures: list[BaseException] = []

        def evaluate(p: Platform) -> None:
            try:
                barrier.wait()
                schedules.evaluate(p.db, p.runs, T0 + 6 * HOUR)
            except BaseException as error:  # reported below: a thread's exception is otherwise lost
                failures.append(error)

        threads = [threading.Thread(target=evaluate, args=(p,)) for p in evaluators]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failures == []
        rows = _tick_rows(evaluators[0])
        assert [r.decision for r in rows] == ["submitted"] * 6
        with evaluators[0].db.read() as conn:
            keys = [row.idempotency_key for row in conn.execute(sa.text("SELECT idempotency_key FROM dataflow_runs"))]
        assert len(keys) == 6 and len(set(keys)) == 6
        assert {r.run_id for r in rows} == {
            evaluators[0].runs.get(r.run_id).run_id for r in rows
        }  # every decision names its run
    finally:
        for p in evaluators:
            p.close()


def test_catch_up_runs_ticks_inside_the_window_and_records_older_ones_skipped(
    platform: Platform, tmp_path: Path
) -> None:
    """Proves the window: after a 10-hour outage with a 3-hour window, the seven older ticks are
    skipped_catchup with no run and the three inside it are submitted."""
    _apply(platform, tmp_path, scheduled(overlap="allow", window="3h"))
    now = T0 + 10 * HOUR + dt.timedelta(minutes=30)
    decided = schedules.evaluate(platform.db, platform.runs, now).decisions
    assert [d.decision for d in decided] == ["skipped_catchup"] * 7 + ["submitted"] * 3
    assert all(d.run_id is None for d in decided[:7]) and all(d.run_id for d in decided[7:])
    assert decided[7].tick == "2026-03-01T08:00:00Z"
    with platform.db.read() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM dataflow_runs")).scalar() == 3


@pytest.mark.parametrize(
    ("overlap", "second", "third"),
    [
        # Tick 2 is due while tick 1's run is queued; tick 3 after it finished.
        ("skip", ["skipped_overlap"], ["submitted"]),
        ("allow", ["submitted"], ["submitted"]),
        # buffer_one: tick 2 waits undecided; once the run finished it is submitted, and tick 3 (the
        # newest, due while tick 2's run is queued) waits in turn.
        ("buffer_one", [], ["submitted"]),
    ],
)
def test_overlap_policies(
    platform: Platform, tmp_path: Path, overlap: str, second: list[str], third: list[str]
) -> None:
    """Proves each policy's decision for a tick due while the previous tick's run is unfinished."""
    _apply(platform, tmp_path, scheduled(overlap=overlap))
    first = schedules.evaluate(platform.db, platform.runs, T0 + HOUR).decisions
    assert [d.decision for d in first] == ["submitted"]
    assert [d.decision for d in schedules.evaluate(platform.db, platform.runs, T0 + 2 * HOUR).decisions] == second
    _finish_all(platform)
    decided = schedules.evaluate(platform.db, platform.runs, T0 + 3 * HOUR).decisions
    assert [d.decision for d in decided] == third
    ticks = {r.tick_us: r.decision for r in _tick_rows(platform)}
    if overlap == "buffer_one":
        assert decided[0].tick == "2026-03-01T02:00:00Z"  # the buffered tick ran, late, once
        assert len(ticks) == 2  # tick 3 is buffered: undecided
    elif overlap == "skip":
        assert decided[0].tick == "2026-03-01T03:00:00Z"
        assert sorted(ticks.values()) == ["skipped_overlap", "submitted", "submitted"]


def test_buffer_one_keeps_only_the_newest_waiting_tick(platform: Platform, tmp_path: Path) -> None:
    """Five ticks due while the first run is queued: four are skipped_overlap, the newest waits."""
    _apply(platform, tmp_path, scheduled(overlap="buffer_one"))
    schedules.evaluate(platform.db, platform.runs, T0 + HOUR)
    decided = schedules.evaluate(platform.db, platform.runs, T0 + 6 * HOUR).decisions
    assert [d.decision for d in decided] == ["skipped_overlap"] * 4
    _finish_all(platform)
    (late,) = schedules.evaluate(platform.db, platform.runs, T0 + 6 * HOUR).decisions
    assert (late.tick, late.decision) == ("2026-03-01T06:00:00Z", "submitted")


def test_reapplying_an_unchanged_definition_writes_nothing(platform: Platform, tmp_path: Path) -> None:
    """Proves the no-op: the second apply reports unchanged and the row (times included) is identical;
    a changed schedule is a change and its ticks start after the new apply."""
    first = _apply(platform, tmp_path, scheduled())
    assert (first.created, first.changed) == (True, True)
    with platform.db.read() as conn:
        before = conn.execute(sa.select(schedules_table)).all()
    again = schedules.apply(platform.runs, scheduled(), workspace.local(tmp_path), AccessContext.local(),
                            now=T0 + 5 * HOUR)  # fmt: skip
    assert (again.created, again.changed) == (False, False)
    with platform.db.read() as conn:
        assert conn.execute(sa.select(schedules_table)).all() == before
    changed = schedules.apply(platform.runs, scheduled("30 * * * *"), workspace.local(tmp_path), AccessContext.local(),
                              now=T0 + 5 * HOUR)  # fmt: skip
    assert (changed.created, changed.changed) == (False, True)
    decided = schedules.evaluate(platform.db, platform.runs, T0 + 6 * HOUR).decisions
    assert [d.tick for d in decided] == ["2026-03-01T05:30:00Z"]


def test_pause_and_resume(platform: Platform, tmp_path: Path) -> None:
    """Paused, nothing is decided; resumed, ticks start after the resume, the paused ones never run."""
    _apply(platform, tmp_path, scheduled(overlap="allow"))
    schedules.set_paused(platform.db, "default", "hourly", True, now=T0)
    assert schedules.evaluate(platform.db, platform.runs, T0 + 3 * HOUR).decisions == []
    schedules.set_paused(platform.db, "default", "hourly", False, now=T0 + 3 * HOUR + dt.timedelta(minutes=1))
    decided = schedules.evaluate(platform.db, platform.runs, T0 + 5 * HOUR).decisions
    assert [d.tick for d in decided] == ["2026-03-01T04:00:00Z", "2026-03-01T05:00:00Z"]


def test_schedules_are_per_tenant(platform: Platform, tmp_path: Path) -> None:
    """Proves isolation: one name in two tenants is two schedules with their own keys; a tenant cannot
    pause, see or evaluate another's."""
    _apply(platform, tmp_path, scheduled(overlap="allow"), tenant="acme")
    _apply(platform, tmp_path, scheduled(overlap="allow"), tenant="globex")
    with pytest.raises(NotFound):
        schedules.set_paused(platform.db, "initech", "hourly", True)
    schedules.set_paused(platform.db, "acme", "hourly", True)
    decided = schedules.evaluate(platform.db, platform.runs, T0 + HOUR).decisions
    assert [(d.tenant, d.decision) for d in decided] == [("globex", "submitted")]
    assert platform.runs.get(decided[0].run_id or "").idempotency_key.startswith("schedule:globex:")
    assert [s.applied.tenant for s in schedules.statuses(platform.db, "acme", T0)] == ["acme"]


def test_a_definition_without_a_schedule_cannot_be_applied(platform: Platform, tmp_path: Path) -> None:
    plain = Definition.model_validate({**scheduled().model_dump(by_alias=True), "schedule": None})
    with pytest.raises(InputError):
        _apply(platform, tmp_path, plain)
    with platform.db.read() as conn:
        assert conn.execute(sa.select(schedules_table)).all() == []


def test_a_decision_without_its_run_is_repaired(platform: Platform, tmp_path: Path) -> None:
    """An evaluator that died between the decision and the submit: the next evaluation submits the
    run under the same key, once."""
    applied = _apply(platform, tmp_path, scheduled()).schedule
    tick = applied.spec.tick_at(T0 + HOUR)
    schedules._decide(platform.db, applied, tick, "submitted")  # the dead evaluator's only commit
    decided = schedules.evaluate(platform.db, platform.runs, T0 + HOUR).decisions
    assert [d.decision for d in decided] == ["submitted"] and decided[0].run_id is not None
    assert schedules.evaluate(platform.db, platform.runs, T0 + HOUR).decisions == []
    with platform.db.read() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM dataflow_runs")).scalar() == 1


def test_two_workers_submit_and_run_each_due_tick_once(db_url: str, tmp_path: Path) -> None:
    """Proves `dataflow worker` evaluates schedules: two workers, one after the other (until idle), over a
    schedule applied 3.5 hours before the database clock's now leave one succeeded run per due tick; the
    second worker's evaluation decides nothing again."""
    from durable_dataflow.dataflow.worker import Worker, WorkerOptions

    first, second = Platform(db_url, lease_ttl_s=5), Platform(db_url, lease_ttl_s=5)
    try:
        with first.db.read() as conn:
            now = units.from_us(first.db.now_us(conn))
        schedules.apply(first.runs, scheduled(overlap="allow"), workspace.local(tmp_path), AccessContext.local(),
                        now=now - 3 * HOUR - dt.timedelta(minutes=30))  # fmt: skip
        for p in (first, second):
            Worker(p.runs, WorkerOptions(until_idle=True, poll_interval_s=0.01)).run()
        with first.db.read() as conn:
            end = units.from_us(first.db.now_us(conn))
        # The hourly ticks after the apply and up to the workers' last evaluation: 3, or 4 when the
        # wall clock's minute is below 30 (the apply was 3.5 hours back) or an hour began meanwhile.
        start = now - 3 * HOUR - dt.timedelta(minutes=30)
        hour = start.replace(minute=0, second=0, microsecond=0)
        due = sum(1 for k in range(1, 6) if start < hour + k * HOUR <= end)
        assert due in (3, 4, 5)
        rows = _tick_rows(first)
        assert [r.decision for r in rows] == ["submitted"] * due
        assert {first.runs.get(r.run_id).status for r in rows} == {RunStatus.SUCCEEDED}
        with first.db.read() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM dataflow_runs")).scalar() == due
    finally:
        first.close()
        second.close()


def test_a_worker_decides_a_tick_when_it_falls_due_not_at_its_next_interval(db_url: str, tmp_path: Path) -> None:
    """Proves a worker evaluates at the earliest schedule's next-due instant (issue 29, item 7: A's ticks
    within 2 s of their time), not only every ``schedule_interval_s``: with the interval at an hour, a
    schedule whose next tick is reached (the database clock moved past it) is decided within seconds.
    On a worker that evaluated only by interval, no decision would come within the hour."""
    from durable_dataflow.dataflow.worker import Worker, WorkerOptions

    with Platform(db_url, lease_ttl_s=5) as platform:
        with platform.db.read() as conn:
            now = units.from_us(platform.db.now_us(conn))
        schedules.apply(platform.runs, scheduled("* * * * *"), workspace.local(tmp_path), AccessContext.local(),
                        now=now)  # fmt: skip
        next_due_s = schedules.seconds_until_due(platform.db)
        assert next_due_s is not None and 0 < next_due_s <= 60
        # One worker object driven one turn at a time (`once`: one turn, then back here), so no thread and
        # no wait: the first turn evaluates (nothing is due yet); the clock then passes the tick; the second
        # turn must evaluate again, though its hour-long interval has not passed, and run the tick's run.
        worker = Worker(platform.runs, WorkerOptions(once=True, schedule_interval_s=3600.0, poll_interval_s=0.05))
        worker.run()
        assert worker.summary.schedule_evaluations == 1 and not _tick_rows(platform)
        platform.db.advance_clock(next_due_s + 1)  # the worker shares this clock: the tick is due now
        worker.run()
        rows = _tick_rows(platform)
        assert [r.decision for r in rows] == ["submitted"], rows
        assert worker.summary.schedule_evaluations == 2
        assert platform.runs.get(rows[0].run_id).status == RunStatus.SUCCEEDED
        assert schedules.seconds_until_due(platform.db) > 0  # the next tick is a minute later


def test_a_worker_polling_every_10_ms_reads_the_earliest_due_at_most_once_a_second(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the probe of the earliest next-due instant is spaced by DUE_PROBE_S_MIN, whatever the poll
    interval: a worker polling every 10 ms read it once per turn (once per run under load, a statement and
    about a tenth of a busy worker's CPU in the throughput benchmark). 40 turns of one worker object; the
    probes (counted by a spy around the real function) are at most one per second of the turns' time."""
    from durable_dataflow.dataflow import worker as worker_mod
    from durable_dataflow.dataflow.worker import Worker, WorkerOptions

    probes: list[float] = []
    real = schedules.seconds_until_due

    def counted(db: Any) -> float | None:
        probes.append(time.monotonic())
        return real(db)

    monkeypatch.setattr(schedules, "seconds_until_due", counted)
    with Platform(db_url, lease_ttl_s=5) as platform:
        schedules.apply(platform.runs, scheduled("0 0 1 1 *"), workspace.local(tmp_path), AccessContext.local())
        worker = Worker(platform.runs, WorkerOptions(once=True, schedule_interval_s=3600.0, poll_interval_s=0.01))
        started = time.monotonic()
        for _ in range(40):
            worker.run()
        elapsed = time.monotonic() - started
    assert worker.summary.schedule_evaluations == 1  # the first turn's; nothing fell due after it
    assert 1 <= len(probes) <= 1 + int(elapsed / worker_mod.DUE_PROBE_S_MIN), (len(probes), elapsed)
    assert all(b - a >= worker_mod.DUE_PROBE_S_MIN for a, b in itertools.pairwise(probes))
