"""Benchmark 3: replay of an existing idempotency key, ours against DBOS's replay of a workflow ID.

Ours: ``runs.submit`` with the key (and request) of a finished run returns the existing run. The
peer: calling the workflow again under ``SetWorkflowID`` of a finished workflow returns its
recorded result. Latency per replay, and write transactions (WAL COMMIT records) over all replays
of a round: ours must write nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_commits import _wal_commits, _wal_lsn
from bench_throughput import collect, prepare_peer, stop_all
from common import BenchContext, make_request, print_table, summary, write_result

NAME = "replay"
REPLAYS = {False: 300, True: 50}
WARMUP = 20
TARGET_RATIO = 0.5  # our median latency at most half of DBOS's


def _child_peer(url: str, n: int, ready: Any, go: Any, out: Any) -> None:
    import peer_dbos

    peer_dbos.launch(url, f"replay-{time.time_ns()}")
    workflow_id = f"replay-{time.time_ns()}"
    peer_dbos.run_once(workflow_id, "x")
    for _ in range(WARMUP):
        peer_dbos.run_once(workflow_id, "x")
    ready.put(0)
    go.wait()
    latencies = []
    for _ in range(n):
        began = time.perf_counter()
        peer_dbos.run_once(workflow_id, "x")
        latencies.append(time.perf_counter() - began)
    out.put(latencies)
    peer_dbos.shutdown()


def _peer_round(ctx: BenchContext, url: str) -> tuple[list[float], int]:
    spawn = mp.get_context("spawn")
    ready, go, out = spawn.Queue(), spawn.Event(), spawn.Queue()
    proc = spawn.Process(target=_child_peer, args=(url, REPLAYS[ctx.quick], ready, go, out))
    proc.start()
    try:
        collect(ready, [proc])
        lsn0 = _wal_lsn(ctx)
        go.set()
        latencies = collect(out, [proc])[0]
        lsn1 = _wal_lsn(ctx)
    finally:
        stop_all([proc])
    return latencies, _wal_commits(ctx, lsn0, lsn1)


def _ours_round(ctx: BenchContext, platform: Any, base: Path, r: int) -> tuple[list[float], int]:
    request = make_request(base, key=f"replay-{r}")
    platform.runs.run_inline(request)
    for _ in range(WARMUP):
        platform.runs.submit(request)
    lsn0 = _wal_lsn(ctx)
    latencies = []
    for _ in range(REPLAYS[ctx.quick]):
        began = time.perf_counter()
        submission = platform.runs.submit(request)
        latencies.append(time.perf_counter() - began)
        assert not submission.created
    lsn1 = _wal_lsn(ctx)
    return latencies, _wal_commits(ctx, lsn0, lsn1)


def run(ctx: BenchContext) -> dict[str, Any]:
    from durable_dataflow.platform import Platform

    ours_url = ctx.new_database("bench_replay_ours")
    peer_url = ctx.new_database("bench_replay_dbos")
    with ctx.server.connect("postgres") as conn:
        conn.execute("create extension if not exists pg_walinspect")
    prepare_peer(peer_url)
    base = Path(tempfile.mkdtemp(prefix="bench-replay-", dir=ctx.workdir))
    ours_med, peer_med, ours_writes, peer_writes = [], [], [], []
    ours_all: list[float] = []
    peer_all: list[float] = []
    with Platform(ours_url) as platform:
        for r in range(ctx.rounds):
            for system in (("ours", "dbos") if r % 2 == 0 else ("dbos", "ours")):
                if system == "ours":
                    lat, writes = _ours_round(ctx, platform, base, r)
                    ours_med.append(statistics.median(lat))
                    ours_writes.append(writes)
                    ours_all.extend(lat)
                else:
                    lat, writes = _peer_round(ctx, peer_url)
                    peer_med.append(statistics.median(lat))
                    peer_writes.append(writes / REPLAYS[ctx.quick])
                    peer_all.extend(lat)
    ratio = statistics.median(ours_med) / statistics.median(peer_med)
    met = ratio <= TARGET_RATIO and max(ours_writes) == 0
    payload = {
        "rounds": ctx.rounds,
        "replays_per_round": REPLAYS[ctx.quick],
        "ours_latency_s": {"round_medians": ours_med, **summary(ours_all)},
        "dbos_latency_s": {"round_medians": peer_med, **summary(peer_all)},
        "ours_write_transactions_per_round": ours_writes,
        "dbos_write_transactions_per_replay": peer_writes,
        "ratio_ours_over_dbos": ratio,
        "target": f"0 write transactions and latency <= {TARGET_RATIO}x DBOS",
        "target_met": met,
    }
    print_table(
        "Replay of an existing key (PostgreSQL)",
        ["", "median ms", "p95 ms", "write txns per replay", "ours/DBOS", "target"],
        [
            ("ours", statistics.median(ours_med) * 1e3, summary(ours_all)["p95"] * 1e3,
             max(ours_writes) / REPLAYS[ctx.quick], ratio, met),
            ("DBOS", statistics.median(peer_med) * 1e3, summary(peer_all)["p95"] * 1e3,
             statistics.median(peer_writes), "", ""),
        ],
    )  # fmt: skip
    write_result(NAME, payload, ctx.server, ctx.quick)
    return payload
