"""The fleet: one heartbeat row per worker process and per `dataflow serve` sweeper (issue 33).

This module alone reads and writes the ``workers`` table. Its statements:

- ``register``: prune rows gone longer than ``ROW_RETENTION_S``, then upsert the process's row (status
  running, beat now) — once, at start.
- ``beat``: one guarded ``UPDATE … WHERE holder = :holder`` (the beat time, in-flight attempts, whether the
  holder lock is held) — every ``beat_interval_s(ttl)`` on the process's own loop.
- ``mark_stopped``: the same UPDATE with status stopped — on a graceful stop.
- ``list_workers``: every row with its liveness decided on the database clock.

Liveness (:func:`state_of`): a stopped row is ``stopped``; a running row whose last beat is older than its
TTL is ``dead``. On PostgreSQL a running process holds its holder's advisory lock (core/holders.py) for its
whole life, and a dead one's session, with the lock, is ended by the server: a row whose holder held the lock
at a beat taken since the server started, and whose lock can now be taken, is ``dead`` at once, whatever
the TTL (the same test as ``core.leases``'s dead holders). On SQLite the TTL alone decides.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow import __version__
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.leases import holder_key
from durable_dataflow.dataflow.schema import workers

WORKER_TTL_ENV = "DATAFLOW_WORKER_TTL_S"
# A running row whose last beat is older than this is dead (on SQLite the only signal; on PostgreSQL the
# fallback when the holder lock tells nothing, e.g. right after a server restart).
WORKER_TTL_S_DEFAULT = 15.0
WORKER_TTL_S_MIN = 0.3
WORKER_TTL_S_MAX = 3600.0
BEATS_PER_TTL = 3  # as leases (core/heartbeat.py): two beats may be missed before the row reads dead
ROW_RETENTION_S = 7 * 86_400.0  # a row not beaten for a week (a dead or stopped process's) is pruned
WORKERS_SHOWN_MAX = 500  # rows one listing returns, newest start first
VERSION_CHARS_MAX = 64
HOST_CHARS_MAX = 255
_US = 1_000_000


class Role(enum.StrEnum):
    WORKER = "worker"  # `dataflow worker`: sweeps, claims and executes
    SWEEPER = "sweeper"  # `dataflow serve`'s embedded sweeper: sweeps only


class RowStatus(enum.StrEnum):
    RUNNING = "running"  # the process said it started and has not said it stopped
    STOPPED = "stopped"  # the process stopped gracefully (its in-flight attempts ended first)


class WorkerState(enum.StrEnum):
    ALIVE = "alive"  # beating within its TTL, and (PostgreSQL) its holder lock still held
    DEAD = "dead"  # no beat within its TTL, or (PostgreSQL) its holder lock released by the server
    STOPPED = "stopped"  # stopped gracefully


@dataclass(frozen=True)
class WorkerView:
    """One process's row as the CLI, the API and the Ops page show it."""

    holder: str
    role: str
    host: str
    pid: int
    version: str
    state: WorkerState
    started_at_us: int
    beat_at_us: int
    stopped_at_us: int | None
    last_beat_age_s: float
    inflight: int
    concurrency: int
    ttl_s: float

    def as_json(self) -> dict[str, Any]:
        return {
            "holder": self.holder, "role": self.role, "host": self.host, "pid": self.pid,
            "version": self.version, "state": str(self.state), "started_at_us": self.started_at_us,
            "last_beat_at_us": self.beat_at_us, "stopped_at_us": self.stopped_at_us,
            "last_beat_age_s": round(self.last_beat_age_s, 3), "inflight": self.inflight,
            "concurrency": self.concurrency, "ttl_s": self.ttl_s,
        }  # fmt: skip


def view_from_json(data: Mapping[str, Any]) -> WorkerView:
    """A row of ``document``'s ``workers`` (``GET /v1/workers``) as the view it was made from: the remote
    ``dataflow workers`` prints what the local one prints."""
    return WorkerView(
        holder=str(data["holder"]), role=str(data["role"]), host=str(data["host"]), pid=int(data["pid"]),
        version=str(data["version"]), state=WorkerState(data["state"]), started_at_us=int(data["started_at_us"]),
        beat_at_us=int(data["last_beat_at_us"]),
        stopped_at_us=None if data["stopped_at_us"] is None else int(data["stopped_at_us"]),
        last_beat_age_s=float(data["last_beat_age_s"]), inflight=int(data["inflight"]),
        concurrency=int(data["concurrency"]), ttl_s=float(data["ttl_s"]),
    )  # fmt: skip


def ttl_from_env(explicit: float | None = None) -> float:
    """The heartbeat TTL: explicit, else ``DATAFLOW_WORKER_TTL_S``, else WORKER_TTL_S_DEFAULT."""
    raw = explicit if explicit is not None else os.environ.get(WORKER_TTL_ENV) or WORKER_TTL_S_DEFAULT
    try:
        value = float(raw)
    except ValueError as error:
        raise InputError(f"{WORKER_TTL_ENV} must be a number of seconds, got {raw!r}") from error
    if not WORKER_TTL_S_MIN <= value <= WORKER_TTL_S_MAX:
        raise InputError(f"{WORKER_TTL_ENV} must be between {WORKER_TTL_S_MIN} and {WORKER_TTL_S_MAX} s, got {raw!r}")
    return value


def beat_interval_s(ttl_s: float) -> float:
    return ttl_s / BEATS_PER_TTL


def state_of(status: str, beat_age_s: float, ttl_s: float, lock_released: bool) -> WorkerState:
    """A row's liveness: ``lock_released`` is PostgreSQL's word that the process's session has ended."""
    if status == RowStatus.STOPPED:
        return WorkerState.STOPPED
    if lock_released or beat_age_s > ttl_s:
        return WorkerState.DEAD
    return WorkerState.ALIVE


def register(db: Database, *, holder: str, role: Role, concurrency: int, ttl_s: float, holder_locked: bool) -> None:
    """Prune old rows, then upsert this process's row as running with a beat now."""
    values = {
        "role": str(role), "host": os.uname().nodename[:HOST_CHARS_MAX], "pid": os.getpid(),
        "version": __version__[:VERSION_CHARS_MAX], "status": str(RowStatus.RUNNING), "stopped_at_us": None,
        "inflight": 0, "concurrency": concurrency, "ttl_us": int(ttl_s * _US), "holder_locked": holder_locked,
    }  # fmt: skip
    with db.begin() as conn:
        now_us = db.now_us(conn)
        conn.execute(workers.delete().where(workers.c.beat_at_us < now_us - int(ROW_RETENTION_S * _US)))
        updated = conn.execute(
            workers.update().where(workers.c.holder == holder).values(**values, started_at_us=now_us, beat_at_us=now_us)
        ).rowcount
        if not updated:
            conn.execute(workers.insert().values(holder=holder, **values, started_at_us=now_us, beat_at_us=now_us))


def beat(db: Database, holder: str, *, inflight: int, holder_locked: bool) -> bool:
    """One UPDATE: the beat time on the database clock. False when the row is gone (pruned, or a restored
    database): the caller registers again."""
    with db.begin() as conn:
        return bool(
            conn.execute(
                workers.update()
                .where(workers.c.holder == holder)
                .values(beat_at_us=db.now_us_expr(), inflight=inflight, holder_locked=holder_locked)
            ).rowcount
        )


def mark_stopped(db: Database, holder: str) -> None:
    """The graceful stop: the row reads ``stopped`` from now on (never ``dead``)."""
    with db.begin() as conn:
        now = db.now_us_expr()
        conn.execute(
            workers.update()
            .where(workers.c.holder == holder)
            .values(status=str(RowStatus.STOPPED), stopped_at_us=now, beat_at_us=now, inflight=0)
        )


def _lock_released(db: Database) -> sa.ColumnElement[bool]:
    """SQL: the row's process is gone by its holder lock (PostgreSQL; always false on SQLite). Only a lock
    held at a beat taken since the server started counts: a server restart ends live sessions too."""
    if db.dialect != "postgresql":
        return sa.false()
    started_us = sa.cast(sa.func.extract("epoch", sa.func.pg_postmaster_start_time()) * _US, sa.BigInteger)
    # CASE evaluates the lock attempt only for the rows that qualify; in an autocommit read the
    # transaction-level lock is released when the statement ends.
    return sa.case(
        (
            sa.and_(
                workers.c.status == str(RowStatus.RUNNING),
                workers.c.holder_locked,
                workers.c.beat_at_us > started_us + int(db.clock_offset_s * _US),
            ),
            sa.func.pg_try_advisory_xact_lock(holder_key(workers.c.holder)),
        ),
        else_=sa.false(),
    )


def list_workers(db: Database, limit: int = WORKERS_SHOWN_MAX) -> list[WorkerView]:
    """Every process's row (newest start first), its liveness decided on the database clock."""
    with db.read() as conn:
        return _list(conn, db, limit)


def _list(conn: Connection, db: Database, limit: int) -> list[WorkerView]:
    now_us = db.now_us(conn)
    rows = conn.execute(
        sa.select(workers, _lock_released(db).label("lock_released"))
        .order_by(workers.c.started_at_us.desc(), workers.c.holder)
        .limit(max(1, min(limit, WORKERS_SHOWN_MAX)))
    ).all()
    return [_view(row, now_us) for row in rows]


def document(found: list[WorkerView]) -> dict[str, Any]:
    """The one JSON document of the fleet (``dataflow workers --json``, ``GET /v1/workers``): the rows, and
    the count per state."""
    counts = {str(state): sum(1 for w in found if w.state == state) for state in WorkerState}
    return {"workers": [w.as_json() for w in found], **counts}


def _view(row: sa.Row[Any], now_us: int) -> WorkerView:
    age_s = max(0.0, (now_us - int(row.beat_at_us)) / _US)
    ttl_s = int(row.ttl_us) / _US
    return WorkerView(
        holder=row.holder, role=row.role, host=row.host, pid=int(row.pid), version=row.version,
        state=state_of(row.status, age_s, ttl_s, bool(row.lock_released)),
        started_at_us=int(row.started_at_us), beat_at_us=int(row.beat_at_us),
        stopped_at_us=None if row.stopped_at_us is None else int(row.stopped_at_us), last_beat_age_s=age_s,
        inflight=int(row.inflight), concurrency=int(row.concurrency), ttl_s=ttl_s,
    )  # fmt: skip


class Heartbeat:
    """One process's row, beaten from its own loop: :meth:`maybe_beat` is cheap to call every turn (it
    writes only when a beat is due). Beat failures are left to the caller's outage handling (they raise
    StorageUnavailable like any guarded statement)."""

    def __init__(self, db: Database, holder: str, role: Role, concurrency: int, ttl_s: float) -> None:
        self.db = db
        self.holder = holder
        self.role = role
        self.concurrency = concurrency
        self.ttl_s = ttl_s
        self.interval_s = beat_interval_s(ttl_s)
        self._registered = False
        self._last_beat_s: float | None = None

    def due_in_s(self, now_s: float) -> float:
        """Seconds until the next beat is due (0 when due now); waits are capped by it."""
        if self._last_beat_s is None:
            return 0.0
        return max(0.0, self._last_beat_s + self.interval_s - now_s)

    def maybe_beat(self, now_s: float, inflight: int, holder_locked: bool) -> None:
        if self.due_in_s(now_s) > 0:
            return
        if not self._registered or not beat(self.db, self.holder, inflight=inflight, holder_locked=holder_locked):
            register(
                self.db, holder=self.holder, role=self.role, concurrency=self.concurrency, ttl_s=self.ttl_s,
                holder_locked=holder_locked,
            )  # fmt: skip
            self._registered = True
        self._last_beat_s = now_s

    def stopped(self) -> None:
        if self._registered:
            mark_stopped(self.db, self.holder)
