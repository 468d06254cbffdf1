"""Acceptance: the "Daily tables" guide (docs/daily-tables.md), command by command, on its example.

`examples/daily_orders_publish/daily_table.yaml` replaces one day of a Delta table per run. A day
run twice under two keys (a late order arrived in between) holds the second run's rows once; the
other day is untouched; a replay of the first key changes nothing. The table is read back with
deltalake's own reader, never through the platform's provider.
"""

from __future__ import annotations

import shutil
from decimal import Decimal
from pathlib import Path

from deltalake import DeltaTable

from support.cli import PUBLISH_EXAMPLE, make_cli

LATE_ORDER = "59999,1002,2026-11-02,1000.00,completed\n"  # customer 1002 is in the south


def _rows_by_day(table: Path) -> dict[str, list[tuple[str, Decimal, int]]]:
    found: dict[str, list[tuple[str, Decimal, int]]] = {}
    for row in DeltaTable(str(table)).to_pyarrow_table().to_pylist():
        found.setdefault(str(row["day"]), []).append((row["region"], row["revenue"], row["orders"]))
    return {day: sorted(rows) for day, rows in found.items()}


def test_a_re_run_of_a_day_replaces_it_and_leaves_the_other_days(tmp_path: Path, sqlite_url: str) -> None:
    """The guide's walk-through: publish two days, re-run the first after a late order, replay a key."""
    example = tmp_path / "example"
    shutil.copytree(PUBLISH_EXAMPLE, example, ignore=shutil.ignore_patterns("warehouse"))
    cli = make_cli(sqlite_url, tmp_path)
    definition, table = str(example / "daily_table.yaml"), example / "warehouse" / "daily_revenue_by_day"

    for day, key in (("2026-11-02", "nov-02"), ("2026-11-03", "nov-03")):
        ran = cli("run", definition, "-p", f"day={day}", "-k", key, "--json")
        assert ran.code == 0 and ran.json()["status"] == "succeeded", ran.output
    before = _rows_by_day(table)
    assert sorted(before) == ["2026-11-02", "2026-11-03"] and len(before["2026-11-02"]) == 4

    with (example / "data" / "orders.csv").open("a", encoding="utf-8") as orders:
        orders.write(LATE_ORDER)
    again = cli("run", definition, "-p", "day=2026-11-02", "-k", "nov-02-late", "--json")
    assert again.code == 0 and again.json()["status"] == "succeeded", again.output
    after = _rows_by_day(table)
    assert after["2026-11-03"] == before["2026-11-03"], "another day changed"
    assert len(after["2026-11-02"]) == 4, "the day was appended again instead of replaced"
    changed = {region: (revenue, orders) for region, revenue, orders in after["2026-11-02"]}
    earlier = {region: (revenue, orders) for region, revenue, orders in before["2026-11-02"]}
    assert changed["south"] == (earlier["south"][0] + Decimal("1000.00"), earlier["south"][1] + 1)
    assert {r: v for r, v in changed.items() if r != "south"} == {r: v for r, v in earlier.items() if r != "south"}

    replay = cli("run", definition, "-p", "day=2026-11-02", "-k", "nov-02", "--json")
    assert replay.code == 0 and replay.json()["replayed"] is True, replay.output
    assert _rows_by_day(table) == after, "a replay of the first key changed the table"


def test_partitions_shows_the_gap_and_backfill_only_missing_fills_it(tmp_path: Path, sqlite_url: str) -> None:
    """The guide's operator part: `dataflow partitions` lists a missing day and each day's current run;
    `backfill --only-missing` submits only the missing day; once a worker ran it, every day is published
    and the table holds each day once."""
    example = tmp_path / "example"
    shutil.copytree(PUBLISH_EXAMPLE, example, ignore=shutil.ignore_patterns("warehouse"))
    cli = make_cli(sqlite_url, tmp_path)
    definition, table = str(example / "daily_table.yaml"), example / "warehouse" / "daily_revenue_by_day"
    for key in ("first", "again"):
        assert cli("run", definition, "-p", "day=2026-11-02", "-k", key).code == 0
    span = ("--from", "2026-11-01", "--to", "2026-11-03")

    listed = cli("partitions", "analytics.daily_revenue_by_day", *span, "--json")
    assert listed.code == 0, listed.output
    states = {p["partition"]["day"]: (p["state"], (p["current"] or {}).get("idempotency_key"))
              for p in listed.json()["partitions"]}  # fmt: skip
    assert states == {"2026-11-01": ("missing", None), "2026-11-02": ("published", "again"),
                      "2026-11-03": ("missing", None)}  # fmt: skip

    filled = cli("backfill", definition, *span, "--only-missing")
    assert filled.code == 0 and "2 run(s) submitted" in filled.stdout, filled.output
    assert cli("worker", "--until-idle").code == 0
    after = cli("partitions", "analytics.daily_revenue_by_day", *span, "--json").json()["partitions"]
    assert [p["state"] for p in after] == ["published"] * 3
    assert {day: len(rows) for day, rows in _rows_by_day(table).items()} == {
        "2026-11-01": 4, "2026-11-02": 4, "2026-11-03": 4
    }  # fmt: skip
