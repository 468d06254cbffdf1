"""Where the machine's CPU goes while K worker processes drain N queued trivial runs.

Submits N runs of the benchmark's trivial definition, then starts K ``dataflow.worker.Worker``
processes (concurrency 1, 10 ms poll, in process or isolated) that drain the queue until idle, and
prints the runs a second, the machine's busy share (``/proc/stat``) and the CPU a run costs per kind of
process: the workers, their executor processes (forkserver children), PostgreSQL's backends, the rest.
Unlike ``bench_throughput`` nothing submits while the workers run, so the figure is the drain alone::

    .venv/bin/python benchmarks/profile_drain.py --isolated 4 600
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import bench_server, make_request

WARMUP_RUNS = 5
TIMEOUT_S = 600


def _machine_cpu() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine since boot."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]
    return sum(ticks) - idle, sum(ticks)


def _cpu_by_kind() -> dict[tuple[str, str], int]:
    """Clock ticks of every process, keyed by (pid, kind)."""
    ticks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                fields, command = stat.read().rsplit(")", 1)[1].split(), cmdline.read().decode(errors="replace")
        except OSError:
            continue
        if "forkserver" in command:
            kind = "executors"
        elif "multiprocessing.spawn" in command:
            kind = "workers"
        elif "postgres" in command:
            kind = "postgres"
        else:
            kind = "rest"
        ticks[(pid, kind)] = int(fields[11]) + int(fields[12])
    return ticks


def _worker(url: str, base: str, isolated: bool, started: Any, ended: Any, leave: Any) -> None:
    import logging

    import structlog

    from durable_dataflow.dataflow.execution import isolation
    from durable_dataflow.dataflow.worker import Worker, WorkerOptions
    from durable_dataflow.platform import Platform

    isolation.configure(isolation.Isolation.PROCESS if isolated else isolation.Isolation.NONE)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    platform = Platform(url, migrate=False)
    for i in range(WARMUP_RUNS):  # the imports, the executor, the pools
        platform.runs.run_inline(make_request(Path(base), key=f"warm-{os.getpid()}-{i}"))
    started.wait()
    Worker(platform.runs, WorkerOptions(until_idle=True, concurrency=1, poll_interval_s=0.01)).run()
    ended.put(time.time())
    leave.wait(TIMEOUT_S)  # the executors live until the parent has read their CPU


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workers", type=int)
    parser.add_argument("runs", type=int)
    parser.add_argument("--isolated", action="store_true", help="each execution in an executor process")
    args = parser.parse_args()
    from durable_dataflow.platform import Platform

    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as base, bench_server() as server:
        url = server.create_database("drain")
        with Platform(url) as platform:
            for i in range(args.runs):
                platform.runs.submit(make_request(Path(base), key=f"drain-{i}"))
        started, ended, leave = spawn.Barrier(args.workers + 1), spawn.Queue(), spawn.Event()
        procs = [spawn.Process(target=_worker, args=(url, base, args.isolated, started, ended, leave))
                 for _ in range(args.workers)]  # fmt: skip
        for proc in procs:
            proc.start()
        started.wait()
        began, machine_before, before = time.time(), _machine_cpu(), _cpu_by_kind()
        finished = max(ended.get(timeout=TIMEOUT_S) for _ in procs)
        machine_after, after = _machine_cpu(), _cpu_by_kind()
        leave.set()
        for proc in procs:
            proc.join()
    hz, n = os.sysconf("SC_CLK_TCK"), args.runs
    per_kind: collections.Counter[str] = collections.Counter()
    for key, ticks in after.items():
        per_kind[key[1]] += ticks - before.get(key, 0)
    busy, total = machine_after[0] - machine_before[0], machine_after[1] - machine_before[1]
    mode = "isolated" if args.isolated else "in process"
    print(f"{mode}, {args.workers} workers, {n} runs: {n / (finished - began):.1f} runs/s, machine busy "
          f"{100 * busy / total:.0f} %, {busy / hz * 1000 / n:.2f} ms of CPU a run: "
          + ", ".join(f"{kind} {ticks / hz * 1000 / n:.2f}" for kind, ticks in sorted(per_kind.items())))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
