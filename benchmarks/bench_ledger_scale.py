"""Benchmark 6: the history page and the Ops projection with 1,000,000 runs in PostgreSQL.

The runs are bulk-loaded, not submitted: going through the service would take hours. One
``INSERT … SELECT generate_series`` per table writes the projection rows (``dataflow_runs``), three
ledger entries per run (run.recorded, attempt.started, a terminal entry) and a released lease per
run, with a realistic mix of tenants, definitions and statuses; then ``ANALYZE``. The ledger
entries' hashes are placeholders: nothing here verifies chains, the queries only read columns.

Measured (p50/p95 over repetitions, each in its own read transaction as the API does):
``runs.list_page`` (50 runs) unfiltered and filtered by tenant+status, first page and a deep cursor
page, and ``ops.ledger.projection`` for all tenants and for one. A query over its target is
EXPLAIN ANALYZEd into the JSON.
"""

from __future__ import annotations

import time
from typing import Any

from common import BenchContext, print_table, summary, write_result

NAME = "ledger_scale"
RUNS = {False: 1_000_000, True: 20_000}
PAGE_REPS = {False: 50, True: 20}
PROJECTION_REPS = {False: 10, True: 5}
PAGE_P95_TARGET_S = 0.050
PROJECTION_P95_TARGET_S = 0.200
TENANTS = 10
DEFINITION_NAMES = 20
BASE_US = 1_750_000_000_000_000

# status by run number: mostly succeeded, some failed, queued, running and unresolved.
STATUS_SQL = """case when i % 100 < 90 then 'succeeded' when i % 100 < 95 then 'failed'
  when i % 100 < 98 then 'queued' when i % 100 < 99 then 'running' else 'outcome_unknown' end"""
RECOVERY_SQL = """case when i % 100 < 90 then 'verified' when i % 100 < 95 then 'no_external_output'
  when i % 100 < 98 then 'recorded' when i % 100 < 99 then 'leased' else 'outcome_unknown' end"""

LOAD_RUNS = f"""
insert into dataflow_runs (run_id, tenant, idempotency_key, definition_hash, definition_name, request_hash, mode,
  status, recovery_status, attempt, max_attempts, parameters_json, provenance_json, principal,
  access_context_digest, target_json, base_dir, row_count, output_digest, created_at_us, updated_at_us)
select lpad(to_hex(i), 8, '0') || '-0000-7000-8000-' || lpad(to_hex(i), 12, '0'),
  't' || (i % {TENANTS}), 'key-' || i, 'sha256:' || md5((i % {DEFINITION_NAMES})::text),
  'dataflow_' || (i % {DEFINITION_NAMES}), 'sha256:' || md5(i::text), 'atomic',
  {STATUS_SQL}, {RECOVERY_SQL}, 1, 3, '{{"day":"2026-11-02"}}',
  '{{"actor":"bench","trigger":"api"}}', 'bench', 'sha256:00', null, '/tmp', 10, 'sha256:' || md5(i::text),
  {BASE_US} + i * 1000, {BASE_US} + i * 1000 + 500
from generate_series(1, {{n}}) as i
"""
LOAD_LEDGER = """
insert into ledger_entries (module, subject_id, seq, attempt, kind, payload_json, prev_hash, entry_hash, recorded_at_us)
select 'dataflow', r.run_id, s.seq, case when s.seq = 1 then 0 else 1 end,
  case s.seq when 1 then 'run.recorded' when 2 then 'attempt.started'
    else case r.status when 'failed' then 'run.failed' else 'run.succeeded' end end,
  '{}', 'sha256:prev', 'sha256:' || md5(r.run_id || s.seq), r.created_at_us + s.seq
from dataflow_runs r cross join generate_series(1, 3) as s(seq)
"""
LOAD_LEASES = """
insert into leases (module, subject_id, attempt, holder, acquired_at_us, expires_at_us, released_at_us)
select 'dataflow', run_id, 1, 'bench', created_at_us, created_at_us + 30000000,
  case when status in ('running', 'outcome_unknown') then null else updated_at_us end
from dataflow_runs where status <> 'queued'
"""


def _load(ctx: BenchContext, dbname: str, n: int) -> dict[str, float]:
    timings = {}
    with ctx.server.connect(dbname) as conn:
        for name, sql, params in (
            ("runs", LOAD_RUNS.replace("{n}", str(int(n))), None),
            ("ledger_entries", LOAD_LEDGER, None),
            ("leases", LOAD_LEASES, None),
        ):
            began = time.perf_counter()
            conn.execute(sql, params)
            timings[name] = time.perf_counter() - began
        began = time.perf_counter()
        conn.execute("vacuum analyze")
        timings["vacuum_analyze"] = time.perf_counter() - began
    return timings


def _time_reads(db: Any, fn: Any, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        began = time.perf_counter()
        with db.read() as conn:
            fn(conn)
        samples.append(time.perf_counter() - began)
    return samples


def _explain(db: Any, fn: Any) -> list[str]:
    """EXPLAIN ANALYZE every statement fn runs, captured with a cursor event."""
    from sqlalchemy import event

    statements: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if not statement.lstrip().upper().startswith("EXPLAIN"):
            statements.append((statement, parameters))

    event.listen(db.engine, "before_cursor_execute", capture)
    try:
        with db.read() as conn:
            fn(conn)
    finally:
        event.remove(db.engine, "before_cursor_execute", capture)
    plans = []
    with db.engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        for statement, parameters in statements:
            if "clock_timestamp" in statement and "FROM" not in statement.upper():
                continue
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, parameters)
            plans.append("\n".join(str(row[0]) for row in cursor.fetchall()))
        raw.rollback()
    return plans


def run(ctx: BenchContext) -> dict[str, Any]:
    from durable_dataflow.dataflow.protocol import runs
    from durable_dataflow.platform import Platform

    n = RUNS[ctx.quick]
    url = ctx.new_database("bench_scale")
    dbname = url.rsplit("/", 1)[1]
    Platform(url).close()
    load = _load(ctx, dbname, n)
    deep = (BASE_US + (n // 10) * 1000, "")  # a cursor 90% of the way down the history
    try:
        from durable_dataflow.ops import ledger as ops_ledger
    except ImportError:  # TODO(ops): measure the Ops projection once durable_dataflow.ops exists
        ops_ledger = None
    queries: dict[str, tuple[Any, float, int]] = {
        "page unfiltered, first": (lambda c: runs.list_page(c, limit=50), PAGE_P95_TARGET_S, PAGE_REPS[ctx.quick]),
        "page unfiltered, deep cursor": (
            lambda c: runs.list_page(c, before=deep, limit=50), PAGE_P95_TARGET_S, PAGE_REPS[ctx.quick]),
        "page tenant+status, first": (
            lambda c: runs.list_page(c, tenant="t3", status="failed", limit=50), PAGE_P95_TARGET_S,
            PAGE_REPS[ctx.quick]),
        "page tenant+status, deep cursor": (
            lambda c: runs.list_page(c, tenant="t3", status="failed", before=deep, limit=50), PAGE_P95_TARGET_S,
            PAGE_REPS[ctx.quick]),
        "page definition filter, first": (
            lambda c: runs.list_page(c, definition_name="dataflow_7", limit=50), PAGE_P95_TARGET_S,
            PAGE_REPS[ctx.quick]),
    }  # fmt: skip
    results: dict[str, Any] = {}
    rows = []
    with Platform(url, migrate=False) as platform:
        if ops_ledger is not None:
            queries["ops projection, all tenants"] = (
                lambda c: ops_ledger.projection(c, platform.db), PROJECTION_P95_TARGET_S, PROJECTION_REPS[ctx.quick])
            queries["ops projection, one tenant"] = (
                lambda c: ops_ledger.projection(c, platform.db, tenant="t3"), PROJECTION_P95_TARGET_S,
                PROJECTION_REPS[ctx.quick])  # fmt: skip
        for name, (fn, target, reps) in queries.items():
            _time_reads(platform.db, fn, 2)  # warm the cache
            stats = summary(_time_reads(platform.db, fn, reps))
            met = stats["p95"] < target
            entry: dict[str, Any] = {"seconds": stats, "target_p95_s": target, "target_met": met}
            if not met:
                entry["explain_analyze"] = _explain(platform.db, fn)
            results[name] = entry
            rows.append((name, stats["median"] * 1e3, stats["p95"] * 1e3, target * 1e3, met))
    print_table(
        f"History page and Ops projection with {n:,} runs (ms)",
        ["query", "p50", "p95", "target p95", "target"],
        rows,
    )
    payload = {
        "runs": n,
        "ledger_entries": 3 * n,
        "load_seconds": load,
        "load_method": "INSERT ... SELECT generate_series on the server (not through the service)",
        "ops_projection_measured": ops_ledger is not None,
        "queries": results,
    }
    write_result(NAME, payload, ctx.server, ctx.quick)
    return payload
