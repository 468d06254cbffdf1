"""Keep a lease alive while its attempt works, and notice at once when it is lost.

One daemon thread per :class:`Heartbeats` (one per run service) extends every registered lease
every ``ttl/3`` through a fenced heartbeat. An attempt registers for as long as it works
(:meth:`Heartbeats.keep_alive`); one that ends before its first beat is due (most runs, at the
default 30 s TTL) costs no heartbeat and no thread of its own. When a heartbeat is refused (the
lease expired, e.g. because the process was paused) that lease's beats stop and its ``lost`` is
set; the attempt's next fenced write would be refused anyway, ``lost`` only lets it stop early. A beat
the database could not take (an outage) is tried again next beat, silently: the worker's own guarded
statements report outages. Any other error of a beat is a bug: it is logged once per lease
(``heartbeat.failed``, the error's type), and the lease's beats go on.
"""

from __future__ import annotations

import heapq
import threading
import time
from types import TracebackType

import structlog

from durable_dataflow.core import fencing, leases
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import DataflowError, StaleAttempt

HEARTBEATS_PER_TTL = 3

_log = structlog.get_logger("dataflow.service")


class KeepAlive:
    """Context manager: the lease ``(module, subject, attempt)`` is heartbeaten until exit or until lost."""

    def __init__(self, beats: Heartbeats, module: str, subject_id: str, attempt: int, ttl_s: float) -> None:
        self._beats = beats
        self.key = (module, subject_id, attempt)
        self.ttl_s = ttl_s
        self.lost = threading.Event()
        self.ended = False  # set under the scheduler's lock on exit: no beat is taken after it
        self.failed = False  # a beat raised an unexpected error (logged once): only the heartbeat thread sets it

    def __enter__(self) -> KeepAlive:
        self._beats.register(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._beats.unregister(self)


class Heartbeats:
    """The heartbeat thread of one service: started on the first registration, runs until :meth:`close`."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, KeepAlive]] = []  # heap of (monotonic due time, tie-break, lease)
        self._counter = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def keep_alive(self, module: str, subject_id: str, attempt: int, ttl_s: float) -> KeepAlive:
        return KeepAlive(self, module, subject_id, attempt, ttl_s)

    def register(self, alive: KeepAlive) -> None:
        """Schedule ``alive``'s first beat; the thread is woken only when that beat is now the earliest (it
        waits for the earliest beat, or for any): a lease registered behind an earlier one, as every run's
        lease is behind its predecessors' of the same TTL, costs the thread no wake-up."""
        with self._cond:
            self._schedule(alive)
            if self._thread is None or not self._thread.is_alive():
                self._closed = False
                self._thread = threading.Thread(target=self._loop, name="heartbeats", daemon=True)
                self._thread.start()
            if self._due[0][2] is alive:
                self._cond.notify()

    def unregister(self, alive: KeepAlive) -> None:
        with self._cond:  # a beat in progress holds no lock: it may still finish, and is harmless
            alive.ended = True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _schedule(self, alive: KeepAlive) -> None:
        self._counter += 1
        heapq.heappush(self._due, (time.monotonic() + alive.ttl_s / HEARTBEATS_PER_TTL, self._counter, alive))

    def _next_due(self) -> KeepAlive | None:
        """Wait for the next lease whose beat is due; None once closed. Ended leases are dropped."""
        with self._cond:
            while not self._closed:
                while self._due and self._due[0][2].ended:
                    heapq.heappop(self._due)
                if not self._due:
                    self._cond.wait()
                    continue
                wait_s = self._due[0][0] - time.monotonic()
                if wait_s <= 0:
                    return heapq.heappop(self._due)[2]
                self._cond.wait(wait_s)
            return None

    def _loop(self) -> None:  # runs until closed
        while (alive := self._next_due()) is not None:
            module, subject_id, attempt = alive.key
            try:
                with fencing.fenced(self._db, module, subject_id, attempt) as conn:
                    leases.heartbeat(conn, self._db, module, subject_id, attempt, alive.ttl_s)
            except StaleAttempt:
                alive.lost.set()
                continue
            except DataflowError:
                pass  # the database is briefly unavailable: try again next beat; expiry decides
            except Exception as error:  # one lease's unexpected error must not stop every lease's beats
                if not alive.failed:  # as an outage: the next beat tries again, and expiry decides if none succeeds
                    alive.failed = True
                    _log.error(
                        "heartbeat.failed", module=module, subject_id=subject_id, attempt=attempt,
                        error=type(error).__name__, note="the lease's beats go on; it expires if none succeeds",
                    )  # fmt: skip
            with self._cond:
                if not alive.ended:
                    self._schedule(alive)
