"""Benchmark 4: recovery latency after a worker is SIGKILLed mid-run, for lease TTLs of 2, 5, 10, 30 s.

Per round: worker B (``dataflow worker``, sweep interval 1 s) is started and then paused with
SIGSTOP while idle; a run is submitted; worker A (``dataflow worker --once`` with
``DATAFLOW_CRASH_AT=during_execution``) claims it and SIGKILLs itself mid-execution; B is resumed
at once. Recovery latency is from A's death (observed by the parent) to the ``attempt.started``
entry of attempt 2 (its ``recorded_at_us``, database clock on this same host).

On PostgreSQL the dead worker's session, and with it its holder lock, ends at once (core/holders.py),
so B's next sweep decides the attempt whatever the TTL. Target (issue 15): at most 1 s at every TTL,
30 s included. (Before holder locks the bound was TTL + 10% + one sweep interval: 2.1 / 5.2 / 10.4 s.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import BenchContext, make_request, print_table, summary, write_result

NAME = "recovery"
TTLS = {False: (2.0, 5.0, 10.0, 30.0), True: (30.0,)}
SWEEP_INTERVAL_S = 1.0
POLL_INTERVAL_S = 0.05
WORKER_START_S = 3.0  # B's imports and first sweep before it is paused
WAIT_MAX_S = 60.0
BOUND_S = 1.0  # a dead holder's attempt is decided by the next sweep, whatever the TTL


def _dataflow_cli() -> str:
    return str(Path(sys.executable).parent / "dataflow")


def _worker(url: str, ttl: float, *, crash: bool) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DATAFLOW_DB": url}
    env.pop("DATAFLOW_CRASH_AT", None)
    args = [_dataflow_cli(), "worker", "--lease-ttl", str(ttl), "--sweep-interval", str(SWEEP_INTERVAL_S),
            "--poll-interval", str(POLL_INTERVAL_S)]  # fmt: skip
    if crash:
        env["DATAFLOW_CRASH_AT"] = "during_execution"
        args.append("--once")
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _attempt_started_us(conn: Any, run_id: str, attempt: int) -> int | None:
    row = conn.execute(
        "select recorded_at_us from ledger_entries where module = 'dataflow' and subject_id = %s "
        "and kind = 'attempt.started' and attempt = %s",
        (run_id, attempt),
    ).fetchone()
    return int(row[0]) if row else None


def _round(ctx: BenchContext, platform: Any, url: str, base: Path, ttl: float, key: str) -> dict[str, float]:
    dbname = url.rsplit("/", 1)[1]
    sweeper = _worker(url, ttl, crash=False)
    try:
        time.sleep(WORKER_START_S)  # let B start up and go idle; nothing is queued yet
        sweeper.send_signal(signal.SIGSTOP)
        run_id = platform.runs.submit(make_request(base, key=key)).run.run_id
        crasher = _worker(url, ttl, crash=True)
        crasher.wait(WAIT_MAX_S)
        killed_us = time.time_ns() // 1000
        if crasher.returncode != -signal.SIGKILL:
            raise RuntimeError(f"worker A exited {crasher.returncode}, expected SIGKILL at during_execution")
        sweeper.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + WAIT_MAX_S
        with ctx.server.connect(dbname) as conn:
            first = _attempt_started_us(conn, run_id, 1)
            second = None
            while second is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"attempt 2 of {run_id} did not start within {WAIT_MAX_S}s")
                time.sleep(0.02)
                second = _attempt_started_us(conn, run_id, 2)
    finally:
        sweeper.send_signal(signal.SIGCONT)
        sweeper.terminate()
        sweeper.wait(WAIT_MAX_S)
    assert first is not None
    return {"from_kill_s": (second - killed_us) / 1e6, "from_attempt1_start_s": (second - first) / 1e6}


def run(ctx: BenchContext) -> dict[str, Any]:
    from durable_dataflow.platform import Platform

    base = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=ctx.workdir))
    results: dict[str, Any] = {}
    rows = []
    for ttl in TTLS[ctx.quick]:
        url = ctx.new_database(f"bench_recovery_{int(ttl)}")
        samples = []
        with Platform(url) as platform:
            for r in range(ctx.rounds):
                samples.append(_round(ctx, platform, url, base, ttl, f"recovery-{ttl}-{r}"))
        bound = BOUND_S
        from_kill = summary([s["from_kill_s"] for s in samples])
        met = from_kill["max"] <= bound
        results[f"ttl_{ttl:g}s"] = {
            "lease_ttl_s": ttl,
            "sweep_interval_s": SWEEP_INTERVAL_S,
            "bound_s": bound,
            "from_kill_s": from_kill,
            "from_attempt1_start_s": summary([s["from_attempt1_start_s"] for s in samples]),
            "rounds": samples,
            "target_met": met,
        }
        rows.append((f"{ttl:g}", from_kill["median"], from_kill["p95"], from_kill["max"], bound, met))
    print_table(
        "Recovery latency after SIGKILL mid-run (s, kill -> attempt 2 started)",
        ["lease TTL", "median", "p95", "max", "bound", "target (max within bound)"],
        rows,
    )
    payload = {"rounds": ctx.rounds, "results": results}
    write_result(NAME, payload, ctx.server, ctx.quick)
    return payload
