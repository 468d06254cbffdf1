"""Benchmark 1: transactions per run on PostgreSQL, against the DESIGN §10 commit budget.

Three counts per scenario, each the median of the rounds:

- ``xact_commit`` / ``xact_rollback``: deltas of ``pg_stat_database`` for the platform database —
  every transaction the server counted, read-only ones included (``Database.read()`` runs each
  statement on its own on PostgreSQL, which the server counts as one committed transaction; a pool
  pre-ping, were it configured, would count as one too);
- ``write_transactions``: COMMIT records written to the WAL between two LSNs (``pg_walinspect``).
  Only a transaction that wrote something writes a commit record, so this is exactly the number of
  committed write transactions — the number the budget is about.

Statistics are flushed by a backend when it exits, so each round closes the platform's pooled connections and
waits until no backend is connected before reading; the counters are read from the ``postgres``
database, so the reading is not counted. A warm-up checkout (subtracted as the ``baseline``
scenario) makes every checkout in the measured operation a pooled one, as in a long-lived worker.
Where each transaction comes from is recorded with SQLAlchemy events and the calling function.
"""

from __future__ import annotations

import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import BenchContext, db_name, make_request, print_table, summary, wait_backends_gone, write_result
from sqlalchemy import event

NAME = "commits"
# DESIGN §10: record+claim and terminal for an inline atomic run; one more (pre-dispatch) for forward;
# one more when queued (record, then the worker's claim); a replay writes nothing.
BUDGET = {
    "atomic_inline": 2,
    "forward_inline": 3,
    "atomic_queued": 3,
    "forward_queued": 4,
    "replay_existing_key": 0,
    "baseline": 0,
}
FRAMES_SHOWN = 3


def _wal_lsn(ctx: BenchContext) -> str:
    with ctx.server.connect("postgres") as conn:
        row = conn.execute("select pg_current_wal_flush_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def _wal_commits(ctx: BenchContext, start: str, end: str) -> int:
    """COMMIT records between two flush LSNs (a synchronous commit is flushed before it returns)."""
    if start == end:
        return 0
    with ctx.server.connect("postgres") as conn:
        row = conn.execute(
            "select count(*) from pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn) "
            "where resource_manager = 'Transaction' and record_type like 'COMMIT%%'",
            (start, end),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _stats(ctx: BenchContext, dbname: str) -> tuple[int, int]:
    with ctx.server.connect("postgres") as conn:
        row = conn.execute(
            "select xact_commit, xact_rollback from pg_stat_database where datname = %s", (dbname,)
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _caller() -> str:
    stack = traceback.extract_stack()
    frames = [f for f in stack if "durable_dataflow" in f.filename and "/core/db.py" not in f.filename]
    return " < ".join(f"{Path(f.filename).stem}.{f.name}" for f in reversed(frames[-FRAMES_SHOWN:])) or "?"


class Attribution:
    """Which function opened each transaction, from SQLAlchemy's engine and pool events."""

    def __init__(self, engine: Any) -> None:
        self.events: list[tuple[str, str]] = []
        self._fresh = False
        event.listen(engine, "commit", lambda conn: self.events.append(("commit", _caller())))
        event.listen(engine, "rollback", lambda conn: self.events.append(("rollback (read-only)", _caller())))
        event.listen(engine.pool, "connect", self._on_connect)
        self._pool = engine.pool
        event.listen(engine.pool, "checkout", self._on_checkout)

    def _on_connect(self, *_: Any) -> None:
        self._fresh = True

    def _on_checkout(self, *_: Any) -> None:
        if self._fresh:  # a new connection is not pinged
            self._fresh = False
            return
        if getattr(self._pool, "_pre_ping", False):  # core/db.py no longer pings: kept to show it if it did
            self.events.append(("pre-ping (implicit commit)", _caller()))

    def clear(self) -> None:
        self.events.clear()


def _close_connections(db: Any) -> None:
    """Close every pooled connection, so their backends exit and flush their statistics, keeping the
    Database usable (``Database.dispose`` ends it: a later use is an invariant violation)."""
    db.engine.dispose()
    if db.read_engine is not db.engine:
        db.read_engine.dispose()


def _measure(
    ctx: BenchContext, platform: Any, dbname: str, op: Callable[[], Any], attribution: Attribution
) -> dict[str, Any]:
    _close_connections(platform.db)
    wait_backends_gone(ctx.server, dbname)
    with platform.db.engine.connect():  # warm-up checkout: the operation's checkouts are pooled ones
        pass
    commits0, rollbacks0 = _stats(ctx, dbname)
    lsn0 = _wal_lsn(ctx)
    attribution.clear()
    op()
    events = list(attribution.events)
    _close_connections(platform.db)
    wait_backends_gone(ctx.server, dbname)
    lsn1 = _wal_lsn(ctx)
    commits1, rollbacks1 = _stats(ctx, dbname)
    return {
        "xact_commit": commits1 - commits0,
        "xact_rollback": rollbacks1 - rollbacks0,
        "write_transactions": _wal_commits(ctx, lsn0, lsn1),
        "events": events,
    }


Scenario = tuple[Callable[[int], None], Callable[[int], Callable[[], Any]]]


def _scenarios(platform: Any, base: Path) -> dict[str, Scenario]:
    """name -> (setup for round i, operation for round i)."""
    runs = platform.runs

    def nothing(i: int) -> None:
        return None

    def inline(forward: bool) -> Callable[[int], Callable[[], Any]]:
        return lambda i: lambda: runs.run_inline(make_request(base, forward=forward, key=f"in-{forward}-{i}"))

    def queued(forward: bool) -> Callable[[int], Callable[[], Any]]:
        def op(i: int) -> Callable[[], Any]:
            def go() -> Any:
                runs.submit(make_request(base, forward=forward, key=f"q-{forward}-{i}"))
                claim = runs.claim_next()
                assert claim is not None
                return runs.execute(claim)

            return go

        return op

    def replay_setup(i: int) -> None:
        runs.run_inline(make_request(base, key=f"replay-{i}"))

    def replay(i: int) -> Callable[[], Any]:
        return lambda: runs.submit(make_request(base, key=f"replay-{i}"))

    def baseline(i: int) -> Callable[[], Any]:
        return lambda: None

    return {
        "baseline": (nothing, baseline),
        "atomic_inline": (nothing, inline(False)),
        "forward_inline": (nothing, inline(True)),
        "atomic_queued": (nothing, queued(False)),
        "forward_queued": (nothing, queued(True)),
        "replay_existing_key": (replay_setup, replay),
    }


def run(ctx: BenchContext) -> dict[str, Any]:
    from durable_dataflow.platform import Platform

    url = ctx.new_database("bench_commits")
    dbname = db_name(url)
    with ctx.server.connect("postgres") as conn:
        conn.execute("create extension if not exists pg_walinspect")
    base = Path(tempfile.mkdtemp(prefix="bench-commits-", dir=ctx.workdir))
    platform = Platform(url)
    attribution = Attribution(platform.db.engine)
    results: dict[str, Any] = {}
    try:
        for name, (setup, make_op) in _scenarios(platform, base).items():
            rounds = []
            for i in range(ctx.rounds):
                setup(i)
                rounds.append(_measure(ctx, platform, dbname, make_op(i), attribution))
            results[name] = rounds
    finally:
        platform.close()
    return _report(ctx, results)


def _report(ctx: BenchContext, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = results["baseline"]
    base_commit = summary([r["xact_commit"] for r in base])["median"]
    base_rollback = summary([r["xact_rollback"] for r in base])["median"]
    scenarios: dict[str, Any] = {}
    rows = []
    for name, rounds in results.items():
        writes = summary([r["write_transactions"] for r in rounds])
        commits = summary([r["xact_commit"] - base_commit for r in rounds])
        rollbacks = summary([r["xact_rollback"] - base_rollback for r in rounds])
        attributed = Counter(f"{kind}: {where}" for kind, where in rounds[-1]["events"])
        met = writes["median"] <= BUDGET[name]
        scenarios[name] = {
            "budget_write_transactions": BUDGET[name],
            "write_transactions": writes,
            "transactions_committed": commits,
            "transactions_rolled_back": rollbacks,
            "raw_rounds": [{k: v for k, v in r.items() if k != "events"} for r in rounds],
            "attribution_last_round": dict(attributed),
            "target_met": met,
        }
        rows.append((name, BUDGET[name], writes["median"], commits["median"], rollbacks["median"], met))
    print_table(
        "Transactions per run (PostgreSQL; medians of rounds)",
        ["scenario", "budget (writes)", "write txns (WAL commits)", "xact_commit", "xact_rollback", "target"],
        rows,
    )
    for name in ("atomic_inline", "forward_inline", "atomic_queued"):
        print(f"  where the transactions of {name} come from:")
        for line, count in scenarios[name]["attribution_last_round"].items():
            print(f"    {count} x {line}")
    payload = {
        "rounds": ctx.rounds,
        "definitions": {
            "write_transactions": "COMMIT records in the WAL (pg_walinspect): committed transactions that wrote",
            "transactions_committed": "pg_stat_database.xact_commit delta minus the baseline (connect only): "
            "every committed transaction incl. read-only statements (autocommit reads)",
            "transactions_rolled_back": "pg_stat_database.xact_rollback delta minus the baseline: transactions "
            "that end in ROLLBACK (on PostgreSQL, Database.read() runs each statement on its own instead)",
        },
        "scenarios": scenarios,
    }
    write_result(NAME, payload, ctx.server, ctx.quick)
    return payload
