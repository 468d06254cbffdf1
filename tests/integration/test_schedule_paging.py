"""Schedule evaluation and listing through every tenant on SQLite and PostgreSQL: an evaluation reads
only the schedules that are enabled and due, page after page, so a tenant with many disabled schedules
cannot starve another's, and `schedules list` pages instead of cutting (issue 29, finding 1)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from typer.testing import CliRunner

from durable_dataflow.cli import app as cli_app
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.protocol import quotas
from durable_dataflow.dataflow.protocol.requests import AccessContext
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.dataflow.schedules.schedule_schema import schedules as schedules_table
from durable_dataflow.platform import Platform
from support import flows

T0 = dt.datetime(2026, 3, 1, 0, 0, tzinfo=dt.UTC)
HOUR = dt.timedelta(hours=1)
PAGE = 5
FLOOD = 2 * PAGE + 1  # more disabled schedules than two pages hold
VICTIM = "z-victim"
FLOODER = "a-first"


def scheduled(name: str, *, enabled: bool = True, cron: str = "0 * * * *", overlap: str = "skip") -> Definition:
    return Definition.model_validate({
        "name": name, "version": 1,
        "sources": {"nums": {"kind": "inline", "rows": [{"n": 1}], "schema": {"n": "int64"}}},
        "steps": [{"name": "result", "sql": "select sum(n) as total from nums"}],
        "output": {"schema": {"total": "int64"}, "max_rows": 10, "max_bytes": "64KiB"},
        "schedule": {"cron": cron, "timezone": "UTC", "enabled": enabled, "overlap": overlap},
    })  # fmt: skip


@pytest.fixture
def platform(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Platform]:
    monkeypatch.setattr(schedules, "EVALUATION_PAGE_SCHEDULES", PAGE, raising=False)
    # The global cap of the code before paging, made as small as a page: the victim would be cut.
    monkeypatch.setattr(schedules, "SCHEDULES_PER_EVALUATION_MAX", PAGE, raising=False)
    with Platform(db_url, lease_ttl_s=5) as opened:
        yield opened


def _apply(platform: Platform, tmp_path: Path, tenant: str, definition: Definition) -> None:
    schedules.apply(platform.runs, definition, workspace.local(tmp_path), AccessContext.local(tenant), now=T0)


def _flood(platform: Platform, tmp_path: Path) -> None:
    for number in range(FLOOD):
        _apply(platform, tmp_path, FLOODER, scheduled(f"off_{number:02d}", enabled=False))


def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the schedule rows read from here on (every read goes through ``_from_row``)."""
    read: list[str] = []
    original: Callable[[Any], schedules.AppliedSchedule] = schedules._from_row

    def counted(row: Any) -> schedules.AppliedSchedule:
        read.append(f"{row.tenant}/{row.name}")
        return original(row)

    monkeypatch.setattr(schedules, "_from_row", counted)
    return read


def test_a_tenant_with_many_disabled_schedules_does_not_starve_another(platform: Platform, tmp_path: Path) -> None:
    """Proves no tenant's schedules push another's out: with pages of 5, tenant a-first (sorting first)
    applies 11 disabled schedules, then z-victim an hourly one; the next evaluation decides and submits
    the victim's tick (a cap of 5 over all applied schedules by tenant and name never reached it)."""
    _flood(platform, tmp_path)
    _apply(platform, tmp_path, VICTIM, scheduled("hourly"))
    decided = schedules.evaluate(platform.db, platform.runs, T0 + HOUR).decisions
    assert [(d.tenant, d.name, d.decision) for d in decided] == [(VICTIM, "hourly", "submitted")]
    assert decided[0].run_id is not None


def test_an_evaluation_reads_only_enabled_and_due_schedules(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the cost follows the due schedules: with 11 disabled, one paused and one not yet due
    schedule beside the victim's due one, an evaluation reads one schedule row (the victim's), and the
    paused schedule has no next-due instant and no decision."""
    _flood(platform, tmp_path)
    _apply(platform, tmp_path, VICTIM, scheduled("hourly"))
    _apply(platform, tmp_path, VICTIM, scheduled("paused"))
    schedules.set_paused(platform.db, VICTIM, "paused", True, now=T0)
    _apply(platform, tmp_path, VICTIM, scheduled("later", cron="0 12 * * *"))
    schedules.evaluate(platform.db, platform.runs, T0)  # the first evaluation settles the disabled ones
    read = _counting_reads(monkeypatch)
    decided = schedules.evaluate(platform.db, platform.runs, T0 + HOUR).decisions
    assert read == [f"{VICTIM}/hourly"]
    assert [(d.tenant, d.name) for d in decided] == [(VICTIM, "hourly")]
    with platform.db.read() as conn:
        paused_due = conn.execute(
            sa.select(schedules_table.c.next_due_us).filter_by(tenant=VICTIM, name="paused")
        ).scalar_one()
    assert paused_due is None
    assert schedules.decisions(platform.db, VICTIM, "paused") == []


def test_schedules_list_pages_to_the_victims_schedule(platform: Platform, tmp_path: Path, db_url: str) -> None:
    """Proves `schedules list` pages instead of cutting: with --limit 5 the first page names the next
    one in a hint, and following the hints reaches z-victim's schedule; the API pages by next_cursor."""
    _flood(platform, tmp_path)
    _apply(platform, tmp_path, VICTIM, scheduled("hourly"))
    seen: list[str] = []
    after: list[str] = []
    for _ in range(FLOOD):  # bounded: a page of 5 moves past 5 schedules
        args = ["--db", db_url, "schedules", "list", "--json", "--limit", str(PAGE), *after]
        result = CliRunner().invoke(cli_app, args)
        assert result.exit_code == 0, result.output
        seen.extend(f"{item['tenant']}/{item['name']}" for item in json.loads(result.stdout))
        if "--after" not in result.stderr:
            break
        after = ["--after", result.stderr.split("--after", 1)[1].split()[0]]
    assert seen[-1] == f"{VICTIM}/hourly" and len(seen) == FLOOD + 1
    shown = CliRunner().invoke(cli_app, ["--db", db_url, "schedules", "list", "--limit", str(PAGE)])
    assert shown.exit_code == 0 and f"--after {FLOODER}/off_{PAGE - 1:02d}" in shown.stdout, shown.output
    page = schedules.shown_page(platform.db, None, T0, limit=PAGE)
    assert page.more and page.next_after == (FLOODER, f"off_{PAGE - 1:02d}")


# ---- a tenant past a quota (red team of issue 29): its refused ticks cost one submit per evaluation ------
# Found: a refused tick stayed `submitted` without a run and its schedule due at once, so every evaluation
# submitted every such tick again (up to 1000 a schedule) plus every new one: a tenant past queued_runs
# with 100 minutely schedules made an idle worker log 92,225 refusals in 2.5 minutes and claim another
# tenant's runs once a pass.

REFUSING = "a-refused"
REFUSING_SCHEDULES = 4
MINUTE = dt.timedelta(minutes=1)


def _submits_by_tenant(platform: Platform, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many submits each tenant's ticks made from here on (the real submit, counted)."""
    made: dict[str, int] = {}
    original = platform.runs.submit

    def counted(request: Any, **kwargs: Any) -> Any:
        made[request.access.tenant] = made.get(request.access.tenant, 0) + 1
        return original(request, **kwargs)

    monkeypatch.setattr(platform.runs, "submit", counted)
    return made


def test_a_tenant_past_its_quota_costs_one_refused_submit_per_evaluation(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a tenant whose quota refuses its ticks costs an evaluation one refused submit, whatever its
    backlog: with queued_runs at 1, four minutely schedules ten minutes behind make two submits (the one
    queued, the one refused) while the victim's schedule is submitted in full; every tick of the refused
    tenant is recorded submitted without a run, with the refusal. Its schedules wait for their next tick
    (not due 30 s later), then one submit is refused again; once its queue is free, the oldest waiting
    tick is submitted and the next one refused."""
    quotas_file = tmp_path / "quotas.yaml"
    quotas_file.write_text(yaml.safe_dump({"tenants": {REFUSING: {"queued_runs": 1}}}))
    monkeypatch.setenv(quotas.QUOTAS_ENV, str(quotas_file))
    with Platform(db_url) as platform:
        for number in range(REFUSING_SCHEDULES):
            _apply(platform, tmp_path, REFUSING, scheduled(f"every_{number}", cron="* * * * *", overlap="allow"))
        _apply(platform, tmp_path, VICTIM, scheduled("victim", cron="* * * * *", overlap="allow"))
        made = _submits_by_tenant(platform, monkeypatch)
        updates: list[str] = []
        sa.event.listen(platform.db.engine, "before_cursor_execute", lambda _c, _cur, statement, *_: updates.append(
            statement) if statement.startswith("UPDATE schedule_ticks") else None)  # fmt: skip

        decided = schedules.evaluate(platform.db, platform.runs, T0 + 10 * MINUTE).decisions
        assert made == {REFUSING: 2, VICTIM: 10}
        # A tick not tried is written once, with its error: the updates are the 11 runs' and the refusal's.
        assert len(updates) == 12, len(updates)
        victims = [d for d in decided if d.tenant == VICTIM]
        assert len(victims) == 10 and all(d.run_id for d in victims)
        refused = [d for d in decided if d.tenant == REFUSING]
        assert len(refused) == REFUSING_SCHEDULES * 10 and {d.decision for d in refused} == {"submitted"}
        assert [d.run_id is not None for d in refused].count(True) == 1
        assert all("queued_runs" in (d.error or "") for d in refused if d.run_id is None)

        made.clear()
        assert schedules.evaluate(platform.db, platform.runs, T0 + 10 * MINUTE + MINUTE / 2).decisions == []
        assert made == {}
        schedules.evaluate(platform.db, platform.runs, T0 + 12 * MINUTE)
        assert made == {REFUSING: 1, VICTIM: 2}

        claim = platform.runs.claim_next()  # the one queued run of the refused tenant (FIFO: the oldest)
        assert claim is not None and claim.run.tenant == REFUSING
        platform.runs.execute(claim)
        while (other := platform.runs.claim_next()) is not None:  # the victim's
            platform.runs.execute(other)
        made.clear()
        schedules.evaluate(platform.db, platform.runs, T0 + 14 * MINUTE)
        assert made == {REFUSING: 2, VICTIM: 2}


def test_a_refusal_of_one_tick_of_its_own_leaves_the_schedules_other_ticks_submitted(
    db_url: str, tmp_path: Path
) -> None:
    """Proves only a quota's refusal stops a tenant's other ticks: the 01:00 tick's key already names a run
    of another request (a conflict of that tick alone), and the 02:00 and 03:00 ticks are still submitted,
    in that evaluation and the next; the 01:00 tick keeps its conflict. (A first fix stopped a schedule at
    any refusal, so one such tick kept every later tick of its schedule from running: review.)"""
    with Platform(db_url) as platform:
        _apply(platform, tmp_path, VICTIM, scheduled("hourly", overlap="allow"))
        applied = schedules.get(platform.db, VICTIM, "hourly")
        first_tick = applied.spec.tick_at(T0 + HOUR)
        other = schedules.tick_request(applied, first_tick)
        platform.runs.submit(dataclasses.replace(other, definition=scheduled("other")))  # the key, taken
        decided = schedules.evaluate(platform.db, platform.runs, T0 + 3 * HOUR + MINUTE).decisions
        assert [(d.tick, d.run_id is not None) for d in decided] == [
            ("2026-03-01T01:00:00Z", False), ("2026-03-01T02:00:00Z", True), ("2026-03-01T03:00:00Z", True)
        ]
        assert "[conflict]" in (decided[0].error or "") and "not submitted" not in (decided[0].error or "")
        later = schedules.evaluate(platform.db, platform.runs, T0 + 4 * HOUR + MINUTE).decisions
        assert [(d.tick, d.run_id is not None) for d in later] == [
            ("2026-03-01T01:00:00Z", False), ("2026-03-01T04:00:00Z", True)
        ]


def test_a_tick_refused_by_a_quota_is_retried_inside_a_one_minute_catch_up_window(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the wait after a refusal fits the catch-up window: with catchup_window 1m, a tick refused at
    00:05:05 (queued_runs full) is due again 30 s later, not 60 s (by then it would have left the window
    and never run), and is submitted once the queue has room. (A first fix waited 60 s: review.)"""
    quotas_file = tmp_path / "quotas.yaml"
    quotas_file.write_text(yaml.safe_dump({"tenants": {REFUSING: {"queued_runs": 1}}}))
    monkeypatch.setenv(quotas.QUOTAS_ENV, str(quotas_file))
    assert schedules.retry_wait_s(60, None) == 30 and schedules.retry_wait_s(86400, None) == 60
    with Platform(db_url) as platform:
        five = Definition.model_validate({
            **scheduled("five").model_dump(mode="json", exclude_none=True),
            "schedule": {"cron": "*/5 * * * *", "timezone": "UTC", "catchup_window": "1m", "overlap": "allow"},
        })  # fmt: skip
        _apply(platform, tmp_path, REFUSING, five)
        platform.runs.submit(flows.request(flows.definition(), tmp_path, "fills-the-queue", tenant=REFUSING))
        tick = T0 + 5 * MINUTE
        [refused] = schedules.evaluate(platform.db, platform.runs, tick + dt.timedelta(seconds=5)).decisions
        assert refused.run_id is None and "queued_runs" in (refused.error or "")
        claim = platform.runs.claim_next()
        assert claim is not None
        platform.runs.execute(claim)  # the queue has room again
        assert schedules.evaluate(platform.db, platform.runs, tick + dt.timedelta(seconds=20)).decisions == []
        [retried] = schedules.evaluate(platform.db, platform.runs, tick + dt.timedelta(seconds=40)).decisions
        assert (retried.tick, retried.run_id is not None) == ("2026-03-01T00:05:00Z", True)


def test_a_worker_claims_between_the_parts_of_a_long_evaluation(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a worker's schedule evaluation does not hold its claims for the whole backlog: with the
    budget at 0 s, each turn evaluates one due schedule, then claims, and the victim's queued run is
    claimed before the third schedule's ticks are decided; every schedule is evaluated in the end. (A
    first pass over a 3-hour backlog of 100 minutely schedules took 18 s before the worker claimed.)"""
    from durable_dataflow.dataflow import worker as worker_mod
    from durable_dataflow.dataflow.worker import Worker, WorkerOptions

    monkeypatch.setattr(worker_mod, "SCHEDULE_BUDGET_S", 0.0, raising=False)
    events: list[str] = []
    original_evaluate = schedules.evaluate

    def evaluate(*args: Any, **kwargs: Any) -> schedules.Evaluation:
        evaluation = original_evaluate(*args, **kwargs)
        events.extend(sorted({f"decide {d.name}" for d in evaluation.decisions}))
        return evaluation

    monkeypatch.setattr(schedules, "evaluate", evaluate)
    with Platform(db_url) as platform:
        with platform.db.read() as conn:
            now_us = conn.execute(sa.select(platform.db.now_us_expr())).scalar_one()
        now = dt.datetime.fromtimestamp(now_us / 1e6, dt.UTC)
        for number in range(3):
            definition = scheduled(f"hourly_{number}")
            schedules.apply(platform.runs, definition, workspace.local(tmp_path), AccessContext.local(FLOODER),
                            now=now - 2 * HOUR)  # fmt: skip
        platform.runs.submit(flows.request(flows.definition(), tmp_path, "victim-run", tenant=VICTIM))
        original_claim = platform.runs.claim_next

        def claim_next() -> Any:
            claim = original_claim()
            if claim is not None:
                events.append(f"claim {claim.run.tenant}")
            return claim

        monkeypatch.setattr(platform.runs, "claim_next", claim_next)
        Worker(platform.runs, WorkerOptions(until_idle=True, poll_interval_s=0.01, sweep_interval_s=60)).run()
    decided = [e for e in events if e.startswith("decide")]
    assert sorted(decided) == ["decide hourly_0", "decide hourly_1", "decide hourly_2"], events
    assert events.index(f"claim {VICTIM}") < events.index(decided[2]), events
    assert events[0] == decided[0] and events[1].startswith("claim"), events
