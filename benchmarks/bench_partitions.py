"""Benchmark: publishing one day into a Delta table of 365 daily partitions (issue 27, item 7).

Data: ``lineitem`` at SF1 from ``tpchgen-cli`` (the ``bench`` extra), its rows shipped from 1995-01-01 to
1996-01-01 (917 k rows, 2,300 - 2,700 a day) kept as one Parquet file in ``benchmarks/.data/partitions-sf1/``
(generated once). The definition publishes one ``l_shipdate`` day of it, every ``lineitem`` column, to a
Delta table partitioned by ``day``.

The table is built once per invocation through the platform itself: 365 runs with ``mode:
replace_partition`` (1995-01-01 to 1995-12-31) on one SQLite platform database, so the table is what a
year of nightly publications leaves (365 commits, delta-rs's checkpoints, a publication and a partition
transaction per day). Then each measurement starts from a copy of that table and of that platform database
and publishes one day with ``run_inline`` (what ``dataflow run`` does) in a fresh process, once with
``mode: replace_partition`` and once with ``mode: append``, alternating which goes first every round:

- *rerun*: a day already in the table (1995-07-01) published again under a new key. Replace leaves the
  day once (the old files removed, the new ones added, one commit); append adds a second copy — the
  mistake replace exists to prevent, measured for its cost only;
- *new_day*: the next day (1996-01-01), not in the table yet: both only add files.

Reported per case and side: the median wall time of ``run_inline`` and of the provider's publish call
alone (from the pre-dispatch commit to the sink's answer, taken at the crash points' in-process hook), the
CPU time of the run, and the process's peak RSS (VmHWM). The child checks what the table holds for the day
afterwards (replace: the day's rows once; append on a rerun: twice). Target: replace <= 1.5 x append.

    .venv/bin/python benchmarks/run.py --only partitions            # 5 rounds: results/partitions.json
    .venv/bin/python benchmarks/run.py --quick --only partitions    # 2 rounds: results/partitions.quick.json
    .venv/bin/python benchmarks/bench_partitions.py [--quick]       # the same without the PostgreSQL server

The harness starts its PostgreSQL server for every benchmark; this one does not use it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "partitions"
ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "benchmarks" / ".data" / "partitions-sf1"
SOURCE_FILE = "lineitem_1995.parquet"
SCALE_FACTOR = "1"
FIRST_DAY, LAST_DAY = "1995-01-01", "1995-12-31"  # the 365 partitions of the table
CASES = {"rerun": "1995-07-01", "new_day": "1996-01-01"}
SIDES = ("replace_partition", "append")
ROUNDS = {False: 5, True: 2}  # by quick
TIME_RATIO_MAX = 1.5  # replace <= 1.5 x append
TENANT = "bench"
LOCATION = "warehouse/lineitem_daily"
CHILD_TIMEOUT_S = 1800.0
GENERATE_TIMEOUT_S = 1800.0
COLUMNS = [
    ["day", "date"], ["l_orderkey", "int64"], ["l_partkey", "int64"], ["l_suppkey", "int64"],
    ["l_linenumber", "int32"], ["l_quantity", "decimal(15,2)"], ["l_extendedprice", "decimal(15,2)"],
    ["l_discount", "decimal(15,2)"], ["l_tax", "decimal(15,2)"], ["l_returnflag", "string"],
    ["l_linestatus", "string"], ["l_commitdate", "date"], ["l_receiptdate", "date"], ["l_shipinstruct", "string"],
    ["l_shipmode", "string"], ["l_comment", "string"],
]  # fmt: skip


# ---- data and definitions ------------------------------------------------------------------------


def ensure_source() -> Path:
    """lineitem's rows shipped in 1995 (and 1996-01-01) as one Parquet file, generated when missing."""
    path = DATA_DIR / SOURCE_FILE
    if path.is_file():
        return path
    partial = DATA_DIR.with_name(DATA_DIR.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    beside = Path(sys.executable).parent / "tpchgen-cli"
    binary = str(beside) if beside.is_file() else shutil.which("tpchgen-cli")
    if binary is None:
        raise RuntimeError("tpchgen-cli is not installed: .venv/bin/pip install -e '.[bench]' (or tpchgen-cli)")
    command = [binary, "parquet", "-s", SCALE_FACTOR, "--tables", "lineitem", "-o", str(partial), "-q"]
    subprocess.run(command, check=True, timeout=GENERATE_TIMEOUT_S)
    import duckdb

    lineitem = partial / "lineitem.parquet"
    duckdb.connect().execute(
        f"COPY (SELECT * FROM read_parquet('{lineitem}') WHERE l_shipdate BETWEEN DATE '{FIRST_DAY}' "
        f"AND DATE '{max(CASES.values())}' ORDER BY l_shipdate) TO '{partial / SOURCE_FILE}' (FORMAT parquet)"
    )
    lineitem.unlink()
    shutil.rmtree(DATA_DIR, ignore_errors=True)
    partial.rename(DATA_DIR)
    return path


def definition(mode: str) -> dict[str, Any]:
    """One day of lineitem, every column, to the Delta table: replacing the day's partition, or appending."""
    columns = ", ".join(name for name, _ in COLUMNS[1:])
    target: dict[str, Any] = {
        "type": "datasources.publication", "provider": "delta", "datasource": "bench.lineitem_daily",
        "location": LOCATION, "mode": mode,
    }  # fmt: skip
    if mode == "replace_partition":
        target["partition"] = {"day": "$day"}
    return {
        "name": f"lineitem_daily_{mode}",
        "version": 1,
        "parameters": {"day": {"type": "date"}},
        "sources": {"lineitem": {"kind": "parquet", "path": SOURCE_FILE}},
        "steps": [{"name": "day", "sql": f"select l_shipdate as day, {columns} from lineitem where l_shipdate = $day"}],
        "output": {"schema": COLUMNS, "max_rows": 100_000, "max_bytes": "256MiB"},
        "target": target,
    }


# ---- the child: one process per build or measurement --------------------------------------------


def _rss_peak_kib() -> int:
    """This process's peak resident set (VmHWM: not ru_maxrss, which carries the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread: DuckDB's and delta-rs's included
    return usage.ru_utime + usage.ru_stime


def _request(spec: dict[str, Any], day: str, key: str) -> Any:
    from durable_dataflow.dataflow.definitions.definitions import parse_definition
    from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest

    return RunRequest(
        definition=parse_definition(json.dumps(spec["definition"]), "<bench_partitions>"),
        base_dir=Path(spec["base_dir"]), parameters={"day": day},
        access=AccessContext(tenant=TENANT, principal="bench", roles=("operator",)),
        provenance=Provenance(actor="bench", trigger="api", host="bench"),
        idempotency_key=key, max_attempts=1,
    )  # fmt: skip


def child_build(spec: dict[str, Any]) -> dict[str, Any]:
    """Publish every day of the year, one replace_partition run each, in this process."""
    import datetime as dt

    from durable_dataflow.platform import Platform

    began = time.perf_counter()
    seconds = []
    with Platform(spec["db_url"]) as platform:
        day, last = dt.date.fromisoformat(FIRST_DAY), dt.date.fromisoformat(LAST_DAY)
        while day <= last:
            started = time.perf_counter()
            run = platform.runs.run_inline(_request(spec, day.isoformat(), f"build-{day}")).run
            if run.status != "succeeded":
                raise RuntimeError(f"building {day}: {run.status} {run.error_code} {run.error_message}")
            seconds.append(time.perf_counter() - started)
            day += dt.timedelta(days=1)
    return {"runs": len(seconds), "build_s": time.perf_counter() - began, "run_median_s": statistics.median(seconds)}


def child_publish(spec: dict[str, Any]) -> dict[str, Any]:
    """One timed run_inline publishing one day (the parent then reads what the table holds)."""
    from durable_dataflow.core import crashpoints
    from durable_dataflow.platform import Platform

    platform = Platform(spec["db_url"])
    request = _request(spec, spec["day"], spec["key"])
    marks: dict[str, float] = {}

    def mark(point: str) -> None:
        marks.setdefault(point, time.perf_counter())

    crashpoints.set_hook(mark)
    rss_before_kib, cpu_before = _rss_peak_kib(), _cpu_s()
    started = time.perf_counter()
    run = platform.runs.run_inline(request).run
    wall_s = time.perf_counter() - started
    cpu_s, rss_peak_kib = _cpu_s() - cpu_before, _rss_peak_kib()
    pandas_imported = "pandas" in sys.modules  # pyarrow imports it on converting a Python value: ≈ 0.4 s
    crashpoints.set_hook(None)
    platform.close()
    if run.status != "succeeded":
        raise RuntimeError(f"{spec['definition']['name']} {spec['day']}: {run.error_code} {run.error_message}")
    publish_s = marks[crashpoints.AFTER_PROVIDER_CALL] - marks[crashpoints.AFTER_PREDISPATCH_COMMIT]
    return {
        "wall_s": wall_s, "publish_s": publish_s, "cpu_s": cpu_s, "rss_before_kib": rss_before_kib,
        "rss_peak_kib": rss_peak_kib, "rows": run.row_count, "pandas_imported": pandas_imported,
    }  # fmt: skip


def table_facts(table_dir: Path, day: str) -> dict[str, Any]:
    """What the table holds after a measurement, read by the parent with delta-rs: the day's rows, the
    version and the number of partitions."""
    import datetime as dt

    import deltalake

    table = deltalake.DeltaTable(str(table_dir))
    when = dt.date.fromisoformat(day)
    day_rows = table.to_pyarrow_table(filters=[("day", "=", when)], columns=["l_orderkey"]).num_rows
    return {"day_rows_after": day_rows, "table_version": table.version(), "partitions": len(table.partitions())}


CHILDREN = {"build": child_build, "publish": child_publish}


def child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = CHILDREN[spec["kind"]](spec)
    Path(spec["result_path"]).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # measured and written: no interpreter teardown of the engines' native threads


def spawn(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    spec_path, result_path = folder / "spec.json", folder / "result.json"
    result_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**spec, "result_path": str(result_path)}))
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False, cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0 or not result_path.is_file():
        raise RuntimeError(f"{spec['kind']} failed (exit {done.returncode}): {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


# ---- the parent ----------------------------------------------------------------------------------


def measure(workdir: Path, quick: bool) -> dict[str, Any]:
    source = ensure_source()
    pristine = workdir / "pristine"
    pristine.mkdir(parents=True)
    try:
        os.link(source, pristine / SOURCE_FILE)  # the run's source inside its base_dir, not copied
    except OSError:
        shutil.copy(source, pristine / SOURCE_FILE)  # another file system
    db = pristine / "platform.db"
    build = spawn(
        {"kind": "build", "db_url": f"sqlite:///{db}", "base_dir": str(pristine),
         "definition": definition("replace_partition")},
        pristine,
    )  # fmt: skip
    print(f"built 365 partitions in {build['build_s']:.1f} s (median run {build['run_median_s'] * 1000:.0f} ms)")
    table_dir = pristine / LOCATION
    built_table = {
        "files": sum(1 for _ in table_dir.rglob("*.parquet")),
        "bytes": sum(p.stat().st_size for p in table_dir.rglob("*") if p.is_file()),
        "log_commits": sum(1 for _ in (table_dir / "_delta_log").glob("*.json")),
        "checkpoints": sum(1 for _ in (table_dir / "_delta_log").glob("*.checkpoint.parquet")),
    }
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {c: {s: [] for s in SIDES} for c in CASES}
    base = workdir / "run"
    for r in range(ROUNDS[quick]):
        order = SIDES if r % 2 == 0 else tuple(reversed(SIDES))
        for case, day in CASES.items():
            for side in order:
                shutil.rmtree(base, ignore_errors=True)
                shutil.copytree(pristine, base, copy_function=shutil.copy2)  # the same start every time
                result = spawn(
                    {"kind": "publish", "db_url": f"sqlite:///{base / 'platform.db'}", "base_dir": str(base),
                     "definition": definition(side), "day": day, "key": f"{case}-{side}-{r}"},
                    workdir,
                )  # fmt: skip
                result.update(table_facts(base / LOCATION, day))
                samples[case][side].append(result)
                print(
                    f"round {r} {case} {side}: run {result['wall_s'] * 1000:.0f} ms, publish "
                    f"{result['publish_s'] * 1000:.0f} ms, cpu {result['cpu_s'] * 1000:.0f} ms, peak RSS "
                    f"{result['rss_peak_kib'] / 1024:.0f} MiB, day rows after {result['day_rows_after']}",
                    flush=True,
                )
    summary = {case: summarize(by_side) for case, by_side in samples.items()}
    return {"build": build, "table": built_table, "cases": CASES, "rounds": ROUNDS[quick],
            "target": f"replace_partition <= {TIME_RATIO_MAX} x append (run time)",
            "summary": summary, "samples": samples}  # fmt: skip


def _median(samples: list[dict[str, Any]], field: str) -> float:
    return float(statistics.median(s[field] for s in samples))


def summarize(by_side: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    replace, append = by_side["replace_partition"], by_side["append"]
    out: dict[str, Any] = {}
    for field in ("wall_s", "publish_s", "cpu_s"):
        out[field] = {"replace_partition": _median(replace, field), "append": _median(append, field)}
        out[field]["ratio"] = out[field]["replace_partition"] / out[field]["append"]
    rss = {side: max(s["rss_peak_kib"] for s in by_side[side]) / 1024 for side in SIDES}
    growth = {side: max(s["rss_peak_kib"] - s["rss_before_kib"] for s in by_side[side]) / 1024 for side in SIDES}
    out["rss_peak_mib"] = {**rss, "ratio": rss["replace_partition"] / rss["append"]}
    out["rss_growth_mib"] = growth  # the run's own growth of the peak over the imported process's
    out["day_rows_after"] = {side: sorted({s["day_rows_after"] for s in by_side[side]}) for side in SIDES}
    out["met"] = out["wall_s"]["ratio"] <= TIME_RATIO_MAX
    return out


def run(ctx: Any) -> dict[str, Any]:
    """The entry point of run.py."""
    from common import print_table, write_result

    payload = measure(Path(ctx.workdir) / NAME, bool(ctx.quick))
    rows = []
    for case, s in payload["summary"].items():
        for field, label in (("wall_s", "run ms"), ("publish_s", "publish ms"), ("cpu_s", "cpu ms")):
            figure = s[field]
            rows.append([case, label, figure["replace_partition"] * 1000, figure["append"] * 1000, figure["ratio"]])
        rss = s["rss_peak_mib"]
        rows.append([case, "peak RSS MiB", rss["replace_partition"], rss["append"], rss["ratio"]])
        rows.append([case, f"run time <= {TIME_RATIO_MAX}x", "", "", s["met"]])
    print_table(
        "Publishing one day into 365 Delta partitions", ["case", "figure", "replace_partition", "append", "ratio"], rows
    )
    write_result(NAME, payload, getattr(ctx, "server", None), bool(ctx.quick))
    return payload


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "--child":
        return child(argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from types import SimpleNamespace

    with tempfile.TemporaryDirectory(prefix="bench-partitions-") as workdir:
        run(SimpleNamespace(workdir=workdir, quick="--quick" in argv, server=None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
