"""Executor processes (execution/isolation.py): each DuckDB execution of a shared process in a pooled process
that the operating system bounds, whose death ends only its own run."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.core.errors import ExecutionError, Interrupted, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import isolation, progress
from durable_dataflow.dataflow.execution.compute import engine_for, execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.engine import EngineRun
from durable_dataflow.dataflow.execution.interruption import Interruption
from durable_dataflow.dataflow.execution.limits import ExecutionLimits, MiB

HOG_SQL = "select length(repeat('x', 400000000))::bigint as n"  # ≈ 800 MiB that DuckDB's memory_limit misses
SLOW_SQL = "select count(*)::bigint as n from range(100000000000) a"  # minutes of work unless stopped
WAIT_S_MAX = 30.0


def _definition(sql: str, inline: bool = False) -> Definition:
    sources = {"t": {"kind": "inline", "schema": {"x": "int64"}, "rows": [{"x": 1}, {"x": 2}]}} if inline else {}
    return Definition.model_validate({
        "name": "isolated", "version": 1, "sources": sources, "steps": [{"name": "r", "sql": sql}],
        "output": {"schema": {"n": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
    })  # fmt: skip


def _context(tmp_path: Path, interruption: Interruption | None = None) -> ExecutionContext:
    limits = ExecutionLimits(memory_bytes_max=64 * MiB, threads=2, time_limit_s=60)
    return ExecutionContext(tmp_path, (tmp_path,), limits, interruption=interruption)


@pytest.fixture
def pool() -> Iterator[isolation.ExecutorPool]:
    executors = isolation.ExecutorPool()
    with isolation.using(executors):
        yield executors
    executors.close()


def test_a_trivial_execution_runs_in_an_executor_and_returns_its_rows(pool: isolation.ExecutorPool,
                                                                     tmp_path: Path) -> None:
    """Proves an execution through the pool returns the rows, digest and count the in-process engine does,
    in an executor process (not this one) that serves the next execution too."""
    d = _definition("select sum(x)::bigint as n from t", inline=True)
    isolated = execute(d, {}, _context(tmp_path))
    [pid] = pool.pids()
    assert pid != os.getpid()
    again = execute(d, {}, _context(tmp_path))
    assert pool.pids() == [pid], "the executor is reused"
    with isolation.using(None):
        local = execute(d, {}, _context(tmp_path))
    assert isolated.table.to_pylist() == local.table.to_pylist() == [{"n": 3}]
    assert isolated.output_digest == again.output_digest == local.output_digest
    assert isolated.row_count == local.row_count == 1


def test_the_data_limit_ends_a_huge_value_with_limit_exceeded_and_the_executor_serves_on(
    pool: isolation.ExecutorPool, tmp_path: Path
) -> None:
    """Proves RLIMIT_DATA in the executor makes DuckDB's allocation of one 400 MB value fail (limit_exceeded
    naming the memory limit) while the executor's peak stays far below it, and the same executor then
    runs the next execution."""
    with pytest.raises(LimitExceeded, match=r"memory limit of 64MiB"):
        execute(_definition(HOG_SQL), {}, _context(tmp_path))
    [pid] = pool.pids()
    assert _peak_kib(pid) < 400 * 1024, "the value was never built"
    assert execute(_definition("select 7::bigint as n"), {}, _context(tmp_path)).table.to_pylist() == [{"n": 7}]
    assert pool.pids() == [pid]


def test_the_watch_kills_an_executor_past_its_bound_and_the_next_execution_succeeds(tmp_path: Path) -> None:
    """Proves the parent's watch alone (no RLIMIT_DATA) SIGKILLs an executor whose resident size passes
    memory limit + output.max_bytes + slack, the run ends limit_exceeded naming the bound, and the pool
    replaces the executor so the next execution in it succeeds."""
    executors = isolation.ExecutorPool(data_limit=False)
    try:
        with isolation.using(executors):
            with pytest.raises(LimitExceeded, match=r"memory bound of its executor process") as raised:
                execute(_definition(HOG_SQL), {}, _context(tmp_path))
            assert "was killed" in raised.value.message
            assert executors.pids() == [], "the killed executor is not kept"
            after = execute(_definition("select 8::bigint as n"), {}, _context(tmp_path))
        assert after.table.to_pylist() == [{"n": 8}]
    finally:
        executors.close()


def test_an_interruption_kills_the_executor_and_raises_interrupted(pool: isolation.ExecutorPool,
                                                                   tmp_path: Path) -> None:
    """Proves a process interruption (SIGTERM's request) during a minutes-long query ends it within seconds
    as Interrupted naming the signal, the executor is killed, and the next execution runs."""
    stop = Interruption()
    started = threading.Timer(0.5, stop.request, ("SIGTERM", "worker"))
    started.start()
    began = time.monotonic()
    with pytest.raises(Interrupted, match=r"interrupted \(SIGTERM\)"):
        execute(_definition(SLOW_SQL), {}, _context(tmp_path, stop))
    assert time.monotonic() - began < 5.0
    assert pool.pids() == []
    assert execute(_definition("select 9::bigint as n"), {}, _context(tmp_path)).table.to_pylist() == [{"n": 9}]


def test_executors_ignore_sigint_and_sigterm_meant_for_their_parent(pool: isolation.ExecutorPool,
                                                                    tmp_path: Path) -> None:
    """Proves an executor receiving SIGINT and SIGTERM (as a Ctrl-C to the process group would send) lives
    on: the same process runs the next execution."""
    execute(_definition("select 1::bigint as n"), {}, _context(tmp_path))
    [pid] = pool.pids()
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    assert execute(_definition("select 2::bigint as n"), {}, _context(tmp_path)).row_count == 1
    assert pool.pids() == [pid]


def test_an_executor_killed_by_another_signal_ends_its_run_naming_the_cause(pool: isolation.ExecutorPool,
                                                                           tmp_path: Path) -> None:
    """Proves an executor dying of a signal the pool did not send (SIGKILL from outside, as the kernel's OOM
    killer sends) ends the run limit_exceeded naming the kill, and the pool starts a new executor."""
    execute(_definition("select 1::bigint as n"), {}, _context(tmp_path))
    [pid] = pool.pids()
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(LimitExceeded, match=r"killed by SIGKILL"):
        execute(_definition(SLOW_SQL), {}, _context(tmp_path))
    assert execute(_definition("select 3::bigint as n"), {}, _context(tmp_path)).row_count == 1
    assert pool.pids() != [pid]


def test_errors_come_back_as_the_same_class_and_progress_is_relayed(pool: isolation.ExecutorPool,
                                                                   tmp_path: Path) -> None:
    """Proves an engine error in the executor is raised here as the same DataflowError subclass with its
    message, and a watched execution's progress reports reach the caller's sink."""
    with pytest.raises(ExecutionError, match=r"step 'r' failed") as raised:
        execute(_definition("select 'a'::bigint as n"), {}, _context(tmp_path))
    assert type(raised.value) is ExecutionError
    reports: list[progress.Progress] = []
    # Several seconds of work on 2 threads (a bare count(*) of the same rows took 0.25 s on an idle machine:
    # shorter than PROGRESS_INTERVAL_S, so no report came and the test failed whenever the machine was quiet).
    d = _definition("select sum(a.range % 7)::bigint as n from range(400000000) a, range(3) b")
    execute(d, {}, _context(tmp_path), progress_sink=reports.append)
    assert reports and all(r.phase is progress.Phase.EXECUTING for r in reports)


def test_each_definition_travels_once_to_an_executor_which_runs_each_jobs_own(
    pool: isolation.ExecutorPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the pool sends a definition object to an executor once (a next job with the same object
    carries none) and the executor runs each job's own definition: two definitions in turn on one
    executor, and the first again on the executor that replaced a discarded one (which is sent it anew)."""
    sent: list[Definition | None] = []
    converse = isolation._converse

    def recording(executor: Any, job: isolation.Job, *rest: Any) -> Any:
        sent.append(job.definition)
        return converse(executor, job, *rest)

    monkeypatch.setattr(isolation, "_converse", recording)
    one, two = _definition("select 1::bigint as n"), _definition("select 2::bigint as n")
    rows = [execute(d, {}, _context(tmp_path)).table.to_pylist() for d in (one, one, two, one)]
    assert rows == [[{"n": 1}], [{"n": 1}], [{"n": 2}], [{"n": 1}]]
    assert sent == [one, None, two, one]
    assert len(pool.pids()) == 1, "one executor served the four jobs"
    unsendable = EngineRun(one, {"x": threading.Lock()}, [], ExecutionLimits(), time.monotonic() + 60)
    with pytest.raises(ExecutionError, match=r"could not be sent"):  # its executor is discarded
        pool.run(unsendable, engine_for(one).gate(one, ExecutionLimits()), 1024)
    assert pool.pids() == [] and sent[-1] is None
    assert execute(one, {}, _context(tmp_path)).table.to_pylist() == [{"n": 1}]
    assert sent[-1] is one, "a new executor is sent the definition"


def _inline_sum(values: list[int]) -> Definition:
    return Definition.model_validate({
        "name": "held", "version": 1, "steps": [{"name": "r", "sql": "select sum(x)::bigint as n from t"}],
        "sources": {"t": {"kind": "inline", "schema": {"x": "int64"}, "rows": [{"x": v} for v in values]}},
        "output": {"schema": {"n": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
    })  # fmt: skip


def test_an_inline_table_travels_once_to_an_executor_which_binds_each_jobs_own(
    pool: isolation.ExecutorPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves an inline source's table is sent to an executor once (the next job of the same definition names
    it, Held) and the executor binds each job's own table: two definitions whose source has the same name
    and other rows, in turn on one executor, and the first again on the executor that replaced a discarded
    one (which is sent the table anew)."""
    sent: list[tuple[str, ...]] = []
    converse = isolation._converse

    def recording(executor: Any, job: isolation.Job, *rest: Any) -> Any:
        sent.append(tuple("held" if isinstance(s, isolation.Held) else "table" for s in job.resolved))
        return converse(executor, job, *rest)

    monkeypatch.setattr(isolation, "_converse", recording)
    one, two = _inline_sum([1, 2]), _inline_sum([10, 20, 30])
    sums = [execute(d, {}, _context(tmp_path)).table.to_pylist() for d in (one, one, two, one, one)]
    assert sums == [[{"n": 3}], [{"n": 3}], [{"n": 60}], [{"n": 3}], [{"n": 3}]]
    assert sent == [("table",), ("held",), ("table",), ("table",), ("held",)]
    assert len(pool.pids()) == 1, "one executor served the five jobs"
    # an execution that ends mid-conversation (here a KeyboardInterrupt in the parent) discards its executor
    monkeypatch.setattr(isolation, "_reply", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        execute(one, {}, _context(tmp_path))
    assert pool.pids() == [] and sent[-1] == ("held",)
    monkeypatch.undo()
    monkeypatch.setattr(isolation, "_converse", recording)
    assert execute(one, {}, _context(tmp_path)).table.to_pylist() == [{"n": 3}]
    assert sent[-1] == ("table",), "a new executor is sent the table"


def _kill_and_reap(pid: int) -> None:
    ended = os.pidfd_open(pid)  # readable once the process has exited
    try:
        os.kill(pid, signal.SIGKILL)
        assert select.select([ended], [], [], WAIT_S_MAX)[0]
    finally:
        os.close(ended)


def test_an_executor_that_died_idle_is_replaced_before_the_job_is_sent(
    pool: isolation.ExecutorPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves an idle executor that died (the OOM killer, an operator) before the forkserver reported its
    death (``is_alive()`` reads that report, here held at True) does not fail the next execution with a
    raw BrokenPipeError: the job never reached it, so a fresh executor runs it (found by a review)."""
    d = _definition("select 1::bigint as n")
    assert execute(d, {}, _context(tmp_path)).table.to_pylist() == [{"n": 1}]
    [pid] = pool.pids()
    _kill_and_reap(pid)
    monkeypatch.setattr(BaseProcess, "is_alive", lambda _self: True)  # the death not reported yet
    assert execute(d, {}, _context(tmp_path)).table.to_pylist() == [{"n": 1}]
    assert pid not in pool.pids()


def test_a_job_whose_fresh_executor_died_idle_too_fails_as_an_execution_error(
    pool: isolation.ExecutorPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the pool tries a second executor once, not forever: when the executor taken for a job and
    the fresh one taken after it were both dead before the job reached them (each killed here right after
    it is taken, the forkserver not reporting it), the execution ends as an ExecutionError saying so, both
    are discarded, and the next job runs on a new executor (the second turn had no test at stop 41)."""
    d = _definition("select 1::bigint as n")
    assert execute(d, {}, _context(tmp_path)).table.to_pylist() == [{"n": 1}]
    take = isolation.ExecutorPool._take
    killed: list[int] = []

    def take_a_dead_one(self: isolation.ExecutorPool) -> Any:
        executor = take(self)
        _kill_and_reap(executor.pid)
        killed.append(executor.pid)
        return executor

    with monkeypatch.context() as patched:
        patched.setattr(BaseProcess, "is_alive", lambda _self: True)  # the deaths not reported yet
        patched.setattr(isolation.ExecutorPool, "_take", take_a_dead_one)
        with pytest.raises(ExecutionError, match=r"could not be sent to its executor process \(it died\)"):
            execute(d, {}, _context(tmp_path))
    assert len(set(killed)) == 2 and not set(killed) & set(pool.pids())
    assert execute(d, {}, _context(tmp_path)).table.to_pylist() == [{"n": 1}]


def _peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def test_a_job_that_cannot_be_sent_fails_as_an_execution_error(pool: isolation.ExecutorPool) -> None:
    """Proves a job holding a value that cannot be pickled (here a lock among the parameters) ends as an
    ExecutionError naming the cause, not a raw TypeError, and its executor is not kept."""
    d = _definition("select 1::bigint as n")
    job = EngineRun(d, {"x": threading.Lock()}, [], ExecutionLimits(), time.monotonic() + 60)
    with pytest.raises(ExecutionError, match=r"could not be sent to its executor process \(TypeError\)"):
        pool.run(job, engine_for(d).gate(d, ExecutionLimits()), 1024)
    assert pool.pids() == []
