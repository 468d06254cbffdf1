"""One thread per process that wakes every watched execution when its time comes.

Each DuckDB execution is watched: interrupted when its time is up or the process is interrupted, and
asked for progress meanwhile (duckdb_engine's ``_Watch``). A thread started and joined per execution
cost two thread hand-offs a run (each waits for a core on a busy host: a trivial run's executor spent
about a quarter of its samples there); one long-lived thread per process now serves every execution,
woken only when a newly watched execution is due before the instant the thread sleeps until (an ended
execution is dropped without waking it, so back-to-back runs wake it about once per interruption poll).

A watched thing says when it next wants to be woken (``tick(now)`` returns that instant, or None when it
is done) and keeps its own lock, so that once ``remove`` has returned for it, it is never ticked again
by surprise: ``remove`` takes it out of the schedule, and a tick already under way finishes first
(the watch holds its lock while it ticks, and marks itself done under that lock before ``remove``), and
nothing removed is held on to (a done execution's database connection is released with it).
The thread is started on first use in each process (an executor forked from the forkserver starts its
own), and is a daemon: it holds nothing durable. A tick that raises is logged (``execution.watch_failed``,
the error's type only: a driver's message may quote the step's SQL) once per watched thing, and tried
again ``RETRY_S`` later.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import threading
import time
from typing import Protocol

import structlog

THREAD_NAME = "dataflow-execution-watch"
# A tick that raised is tried again this much later: one execution's failure (a closed connection, a
# cancel request that failed) never stops the thread that watches every other one.
RETRY_S = 0.1

_log = structlog.get_logger("dataflow.execution")


class Watched(Protocol):
    def tick(self, now: float) -> float | None:
        """Do what is due at ``now``; the next instant to be woken at (monotonic), or None: done."""


class Watcher:
    """The schedule of watched executions and the thread that serves it."""

    def __init__(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._schedule: list[tuple[float, int, Watched]] = []  # a heap of (instant, order, watched)
        self._watching: set[Watched] = set()  # what is watched, scheduled or being ticked
        self._failed: set[Watched] = set()  # watched things whose tick raised (logged once each)
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        # The instant the thread sleeps until (inf: until notified), None while it is not asleep (it reads
        # the schedule again before it sleeps): an add notifies only a thread that would wake too late.
        self._asleep_until: float | None = None

    def add(self, watched: Watched, at: float) -> None:
        """Watch ``watched`` from now on; it is first ticked at ``at`` (monotonic)."""
        with self._wake:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
                self._thread.start()
            self._watching.add(watched)
            heapq.heappush(self._schedule, (at, next(self._order), watched))
            if self._asleep_until is not None and at < self._asleep_until:
                self._wake.notify()  # otherwise the thread wakes (or looks) before it is due anyway

    def remove(self, watched: Watched) -> None:
        """Stop watching ``watched`` (O(watched executions): a handful). A tick under way is the watched
        one's to fence with its own lock."""
        with self._wake:
            self._watching.discard(watched)
            self._failed.discard(watched)
            kept = [entry for entry in self._schedule if entry[2] is not watched]
            if len(kept) != len(self._schedule):
                heapq.heapify(kept)
                self._schedule = kept

    def watched(self) -> int:
        """How many executions are watched now (tests)."""
        with self._wake:
            return len(self._watching)

    def _serve(self) -> None:
        while True:
            with self._wake:
                now = time.monotonic()
                while not self._schedule or self._schedule[0][0] > now:
                    self._asleep_until = self._schedule[0][0] if self._schedule else math.inf
                    # Capped: a wait past threading.TIMEOUT_MAX raises OverflowError (an infinite deadline).
                    timeout = None if not self._schedule else min(self._schedule[0][0] - now, threading.TIMEOUT_MAX)
                    self._wake.wait(timeout)
                    self._asleep_until = None
                    now = time.monotonic()
                due: list[Watched] = []
                while self._schedule and self._schedule[0][0] <= now:
                    due.append(heapq.heappop(self._schedule)[2])
            due.reverse()
            while due:  # outside the schedule's lock; popped, so nothing ended is held while the thread sleeps
                self._tick(due.pop())

    def _tick(self, watched: Watched) -> None:
        """Tick one watched thing, and schedule it again unless it is done or was removed meanwhile."""
        try:
            at = watched.tick(time.monotonic())
        except Exception as error:
            at = time.monotonic() + RETRY_S
            with self._wake:
                first = watched in self._watching and watched not in self._failed
                if first:
                    self._failed.add(watched)
            if first:
                _log.warning("execution.watch_failed", error=type(error).__name__, retry_s=RETRY_S)
        if at is None:
            return
        with self._wake:
            if watched in self._watching:  # not removed while it ticked: held no longer than that
                heapq.heappush(self._schedule, (at, next(self._order), watched))


_watcher: Watcher | None = None
_watcher_pid: int | None = None
_watcher_lock = threading.Lock()


def watcher() -> Watcher:
    """This process's watcher (a forked child gets its own: the parent's thread does not follow a fork)."""
    global _watcher, _watcher_pid
    with _watcher_lock:
        if _watcher is None or _watcher_pid != os.getpid():
            _watcher, _watcher_pid = Watcher(), os.getpid()
        return _watcher
