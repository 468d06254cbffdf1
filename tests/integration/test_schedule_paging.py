"""Schedule evaluation and listing through every tenant on SQLite and PostgreSQL: an evaluation reads
only the schedules that are enabled and due, page after page, so a tenant with many disabled schedules
cannot starve another's, and `schedules list` pages instead of cutting (issue 29, finding 1)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from durable_dataflow.cli import app as cli_app
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.protocol.requests import AccessContext
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.dataflow.schedules.schedule_schema import schedules as schedules_table
from durable_dataflow.platform import Platform

T0 = dt.datetime(2026, 3, 1, 0, 0, tzinfo=dt.UTC)
HOUR = dt.timedelta(hours=1)
PAGE = 5
FLOOD = 2 * PAGE + 1  # more disabled schedules than two pages hold
VICTIM = "z-victim"
FLOODER = "a-first"


def scheduled(name: str, *, enabled: bool = True, cron: str = "0 * * * *") -> Definition:
    return Definition.model_validate({
        "name": name, "version": 1,
        "sources": {"nums": {"kind": "inline", "rows": [{"n": 1}], "schema": {"n": "int64"}}},
        "steps": [{"name": "result", "sql": "select sum(n) as total from nums"}],
        "output": {"schema": {"total": "int64"}, "max_rows": 10, "max_bytes": "64KiB"},
        "schedule": {"cron": cron, "timezone": "UTC", "enabled": enabled},
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
