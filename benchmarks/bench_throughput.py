"""Benchmark 2: runs per second and per-run overhead on PostgreSQL, ours against DBOS Transact.

The work is the trivial dataflow (a 1,000-row inline source, one GROUP BY); the peer is a DBOS
workflow with one step doing the same DuckDB query (see peer_dbos.py). Two shapes, each with 1, 2
and 4 worker processes, ours and the peer alternating inside every round:

- ``direct``: every process runs its own runs one after another (ours: ``runs.run_inline``, what
  ``dataflow run`` does; the peer: calling the workflow under ``SetWorkflowID``). Throughput is all
  runs over the wall-clock span from the first start to the last end; latency is per run.
- ``queued``: the parent submits the runs while the workers serve the queue (ours: ``runs.submit``
  and ``dataflow.worker.Worker`` processes with concurrency 1; the peer: ``DBOSClient.enqueue`` and
  DBOS processes serving a ``Queue`` with ``worker_concurrency=1``). Throughput is the runs over the
  span from the first submit until the last run is recorded as succeeded.

Every process does warm-up runs before the clock starts (imports, pools, the DuckDB database).

Ours is measured twice: ``ours`` executes in the calling process (``DATAFLOW_ISOLATION=none``, what
``dataflow run`` does), ``ours_isolated`` in a pooled executor process the OS bounds
(``execution/isolation.py``, what ``dataflow worker`` and ``dataflow serve`` do by default): the
difference is what isolation costs per run. The target (``TARGET_RATIO`` over DBOS) applies to the
isolated figure, the workers' default.

Each round measures every shape and worker count with the server's ``fsync`` off and then on (the
server is restarted between the two; ``common.BenchServer.set_fsync``): ``fsync=on`` is
PostgreSQL's default, where every commit waits for its WAL flush, so a design with fewer commits per
run gains there. A measurement is at least ``RUNS_PER_MEASUREMENT`` runs (direct: split over the
processes), and there are ``ROUNDS`` rounds, ours and DBOS alternating first inside each.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    BenchContext,
    duckdb_group_by_on_shared,
    inline_rows,
    make_request,
    print_table,
    summary,
    write_result,
)

NAME = "throughput"
CONCURRENCY = (1, 2, 4)
FSYNC = (False, True)  # the server's fsync setting, a dimension of every figure
ROUNDS = 7
ROUNDS_QUICK = 1  # a smoke run: both fsync settings make it as long as two rounds were before
WARMUP_RUNS = 3
RUNS_PER_MEASUREMENT = {False: 300, True: 24}  # by quick: at least this many runs per measurement
OUR_POLL_S = 0.01  # our worker's minimum poll interval (dataflow.worker.INTERVAL_S_MIN)
PEER_POLL_S = 0.001  # DBOS's queue poll, set low so its dequeue delay does not cap its throughput
COMPLETION_POLL_S = 0.005
CHILD_TIMEOUT_S = 600
TARGET_RATIO = 1.5
# ours in process, ours with each execution in an executor process, the peer
SYSTEMS = ("ours", "ours_isolated", "dbos")
OURS = ("ours", "ours_isolated")


def quiet_worker_log() -> None:
    """Silence the worker's per-run info lines: the benchmark prints its own table."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _ours_runner(url: str, base: str, system: str) -> Any:
    from durable_dataflow.dataflow.execution import isolation
    from durable_dataflow.platform import Platform

    isolated = system == "ours_isolated"
    isolation.configure(isolation.Isolation.PROCESS if isolated else isolation.Isolation.NONE)
    platform = Platform(url, migrate=False)
    return platform, lambda key: platform.runs.run_inline(make_request(Path(base), key=key))


def _child_direct(system: str, url: str, base: str, n_runs: int, tag: str, idx: int, barrier: Any, out: Any) -> None:
    if system in OURS:
        platform, do = _ours_runner(url, base, system)
    else:
        import peer_dbos

        peer_dbos.launch(url, f"{tag}-exec-{idx}")
        do = lambda key: peer_dbos.run_once(key, key)  # noqa: E731
    for w in range(WARMUP_RUNS):
        do(f"warm-{tag}-{idx}-{w}")
    barrier.wait()
    latencies = []
    start = time.time()
    for i in range(n_runs):
        began = time.perf_counter()
        do(f"{tag}-{idx}-{i}")
        latencies.append(time.perf_counter() - began)
    out.put((idx, start, time.time(), latencies))
    if system in OURS:
        platform.close()
    else:
        peer_dbos.shutdown()


def _child_queued(system: str, url: str, base: str, tag: str, idx: int, ready: Any, go: Any, stop: Any) -> None:
    if system in OURS:
        from durable_dataflow.dataflow.worker import Worker, WorkerOptions

        platform, do = _ours_runner(url, base, system)
        for w in range(WARMUP_RUNS):
            do(f"warm-{tag}-{idx}-{w}")
        quiet_worker_log()
        worker = Worker(platform.runs, WorkerOptions(concurrency=1, poll_interval_s=OUR_POLL_S))
        threading.Thread(target=lambda: (stop.wait(), worker.request_stop("benchmark done")), daemon=True).start()
        ready.put(idx)
        go.wait()
        worker.run()
        platform.close()
    else:
        import peer_dbos

        peer_dbos.launch(url, f"{tag}-exec-{idx}", queue_poll_s=PEER_POLL_S)
        for w in range(WARMUP_RUNS):
            peer_dbos.run_once(f"warm-{tag}-{idx}-{w}", "warm")
        ready.put(idx)
        stop.wait()
        peer_dbos.shutdown()


def _child_prepare(url: str) -> None:
    import peer_dbos

    peer_dbos.launch(url, "prepare")
    peer_dbos.shutdown()


def prepare_peer(url: str) -> None:
    """Launch DBOS once in a child so its system schema exists before concurrent launches."""
    proc = mp.get_context("spawn").Process(target=_child_prepare, args=(url,))
    proc.start()
    proc.join(CHILD_TIMEOUT_S)
    if proc.exitcode != 0:
        raise RuntimeError(f"DBOS could not launch on the benchmark server (exit {proc.exitcode})")


def check_alive(procs: list[Any]) -> None:
    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
    if dead:
        raise RuntimeError(f"a benchmark child process failed (exit codes {dead}); see its traceback above")


def collect(out: Any, procs: list[Any]) -> list[Any]:
    """One result per child; fails at once when a child dies instead of waiting for the timeout."""
    got: list[Any] = []
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=1.0))
        except queue.Empty:
            check_alive(procs)
            if time.monotonic() > deadline:
                raise TimeoutError("benchmark children did not report") from None
    return got


def wait_ready(ready: Any, procs: list[Any]) -> None:
    """Wait until every child has put its index on ``ready`` (warmed up), failing fast on a death."""
    collect(ready, procs)


def stop_all(procs: list[Any]) -> None:
    for p in procs:
        p.join(CHILD_TIMEOUT_S if p.exitcode is None and not _failed(procs) else 1.0)
        if p.is_alive():
            p.terminate()
            p.join()


def _failed(procs: list[Any]) -> bool:
    return any(p.exitcode not in (None, 0) for p in procs)


def _count_ours(conn: Any, prefix: str) -> int:
    row = conn.execute(
        "select count(*) from dataflow_runs where status = 'succeeded' and idempotency_key like %s", (prefix + "%",)
    ).fetchone()
    return int(row[0]) if row else 0


def _direct(ctx: BenchContext, system: str, url: str, base: str, n: int, tag: str) -> dict[str, Any]:
    spawn = mp.get_context("spawn")
    barrier, out = spawn.Barrier(n), spawn.Queue()
    runs = -(-RUNS_PER_MEASUREMENT[ctx.quick] // n)  # per process, rounded up
    procs = [
        spawn.Process(target=_child_direct, args=(system, url, base, runs, tag, i, barrier, out)) for i in range(n)
    ]
    for p in procs:
        p.start()
    try:
        got = collect(out, procs)
    finally:
        stop_all(procs)
    span = max(g[2] for g in got) - min(g[1] for g in got)
    latencies = [x for g in got for x in g[3]]
    runs_done = len(latencies)
    return {"runs": runs_done, "seconds": span, "runs_per_s": runs_done / span, "latency_s": summary(latencies)}


def _queued(ctx: BenchContext, system: str, url: str, base: str, n: int, tag: str) -> dict[str, Any]:
    spawn = mp.get_context("spawn")
    ready, go, stop = spawn.Queue(), spawn.Event(), spawn.Event()
    procs = [spawn.Process(target=_child_queued, args=(system, url, base, tag, i, ready, go, stop)) for i in range(n)]
    for p in procs:
        p.start()
    total = RUNS_PER_MEASUREMENT[ctx.quick]
    keys = [f"{tag}-{i}" for i in range(total)]
    dbname = url.rsplit("/", 1)[1]
    try:
        wait_ready(ready, procs)
        go.set()
        start = time.time()
        if system in OURS:
            from durable_dataflow.platform import Platform

            with Platform(url, migrate=False) as platform:
                for key in keys:
                    platform.runs.submit(make_request(Path(base), key=key))
        else:
            import peer_dbos

            peer_dbos.enqueue_many(url, keys)
        submitted = time.time()
        with ctx.server.connect(dbname) as conn:
            count = _count_ours if system in OURS else peer_dbos_count
            deadline = time.monotonic() + CHILD_TIMEOUT_S
            while count(conn, f"{tag}-") < total:
                check_alive(procs)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{system} queued runs did not finish")
                time.sleep(COMPLETION_POLL_S)
        end = time.time()
    finally:
        stop.set()
        stop_all(procs)
    span = end - start
    return {"runs": total, "seconds": span, "submit_seconds": submitted - start, "runs_per_s": total / span}


def peer_dbos_count(conn: Any, prefix: str) -> int:
    import peer_dbos

    return peer_dbos.count_succeeded(conn, prefix)


def _work_only(rounds: int) -> dict[str, Any]:
    """The work itself, without any orchestration: build the table, run the query, encode IPC."""
    import pyarrow as pa

    rows = inline_rows()
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    samples = []
    for _ in range(max(rounds, 20)):
        began = time.perf_counter()
        duckdb_group_by_on_shared(pa.Table.from_pylist(rows, schema=schema))
        samples.append(time.perf_counter() - began)
    return summary(samples)


def _rounds(ctx: BenchContext) -> int:
    return ROUNDS_QUICK if ctx.quick else ROUNDS


def run(ctx: BenchContext) -> dict[str, Any]:
    from durable_dataflow.platform import Platform

    ours_url = ctx.new_database("bench_tp_ours")
    peer_url = ctx.new_database("bench_tp_dbos")
    Platform(ours_url).close()  # migrate once, before any worker starts
    prepare_peer(peer_url)
    base = tempfile.mkdtemp(prefix="bench-tp-", dir=ctx.workdir)
    samples: dict[str, list[dict[str, Any]]] = {}
    try:
        for r in range(_rounds(ctx)):
            order = SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[:r % len(SYSTEMS)]  # each goes first in turn
            for fsync in FSYNC:
                ctx.server.set_fsync(fsync)
                assert ctx.server.fsync_setting() == ("on" if fsync else "off")
                for n in CONCURRENCY:
                    for shape, fn in (("direct", _direct), ("queued", _queued)):
                        for system in order:
                            url = ours_url if system in OURS else peer_url
                            tag = f"r{r}-{_fsync_name(fsync)}-{shape}-{n}-{system}"
                            result = fn(ctx, system, url, base, n, tag)
                            samples.setdefault(f"{_fsync_name(fsync)}/{shape}/{n}/{system}", []).append(result)
                            print(f"  round {r} {_fsync_name(fsync)} {shape} n={n} {system}: "
                                  f"{result['runs_per_s']:.1f} runs/s")  # fmt: skip
    finally:
        ctx.server.set_fsync(False)  # the other benchmarks' setting
    return _report(ctx, samples, _work_only(_rounds(ctx)))


def _fsync_name(fsync: bool) -> str:
    return "fsync_on" if fsync else "fsync_off"


def _median_of(rounds: list[dict[str, Any]], field: str) -> float:
    return statistics.median([s["latency_s"][field] for s in rounds])


def _entry(samples: dict[str, list[dict[str, Any]]], key: str, work: dict[str, Any]) -> dict[str, Any]:
    ours = [s["runs_per_s"] for s in samples[f"{key}/ours"]]
    isolated = [s["runs_per_s"] for s in samples[f"{key}/ours_isolated"]]
    peer = [s["runs_per_s"] for s in samples[f"{key}/dbos"]]
    ratio = statistics.median(ours) / statistics.median(peer)
    ratio_isolated = statistics.median(isolated) / statistics.median(peer)
    entry: dict[str, Any] = {
        "ours_runs_per_s": summary(ours),
        "ours_isolated_runs_per_s": summary(isolated),
        "dbos_runs_per_s": summary(peer),
        "ratio_ours_over_dbos": ratio,
        "ratio_isolated_over_dbos": ratio_isolated,
        "isolation_cost_ratio": statistics.median(isolated) / statistics.median(ours),
        "target_ratio": TARGET_RATIO,
        "target_met": ratio_isolated >= TARGET_RATIO,  # isolation is the workers' and the server's default
        "rounds": {system: samples[f"{key}/{system}"] for system in SYSTEMS},
    }
    if "/direct/" in key:  # per-run latency: medians over rounds of each round's p50 and p95
        for system in SYSTEMS:
            p50 = _median_of(samples[f"{key}/{system}"], "median")
            entry[f"{system}_latency_p50_s"] = p50
            entry[f"{system}_latency_p95_s"] = _median_of(samples[f"{key}/{system}"], "p95")
            entry[f"{system}_overhead_per_run_s"] = p50 - work["median"]
        entry["overhead_ratio_ours_over_dbos"] = entry["ours_overhead_per_run_s"] / entry["dbos_overhead_per_run_s"]
    return entry


def _report(ctx: BenchContext, samples: dict[str, list[dict[str, Any]]], work: dict[str, Any]) -> dict[str, Any]:
    rows, latency_rows, table = [], [], {}
    for fsync in FSYNC:
        name = _fsync_name(fsync)
        for shape in ("direct", "queued"):
            for n in CONCURRENCY:
                key = f"{name}/{shape}/{n}"
                entry = table[key] = _entry(samples, key, work)
                rows.append((name, shape, n, entry["ours_runs_per_s"]["median"],
                             entry["ours_isolated_runs_per_s"]["median"], entry["dbos_runs_per_s"]["median"],
                             entry["ratio_ours_over_dbos"], entry["ratio_isolated_over_dbos"],
                             entry["target_met"]))  # fmt: skip
                if shape == "direct":
                    latency_rows.append((
                        name, n, entry["ours_latency_p50_s"] * 1e3, entry["ours_latency_p95_s"] * 1e3,
                        entry["ours_isolated_latency_p50_s"] * 1e3,
                        entry["dbos_latency_p50_s"] * 1e3, entry["dbos_latency_p95_s"] * 1e3,
                        entry["ours_overhead_per_run_s"] * 1e3, entry["dbos_overhead_per_run_s"] * 1e3,
                        entry["overhead_ratio_ours_over_dbos"],
                    ))  # fmt: skip
    print_table(
        "Throughput, runs/s (median of rounds; PostgreSQL)",
        ["fsync", "shape", "workers", "ours in process", "ours isolated", "DBOS", "in process/DBOS",
         "isolated/DBOS", f"isolated >= {TARGET_RATIO}x"],
        rows,
    )
    print_table(
        f"Per-run latency, direct (ms; medians of rounds; work alone {work['median'] * 1e3:.2f} ms)",
        ["fsync", "processes", "ours p50", "ours p95", "isolated p50", "DBOS p50", "DBOS p95", "ours overhead",
         "DBOS overhead",
         "overhead ours/DBOS"],
        latency_rows,
    )  # fmt: skip
    payload = {
        "rounds": _rounds(ctx),
        "work_only_s": work,
        "settings": {
            "fsync": {_fsync_name(f): f for f in FSYNC},
            "synchronous_commit": "on (the default)",
            "runs_per_measurement": RUNS_PER_MEASUREMENT[ctx.quick],
            "direct_runs_per_process": {n: -(-RUNS_PER_MEASUREMENT[ctx.quick] // n) for n in CONCURRENCY},
            "warmup_runs_per_process": WARMUP_RUNS,
            "our_worker_poll_s": OUR_POLL_S,
            "dbos_queue_poll_s": PEER_POLL_S,
            "overhead": "latency p50 minus the work alone (table + GROUP BY, work_only_s median)",
        },
        "results": table,
    }
    write_result(NAME, payload, ctx.server, ctx.quick)
    return payload
