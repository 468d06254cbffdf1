"""The soak's partition invariant can fail: "each partition holds exactly the rows of exactly one run,
the one recorded as its current publication" (tests/faults/harness.py, issue 27 item 6) is reported
for a partition holding two runs' rows, an older run's rows, rows of no run, or nothing, both on
hand-made records and on a real Delta sink doctored after two real runs of one day."""

from __future__ import annotations

from pathlib import Path

from durable_dataflow.platform import Platform
from faults import harness

DAY = "2026-11-01"


def _rows(n: int, day: str = DAY) -> tuple[harness.Row, ...]:
    """The rows harness.partitioned_definition's run with parameter n holds for a day."""
    return tuple(sorted((day, item, str(qty * n), str(n)) for item, qty in (("a", 1), ("b", 2), ("c", 3))))


def _run(run_id: str, n: int, token: int | None, status: str = "succeeded", day: str = DAY) -> harness.PartitionRun:
    return harness.PartitionRun(run_id, day, status, status == "outcome_unknown", token, _rows(n, day))


def test_a_partition_holding_its_current_publication_passes() -> None:
    runs = [_run("r1", 1, 1), _run("r2", 2, 2), _run("r3", 3, None, "cancelled"), _run("r4", 4, 3, "failed")]
    assert harness.partition_problems("t", {DAY: list(_rows(2))}, runs) == []
    assert harness.current_publication(runs) == runs[1]


def test_two_runs_rows_in_one_partition_are_reported() -> None:
    runs = [_run("r1", 1, 1), _run("r2", 2, 2)]
    problems = harness.partition_problems("t", {DAY: sorted(_rows(1) + _rows(2))}, runs)
    assert len(problems) == 1 and "run r2" in problems[0] and "no single run" in problems[0]


def test_an_older_runs_rows_are_reported_naming_whose_they_are() -> None:
    runs = [_run("r1", 1, 1), _run("r2", 2, 2)]
    problems = harness.partition_problems("t", {DAY: list(_rows(1))}, runs)
    assert len(problems) == 1 and "run r2 (partition token 2)" in problems[0] and "['r1']" in problems[0]


def test_a_missing_partition_rows_of_no_run_and_a_shared_token_are_reported() -> None:
    assert harness.partition_problems("t", {}, [_run("r1", 1, 1)])  # succeeded, but the sink holds nothing
    assert harness.partition_problems("t", {DAY: list(_rows(9))}, [])  # rows no run owns
    unresolved_only = [_run("r1", 1, 1, "outcome_unknown")]  # not recorded as published (yet)
    assert "no succeeded run" in harness.partition_problems("t", {DAY: list(_rows(1))}, unresolved_only)[0]
    shared = [_run("r1", 1, 1), _run("r2", 2, 1, "failed")]
    assert any(
        "token 1 was taken by 2 runs" in p for p in harness.partition_problems("t", {DAY: list(_rows(1))}, shared)
    )


def test_a_real_delta_partition_doctored_to_hold_two_runs_rows_is_reported(tmp_path: Path) -> None:
    """Two real runs of one day and one of another on SQLite publish to a Delta table: the checker,
    reading the table with delta-rs, passes it; after the first run's rows are appended to the day
    again, it reports that day and only that day."""
    defs = tmp_path / "defs"
    definition = harness.partitioned_definition(defs, "daily", provider="delta", location="daily")
    with Platform(f"sqlite:///{tmp_path}/p.db") as platform:
        for n, day, key in ((1, DAY, "k1"), (2, DAY, "k2"), (3, "2026-11-02", "k3")):
            run = platform.runs.run_inline(harness.request_for(definition, {"n": str(n), "day": day}, key)).run
            assert run.status == "succeeded"
        runs = harness.partition_runs(platform.db, ["daily"])
    assert {r.partition for r in runs} == {DAY, "2026-11-02"} and all(r.token for r in runs)
    held = harness.delta_partition_rows(defs / "daily")
    assert held == {DAY: list(_rows(2)), "2026-11-02": list(_rows(3, "2026-11-02"))}
    assert harness.partition_problems("delta", held, runs) == []

    import datetime as dt

    import deltalake
    import pyarrow as pa

    first = pa.table({
        "day": pa.array([dt.date(2026, 11, 1)] * 3, pa.date32()), "item": ["a", "b", "c"],
        "qty": pa.array([1, 2, 3], pa.int64()), "run_n": pa.array([1, 1, 1], pa.int64()),
    })  # fmt: skip
    deltalake.write_deltalake(str(defs / "daily"), first, mode="append")
    doctored = harness.delta_partition_rows(defs / "daily")
    problems = harness.partition_problems("delta", doctored, runs)
    assert len(problems) == 1 and f"delta[{DAY}]" in problems[0] and "holds 6 rows" in problems[0]
