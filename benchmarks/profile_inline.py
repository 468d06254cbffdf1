"""Profile the per-run path on PostgreSQL, for docs/performance.md ("Where a run's time goes").

    .venv/bin/python benchmarks/profile_inline.py [runs]                # cProfile of run_inline
    .venv/bin/python benchmarks/profile_inline.py --statements [runs]   # per-statement table, inline and queued
    .venv/bin/python benchmarks/profile_inline.py --loop [runs]         # no profiler: for py-spy (below)
    .venv/bin/python benchmarks/profile_inline.py --loop --worker [runs]
    .venv/bin/py-spy record -r 400 -o inline.svg -- .venv/bin/python benchmarks/profile_inline.py --loop 300
    .venv/bin/py-spy record -r 400 -o worker.svg -- .venv/bin/python benchmarks/profile_inline.py --loop --worker 300
    .venv/bin/py-spy record -r 400 --subprocesses -o isolated.svg -- .venv/bin/python benchmarks/profile_inline.py \
        --loop --isolated 300

Each starts its own throwaway server (``--fsync`` turns fsync on), warms up, then runs the trivial
dataflow: inline (``runs.run_inline``, what ``dataflow run`` does) or, with ``--worker``, submitted
first and served by an in-process :class:`~durable_dataflow.dataflow.worker.Worker` (concurrency 1,
10 ms poll) until idle. ``--statements`` prints, per transaction, each SQL statement's count and
time per run (``statements.py``): inline runs, then queued ones (submit, ``claim_next``, ``execute``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_server, make_request

RUNS_DEFAULT = 50
WARMUP_RUNS = 5
TOP = 25
WORKER_POLL_S = 0.01


def _inline(platform: Any, base: Path, prefix: str) -> Callable[[int], Any]:
    return lambda i: platform.runs.run_inline(make_request(base, key=f"{prefix}-{i}"))


def _queued(platform: Any, base: Path, prefix: str) -> Callable[[int], Any]:
    def one(i: int) -> Any:
        platform.runs.submit(make_request(base, key=f"{prefix}-{i}"))
        claim = platform.runs.claim_next()
        assert claim is not None
        return platform.runs.execute(claim)

    return one


def _cprofile(platform: Any, base: Path, runs: int) -> None:
    do = _inline(platform, base, "run")
    for i in range(WARMUP_RUNS):  # first uses import and build what every later run reuses
        do(-1 - i)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for i in range(runs):
        do(i)
    profiler.disable()
    elapsed = time.perf_counter() - started
    print(f"{runs} inline atomic runs: {elapsed / runs * 1e3:.2f} ms per run (under the profiler)")
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("cumulative").print_stats(TOP)
    stats.sort_stats("tottime").print_stats(TOP)


def _statements(platform: Any, base: Path, runs: int) -> None:
    import statements

    log = statements.StatementLog(platform.db.engine)
    paths = (("inline atomic (run_inline)", _inline), ("queued atomic (submit, claim_next, execute)", _queued))
    for name, make in paths:
        do = make(platform, base, name[:6])
        for i in range(WARMUP_RUNS):
            do(-1 - i)
        started = time.perf_counter()
        with log.recording():
            for i in range(runs):
                do(i)
        elapsed = time.perf_counter() - started
        print(f"\n### {name}: {runs} runs, {elapsed / runs * 1e3:.2f} ms per run (with the statement log)\n")
        print(statements.markdown(statements.breakdown(log, runs)))


def _loop(platform: Any, base: Path, runs: int, worker: bool) -> None:
    do = _inline(platform, base, "warm")
    for i in range(WARMUP_RUNS):
        do(i)
    started = time.perf_counter()
    if not worker:
        do = _inline(platform, base, "run")
        for i in range(runs):
            do(i)
    else:
        import logging

        import structlog

        from durable_dataflow.dataflow.worker import Worker, WorkerOptions

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        for i in range(runs):
            platform.runs.submit(make_request(base, key=f"queued-{i}"))
        submitted = time.perf_counter()
        print(f"{runs} submits: {(submitted - started) / runs * 1e3:.2f} ms each")
        started = submitted
        Worker(platform.runs, WorkerOptions(until_idle=True, poll_interval_s=WORKER_POLL_S)).run()
    elapsed = time.perf_counter() - started
    print(f"{runs} runs ({'worker' if worker else 'inline'}): {elapsed / runs * 1e3:.2f} ms per run")


def main() -> None:
    from durable_dataflow.platform import Platform

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="?", type=int, default=RUNS_DEFAULT)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--statements", action="store_true", help="per-statement table of each transaction")
    mode.add_argument("--loop", action="store_true", help="just run (for py-spy record)")
    parser.add_argument("--worker", action="store_true", help="with --loop: queued runs served by a Worker")
    parser.add_argument("--fsync", action="store_true", help="run the server with fsync=on")
    parser.add_argument("--isolated", action="store_true",
                        help="each execution in a pooled executor process (what workers and serve do); "
                             "py-spy needs --subprocesses to sample the executor")
    args = parser.parse_args()
    from durable_dataflow.dataflow.execution import isolation

    isolation.configure(isolation.Isolation.PROCESS if args.isolated else isolation.Isolation.NONE)
    with tempfile.TemporaryDirectory() as workdir, bench_server(fsync=args.fsync) as server:
        url = server.create_database("bench_profile")
        with Platform(url) as platform:
            base = Path(workdir)
            if args.statements:
                _statements(platform, base, args.runs)
            elif args.loop:
                _loop(platform, base, args.runs, args.worker)
            else:
                _cprofile(platform, base, args.runs)


if __name__ == "__main__":
    main()
