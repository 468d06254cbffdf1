"""Executor processes: each DuckDB execution of a shared process runs in a pooled process the OS bounds.

DuckDB's ``memory_limit`` does not count everything (one value built by ``repeat()`` is not), so one
tenant's step could grow the worker or server until the kernel's OOM killer takes it, with every other
tenant's in-flight runs. ``dataflow worker`` and ``dataflow serve`` therefore run each DuckDB execution
in an executor process of an :class:`ExecutorPool` (``DATAFLOW_ISOLATION=process``, their default):

* executors are started from a ``forkserver`` that imported the engine once, and are reused run after
  run (the process-wide shared DuckDB database included), so a run pays neither an import nor a fork;
* the parent keeps everything that decides or records (parameters, the gate, source resolution,
  ``check_unchanged``, the interruption); it sends the checked job and receives progress messages and
  then the result's IPC bytes (one copy in the parent, as the in-process collector holds one) or an
  error rebuilt as the same ``DataflowError`` subclass; a definition object travels once to each
  executor (the next jobs of the same definition carry none; a worker keeps one object per hash), and so
  does an inline source's table (a source resolved to the same object as in the executor's previous job
  travels as its name, :class:`Held`);
* two OS bounds hold each execution to ``memory_bytes_max + output.max_bytes + MEMORY_SLACK_BYTES`` over
  the executor's size when the execution starts: ``RLIMIT_DATA`` in the executor (an allocation past it
  fails, DuckDB reports "Out of Memory", the run ends ``limit_exceeded`` and the executor lives on), and
  the parent's watch, which reads the executor's resident size every ``WATCH_INTERVAL_S`` and SIGKILLs it
  past the bound (what ``RLIMIT_DATA`` does not see: file-backed and shared pages);
* a dead executor (killed by the watch, the kernel or anything else) ends only its run and is replaced;
  one that died while idle, before the forkserver reported it, is replaced before the job is sent to it.

Executors ignore SIGINT and SIGTERM (they share the parent's process group, and a Ctrl-C is the parent's
to decide): on an interruption the parent kills the executor and raises ``Interrupted``. Executors die
with the parent (``PR_SET_PDEATHSIG`` on the forkserver's death, and the pool's exit finalizer).
An executor prepares its ``__main__`` as every forkserver child does: a main script must guard its entry
point (``if __name__ == "__main__"``), as the ``dataflow`` script and ``python -m`` modules do.
Spark is not isolated here: it runs in its own JVM, bounded by ``spark.driver.memory`` (docs/engines.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import multiprocessing
import multiprocessing.util
import os
import pickle
import resource
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from durable_dataflow.core import errors
from durable_dataflow.core.errors import DataflowError, ExecutionError, InputError, Interrupted, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import interruption as interruption_module
from durable_dataflow.dataflow.execution import progress
from durable_dataflow.dataflow.execution.engine import EngineRun
from durable_dataflow.dataflow.execution.limits import ExecutionLimits, MiB, format_size
from durable_dataflow.dataflow.execution.postgres_source import PostgresStream
from durable_dataflow.dataflow.execution.resultstream import BoundedResult
from durable_dataflow.dataflow.execution.sources import ArrowTable, ResolvedSource

ISOLATION_ENV = "DATAFLOW_ISOLATION"


class Isolation(enum.StrEnum):
    PROCESS = "process"  # DuckDB executions run in pooled executor processes bounded by the OS
    NONE = "none"  # executions run in the calling process (the local `dataflow run`: the process is the run)


# How often the parent reads a running executor's resident size (and looks for an interruption): an
# allocation outruns the watch by at most what it writes in this time; RLIMIT_DATA stops the rest.
WATCH_INTERVAL_S = 0.01
# The executor's own memory beyond the two limits: Arrow batches in flight, DuckDB's unaccounted
# buffers, the IPC bytes being sent.
MEMORY_SLACK_BYTES = 256 * MiB
# Address space RLIMIT_DATA counts beyond resident memory: each engine thread's stack (8 MiB) and the
# malloc arena it writes into (64 MiB reserved per arena).
DATA_SLACK_PER_THREAD_BYTES = 72 * MiB
# An idle executor that grew this much since it started (allocator retention, caches) is replaced, so
# each execution's bound starts near the executor's fresh size.
IDLE_GROWTH_BYTES_MAX = 512 * MiB
IDLE_EXECUTORS_MAX = 4  # executors kept alive between runs; a busier process starts more, then closes them
# Past the deadline, the time an executor has to report the time limit itself before it is killed.
DEADLINE_GRACE_S = 5.0
EXECUTOR_JOIN_S = 5.0  # waiting for a killed executor to be reaped
# Imported once in the forkserver, so every executor starts with the engine loaded.
PRELOAD_MODULES = ("durable_dataflow.dataflow.execution.duckdb_engine",)
_PR_SET_PDEATHSIG = 1
EXIT_PRIORITY = 100  # multiprocessing runs finalizers with a priority before it stops its children


def isolation_from_env(default: Isolation) -> Isolation:
    """The process's isolation: ``$DATAFLOW_ISOLATION`` (process or none), else ``default``."""
    raw = os.environ.get(ISOLATION_ENV, "").strip().lower()
    if not raw:
        return default
    try:
        return Isolation(raw)
    except ValueError:
        raise InputError(f"{ISOLATION_ENV} must be 'process' or 'none', got {raw!r}") from None


@dataclass(frozen=True)
class Held:
    """In a job, a source the executor holds from its previous job (the same resolved object)."""

    name: str


def holdable(source: ResolvedSource) -> bool:
    """Whether an executor keeps a source for its next job: an inline source's table, which the parent
    resolves once per definition (so the next job of the definition has the same object) and nothing
    mutates. Streams and scans are resolved afresh for every run."""
    return isinstance(source.binding, ArrowTable)


@dataclass(frozen=True)
class Job:
    """One execution as sent to an executor: every value checked, every source resolved, the steps gated."""

    # None: the definition of the executor's previous job (the pool sends each definition object once per
    # executor; a worker's definitions are cached per hash, so most runs send none: 0.2 ms of pickling less)
    definition: Definition | None
    params: Mapping[str, Any]
    resolved: tuple[ResolvedSource | Held, ...]  # Held: the executor's own object from its previous job
    gated: tuple[object, ...]
    limits: ExecutionLimits
    deadline_at: float  # time.monotonic(): CLOCK_MONOTONIC is the same clock in every process of the host
    watched: bool  # whether the executor sends progress messages
    data_bytes_extra: int | None  # RLIMIT_DATA over the executor's data size at the start (None: no limit)


def memory_bound_bytes(limits: ExecutionLimits, result_bytes_max: int) -> int:
    """What one execution may add to its executor's resident size before the watch kills it."""
    return limits.memory_bytes_max + result_bytes_max + MEMORY_SLACK_BYTES


# ---- the executor's side ----------------------------------------------------------------------


def _die_with_parent() -> None:
    """SIGKILL when the forkserver (which exits with the pool's process) dies; Linux only, else nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _read_proc(path: str) -> bytes:
    """A small /proc file's bytes, read unbuffered (a text-mode open costs twice as much, every run)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = [os.read(fd, 16384)]
        while chunks[-1]:  # one read is the whole file unless it is longer (a status with many groups)
            chunks.append(os.read(fd, 16384))
        return b"".join(chunks)
    finally:
        os.close(fd)


def _data_size_bytes() -> int:
    status = _read_proc("/proc/self/status")
    start = status.index(b"VmData:") + len(b"VmData:")
    return int(status[start : status.index(b"\n", start)].split()[0]) * 1024


def executor_main(conn: Connection) -> None:
    """Serve jobs one at a time until the parent closes the pipe (a loop meant to run for the executor's life)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it kills us on an interruption
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    definition: Definition | None = None
    held: dict[str, ResolvedSource] = {}
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job.definition is not None:
            definition = job.definition
        assert definition is not None  # the pool sends its definition to a new executor
        resolved = tuple(held[s.name] if isinstance(s, Held) else s for s in job.resolved)
        held = {s.name: s for s in resolved if holdable(s)}  # the parent's rule, on the same sources
        _serve(conn, job, definition, resolved)


def _serve(conn: Connection, job: Job, definition: Definition, resolved: tuple[ResolvedSource, ...]) -> None:
    from durable_dataflow.dataflow.execution import duckdb_engine  # preloaded by the forkserver

    lock = threading.Lock()  # the watch thread sends progress while the main thread may reply

    def send_progress(report: progress.Progress) -> None:
        with lock:
            conn.send(("progress", report))

    run = EngineRun(definition, job.params, resolved, job.limits, job.deadline_at,
                    send_progress if job.watched else None, None, crashpoints_reached=False)  # fmt: skip
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    result: BoundedResult | None = None
    try:
        if job.data_bytes_extra is not None:
            limit = _data_size_bytes() + job.data_bytes_extra
            if hard != resource.RLIM_INFINITY:
                limit = min(limit, hard)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
        result = duckdb_engine.ENGINE.run(run, job.gated)
        reply: tuple[Any, ...] = ("result", result.row_count, result.output_digest, _fingerprints(resolved))
    except DataflowError as error:
        reply = ("error", type(error).__name__, error.message)
    except MemoryError:
        reply = ("error", LimitExceeded.__name__, _memory_message(job.limits))
    except Exception as error:  # the executor reports every failure and serves the next job
        reply = ("error", ExecutionError.__name__, f"the execution failed in its executor ({type(error).__name__})")
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    with lock:
        conn.send(reply)
        if result is not None:
            conn.send_bytes(result.ipc_bytes)


def _fingerprints(resolved: Sequence[ResolvedSource]) -> dict[str, tuple[str | None, int]]:
    """What the engine learnt of each PostgreSQL source while reading it; the parent records it."""
    return {s.name: (s.binding.fingerprint, s.binding.bytes_read) for s in resolved
            if isinstance(s.binding, PostgresStream)}  # fmt: skip


def _memory_message(limits: ExecutionLimits) -> str:
    return f"the execution exceeded the memory limit of {limits.memory_limit} in its executor process"


# ---- the parent's side ------------------------------------------------------------------------


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes(pid: int) -> int | None:
    """The resident size of a live process (None once it is gone): statm's second field, in pages."""
    try:
        return int(_read_proc(f"/proc/{pid}/statm").split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


class _Executor:
    """One executor process and the parent's end of its pipe."""

    def __init__(self, context: Any) -> None:
        parent_end, child_end = multiprocessing.Pipe(duplex=True)
        self.process: BaseProcess = context.Process(target=executor_main, args=(child_end,), name="dataflow-executor",
                                                    daemon=True)  # fmt: skip
        self.process.start()
        child_end.close()
        self.conn = parent_end
        self.started_rss_bytes = _rss_bytes(self.pid) or 0
        self.answered = False  # whether it answered its current job (and so may serve another)
        self.definition: Definition | None = None  # the definition object it holds (the last one sent)
        self.held: dict[str, ResolvedSource] = {}  # the sources it holds from its previous job (holdable)

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None  # started in __init__
        return pid

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.join(EXECUTOR_JOIN_S)
        self.conn.close()

    def death(self) -> str:
        """How the executor ended: the signal's name or the exit status."""
        self.process.join(EXECUTOR_JOIN_S)
        code = self.process.exitcode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"


class ExecutorPool:
    """Executor processes reused across executions; thread-safe (each execution takes one executor)."""

    def __init__(self, idle_max: int = IDLE_EXECUTORS_MAX, data_limit: bool = True) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(PRELOAD_MODULES))
        self._idle_max = idle_max
        self._data_limit = data_limit  # False only in tests of the watch alone
        self._idle: list[_Executor] = []
        self._busy: set[_Executor] = set()
        self._lock = threading.Lock()
        self._closed = False
        # Closed at exit before multiprocessing stops its daemonic children (it SIGTERMs them, which
        # executors ignore, and then waits): its exit handler runs finalizers with a priority first, in a
        # main process (atexit) and in a multiprocessing child (which leaves without atexit) alike.
        multiprocessing.util.Finalize(None, self.close, exitpriority=EXIT_PRIORITY)

    def run(
        self,
        job: EngineRun,
        gated: Sequence[object],
        result_bytes_max: int,
    ) -> BoundedResult:
        """Run the job in an executor; the caller's progress sink and interruption are served from here."""
        bound_bytes = memory_bound_bytes(job.limits, result_bytes_max)
        data_extra = bound_bytes + job.limits.threads * DATA_SLACK_PER_THREAD_BYTES if self._data_limit else None
        with contextlib.suppress(_DiedIdle):  # it died idle, before the job reached it: nothing of it ran
            return self._run_in(self._take(), job, gated, bound_bytes, data_extra)
        try:
            return self._run_in(self._take(), job, gated, bound_bytes, data_extra)
        except _DiedIdle:
            raise ExecutionError("the execution could not be sent to its executor process (it died)") from None

    def _run_in(
        self, executor: _Executor, job: EngineRun, gated: Sequence[object], bound_bytes: int, data_extra: int | None
    ) -> BoundedResult:
        definition = None if executor.definition is job.definition else job.definition
        resolved = tuple(Held(s.name) if executor.held.get(s.name) is s else s for s in job.resolved)
        sent = Job(definition, dict(job.params), resolved, tuple(gated), job.limits,
                   job.deadline_at, job.progress_sink is not None, data_extra)  # fmt: skip
        try:
            result = _converse(executor, sent, job.resolved, bound_bytes, job.progress_sink, job.interruption)
        except DataflowError:
            if executor.answered:  # it answered with an error and serves the next job
                self._give_back(executor)
            else:
                self._discard(executor)
            raise
        except BaseException:  # e.g. a KeyboardInterrupt in the parent mid-conversation, or _DiedIdle: start afresh
            self._discard(executor)
            raise
        self._give_back(executor)
        return result

    def pids(self) -> list[int]:
        """The executors' process ids (tests read their peak sizes)."""
        with self._lock:
            return [e.pid for e in (*self._idle, *self._busy)]

    def close(self) -> None:
        """Kill every executor (they hold nothing durable); an execution still running fails."""
        with self._lock:
            self._closed = True
            executors, self._idle, self._busy = [*self._idle, *self._busy], [], set()
        for executor in executors:
            executor.kill()

    def _take(self) -> _Executor:
        with self._lock:
            if self._closed:
                raise ExecutionError("the executor pool is closed (the process is stopping)")
            executor = self._idle.pop() if self._idle else None
        if executor is None or not executor.process.is_alive():
            if executor is not None:
                executor.kill()
            executor = _Executor(self._context)
        with self._lock:
            self._busy.add(executor)
        return executor

    def _discard(self, executor: _Executor) -> None:
        with self._lock:
            self._busy.discard(executor)
        executor.kill()

    def _give_back(self, executor: _Executor) -> None:
        rss = _rss_bytes(executor.pid)
        with self._lock:
            self._busy.discard(executor)
            keep = (not self._closed and len(self._idle) < self._idle_max and rss is not None
                    and rss - executor.started_rss_bytes <= IDLE_GROWTH_BYTES_MAX)  # fmt: skip
            if keep:
                self._idle.append(executor)
        if not keep:
            executor.kill()


class _DiedIdle(Exception):
    """An executor taken from the idle list had died before the job was sent: nothing of the job ran."""


def _converse(
    executor: _Executor,
    job: Job,
    resolved: Sequence[ResolvedSource],
    bound_bytes: int,
    sink: progress.ProgressSink | None,
    interrupted: interruption_module.Interruption | None,
) -> BoundedResult:
    """Send the job, relay progress, watch the executor's size, the deadline and the interruption."""
    baseline_bytes = _rss_bytes(executor.pid) or executor.started_rss_bytes
    ceiling_bytes = baseline_bytes + bound_bytes
    executor.answered = False
    try:
        executor.conn.send(job)
    except (pickle.PicklingError, TypeError, AttributeError) as error:  # a source binding that cannot travel
        kind = type(error).__name__
        raise ExecutionError(f"the execution could not be sent to its executor process ({kind})") from None
    except OSError:  # its end of the pipe is closed: it died while idle (the forkserver had not reported it yet)
        raise _DiedIdle from None
    if job.definition is not None:
        executor.definition = job.definition
    executor.held = {s.name: s for s in resolved if holdable(s)}  # as the executor keeps them on receipt
    peak_bytes = 0
    while True:  # ends with the executor's reply, its death, or its kill
        try:
            if executor.conn.poll(WATCH_INTERVAL_S):
                message = executor.conn.recv()
                if message[0] == "progress":
                    progress.report(sink, message[1])
                    continue
                return _reply(executor, resolved, message)
        except (EOFError, OSError):
            raise _died(executor, job, bound_bytes, peak_bytes) from None
        rss = _rss_bytes(executor.pid)
        if rss is None:
            raise _died(executor, job, bound_bytes, peak_bytes)
        peak_bytes = max(peak_bytes, rss)
        if rss > ceiling_bytes:
            executor.kill()
            raise LimitExceeded(
                f"the execution exceeded the memory bound of its executor process ({format_size(bound_bytes)}: "
                f"memory limit {job.limits.memory_limit} + output.max_bytes + {format_size(MEMORY_SLACK_BYTES)} "
                f"slack) and was killed {format_size(rss - baseline_bytes)} over its starting size; DuckDB's "
                "memory_limit does not count every allocation (one large value), the operating system bound does"
            )
        _check_stop(executor, job, interrupted)


def _check_stop(executor: _Executor, job: Job, interrupted: interruption_module.Interruption | None) -> None:
    cause = interrupted.cause if interrupted is not None else None
    if cause is not None:
        executor.kill()
        raise Interrupted(f"the execution was interrupted ({cause.signal})")
    if time.monotonic() > job.deadline_at + DEADLINE_GRACE_S:
        executor.kill()
        raise LimitExceeded(f"the execution exceeded the time limit of {job.limits.time_limit_s:g} s")


def _reply(executor: _Executor, resolved: Sequence[ResolvedSource], message: tuple[Any, ...]) -> BoundedResult:
    if message[0] == "error":
        executor.answered = True
        raise _rebuilt(message[1], message[2])
    _, row_count, output_digest, fingerprints = message
    ipc_bytes = executor.conn.recv_bytes()
    executor.answered = True
    for source in resolved:  # the parent's own bindings, which check_unchanged and the record read
        if isinstance(source.binding, PostgresStream) and source.name in fingerprints:
            source.binding.fingerprint, source.binding.bytes_read = fingerprints[source.name]
    return BoundedResult(memoryview(ipc_bytes), row_count, output_digest)


def _rebuilt(name: str, message: str) -> DataflowError:
    """The executor's error as the same DataflowError subclass (ExecutionError for one it cannot name)."""
    kind = getattr(errors, name, None)
    if isinstance(kind, type) and issubclass(kind, DataflowError) and kind is not errors.QuotaExceeded:
        return kind(message)
    return ExecutionError(message)


def _died(executor: _Executor, job: Job, bound_bytes: int, peak_bytes: int) -> DataflowError:
    """A death we did not cause: SIGKILL is taken for the kernel's memory bound (OOM killer, cgroup)."""
    how = executor.death()
    executor.conn.close()
    if how == f"killed by {signal.SIGKILL.name}":
        return LimitExceeded(
            f"the execution's executor process was {how} (the kernel's OOM killer or a cgroup memory.max, at "
            f"{format_size(peak_bytes)} last seen; its bound is {format_size(bound_bytes)} with the memory "
            f"limit {job.limits.memory_limit})"
        )
    return ExecutionError(f"the execution's executor process {how}")


# ---- the process's pool -------------------------------------------------------------------------

_pool: ExecutorPool | None = None
_pool_lock = threading.Lock()


def current() -> ExecutorPool | None:
    """The pool DuckDB executions of this process run in (None: in the calling process)."""
    return _pool


def configure(isolation: Isolation) -> ExecutorPool | None:
    """Isolate this process's DuckDB executions (or not); the pool is closed at exit. Called once by the
    entry points of the shared processes (`dataflow worker`, `dataflow serve`)."""
    global _pool
    with _pool_lock:
        if isolation is Isolation.NONE:
            previous, _pool = _pool, None
            if previous is not None:
                previous.close()
            return None
        if _pool is None:
            # Started lazily: the first execution starts the forkserver (≈ 1 s of imports), so a process that
            # never executes (a reconciling worker, a server without inline runs) pays nothing.
            _pool = ExecutorPool()
        return _pool


@contextlib.contextmanager
def using(pool: ExecutorPool | None) -> Iterator[ExecutorPool | None]:
    """This process's DuckDB executions run in ``pool`` (None: in process) within the block (tests)."""
    global _pool
    with _pool_lock:
        previous, _pool = _pool, pool
    try:
        yield pool
    finally:
        with _pool_lock:
            _pool = previous
