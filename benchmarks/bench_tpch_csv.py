"""The cost of declared source types (issue 26): TPC-H Q1 and Q6 over ``lineitem`` as a CSV at SF1.

``lineitem`` is written once by ``tpchgen-cli csv`` into ``benchmarks/.data/tpch-sf<N>-csv/`` and
declared with its TPC-H column types (``schema``), so DuckDB's reader parses it as declared. Each
measurement is one ``execute`` of the query's definition (resolution, the CSV's SHA-256
fingerprint, binding, the query, the bounded result) in a fresh interpreter, once with the code of
``--before`` (default: the commit before declared types were enforced) and once with the code of
``--after`` (default: the working tree), each exported with ``git archive``, alternating which side
goes first every round. Reported per
query: the median wall time and CPU time (user + system, all threads) of each side and their ratios;
the target is after <= 1.1 x before. On a shared machine the CPU time is the steadier figure.

    .venv/bin/python benchmarks/bench_tpch_csv.py                 # SF1, 5 rounds: results/tpch_csv.json
    .venv/bin/python benchmarks/bench_tpch_csv.py --rounds 1 --scale-factor 0.1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "benchmarks" / ".data"
RESULT_PATH = ROOT / "benchmarks" / "results" / "tpch_csv.json"
BEFORE_DEFAULT = "a0526b0"  # the commit before declared source types were enforced (issue 26)
QUERIES = ("q1", "q6")
TIME_RATIO_MAX = 1.1
MEMORY_BYTES = 4 * 1024**3
CHILD_TIMEOUT_S = 1800.0
GENERATE_TIMEOUT_S = 1800.0
LINEITEM_SCHEMA = [
    ["l_orderkey", "int64"], ["l_partkey", "int64"], ["l_suppkey", "int64"], ["l_linenumber", "int32"],
    ["l_quantity", "decimal(15,2)"], ["l_extendedprice", "decimal(15,2)"], ["l_discount", "decimal(15,2)"],
    ["l_tax", "decimal(15,2)"], ["l_returnflag", "string"], ["l_linestatus", "string"], ["l_shipdate", "date"],
    ["l_commitdate", "date"], ["l_receiptdate", "date"], ["l_shipinstruct", "string"], ["l_shipmode", "string"],
    ["l_comment", "string"],
]  # fmt: skip

# The child: one execute() of the definition, timed; it imports whichever code PYTHONPATH names first.
CHILD = """
import json, resource, sys, time
began = time.perf_counter()
from durable_dataflow.dataflow.definitions.definitions import parse_definition
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from durable_dataflow.dataflow.execution.compute import execute
spec = json.loads(sys.argv[1])
d = parse_definition(json.dumps(spec["definition"]), "<bench_tpch_csv>")
limits = ExecutionLimits(time_limit_s=3600.0, memory_bytes_max=spec["memory"], source_bytes_max=1 << 40)
from pathlib import Path
base = Path(spec["base"])
ctx = ExecutionContext(base_dir=base, allowed_roots=(base,), limits=limits)
def cpu_s():
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process, DuckDB's included
    return usage.ru_utime + usage.ru_stime
imported, cpu_before = time.perf_counter(), cpu_s()
result = execute(d, {}, ctx)
done, cpu_after = time.perf_counter(), cpu_s()
print(json.dumps({"execute_s": done - imported, "cpu_s": cpu_after - cpu_before, "rows": result.table.num_rows,
                  "digest": result.output_digest}))
"""


def ensure_lineitem(scale_factor: float) -> Path:
    folder = DATA_DIR / f"tpch-sf{scale_factor:g}-csv"
    path = folder / "lineitem.csv"
    if path.is_file():
        return path
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    binary = Path(sys.executable).parent / "tpchgen-cli"
    command = [str(binary if binary.is_file() else "tpchgen-cli"), "csv", "-s", f"{scale_factor:g}",
               "--tables", "lineitem", "-o", str(partial)]
    subprocess.run(command, check=True, timeout=GENERATE_TIMEOUT_S)
    partial.rename(folder)
    return path


def export(revision: str, folder: Path) -> Path:
    """The src folder of a git revision, exported into folder."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "src"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "src"


def definition(query: str, lineitem: Path) -> dict[str, Any]:
    import tpch_queries

    q = {"q1": tpch_queries.Q1, "q6": tpch_queries.Q6}[query]
    document = tpch_queries.definition(q, lineitem.parent)
    document["sources"] = {"lineitem": {"kind": "csv", "path": str(lineitem), "schema": LINEITEM_SCHEMA}}
    return document


def measure(src: Path, query: str, lineitem: Path) -> dict[str, Any]:
    spec = {"definition": definition(query, lineitem), "base": str(lineitem.parent), "memory": MEMORY_BYTES}
    env = {**os.environ, "PYTHONPATH": str(src)}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{query} with {src} failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - began
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale-factor", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", default=BEFORE_DEFAULT, help="the git revision measured as 'before'")
    parser.add_argument("--after", default=None, help="the git revision measured as 'after' (default: the work tree)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    lineitem = ensure_lineitem(args.scale_factor)
    with tempfile.TemporaryDirectory(prefix="bench-tpch-csv-") as tmp:
        sides = {"before": export(args.before, Path(tmp) / "before"),
                 "after": ROOT / "src" if args.after is None else export(args.after, Path(tmp) / "after")}
        samples: dict[str, dict[str, list[dict[str, Any]]]] = {q: {"before": [], "after": []} for q in QUERIES}
        for r in range(args.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for query in QUERIES:
                for side in order:
                    result = measure(sides[side], query, lineitem)
                    samples[query][side].append(result)
                    print(f"round {r} {query} {side}: {result['execute_s']:.3f} s, cpu {result['cpu_s']:.3f} s",
                          flush=True)
    summary = {}
    for query, by_side in samples.items():
        before = statistics.median(s["execute_s"] for s in by_side["before"])
        after = statistics.median(s["execute_s"] for s in by_side["after"])
        cpu_before = statistics.median(s["cpu_s"] for s in by_side["before"])
        cpu_after = statistics.median(s["cpu_s"] for s in by_side["after"])
        digests = {s["digest"] for side in by_side.values() for s in side}
        summary[query] = {"before_s": before, "after_s": after, "ratio": after / before,
                          "cpu_before_s": cpu_before, "cpu_after_s": cpu_after, "cpu_ratio": cpu_after / cpu_before,
                          "met": after <= TIME_RATIO_MAX * before, "same_answer": len(digests) == 1}
        print(f"{query}: wall before {before:.3f} s, after {after:.3f} s, ratio {after / before:.3f}; cpu before "
              f"{cpu_before:.3f} s, after {cpu_after:.3f} s, ratio {cpu_after / cpu_before:.3f}; "
              f"same answer {len(digests) == 1}")
    RESULT_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULT_PATH.write_text(json.dumps({
        "benchmark": "tpch_csv", "scale_factor": args.scale_factor, "rounds": args.rounds, "before": args.before,
        "after": args.after or "work tree",
        "threads": os.cpu_count(), "memory_bytes": MEMORY_BYTES, "csv_bytes": lineitem.stat().st_size,
        "target": f"after <= {TIME_RATIO_MAX} x before", "summary": summary, "samples": samples,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
