"""Interruption of a process's executions (SIGINT or SIGTERM to ``dataflow run`` or a worker).

A signal handler runs in the main thread, between two bytecodes: it only calls :meth:`Interruption.request`,
which writes two attributes (no lock, no logging, no I/O, so it cannot deadlock on what the interrupted
code held). Everything else polls: each execution's watch (DuckDB: ticked by the process's watcher
thread; Spark: a thread of its own), which treats a requested interruption as a deadline reached now
and stops the engine the way a time limit does (``con.interrupt()``, the job tag cancelled, PostgreSQL
source queries cancelled); and the run service,
which looks (:meth:`Interruption.check`) right before its terminal or pre-dispatch commit, after
everything else the attempt does first (the partition row check included), and cancels the run instead
(dataflow.protocol.cancel).
Once the dispatch is authorized, nothing looks any more: a publication is never cut short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from durable_dataflow.core.errors import Interrupted

# How a run (and the process executing it) was started; requests.Provenance records it with each run.
Trigger = Literal["cli", "api", "schedule", "worker"]

# How often a watch looks for an interruption: the engine stops well within a second.
POLL_S = 0.1


@dataclass(frozen=True)
class Cause:
    """Why the executions stop: the signal's name, and how the process was started (the run's trigger)."""

    signal: str
    trigger: Trigger  # "cli" (dataflow run) or "worker"


class Interruption:
    """Requested once, from a signal handler or any thread; read by every execution of the process."""

    def __init__(self) -> None:
        self._cause: Cause | None = None
        self._count = 0

    def request(self, signal: str, trigger: Trigger) -> None:
        """Ask every execution to stop (safe in a signal handler: two attribute writes)."""
        self._count += 1
        if self._cause is None:
            self._cause = Cause(signal, trigger)

    @property
    def requested(self) -> bool:
        return self._cause is not None

    @property
    def cause(self) -> Cause | None:
        return self._cause

    def check(self) -> None:
        """Interrupted when the process was told to stop: the run service's last look before a commit."""
        if self._cause is not None:
            raise Interrupted(f"the execution was interrupted ({self._cause.signal})")

    @property
    def count(self) -> int:
        """How many times it was requested (a second Ctrl-C asks to stop waiting)."""
        return self._count
