"""Soak test (`make soak`): many runs, several workers, crashes and pauses in at least one run in ten,
reconciles killed mid-way, replays of the same keys, re-runs of the same partitions, then a checker.

    .venv/bin/python scripts/soak.py [--runs 200] [--workers 4] [--seed S] [--lease-ttl 2] [--db URL]

It starts a throwaway PostgreSQL cluster (tests/support/pg.py) unless --db names a PostgreSQL
database, and a moto_server (tests/support/s3.py: S3 over HTTP on loopback, with conditional writes)
with a bucket for the object-store sink, and plans --runs runs from the seed, in a cycle of twelve:
three atomic, one forward append to each of three local or PostgreSQL sinks (a Parquet folder, a
Delta table, a PostgreSQL table in a second database of the same server, or --sink-db), two forward
appends to a Delta table on the store (`location: s3://bucket/tables/soak_delta_s3`, credentials as
secret references resolved from the environment of every process), one straight to the store
(delta_s3) and one through a FaultProxy (delta_s3_lost), and two forward `mode: replace_partition`
runs to each of two partitioned targets (a Delta table and a PostgreSQL table, `partition: {day:
$day}`), each for one of DAYS days drawn from the seed, so every day of each is re-run many times
under new keys, and runs of one day overlap. Twelve rather than ten: the atomic runs keep their
three slots (cheap, and most of the non-publishing crash points) and every other kind keeps one run
in each cycle (a sixth fewer of each than in a cycle of ten, the fault rate unchanged), while the
store gets two, so that a 200-run soak has some 17 runs of each S3 kind, enough for lost answers to
end outcome_unknown and be reconciled on the store (measured: 5 answers lost, 4 runs reconciled
present from the store; a trial with one S3 slot in a cycle of eleven, half its runs through the
proxy, lost one answer in 60 runs and left no run outcome_unknown). The store's own fault: over and
over, the proxy forwards the next commit of the table made through it (a delta_s3_lost publication,
or its reconcile's fence) and drops its answer, then drops every answer for S3_HEAL_AFTER_S (shorter
than the writer's retries, a retry learns the outcome from the log; longer, the run ends
outcome_unknown and a reconcile decides it from the store), then heals, and re-arms a few seconds
later; it is healed for good when every run is terminal, before the end's reconciles. A run through
the proxy that meets a blackhole before dispatch fails there with nothing written (about half of
them): a store that cannot be listed is never taken for an empty one. The first few runs are
submitted through `dataflow submit` killed at `after_record`; the rest are submitted while the fleet
works (the queue topped up as it drains), each top-up also replaying earlier keys, which must return
the run first recorded for the key.

It keeps --workers worker processes alive. Each new worker is clean or armed with a crash point
(DATAFLOW_CRASH_AT: SIGKILL there) or a pause point (DATAFLOW_PAUSE_AT: SIGSTOP there; SIGCONT once
the lease has expired), drawn from the seeded generator, and armed for certain while the armed
workers that reached their point (plus those that have not yet) are fewer than WORKER_FAULT_AIM of
the runs started, a clean worker then retiring early to make room: the fault rate holds however
fast the machine is. A worker is sent SIGTERM (it drains, cancelling a run it has not authorized)
after RUNS_PER_WORKER finished runs, counted in its own log, not after a time. Meanwhile one
`dataflow reconcile RUN [--resume]` process at a time settles a random `outcome_unknown` (or resumes
a `reconciled_absent`) run, half of them killed mid-way (at `after_inspect`, or for a resume after
its dispatch authorization or its provider call). When every run is terminal the fleet stops and
every run still unresolved (or `reconciled_absent`) is reconciled with `--resume`, without faults,
until none is left; every key is replayed once more (a few through `dataflow submit`).

Then the checker reads the ledger, the run projection, the stored results and the sinks and counts
violations of DESIGN §7 invariants 3, 6, 7, 8 and 9 (tests/faults/harness.py; the S3 table's
publications read from its log with boto3, never delta-rs, as the local Delta table's are from its
folder: each key at most once, a succeeded run's there with its digest, none for a failed, cancelled
or atomic run), of "the S3 table's live rows are exactly the stored result rows of the runs whose
publications it holds" (its data files read with pyarrow from the bytes boto3 fetched, the log whole
from version 0, no commit publishing a key without naming it), of "each partition holds exactly the
rows of exactly one run, the one recorded as its current publication" (the partitioned sinks read by
delta-rs and by SQL; the current publication is the partition's succeeded run with the highest
partition token), and of the replays (another run, or a new one, for a key). It prints the seed, the
runs per second, the faults that hit a run (crashes and pauses of workers, killed submits and
reconciles, answers lost by the store's proxy) and their rate, the reconciles, the runs per final
state (per kind of run), the S3 table's publications, rows and its runs per recovery status, and the
violations. It exits 1 on any violation, and when fewer than one run in ten was hit by a fault
(FAULT_RATE_REQUIRED): a soak that stopped hurting fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
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

import sqlalchemy as sa  # noqa: E402
from soak_flood import FLOOD_RUNS, OWN_TENANT, Flood, fairness_summary, first_claims, flood_runs  # noqa: E402
from soak_lineage import LineageCheck  # noqa: E402

from durable_dataflow.core import crashpoints as cp  # noqa: E402
from durable_dataflow.core import leases  # noqa: E402
from durable_dataflow.core.db import Database  # noqa: E402
from durable_dataflow.dataflow.protocol import runs as runs_module  # noqa: E402
from durable_dataflow.dataflow.protocol.requests import RunRequest  # noqa: E402
from durable_dataflow.dataflow.schema import dataflow_runs  # noqa: E402
from durable_dataflow.platform import Platform  # noqa: E402
from faults import harness  # noqa: E402
from support.pg import PostgresServer  # noqa: E402
from support.s3 import ACCESS_KEY, REGION, SECRET_KEY, FaultProxy, MotoServer  # noqa: E402

RUNS_DEFAULT = 200  # with a fault in one run in ten or more, reconciles and replays: minutes on 2 cores
WORKERS_DEFAULT = 4
LEASE_TTL_S_DEFAULT = 2.0
DEADLINE_S_BASE = 600.0  # the default deadline: this, plus DEADLINE_S_PER_RUN for each run
DEADLINE_S_PER_RUN = 1.0  # several times the pace seen on a shared 2-core machine with the faults below
SINK_SECRET = "SOAK_SINK_DSN"  # the secret the PostgreSQL-table targets' DSN is read from
# The kinds of run, in a cycle of twelve by run number: 3 atomic, 5 appends (one per local or PostgreSQL
# sink, two to the object store's), 4 partitioned.
KIND_CYCLE = (
    "atomic", "parquet", "delta_daily", "delta_s3", "atomic", "delta", "postgres_daily", "delta_s3_lost",
    "atomic", "postgres", "delta_daily", "postgres_daily",
)  # fmt: skip
APPEND_KINDS = ("parquet", "delta", "postgres", "delta_s3", "delta_s3_lost")
# The object-store sink: one Delta table on a moto_server, appended to directly ("delta_s3") and through
# a FaultProxy that loses answers ("delta_s3_lost").
S3_KINDS = ("delta_s3", "delta_s3_lost")
S3_TABLE = "tables/soak_delta_s3"
S3_ACCESS_SECRET = "SOAK_S3_ACCESS_KEY"  # the secrets the S3 targets' credentials are read from
S3_SECRET_SECRET = "SOAK_S3_SECRET_KEY"
S3_LATER_COMMIT = r"/_delta_log/(?!0{20})\d{20}\.json$"  # a commit after the table's creation (version 0)
S3_HEAL_AFTER_S = (1.0, 10.0)  # the proxy, having lost a commit's answer, drops every answer this long:
# shorter than the writer's retries (~4 s), the retry learns the outcome from the log; longer, outcome_unknown
S3_REARM_AFTER_S = (0.0, 4.0)  # then forwards faithfully this long before losing the next commit's answer
PARTITIONED_KINDS = ("delta_daily", "postgres_daily")
PG_APPEND_TABLE = "soak_published"
PG_DAILY_TABLE = "soak_daily"
DAYS = 6  # the partitioned runs' days: 500 runs re-run each day of each partitioned sink ≈ 17 times
FIRST_DAY = dt.date(2026, 11, 1)
SUBMIT_CRASHES = 5  # runs submitted through `dataflow submit` killed after the record commit
QUEUE_LOW = 16  # the supervisor tops the queue up when fewer runs than this are queued
TOPUP = 12  # runs submitted per top-up
REPLAYS_PER_TOPUP = 3  # earlier keys re-submitted with each top-up
CLI_REPLAYS = 4  # keys re-submitted through `dataflow submit --json` at the end
FAULT_RATE_REQUIRED = 0.10  # faults that hit a run, per run: below this the soak fails
WORKER_FAULT_AIM = 0.12  # the supervisor arms workers so that this share of started runs sees a worker hit
FAULT_SHARE = 0.25  # otherwise, the share of new workers armed (half crash, half pause)
# A worker is sent SIGTERM (it drains, then exits) once it has finished this many runs: counted in runs,
# not seconds, so a slow (shared) machine does not cancel more runs, nor a fast one fewer.
RUNS_PER_WORKER = (6, 30)
RUNS_AFTER_PAUSE = 3  # a paused worker, resumed, retires after this many more runs (or its budget, if less)
PAUSES_PER_WORKER = 2  # ... or as it is resumed from this many pauses
RESUME_AFTER_EXPIRY_S = (0.2, 2.0)  # a paused worker is resumed this long after its lease expired
RECONCILE_KILL_SHARE = 0.5  # of the reconciles during the soak: killed at a crash point mid-way
RECONCILE_RESUME_SHARE = 0.5  # of the reconciles of outcome_unknown runs during the soak: with --resume
RECONCILE_WAIT_S = 120.0  # a reconcile process that has not exited by then is a violation
RESUME_POINTS = (cp.AFTER_PREDISPATCH_COMMIT, cp.AFTER_PROVIDER_CALL)  # a resume's points after its authorization
SETTLE_AT_ONCE = 2  # reconcile processes side by side when settling at the end
SETTLE_ROUNDS_MAX = 6
SETTLE_WAIT_S = 60.0  # bound on waiting for a killed reconcile's lease to expire
SUPERVISOR_POLL_S = 0.1
VIOLATIONS_SHOWN_MAX = 30
# Points a worker reaches (after_record is a submit's, after_inspect a reconcile's).
WORKER_POINTS = tuple(p for p in cp.POINTS if p not in (cp.AFTER_RECORD, cp.AFTER_INSPECT))


# Every process the soak started: killed if the soak itself is stopped or fails (see main).
LIVE: list[subprocess.Popen[bytes]] = []


@dataclass(frozen=True)
class Planned:
    """One run of the plan: its key, kind and parameters."""

    number: int
    kind: str
    parameters: dict[str, str]

    @property
    def key(self) -> str:
        return f"k-{self.number}"


def plan(runs: int, seed: int) -> list[Planned]:
    """The runs, from the seed alone: the kind by number, a partitioned run's day drawn."""
    rng = random.Random(f"{seed}:plan")
    planned = []
    for number in range(runs):
        kind = KIND_CYCLE[number % len(KIND_CYCLE)]
        parameters = {"n": str(number)}
        if kind in PARTITIONED_KINDS:
            parameters[harness.PARTITION_COLUMN] = (FIRST_DAY + dt.timedelta(days=rng.randrange(DAYS))).isoformat()
        planned.append(Planned(number, kind, parameters))
    return planned


@dataclass
class Slot:
    """One worker process and what the supervisor does with it."""

    proc: subprocess.Popen[bytes]
    fault: str  # "clean" | "crash:<point>" | "pause:<point>"
    log: Path  # its own log: its `run.finished` lines say how many runs it has finished
    budget: int  # it is sent SIGTERM once it has finished this many runs
    finished: int = 0
    read_to: int = 0  # how far its log has been read
    retiring: bool = False  # sent SIGTERM
    stopped_since_s: float | None = None  # paused workers: when the pause was first seen
    resume_after_s: float = 0.0
    hit: bool = False  # an armed worker reached its point (at least once)
    pauses: int = 0


@dataclass
class Reconciling:
    """One `dataflow reconcile` process of the soak."""

    proc: subprocess.Popen[bytes]
    run_id: str
    point: str | None
    started_s: float


@dataclass
class Stats:
    spawned: int = 0
    armed_by_deficit: int = 0
    workers_hit: int = 0  # armed workers that reached their point (a worker paused twice counts once)
    armed: dict[str, int] = field(default_factory=dict)  # "crash" | "pause" -> workers spawned armed so
    crashes: dict[str, int] = field(default_factory=dict)
    pauses: dict[str, int] = field(default_factory=dict)
    submit_kills: int = 0
    terminated: int = 0
    exit_codes: dict[int, int] = field(default_factory=dict)
    reconciles: int = 0
    reconcile_kills: dict[str, int] = field(default_factory=dict)
    reconcile_exit_codes: dict[int, int] = field(default_factory=dict)
    store_answers_lost: int = 0  # the proxy forwarded a commit to the store and dropped its answer
    settled: dict[int, int] = field(default_factory=dict)  # the end's reconciles: exit code -> count
    replays: int = 0
    cli_replays: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def worker_faults(self) -> int:
        return sum(self.crashes.values()) + sum(self.pauses.values())

    @property
    def faults(self) -> int:
        """Faults that hit a run: a worker killed or stopped at its point (in a run), a submit killed
        after recording its run, a reconcile killed mid-way, a commit's answer lost by the store's proxy."""
        return self.worker_faults + self.submit_kills + sum(self.reconcile_kills.values()) + self.store_answers_lost


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
        "--flood", action="store_true", help="a hostile tenant floods meanwhile (scripts/soak_flood.py)"
    )
    parser.add_argument(
        "--lineage", action="store_true",
        help="every process delivers OpenLineage events to a local receiver; they must equal the ledger's "
        "transitions one for one (scripts/soak_lineage.py)",
    )
    parser.add_argument(
        "--sink-db",
        default=None,
        help="an empty PostgreSQL database for the PostgreSQL-table sinks (required with --db)",
    )
    args = parser.parse_args(argv)
    if args.db and not args.sink_db:
        parser.error("--db needs --sink-db: the PostgreSQL-table sink needs a database of its own")
    if args.runs < SUBMIT_CRASHES:
        parser.error(f"--runs must be at least {SUBMIT_CRASHES}")
    if args.deadline is None:
        flooded = FLOOD_RUNS if args.flood else 0  # the flood's runs are the fleet's work too
        args.deadline = DEADLINE_S_BASE + DEADLINE_S_PER_RUN * (args.runs + flooded)
    return args


class Store:
    """The object-store sink: a moto_server of the soak's own (S3 over HTTP on loopback), a bucket, and a
    FaultProxy in front of it through which the delta_s3_lost runs (and their reconciles) reach the
    store. Over and over, the proxy forwards the next commit of the table (a publication, or a
    reconcile's fence) to the store and drops its answer, then drops every answer for a while, so
    the writer's retries cannot learn the outcome either (the textbook lost answer: the run ends
    outcome_unknown and only the store can tell), then heals, and some seconds later loses the next."""

    def __init__(self, work: Path) -> None:
        self.server = MotoServer(work / "moto.log")
        try:
            self.bucket = self.server.new_bucket()
            self.proxy = FaultProxy(self.server.endpoint.removeprefix("http://")).start()
            # A client that gave up on a slow answer leaves the proxy a broken pipe: to a log, not stderr.
            self._errors = (work / "proxy-errors.log").open("a")
            self.proxy.errors_to(self._errors)
        except BaseException:
            self.server.stop()
            raise
        self.url = f"s3://{self.bucket}/{S3_TABLE}"
        self.armed = False  # the proxy loses the next commit's answer
        self.losing_until_s: float | None = None  # it lost one and drops every answer until then
        self.arm_at_s = 0.0

    def options(self, *, through_proxy: bool) -> dict[str, object]:
        """A target's store options: the endpoint (the store's, or the proxy's), credentials as secrets."""
        return {
            "endpoint": self.proxy.endpoint if through_proxy else self.server.endpoint,
            "allow_http": True,
            "region": REGION,
            "access_key_id": {"secret": S3_ACCESS_SECRET},
            "secret_access_key": {"secret": S3_SECRET_SECRET},
        }

    def tick(self, rng: random.Random, stats: Stats) -> None:
        """Advance the proxy's script: armed -> an answer lost (counted) -> healed -> armed again."""
        now = time.monotonic()
        if self.armed and self.proxy.fired:
            self.armed = False
            stats.store_answers_lost += 1
            self.losing_until_s = now + rng.uniform(*S3_HEAL_AFTER_S)
        elif self.losing_until_s is not None and now >= self.losing_until_s:
            self.heal()
            self.arm_at_s = now + rng.uniform(*S3_REARM_AFTER_S)
        elif not self.armed and self.losing_until_s is None and now >= self.arm_at_s:
            self.proxy.lose_answer("PUT", S3_LATER_COMMIT, then_blackhole=True)
            self.armed = True

    def heal(self) -> None:
        """Every request is forwarded and answered from now on (until the next `tick` arms it again)."""
        self.proxy.heal()
        self.armed, self.losing_until_s = False, None

    def read(self) -> harness.StoreTable:
        """The table as an independent reader sees it: its log and data files fetched with boto3."""
        return harness.delta_store_table(self.server.client(), self.bucket, S3_TABLE)

    def stop(self) -> None:
        self.proxy.stop()
        self.server.stop()
        self._errors.close()


@dataclass(frozen=True)
class Flows:
    """The soak's definitions (one per kind of run) and where each sink is read."""

    definitions: dict[str, Path]  # kind -> definition
    work: Path
    sink_dsn: str
    store: Store

    @classmethod
    def write(cls, work: Path, sink_dsn: str, store: Store) -> Flows:
        defs = work / "defs"
        pg = {"dsn": {"secret": SINK_SECRET}}
        direct, lossy = store.options(through_proxy=False), store.options(through_proxy=True)
        definitions = {
            "atomic": harness.inline_definition(defs, "soak_atomic"),
            "parquet": harness.inline_definition(defs, "soak_parquet", publish_to="sink_parquet"),
            "delta": harness.inline_definition(defs, "soak_delta", publish_to="sink_delta", provider="delta"),
            "postgres": harness.inline_definition(
                defs, "soak_postgres", publish_to=PG_APPEND_TABLE, provider="postgres", options=pg
            ),
            "delta_daily": harness.partitioned_definition(
                defs, "soak_delta_daily", provider="delta", location="sink_delta_daily"
            ),
            "postgres_daily": harness.partitioned_definition(
                defs, "soak_postgres_daily", provider="postgres", location=PG_DAILY_TABLE, options=pg
            ),
            "delta_s3": harness.inline_definition(
                defs, "soak_delta_s3", publish_to=store.url, provider="delta", options=direct
            ),
            "delta_s3_lost": harness.inline_definition(
                defs, "soak_delta_s3_lost", publish_to=store.url, provider="delta", options=lossy
            ),
        }
        return cls(definitions, work, sink_dsn, store)

    def kind_of(self, definition_name: str) -> str:
        return {path.stem: kind for kind, path in self.definitions.items()}.get(definition_name, definition_name)

    def request(self, planned: Planned) -> RunRequest:
        return harness.request_for(self.definitions[planned.kind], planned.parameters, planned.key)

    def publications(self, on_store: harness.StoreTable) -> dict[str, list[harness.Publication]]:
        """Every publication each sink holds, read from the sink itself (kind -> publications; the S3
        table, which both S3 kinds append to, under delta_s3, as ``on_store`` read it)."""
        defs = self.work / "defs"
        in_pg = harness.postgres_publications(self.sink_dsn)
        return {
            "parquet": harness.parquet_publications(defs / "sink_parquet"),
            "delta": harness.delta_publications(defs / "sink_delta"),
            "delta_daily": harness.delta_publications(defs / "sink_delta_daily"),
            "postgres": [p for p in in_pg if PG_DAILY_TABLE not in p.where],
            "postgres_daily": [p for p in in_pg if PG_DAILY_TABLE in p.where],
            "delta_s3": on_store.publications,
        }

    def partition_rows(self) -> dict[str, dict[str, list[harness.Row]]]:
        """Each partitioned sink's rows per day, read by independent readers (kind -> day -> rows)."""
        return {
            "delta_daily": harness.delta_partition_rows(self.work / "defs" / "sink_delta_daily"),
            "postgres_daily": harness.postgres_partition_rows(self.sink_dsn, PG_DAILY_TABLE),
        }


class Keys:
    """The keys submitted so far and the run each was first recorded as: a replay must return that run."""

    def __init__(self, flows: Flows, planned: list[Planned], stats: Stats) -> None:
        self.flows, self.planned, self.stats = flows, planned, stats
        self.run_of: dict[str, str] = {}
        self.next = 0  # the next planned number to submit

    def submit_via_cli_killed(self, url: str, ttl_s: float) -> None:
        """The first SUBMIT_CRASHES runs: `dataflow submit` killed right after its record commit."""
        env = harness.worker_env(url, lease_ttl_s=ttl_s, crash_at=cp.AFTER_RECORD)
        log = self.flows.work / "submit.log"
        for planned in self.planned[:SUBMIT_CRASHES]:
            code = harness.wait_exit(harness.start(self._submit_args(planned), env, log), log)
            if code != -signal.SIGKILL:
                raise SystemExit(f"the submit was not killed at after_record (exit {code})")
            self.stats.submit_kills += 1
        self.next = SUBMIT_CRASHES

    def _submit_args(self, planned: Planned) -> list[str]:
        params = [arg for name, value in planned.parameters.items() for arg in ("--param", f"{name}={value}")]
        return ["submit", str(self.flows.definitions[planned.kind]), *params, "--idempotency-key", planned.key]

    def submit(self, platform: Platform, count: int) -> None:
        for planned in self.planned[self.next : self.next + count]:
            submission = platform.runs.submit(self.flows.request(planned))
            self.expect(planned.key, submission.run.run_id, replayed=not submission.created, how="submit")
            self.next += 1

    def replay(self, platform: Platform, planned: Planned) -> None:
        submission = platform.runs.submit(self.flows.request(planned))
        self.stats.replays += 1
        self.expect(planned.key, submission.run.run_id, replayed=not submission.created, how="replay")

    def expect(self, key: str, run_id: str, *, replayed: bool, how: str) -> None:
        first = self.run_of.setdefault(key, run_id)
        if first != run_id:
            self.stats.violations.append(f"replay: {how} of key {key} returned run {run_id}, first {first}")
        number = int(key.split("-")[1])
        if how != "submit" and not replayed:
            self.stats.violations.append(f"replay: {how} of key {key} recorded a new run {run_id}")
        if how == "submit" and replayed and number >= SUBMIT_CRASHES:
            self.stats.violations.append(f"replay: the first submit of key {key} found a run already ({run_id})")

    def replay_cli(self, url: str, planned: Planned, ttl_s: float) -> None:
        """A replay through `dataflow submit --json`: the same run, `replayed`, exit 0 (or 3 while unresolved)."""
        env = harness.worker_env(url, lease_ttl_s=ttl_s)
        done = subprocess.run(
            [*harness.WORKER_CMD, *self._submit_args(planned), "--json"],
            env=env, cwd=REPO, capture_output=True, timeout=harness.PROCESS_WAIT_S, check=False,
        )  # fmt: skip
        self.stats.cli_replays += 1
        try:
            shown = json.loads(done.stdout)
        except json.JSONDecodeError:
            shown = {}
        if done.returncode not in (0, 3) or not shown.get("replayed"):
            self.stats.violations.append(
                f"replay: `dataflow submit` of key {planned.key} exited {done.returncode}, replayed "
                f"{shown.get('replayed')}"
            )
        if "run_id" in shown:
            self.expect(planned.key, str(shown["run_id"]), replayed=bool(shown.get("replayed")), how="cli replay")


def spawn(url: str, rng: random.Random, ttl_s: float, logs: Path, stats: Stats, deficit: bool) -> Slot:
    """A new worker: armed for certain when worker faults lag the aim, else at random (FAULT_SHARE)."""
    draw, point, crash = rng.random(), rng.choice(WORKER_POINTS), rng.random() < 0.5
    armed = deficit or draw < FAULT_SHARE
    stats.armed_by_deficit += deficit and draw >= FAULT_SHARE
    crash_at = point if armed and crash else None
    pause_at = point if armed and not crash else None
    fault = f"crash:{point}" if crash_at else f"pause:{point}" if pause_at else "clean"
    env = harness.worker_env(url, lease_ttl_s=ttl_s, crash_at=crash_at, pause_at=pause_at)
    args = harness.worker_args(concurrency=2, sweep_interval_s=0.5, poll_interval_s=0.1)
    stats.spawned += 1
    if fault != "clean":
        stats.armed[fault.split(":")[0]] = stats.armed.get(fault.split(":")[0], 0) + 1
    log = logs / f"worker-{stats.spawned}-{fault.replace(':', '-')}.log"
    proc = harness.start(args, env, log)
    LIVE.append(proc)
    return Slot(proc, fault, log, rng.randint(*RUNS_PER_WORKER))


def tend(slot: Slot, rng: random.Random, ttl_s: float, stats: Stats) -> bool:
    """Advance one worker's script; True when it has exited (its slot is free)."""
    now = time.monotonic()
    code = slot.proc.poll()
    if code is not None:
        stats.exit_codes[code] = stats.exit_codes.get(code, 0) + 1
        if code == -signal.SIGKILL and slot.fault.startswith("crash:"):  # the soak never SIGKILLs a worker
            stats.crashes[slot.fault] = stats.crashes.get(slot.fault, 0) + 1
            stats.workers_hit += 1
        return True
    slot.finished += _finished_since(slot)
    if not slot.retiring and slot.finished >= slot.budget and slot.stopped_since_s is None:
        retire(slot, stats)
    if harness.is_stopped(slot.proc.pid):
        if slot.stopped_since_s is None:
            slot.stopped_since_s = now
            stats.workers_hit += not slot.hit
            slot.hit = True
            slot.resume_after_s = ttl_s + rng.uniform(*RESUME_AFTER_EXPIRY_S)
            stats.pauses[slot.fault] = stats.pauses.get(slot.fault, 0) + 1
            slot.pauses += 1
            slot.budget = min(slot.budget, slot.finished + RUNS_AFTER_PAUSE)  # one pause point may be in every run
        elif now - slot.stopped_since_s >= slot.resume_after_s:
            harness.resume(slot.proc)  # it goes on (and pauses again at its point) until its budget is spent
            slot.stopped_since_s = None
            if slot.pauses >= PAUSES_PER_WORKER and not slot.retiring:
                retire(slot, stats)  # a point every run reaches (after_claim) would pause it on every claim
    return False


def retire(slot: Slot, stats: Stats) -> None:
    """SIGTERM: the worker stops claiming, a run it has not authorized yet is cancelled, then it exits."""
    slot.proc.send_signal(signal.SIGTERM)
    stats.terminated += 1
    slot.retiring = True


def lagging(slots: list[Slot], stats: Stats, started: int) -> bool:
    """Whether the armed workers that reached their point, with those still to reach it, are fewer
    than WORKER_FAULT_AIM of the runs started: then the next worker is armed, and a clean one retires.
    (A paused worker may pause again after SIGCONT: each pause is a fault, but paces as one worker.)"""
    return stats.workers_hit + pending_armed(slots) < WORKER_FAULT_AIM * started


def _finished_since(slot: Slot) -> int:
    """The `run.finished` lines its log gained since the last look (a worker's pace, whatever the machine's)."""
    try:
        with slot.log.open("rb") as log:
            log.seek(slot.read_to)
            gained = log.read()
    except FileNotFoundError:
        return 0
    complete = gained.rfind(b"\n") + 1  # a line still being written is read next time
    slot.read_to += complete
    return gained[:complete].count(b'"event": "run.finished"')


def pending_armed(slots: list[Slot]) -> int:
    """Armed workers that have not reached their point yet and are not retiring."""
    return sum(1 for s in slots if s.fault != "clean" and not s.hit and not s.retiring)


def unsettled(db: Database) -> list[str]:
    """The runs a reconcile applies to now: outcome_unknown, evidence_failed or reconciled_absent (sorted ids)."""
    found: set[str] = set()
    with db.read() as conn:
        for status in ("outcome_unknown", "evidence_failed"):
            found.update(r.run_id for r in runs_module.list_page(conn, status=status, limit=runs_module.PAGE_SIZE_MAX))
        absent = runs_module.list_page(conn, recovery_status="reconciled_absent", limit=runs_module.PAGE_SIZE_MAX)
        found.update(r.run_id for r in absent)
    return sorted(found)


def start_reconcile(url: str, run_id: str, ttl_s: float, *, resume: bool, point: str | None, log: Path) -> Reconciling:
    env = harness.worker_env(url, lease_ttl_s=ttl_s, crash_at=point)
    args = ["reconcile", run_id, *(["--resume"] if resume else [])]
    proc = harness.start(args, env, log)
    LIVE.append(proc)
    return Reconciling(proc, run_id, point, time.monotonic())


def reconcile_one(
    url: str, db: Database, rng: random.Random, ttl_s: float, log: Path, stats: Stats
) -> Reconciling | None:
    """Start a reconcile of a random unsettled run, killed mid-way at RECONCILE_KILL_SHARE."""
    candidates = unsettled(db)
    if not candidates:
        return None
    run_id = rng.choice(candidates)
    with db.read() as conn:
        run = runs_module.get(conn, run_id)
    absent = run.recovery_status == "reconciled_absent"
    resume = absent or rng.random() < RECONCILE_RESUME_SHARE
    killed = rng.random() < RECONCILE_KILL_SHARE
    if absent:
        point = rng.choice(RESUME_POINTS)
    else:
        point = rng.choice((cp.AFTER_INSPECT, *RESUME_POINTS)) if resume else cp.AFTER_INSPECT
    stats.reconciles += 1
    return start_reconcile(url, run_id, ttl_s, resume=resume, point=point if killed else None, log=log)


def reconcile_done(job: Reconciling, stats: Stats) -> bool:
    """True when the reconcile process has exited (counted); a hung one is killed and a violation."""
    code = job.proc.poll()
    if code is None and time.monotonic() - job.started_s > RECONCILE_WAIT_S:
        job.proc.kill()
        code = job.proc.wait()
        stats.violations.append(f"reconcile of run {job.run_id} did not exit in {RECONCILE_WAIT_S}s")
    if code is None:
        return False
    stats.reconcile_exit_codes[code] = stats.reconcile_exit_codes.get(code, 0) + 1
    if code == -signal.SIGKILL and job.point is not None:
        stats.reconcile_kills[job.point] = stats.reconcile_kills.get(job.point, 0) + 1
    return True


def supervise(url: str, args: argparse.Namespace, rng: random.Random, keys: Keys, stats: Stats) -> bool:
    """Submit, replay, keep the fleet alive with faults and reconcile until every run is terminal;
    False at the deadline."""
    logs = keys.flows.work / "workers"
    logs.mkdir()
    log = logs / "stopping.log"
    reconcile_log = keys.flows.work / "reconcile.log"
    slots: list[Slot] = []
    reconciling: Reconciling | None = None
    deadline = time.monotonic() + args.deadline
    store, store_rng = keys.flows.store, random.Random(rng.random())
    with harness.open_platform(url) as platform:
        keys.submit(platform, QUEUE_LOW * 2)
        while time.monotonic() < deadline:
            store.tick(store_rng, stats)
            slots = [s for s in slots if not tend(s, rng, args.lease_ttl, stats)]
            if reconciling is not None and reconcile_done(reconciling, stats):
                reconciling = None
            counts = harness.status_counts(platform.db)
            if keys.next < len(keys.planned) and own_queued(platform.db) < QUEUE_LOW:
                keys.submit(platform, TOPUP)
                for _ in range(REPLAYS_PER_TOPUP):
                    keys.replay(platform, keys.planned[rng.randrange(keys.next)])
                continue
            if keys.next >= len(keys.planned) and not (counts["queued"] or counts["running"] or reconciling):
                break
            started = sum(counts.values()) - counts["queued"]
            while len(slots) < args.workers:
                slots.append(spawn(url, rng, args.lease_ttl, logs, stats, lagging(slots, stats, started)))
            clean = [s for s in slots if s.fault == "clean" and not s.retiring]
            if lagging(slots, stats, started) and clean and not any(s.retiring for s in slots):
                retire(max(clean, key=lambda s: s.finished), stats)  # its slot goes to an armed worker
            if reconciling is None:
                reconciling = reconcile_one(url, platform.db, rng, args.lease_ttl, reconcile_log, stats)
            time.sleep(SUPERVISOR_POLL_S)  # the supervisor's own pace, not a wait for an order
        else:
            store.heal()
            if reconciling is not None:
                reconciling.proc.kill()
                reconciling.proc.wait()
            return False
        store.heal()  # for good: the fleet drains, and the end's reconciles see the store
        for slot in slots:  # resume the paused ones so they can try (and fail) their stale writes
            if harness.is_stopped(slot.proc.pid):
                harness.resume(slot.proc)
        harness.stop_fleet([s.proc for s in slots], log)
    return True


def own_queued(db: Database) -> int:
    """The soak's own queued runs (a flood's are not topped up)."""
    query = sa.select(sa.func.count()).where(dataflow_runs.c.tenant == OWN_TENANT, dataflow_runs.c.status == "queued")
    with db.read() as conn:
        return int(conn.execute(query).scalar_one())


def settle(url: str, ttl_s: float, work: Path, stats: Stats) -> list[str]:
    """Reconcile (with --resume, no faults) every unsettled run until none is left; the runs left."""
    log = work / "settle.log"
    left: list[str] = []
    with harness.open_platform(url) as platform:
        for _ in range(SETTLE_ROUNDS_MAX):
            left = unsettled(platform.db)
            if not left:
                return []
            # A reconcile killed mid-way holds its lease until it expires: wait for that, bounded.
            queue = list(left)
            free = functools.partial(_leases_free, platform.db, tuple(left))
            harness.wait_until(free, SETTLE_WAIT_S, "the unsettled runs' leases")
            jobs: list[Reconciling] = []
            while queue or jobs:
                while queue and len(jobs) < SETTLE_AT_ONCE:
                    jobs.append(start_reconcile(url, queue.pop(0), ttl_s, resume=True, point=None, log=log))
                job = jobs.pop(0)
                code = harness.wait_exit(job.proc, log)
                stats.settled[code] = stats.settled.get(code, 0) + 1
        return unsettled(platform.db)


def _leases_free(db: Database, run_ids: tuple[str, ...]) -> bool:
    with db.read() as conn:
        held = leases.expiry_of(conn, db, runs_module.MODULE, run_ids[: leases.EXPIRY_SUBJECTS_MAX])
    return all(lease.released or lease.expired for lease in held.values())


def replay_all(url: str, ttl_s: float, keys: Keys, rng: random.Random) -> None:
    """Every key once more in-process (the run must be the same, its state unchanged), a few through the CLI."""
    with harness.open_platform(url) as platform:
        before = {run.run_id: (run.status, run.attempt) for run in harness.all_runs(platform.db)}
        for planned in keys.planned:
            keys.replay(platform, planned)
        after = {run.run_id: (run.status, run.attempt) for run in harness.all_runs(platform.db)}
    if after != before:
        changed = sorted(r for r in set(before) | set(after) if before.get(r) != after.get(r))
        keys.stats.violations.append(f"replay: replays changed runs {changed[:10]}")
    for planned in rng.sample(keys.planned, min(CLI_REPLAYS, len(keys.planned))):
        keys.replay_cli(url, planned, ttl_s)


def final_states(url: str, flows: Flows) -> dict[str, Counter[str]]:
    """The runs per final state, per kind of run."""
    found: dict[str, Counter[str]] = {}
    with harness.open_platform(url) as platform:
        for run in harness.all_runs(platform.db):
            found.setdefault(flows.kind_of(run.definition_name), Counter())[str(run.status)] += 1
    return found


def check_partitions(db: Database, flows: Flows) -> tuple[list[str], dict[str, int]]:
    """The partition invariant over both partitioned sinks; also the partitions each holds."""
    problems: list[str] = []
    held_count = {}
    for kind, held in flows.partition_rows().items():
        runs_of = harness.partition_runs(db, [flows.definitions[kind].stem])
        problems += harness.partition_problems(kind, held, runs_of)
        held_count[kind] = len(held)
    return problems, held_count


def check_store(db: Database, flows: Flows, on_store: harness.StoreTable) -> tuple[str, list[str]]:
    """The S3 table read back without delta-rs: its log must be whole, each publication's rows there
    once (the stored results of the runs whose keys it holds, nothing else); and a summary line."""
    names = [flows.definitions[kind].stem for kind in S3_KINDS]
    problems = [f"delta_s3: {problem}" for problem in on_store.problems]
    problems += harness.published_rows_problems(
        db, "delta_s3", on_store.rows, on_store.publications, names, ("item", "qty")
    )
    recovery: Counter[str] = Counter()
    for run in harness.all_runs(db):
        if run.definition_name in names:
            recovery[f"{flows.kind_of(run.definition_name)}:{run.recovery_status}"] += 1
    summary = (
        f"S3 sink {flows.store.url}: {len(on_store.publications)} publications "
        f"({len({p.key for p in on_store.publications})} keys), {len(on_store.rows)} rows read back with boto3 + "
        f"pyarrow; S3 runs per recovery status {dict(sorted(recovery.items()))}; {flows.store.proxy.requests.total()} "
        f"requests through the proxy"
    )
    return summary, problems


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(f"soak: stopped by signal {signum}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"soak: seed {seed}, {args.runs} runs, {args.workers} workers, lease TTL {args.lease_ttl}s", flush=True)
    rng = random.Random(seed)
    signal.signal(signal.SIGTERM, _stop)  # so the finally below still stops the fleet and the cluster
    started = time.monotonic()
    phases: dict[str, float] = {}  # phase -> seconds it took
    server = None if args.db else PostgresServer.launch()
    store: Store | None = None
    stats = Stats()
    lineage = LineageCheck() if args.lineage else None
    if lineage is not None:
        lineage.start()  # before the first process: each inherits OPENLINEAGE_URL
    lineage_report: tuple[str, list[str]] = ("", [])
    try:
        url = args.db or harness.fresh_database(server, "soak")
        sink_dsn = str(args.sink_db or harness.fresh_database(server, "soak_sink"))
        sink_dsn = sink_dsn.replace("postgresql+psycopg://", "postgresql://")
        os.environ[SINK_SECRET] = sink_dsn  # submits check the target's secret; workers inherit it
        os.environ[S3_ACCESS_SECRET], os.environ[S3_SECRET_SECRET] = ACCESS_KEY, SECRET_KEY  # the same for S3
        work = Path(tempfile.mkdtemp(prefix="dataflow-soak-"))
        store = Store(work)
        flows = Flows.write(work, sink_dsn, store)
        keys = Keys(flows, plan(args.runs, seed), stats)
        keys.submit_via_cli_killed(url, args.lease_ttl)
        flood = Flood.open(url, flows.work) if args.flood else None
        if flood is not None:
            flood.before_fleet()  # its schedules and its queue, ahead of the soak's own runs
            flood.start_inline()
        submitted_s = time.monotonic()
        phases["setup"] = submitted_s - started
        try:
            finished = supervise(url, args, rng, keys, stats)
        finally:
            if flood is not None:
                flood.stop()
        worked_s = phases["fleet"] = time.monotonic() - submitted_s
        mark = time.monotonic()
        left = settle(url, args.lease_ttl, flows.work, stats) if finished else []
        phases["settle"], mark = time.monotonic() - mark, time.monotonic()
        replay_all(url, args.lease_ttl, keys, rng)
        phases["replays"], mark = time.monotonic() - mark, time.monotonic()
        with harness.open_platform(url) as platform:
            on_store = store.read()
            published = flows.publications(on_store)
            report = harness.check(platform.db, [p for found in published.values() for p in found])
            partition_violations, partitions_held = check_partitions(platform.db, flows)
            store_summary, store_violations = check_store(platform.db, flows, on_store)
            flooded, flooded_inline = flood_runs(platform.db)
            waits = fairness_summary(first_claims(platform.db)) if flood is not None else ("", [])
            if lineage is not None:
                lineage_report = lineage.check(platform.db)
        per_kind = final_states(url, flows)
        phases["check"] = time.monotonic() - mark
    finally:
        for proc in LIVE:  # nothing is left running (a normal end has stopped them all already)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if server is not None:
            server.destroy()
        if store is not None:
            store.stop()
        if lineage is not None:
            lineage.stop()
    report.violations += stats.violations + partition_violations + store_violations + waits[1] + lineage_report[1]
    if flood is not None:
        report.violations += flood.violations()
    total = sum(report.states.values()) - flooded  # the soak's own runs
    if total != args.runs:
        report.violations.append(f"lost or doubled runs: {total} recorded, {args.runs} submitted")
    if not finished:
        report.violations.append(f"not every run was terminal after {args.deadline}s")
    if left:
        report.violations.append(
            f"{len(left)} runs still unsettled after {SETTLE_ROUNDS_MAX} reconcile rounds: {left[:10]}"
        )
    rate = stats.faults / max(total + flooded - flooded_inline, 1)  # runs a worker could be hurt in
    shown = ", ".join(f"{name} {seconds:.0f}s" for name, seconds in phases.items())
    print(f"soak: {time.monotonic() - started:.1f}s ({shown})")
    print(f"soak: workers spawned {stats.spawned}, armed {dict(sorted(stats.armed.items()))} ({stats.armed_by_deficit} "
          f"of them to keep the fault rate up), SIGTERMed {stats.terminated}")  # fmt: skip
    print(f"soak: {total / worked_s:.1f} runs/s ({total} runs in {worked_s:.1f}s from the first submit to the last "
          f"terminal state, faults and reconciles included)")  # fmt: skip
    print(f"soak: faults that hit a run: {stats.faults} in {total} runs, 1 in {total / max(stats.faults, 1):.1f} "
          f"(required: at least 1 in {1 / FAULT_RATE_REQUIRED:.0f})")  # fmt: skip
    print(f"soak:   worker crashes {sum(stats.crashes.values())} {dict(sorted(stats.crashes.items()))}")
    print(f"soak:   worker pauses {sum(stats.pauses.values())} {dict(sorted(stats.pauses.items()))}")
    print(f"soak:   submits killed at after_record {stats.submit_kills}")
    print(f"soak:   reconciles killed mid-way {sum(stats.reconcile_kills.values())} "
          f"{dict(sorted(stats.reconcile_kills.items()))}")  # fmt: skip
    print(f"soak:   store answers lost {stats.store_answers_lost} (a commit forwarded to the S3 store, its answer "
          f"and every answer for {S3_HEAL_AFTER_S[0]:g}-{S3_HEAL_AFTER_S[1]:g}s dropped)")  # fmt: skip
    print(
        f"soak: reconciles during the soak {stats.reconciles}, exit codes "
        f"{dict(sorted(stats.reconcile_exit_codes.items()))}; at the end {dict(sorted(stats.settled.items()))}"
    )
    print(f"soak: replays {stats.replays} in-process, {stats.cli_replays} through `dataflow submit`")
    print(f"soak: worker exit codes {dict(sorted(stats.exit_codes.items()))}; logs in {flows.work}")
    for kind, states in sorted(per_kind.items()):
        sink = f"; {len(published[kind])} publications in the sink" if kind in published else ""
        sink += " (the S3 table, with delta_s3_lost's)" if kind == "delta_s3" else ""
        held = f"; {partitions_held[kind]} partitions held" if kind in partitions_held else ""
        print(f"soak: {kind}: {dict(sorted(states.items()))}{sink}{held}")
    print(f"soak: {store_summary}")
    if flood is not None:
        print(f"soak: {flood.report()}; {flooded} runs of the flood recorded")
        print(f"soak: {waits[0]}")
    if lineage is not None:
        print(f"soak: {lineage_report[0]}")
    print(f"soak: {report.summary()}")
    for violation in report.violations[:VIOLATIONS_SHOWN_MAX]:
        print(f"  VIOLATION {violation}")
    soft = rate < FAULT_RATE_REQUIRED
    if soft:
        print(f"soak: FAILED: the soak went soft: faults hit {rate:.3f} of the runs, below {FAULT_RATE_REQUIRED}")
    return 1 if report.violations or soft else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
