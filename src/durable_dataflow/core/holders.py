"""Holder liveness on PostgreSQL: a dead process's leases are recovered at once, whatever the TTL.

Every process that takes leases (a worker, ``dataflow run``, ``dataflow reconcile``, the server)
holds a session-level advisory lock on its holder id, on a connection of its own, for as long as it
lives (:class:`HolderLock`, taken before its first lease and checked again before later ones).
PostgreSQL ends a dead process's session, and with it the lock, so a sweeper that can take the lock
knows the holder is gone (``core.leases.list_dead_holders`` / ``close_dead_holder``): the lease is
closed exactly as an expired one is, and the same decision follows.

A paused or partitioned process keeps its session, its lock and its lease: the database clock and
the TTL decide for it, as before. A server restart ends every session, live processes' included, so
a lease counts as its holder's only when it was granted after the server started
(``pg_postmaster_start_time()``, ``core.leases``); older leases wait for their TTL. On SQLite (one machine, the
embedded default) there is no such signal: the TTL decides (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import threading
import time

import sqlalchemy as sa
import structlog
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from durable_dataflow.core.db import Database
from durable_dataflow.core.leases import holder_key

CHECK_INTERVAL_S = 1.0  # how often, at most, a held lock's session is checked before a new lease
_log = structlog.get_logger("core.holders")


class HolderLock:
    """The process's session-level advisory lock on ``holder`` (PostgreSQL; a no-op on SQLite)."""

    def __init__(self, db: Database, holder: str) -> None:
        self._db = db
        self._holder = holder
        self._engine: Engine | None = None
        self._conn: Connection | None = None
        self._checked_at = 0.0
        self._lock = threading.Lock()
        self.held = False  # False on SQLite, or when another session holds the same holder id

    def ensure(self) -> None:
        """Hold the lock before a lease is taken: take it, or take it again after its session was lost
        (a server restart). Never raises: without the lock the TTL decides, which is always safe."""
        if self._db.dialect != "postgresql":
            return
        with self._lock:
            now = time.monotonic()
            if self._conn is not None and now - self._checked_at < CHECK_INTERVAL_S:
                return
            self._checked_at = now
            try:
                if self._conn is not None:
                    self._conn.execute(sa.text("SELECT 1"))
                    return
                self._take()
            except Exception as error:  # the server is down: the lease transaction will say so
                self._drop()
                _log.warning("holder_lock.unavailable", holder=self._holder, error_type=type(error).__name__)

    def _take(self) -> None:
        if self._engine is None:
            self._engine = sa.create_engine(self._db.engine.url, poolclass=NullPool)
        conn = self._engine.connect()
        try:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.execute(sa.text("SET idle_session_timeout = 0"))  # an idle lock session must not be ended
            self.held = bool(conn.execute(sa.select(sa.func.pg_try_advisory_lock(holder_key(self._holder)))).scalar())
        except BaseException:
            with contextlib.suppress(Exception):  # already broken
                conn.close()
            raise
        if not self.held:
            _log.warning("holder_lock.taken_elsewhere", holder=self._holder, note="the lease TTL decides")
        self._conn = conn

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # already broken
                self._conn.close()
        self._conn = None
        self.held = False

    def close(self) -> None:
        """Release the lock (closing its session) and dispose of its engine."""
        with self._lock:
            self._drop()
            if self._engine is not None:
                self._engine.dispose()
                self._engine = None
