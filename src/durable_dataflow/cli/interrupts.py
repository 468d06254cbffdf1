"""SIGINT and SIGTERM while ``dataflow run`` executes a run in this process (docs/cli.md#interrupting-a-run).

A Python signal handler runs in the main thread between two bytecodes, so a query the main thread waits
on in DuckDB or Spark would delay it until the query ends. The run is therefore carried by a thread of
its own while the main thread only waits for it, free to run the handler at once. The first signal asks
the run service to stop (dataflow.execution.interruption): its engine stops within a second, and an attempt not yet
authorized to dispatch ends ``cancelled``; a publication already authorized is finished. A second signal
stops waiting: attempts not yet authorized are cancelled from here (under the fence, as an operator's
cancel), an authorized one is left to the sweeper as a crash would leave it, and the command exits 130.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TypeVar

from durable_dataflow.cli import common
from durable_dataflow.dataflow.execution.interruption import POLL_S, Interruption

T = TypeVar("T")
SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After a second signal, how long the run's (interrupted) thread may take to end before the process
# leaves anyway.
STOP_GRACE_S = 2.0


class StopWaiting(KeyboardInterrupt):
    """A second signal: the command stops waiting for its run (exit 130)."""


@contextlib.contextmanager
def handled(interruption: Interruption) -> Iterator[None]:
    """SIGINT and SIGTERM request ``interruption`` (a ``dataflow run``: trigger cli) while the block runs;
    the second one raises StopWaiting in the main thread. The previous handlers come back afterwards."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        interruption.request(signal.Signals(signum).name, "cli")
        if interruption.count > 1:
            raise StopWaiting

    previous = {signum: signal.signal(signum, on_signal) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _end_spark_launch() -> None:
    """The Spark engine's exit hook, when that engine was loaded (importing it here would load pyspark)."""
    spark_engine = sys.modules.get("durable_dataflow.dataflow.execution.spark_engine")
    if spark_engine is not None:
        spark_engine.end_launch()


def call_in_thread(fn: Callable[[], T], on_stop: Callable[[], None]) -> T:
    """``fn()`` in a thread of its own, awaited here; its exception is raised here. The wait wakes every
    POLL_S: a signal the kernel delivered to another thread (the main one was stopped, or already had
    one pending) only marks the handler due, and it runs when this thread next runs Python code.
    On a second signal, ``on_stop()`` runs here (it cancels what it can and says so); then the thread
    gets STOP_GRACE_S to end and the process leaves with status 130 through ``os._exit``: an engine
    thread still inside DuckDB (or one tearing down its thread-local state) when the interpreter
    finalizes is force-unwound through C++ frames and aborts the process (seen: SIGABRT, "exception
    not rethrown"). Every write of the attempt is one transaction, so leaving mid-way is a crash at worst."""
    done: list[T] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            done.append(fn())
        except BaseException as error:  # raised again in the waiting thread
            failed.append(error)

    thread = threading.Thread(target=target, name="dataflow-run", daemon=True)
    thread.start()
    try:
        while thread.is_alive():  # loops until the run's thread ends, each turn bounded by POLL_S
            thread.join(POLL_S)
    except StopWaiting:
        on_stop()
        thread.join(STOP_GRACE_S)
        _end_spark_launch()  # os._exit skips atexit, which kills a Spark JVM still starting
        sys.stdout.flush()
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
        os._exit(common.EXIT_INTERRUPTED)
    if failed:
        raise failed[0]
    return done[0]
