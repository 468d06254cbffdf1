"""Keep a lease alive while its attempt works, and notice at once when it is lost.

A daemon thread extends the lease every ``ttl/3`` through a fenced heartbeat. When the heartbeat is
refused (the lease expired, e.g. because the process was paused) it stops and sets ``lost``; the
attempt's next fenced write would be refused anyway, ``lost`` only lets it stop early.
"""

from __future__ import annotations

import threading
from types import TracebackType

from durable_dataflow.core import fencing, leases
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import DataflowError, StaleAttempt

HEARTBEATS_PER_TTL = 3


class KeepAlive:
    """Context manager: heartbeats ``(module, subject, attempt)`` until exit or until the lease is lost."""

    def __init__(self, db: Database, module: str, subject_id: str, attempt: int, ttl_s: float) -> None:
        self._db = db
        self._key = (module, subject_id, attempt)
        self._ttl_s = ttl_s
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{subject_id}", daemon=True)

    def __enter__(self) -> KeepAlive:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:  # runs until the attempt ends or its lease is lost
        module, subject_id, attempt = self._key
        while not self._stop.wait(self._ttl_s / HEARTBEATS_PER_TTL):
            try:
                with fencing.fenced(self._db, module, subject_id, attempt) as conn:
                    leases.heartbeat(conn, self._db, module, subject_id, attempt, self._ttl_s)
            except StaleAttempt:
                self.lost.set()
                return
            except DataflowError:
                continue  # the database is briefly unavailable: try again next beat; expiry decides
