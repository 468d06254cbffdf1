"""Run the benchmarks (``make bench``): one throwaway PostgreSQL server, every benchmark in turn.

    .venv/bin/python benchmarks/run.py                 # all, full size (results/<name>.json)
    .venv/bin/python benchmarks/run.py --quick         # smoke run, small sizes (results/<name>.quick.json)
    .venv/bin/python benchmarks/run.py --only commits,replay

Each benchmark prints a Rich table and writes its JSON to benchmarks/results/. The DBOS peer runs
in the same invocation, alternating with ours, on the same server.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BenchContext, bench_server, console

# In the order they run; ledger_scale last, since it loads a million runs.
BENCHMARKS = (
    "commits", "throughput", "replay", "recovery", "digest", "tpch", "cli_startup", "partitions", "fairness", "s3",
    "ledger_scale",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes, results in *.quick.json")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    args = parser.parse_args(argv)
    chosen = [b.strip() for b in args.only.split(",") if b.strip()] or list(BENCHMARKS)
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}")
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dataflow-bench-") as workdir, bench_server() as server:
        ctx = BenchContext(server=server, quick=args.quick, workdir=Path(workdir))
        for name in chosen:
            console.rule(f"benchmark: {name}")
            started = time.monotonic()
            try:
                importlib.import_module(f"bench_{name}").run(ctx)
            except Exception:
                traceback.print_exc()
                failures.append(name)
            console.print(f"[dim]{name} took {time.monotonic() - started:.1f}s[/dim]")
    if failures:
        console.print(f"[red]failed: {', '.join(failures)}[/red]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
