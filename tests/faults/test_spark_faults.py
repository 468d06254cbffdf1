"""Issue 14, item 5: Spark faults end as the protocol requires, with real `dataflow worker` processes.

A Spark job failure fails the run (no external output, never retried, nothing dispatched); a driver
SIGKILLed while its Spark job runs (``DATAFLOW_CRASH_AT=during_execution``, reached by the engine's watch
thread) leaves no JVM behind and is recovered and retried under the next attempt (on PostgreSQL at once:
its holder is gone); the time limit cancels the job and the same process goes on; an executor killed
mid-job (``local-cluster``) is survived by Spark while the driver, paused at the same point from its
watch thread, keeps its lease. Every case ends with the invariant checker finding nothing.

The definition's one step is a cross join over generated rows (``range``): a few seconds on ``local[2]``
per 2,000 of ``n``; ``d = 0`` divides by zero (ANSI) in every task.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from durable_dataflow.core import crashpoints as cp
from durable_dataflow.core import ledger
from durable_dataflow.core.errors import ExecutionError
from durable_dataflow.dataflow.definitions.definitions import Definition, load_definition
from durable_dataflow.dataflow.execution import results, spark_engine
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from durable_dataflow.dataflow.protocol import evidence, runs, sweeper
from durable_dataflow.dataflow.protocol.forward import publication_key
from durable_dataflow.dataflow.protocol.runs import MODULE, Run
from durable_dataflow.datasources.parquet_folder import MARKER
from durable_dataflow.platform import Platform
from faults import harness
from support.procs import alive, children

# No importorskip: without pyspark or Java the `spark` marker skips these locally and fails them in CI.
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]

N_SLOW = 2000  # the step reads 2 x n x 3000 generated rows: a Spark job of a few seconds on local[2]
N_HUGE = 1_000_000  # hours: only the time limit ends it
JOB_ROWS = 3000  # rows of the inner range, per row of range(0, n) and seed key
TIME_LIMIT_S = 6.0
CANCEL_SLACK_S = 12.0  # the cancelled job's run fails at most this long after the deadline (a loaded machine)
LONG_TTL_S = 60.0  # never waited for
SQLITE_CRASHED_TTL_S = 4.0  # on SQLite the TTL decides: short, but longer than a loaded machine's heartbeat gaps
JVM_EXIT_S = 30.0
TASK_CPU_S = 0.5  # CPU an executor burns before it is taken to be running a task (idle: a few ms a second)
SPARK_WAIT_S = 240.0  # a Spark process: session start (~8 s, much more on a loaded machine) plus its jobs
STEP_SQL = (
    "select s.k as k, count(*) as c, sum(xxhash64(a.id, b.id) % 1000 div $d) as h "
    f"from seed s cross join range(0, $n) a cross join range(0, {JOB_ROWS}) b group by s.k order by s.k"
)
BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


# ---- definitions, processes and what they leave --------------------------------------------------------


def spark_definition(folder: Path, name: str, *, publish: bool = False, time_limit: float | None = None) -> Path:
    """The slow Spark step over an inline seed; with ``publish`` it appends to ``<folder>/warehouse/out``."""
    folder.mkdir(parents=True, exist_ok=True)
    body: dict[str, Any] = {
        "name": name, "version": 1, "engine": "spark",
        "parameters": {"n": {"type": "int"}, "d": {"type": "int", "default": 1}},
        "sources": {"seed": {"kind": "inline", "schema": {"k": "int64"}, "rows": [{"k": 1}, {"k": 2}]}},
        "steps": [{"name": "result", "sql": STEP_SQL}],
        "output": {"schema": {"k": "int64", "c": "int64", "h": "int64"}, "max_rows": 10, "max_bytes": "64KiB"},
    }  # fmt: skip
    if time_limit is not None:
        body["limits"] = {"time_limit": time_limit}
    if publish:
        body["target"] = {
            "type": "datasources.publication", "provider": "parquet", "datasource": f"faults.{name}",
            "location": "warehouse/out", "mode": "append",
        }  # fmt: skip
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def sink_of(definition: Path) -> Path:
    return definition.parent / "warehouse" / "out"


def sink_files(definition: Path) -> list[Path]:
    """Every file in the sink folder but its location marker: preparing it before authorization creates the
    folders and the marker that records which folder was registered, nothing else."""
    return sorted(p for p in sink_of(definition).rglob("*") if p.is_file() and p != sink_of(definition) / MARKER)


def spark_env(url: str, ttl_s: float, marker: str, *, master: str = "local[2]", event_log: Path | None = None,
              **points: str) -> dict[str, str]:  # fmt: skip
    """A worker's environment: every JVM it starts carries ``-Ddataflow.test=<marker>`` on its command line."""
    java = f"-Ddataflow.test={marker}"
    conf = [f"spark.driver.extraJavaOptions={java}", f"spark.executor.extraJavaOptions={java}",
            "spark.sql.shuffle.partitions=4"]  # fmt: skip
    if event_log is not None:
        event_log.mkdir(parents=True, exist_ok=True)
        conf += ["spark.eventLog.enabled=true", f"spark.eventLog.dir=file://{event_log}",
                 "spark.eventLog.rolling.enabled=false", "spark.eventLog.compress=false"]  # one JSON-lines file
    extra = {"DATAFLOW_SPARK_MASTER": master, "DATAFLOW_SPARK_CONF": ";".join(conf)}
    return harness.worker_env(url, lease_ttl_s=ttl_s, extra=extra, **points)


def database(backend: str, request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.db"
    return harness.fresh_database(request.getfixturevalue("postgres_server"), prefix)


def submit(platform: Platform, definition: Path, key: str, n: int, d: int = 1) -> str:
    request = harness.request_for(definition, {"n": str(n), "d": str(d)}, key)
    return platform.runs.submit(request).run.run_id


def entries_of(platform: Platform, run_id: str) -> list[ledger.Entry]:
    with platform.db.read() as conn:
        return ledger.read(conn, MODULE, run_id)


def result_rows(platform: Platform, run_id: str) -> list[dict[str, Any]]:
    with platform.db.read() as conn:
        return results.decode_ipc(results.stored_bytes(conn, run_id)).to_pylist()


def assert_counted_once(platform: Platform, run_id: str, n: int) -> None:
    """Every generated row was counted exactly once (a lost or re-run task neither dropped nor doubled any)."""
    assert [(r["k"], r["c"]) for r in result_rows(platform, run_id)] == [(1, n * JOB_ROWS), (2, n * JOB_ROWS)]


def describe(run: Run, entries: list[ledger.Entry], log: Path) -> str:
    kinds = [(e.attempt, e.kind) for e in entries]
    return f"{run.status}/{run.recovery_status} attempt {run.attempt}; ledger {kinds}\n{harness.tail(log)}"


def assert_no_violations(platform: Platform, publications: list[harness.Publication]) -> None:
    report = harness.check(platform.db, publications)
    assert report.violations == [], report.violations
    assert not (report.states["queued"] or report.states["running"]), report.summary()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def marked(marker: str, kind: str = "") -> list[int]:
    """Pids of the live processes whose command line carries the marker (and ``kind``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            cmdline = _cmdline(int(entry.name))
            if f"-Ddataflow.test={marker}" in cmdline and kind in cmdline:
                found.append(int(entry.name))
    return sorted(found)


def cpu_s(pid: int) -> float:
    """CPU seconds the process has used (user and system)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def event_log(folder: Path) -> list[dict[str, Any]]:
    """The events of every Spark application that logged into ``folder``."""
    events: list[dict[str, Any]] = []
    for path in sorted(folder.iterdir()) if folder.exists() else []:
        if path.is_file() and not path.name.startswith("."):
            events += [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return events


def wait_stopped(proc: Any, log: Path) -> None:
    harness.wait_until(lambda: harness.is_stopped(proc.pid) or proc.poll() is not None, SPARK_WAIT_S, "the pause")
    assert proc.poll() is None, f"the worker exited instead of pausing:\n{harness.tail(log)}"


# ---- the crash point, in process -------------------------------------------------------------------------


def test_the_crash_point_is_reached_once_per_execution_and_before_the_result(tmp_path: Path) -> None:
    """Proves the engines reach during_execution exactly once per execution: Spark from its watch thread once
    a job of the execution has started (a job failure and a short job: once too); DuckDB in the execution's
    own thread, before any step."""
    tracker = spark_engine.session().sparkContext.statusTracker()
    reached: list[tuple[str, set[int]]] = []  # (thread, the jobs started by then)

    def hook(point: str) -> None:
        if point == cp.DURING_EXECUTION:
            reached.append((threading.current_thread().name, set(tracker.getJobIdsForGroup())))

    loaded = load_definition(spark_definition(tmp_path, "inproc"))
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits())
    duck = Definition.model_validate({
        "name": "duck", "version": 1,
        "sources": {"t": {"kind": "inline", "schema": {"x": "int64"}, "rows": [{"x": 1}]}},
        "steps": [{"name": "r", "sql": "select x from t"}],
        "output": {"schema": {"x": "int64"}, "max_rows": 10, "max_bytes": "64KiB"},
    })  # fmt: skip

    def once(run: Callable[[], object]) -> tuple[str, set[int]]:
        """Where the point was reached, and the Spark jobs this execution had started by then."""
        reached.clear()
        before = set(tracker.getJobIdsForGroup())
        run()
        assert len(reached) == 1, reached
        return reached[0][0], reached[0][1] - before

    cp.set_hook(hook)
    try:
        thread, started = once(lambda: execute(loaded.definition, {"n": N_SLOW, "d": 1}, ctx))
        assert thread == "dataflow-spark-watch" and started, (thread, started)
        once(lambda: execute(loaded.definition, {"n": 1, "d": 1}, ctx))

        def failing() -> None:
            with pytest.raises(ExecutionError, match="DIVIDE_BY_ZERO"):
                execute(loaded.definition, {"n": 1, "d": 0}, ctx)

        once(failing)
        assert once(lambda: execute(duck, {}, ctx))[0] == threading.current_thread().name
    finally:
        cp.set_hook(None)


# ---- one backend's faults: a killed driver, job failures, the time limit ------------------------------------

KILLED_PUBLISHES = {"sqlite": False, "postgres": True}  # the killed run: atomic on SQLite, forward on PostgreSQL


@dataclass(frozen=True)
class Outcome:
    """What one backend's two workers left: A (crashing at during_execution) claimed the killed run; B ran
    every run to its end, in submission order (the killed run once recovered)."""

    backend: str
    definitions: dict[str, Path]
    runs: dict[str, Run]
    entries: dict[str, list[ledger.Entry]]
    rows: dict[str, list[dict[str, Any]]]
    pubs: dict[str, list[harness.Publication]]
    files: dict[str, list[Path]]
    report: harness.Report
    killed_exit: int | None
    killed_left_running: bool  # the killed run was still `running` (left to recovery) once A died
    started: set[int]  # every process A started: its children and the marked JVMs
    drivers: set[int]  # of those, the driver JVMs (SparkSubmit) seen alive
    jvms_exited: bool  # every one of them had exited within JVM_EXIT_S of A's death
    b_exit: int | None
    events: list[dict[str, Any]]  # B's Spark event log
    log: Path

    def context(self, name: str) -> str:
        return describe(self.runs[name], self.entries[name], self.log)


KILLED_WAIT_S = 300.0  # Spark's session start alone took 40 s on a loaded machine


def _run_until_killed(proc: Any, marker: str) -> tuple[set[int], set[int]]:
    """Watch the worker until it exits: every process it started (its children and the marked ones), and
    of those the driver JVMs (``SparkSubmit``) seen alive."""
    seen: set[int] = set()
    drivers: set[int] = set()
    # Sampling, not waiting for an order: the worker's crash point kills it; the poll is bounded by that.
    deadline = time.monotonic() + KILLED_WAIT_S
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"the worker did not reach its crash point in {KILLED_WAIT_S:g} s"
        now = children(proc.pid) | set(marked(marker))
        drivers |= {pid for pid in now if "org.apache.spark.deploy.SparkSubmit" in _cmdline(pid)}
        seen |= now
        time.sleep(harness.POLL_S)
    return seen, drivers


def run_backend(backend: str, url: str, tmp: Path) -> Outcome:
    tmp.mkdir(parents=True)
    definitions = {
        "killed": spark_definition(tmp / "killed", "killed", publish=KILLED_PUBLISHES[backend]),
        "fail-atomic": spark_definition(tmp / "fail-atomic", "fails"),
        "fail-forward": spark_definition(tmp / "fail-forward", "fails_fwd", publish=True),
        "limited": spark_definition(tmp / "limited", "limited", publish=True, time_limit=TIME_LIMIT_S),
        "after": spark_definition(tmp / "after", "after"),
    }
    sizes = {"killed": (N_SLOW, 1), "fail-atomic": (N_SLOW, 0), "fail-forward": (N_SLOW, 0),
             "limited": (N_HUGE, 1), "after": (2, 1)}  # fmt: skip
    log, events, marker = tmp / "processes.log", tmp / "events", uuid.uuid4().hex
    crashed_ttl = LONG_TTL_S if backend == "postgres" else SQLITE_CRASHED_TTL_S
    with harness.open_platform(url) as platform:
        ids = {name: submit(platform, definitions[name], name, *sizes[name]) for name in definitions}  # in order
        crashing = spark_env(url, crashed_ttl, marker, crash_at=cp.DURING_EXECUTION)
        killed = harness.start(harness.worker_args(once=True), crashing, log)  # claims the oldest: "killed"
        started, drivers = _run_until_killed(killed, marker)
        try:
            harness.wait_until(lambda: not any(alive(p) for p in started), JVM_EXIT_S, "the JVMs to exit")
            jvms_exited = True
        except AssertionError:
            jvms_exited = False
        left_running = platform.runs.get(ids["killed"]).status == "running"
        env = spark_env(url, LONG_TTL_S, uuid.uuid4().hex, event_log=events)
        fresh = harness.start(harness.worker_args(until_idle=True), env, log)
        b_exit = harness.wait_exit(fresh, log, SPARK_WAIT_S * 2)
        runs_ = {name: platform.runs.get(run_id) for name, run_id in ids.items()}
        entries = {name: entries_of(platform, run_id) for name, run_id in ids.items()}
        rows = {name: result_rows(platform, ids[name]) for name in ("killed", "after")
                if runs_[name].status == "succeeded"}  # fmt: skip
        publishing = [name for name, path in definitions.items() if "target" in yaml.safe_load(path.read_text())]
        pubs = {name: harness.parquet_publications(sink_of(definitions[name])) for name in publishing}
        report = harness.check(platform.db, [pub for found in pubs.values() for pub in found])
    return Outcome(
        backend, definitions, runs_, entries, rows, pubs, {name: sink_files(definitions[name]) for name in publishing},
        report, killed.returncode, left_running, started, drivers, jvms_exited, b_exit, event_log(events), log,
    )  # fmt: skip


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both backends side by side (each its own database, folders and workers); a backend maps to its
    Outcome, or to the exception that stopped it (PostgreSQL's skip when it cannot start)."""
    root = tmp_path_factory.mktemp("spark-faults")
    cases: dict[str, Callable[[], Outcome]] = {
        "sqlite": lambda: run_backend("sqlite", f"sqlite:///{root}/sqlite-ledger.db", root / "sqlite"),
    }
    try:
        server = request.getfixturevalue("postgres_server")
    except BaseException as skipped:  # pytest's skip (or failure) of the PostgreSQL fixture
        pg: Any = skipped
    else:
        cases["postgres"] = lambda: run_backend("postgres", harness.fresh_database(server, "sparkfault"),
                                                root / "postgres")  # fmt: skip
        pg = None
    found = harness.run_concurrently(cases)
    return found if pg is None else {**found, "postgres": pg}


def outcome_of(outcomes: dict[str, Any], backend: str) -> Outcome:
    found = outcomes[backend]
    if isinstance(found, BaseException):
        raise found
    assert isinstance(found, Outcome)
    assert found.b_exit == 0, f"the second worker exited {found.b_exit}:\n{harness.tail(found.log)}"
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_spark_job_failure_fails_the_run_with_no_external_output(backend: str, outcomes: dict[str, Any]) -> None:
    """An ANSI division by zero in every task: the run fails under attempt 1 with no external output and is
    never retried; the forward run's sink is untouched and nothing was authorized."""
    outcome = outcome_of(outcomes, backend)
    for name in ("fail-atomic", "fail-forward"):
        run, entries, context = outcome.runs[name], outcome.entries[name], outcome.context(name)
        assert (run.status, run.recovery_status, run.attempt) == ("failed", "no_external_output", 1), context
        assert run.error_code == "execution_failed" and "DIVIDE_BY_ZERO" in (run.error_message or ""), context
        started = [e.attempt for e in entries if e.kind == evidence.ATTEMPT_STARTED]
        assert started == [1], "an execution error is never retried: " + context
        assert evidence.DISPATCH_AUTHORIZED not in {e.kind for e in entries}, context
        failed = next(e for e in entries if e.kind == evidence.RUN_FAILED)
        assert failed.payload["no_external_output"] is True, failed.payload
    assert outcome.pubs["fail-forward"] == [] and outcome.files["fail-forward"] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_driver_killed_mid_query_leaves_no_jvm_and_is_retried(backend: str, outcomes: dict[str, Any]) -> None:
    """SIGKILL at during_execution while the Spark job runs: the driver's JVM exits with it (its stdin pipe
    closes); the second worker's sweeper recovers the attempt (PostgreSQL: at once, the holder is gone) and
    attempt 2 succeeds, every row counted once; the forward run (PostgreSQL) publishes exactly once."""
    outcome = outcome_of(outcomes, backend)
    run, entries, context = outcome.runs["killed"], outcome.entries["killed"], outcome.context("killed")
    assert outcome.killed_exit == -signal.SIGKILL, f"exit {outcome.killed_exit}: {context}"
    assert outcome.drivers, f"no driver JVM was seen among {outcome.started}"
    assert outcome.jvms_exited, f"left running: {[p for p in outcome.started if alive(p)]}"
    assert outcome.killed_left_running, "the killed attempt must be left to recovery"
    assert (run.status, run.attempt) == ("succeeded", 2), context
    recovered = [e for e in entries if e.kind == evidence.ATTEMPT_RECOVERED]
    assert [e.attempt for e in recovered] == [1], context
    if backend == "postgres":
        assert recovered[0].payload.get("holder_gone") is True, recovered[0].payload
    publishes = KILLED_PUBLISHES[backend]
    assert [p.key for p in outcome.pubs.get("killed", [])] == [publication_key(run)] * publishes, outcome.pubs
    assert [(r["k"], r["c"]) for r in outcome.rows["killed"]] == [(1, N_SLOW * JOB_ROWS), (2, N_SLOW * JOB_ROWS)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_time_limit_cancels_the_spark_job_and_the_worker_goes_on(backend: str, outcomes: dict[str, Any]) -> None:
    """A forward run whose Spark job (hours of work) is cancelled at its time limit: limit_exceeded, no external
    output, within seconds of the deadline, its sink untouched, the job cancelled in Spark; the run after it
    succeeds in the same worker process and Spark session."""
    outcome = outcome_of(outcomes, backend)
    run, entries, context = outcome.runs["limited"], outcome.entries["limited"], outcome.context("limited")
    assert (run.status, run.recovery_status, run.attempt) == ("failed", "no_external_output", 1), context
    assert run.error_code == "limit_exceeded" and "time limit" in (run.error_message or ""), context
    started = next(e for e in entries if e.kind == evidence.ATTEMPT_STARTED).recorded_at_us
    failed = next(e for e in entries if e.kind == evidence.RUN_FAILED).recorded_at_us
    took_s = (failed - started) / 1e6
    assert TIME_LIMIT_S <= took_s <= TIME_LIMIT_S + CANCEL_SLACK_S, f"failed {took_s:.1f} s after it started"
    assert evidence.DISPATCH_AUTHORIZED not in {e.kind for e in entries}, context
    assert outcome.pubs["limited"] == [] and outcome.files["limited"] == []
    ends = [e for e in outcome.events if e.get("Event") == "SparkListenerJobEnd"]
    cancelled = [e for e in ends if "cancelled" in str(e["Job Result"].get("Exception", {}).get("Message", ""))]
    assert cancelled, f"no Spark job was cancelled: {[e['Job Result'] for e in ends]}"
    after = outcome.runs["after"]
    assert (after.status, after.attempt) == ("succeeded", 1), outcome.context("after")
    after_started = next(e for e in outcome.entries["after"] if e.kind == evidence.ATTEMPT_STARTED).recorded_at_us
    assert after_started > failed, "the run after must be claimed after the cancelled one ended"
    assert [(r["k"], r["c"]) for r in outcome.rows["after"]] == [(1, 2 * JOB_ROWS), (2, 2 * JOB_ROWS)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_run_is_left_running_and_no_invariant_is_broken(backend: str, outcomes: dict[str, Any]) -> None:
    """The checker over everything both workers left: every run terminal, DESIGN §7 invariants 3, 6-9 hold."""
    outcome = outcome_of(outcomes, backend)
    report = outcome.report
    assert report.violations == [], report.violations
    assert sum(report.states.values()) == len(outcome.runs), report.summary()
    assert not (report.states["queued"] or report.states["running"]), report.summary()


# ---- a lost executor, the driver paused --------------------------------------------------------------------


@pytest.mark.postgres
def test_a_lost_executor_is_survived_while_the_paused_driver_keeps_its_lease(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """local-cluster[2,1,1024] (two executor JVMs): the worker pauses itself from the watch thread once the
    job runs (SIGSTOP stops the whole process; the sweeper decides nothing while its holder lives); one
    executor is SIGKILLed mid-job; resumed, the run succeeds under attempt 1 with every row counted once,
    and Spark's event log shows the executor removed and its tasks lost and re-run."""
    url = database("postgres", request, tmp_path, "sparklost")
    n = 5 * N_SLOW  # a job of seconds of CPU on each executor
    definition = spark_definition(tmp_path, "lost")
    log, events, marker = tmp_path / "worker.log", tmp_path / "events", uuid.uuid4().hex
    env = spark_env(url, LONG_TTL_S, marker, master="local-cluster[2,1,1024]", event_log=events,
                    pause_at=cp.DURING_EXECUTION)  # fmt: skip
    with harness.open_platform(url) as platform:
        run_id = submit(platform, definition, "lost", n)
        proc = harness.start(harness.worker_args(once=True), env, log)
        try:
            wait_stopped(proc, log)
            executors = marked(marker, "CoarseGrainedExecutorBackend")
            assert len(executors) == 2, executors
            victim, idle_cpu = executors[0], cpu_s(executors[0])
            # The job runs on while the driver's Python is stopped: kill the executor once it is busy with a task.
            harness.wait_until(lambda: cpu_s(victim) - idle_cpu >= TASK_CPU_S, SPARK_WAIT_S, "a task on the executor")
            os.kill(victim, signal.SIGKILL)
            assert sweeper.sweep(platform.db) == [], "a paused holder was taken for dead"
        finally:
            if proc.returncode is None:
                harness.resume(proc)
        assert harness.wait_exit(proc, log, SPARK_WAIT_S) == 0, harness.tail(log)
        run, entries = platform.runs.get(run_id), entries_of(platform, run_id)
        assert (run.status, run.attempt) == (runs.RunStatus.SUCCEEDED, 1), describe(run, entries, log)
        assert_counted_once(platform, run_id, n)
        assert_no_violations(platform, [])
    harness.wait_until(lambda: marked(marker) == [], JVM_EXIT_S, "the worker's JVMs to exit")
    logged = event_log(events)
    assert any(e.get("Event") == "SparkListenerExecutorRemoved" for e in logged)
    lost = [e for e in logged if e.get("Event") == "SparkListenerTaskEnd"
            and e.get("Task End Reason", {}).get("Reason") == "ExecutorLostFailure"]  # fmt: skip
    assert lost, "no task was running on the killed executor"
