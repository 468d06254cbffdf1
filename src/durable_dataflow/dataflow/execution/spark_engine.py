"""The Apache Spark engine (``engine: spark``): the same sources, gate and bounded result, run by Spark SQL.

Steps pass ``spark_gate`` (sqlglot, Spark dialect) without starting Spark, so ``preflight`` refuses
hostile SQL before a run is recorded. One Spark session serves the process (started lazily from
``DATAFLOW_SPARK_REMOTE`` — a Spark Connect URL — or ``DATAFLOW_SPARK_MASTER``, default ``local[2]``,
plus ``DATAFLOW_SPARK_CONF``); each execution works in ``newSession()``, whose temp views and SQL
settings are its own. Only the platform creates views: one per source, then one per earlier step.
Through Spark Connect an execution's session is released on the server when it ends, the client
retries an unanswered call for about CONNECT_RETRY_S only, and a server that is lost, refuses the
token or forgot the session is an ExecutionError naming the gRPC status (never the URL, which may hold
the token); the next execution connects again.

* Parquet files and a Delta snapshot without partition columns are read by Spark from exactly the
  resolved files (``file://`` URIs, never a folder or a glob); a partitioned Delta snapshot, inline
  rows and a PostgreSQL stream become Arrow tables in the driver (bounded by the source limit) and
  ``createDataFrame``. A CSV is read with ``mode=FAILFAST``, its declared columns as text converted by a
  checked cast, as is every declared Parquet column stored as another type (``typed_sources``).
* Earlier steps are ``localCheckpoint``-ed (computed once, eagerly, in order, spilling to disk) and
  registered as views, like DuckDB's TEMP tables: each runs once however many later steps read it,
  its non-deterministic values are read consistently, and its errors name it, not a later step.
* The last step is collected with ``limit(max_rows + 1)`` into Arrow and streamed into the same
  ``ResultCollector`` as DuckDB's, so typing, ``max_rows``, ``max_bytes`` and the digest are identical.

The crash point ``during_execution`` (``crashpoints``) is reached exactly once per execution and always
before the result exists: by the watch thread as soon as it sees a Spark job of the execution running
(classic sessions, while the point is armed), else by the execution itself just before the last step's
result is handed to the collector, or as the execution ends in an error.

What the engine honours per execution: the time limit (every job carries a tag of the execution,
cancelled by a watch thread when the time is up), ``output.max_rows``/``max_bytes``, the source limit
(file sizes at resolution; Arrow bytes of the driver-side sources). Memory, threads and spilling are
the Spark deployment's, not the execution's: ``limits.memory_bytes_max``, ``threads``, ``temp_dir``
and ``temp_bytes_max`` are not applied; set ``spark.driver.memory``, ``spark.local.dir`` etc. in
``DATAFLOW_SPARK_CONF`` and the cores in the master URL (``local[N]``). The driver holds the last
step's result (at most ``max_rows + 1`` rows) before it is bounded by bytes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import signal
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from durable_dataflow.core import crashpoints
from durable_dataflow.core.errors import DataflowError, ExecutionError, InputError, Interrupted, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition, parse_arrow_type
from durable_dataflow.dataflow.execution import (
    interruption,
    progress,
    resultstream,
    spark_gate,
    store_sources,
    typed_sources,
)
from durable_dataflow.dataflow.execution.engine import PROGRESS_INTERVAL_S, RESULT_BATCH_ROWS, EngineRun
from durable_dataflow.dataflow.execution.limits import (
    SPARK_CONF_ENV,
    SPARK_MASTER_ENV,
    SPARK_REMOTE_ENV,
    ExecutionLimits,
)
from durable_dataflow.dataflow.execution.postgres_source import PostgresStream
from durable_dataflow.dataflow.execution.sources import ArrowDataset, ArrowTable, FileScan, ResolvedSource

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType

SPARK_MASTER_DEFAULT = "local[2]"
# Settings of the Spark application (classic only; a Connect server has its own), after DATAFLOW_SPARK_CONF.
APP_CONF = {
    "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", "spark.log.level": "ERROR",
    # A task's fatal error (an OutOfMemoryError from repeat(s, 100000000)) fails its job instead of exiting
    # the executor's JVM, which in local mode is the driver that every execution of the process shares.
    "spark.executor.killOnFatalError.depth": "0",
}  # fmt: skip
# How long a Spark call may still take to return once the time is up (a cancelled job fails in ms).
CALL_GRACE_S = 1.0
REAP_INTERVAL_S = 0.5  # how often the jobs of an abandoned call are cancelled
# Settings of every execution's session; runSQLOnFiles off: no ``parquet.`/path``` in user SQL.
SESSION_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.ansi.enabled": "true",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.runSQLOnFiles": "false",
    # Spark rewrites ${env:…}, ${system:…} and ${setting} in SQL text, string literals included; the
    # gate never renders "${", and this turns the substitution itself off.
    "spark.sql.variable.substitute": "false",
}
MESSAGE_CHARS_MAX = 300
POINT_POLL_S = 0.05  # how often an armed watch looks for a running job of its execution
WITHHELD = "(value withheld)"
_CONF_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*$")
_PATH = re.compile(r"""(?:\bfile:/*|(?<![\w.:/])/)[A-Za-z0-9_.~-][^\s"'`,;)\]]*""")
_KEPT_PARAMETER = re.compile(r"(?i)(type|config|conf)$")  # message parameters naming types and settings
_QUOTING_LOGGERS = ("org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager")
_FILE_REFUSALS = ("AccessDeniedException", "AccessControlException", "FileNotFoundException", "NoSuchFileException")
# 50 ms, 200 ms, 800 ms, then 2 s apart (plus jitter): about CONNECT_RETRY_S before a lost server is an error.
CONNECT_RETRIES = 6
CONNECT_BACKOFF_MAX_MS = 2000
CONNECT_RETRY_S = 8.0
_GRPC_STATUS = re.compile(r"StatusCode\.([A-Z_]+)")
# gRPC statuses of a Spark Connect call that Spark itself never answered.
_CONNECT_LOST = ("UNAVAILABLE", "UNAUTHENTICATED", "PERMISSION_DENIED", "DEADLINE_EXCEEDED")
_MEMORY_CONDITIONS = ("UNABLE_TO_ACQUIRE_MEMORY", "SPARK_OUT_OF_MEMORY", "OUT_OF_MEMORY")

# pyspark warns on stderr each time a Connect call gives up retrying; the engine reports that error itself.
warnings.filterwarnings("ignore", message=r"\[RETRIES_EXCEEDED\]", category=UserWarning)

_session: SparkSession | None = None
_session_lock = threading.Lock()
_launching = False  # a classic session's JVM is being started (under _session_lock)
_LAUNCH_MARK = b"_PYSPARK_DRIVER_CONN_INFO_PATH="  # in the environment pyspark gives its launcher, and only there


def spark_conf_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """DATAFLOW_SPARK_CONF as settings: ``key=value`` entries separated by newlines or ``;``."""
    conf: dict[str, str] = {}
    entries = [e.strip() for e in re.split(r"[;\n]", environ.get(SPARK_CONF_ENV, "")) if e.strip()]
    for number, entry in enumerate(entries, 1):
        key, sep, value = entry.partition("=")
        if not sep or not _CONF_KEY.match(key.strip()) or not value.strip():
            raise InputError(  # never the entry itself: it may hold a credential
                f"{SPARK_CONF_ENV}: entry {number} is not key=value (a Spark setting name, '=', a value); "
                "separate entries with newlines or ';'"
            )
        conf[key.strip()] = value.strip()
    return conf


def _start() -> SparkSession:
    from pyspark.logger import PySparkLogger
    from pyspark.sql import SparkSession

    for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
        # pyspark logs every SQL error as JSON to stderr, quoting values: the engine reports them itself.
        PySparkLogger.getLogger(name).setLevel(logging.CRITICAL + 1)
    conf = spark_conf_from_env()
    remote = os.environ.get(SPARK_REMOTE_ENV, "").strip()
    if remote:  # the server's application settings are its own; a session of the platform's own
        spark = SparkSession.builder.remote(remote).create()  # no option: each would be a call
        _configure(spark, {**conf, **SESSION_CONF})
        return spark
    # pyspark marks the whole process as Spark Connect once it made a Connect session, and from then on
    # builds Connect sessions only: the platform's settings, not that mark, choose the kind.
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
    builder = SparkSession.builder.appName("durable-dataflow")
    builder = builder.master(os.environ.get(SPARK_MASTER_ENV, "").strip() or SPARK_MASTER_DEFAULT)
    for key, value in {**conf, **APP_CONF, **SESSION_CONF}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    with contextlib.suppress(Exception):  # a failed task's log quotes the values it failed on
        log4j = spark.sparkContext._jvm.org.apache.logging.log4j  # type: ignore[union-attr]
        for name in _QUOTING_LOGGERS:
            log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)
    return spark


def stop_session(lost: bool = False) -> None:
    """Stop the process's session; ``lost``: a Connect server that no longer answers is not asked to
    release it (it restarted, or the call would only wait for the retries to run out)."""
    global _session
    with _session_lock:
        spark, _session = _session, None
    if spark is not None and not _is_remote(spark) and not _jvm_answers():
        _discard(spark)
    elif spark is not None:
        if lost:
            spark.release_session_on_close = False  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            spark.stop()


def _jvm_answers() -> bool:
    """Whether the JVM of pyspark's gateway still answers a call (classic sessions)."""
    from pyspark import SparkContext

    try:
        SparkContext._jvm.java.lang.System.nanoTime()  # type: ignore[union-attr]
    except Exception:  # killed, or exited on a fatal error
        return False
    return True


def _discard(spark: SparkSession) -> None:
    """Forget a classic session whose JVM died, and pyspark's handles on that JVM: pyspark would reuse its
    dead gateway for every later session, so each later execution failed (ConnectionRefusedError)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession as Session

    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")  # "Unable to cleanly shutdown Spark JVM process"
        spark.stop()
    gateway = SparkContext._gateway
    with SparkContext._lock:
        SparkContext._active_spark_context = None
        SparkContext._gateway = None
        SparkContext._jvm = None
    Session._instantiatedSession = None
    Session._activeSession = None
    if gateway is not None:
        with contextlib.suppress(Exception):
            gateway.shutdown()
        process = getattr(gateway, "proc", None)  # the launcher's Popen; its stdin pipe tells the JVM to exit
        with contextlib.suppress(Exception):
            if process is not None:
                process.kill()
                process.wait(timeout=10)
                if process.stdin is not None:
                    process.stdin.close()


def session() -> SparkSession:
    """The process's Spark session, started on first use (thread-safe); stopped at exit. A classic
    session whose JVM died is replaced by a new one (a new JVM)."""
    global _session, _launching
    with _session_lock:
        if _session is not None and not _is_remote(_session) and not _jvm_answers():
            _discard(_session)
            _session = None
        if _session is None or (not _is_remote(_session) and _session.sparkContext._jsc is None):
            atexit.register(end_launch)  # the process may exit (SIGTERM) before the session is up
            _launching = True
            try:
                _session = _start()
            finally:
                _launching = False
                atexit.unregister(end_launch)
            atexit.register(stop_session)
        return _session


def end_launch() -> None:
    """At exit (atexit, and ``dataflow run``'s forced exit on a second signal) while a JVM is still
    starting: kill pyspark's launcher and what it started. Once up, the JVM exits when its stdin (a pipe
    from this process) closes; before its gateway watches that pipe, a JVM started on a busy host
    outlived the process by seconds (and a stopped server must not leave one).

    The launched processes are stopped first, and the tree read again until it holds nothing new: a
    process killed before its children would orphan them (no longer this process's descendants, so
    never found), and a stopped one forks no more. Then each is killed."""
    if not _launching:
        return
    stopped: list[int] = []
    while fresh := [pid for pid in _launched_processes() if pid not in stopped]:
        for pid in fresh:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        stopped += fresh
        _await_stopped(fresh)
    for pid in stopped:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # there is nothing of the run's to save in a JVM not yet up


STOP_WAIT_S = 1.0  # a process in an uninterruptible wait stops only when it leaves it: not waited for longer


def _await_stopped(pids: Sequence[int]) -> None:
    """Until each of pids is stopped or gone (a fork it was making is then linked: the next read of the
    tree sees the child), at most STOP_WAIT_S."""
    deadline = time.monotonic() + STOP_WAIT_S
    waiting = list(pids)
    while waiting and time.monotonic() < deadline:
        waiting = [pid for pid in waiting if _state(pid) not in ("T", "t", "Z", "X", None)]
        if waiting:
            os.sched_yield()


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _launched_processes() -> list[int]:
    """This process's descendants started by pyspark's gateway launcher (spark-submit, the launcher's
    java, the JVM): each whose environment carries the mark pyspark sets for its launcher only, and
    every descendant of one (whatever its own environment reads: a process in the middle of an exec
    reads empty). Found through /proc (Linux; elsewhere none); none when this process itself carries
    the mark."""
    if _LAUNCH_MARK.decode().rstrip("=") in os.environ:
        return []
    found: list[int] = []
    pending = [(os.getpid(), False)]
    while pending:
        pid, launched = pending.pop()
        for child in _children(pid):
            if launched or _carries_mark(child):
                found.append(child)
                pending.append((child, True))
    return found


def _children(pid: int) -> list[int]:
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for task in tasks:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as listed:
            children += [int(child) for child in listed.read().split()]
    return children


def _carries_mark(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return b"\0" + _LAUNCH_MARK in b"\0" + environ.read()
    except OSError:
        return False


def _is_remote(spark: SparkSession) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


_Link = tuple[str, str | None, dict[str, str], str | None, str]  # class, condition, parameters, SQLSTATE, message


def _chain(exc: BaseException) -> list[_Link]:
    """What Spark says about exc and each of its causes, outermost first; [] when that cannot be asked."""
    try:
        return _links(exc)
    except Exception:  # the JVM is gone
        return []


def _links(exc: BaseException) -> list[_Link]:
    java = getattr(exc, "java_exception", None) or getattr(exc, "_origin", None)
    if java is None:  # a Spark Connect error, or one raised by pyspark itself
        spark_exc: Any = exc
        condition = spark_exc.getCondition() if hasattr(exc, "getCondition") else None
        if not condition:
            return [(type(exc).__name__, None, {}, None, "")]
        params = {str(k): str(v) for k, v in (spark_exc.getMessageParameters() or {}).items()}
        return [(type(exc).__name__, condition, params, spark_exc.getSqlState(), str(spark_exc.getMessage()))]
    from py4j.java_gateway import is_instance_of  # type: ignore[import-untyped]
    from pyspark import SparkContext

    gateway, jvm = SparkContext._gateway, SparkContext._jvm
    found: list[_Link] = []
    while java is not None and len(found) < 20:  # ends at the root cause
        name = str(java.getClass().getName())
        if gateway is not None and jvm is not None and is_instance_of(gateway, java, "org.apache.spark.SparkThrowable"):
            utils = jvm.PythonErrorUtils
            params = {str(k): str(v) for k, v in dict(utils.getMessageParameters(java) or {}).items()}
            found.append((name, utils.getCondition(java), params, utils.getSqlState(java), str(java.getMessage())))
        else:
            found.append((name, None, {}, None, ""))
        java = java.getCause()
    return found


def spark_message(exc: BaseException, own_text: str = "", chain: list[_Link] | None = None) -> str:
    """Spark's error class and the first line of its message, without values: a message parameter
    is shown only when it names a type or a setting or (outside data errors, SQLSTATE 22xxx) when
    every word of it is in ``own_text``, the definition's SQL and names (a column named by a file's
    header is file contents). Never a stack trace, a path, a JVM id or a non-Spark exception's text."""
    chain = _chain(exc) if chain is None else chain
    known = [link for link in chain if link[1]]
    if not known:
        names = [link[0].rsplit(".", 1)[-1] for link in chain] or [type(exc).__name__]
        return (names[0] if len(names) == 1 else f"{names[0]} (caused by {names[-1]})")[:MESSAGE_CHARS_MAX]
    _, condition, params, _, message = known[0]
    data_error = any((link[3] or "").startswith("22") for link in known)
    own_words = set(re.findall(r"\w+", own_text.lower()))
    for key, value in sorted(params.items(), key=lambda kv: -len(kv[1])):
        words = set(re.findall(r"\w+", value.lower()))
        shown = _KEPT_PARAMETER.search(key) or (not data_error and words and words <= own_words)
        if value and not shown:
            message = message.replace(value, WITHHELD)
    line = next((ln.strip() for ln in message.splitlines() if ln.strip()), f"[{condition}]")
    line = _PATH.sub("(path withheld)", line.split("; line ")[0])
    causes = [link[1] for link in known[1:] if link[1] != condition]
    return (line + (f" (caused by {causes[0]})" if causes else ""))[:MESSAGE_CHARS_MAX]


class _PointOnce:
    """``crashpoints.DURING_EXECUTION`` for one execution: reached exactly once, by whichever thread
    comes first (the other waits until it has been reached, so no result is collected before it)."""

    def __init__(self) -> None:
        self.point = crashpoints.DURING_EXECUTION
        self.armed = crashpoints.armed(self.point)
        self._lock = threading.Lock()
        self._reached = False
        self._error: BaseException | None = None  # what a hook raised in the watch thread

    @property
    def pending(self) -> bool:
        return self.armed and not self._reached

    def reach(self) -> None:
        """Reach the point unless it was; re-raise here what a hook raised when the watch reached it."""
        with self._lock:
            if not self._reached:
                self._reached = True
                crashpoints.reach(self.point)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def reach_from_watch(self) -> None:
        """Reach the point from the watch thread: SIGKILL or SIGSTOP act on the whole process; a hook's
        error is raised by the execution's thread when it next reaches for the point."""
        with self._lock:
            if self._reached:
                return
            self._reached = True
            try:
                crashpoints.reach(self.point)
            except BaseException as error:
                self._error = error


class _Watch:
    """One thread per execution: cancels its tagged jobs when the time is up (and keeps cancelling,
    since a collect may start another job), reports progress when someone watches, and reaches the
    crash point once a job of the execution runs."""

    def __init__(self, spark: SparkSession, job: EngineRun, own_text: str, point: _PointOnce) -> None:
        self.spark = spark
        self.remote = _is_remote(spark)
        self.tag = f"dataflow-{uuid.uuid4().hex}"
        self.deadline_at = job.deadline_at
        self.interruption = job.interruption  # an interruption is a deadline reached now
        self.limits = job.limits
        self.sink = job.progress_sink
        self.own_text = own_text
        self.streams = tuple(s.binding for s in job.resolved if isinstance(s.binding, PostgresStream))
        self.collector: resultstream.ResultCollector | None = None
        self.point = point
        self.fired = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dataflow-spark-watch", daemon=True)

    def __enter__(self) -> _Watch:
        # Job tags are thread-local and inherited by the threads Spark starts for a collect; a
        # classic session's own tags are not, so the SparkContext's are used there.
        if self.remote:
            self.spark.addTag(self.tag)
        else:
            self.spark.sparkContext.addJobTag(self.tag)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()
        with contextlib.suppress(Exception):
            if self.remote:
                self.spark.removeTag(self.tag)
            else:
                self.spark.sparkContext.removeJobTag(self.tag)

    def _watch(self) -> None:
        next_report = time.monotonic() + PROGRESS_INTERVAL_S
        while not self.fired.is_set():  # ends when the execution ends or its time is up
            now = time.monotonic()
            remaining = self.deadline_at - now
            if remaining <= 0 or self._interrupted():
                self.fired.set()
                for stream in self.streams:
                    stream.cancel()
                continue
            wait = remaining
            if self.interruption is not None:
                wait = min(wait, interruption.POLL_S)
            if self.sink is not None:
                wait = min(wait, max(0.0, next_report - now))
            looking = self.point.pending and not self.remote  # Spark Connect has no status tracker
            if looking:
                wait = min(wait, POINT_POLL_S)
            if self._done.wait(wait):
                return
            if looking and self._job_running():
                self.point.reach_from_watch()
            if self.sink is not None and time.monotonic() >= next_report:
                self._report()
                next_report = time.monotonic() + PROGRESS_INTERVAL_S
        while True:  # cancel until the execution notices
            with contextlib.suppress(Exception):
                if self.remote:
                    self.spark.interruptTag(self.tag)
                else:
                    self.spark.sparkContext.cancelJobsWithTag(self.tag)
            if self._done.wait(0.1):
                return

    def _job_running(self) -> bool:
        """Whether a job carrying this execution's tag is running now (classic only)."""
        try:
            tracker = self.spark.sparkContext._jsc.sc().statusTracker()
            for job_id in tracker.getJobIdsForTag(self.tag):
                info = tracker.getJobInfo(job_id)
                if not info.isEmpty() and str(info.get().status()) == "RUNNING":
                    return True
        except Exception:  # the JVM is going away: the execution reaches the point itself
            return False
        return False

    def _percent(self) -> float | None:
        """Completed tasks of the stages of this execution's running jobs (classic only)."""
        if self.remote:
            return None
        try:
            tracker = self.spark.sparkContext._jsc.sc().statusTracker()
            done = total = 0
            for job_id in tracker.getJobIdsForTag(self.tag):
                info = tracker.getJobInfo(job_id)
                if info.isEmpty() or str(info.get().status()) != "RUNNING":
                    continue
                for stage_id in info.get().stageIds():
                    stage = tracker.getStageInfo(stage_id)
                    if not stage.isEmpty():
                        done, total = done + stage.get().numCompletedTasks(), total + stage.get().numTasks()
            return 100.0 * done / total if total else None
        except Exception:  # progress is best effort
            return None

    def _report(self) -> None:
        if self.sink is None:
            return
        collector = self.collector
        progress.report(self.sink, progress.Progress(
            progress.Phase.EXECUTING, self._percent(),
            collector.rows if collector else 0, collector.bytes if collector else 0,
        ))  # fmt: skip

    # The declared-type checks of the bound sources (replaced by SparkEngine._run): a raised check is the
    # source's invalid input, naming the source and the column.
    type_checks = typed_sources.TypeChecks()

    def _interrupted(self) -> bool:
        return self.interruption is not None and self.interruption.requested

    def stopped(self, part: str) -> DataflowError:
        """Why the watch cancelled the execution's jobs: the process's interruption, else the time limit."""
        cause = self.interruption.cause if self.interruption is not None else None
        if cause is not None:
            return Interrupted(f"{part} was interrupted ({cause.signal})")
        return LimitExceeded(f"{part} exceeded the time limit of {self.limits.time_limit_s:g} s")

    def check(self, part: str) -> None:
        if self.fired.is_set():
            raise self.stopped(part)

    @contextlib.contextmanager
    def guard(self, part: str) -> Iterator[None]:
        """Every error inside becomes a DataflowError naming ``part`` (``step 'x'`` or ``source 'x'``)."""
        self.check(part)
        try:
            yield
        except DataflowError:
            raise
        except Exception as exc:
            raise self.translate(part, exc) from None

    def translate(self, part: str, exc: BaseException) -> DataflowError:
        from py4j.protocol import Py4JNetworkError  # type: ignore[import-untyped]

        if self.fired.is_set():
            return self.stopped(part)
        if isinstance(exc, Py4JNetworkError | ConnectionError):
            stop_session()  # the JVM is gone: the next execution starts a new session
            return ExecutionError(f"{part} failed: the Spark engine was lost ({type(exc).__name__})")
        lost = _connect_lost(exc)
        if lost is not None:
            stop_session(lost=True)  # the next execution connects again, with a session the server knows
            return ExecutionError(f"{part} failed: the Spark engine was lost ({lost})")
        chain = _chain(exc)
        typed = self.type_checks.failure(" ".join(link[4] + " " + " ".join(link[2].values()) for link in chain))
        if typed is not None:
            return typed
        text = spark_message(exc, self.own_text, chain)
        classes = " ".join(link[0] for link in chain)
        conditions = [link[1] or "" for link in chain]
        if isinstance(exc, MemoryError) or "OutOfMemoryError" in classes or any(
            c.startswith(_MEMORY_CONDITIONS) for c in conditions
        ):
            return LimitExceeded(
                f"{part} ran out of the Spark engine's memory (spark.driver.memory and spark.executor.memory, "
                f"set through {SPARK_CONF_ENV}): {text}"
            )
        if any(c in classes for c in _FILE_REFUSALS) or "PATH_NOT_FOUND" in conditions:
            return InputError(f"{part}: Spark could not open a file (missing, or access refused): {text}")
        if isinstance(exc, pa.ArrowCapacityError):
            return LimitExceeded(f"{part} produced a batch larger than Arrow can hold (2 GiB): {text}")
        return ExecutionError(f"{part} failed: {text}")


def _connect_lost(exc: BaseException) -> str | None:
    """What says that a Spark Connect server did not answer, refused the credentials or no longer knows
    the session (it restarted), as "Spark Connect: <status or condition>"; None for any other error. The
    rest of such an error (addresses, the server's text) is withheld."""
    if type(exc).__module__ != "pyspark.errors.exceptions.connect":
        return None
    spark_exc: Any = exc
    condition = str(spark_exc.getCondition() or "") if hasattr(exc, "getCondition") else ""
    if condition.startswith("INVALID_HANDLE"):
        return f"Spark Connect: {condition.split('.')[-1]}"
    if condition:
        return None
    code = spark_exc.getGrpcStatusCode().name if hasattr(exc, "getGrpcStatusCode") else "UNKNOWN"
    if code == "UNKNOWN":  # a client-side error wraps the RPC's own
        found = _GRPC_STATUS.search(str(exc))
        code = found.group(1) if found else code
    return f"Spark Connect: {code}" if code in _CONNECT_LOST else None


def _retry_briefly(spark: SparkSession) -> None:
    """A Connect client retries a call the server did not answer for at most about CONNECT_RETRY_S
    (pyspark's default policy waits up to 10 minutes, longer than any time limit, before failing)."""
    if _is_remote(spark):
        from pyspark.sql.connect.client.retries import DefaultPolicy

        policy = DefaultPolicy(max_retries=CONNECT_RETRIES, initial_backoff=50, max_backoff=CONNECT_BACKOFF_MAX_MS)
        spark.client.set_retry_policies([policy])


def _configure(spark: SparkSession, conf: Mapping[str, str]) -> None:
    """Set a new session's SQL settings; a Connect session that cannot take them is closed without
    asking the server (else pyspark asks it again at exit, retrying a lost server at length)."""
    _retry_briefly(spark)  # before any call, so an unreachable server fails in seconds
    try:
        for key, value in conf.items():
            spark.conf.set(key, value)
    except BaseException:
        if _is_remote(spark):
            spark.release_session_on_close = False  # type: ignore[attr-defined]
            with contextlib.suppress(Exception):
                spark.stop()
        raise


def execution_session() -> SparkSession:
    """A session of the execution's own (``newSession()``: its temp views and SQL settings), with the
    engine's settings; an engine that cannot be started or reached is an ExecutionError naming why."""
    try:
        spark = session().newSession()
        _configure(spark, SESSION_CONF)
    except Exception as exc:
        lost = _connect_lost(exc)
        if lost is not None:
            stop_session(lost=True)
            raise ExecutionError(f"the Spark engine could not be reached ({lost}); see {SPARK_REMOTE_ENV}") from None
        where = f"; see {SPARK_REMOTE_ENV}" if os.environ.get(SPARK_REMOTE_ENV, "").strip() else ""
        raise ExecutionError(f"the Spark engine could not be started: {spark_message(exc)}{where}") from None
    return spark


def _file_uri(source: str, path: str) -> str:
    """A resolved absolute path as a URI Spark reads as exactly that file (Hadoop expands a glob,
    and reads a backslash as the glob escape: resolution refuses the glob characters)."""
    if "\\" in path or "\n" in path or "\r" in path:
        raise InputError(f"source {source!r}: a file name holds a backslash or a line break, which Spark cannot read")
    return "file://" + path


def spark_type(arrow_type_name: str) -> DataType:
    """The Spark type that reads a column declared with this Arrow type name (unsigned ones widened)."""
    from pyspark.sql.pandas.types import from_arrow_type

    t = parse_arrow_type(arrow_type_name)
    widened = {pa.uint8(): pa.int16(), pa.uint16(): pa.int32(), pa.uint32(): pa.int64(), pa.uint64(): pa.decimal128(20)}
    return from_arrow_type(widened.get(t, t), prefer_timestamp_ntz=True)


def _csv_options(name: str, scan: FileScan) -> tuple[bool, str]:
    """(header, delimiter) from the scan's DuckDB-style options, which name nothing else."""
    options = dict(scan.options)
    unknown = sorted(set(options) - {"header", "delim"})
    if unknown:
        raise ExecutionError(f"source {name!r}: the spark engine cannot read the csv option {unknown[0]!r}")
    delim = options.get("delim", "','")
    if len(delim) < 3 or delim[0] != "'" or delim[-1] != "'":
        raise ExecutionError(f"source {name!r}: the csv delimiter is not a quoted literal")
    return options.get("header") == "true", delim[1:-1].replace("''", "'")


def _checked(df: DataFrame, name: str, declared: dict[str, str], checks: typed_sources.TypeChecks) -> DataFrame:
    """df with each declared column whose type differs converted by a checked cast (typed_sources)."""
    stored = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    missing = [c for c in declared if c not in stored]
    if missing:
        raise ExecutionError(f"source {name!r}: the files have no column {missing[0]!r} that its schema declares")
    columns = []
    for column, stored_type in stored.items():
        quoted = "`" + column.replace("`", "``") + "`"
        target = spark_type(declared[column]).simpleString() if column in declared else stored_type
        if target == stored_type:
            columns.append(quoted)
            continue
        marker = checks.add(name, column, declared[column])
        columns.append(f"{typed_sources.spark_checked_cast(quoted, stored_type, target, marker)} AS {quoted}")
    return df.selectExpr(*columns)


def _read_csv(spark: SparkSession, name: str, scan: FileScan, checks: typed_sources.TypeChecks) -> DataFrame:
    """The file with its declared columns read as text and converted by checked casts: Spark's own
    parsing of a typed column cannot say which column failed; a checked cast names it."""
    from pyspark.sql.types import StringType, StructField, StructType

    header, delim = _csv_options(name, scan)
    paths = [_file_uri(name, s.path) for s in scan.stamps]

    def read(schema: StructType | None = None) -> DataFrame:  # a reader is mutable: one per read
        reader = spark.read.options(header=header, sep=delim, escape='"', mode="FAILFAST", enforceSchema=True)
        return (reader.option("inferSchema", True) if schema is None else reader.schema(schema)).csv(paths)

    declared = scan.declared or {}
    if declared and not header:  # without a header line the declared schema names the columns, in order
        return _checked(read(StructType([StructField(c, StringType()) for c in declared])), name, declared, checks)
    if not header:  # named like DuckDB names them: column0.. (zero-padded to the widest number)
        df = read()
        width = len(str(len(df.columns) - 1))
        return df.toDF(*[f"column{i:0{width}d}" for i in range(len(df.columns))])
    names = spark.read.options(header=True, sep=delim, escape='"').csv(paths).columns  # the header line only
    missing = [c for c in declared if c not in names]
    if missing:
        raise ExecutionError(f"source {name!r}: the file has no column {missing[0]!r} that its schema declares")
    # Undeclared columns are inferred (a pass over the file), as DuckDB sniffs them.
    inferred = {} if set(names) <= set(declared) else {f.name: f.dataType for f in read().schema.fields}
    text = read(StructType([StructField(c, StringType() if c in declared else inferred[c]) for c in names]))
    return _checked(text, name, declared, checks) if declared else text


def _arrow_within(name: str, schema: pa.Schema, batches: Iterator[pa.RecordBatch], bytes_max: int,
                  watch: _Watch) -> pa.Table:
    """The batches as one table in the driver, refused past the source limit (counted in Arrow bytes)."""
    kept, size = [], 0
    for batch in batches:
        watch.check(f"source {name!r}")
        size += batch.nbytes
        if size > bytes_max:
            raise LimitExceeded(f"source {name!r} is larger than the source limit of {bytes_max} bytes in memory")
        kept.append(batch)
    return pa.Table.from_batches(kept, schema)


def _read_delta(spark: SparkSession, name: str, binding: ArrowDataset, limits: ExecutionLimits,
                watch: _Watch) -> DataFrame:
    import pyarrow.dataset as pads
    from pyspark.sql.pandas.types import from_arrow_schema

    dataset = binding.dataset
    partitioned = any(pads.get_partition_keys(f.partition_expression) for f in dataset.get_fragments())
    if binding.stamps and not partitioned:  # Spark reads the snapshot's files, typed as the table
        schema = from_arrow_schema(dataset.schema, prefer_timestamp_ntz=True)
        return spark.read.schema(schema).parquet(*[_file_uri(name, s.path) for s in binding.stamps])
    # Partition values live in the log, not in the files: the dataset applies them.
    table = _arrow_within(name, dataset.schema, dataset.to_batches(), limits.source_bytes_max, watch)
    return spark.createDataFrame(table)


def _read_postgres(spark: SparkSession, name: str, stream: PostgresStream, watch: _Watch) -> DataFrame:
    try:
        schema, batches = stream.batches()
        table = _arrow_within(name, schema, batches, stream.bytes_max, watch)
    except Exception:
        if stream.failure is not None:  # the stream's own error
            raise stream.failure from None
        raise
    finally:
        stream.close()
    return spark.createDataFrame(table)


def _bind(spark: SparkSession, source: ResolvedSource, limits: ExecutionLimits, watch: _Watch) -> None:
    name, binding = source.name, source.binding
    if isinstance(binding, ArrowTable):
        df = spark.createDataFrame(binding.table)
    elif isinstance(binding, ArrowDataset):
        df = _read_delta(spark, name, binding, limits, watch)
    elif isinstance(binding, PostgresStream):
        df = _read_postgres(spark, name, binding, watch)
    elif binding.reader == "read_csv":
        df = _read_csv(spark, name, binding, watch.type_checks)
    else:
        df = spark.read.parquet(*[_file_uri(name, s.path) for s in binding.stamps])
        if binding.declared:
            df = _checked(df, name, binding.declared, watch.type_checks)
    df.createOrReplaceTempView(name)


def _release(df: DataFrame) -> None:
    """Free a local checkpoint's blocks now rather than at the JVM's next garbage collection."""
    with contextlib.suppress(Exception):
        df._jdf.queryExecution().analyzed().rdd().unpersist(False)


_T = TypeVar("_T")


def _bounded(watch: _Watch, part: str, call: Callable[..., _T], *args: Any) -> _T:
    """call(*args) in a thread of its own carrying the execution's job tag, awaited until the time is up
    (plus CALL_GRACE_S for a cancelled job to return). The tag cancels Spark's jobs, not what Spark does in
    the driver outside any job: optimizer rules evaluating expressions over inline rows and constants (a
    backtracking regex, repeat()), foldable arguments, a serve-Arrow thread that died and left pyspark
    reading its socket forever. Such a call is abandoned (its thread ends when Spark returns, if ever) and
    the part has exceeded the time limit; a late result is never used."""
    done: list[_T] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            if watch.remote:  # job tags are thread-local, in the JVM and in a Connect client alike
                _make_active(watch.spark)
                watch.spark.addTag(watch.tag)
            else:
                watch.spark.sparkContext.addJobTag(watch.tag)
            done.append(call(*args))
        except BaseException as exc:  # raised again in the execution's thread
            failed.append(exc)
        finally:
            with contextlib.suppress(Exception):
                if watch.remote:
                    watch.spark.removeTag(watch.tag)
                else:
                    watch.spark.sparkContext.removeJobTag(watch.tag)

    thread = threading.Thread(target=target, name="dataflow-spark-call", daemon=True)
    thread.start()
    _await_call(watch, thread)
    if thread.is_alive():  # once Spark returns from the driver's work, it may start the call's job: cancel it
        threading.Thread(target=_cancel_while, args=(watch, thread), name="dataflow-spark-reaper", daemon=True).start()
    if thread.is_alive() or (watch.fired.is_set() and not failed):
        raise watch.stopped(part)
    if failed:
        raise failed[0]
    return done[0]


def _await_call(watch: _Watch, thread: threading.Thread) -> None:
    """Wait for a call's thread until the time is up or the process is interrupted (the watch fired),
    then CALL_GRACE_S more for its cancelled job to return."""
    while thread.is_alive() and not watch.fired.is_set():
        remaining = watch.deadline_at - time.monotonic()
        if remaining <= 0:
            break
        thread.join(min(remaining, interruption.POLL_S) if watch.interruption is not None else remaining)
    thread.join(CALL_GRACE_S)


def _make_active(spark: SparkSession) -> None:
    """Make a Connect session the calling thread's active one. pyspark (4.0 to 4.3) binds the DataFrame
    that ``localCheckpoint`` returns to the thread's active session, not to the session that made it,
    so a checkpoint of ``newSession()`` was looked up in the process's first session and not found
    (CONNECT_INVALID_PLAN.DATAFRAME_NOT_FOUND). Each call runs in a thread of its own, so this is safe
    for concurrent executions; pyspark has no public setter for it."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    ConnectSession._active_session.session = spark


def _cancel_while(watch: _Watch, thread: threading.Thread) -> None:
    """Cancel the execution's tagged jobs until an abandoned call's thread ends (the watch has stopped)."""
    while thread.is_alive():
        with contextlib.suppress(Exception):
            if watch.remote:
                watch.spark.interruptTag(watch.tag)
            else:
                watch.spark.sparkContext.cancelJobsWithTag(watch.tag)
        thread.join(REAP_INTERVAL_S)


def _planned(df: DataFrame) -> DataFrame:
    """df with its physical plan made now, in the calling thread (classic): the optimizer then evaluates
    what it folds here, where an OutOfMemoryError comes back as an error, not in toArrow()'s serve-Arrow
    thread, which such an error ended while pyspark waited on its socket forever."""
    jdf = getattr(df, "_jdf", None)
    if jdf is not None:
        jdf.queryExecution().executedPlan()
    return df


def _check_utf8(table: pa.Table, step: str) -> None:
    """Refuse a result string that is not UTF-8: Spark's CAST(binary AS STRING) keeps any bytes, while an
    Arrow string must be UTF-8 (every reader of the stored result decodes it) and DuckDB refuses the cast."""
    for name, column in zip(table.column_names, table.columns, strict=True):
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:
            raise ExecutionError(
                f"step {step!r} failed: column {name!r} holds a string that is not valid UTF-8 "
                "(Spark casts binary to string without checking it)"
            ) from None


class SparkEngine:
    """``engine: spark`` (the spark extra)."""

    name = "spark"

    def gate(self, d: Definition, limits: ExecutionLimits) -> list[spark_gate.SparkStep]:
        """Every step through the Spark gate, reading only declared sources and earlier steps; no Spark here.
        An s3:// source is refused: Spark would need the hadoop-aws connector and the store's credentials
        in its own configuration (docs/engines.md)."""
        for name, spec in d.sources.items():
            if store_sources.is_store_source(spec):
                raise InputError(
                    f"source {name!r}: engine spark does not read s3:// sources; run the definition on "
                    "engine duckdb (docs/engines.md)"
                )
        relations = list(d.sources)
        gated = []
        for step in d.steps:
            checked = spark_gate.gate_step(step.name, step.sql, relations=tuple(relations))
            undeclared = sorted(checked.parameter_names - set(d.parameters))
            if undeclared:
                raise InputError(f"step {step.name!r} uses ${undeclared[0]}, which is not a declared parameter")
            gated.append(checked)
            relations.append(step.name)
        return gated

    def run(self, job: EngineRun, gated: Sequence[object]) -> resultstream.BoundedResult:
        steps = [step for step in gated if isinstance(step, spark_gate.SparkStep)]
        d = job.definition
        declared = d.output.arrow_schema()
        collector = resultstream.ResultCollector(
            declared, d.output.max_rows, d.output.max_bytes_int, f"output.max_bytes = {d.output.max_bytes}"
        )
        own_text = "\n".join([*(s.sql for s in d.steps), *d.sources, *(s.name for s in d.steps), *d.output.columns])
        point = _PointOnce()
        try:
            self._run(job, steps, collector, own_text, point)
        except BaseException:
            point.reach()  # an execution that ends in an error reaches the point too, once
            raise
        return collector.finish()

    def _run(self, job: EngineRun, steps: list[spark_gate.SparkStep], collector: resultstream.ResultCollector,
             own_text: str, point: _PointOnce) -> None:
        from pyspark import StorageLevel

        d = job.definition
        declared = collector.declared
        spark = execution_session()  # private temp views and settings; the SparkContext is shared
        checkpoints: list[DataFrame] = []
        views = [*d.sources, *(step.name for step in steps[:-1])]
        try:
            with _Watch(spark, job, own_text, point) as watch:
                watch.type_checks = typed_sources.TypeChecks()
                for source in job.resolved:
                    with watch.guard(f"source {source.name!r}"):
                        _bind(spark, source, job.limits, watch)
                for step in steps:
                    bound = {name: (d.parameters[name].type, job.params[name]) for name in step.parameter_names}
                    part = f"step {step.name!r}"
                    with watch.guard(part):
                        df = _bounded(watch, part, spark.sql, spark_gate.render(step, bound))
                        if step is not steps[-1]:
                            df = _bounded(watch, part, df.localCheckpoint, True, StorageLevel.MEMORY_AND_DISK)
                            checkpoints.append(df)
                            df.createOrReplaceTempView(step.name)
                            continue
                        watch.collector = collector
                        limited = _bounded(watch, part, _planned, df.limit(d.output.max_rows + 1))
                        table = _bounded(watch, part, limited.toArrow)
                        resultstream.check_columns(table.schema, declared, step.name)
                        _check_utf8(table, step.name)
                        point.reach()  # unless the watch saw a job running: before the result is collected
                        collector.add_all(table.to_batches(max_chunksize=RESULT_BATCH_ROWS))
        finally:
            for name in views:
                with contextlib.suppress(Exception):
                    spark.catalog.dropTempView(name)
            for df in checkpoints:
                _release(df)
            for source in job.resolved:
                if isinstance(source.binding, PostgresStream):
                    source.binding.close()
            if _is_remote(spark):  # the server keeps a session until it is released (or idles out)
                with contextlib.suppress(Exception):
                    spark.stop()


ENGINE = SparkEngine()
