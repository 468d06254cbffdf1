"""`dataflow schedules …` and `dataflow backfill` as real processes, on both engines: racing tick
processes, a backfill SIGKILLed and re-run, unresolved runs reported, bad input refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_dataflow import migrations
from durable_dataflow.core.db import Database
from support.cli import CLI_TIMEOUT_S, Cli, make_cli
from support.flows import DAILY_YAML

FLOW = DAILY_YAML
SCHEDULE = """\
schedule:
  cron: "30 2 * * *"
  timezone: Europe/Berlin
  parameters: {day: "{{ tick.date - 1 day }}"}
  overlap: allow
  catchup_window: 7d
"""


@pytest.fixture
def cli(db_url: str, tmp_path: Path) -> Cli:
    return make_cli(db_url, tmp_path)


def _write(tmp_path: Path, text: str, name: str = "daily.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _count(db_url: str, table: str) -> int:
    db = Database(db_url)
    try:
        migrations.upgrade(db)  # a command refused before opening the platform created no table
        with db.read() as conn:
            return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar() or 0)
    finally:
        db.dispose()


def _make_unresolved(db_url: str, run_id: str) -> None:
    """The projection of a run whose publication may exist (what a sweeper writes after a lost dispatch)."""
    db = Database(db_url)
    try:
        with db.begin() as conn:
            conn.execute(
                sa.text("UPDATE dataflow_runs SET status='outcome_unknown', recovery_status='outcome_unknown', "
                        "warning='the publication may exist' WHERE run_id=:r"),
                {"r": run_id},
            )  # fmt: skip
    finally:
        db.dispose()


def test_apply_is_a_no_op_when_unchanged_and_tick_processes_race(cli: Cli, db_url: str, tmp_path: Path) -> None:
    """Proves exactly once across processes: six `schedules tick` processes started together on the same
    due ticks leave one decision and one run per tick."""
    flow = _write(tmp_path, FLOW + SCHEDULE)
    first = cli("schedules", "apply", str(flow), "--now", "2026-03-26T00:00:00Z", "--json")
    assert first.code == 0, first.output
    assert (first.json()["created"], first.json()["changed"]) == (True, True)
    again = cli("schedules", "apply", str(flow), "--now", "2026-03-28T00:00:00Z", "--json")
    assert (again.json()["created"], again.json()["changed"]) == (False, False)
    assert again.json()["schedule"]["applied_at"] == "2026-03-26T00:00:00Z"
    argv = [sys.executable, "-m", "durable_dataflow.cli", "--db", db_url, "schedules", "tick",
            "--now", "2026-03-30T12:00:00Z", "--json"]  # fmt: skip
    processes = [subprocess.Popen(argv, cwd=tmp_path, env=cli.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(6)]  # fmt: skip
    outputs = [p.communicate(timeout=CLI_TIMEOUT_S) for p in processes]
    assert [p.returncode for p in processes] == [0] * 6, outputs
    new = [d for out, _ in outputs for d in json.loads(out)["decisions"] if d["new"]]
    # 27th..30th at 02:30 Berlin; the 29th is the spring-forward day: 02:30 does not exist, 03:00 CEST fires.
    assert sorted(d["tick"] for d in new) == [
        "2026-03-26T01:30:00Z", "2026-03-27T01:30:00Z", "2026-03-28T01:30:00Z", "2026-03-29T01:00:00Z",
        "2026-03-30T00:30:00Z",
    ]  # fmt: skip
    assert _count(db_url, "schedule_ticks") == 5
    assert _count(db_url, "dataflow_runs") == 5
    listed = cli("schedules", "list", "--json", "--now", "2026-03-30T12:00:00Z").json()
    assert listed[0]["last_tick"] == "2026-03-30T00:30:00Z" and listed[0]["next_tick"] == "2026-03-31T00:30:00Z"
    assert listed[0]["last_run_status"] == "queued" and listed[0]["unresolved"] is False


def test_list_shows_an_unresolved_last_run(cli: Cli, db_url: str, tmp_path: Path) -> None:
    flow = _write(tmp_path, FLOW + SCHEDULE)
    cli("schedules", "apply", str(flow), "--now", "2026-03-29T12:00:00Z")
    ticked = cli("schedules", "tick", "--now", "2026-03-30T12:00:00Z", "--json").json()
    _make_unresolved(db_url, ticked["decisions"][0]["run_id"])
    listed = cli("schedules", "list", "--json").json()
    assert listed[0]["unresolved"] is True and listed[0]["last_run_recovery_status"] == "outcome_unknown"
    assert listed[0]["warning"]
    text = cli("schedules", "list")
    assert "UNRESOLVED" in text.stdout and "WARNING:" in text.stdout and "reconcile" in text.stdout


def test_pause_and_resume_by_name(cli: Cli, tmp_path: Path) -> None:
    cli("schedules", "apply", str(_write(tmp_path, FLOW + SCHEDULE)), "--now", "2026-03-26T00:00:00Z")
    assert cli("schedules", "pause", "daily").code == 0
    assert cli("schedules", "tick", "--now", "2026-03-30T12:00:00Z", "--json").json()["decisions"] == []
    assert cli("schedules", "list", "--json").json()[0]["paused"] is True
    resumed = cli("schedules", "resume", "daily", "--now", "2026-03-30T12:00:00Z")
    assert resumed.code == 0 and "active" in resumed.stdout
    missing = cli("schedules", "pause", "nope")
    assert missing.code == 4 and "not_found" in missing.stderr


def test_a_backfill_killed_half_way_and_run_again_leaves_one_run_per_day(
    cli: Cli, db_url: str, tmp_path: Path
) -> None:
    """Proves resumability: SIGKILLed right after its first and then its second new run was recorded, a
    week's backfill run a third time leaves exactly seven runs, and a fourth run submits nothing and
    reports every day."""
    flow = _write(tmp_path, FLOW)
    week = ("backfill", str(flow), "--from", "2026-03-01", "--to", "2026-03-07", "--json")
    for _ in range(2):
        killed = cli(*week, extra_env={"DATAFLOW_CRASH_AT": "after_record"})
        assert killed.code == -9, killed.output
    assert _count(db_url, "dataflow_runs") == 2
    third = cli(*week)
    assert third.code == 0, third.output
    assert [d["created"] for d in third.json()] == [False, False] + [True] * 5
    assert _count(db_url, "dataflow_runs") == 7
    fourth = cli(*week)
    assert [d["created"] for d in fourth.json()] == [False] * 7
    assert [d["tick"] for d in fourth.json()] == [f"2026-03-0{day}" for day in range(1, 8)]
    assert fourth.json()[0]["idempotency_key"] == "backfill:default:daily:2026-03-01"
    assert {d["status"] for d in fourth.json()} == {"queued"}
    assert _count(db_url, "dataflow_runs") == 7


def test_a_backfill_over_an_unresolved_day_reports_it_and_does_not_rerun_it(
    cli: Cli, db_url: str, tmp_path: Path
) -> None:
    flow = _write(tmp_path, FLOW)
    first = cli("backfill", str(flow), "--from", "2026-03-01", "--to", "2026-03-02", "--json").json()
    _make_unresolved(db_url, first[1]["run_id"])
    again = cli("backfill", str(flow), "--from", "2026-03-01", "--to", "2026-03-03", "--json")
    assert again.code == 3
    days = again.json()
    assert [(d["created"], d["unresolved"]) for d in days] == [(False, False), (False, True), (True, False)]
    assert days[1]["run_id"] == first[1]["run_id"]
    text = cli("backfill", str(flow), "--from", "2026-03-01", "--to", "2026-03-03")
    assert text.code == 3 and "UNRESOLVED" in text.stdout and "reconcile" in text.stdout
    assert _count(db_url, "dataflow_runs") == 3


def test_a_backfill_started_by_mistake_is_cancelled_but_never_its_unresolved_day(
    cli: Cli, db_url: str, tmp_path: Path
) -> None:
    """Proves `dataflow backfill cancel`: every queued day is cancelled, the unresolved day is refused
    (exit 5, reconcile named) and left as it is, a day without a run is reported; a re-run of the
    cancel writes nothing; and the backfill run again submits nothing over the cancelled days."""
    flow = _write(tmp_path, FLOW)
    days = cli("backfill", str(flow), "--from", "2026-03-01", "--to", "2026-03-03", "--json").json()
    _make_unresolved(db_url, days[1]["run_id"])
    cancelled = cli("backfill", "cancel", str(flow), "--from", "2026-03-01", "--to", "2026-03-04", "--json")
    assert cancelled.code == 5, cancelled.output
    report = cancelled.json()
    assert [d["outcome"] for d in report] == ["cancelled", "refused", "cancelled", "no_run"]
    assert "dataflow reconcile" in report[1]["detail"] and report[1]["status"] == "outcome_unknown"
    assert [d["status"] for d in report] == ["cancelled", "outcome_unknown", "cancelled", None]
    again = cli("backfill", "cancel", str(flow), "--from", "2026-03-01", "--to", "2026-03-01", "--json")
    assert again.code == 0 and again.json()[0]["outcome"] == "already_cancelled"
    resubmitted = cli("backfill", str(flow), "--from", "2026-03-01", "--to", "2026-03-03", "--json")
    assert [d["created"] for d in resubmitted.json()] == [False, False, False]
    assert [d["status"] for d in resubmitted.json()] == ["cancelled", "outcome_unknown", "cancelled"]
    assert _count(db_url, "dataflow_runs") == 3


def test_a_backfill_uses_the_schedule_ticks_when_there_is_one(cli: Cli, tmp_path: Path) -> None:
    flow = _write(tmp_path, FLOW + SCHEDULE)
    days = cli("backfill", str(flow), "--from", "2026-03-28", "--to", "2026-03-30", "--json").json()
    assert [d["tick"] for d in days] == ["2026-03-28T01:30:00Z", "2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"]
    assert days[0]["idempotency_key"] == "backfill:default:daily:2026-03-28T01:30:00Z"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--from", "2026-01-01", "--to", "2027-01-05"), "at most 366 days"),
        (("--from", "2026-03-05", "--to", "2026-03-01"), "--to must not be before --from"),
        (("--from", "2026-02-30", "--to", "2026-03-01"), "--from must be a date"),
        (("--from", "2026-03-01", "--to", "2026-03-02", "--param", "day={{ tick.iso }}"), "declared date"),
        (("--from", "2026-03-01", "--to", "2026-03-02", "--param", "day={{ os.system }}"), "must be one of"),
    ],
)
def test_bad_backfills_are_refused_before_anything_is_recorded(
    sqlite_url: str, tmp_path: Path, args: tuple[str, ...], expected: str
) -> None:
    """On SQLite only: the refusals are the CLI's checks of its arguments, made before any database write."""
    refused = make_cli(sqlite_url, tmp_path)("backfill", str(_write(tmp_path, FLOW)), *args)
    assert refused.code == 2 and expected in refused.stderr, refused.output
    assert _count(sqlite_url, "dataflow_runs") == 0


def test_bad_schedules_are_refused_before_anything_is_recorded(cli: Cli, db_url: str, tmp_path: Path) -> None:
    for bad in (SCHEDULE.replace("30 2 * * *", "30 2 * *"), SCHEDULE.replace("Europe/Berlin", "Europe/Atlantis")):
        refused = cli("schedules", "apply", str(_write(tmp_path, FLOW + bad)))
        assert refused.code == 2, refused.output
    plain = cli("schedules", "apply", str(_write(tmp_path, FLOW)))
    assert plain.code == 2 and "no schedule" in plain.stderr
    for edge in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"):  # applied, they broke every tick
        refused = cli("schedules", "apply", str(_write(tmp_path, FLOW + SCHEDULE)), "--now", edge)
        assert refused.code == 2 and "--now must be an instant from 1900" in refused.stderr, refused.output
        assert cli("schedules", "tick", "--now", edge).code == 2
    for tenant in ("", "../x", "*", "t" * 129):  # each tick would have been refused, looking submitted
        refused = cli("schedules", "apply", str(_write(tmp_path, FLOW + SCHEDULE)), "--tenant", tenant)
        assert refused.code == 2 and "the tenant must be" in refused.stderr, refused.output
    assert _count(db_url, "schedules") == 0
    assert cli("schedules", "tick").code == 0
