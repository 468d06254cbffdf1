"""Issue 26, item 4, at the engines: a requested interruption stops a running query within a second, on
DuckDB (``con.interrupt()``) and on Spark (its job tag cancelled), and is reported as ``Interrupted``,
never as the time limit or a failure; without an interruption the time limit is still LimitExceeded."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from durable_dataflow.core import crashpoints
from durable_dataflow.core.errors import Interrupted, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import progress
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.interruption import Interruption
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from durable_dataflow.dataflow.protocol import evidence
from durable_dataflow.platform import Platform
from support import flows

pytestmark = pytest.mark.timeout(180)

# From the request to the raised Interrupted: the watch looks every 0.1 s, then the engine stops.
STOPPED_AFTER_S_MAX = 1.0
# Spark's own cancellation of a running job's tasks adds ~0.5 s on a warm session (measured 0.46-0.58 s);
# the margin is for a loaded test machine.
SPARK_STOPPED_AFTER_S_MAX = 1.5
RUNNING_WAIT_S = 60.0
SLOW_SQL = "select count(distinct md5(f.n::varchar || r.a::varchar)) as c from facts f, range(100000) r(a)"
SPARK_SLOW_SQL = "select count(*) as c from range(200000) a cross join range(200000) b where a.id + b.id < 0"


def _definition(sql: str, engine: str, sources: dict[str, Any]) -> Definition:
    return Definition.model_validate({
        "name": "interrupted", "version": 1, "engine": engine, "sources": sources,
        "steps": [{"name": "counted", "sql": sql}],
        "output": {"schema": {"c": "int64"}, "max_rows": 1, "max_bytes": "1MiB"},
    })  # fmt: skip


def _parquet_facts(tmp_path: Path) -> dict[str, Any]:
    pq.write_table(pa.table({"n": pa.array(range(200_000), pa.int64())}), tmp_path / "facts.parquet")
    return {"facts": {"kind": "parquet", "path": "facts.parquet"}}


def test_duckdb_stops_a_running_query_within_a_second_when_interrupted(tmp_path: Path) -> None:
    """Proves an interruption requested once DuckDB reports the query's progress (so it runs) ends the
    execution with Interrupted naming the step and the signal, within a second."""
    interruption = Interruption()
    requested_at: list[float] = []

    def sink(report: progress.Progress) -> None:
        if report.percent is not None and not requested_at:  # the engine's own progress: the query runs
            requested_at.append(time.monotonic())
            interruption.request("SIGINT", "cli")

    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits(), interruption=interruption)
    with pytest.raises(Interrupted, match=r"step 'counted' was interrupted \(SIGINT\)"):
        execute(_definition(SLOW_SQL, "duckdb", _parquet_facts(tmp_path)), {}, ctx, progress_sink=sink)
    assert requested_at, "the query never reported progress"
    assert time.monotonic() - requested_at[0] <= STOPPED_AFTER_S_MAX


def test_duckdb_time_limit_is_still_a_limit(tmp_path: Path) -> None:
    """Proves that with an interruption watched but never requested, the time limit stays LimitExceeded."""
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits(time_limit_s=0.5), interruption=Interruption())
    with pytest.raises(LimitExceeded, match=r"exceeded the time limit of 0\.5 s"):
        execute(_definition(SLOW_SQL, "duckdb", _parquet_facts(tmp_path)), {}, ctx)


def test_an_interruption_before_the_engine_starts_runs_nothing(tmp_path: Path) -> None:
    """Proves an execution whose process was already interrupted raises Interrupted before any step."""
    interruption = Interruption()
    interruption.request("SIGTERM", "worker")
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits(), interruption=interruption)
    started = time.monotonic()
    with pytest.raises(Interrupted, match=r"interrupted \(SIGTERM\)"):
        execute(_definition(SLOW_SQL, "duckdb", _parquet_facts(tmp_path)), {}, ctx)
    assert time.monotonic() - started <= STOPPED_AFTER_S_MAX


@pytest.mark.spark
def test_spark_cancels_a_running_job_within_a_second_when_interrupted(tmp_path: Path) -> None:
    """Proves an interruption requested once a Spark job of the execution runs (the DURING_EXECUTION point,
    which Spark's watch reaches when it sees the job) cancels the job and raises Interrupted within a
    second; the session still runs the next execution."""
    from durable_dataflow.dataflow.execution import spark_engine

    inline = {"t": {"kind": "inline", "schema": {"n": "int64"}, "rows": [{"n": 1}]}}
    count = _definition("select count(*) as c from t", "spark", inline)
    spark_engine.session()
    execute(count, {}, ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits()))  # warm: a first job is slow
    interruption = Interruption()
    requested_at: list[float] = []
    lock = threading.Lock()

    def hook(point: str) -> None:
        with lock:
            if point == crashpoints.DURING_EXECUTION and not requested_at:
                requested_at.append(time.monotonic())
                interruption.request("SIGINT", "cli")

    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits(), interruption=interruption)
    crashpoints.set_hook(hook)
    try:
        with pytest.raises(Interrupted, match=r"step 'counted' was interrupted \(SIGINT\)"):
            execute(_definition(SPARK_SLOW_SQL, "spark", inline), {}, ctx)
        stopped_after_s = time.monotonic() - requested_at[0]
    finally:
        crashpoints.set_hook(None)
    assert stopped_after_s <= SPARK_STOPPED_AFTER_S_MAX, stopped_after_s
    assert execute(count, {}, ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits())).row_count == 1


@pytest.mark.parametrize("with_target", [False, True], ids=["atomic", "forward"])
def test_an_interruption_after_the_engine_ended_still_cancels_before_the_commit(
    platform: Platform, tmp_path: Path, with_target: bool
) -> None:
    """Proves the run service looks for an interruption right before its terminal (atomic) or pre-dispatch
    (forward) commit, after the engine ended and the result was checked: a signal that comes once the result is
    computed (requested here when the run reports it is committing) ends the run ``cancelled`` with no external
    output, nothing authorized and nothing in the sink."""
    service = platform.runs

    def sink(report: progress.Progress) -> None:
        if report.phase == progress.Phase.COMMITTING:
            service.interruption.request("SIGTERM", "cli")

    defn = flows.definition(flows.parquet_target() if with_target else None)
    run = service.run_inline(flows.request(defn, tmp_path, "late-signal"), sink).run
    assert (run.status, run.recovery_status) == ("cancelled", "no_external_output"), run
    assert evidence.DISPATCH_AUTHORIZED not in flows.kinds(platform, run.run_id)
    assert evidence.RUN_SUCCEEDED not in flows.kinds(platform, run.run_id)
    assert not (tmp_path / "sink" / "_manifests").exists() or flows.manifests(tmp_path / "sink") == []
