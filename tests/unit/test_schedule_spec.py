"""The ``schedule:`` block: validation, ticks around real DST changes, parameter expressions, and a
definition without the block keeping its hash."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml

from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions import definitions
from durable_dataflow.dataflow.definitions.definitions import Definition, canonical_body, definition_hash
from durable_dataflow.dataflow.definitions.schedule_spec import ScheduleSpec, Tick, instant_of, render
from durable_dataflow.dataflow.schedules import schedules
from support import flows

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# The hashes the examples had before the schedule block existed (computed on the unchanged tree).
REVENUE_HASH = "sha256:775bb13ad43333e0bb03f1a770411a9f588391a60991eb2d2b69449cb3ecd4a4"
MINIMAL_HASH = "sha256:701ec53321bb5fff52d4018998f9ae710448e6d84abc365d03ff13e93b65002e"
UTC = dt.UTC


def _doc(schedule: dict[str, Any] | None = None, **parameters: Any) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(flows.MINIMAL_YAML)
    document["parameters"] = parameters or {"day": {"type": "date"}}
    if schedule is not None:
        document["schedule"] = schedule
    return document


def _parse(document: dict[str, Any]) -> Definition:
    return definitions.parse_definition(yaml.safe_dump(document, sort_keys=False), "flow.yaml")


def _day_ticks(spec: ScheduleSpec, day: dt.date) -> list[str]:
    zone = spec.zone()
    start = dt.datetime(day.year, day.month, day.day, tzinfo=zone).astimezone(UTC)
    end = (dt.datetime(day.year, day.month, day.day, tzinfo=zone) + dt.timedelta(days=1)).astimezone(UTC)
    return [t.iso for t in spec.ticks(start - dt.timedelta(microseconds=1), end - dt.timedelta(microseconds=1), 500)]


# ---- the hash of a definition without the block -------------------------------------------------------


def test_definitions_without_a_schedule_keep_their_hash() -> None:
    """Proves the block is invisible when absent: the example's and the minimal definition's hashes are
    the ones computed before the block existed, and no canonical body has a `schedule` key."""
    revenue = definitions.load_definition(EXAMPLES / "revenue_by_region" / "dataflow.yaml").definition
    assert definition_hash(revenue) == REVENUE_HASH
    minimal = definitions.parse_definition(flows.MINIMAL_YAML, "flow.yaml")
    assert definition_hash(minimal) == MINIMAL_HASH
    assert "schedule" not in canonical_body(revenue)
    assert "schedule" not in canonical_body(minimal)


def test_a_schedule_is_part_of_the_body_and_round_trips() -> None:
    """The pinned body holds the schedule (a run re-executes what it recorded), and another schedule is
    another definition hash."""
    daily = {"cron": "0 6 * * *", "timezone": "Europe/Berlin", "parameters": {"day": "{{ tick.date }}"}}
    scheduled = _parse(_doc(daily))
    body = canonical_body(scheduled)
    assert body["schedule"]["cron"] == "0 6 * * *"
    assert Definition.model_validate(body) == scheduled
    other = _parse(_doc({"cron": "0 7 * * *", "timezone": "Europe/Berlin", "parameters": {"day": "{{ tick.date }}"}}))
    assert definition_hash(other) != definition_hash(scheduled)


# ---- refused at load ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ({"cron": "0 6 * *", "parameters": {"day": "{{ tick.date }}"}}, "5 fields"),
        ({"cron": "0 6 * * * *", "parameters": {"day": "{{ tick.date }}"}}, "5 fields"),
        ({"cron": "61 6 * * *", "parameters": {"day": "{{ tick.date }}"}}, "not a valid"),
        ({"cron": "0 6 * * *", "timezone": "Mars/Olympus", "parameters": {"day": "{{ tick.date }}"}}, "IANA"),
        ({"cron": "0 6 * * *", "parameters": {"day": "{{ __import__('os') }}"}}, "must be one of"),
        ({"cron": "0 6 * * *", "parameters": {"day": "{{ tick.date * 2 }}"}}, "must be one of"),
        ({"cron": "0 6 * * *", "parameters": {"day": "{{ tick.date"}}, "unmatched"),
        ({"cron": "0 6 * * *", "parameters": {"day": "{{ tick.iso }}"}}, "declared date"),
        ({"cron": "0 6 * * *", "parameters": {"day": "{{ tick.date }}", "other": "x"}}, "not declared"),
        ({"cron": "0 6 * * *"}, "required"),
        ({"cron": "R R * * *", "parameters": {"day": "{{ tick.date }}"}}, "random (R) and hashed (H)"),
        ({"cron": "0 r(0-5) * * *", "parameters": {"day": "{{ tick.date }}"}}, "random (R) and hashed (H)"),
        ({"cron": "0,R 6 * * *", "parameters": {"day": "{{ tick.date }}"}}, "random (R) and hashed (H)"),
        ({"cron": "H/5 6 * * *", "parameters": {"day": "{{ tick.date }}"}}, "random (R) and hashed (H)"),
        ({"cron": "0 6 * * *", "timezone": "Europe", "parameters": {"day": "{{ tick.date }}"}}, "IANA time zone"),
        ({"cron": "0 6 * * *", "parameters": {"day": "{{ tick.date }}"}, "overlap": "queue"}, "overlap"),
        ({"cron": "0 6 * * *", "parameters": {"day": "{{ tick.date }}"}, "catchup_window": "2 weeks"}, "catchup"),
        ({"cron": "0 6 * * *", "parameters": {"day": "{{ tick.date }}"}, "catchup_window": "5s"}, "between"),
        ({"cron": "0 6 * * *", "parameters": {"day": "{{ tick.date }}"}, "when": "daily"}, "unknown field"),
    ],
)
def test_bad_schedules_are_refused_at_load(schedule: dict[str, Any], expected: str) -> None:
    """Each bad block is an InputError naming the problem, before anything could be recorded."""
    with pytest.raises(InputError) as raised:
        _parse(_doc(schedule))
    assert expected in raised.value.message


# ---- parameter expressions ---------------------------------------------------------------------------------


def test_expressions_render_from_the_tick() -> None:
    tick = Tick(dt.datetime(2026, 3, 1, 5, 0, tzinfo=UTC), dt.date(2026, 3, 1))
    assert render("{{ tick.date }}", tick) == "2026-03-01"
    assert render("{{tick.date - 1 day}}", tick) == "2026-02-28"
    assert render("{{ tick.date - 30 days }}", tick) == "2026-01-30"
    assert render("{{ tick.date + 2 days }}", tick) == "2026-03-03"
    assert render("{{ tick.iso }}", tick) == "2026-03-01T05:00:00Z"
    assert render("run of {{ tick.date }}", tick) == "run of 2026-03-01"
    assert render(7, tick) == 7


def test_the_tick_date_is_local_to_the_schedule_time_zone() -> None:
    """00:30 in Berlin on 1 March is 23:30 UTC on 28 February: the parameter is the local day."""
    spec = ScheduleSpec(cron="30 0 * * *", timezone="Europe/Berlin", parameters={"day": "{{ tick.date }}"})
    (tick,) = spec.ticks(dt.datetime(2026, 2, 28, 12, tzinfo=UTC), dt.datetime(2026, 3, 1, 12, tzinfo=UTC), 10)
    assert tick.iso == "2026-02-28T23:30:00Z"
    assert spec.parameters_for(tick) == {"day": "2026-03-01"}


# ---- DST -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("zone", "spring", "autumn"),
    [("Europe/Berlin", dt.date(2026, 3, 29), dt.date(2026, 10, 25)),
     ("America/New_York", dt.date(2026, 3, 8), dt.date(2026, 11, 1))],
)
def test_hourly_ticks_on_dst_days(zone: str, spring: dt.date, autumn: dt.date) -> None:
    """Proves the count: 23 hourly ticks on the spring-forward day (the skipped hour's tick is the same
    instant as the next hour's, once), 24 on the fall-back day (the repeated hour fires once), 24 on a
    normal day; each instant once."""
    spec = ScheduleSpec(cron="0 * * * *", timezone=zone)
    assert len(_day_ticks(spec, spring)) == 23
    assert len(_day_ticks(spec, autumn)) == 24
    assert len(_day_ticks(spec, spring + dt.timedelta(days=7))) == 24
    for day in (spring, autumn):
        ticks = _day_ticks(spec, day)
        assert len(set(ticks)) == len(ticks) and ticks == sorted(ticks)


def test_a_skipped_local_time_fires_once_at_the_next_valid_instant() -> None:
    """02:30 does not exist in Berlin on 2026-03-29 (02:00 CET -> 03:00 CEST): the tick is 03:00 CEST,
    01:00 UTC, once; every quarter of the skipped hour is that same single tick."""
    daily = ScheduleSpec(cron="30 2 * * *", timezone="Europe/Berlin")
    assert _day_ticks(daily, dt.date(2026, 3, 29)) == ["2026-03-29T01:00:00Z"]
    assert _day_ticks(daily, dt.date(2026, 3, 28)) == ["2026-03-28T01:30:00Z"]
    assert _day_ticks(daily, dt.date(2026, 3, 30)) == ["2026-03-30T00:30:00Z"]
    quarters = ScheduleSpec(cron="*/15 2 * * *", timezone="Europe/Berlin")
    assert _day_ticks(quarters, dt.date(2026, 3, 29)) == ["2026-03-29T01:00:00Z"]
    new_york = ScheduleSpec(cron="30 2 * * *", timezone="America/New_York")
    assert _day_ticks(new_york, dt.date(2026, 3, 8)) == ["2026-03-08T07:00:00Z"]
    assert instant_of(dt.datetime(2026, 3, 29, 2, 59, 59), daily.zone()) == dt.datetime(2026, 3, 29, 1, tzinfo=UTC)


def test_a_repeated_local_time_fires_once_at_its_first_occurrence() -> None:
    """02:30 happens twice in Berlin on 2026-10-25 (CEST, then CET): one tick, at 00:30 UTC."""
    daily = ScheduleSpec(cron="30 2 * * *", timezone="Europe/Berlin")
    assert _day_ticks(daily, dt.date(2026, 10, 25)) == ["2026-10-25T00:30:00Z"]
    assert _day_ticks(daily, dt.date(2026, 10, 24)) == ["2026-10-24T00:30:00Z"]
    assert _day_ticks(daily, dt.date(2026, 10, 26)) == ["2026-10-26T01:30:00Z"]
    new_york = ScheduleSpec(cron="30 1 * * *", timezone="America/New_York")
    assert _day_ticks(new_york, dt.date(2026, 11, 1)) == ["2026-11-01T05:30:00Z"]


def test_ticks_started_inside_the_repeated_hour_are_not_repeated() -> None:
    """An evaluation that last ran during the second 02:xx (CET) does not fire the 02:45 tick again."""
    spec = ScheduleSpec(cron="45 2 * * *", timezone="Europe/Berlin")
    second_occurrence = dt.datetime(2026, 10, 25, 1, 50, tzinfo=UTC)  # 02:50 CET, after both 02:45s
    following = spec.ticks(second_occurrence, dt.datetime(2026, 10, 27, tzinfo=UTC), 10)
    assert [t.iso for t in following] == ["2026-10-26T01:45:00Z"]
    assert spec.next_tick(dt.datetime(2026, 10, 25, 0, 40, tzinfo=UTC)).iso == "2026-10-25T00:45:00Z"


@pytest.mark.parametrize(
    "text", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00", "1899-12-31T23:59:59Z",
             "2999-12-31T23:59:59-00:01"],
)
def test_now_outside_the_years_a_schedule_may_start_is_refused(text: str) -> None:
    """Proves --now at the edges of the calendar is an InputError naming the range (it was accepted
    by apply and then made every evaluation fail with an internal error, or failed at once)."""
    with pytest.raises(InputError, match=r"--now must be an instant from 1900-01-01T00:00:00Z to 2999-12-31T23:59:59Z"):
        schedules.parse_now(text)


def test_now_at_the_ends_of_the_range_and_without_an_offset() -> None:
    assert schedules.parse_now("1900-01-01T00:00:00Z") == schedules.NOW_MIN
    assert schedules.parse_now("2999-12-31T23:59:59Z") == schedules.NOW_MAX
    assert schedules.parse_now("2026-03-29T02:00:00") == dt.datetime(2026, 3, 29, 2, tzinfo=dt.UTC)
    assert schedules.parse_now(None) is None
