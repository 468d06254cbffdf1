"""Shared machinery of the benchmarks: the throwaway server, the trivial dataflow, statistics, output.

Every benchmark module exposes ``run(ctx: BenchContext) -> dict`` and is driven by ``run.py``.
Results are written to ``benchmarks/results/<name>.json`` with the machine, the versions, the
rounds, medians, p95 and ratios, and printed as a Rich table.
"""

from __future__ import annotations

import json
import os
import platform as pyplatform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
# tests/support/pg.py starts the throwaway PostgreSQL server; reuse it rather than copy it.
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from support.pg import PostgresServer, find_bindir, reap_orphans  # noqa: E402

console = Console(width=150)

ROUNDS_MIN = 5  # every figure is the median of at least this many rounds
QUICK_ROUNDS = 2  # --quick is a smoke run: it proves the benchmarks work, its figures are not reported
INLINE_ROWS = 1_000  # the trivial dataflow's inline source
GROUPS = 10  # distinct GROUP BY keys in it
PACKAGES = ("durable-dataflow", "dbos", "sqlalchemy", "psycopg", "duckdb", "pyarrow")


class BenchServer(PostgresServer):
    """The test suite's throwaway cluster, with autovacuum off so no background transaction
    lands in a commit count, and every statement logged with its backend pid for attribution.

    The test cluster runs with ``fsync=off`` (``tests/support/pg.py``: tests need no durability);
    here fsync is a setting of the benchmark (:meth:`set_fsync`), off unless a benchmark turns it
    on, so each figure can say which it was measured with. ``fsync=on`` is PostgreSQL's default
    (with ``synchronous_commit=on``): every commit waits for its WAL flush to the disk."""

    fsync = False

    def _options(self) -> str:
        return (
            super()._options()
            + " -c autovacuum=off -c log_line_prefix='%m [%p] ' -c track_counts=on"
            + " -c shared_buffers=256MB -c max_wal_size=4GB"
            + f" -c fsync={'on' if self.fsync else 'off'}"  # the last -c wins over the test cluster's
        )

    def set_fsync(self, on: bool) -> None:
        """Restart the server with fsync on or off (a command-line setting: a reload cannot change it)."""
        if on == self.fsync:
            return
        self.fsync = on
        self.restart("fast")

    def fsync_setting(self) -> str:
        """``fsync`` as the running server reports it."""
        with self.connect("postgres") as conn:
            row = conn.execute("show fsync").fetchone()
        return str(row[0]) if row else "unknown"


@contextmanager
def bench_server(*, fsync: bool = False) -> Iterator[BenchServer]:
    reap_orphans(find_bindir())
    server = BenchServer.launch()
    assert isinstance(server, BenchServer)
    try:
        server.set_fsync(fsync)
        yield server
    finally:
        server.destroy()


@dataclass
class BenchContext:
    server: BenchServer
    quick: bool
    workdir: Path
    _db_counter: list[int] = field(default_factory=lambda: [0])

    @property
    def rounds(self) -> int:
        return QUICK_ROUNDS if self.quick else ROUNDS_MIN

    def new_database(self, prefix: str) -> str:
        """A fresh database on the shared server, as a plain ``postgresql://`` URL."""
        self._db_counter[0] += 1
        name = f"{prefix}_{os.getpid()}_{self._db_counter[0]}"
        self.server.create_database(name)
        return self.server.url(name)


def db_name(url: str) -> str:
    return url.rsplit("/", 1)[1]


# ---- statistics ----------------------------------------------------------------------------------


def p95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = max(0, min(len(ordered) - 1, round(0.95 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "median": statistics.median(values) if values else float("nan"),
        "p95": p95(values),
        "min": min(values) if values else float("nan"),
        "max": max(values) if values else float("nan"),
    }


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- the trivial dataflow ------------------------------------------------------------------------

GROUP_SQL = "select k, sum(v)::BIGINT as total, count(*)::BIGINT as n from items group by k order by k"


def inline_rows() -> list[dict[str, int]]:
    return [{"k": i % GROUPS, "v": i} for i in range(INLINE_ROWS)]


def trivial_definition_text(*, forward: bool = False, name: str = "bench_trivial") -> str:
    """A 1,000-row inline source and one GROUP BY; with ``forward`` it publishes to parquet."""
    doc: dict[str, Any] = {
        "name": name,
        "version": 1,
        "parameters": {"tag": {"type": "string"}},
        "sources": {"items": {"kind": "inline", "schema": {"k": "int64", "v": "int64"}, "rows": inline_rows()}},
        "steps": [{"name": "grouped", "sql": GROUP_SQL}],
        "output": {"schema": {"k": "int64", "total": "int64", "n": "int64"}, "max_rows": 1000, "max_bytes": "1MiB"},
    }
    if forward:
        doc["target"] = {
            "type": "datasources.publication",
            "provider": "parquet",
            "datasource": "bench.grouped",
            "location": "warehouse/grouped",
            "mode": "append",
        }
    return json.dumps(doc)


def make_request(base_dir: Path, *, forward: bool = False, key: str | None = None, tag: str = "x") -> Any:
    """A RunRequest for the trivial dataflow (``tag`` varies the request hash)."""
    from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest

    return RunRequest(
        definition=_definition_cache(forward),
        base_dir=base_dir,
        parameters={"tag": tag},
        access=AccessContext(tenant="bench", principal="bench", roles=("operator",)),
        provenance=Provenance(actor="bench", trigger="api", host="bench"),
        idempotency_key=key,
    )


_DEFINITIONS: dict[bool, Any] = {}


def _definition_cache(forward: bool) -> Any:
    from durable_dataflow.dataflow.definitions.definitions import parse_definition

    if forward not in _DEFINITIONS:
        _DEFINITIONS[forward] = parse_definition(trivial_definition_text(forward=forward), "<bench>")
    return _DEFINITIONS[forward]


def duckdb_group_by_on_shared(rows_table: Any) -> Any:
    """The peer's step: the same query on a cursor of one shared in-process DuckDB database."""
    import duckdb

    global _PEER_DUCKDB
    if _PEER_DUCKDB is None:
        _PEER_DUCKDB = duckdb.connect(":memory:")
    cursor = _PEER_DUCKDB.cursor()
    try:
        cursor.register("items", rows_table)
        return cursor.sql(GROUP_SQL).to_arrow_table()
    finally:
        cursor.close()


_PEER_DUCKDB: Any = None


# ---- PostgreSQL counters -------------------------------------------------------------------------


@dataclass(frozen=True)
class TxCounters:
    commits: int
    rollbacks: int
    next_xid: int  # the next transaction id to be assigned: its delta counts write transactions


def read_counters(server: PostgresServer, dbname: str) -> TxCounters:
    """Counters of dbname, read from the admin database so the reading itself is not counted there.

    ``pg_snapshot_xmax(pg_current_snapshot())`` reads the next xid without assigning one; a
    transaction gets an xid only when it writes, so its delta is the number of write transactions
    (cluster-wide: the benchmark runs nothing else meanwhile and autovacuum is off).
    """
    with server.connect("postgres") as conn:
        conn.execute("select pg_stat_clear_snapshot()")
        row = conn.execute(
            "select xact_commit, xact_rollback, pg_snapshot_xmax(pg_current_snapshot())::text::bigint "
            "from pg_stat_database where datname = %s",
            (dbname,),
        ).fetchone()
    assert row is not None
    return TxCounters(int(row[0]), int(row[1]), int(row[2]))


def wait_backends_gone(server: PostgresServer, dbname: str, timeout_s: float = 10.0) -> None:
    """Backends flush their statistics when they exit: wait until none is connected to dbname, but for
    the process's holder-lock session (``core/holders.py``), which lives as long as the process: it
    runs no transaction of the measured operation (at most a ``SELECT 1`` a second before a lease)."""
    deadline = time.monotonic() + timeout_s
    query = (
        "select count(*) from pg_stat_activity where datname = %s and pid not in "
        "(select pid from pg_locks where locktype = 'advisory' and granted)"
    )
    with server.connect("postgres") as conn:
        while time.monotonic() < deadline:
            row = conn.execute(query, (dbname,)).fetchone()
            if row is not None and int(row[0]) == 0:
                return
            time.sleep(0.02)
    raise TimeoutError(f"backends of {dbname} did not exit within {timeout_s}s")


# ---- output --------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem_gib = round(mem_kb / 1024 / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "os": pyplatform.platform(),
        "python": sys.version.split()[0],
    }


def versions(server: PostgresServer | None = None) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    if server is not None:
        with server.connect("postgres") as conn:
            row = conn.execute("show server_version").fetchone()
            found["postgresql"] = str(row[0]) if row else "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        found["git_commit"] = commit.stdout.strip() or "unknown"
    except OSError:
        found["git_commit"] = "unknown"
    return found


def write_result(name: str, payload: Mapping[str, Any], server: PostgresServer | None, quick: bool) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / (f"{name}.quick.json" if quick else f"{name}.json")
    document = {
        "benchmark": name,
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": quick,
        "machine": machine_info(),
        "versions": versions(server),
        **payload,
    }
    path.write_text(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")
    return path


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*[fmt(v) for v in row])
    console.print(table)


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, bool):
        return "met" if value else "NOT MET"
    return str(value)
