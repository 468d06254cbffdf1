"""Benchmark 7: TPC-H Q1, Q3, Q5, Q6, Q10 and Q18 through the platform and through bare DuckDB.

Data: ``tpchgen-cli`` (the ``bench`` extra) writes one Parquet file per table at each scale factor
into ``benchmarks/.data/tpch-sf<N>/`` (ignored by git, kept across runs, generated once). The
queries and their declared output schemas are in tpch_queries.py.

Every measurement runs in a fresh process (tpch_child.py), so its peak RSS is its own:

- *platform*: ``runs.run_inline`` in atomic mode on a fresh SQLite platform database, the data
  folder in ``DATAFLOW_DATA_ROOTS``; Q1 also in forward mode, appending to a new Delta table;
- *bare*: a fresh in-memory DuckDB with the same memory limit and threads, ``allowed_paths`` set to
  exactly the query's files, then ``enable_external_access = false`` and ``lock_configuration =
  true``, one view per table over ``read_parquet``, the query to an Arrow table;
- *trivial*: the trivial dataflow of the throughput benchmark (1,000 inline rows, one GROUP BY)
  through the platform in the same shape, atomic and forward to Delta: the fixed per-run cost.

- *spark*: the same definition with ``engine: spark`` through the platform (atomic), on a local Spark
  session (``local[<cores>]``, ``spark.driver.memory`` = the DuckDB memory limit) started before the
  clock (its start is reported apart); peak memory is the Python driver's plus its JVM's (driver
  and executors are one JVM in local mode). Skipped when pyspark is not installed, or with
  ``BENCH_TPCH_ENGINES=duckdb``. Spark is reported beside DuckDB, not held to the DuckDB targets.

Platform and bare alternate inside every round (the order flips each round). Reported per query:
median wall time and maximum peak RSS of each side, their ratios, and whether the platform's
output digest equals the digest of bare DuckDB's result cast to the declared schema. Targets
(issue 11): platform time <= 1.25 x bare + the fixed per-run cost; platform peak RSS <= 1.5 x
bare; every query completes at SF10.

    .venv/bin/python benchmarks/run.py --only tpch            # SF1 and SF10, 3 rounds: results/tpch.json
    .venv/bin/python benchmarks/run.py --quick --only tpch    # SF0.1, 1 round: results/tpch.quick.json
    BENCH_TPCH_SCALE_FACTORS=1 .venv/bin/python benchmarks/run.py --only tpch   # other scale factors

The harness starts its PostgreSQL server for every benchmark; this one does not use it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import tpch_queries
from common import RESULTS_DIR, ROOT, BenchContext, console, print_table, trivial_definition_text, write_result
from tpch_queries import Query

NAME = "tpch"
SCALE_FACTORS = {False: (1.0, 10.0), True: (0.1,)}  # by ctx.quick
SCALE_FACTORS_ENV = "BENCH_TPCH_SCALE_FACTORS"  # e.g. "1" to run SF1 alone; recorded in the settings
ENGINES_ENV = "BENCH_TPCH_ENGINES"  # "duckdb" leaves Spark out; default: duckdb and spark (when installed)
ROUNDS_ENV = "BENCH_TPCH_ROUNDS"  # overrides the rounds per scale factor
ROUNDS = {False: 3, True: 1}
TABLES = ("region", "nation", "supplier", "customer", "part", "partsupp", "orders", "lineitem")
DATA_DIR = ROOT / "benchmarks" / ".data"
DATA_COMPLETE_MARKER = "_complete.json"  # written last: a folder without it is regenerated
CHILD_SCRIPT = Path(__file__).resolve().parent / "tpch_child.py"
MEMORY_BYTES = 4 * 1024**3  # DuckDB memory_limit of both sides (the platform's new default)
THREADS = os.cpu_count() or 1
TIME_LIMIT_S = 3600.0  # the platform's execution time limit, so SF10 is not cut at the old 60 s default
CHILD_TIMEOUT_S = 7200.0
GENERATE_TIMEOUT_S = 3600.0
TIME_RATIO_MAX = 1.25  # platform time <= TIME_RATIO_MAX x bare + fixed per-run cost
RSS_RATIO_MAX = 1.5  # platform peak RSS <= RSS_RATIO_MAX x bare
REQUIRED_COMPLETE_SF = 10.0  # every query must complete through the platform at this scale factor
ERROR_CHARS_SHOWN = 160
SINK_LOCATION = "sink/q1"  # the Delta table of forward runs, inside each measurement's own base_dir
STDERR_CHARS_KEPT = 2_000
THROUGHPUT_RESULT = RESULTS_DIR / "throughput.json"


# ---- data ----------------------------------------------------------------------------------------


def sf_label(scale_factor: float) -> str:
    return f"{scale_factor:g}"


def tpchgen_binary() -> str:
    """tpchgen-cli next to this interpreter (the venv), else on PATH."""
    beside = Path(sys.executable).parent / "tpchgen-cli"
    found = str(beside) if beside.is_file() else shutil.which("tpchgen-cli")
    if found is None:
        raise RuntimeError("tpchgen-cli is not installed: .venv/bin/pip install -e '.[bench]' (or tpchgen-cli)")
    return found


def ensure_data(scale_factor: float) -> Path:
    """The folder with one Parquet file per table at this scale factor, generated when missing.

    Generation writes into a ``.partial`` folder and renames it when complete, so an interrupted
    run never leaves a folder that looks finished.
    """
    folder = DATA_DIR / f"tpch-sf{sf_label(scale_factor)}"
    if (folder / DATA_COMPLETE_MARKER).is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    console.print(f"generating TPC-H SF{sf_label(scale_factor)} into {folder} (once; kept for later runs)")
    began = time.monotonic()
    command = [tpchgen_binary(), "parquet", "-s", sf_label(scale_factor), "-o", str(partial), "-q"]
    subprocess.run(command, check=True, timeout=GENERATE_TIMEOUT_S)
    missing = [t for t in TABLES if not (partial / f"{t}.parquet").is_file()]
    if missing:
        raise RuntimeError(f"tpchgen-cli did not write {missing} into {partial}")
    marker = {"scale_factor": scale_factor, "tpchgen_cli": _version("tpchgen-cli"), "seconds": time.monotonic() - began}
    (partial / DATA_COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
    partial.rename(folder)
    return folder


def data_facts(folder: Path) -> dict[str, Any]:
    """Bytes on disk and rows of every table, from the Parquet footers."""
    import pyarrow.parquet as pq

    tables = {}
    for table in TABLES:
        path = folder / f"{table}.parquet"
        tables[table] = {"bytes": path.stat().st_size, "rows": pq.ParquetFile(path).metadata.num_rows}
    marker = json.loads((folder / DATA_COMPLETE_MARKER).read_text())
    return {"folder": str(folder), "generated_by": marker, "tables": tables}


# ---- one measurement -----------------------------------------------------------------------------


def _limits_spec(folder: Path) -> dict[str, Any]:
    return {
        "memory_bytes": MEMORY_BYTES,
        "memory_limit": f"{MEMORY_BYTES // 1024**2}MiB",
        "threads": THREADS,
        "time_limit_s": TIME_LIMIT_S,
        "temp_dir": str(folder / "spill"),
    }


def run_child(
    folder: Path, spec: dict[str, Any], data_dir: Path | None, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; a crash or timeout is a failed measurement."""
    (folder / "spill").mkdir(parents=True, exist_ok=True)
    spec = {**_limits_spec(folder), **spec, "result_path": str(folder / "result.json")}
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **(extra_env or {})}
    if data_dir is not None:
        env["DATAFLOW_DATA_ROOTS"] = str(data_dir)
    began = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(CHILD_SCRIPT), str(spec_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return _failed("timeout", f"no result within {CHILD_TIMEOUT_S:g} s")
    result_path = Path(spec["result_path"])
    if done.returncode != 0 or not result_path.is_file():
        return _failed("crashed", f"exit {done.returncode}: {done.stderr[-STDERR_CHARS_KEPT:]}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["process_s"] = time.perf_counter() - began
    return result


def _failed(status: str, message: str) -> dict[str, Any]:
    return {"ok": False, "status": status, "error_code": status, "error_message": message}


def platform_spec(definition: dict[str, Any], folder: Path, key: str, params: dict[str, Any]) -> dict[str, Any]:
    base_dir = folder / "base"
    base_dir.mkdir(parents=True, exist_ok=True)
    return {
        "kind": "platform",
        "db_url": f"sqlite:///{folder / 'platform.db'}",
        "definition": definition,
        "base_dir": str(base_dir),
        "key": key,
        "parameters": params,
    }


def bare_spec(query: Query, data_dir: Path, folder: Path) -> dict[str, Any]:
    tables = {table: str(data_dir / f"{table}.parquet") for table in query.tables}
    return {"kind": "bare", "sql": query.sql.strip(), "tables": tables, "ipc_path": str(folder / "bare.arrow")}


def spark_conf() -> str:
    """The Spark settings of the spark kind: the DuckDB side's memory for the driver (and its executors)."""
    return f"spark.driver.memory={MEMORY_BYTES // 1024**2}m"


def measure(kind: str, query: Query, data_dir: Path, folder: Path) -> dict[str, Any]:
    """One measurement of a query: ``platform`` (atomic), ``forward`` (Delta sink), ``spark`` or ``bare``."""
    if kind == "spark":
        definition = {**tpch_queries.definition(query, data_dir), "engine": "spark"}
        spec = {**platform_spec(definition, folder, f"tpch-{folder.name}", {}), "spark": True}
        return run_child(folder, spec, data_dir, {"DATAFLOW_SPARK_MASTER": f"local[{THREADS}]",
                                                  "DATAFLOW_SPARK_CONF": spark_conf()})
    if kind == "bare":
        result = run_child(folder, bare_spec(query, data_dir, folder), None)
        if result["ok"]:
            result.update(check_bare(query, data_dir, folder / "bare.arrow"))
        return result
    target = tpch_queries.delta_target(SINK_LOCATION) if kind == "forward" else None
    definition = tpch_queries.definition(query, data_dir, target)
    result = run_child(folder, platform_spec(definition, folder, f"tpch-{folder.name}", {}), data_dir)
    if kind == "forward" and result["ok"]:
        result["sink_digest"] = sink_digest(query, data_dir, folder / "base" / SINK_LOCATION)
    return result


def sink_digest(query: Query, data_dir: Path, table_dir: Path) -> str:
    """The digest of what the Delta table holds, cast to the declared schema: the sink must hold
    exactly the answer (the table is new for every measurement, so it holds one publication)."""
    from deltalake import DeltaTable

    return declared_digest(query, data_dir, DeltaTable(str(table_dir)).to_pyarrow_table())


def measure_trivial(kind: str, folder: Path) -> dict[str, Any]:
    """The fixed per-run cost: the trivial dataflow through the platform in the same shape."""
    document = json.loads(trivial_definition_text())
    if kind == "forward":
        document["target"] = tpch_queries.delta_target("sink/trivial")
    return run_child(folder, platform_spec(document, folder, f"trivial-{folder.name}", {"tag": "x"}), None)


def check_bare(query: Query, data_dir: Path, ipc_path: Path) -> dict[str, Any]:
    """Bare DuckDB's result: do its types equal the declared ones exactly, and its digest once cast
    to the declared schema (what the platform's output digest must equal)."""
    import pyarrow as pa

    with pa.memory_map(str(ipc_path)) as source:
        table = pa.ipc.open_file(source).read_all()
    actual = [(f.name, str(f.type)) for f in table.schema]
    expected = [(f.name, str(f.type)) for f in declared_schema(query, data_dir)]
    digest = declared_digest(query, data_dir, table)
    return {"types_as_declared": actual == expected, "types": actual, "bare_digest": digest}


def declared_schema(query: Query, data_dir: Path) -> Any:
    from durable_dataflow.dataflow.definitions.definitions import parse_definition

    declared = parse_definition(json.dumps(tpch_queries.definition(query, data_dir)), "<bench_tpch>")
    return declared.output.arrow_schema()


def declared_digest(query: Query, data_dir: Path, table: Any) -> str:
    """The platform's output digest of ``table`` once cast, column by column, to the declared schema."""
    import pyarrow as pa

    from durable_dataflow.dataflow.execution import arrowdigest

    schema = declared_schema(query, data_dir)
    cast = pa.Table.from_arrays([table.column(f.name).cast(f.type) for f in schema], schema=schema)
    return str(arrowdigest.output_digest(cast.combine_chunks()))


# ---- rounds --------------------------------------------------------------------------------------


def engines() -> tuple[str, ...]:
    """The engines measured: DuckDB always; Spark unless left out or not installed."""
    import importlib.util

    configured = os.environ.get(ENGINES_ENV, "").strip()
    wanted = tuple(e.strip() for e in configured.split(",") if e.strip()) if configured else ("duckdb", "spark")
    return tuple(e for e in wanted if e == "duckdb" or importlib.util.find_spec("pyspark") is not None)


def kinds_of(query: Query, round_index: int) -> list[str]:
    kinds = ["platform", "bare"]
    if query is tpch_queries.FORWARD_QUERY:
        kinds.insert(1, "forward")
    if "spark" in engines():
        kinds.append("spark")
    return kinds if round_index % 2 == 0 else kinds[::-1]


def run_scale(scale_factor: float, rounds: int, workdir: Path) -> dict[str, Any]:
    """Every round: the trivial runs, then each query on each side, in alternating order."""
    data_dir = ensure_data(scale_factor).resolve()
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
    label = sf_label(scale_factor)
    for r in range(rounds):
        for kind in ("platform", "forward"):
            folder = workdir / f"sf{label}-r{r}-trivial-{kind}"
            result = measure_trivial(kind, folder)
            shutil.rmtree(folder, ignore_errors=True)
            samples.setdefault("trivial", {}).setdefault(kind, []).append(result)
            _progress(label, r, "trivial", kind, result)
        for query in tpch_queries.QUERIES:
            for kind in kinds_of(query, r):
                folder = workdir / f"sf{label}-r{r}-{query.name}-{kind}"
                result = measure(kind, query, data_dir, folder)
                shutil.rmtree(folder, ignore_errors=True)  # the spill folder and the Delta sink
                samples.setdefault(query.name, {}).setdefault(kind, []).append(result)
                _progress(label, r, query.name, kind, result)
    return {"data": data_facts(data_dir), "samples": samples}


def _progress(label: str, r: int, query: str, kind: str, result: dict[str, Any]) -> None:
    if result["ok"]:
        line = f"{result['wall_s']:.3f}s, peak {result['rss_peak_kib'] / 1024:.0f} MiB"
    else:
        line = f"{result['status']}: {_short(result.get('error_message'))}"
    console.print(f"  SF{label} round {r} {query} {kind}: {line}", markup=False, highlight=False)


def _short(text: str | None) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= ERROR_CHARS_SHOWN else flat[: ERROR_CHARS_SHOWN - 1] + "…"


# ---- summary -------------------------------------------------------------------------------------


def side_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    # A run that failed inside the platform still reports its time and memory until the failure.
    failed = [r for r in results if not r["ok"] and "wall_s" in r]
    summary = {
        "completed": len(ok),
        "measured": len(results),
        "wall_s_median": statistics.median(r["wall_s"] for r in ok) if ok else None,
        "rss_peak_mib_max": max(r["rss_peak_kib"] for r in ok) / 1024 if ok else None,
        "rss_before_mib_max": max(r["rss_before_kib"] for r in ok) / 1024 if ok else None,
        "rss_work_mib_max": max(r["rss_peak_kib"] - r["rss_before_kib"] for r in ok) / 1024 if ok else None,
        "setup_s_median": statistics.median(r["setup_s"] for r in ok) if ok else None,
        "errors": sorted({f"{r.get('error_code')}: {_short(r.get('error_message'))}" for r in results if not r["ok"]}),
        "failed_wall_s_median": statistics.median(r["wall_s"] for r in failed) if failed else None,
        "failed_rss_peak_mib_max": max(r["rss_peak_kib"] for r in failed) / 1024 if failed else None,
    }
    phases = [p for p in (phases_ms(r) for r in ok) if p is not None]
    if phases:
        summary["phases_ms_median"] = {name: statistics.median(p[name] for p in phases) for name in phases[0]}
    return summary


def phases_ms(result: dict[str, Any]) -> dict[str, float] | None:
    """Where a platform run's time went, from its ledger timestamps: until the run was recorded
    (submit: replay lookup, gate, record and claim), from then to the last entry (sources,
    execution, terminal commit, publication), and after it (returning to the caller)."""
    timeline = result.get("ledger_ms")
    if not timeline or not all(isinstance(offset, float | int) for _, offset in timeline):
        return None
    first, last = timeline[0][1], timeline[-1][1]
    return {"submit": first, "recorded_to_terminal": last - first, "after_terminal": result["wall_s"] * 1e3 - last}


def compare(side: list[dict[str, Any]], bare: list[dict[str, Any]], fixed_s: float | None) -> dict[str, Any]:
    """One platform mode against bare DuckDB: ratios, targets and the result check."""
    ours, peer = side_summary(side), side_summary(bare)
    complete = ours["completed"] == ours["measured"] and peer["completed"] == peer["measured"]
    entry: dict[str, Any] = {"platform": ours, "bare": peer, "all_completed": complete}
    if not complete or fixed_s is None:
        return {**entry, "time_ratio": None, "rss_ratio": None, "time_target_met": None, "rss_target_met": None,
                "same_result": None}  # fmt: skip
    bare_digests = {r["bare_digest"] for r in bare}
    entry["time_ratio"] = ours["wall_s_median"] / peer["wall_s_median"]
    entry["rss_ratio"] = ours["rss_peak_mib_max"] / peer["rss_peak_mib_max"]
    entry["time_bound_s"] = TIME_RATIO_MAX * peer["wall_s_median"] + fixed_s
    entry["time_target_met"] = ours["wall_s_median"] <= entry["time_bound_s"]
    entry["rss_target_met"] = entry["rss_ratio"] <= RSS_RATIO_MAX
    # The same answer: one bare digest over the rounds, every platform output digest equal to it, and
    # for forward runs the Delta table's contents too.
    entry["same_result"] = len(bare_digests) == 1 and all(
        r["output_digest"] in bare_digests and r.get("sink_digest", r["output_digest"]) in bare_digests for r in side
    )
    entry["bare_types_as_declared"] = all(r["types_as_declared"] for r in bare)
    return entry


def summarize(samples: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    fixed = {kind: side_summary(samples["trivial"][kind]) for kind in ("platform", "forward")}
    queries = {}
    for query in tpch_queries.QUERIES:
        by_kind = samples[query.name]
        modes = {"atomic": compare(by_kind["platform"], by_kind["bare"], fixed["platform"]["wall_s_median"])}
        if "forward" in by_kind:
            modes["forward"] = compare(by_kind["forward"], by_kind["bare"], fixed["forward"]["wall_s_median"])
        queries[query.name] = modes
    spark = {q.name: spark_summary(samples[q.name]) for q in tpch_queries.QUERIES if "spark" in samples[q.name]}
    return {"fixed_per_run_cost": fixed, "queries": queries, "spark": spark}


def spark_summary(by_kind: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The Spark engine beside DuckDB for one query: wall time, driver + JVM peak, the same answer."""
    side = by_kind["spark"]
    ok = [r for r in side if r["ok"]]
    duck = side_summary(by_kind["platform"])
    bare_digests = {r.get("bare_digest") for r in by_kind["bare"]}
    entry: dict[str, Any] = {
        "completed": len(ok), "measured": len(side),
        "wall_s_median": statistics.median(r["wall_s"] for r in ok) if ok else None,
        "session_start_s_median": statistics.median(r["session_start_s"] for r in ok) if ok else None,
        "driver_rss_peak_mib_max": max(r["rss_peak_kib"] for r in ok) / 1024 if ok else None,
        "jvm_rss_peak_mib_max": max(r["jvm_rss_peak_kib"] for r in ok) / 1024 if ok else None,
        "errors": sorted({f"{r.get('error_code')}: {_short(r.get('error_message'))}" for r in side if not r["ok"]}),
        "same_result": bool(ok) and len(ok) == len(side) and all(r["output_digest"] in bare_digests for r in ok),
    }  # fmt: skip
    if ok and duck["wall_s_median"]:
        entry["time_vs_duckdb_platform"] = entry["wall_s_median"] / duck["wall_s_median"]
    return entry


def reference_trivial_run() -> dict[str, Any] | None:
    """The throughput benchmark's warm inline run on PostgreSQL, for comparison only."""
    try:
        document = json.loads(THROUGHPUT_RESULT.read_text())
        return {
            "source": f"{THROUGHPUT_RESULT.name} results.fsync_off/direct/1.ours_latency_p50_s (recorded "
            f"{document['recorded_at']}, PostgreSQL with fsync off, warm process)",
            "wall_s": document["results"]["fsync_off/direct/1"]["ours_latency_p50_s"],
        }
    except (OSError, KeyError, ValueError):
        return None


# ---- output --------------------------------------------------------------------------------------


def _mark(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _num(value: float | None) -> float:
    return float("nan") if value is None else value


def _mib(side: dict[str, Any]) -> str:
    """Peak RSS, with the peak before the timed work (interpreter and imports) in parentheses."""
    if side["rss_peak_mib_max"] is None:
        return "-"
    return f"{side['rss_peak_mib_max']:.0f} ({side['rss_before_mib_max']:.0f})"


def table_rows(per_sf: dict[str, Any]) -> list[tuple[Any, ...]]:
    rows = []
    for label, scale in per_sf.items():
        for query_name, modes in scale["summary"]["queries"].items():
            for mode, e in modes.items():
                ours, peer = e["platform"], e["bare"]
                ours_s = _num(ours["wall_s_median"]) if ours["completed"] == ours["measured"] else "failed"
                rows.append((
                    label, query_name.upper(), mode, ours_s, _num(peer["wall_s_median"]), _num(e["time_ratio"]),
                    _mib(ours), _mib(peer), _num(e["rss_ratio"]),
                    _mark(e["same_result"]), _mark(e["time_target_met"]), _mark(e["rss_target_met"]),
                ))  # fmt: skip
    return rows


def print_report(per_sf: dict[str, Any]) -> None:
    print_table(
        "TPC-H: platform (run_inline, SQLite) vs bare DuckDB in the same sandbox (median s; max peak RSS MiB)",
        ["SF", "query", "mode", "platform s", "bare s", "time ratio", "platform MiB (start)", "bare MiB (start)",
         "RSS ratio", "same result", f"time <= {TIME_RATIO_MAX}x bare + fixed", f"RSS <= {RSS_RATIO_MAX}x bare"],
        table_rows(per_sf),
    )  # fmt: skip
    fixed_rows = []
    for label, scale in per_sf.items():
        for kind, side in scale["summary"]["fixed_per_run_cost"].items():
            fixed_rows.append((label, f"trivial, {kind}", _num(side["wall_s_median"]), _num(side["rss_peak_mib_max"])))
    print_table("Fixed per-run cost (trivial dataflow, same shape)", ["SF", "run", "median s", "peak MiB"], fixed_rows)
    spark_rows = []
    for label, scale in per_sf.items():
        for query_name, e in scale["summary"].get("spark", {}).items():
            duck = scale["summary"]["queries"][query_name]["atomic"]["platform"]
            spark_rows.append((
                label, query_name.upper(), _num(e["wall_s_median"]), _num(duck["wall_s_median"]),
                _num(e.get("time_vs_duckdb_platform")), _num(e["session_start_s_median"]),
                _num(e["driver_rss_peak_mib_max"]), _num(e["jvm_rss_peak_mib_max"]), _mib(duck),
                _mark(e["same_result"]),
            ))  # fmt: skip
    if spark_rows:
        print_table(
            "TPC-H on the Spark engine beside DuckDB (platform, atomic; median s; max peak MiB)",
            ["SF", "query", "spark s", "duckdb s", "spark/duckdb", "session start s", "driver MiB", "JVM MiB",
             "duckdb MiB (start)", "same result"],
            spark_rows,
        )  # fmt: skip
    for label, scale in per_sf.items():
        for query_name, modes in scale["summary"]["queries"].items():
            for mode, e in modes.items():
                for side in ("platform", "bare"):
                    print_failures(f"SF{label} {query_name} {mode} {side}", e[side])
        for query_name, e in scale["summary"].get("spark", {}).items():
            for error in e["errors"]:
                console.print(f"  SF{label} {query_name} spark failed: {error}", markup=False, highlight=False)


def print_failures(where: str, side: dict[str, Any]) -> None:
    cost = ""
    if side["failed_wall_s_median"] is not None:
        cost = f" after {side['failed_wall_s_median']:.2f} s, peak {side['failed_rss_peak_mib_max']:.0f} MiB"
    for error in side["errors"]:
        console.print(f"  {where} failed{cost}: {error}", markup=False, highlight=False)


def versions_extra() -> dict[str, str]:
    return {name: _version(name) for name in ("tpchgen-cli", "deltalake", "pyspark")}


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def targets(per_sf: dict[str, Any]) -> dict[str, Any]:
    entries = [e for s in per_sf.values() for modes in s["summary"]["queries"].values() for e in modes.values()]
    required = per_sf.get(sf_label(REQUIRED_COMPLETE_SF))
    sf10 = None
    if required is not None:
        sf10 = all(e["platform"]["completed"] == e["platform"]["measured"]
                   for modes in required["summary"]["queries"].values() for e in modes.values())  # fmt: skip
    return {
        "time": f"platform median <= {TIME_RATIO_MAX} x bare median + fixed per-run cost",
        "rss": f"platform max peak RSS <= {RSS_RATIO_MAX} x bare",
        "time_met": all(e["time_target_met"] is True for e in entries),
        "rss_met": all(e["rss_target_met"] is True for e in entries),
        "same_results": all(e["same_result"] is True for e in entries),
        "spark_same_results": all(e["same_result"] is True for s in per_sf.values()
                                  for e in s["summary"].get("spark", {}).values()),
        f"sf{sf_label(REQUIRED_COMPLETE_SF)}_completes": sf10,
    }


def scale_factors(quick: bool) -> tuple[float, ...]:
    configured = os.environ.get(SCALE_FACTORS_ENV, "").strip()
    if not configured:
        return SCALE_FACTORS[quick]
    return tuple(float(part) for part in configured.split(",") if part.strip())


def run(ctx: BenchContext) -> dict[str, Any]:
    rounds = int(os.environ.get(ROUNDS_ENV, "").strip() or ROUNDS[ctx.quick])
    workdir = Path(tempfile.mkdtemp(prefix="bench-tpch-", dir=ctx.workdir))
    per_sf: dict[str, Any] = {}
    for scale_factor in scale_factors(ctx.quick):
        measured = run_scale(scale_factor, rounds, workdir)
        per_sf[sf_label(scale_factor)] = {**measured, "summary": summarize(measured["samples"])}
    print_report(per_sf)
    payload = {
        "settings": {
            "scale_factors": list(scale_factors(ctx.quick)),
            "rounds": rounds,
            "memory_limit_bytes": MEMORY_BYTES,
            "threads": THREADS,
            "platform_time_limit_s": TIME_LIMIT_S,
            "platform_database": "SQLite, a fresh file per measurement",
            "bare_sandbox": "allowed_paths=<query files>, enable_external_access=false, lock_configuration=true, "
            "views over read_parquet, temp_directory=<private folder>",
            "timed": "platform: runs.run_inline; bare: connect to Arrow table; each in a fresh process, "
            "imports and platform setup excluded (setup_s)",
            "peak_rss": "VmHWM of the measuring process itself (interpreter and imports included; not ru_maxrss, "
            "which Linux carries over from the parent across fork and exec)",
            "fixed_per_run_cost": "median of the trivial dataflow's run_inline measured in the same shape "
            "(atomic for atomic, forward to Delta for forward)",
            "reference_trivial_run": reference_trivial_run(),
            "engines": list(engines()),
            "spark": f"local[{THREADS}], {spark_conf()}; the session is started before the clock "
            "(session_start_s); peak memory = the driver's VmHWM + its JVM's VmHWM",
            "versions": versions_extra(),
        },
        "targets": targets(per_sf),
        "scale_factors": per_sf,
    }
    write_result(NAME, payload, None, ctx.quick)
    return payload
