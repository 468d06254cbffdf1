"""One bench_tpch measurement in a fresh process, so its peak RSS is that measurement's alone.

    python benchmarks/tpch_child.py SPEC.json

SPEC names the kind (``platform``, ``bare``), what to run and where to write the result (JSON).
Only the standard library is imported at the top: each kind imports what it measures and nothing
else, so bare DuckDB's figure does not carry the platform's imports. The result is written to a
file rather than printed, because the platform may log to stdout.

- ``platform``: a Platform on a fresh SQLite file runs the definition with ``run_inline`` (what
  ``dataflow run`` does). Timed: ``run_inline`` alone; opening the platform (migrations) and
  parsing the definition are reported as ``setup_s``.
  With ``"spark": true`` the definition runs on the Spark engine: the process's Spark session is
  started before the clock (``session_start_s``), and the peak resident set of the JVM it launched
  (driver and, in ``local[N]``, the executors) is reported as ``jvm_rss_peak_kib``.
- ``bare``: a fresh in-memory DuckDB in the sandbox shape the platform is moving to (same memory
  limit, threads and spill folder; ``allowed_paths`` = exactly the source files, then
  ``enable_external_access = false`` and ``lock_configuration = true``; one view per table over
  ``read_parquet``), then the query to an Arrow table. Timed: from ``connect`` to the Arrow table.
  The result is written as Arrow IPC for the parent to check against the platform's digest.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def _rss_peak_kib() -> int:
    """This process's peak resident set so far, in KiB: ``VmHWM`` of /proc/self/status.

    Not ``ru_maxrss``: Linux carries the parent's peak over ``fork``/``vfork`` + ``exec`` into the
    child's ``ru_maxrss`` (measured here: a child of a 500 MiB parent reported 510 MiB against a
    VmHWM of 9 MiB), and ``RUSAGE_CHILDREN`` in the parent inherits the same error. VmHWM belongs
    to the address space that exec created, so it is this measurement's alone.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # elsewhere: the best there is


def _descendants(pid: int) -> list[int]:
    """Every live descendant of a process (from /proc/<pid>/task/*/children)."""
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids = [int(k) for k in children.read_text().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *_descendants(kid)]
    return found


def _jvm_rss_peak_kib() -> int:
    """The summed VmHWM of this process's descendants: the Spark JVM (driver and local executors)."""
    total = 0
    for pid in _descendants(os.getpid()):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def _limits(spec: dict[str, Any]) -> Any:
    """ExecutionLimits with the benchmark's memory, threads, time limit and spill folder."""
    from durable_dataflow.dataflow.execution.limits import ExecutionLimits

    return ExecutionLimits(
        threads=spec["threads"], time_limit_s=spec["time_limit_s"],
        memory_bytes_max=spec["memory_bytes"], temp_dir=Path(spec["temp_dir"]),
    )  # fmt: skip


def _ledger_timeline(platform: Any, run_id: str, started_us: int) -> list[list[Any]]:
    """The run's ledger entries as [kind, ms after run_inline began]: where the time went."""
    from durable_dataflow.core import ledger

    with platform.db.read() as conn:
        entries = ledger.read(conn, "dataflow", run_id)
    return [[entry.kind, round((entry.recorded_at_us - started_us) / 1e3, 3)] for entry in entries]


def measure_platform(spec: dict[str, Any]) -> dict[str, Any]:
    began = time.perf_counter()
    from durable_dataflow.dataflow.definitions.definitions import parse_definition
    from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
    from durable_dataflow.platform import Platform

    platform = Platform(spec["db_url"], limits=_limits(spec))
    request = RunRequest(
        definition=parse_definition(json.dumps(spec["definition"]), "<bench_tpch>"),
        base_dir=Path(spec["base_dir"]),
        parameters=spec.get("parameters", {}),
        access=AccessContext(tenant="bench", principal="bench", roles=("operator",)),
        provenance=Provenance(actor="bench", trigger="api", host="bench"),
        idempotency_key=spec["key"],
        max_attempts=1,  # a failure is reported as it is, not retried
    )
    setup_s = time.perf_counter() - began
    session_start_s = None
    if spec.get("spark"):
        from durable_dataflow.dataflow.execution import spark_engine

        session_began = time.perf_counter()
        spark_engine.session()
        session_start_s = time.perf_counter() - session_began
    rss_before_kib = _rss_peak_kib()
    started_us = time.time_ns() // 1000
    started = time.perf_counter()
    run = platform.runs.run_inline(request).run
    wall_s = time.perf_counter() - started
    rss_peak_kib = _rss_peak_kib()
    jvm_rss_peak_kib = _jvm_rss_peak_kib() if spec.get("spark") else None
    try:
        timeline = _ledger_timeline(platform, run.run_id, started_us)
    except Exception as exc:  # the timeline is informative only; the measurement stands without it
        timeline = [["unavailable", repr(exc)[:200]]]
    platform.close()
    return {
        "ok": run.status == "succeeded",
        "wall_s": wall_s,
        "setup_s": setup_s,
        "rss_before_kib": rss_before_kib,
        "rss_peak_kib": rss_peak_kib,
        "status": run.status,
        "error_code": run.error_code,
        "error_message": run.error_message,
        "rows": run.row_count,
        "output_digest": run.output_digest,
        "publication_ref": run.publication_ref,
        "ledger_ms": timeline,
        "session_start_s": session_start_s,
        "jvm_rss_peak_kib": jvm_rss_peak_kib,
    }


def measure_bare(spec: dict[str, Any]) -> dict[str, Any]:
    began = time.perf_counter()
    import duckdb
    import pyarrow  # noqa: F401  (imported before the clock starts, as it always was: setup, not the query)

    setup_s = time.perf_counter() - began
    rss_before_kib = _rss_peak_kib()
    started = time.perf_counter()
    config = {"memory_limit": spec["memory_limit"], "threads": spec["threads"], "temp_directory": spec["temp_dir"]}
    connection = duckdb.connect(":memory:", config=config)
    connection.execute("SET allowed_paths = $paths", {"paths": sorted(spec["tables"].values())})
    connection.execute("SET enable_external_access = false")
    connection.execute("SET lock_configuration = true")
    for table, path in spec["tables"].items():
        connection.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{path}')")
    return query_and_report(connection, spec, started, setup_s, rss_before_kib)


def query_and_report(
    connection: Any, spec: dict[str, Any], started: float, setup_s: float, rss_before_kib: int
) -> dict[str, Any]:
    """Run the spec's query on a prepared DuckDB connection, write its result to the spec's IPC file and
    report the wall time from ``started`` and the peak RSS (the bare and arrow references alike)."""
    import pyarrow as pa

    result = connection.sql(spec["sql"]).to_arrow_table()
    wall_s = time.perf_counter() - started
    rss_peak_kib = _rss_peak_kib()
    connection.close()
    with pa.OSFile(spec["ipc_path"], "wb") as sink, pa.ipc.new_file(sink, result.schema) as writer:
        writer.write_table(result)
    return {
        "ok": True,
        "wall_s": wall_s,
        "setup_s": setup_s,
        "rss_before_kib": rss_before_kib,
        "rss_peak_kib": rss_peak_kib,
        "status": "succeeded",
        "rows": result.num_rows,
    }


MEASURES = {"platform": measure_platform, "bare": measure_bare}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    result = MEASURES[spec["kind"]](spec)
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
