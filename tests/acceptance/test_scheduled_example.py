"""Issue 16, done when: the scheduled example (examples/daily_orders_publish, its `schedule:` block as
shipped) publishes one run per day from `dataflow worker`, with two workers running at once, on both
engines. The schedule is applied as of 2.5 days ago (`--now`), so its nightly ticks since then are due
on the database clock; the two workers start together and each evaluates them."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from durable_dataflow.core import ledger, units
from durable_dataflow.dataflow.definitions.definitions import load_definition
from durable_dataflow.dataflow.protocol import evidence
from durable_dataflow.dataflow.protocol.runs import MODULE
from faults import harness

pytestmark = [pytest.mark.timeout(300)]

APPLIED_BEFORE = dt.timedelta(days=2, hours=12)


def test_two_workers_publish_the_example_once_per_day(db_url: str, tmp_path: Path) -> None:
    definition = harness.forward_example(tmp_path, "parquet")  # the example, its schedule included
    spec = load_definition(definition).definition.schedule
    assert spec is not None, "the example lost its schedule"
    sink = definition.parent / "warehouse" / "daily_revenue"
    log = tmp_path / "processes.log"
    env = harness.worker_env(db_url, lease_ttl_s=30)
    with harness.open_platform(db_url) as platform:
        with platform.db.read() as conn:
            now = units.from_us(platform.db.now_us(conn))
        applied_at = now - APPLIED_BEFORE
        apply = harness.start(["schedules", "apply", str(definition), "--now", applied_at.isoformat()], env, log)
        assert harness.wait_exit(apply, log) == 0, harness.tail(log)
        workers = [harness.start(harness.worker_args(until_idle=True), env, log) for _ in range(2)]
        assert [harness.wait_exit(w, log) for w in workers] == [0, 0], harness.tail(log)
        with platform.db.read() as conn:
            end = units.from_us(platform.db.now_us(conn))
        due = spec.ticks(applied_at, end, 10)
        assert len(due) in (2, 3), due  # a nightly tick in 2.5 days
        found = harness.all_runs(platform.db)
        pubs = harness.parquet_publications(sink)
        report = harness.check(platform.db, pubs)
        with platform.db.read() as conn:
            kinds = {run.run_id: [e.kind for e in ledger.read(conn, MODULE, run.run_id)] for run in found}
    assert report.violations == [], report.violations
    assert sorted(run.idempotency_key for run in found) == sorted(
        f"schedule:default:daily_orders_publish:{tick.iso}" for tick in due
    )
    assert sorted(run.parameters["day"] for run in found) == sorted(
        (tick.local_date - dt.timedelta(days=1)).isoformat() for tick in due
    )
    assert {str(run.status) for run in found} == {"succeeded"}
    assert len(pubs) == len(due) and len({p.key for p in pubs}) == len(due), pubs
    for run_id, run_kinds in kinds.items():  # each run's one attempt dispatched once, by one of the workers
        assert run_kinds.count(evidence.DISPATCH_AUTHORIZED) == 1, (run_id, run_kinds)
