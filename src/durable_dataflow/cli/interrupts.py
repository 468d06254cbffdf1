"""SIGINT and SIGTERM while ``dataflow run`` executes a run in this process (docs/cli.md#interrupting-a-run).

A Python signal handler runs in the main thread between two bytecodes, so a query the main thread waits
on in DuckDB or Spark would delay it until the query ends. The run is therefore carried by a thread of
its own while the main thread only waits for it, free to run the handler at once. The first signal asks
the run service to stop (dataflow.interruption): its engine stops within a second, and an attempt not yet
authorized to dispatch ends ``cancelled``; a publication already authorized is finished. A second signal
stops waiting: attempts not yet authorized are cancelled from here (under the fence, as an operator's
cancel), an authorized one is left to the sweeper as a crash would leave it, and the command exits 130.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TypeVar

from durable_dataflow.dataflow.interruption import Interruption

T = TypeVar("T")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


def call_in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in a thread of its own, awaited here; its exception is raised here. The wait is a lock
    acquisition, which a signal interrupts on POSIX: the handler runs at once, then the wait goes on.
    The thread is a daemon so that a second signal can end the process without it."""
    done: list[T] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            done.append(fn())
        except BaseException as error:  # raised again in the waiting thread
            failed.append(error)

    thread = threading.Thread(target=target, name="dataflow-run", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return done[0]
