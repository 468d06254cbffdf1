"""Profile the per-run path of an inline atomic run on PostgreSQL (cProfile), for docs/performance.md.

    .venv/bin/python benchmarks/profile_inline.py [runs]

Starts its own throwaway server, warms up, then profiles ``runs.run_inline`` of the trivial
dataflow and prints the top functions by cumulative and by own time.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_server, make_request

RUNS_DEFAULT = 50
WARMUP_RUNS = 5
TOP = 25


def main() -> None:
    from durable_dataflow.platform import Platform

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else RUNS_DEFAULT
    with tempfile.TemporaryDirectory() as workdir, bench_server() as server:
        url = server.create_database("bench_profile")
        with Platform(url) as platform:
            base = Path(workdir)
            for i in range(WARMUP_RUNS):
                platform.runs.run_inline(make_request(base, key=f"warm-{i}"))
            profiler = cProfile.Profile()
            started = time.perf_counter()
            profiler.enable()
            for i in range(runs):
                platform.runs.run_inline(make_request(base, key=f"run-{i}"))
            profiler.disable()
            elapsed = time.perf_counter() - started
    print(f"{runs} inline atomic runs: {elapsed / runs * 1e3:.2f} ms per run (under the profiler)")
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("cumulative").print_stats(TOP)
    stats.sort_stats("tottime").print_stats(TOP)


if __name__ == "__main__":
    main()
