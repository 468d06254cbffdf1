"""Soak test (`make soak`): many runs, several workers, random crash and pause points, then a checker.

    .venv/bin/python scripts/soak.py [--runs 500] [--workers 4] [--seed S] [--lease-ttl 2] [--db URL]

It starts a throwaway PostgreSQL cluster (tests/support/pg.py) unless --db names a PostgreSQL
database, submits --runs runs (half atomic; the other half forward-recovery, in turn to each of the
three sinks: a Parquet folder, a Delta table and a PostgreSQL table in a second database of the same
server, or --sink-db; a few through `dataflow submit` killed at `after_record`), and keeps --workers
worker processes alive.
Each new worker draws (from the seeded generator) one of: no fault (it is sent SIGTERM after a
random lifetime), a crash point (DATAFLOW_CRASH_AT: SIGKILL there), or a pause point
(DATAFLOW_PAUSE_AT: SIGSTOP there; the soak sends SIGCONT once the lease has expired). When every
run is terminal, the checker reads the ledger, the run projection, the stored results and the
sink and counts violations of DESIGN §7 invariants 3, 6, 7, 8 and 9 (tests/faults/harness.py).
It prints the seed, the runs per second, the runs per final state (per kind of run) and the
violations, and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from durable_dataflow.dataflow import crashpoints as cp  # noqa: E402
from faults import harness  # noqa: E402
from support.pg import PostgresServer  # noqa: E402

RUNS_DEFAULT = 500
WORKERS_DEFAULT = 4
LEASE_TTL_S_DEFAULT = 2.0
DEADLINE_S_BASE = 600.0  # the default deadline: this, plus DEADLINE_S_PER_RUN for each run
DEADLINE_S_PER_RUN = 0.5  # ten times the pace seen here (≈ 20 runs/s with 4 workers)
PROVIDERS = ("parquet", "delta", "postgres")  # the forward runs publish to each in turn
SINK_SECRET = "SOAK_SINK_DSN"  # the secret the PostgreSQL-table target's DSN is read from
SUBMIT_CRASHES = 5  # runs submitted through `dataflow submit` killed after the record commit
FAULT_SHARE = 0.5  # of new workers: half run clean, a quarter crash, a quarter pause
LIFETIME_S = (3.0, 8.0)  # a clean worker is sent SIGTERM after this long (drains, then exits)
RESUME_AFTER_EXPIRY_S = (0.2, 2.0)  # a paused worker is resumed this long after its lease expired
SUPERVISOR_POLL_S = 0.1
VIOLATIONS_SHOWN_MAX = 30
WORKER_POINTS = tuple(p for p in cp.POINTS if p != cp.AFTER_RECORD)  # after_record is a submit's point


@dataclass
class Slot:
    """One worker process and what the supervisor does with it."""

    proc: subprocess.Popen[bytes]
    fault: str  # "clean" | "crash:<point>" | "pause:<point>"
    started_s: float
    stop_at_s: float | None = None  # clean workers: when to send SIGTERM
    stopped_since_s: float | None = None  # paused workers: when the pause was first seen
    resume_after_s: float = 0.0


@dataclass
class Stats:
    spawned: int = 0
    crashes: dict[str, int] = field(default_factory=dict)
    pauses: dict[str, int] = field(default_factory=dict)
    terminated: int = 0
    exit_codes: dict[int, int] = field(default_factory=dict)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=RUNS_DEFAULT)
    parser.add_argument("--workers", type=int, default=WORKERS_DEFAULT)
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--lease-ttl", type=float, default=LEASE_TTL_S_DEFAULT)
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help=f"seconds before giving up (default {DEADLINE_S_BASE:g} + {DEADLINE_S_PER_RUN:g} per run)",
    )
    parser.add_argument("--db", default=None, help="a PostgreSQL URL (default: a throwaway cluster)")
    parser.add_argument(
        "--sink-db",
        default=None,
        help="an empty PostgreSQL database for the PostgreSQL-table sink (required with --db)",
    )
    args = parser.parse_args(argv)
    if args.db and not args.sink_db:
        parser.error("--db needs --sink-db: the PostgreSQL-table sink needs a database of its own")
    if args.deadline is None:
        args.deadline = DEADLINE_S_BASE + DEADLINE_S_PER_RUN * args.runs
    return args


@dataclass(frozen=True)
class Flows:
    """The soak's definitions: one atomic, one forward per sink, and where each sink is read."""

    atomic: Path
    forward: dict[str, Path]  # provider -> definition
    work: Path
    sink_dsn: str

    @classmethod
    def write(cls, work: Path, sink_dsn: str) -> Flows:
        defs = work / "defs"
        forward = {
            "parquet": harness.inline_definition(defs, "soak_parquet", publish_to="sink_parquet"),
            "delta": harness.inline_definition(defs, "soak_delta", publish_to="sink_delta", provider="delta"),
            "postgres": harness.inline_definition(
                defs, "soak_postgres", publish_to="soak_published", provider="postgres",
                options={"dsn": {"secret": SINK_SECRET}},
            ),
        }  # fmt: skip
        return cls(harness.inline_definition(defs, "soak_atomic"), forward, work, sink_dsn)

    def for_run(self, number: int) -> Path:
        """Even runs are atomic; odd runs publish, to each sink in turn."""
        if number % 2 == 0:
            return self.atomic
        return self.forward[PROVIDERS[(number // 2) % len(PROVIDERS)]]

    def publications(self) -> dict[str, list[harness.Publication]]:
        """Every publication each sink holds, read from the sink itself (provider -> publications)."""
        defs = self.work / "defs"
        return {
            "parquet": harness.parquet_publications(defs / "sink_parquet"),
            "delta": harness.delta_publications(defs / "sink_delta"),
            "postgres": harness.postgres_publications(self.sink_dsn),
        }


def submit_all(url: str, runs: int, flows: Flows, ttl_s: float) -> None:
    """Record the runs: most in-process, SUBMIT_CRASHES through a CLI submit killed after its commit."""
    with harness.open_platform(url) as platform:
        for number in range(SUBMIT_CRASHES, runs):
            platform.runs.submit(harness.request_for(flows.for_run(number), {"n": str(number)}, f"k-{number}"))
    env = harness.worker_env(url, lease_ttl_s=ttl_s, crash_at=cp.AFTER_RECORD)
    log = flows.work / "submit.log"
    for number in range(min(SUBMIT_CRASHES, runs)):
        args = ["submit", str(flows.for_run(number)), "--param", f"n={number}", "--idempotency-key", f"k-{number}"]
        code = harness.wait_exit(harness.start(args, env, log), log)
        if code != -signal.SIGKILL:
            raise SystemExit(f"the submit was not killed at after_record (exit {code})")


def spawn(url: str, rng: random.Random, ttl_s: float, log: Path, stats: Stats) -> Slot:
    draw = rng.random()
    crash_at = pause_at = None
    if draw < FAULT_SHARE / 2:
        crash_at = rng.choice(WORKER_POINTS)
        fault = f"crash:{crash_at}"
    elif draw < FAULT_SHARE:
        pause_at = rng.choice(WORKER_POINTS)
        fault = f"pause:{pause_at}"
    else:
        fault = "clean"
    env = harness.worker_env(url, lease_ttl_s=ttl_s, crash_at=crash_at, pause_at=pause_at)
    args = harness.worker_args(concurrency=2, sweep_interval_s=0.5, poll_interval_s=0.1)
    now = time.monotonic()
    stats.spawned += 1
    slot = Slot(harness.start(args, env, log), fault, now)
    if fault == "clean":
        slot.stop_at_s = now + rng.uniform(*LIFETIME_S)
    return slot


def tend(slot: Slot, rng: random.Random, ttl_s: float, stats: Stats) -> bool:
    """Advance one worker's script; True when it has exited (its slot is free)."""
    now = time.monotonic()
    code = slot.proc.poll()
    if code is not None:
        stats.exit_codes[code] = stats.exit_codes.get(code, 0) + 1
        if code == -signal.SIGKILL:
            stats.crashes[slot.fault] = stats.crashes.get(slot.fault, 0) + 1
        return True
    if slot.stop_at_s is not None and now >= slot.stop_at_s:
        slot.proc.send_signal(signal.SIGTERM)
        stats.terminated += 1
        slot.stop_at_s = None
    if harness.is_stopped(slot.proc.pid):
        if slot.stopped_since_s is None:
            slot.stopped_since_s = now
            slot.resume_after_s = ttl_s + rng.uniform(*RESUME_AFTER_EXPIRY_S)
            stats.pauses[slot.fault] = stats.pauses.get(slot.fault, 0) + 1
        elif now - slot.stopped_since_s >= slot.resume_after_s:
            harness.resume(slot.proc)
            slot.stopped_since_s = None
            slot.stop_at_s = now + rng.uniform(*LIFETIME_S)  # resumed workers retire after a while too
    return False


def supervise(url: str, args: argparse.Namespace, rng: random.Random, work: Path, stats: Stats) -> bool:
    """Keep the fleet alive with random faults until every run is terminal; False at the deadline."""
    log = work / "workers.log"
    slots: list[Slot] = []
    deadline = time.monotonic() + args.deadline
    with harness.open_platform(url) as platform:
        while time.monotonic() < deadline:
            slots = [s for s in slots if not tend(s, rng, args.lease_ttl, stats)]
            counts = harness.status_counts(platform.db)
            if not (counts["queued"] or counts["running"]):
                break
            while len(slots) < args.workers:
                slots.append(spawn(url, rng, args.lease_ttl, log, stats))
            time.sleep(SUPERVISOR_POLL_S)  # the supervisor's own pace, not a wait for an order
        else:
            return False
        for slot in slots:  # resume the paused ones so they can try (and fail) their stale writes
            if harness.is_stopped(slot.proc.pid):
                harness.resume(slot.proc)
        harness.stop_fleet([s.proc for s in slots], log)
    return True


def final_states(url: str, flows: Flows) -> dict[str, Counter[str]]:
    """The runs per final state, per kind of run (atomic or the sink it publishes to)."""
    kinds = {flows.atomic.stem: "atomic", **{path.stem: provider for provider, path in flows.forward.items()}}
    found: dict[str, Counter[str]] = {}
    with harness.open_platform(url) as platform:
        for run in harness.all_runs(platform.db):
            found.setdefault(kinds.get(run.definition_name, run.definition_name), Counter())[str(run.status)] += 1
    return found


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"soak: seed {seed}, {args.runs} runs, {args.workers} workers, lease TTL {args.lease_ttl}s", flush=True)
    rng = random.Random(seed)
    server = None if args.db else PostgresServer.launch()
    started = time.monotonic()
    try:
        url = args.db or harness.fresh_database(server, "soak")
        sink_dsn = str(args.sink_db or harness.fresh_database(server, "soak_sink"))
        sink_dsn = sink_dsn.replace("postgresql+psycopg://", "postgresql://")
        os.environ[SINK_SECRET] = sink_dsn  # submits check the target's secret; workers inherit it
        flows = Flows.write(Path(tempfile.mkdtemp(prefix="dataflow-soak-")), sink_dsn)
        submit_all(url, args.runs, flows, args.lease_ttl)
        submitted_s = time.monotonic()
        stats = Stats()
        finished = supervise(url, args, rng, flows.work, stats)
        worked_s = time.monotonic() - submitted_s
        with harness.open_platform(url) as platform:
            published = flows.publications()
            report = harness.check(platform.db, [p for found in published.values() for p in found])
        per_kind = final_states(url, flows)
    finally:
        if server is not None:
            server.destroy()
    total = sum(report.states.values())
    if total != args.runs:
        report.violations.append(f"lost or doubled runs: {total} recorded, {args.runs} submitted")
    if not finished:
        report.violations.append(f"not every run was terminal after {args.deadline}s")
    print(f"soak: {time.monotonic() - started:.1f}s; workers spawned {stats.spawned}, SIGTERMed {stats.terminated}")
    print(f"soak: {total / worked_s:.1f} runs/s ({total} runs in {worked_s:.1f}s from the last submit to the last "
          f"terminal state, faults included)")  # fmt: skip
    print(f"soak: crashes {sum(stats.crashes.values())} {dict(sorted(stats.crashes.items()))}")
    print(f"soak: pauses {sum(stats.pauses.values())} {dict(sorted(stats.pauses.items()))}")
    print(f"soak: worker exit codes {dict(sorted(stats.exit_codes.items()))}; logs in {flows.work}")
    for kind, states in sorted(per_kind.items()):
        sink = f"; {len(published[kind])} publications in the sink" if kind in published else ""
        print(f"soak: {kind}: {dict(sorted(states.items()))}{sink}")
    print(f"soak: {report.summary()}")
    for violation in report.violations[:VIOLATIONS_SHOWN_MAX]:
        print(f"  VIOLATION {violation}")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
