"""Per-statement breakdown of a run's transactions, from SQLAlchemy's cursor events (docs/performance.md).

:class:`StatementLog` listens on an engine: every statement is attributed to the platform function
that issued it (the innermost ``durable_dataflow`` frame outside ``core/db.py``) and to the
transaction it ran in (named by the outermost platform frame that opened it). Each statement's time
is the driver's ``execute`` (``before_cursor_execute`` → ``after_cursor_execute``: the round trip
and the server's work; psycopg sends a transaction's ``BEGIN`` with its first statement). The
pool's pre-ping and the COMMIT / ROLLBACK are timed by wrapping the dialect's ``do_ping``,
``do_commit`` and ``do_rollback``. The rest of a transaction's wall time (begin → end) is Python:
building rows and hashes, verifying, SQLAlchemy's own work.

Counts do not depend on the machine's load; times do.
"""

from __future__ import annotations

import re
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from sqlalchemy import event

_SKIPPED_FILES = ("/core/db.py",)
# Transactions are named by the platform function that opened them; these wrap the opening.
_OPENERS_SKIPPED = ("/core/db.py", "/core/fencing.py")
# A transaction opened by one of these functions gets the readable name beside it.
TRANSACTION_NAMES = {
    "submit._replay": "replay lookup (read)",
    "submit.submit": "record (+ claim, inline)",
    "attempt.claim_next": "claim (queued)",
    "attempt.commit_atomic_success": "terminal",
    "heartbeat._loop": "heartbeat",
    "service.get": "read the run",
}


def _frames() -> list[tuple[str, str]]:
    """(file, function) of the platform's frames on this thread's stack, outermost first (cheap: no
    source lines are read, so the log adds little to the time it measures)."""
    found: list[tuple[str, str]] = []
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "durable_dataflow" in filename:
            found.append((filename, frame.f_code.co_name))
        frame = frame.f_back
    found.reverse()
    return found


def _name(frame: tuple[str, str]) -> str:
    return f"{Path(frame[0]).stem}.{frame[1]}"


def _statement_site() -> str:
    frames = [f for f in _frames() if not f[0].endswith(_SKIPPED_FILES)]
    return _name(frames[-1]) if frames else "?"


def _transaction_site() -> str:
    frames = [f for f in _frames() if not f[0].endswith(_OPENERS_SKIPPED)]
    for frame in reversed(frames):  # the innermost known opener names it
        if _name(frame) in TRANSACTION_NAMES:
            return TRANSACTION_NAMES[_name(frame)]
    return _name(frames[-1]) if frames else "?"


_TABLE = re.compile(r"\b(?:FROM|INTO|UPDATE|JOIN)\s+\"?([A-Za-z_][\w.]*)(?![\w(])", re.IGNORECASE)


def _verb(statement: str) -> str:
    """``SELECT leases``: the statement's verb and the first table it names."""
    words = statement.split(None, 1)
    verb = words[0].upper() if words else "?"
    match = _TABLE.search(statement)
    return f"{verb} {match.group(1).split('.')[-1]}" if match else verb


@dataclass
class Transaction:
    name: str
    started: float
    statements: list[tuple[str, float]] = field(default_factory=list)  # (label, seconds)
    ended: float | None = None


class StatementLog:
    """Records every statement, ping and commit of ``engine`` per transaction (thread-aware)."""

    def __init__(self, engine: Any) -> None:
        self.transactions: list[Transaction] = []
        self.outside: list[tuple[str, float]] = []  # pings: before any transaction
        self._local = threading.local()
        self._lock = threading.Lock()
        self.enabled = False
        event.listen(engine, "begin", self._on_begin)
        event.listen(engine, "before_cursor_execute", self._before)
        event.listen(engine, "after_cursor_execute", self._after)
        dialect = engine.dialect
        for name, label in (("do_ping", "pre-ping"), ("do_commit", "COMMIT"), ("do_rollback", "ROLLBACK")):
            setattr(dialect, name, self._timed(getattr(dialect, name), label, ends=name != "do_ping"))

    def _current(self) -> Transaction | None:
        return getattr(self._local, "tx", None)

    def _on_begin(self, conn: Any) -> None:
        if not self.enabled:
            return
        tx = Transaction(_transaction_site(), time.perf_counter())
        self._local.tx = tx
        with self._lock:
            self.transactions.append(tx)

    def _before(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self._local.began = time.perf_counter()

    def _after(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        tx = self._current()
        if not self.enabled or tx is None:
            return
        elapsed = time.perf_counter() - self._local.began
        tx.statements.append((f"{_statement_site()}: {_verb(statement)}", elapsed))

    def _timed(self, fn: Callable[..., Any], label: str, *, ends: bool) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                tx = self._current()
                if self.enabled and ends and tx is not None:
                    tx.statements.append((label, ended - began))
                    tx.ended = ended
                    self._local.tx = None
                elif self.enabled:
                    with self._lock:
                        self.outside.append((label, ended - began))

        return wrapper

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.transactions.clear()
        self.outside.clear()
        self.enabled = True
        try:
            yield
        finally:
            self.enabled = False


@dataclass(frozen=True)
class Row:
    transaction: str
    statement: str
    per_run: float  # statements per run
    ms_per_run: float  # total time per run, ms
    ms_each: float  # median time of one, ms


def breakdown(log: StatementLog, runs: int) -> list[Row]:
    """Per transaction (in first-seen order), each statement's count and time per run, then the
    transaction's Python time (wall time minus its statements) and its wall time."""
    by_tx: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    walls: dict[str, list[float]] = defaultdict(list)
    for tx in log.transactions:
        for label, seconds in tx.statements:
            by_tx[tx.name][label].append(seconds)
        if tx.ended is not None:
            walls[tx.name].append(tx.ended - tx.started)
    rows: list[Row] = []
    for tx_name, statements in by_tx.items():
        in_sql = 0.0
        for label, times in statements.items():
            rows.append(Row(tx_name, label, len(times) / runs, sum(times) / runs * 1e3, statistics.median(times) * 1e3))
            in_sql += sum(times)
        wall = sum(walls[tx_name])
        rows.append(Row(tx_name, "(Python between statements)", 0, (wall - in_sql) / runs * 1e3, 0))
        rows.append(Row(tx_name, "= transaction wall time", len(walls[tx_name]) / runs, wall / runs * 1e3, 0))
    for label in sorted({label for label, _ in log.outside}):
        times = [s for lab, s in log.outside if lab == label]
        rows.append(Row("(outside transactions)", label, len(times) / runs, sum(times) / runs * 1e3,
                        statistics.median(times) * 1e3))  # fmt: skip
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| transaction | statement (function: SQL) | per run | ms per run | ms each (median) |",
             "|---|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        count = f"{r.per_run:g}" if r.per_run else ""
        each = f"{r.ms_each:.3f}" if r.ms_each else ""
        lines.append(f"| {r.transaction} | {r.statement} | {count} | {r.ms_per_run:.3f} | {each} |")
    return "\n".join(lines)
