"""Fairness under a flood (issue 29, item 7): tenant B floods a real `dataflow serve` and worker on
PostgreSQL while tenant A works normally; A's schedule, queue and reads must keep their targets.

B, with its own submitter and operator tokens, in turn: applies ``schedules`` schedules (past its
``applied_schedules`` quota), queues ``queued`` long runs (each sleeps ``run_s`` in PostgreSQL under a
1-hour time limit; past its ``queued_runs`` quota), sends 50 concurrent inline submits of a CPU-bound
query, stores one result of ``result_mib`` MiB and asks for its evidence 20 times at once. Meanwhile A
reads ``GET /v1/runs?limit=1`` in a loop, has an every-minute schedule, and queues one run after B's
queue is full. Reported and checked:

- A's due ticks decided (submitted) within ``TICK_LATENESS_S_MAX`` of their time;
- A's queued run claimed by the first worker slot that frees (no B run claimed between A's submit and
  A's claim);
- A's read p99 ≤ ``READ_P99_S_MAX``;
- the server's and the worker's peak RSS (VmHWM);
- every B request answered 2xx, 429 (a quota, with Retry-After) or 503 (the verification slots), never 500.

    .venv/bin/python benchmarks/run.py --only fairness [--quick]
    .venv/bin/python benchmarks/bench_fairness.py --quick [--engines postgresql,sqlite]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
import yaml
from common import BenchContext, bench_server, console, print_table, write_result

from support.cli import SCRUBBED_ENV, make_cli
from support.hostile import ServerProcess, start_server

TENANT_A, TENANT_B = "tenant_a", "tenant_b"
FULL = {"schedules": 10_000, "queued": 1_000, "inline": 50, "result_mib": 1000, "evidence": 20, "run_s": 20}
QUICK = {"schedules": 300, "queued": 100, "inline": 50, "result_mib": 100, "evidence": 20, "run_s": 4}
OVER_QUOTA = 20  # requests B sends past each quota it floods: each must be answered 429
WORKER_CONCURRENCY = 2  # the worker's slots (threads)
FLOOD_THREADS = 8  # B's concurrent HTTP clients while it applies schedules and queues runs
READ_INTERVAL_S = 0.05  # A's reads, one every this many seconds
TICK_WAIT_S_MAX = 75.0  # how long the benchmark waits for A's schedule to tick at least once during the flood
CLAIM_WAIT_S_MAX = 600.0  # how long it waits for A's queued run to be claimed
TICK_LATENESS_S_MAX = 2.0
READ_P99_S_MAX = 0.100
HTTP_TIMEOUT_S = 120.0  # an answer later than this is a failure of the benchmark (B's inline runs stop at 5 s)
ENGINES = ("postgresql", "sqlite")
SLEEP_SECRET = "SLEEP_DSN"  # granted to B: its long runs sleep in a PostgreSQL database of their own
SLEEPER_ROLE = "fair_sleeper"  # the role of that DSN: may connect and sleep, nothing more


@dataclass
class Scene:
    """The running server and worker, the tokens and B's answers."""

    url: str
    server: ServerProcess
    worker: subprocess.Popen[bytes]
    tokens: dict[str, str]
    answers: Counter[str] = field(default_factory=Counter)  # "<what> <status>" -> count
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, token: str) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.tokens[token]}"}
        return httpx.Client(base_url=self.server.base_url, timeout=HTTP_TIMEOUT_S, headers=headers)

    def keep(self, what: str, response: httpx.Response) -> httpx.Response:
        with self.lock:
            self.answers[f"{what} {response.status_code}"] += 1
            if response.status_code == 429 and "Retry-After" not in response.headers:
                self.answers[f"{what} 429-without-retry-after"] += 1
        return response


def _flow(name: str, sql: str, columns: dict[str, str], *, max_bytes: str = "1MiB", **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "version": 1, "sources": extra.pop("sources", {}), "steps": [{"name": "r", "sql": sql}],
        "output": {"schema": columns, "max_rows": 100_000, "max_bytes": max_bytes}, **extra,
    }  # fmt: skip


def _long_run(run_s: int) -> dict[str, Any]:
    query = f"select 1 as n from pg_sleep({run_s})"
    source = {"s": {"kind": "postgres", "dsn": {"secret": SLEEP_SECRET}, "query": query}}
    return _flow("b_long", "select count(*)::bigint as n from s", {"n": "int64"}, sources=source,
                 limits={"time_limit": "1h"})  # fmt: skip


def _burner() -> dict[str, Any]:
    sql = "select count(*)::varchar as v from range(100000000000) a"
    return _flow("b_burn", sql, {"v": "string"}, limits={"time_limit": "5s", "threads": 1})


def _big(result_mib: int) -> dict[str, Any]:
    sql = f"select repeat(chr((65 + (range % 26))::INTEGER), 1000000) || range::varchar as v from range({result_mib})"
    # Room for the Arrow framing, within the platform's 1 GiB result limit (more is refused 422 at submit:
    # the full scale's 1,000 MiB asked 1,064 MiB until 2026-12-05 and so never stored its result).
    max_mib = min(result_mib + 64, 1024)
    return _flow("b_big", sql, {"v": "string"}, max_bytes=f"{max_mib}MiB", limits={"time_limit": "10m"})


def _a_schedule() -> dict[str, Any]:
    schedule = {"cron": "* * * * *", "timezone": "UTC", "overlap": "allow", "catchup_window": "1h"}
    return _flow("a_minutely", "select 1::bigint as n", {"n": "int64"}, schedule=schedule)


def _b_schedule(i: int) -> dict[str, Any]:
    schedule = {"cron": f"{i % 60} {i % 24} 1 1 *", "timezone": "UTC", "enabled": i % 2 == 0}
    return _flow(f"b_sched_{i}", "select 1::bigint as n", {"n": "int64"}, schedule=schedule)


def _peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


@contextlib.contextmanager
def _scene(url: str, root: Path, sleep_dsn: str, scale: dict[str, int]) -> Iterator[Scene]:
    """Tokens made with the CLI, quotas and grants files, `dataflow serve` and one worker running."""
    data_root, sink_root = root / "data", root / "sinks"
    for folder in (data_root / TENANT_A, data_root / TENANT_B, sink_root):
        folder.mkdir(parents=True, exist_ok=True)
    quotas_path = root / "quotas.yaml"
    b_quotas = {"applied_schedules": scale["schedules"], "queued_runs": scale["queued"]}
    quotas_path.write_text(yaml.safe_dump({"tenants": {TENANT_B: b_quotas}}))
    grants_path = root / "grants.yaml"
    grants_path.write_text(yaml.safe_dump({"secrets": {SLEEP_SECRET: {"tenants": [TENANT_B]}}}))
    settings = {"DATAFLOW_QUOTAS": str(quotas_path), "DATAFLOW_GRANTS": str(grants_path), SLEEP_SECRET: sleep_dsn}
    plain = make_cli(url, root)
    cli = type(plain)(db_url=url, cwd=root, env={**plain.env, **settings})
    tokens: dict[str, str] = {}
    for label, tenant, role in (("a", TENANT_A, "submitter"), ("a_operator", TENANT_A, "operator"),
                                ("b", TENANT_B, "submitter"), ("b_operator", TENANT_B, "operator")):  # fmt: skip
        made = cli("tokens", "create", "--tenant", tenant, "--role", role, "--name", label)
        if made.code != 0:
            raise RuntimeError(f"tokens create failed: {made.output}")
        tokens[label] = made.stdout.strip()
    roots = {"DATAFLOW_DATA_ROOT": str(data_root), "DATAFLOW_SINK_ROOT": str(sink_root)}
    env = {**{k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}, **settings, **roots, "DATAFLOW_DB": url}
    with contextlib.ExitStack() as stack:
        server = start_server(
            ["--db", url, "serve", "--port", "0", "--data-root", str(data_root), "--sink-root", str(sink_root)],
            cwd=root, env=env, log_path=root / "server.log",
        )  # fmt: skip
        stack.callback(server.stop)
        worker_log = (root / "worker.log").open("wb")
        stack.callback(worker_log.close)
        worker = subprocess.Popen(
            [sys.executable, "-m", "durable_dataflow.cli", "--db", url, "worker", "--concurrency",
             str(WORKER_CONCURRENCY), "--poll-interval", "0.1"],
            cwd=root, env=env, stdout=worker_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        stack.callback(_stop, worker)
        yield Scene(url, server, worker, tokens)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Reader(threading.Thread):
    """Tenant A reading its newest run every READ_INTERVAL_S until stopped: the latencies of its reads."""

    def __init__(self, scene: Scene) -> None:
        super().__init__(daemon=True)
        self.scene, self.stopped = scene, threading.Event()
        self.latencies_s: list[float] = []
        self.started_at: list[float] = []  # time.monotonic() of each read, to split the latencies by phase
        self.statuses: Counter[int] = Counter()

    def run(self) -> None:
        with self.scene.client("a") as client:
            while not self.stopped.wait(READ_INTERVAL_S):  # until stop(): the benchmark ends it
                started = time.perf_counter()
                self.started_at.append(time.monotonic())
                status = client.get("/v1/runs", params={"limit": 1}).status_code
                self.latencies_s.append(time.perf_counter() - started)
                self.statuses[status] += 1


def _fan_out(count: int, threads: int, call: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(call, range(count)))


def _flood_schedules(scene: Scene, count: int) -> float:
    started = time.monotonic()
    with scene.client("b_operator") as client:
        _fan_out(count + OVER_QUOTA, FLOOD_THREADS, lambda i: scene.keep(
            "schedule", client.post("/v1/schedules", json={"definition": _b_schedule(i)})))  # fmt: skip
    return time.monotonic() - started


def _flood_queue(scene: Scene, count: int, run_s: int) -> float:
    started = time.monotonic()
    body = {"definition": _long_run(run_s)}
    with scene.client("b") as client:
        _fan_out(count + OVER_QUOTA, FLOOD_THREADS, lambda i: scene.keep("queue", client.post(
            "/v1/runs", params={"queue": "true"}, json=body, headers={"Idempotency-Key": f"b-long-{i}"})))  # fmt: skip
    return time.monotonic() - started


def _queued_of(engine: sa.Engine, tenant: str) -> int:
    query = sa.text("select count(*) from dataflow_runs where tenant = :t and status = 'queued'")
    with engine.connect() as conn:
        return int(conn.execute(query, {"t": tenant}).scalar_one())


def _claims_while_a_queued(engine: sa.Engine, a_run_id: str, tenant: str) -> int:
    """``tenant``'s attempts started (claims, from the ledger's ``attempt.started`` entries, database clock),
    A's queued run aside, after that run was recorded and before its first attempt started."""
    query = sa.text(
        "select count(*) from ledger_entries b where b.module = 'dataflow' and b.kind = 'attempt.started' "
        "and b.subject_id in (select run_id from dataflow_runs where tenant = :b and run_id <> :a) "
        "and b.recorded_at_us > (select recorded_at_us from ledger_entries where module = 'dataflow' "
        "  and subject_id = :a and kind = 'run.recorded') "
        "and b.recorded_at_us < coalesce((select min(recorded_at_us) from ledger_entries where module = 'dataflow' "
        "  and subject_id = :a and kind = 'attempt.started'), 9223372036854775807)"  # never claimed: every B claim
    )
    with engine.connect() as conn:
        return int(conn.execute(query, {"a": a_run_id, "b": tenant}).scalar_one())


def _a_claim(scene: Scene, engine: sa.Engine) -> dict[str, Any]:
    """A queues one run behind B's queue: how long until it is claimed, and how many runs of B and of A
    (its schedule's tick runs) were claimed meanwhile, by the ledger's times. (A count of B's queue before
    A's submit also counted claims made while the submit was on its way.) The claim is fair when B took no
    more slots meanwhile than A's other runs did: with an A tick run claimed first, A and B each run one, a
    tie the oldest queued run (B's) wins."""
    b_before = _queued_of(engine, TENANT_B)
    started = time.monotonic()
    with scene.client("a") as client:
        answer = client.post("/v1/runs", params={"queue": "true"}, json={"definition": _flow(
            "a_queued", "select 1::bigint as n", {"n": "int64"})}, headers={"Idempotency-Key": "a-queued"})  # fmt: skip
        if answer.status_code not in (200, 201, 202):
            raise RuntimeError(f"A's queued submit answered {answer.status_code}: {answer.text}")
        run_id = answer.json()["run"]["run_id"]
        while time.monotonic() - started < CLAIM_WAIT_S_MAX:
            if client.get(f"/v1/runs/{run_id}").json()["run"]["status"] != "queued":
                break
            time.sleep(0.05)  # polling the API: A waits on the condition, with a deadline
    waited = time.monotonic() - started
    b_claimed = _claims_while_a_queued(engine, run_id, TENANT_B)
    a_other = _claims_while_a_queued(engine, run_id, TENANT_A)
    return {"a_claim_wait_s": waited, "b_claimed_before_a": b_claimed, "a_other_claimed_before_a": a_other,
            "b_queued_at_a_submit": b_before}  # fmt: skip


def _flood_inline(scene: Scene, count: int) -> None:
    with scene.client("b") as client:
        _fan_out(count, count, lambda i: scene.keep("inline", client.post(
            "/v1/runs", json={"definition": _burner()}, headers={"Idempotency-Key": f"b-burn-{i}"})))  # fmt: skip


def _flood_evidence(scene: Scene, result_mib: int, requests: int) -> dict[str, Any]:
    with scene.client("b") as client:
        started = time.monotonic()
        answer = scene.keep("big", client.post("/v1/runs", json={"definition": _big(result_mib)},
                                               headers={"Idempotency-Key": "b-big"}))  # fmt: skip
        stored_s = time.monotonic() - started
        if answer.status_code not in (200, 201):
            return {"big_status": answer.status_code, "big_error": answer.text[:500]}
        run_id = answer.json()["run"]["run_id"]
        started = time.monotonic()
        _fan_out(requests, requests, lambda i: scene.keep("evidence", client.get(f"/v1/runs/{run_id}/evidence")))
        return {"big_status": answer.status_code, "big_store_s": stored_s, "evidence_s": time.monotonic() - started}


def _a_ticks(engine: sa.Engine, since_us: int) -> list[float]:
    query = sa.text("select tick_us, decided_at_us from schedule_ticks where tenant = :t and tick_us >= :s "
                    "and decision = 'submitted' order by tick_us")  # fmt: skip
    with engine.connect() as conn:
        return [(int(d) - int(t)) / 1e6 for t, d in conn.execute(query, {"t": TENANT_A, "s": since_us})]


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def flood(url: str, root: Path, sleep_dsn: str, scale: dict[str, int]) -> dict[str, Any]:
    """One flood against one platform database; the measured figures and the checks."""
    engine = sa.create_engine(url)
    with _scene(url, root, sleep_dsn, scale) as scene:
        with scene.client("a_operator") as a:
            applied = a.post("/v1/schedules", json={"definition": _a_schedule()})
            if applied.status_code not in (200, 201):
                raise RuntimeError(f"A's schedule was refused: {applied.status_code} {applied.text}")
        since_us = int(time.time() * 1e6)
        reader = Reader(scene)
        reader.start()
        marks = [("schedules", time.monotonic())]
        phases = {"schedules_s": _flood_schedules(scene, scale["schedules"])}
        marks.append(("queue", time.monotonic()))
        phases["queue_s"] = _flood_queue(scene, scale["queued"], scale["run_s"])
        marks.append(("a_claim", time.monotonic()))
        claim = _a_claim(scene, engine)
        marks.append(("inline", time.monotonic()))
        _flood_inline(scene, scale["inline"])
        phases["inline_s"] = time.monotonic() - marks[-1][1]
        marks.append(("big_result_and_evidence", time.monotonic()))
        evidence = _flood_evidence(scene, scale["result_mib"], scale["evidence"])
        marks.append(("waiting_for_a_tick", time.monotonic()))
        deadline = time.monotonic() + TICK_WAIT_S_MAX
        while not _a_ticks(engine, since_us) and time.monotonic() < deadline:
            time.sleep(0.5)  # waits on the condition (a tick of A decided), with a deadline
        lateness = _a_ticks(engine, since_us)
        reader.stopped.set()
        reader.join()
        peaks = {"server_peak_mib": _peak_kib(scene.server.proc.pid) / 1024,
                 "worker_peak_mib": _peak_kib(scene.worker.pid) / 1024}  # fmt: skip
        answers = dict(scene.answers)
    engine.dispose()
    reads = reader.latencies_s
    measured = {
        "scale": scale, **phases, **claim, **evidence, **peaks, "answers": answers,
        "a_reads": len(reads), "a_read_statuses": dict(reader.statuses),
        "a_read_p50_ms": _p(reads, 0.5) * 1000, "a_read_p99_ms": _p(reads, 0.99) * 1000,
        "a_read_max_ms": max(reads, default=float("nan")) * 1000,
        "a_read_p99_ms_by_phase": _p99_by_phase(reader, marks),
        "a_ticks": len(lateness), "a_tick_lateness_max_s": max(lateness, default=float("nan")),
    }  # fmt: skip
    measured["checks"] = _checks(measured)
    return measured


def _p99_by_phase(reader: Reader, marks: list[tuple[str, float]]) -> dict[str, float]:
    """A's read p99 (ms) within each phase of the flood (a phase lasts until the next one starts)."""
    found: dict[str, float] = {}
    for index, (name, start) in enumerate(marks):
        end = marks[index + 1][1] if index + 1 < len(marks) else float("inf")
        inside = [s for t, s in zip(reader.started_at, reader.latencies_s, strict=True) if start <= t < end]
        found[name] = _p(inside, 0.99) * 1000
    return found


def _checks(m: dict[str, Any]) -> dict[str, bool]:
    statuses = Counter({k: v for k, v in m["answers"].items()})
    server_errors = sum(v for k, v in statuses.items() if k.split()[-1].startswith("5") and not k.endswith(" 503"))
    refused = {what: statuses.get(f"{what} 429", 0) for what in ("schedule", "queue", "inline")}
    return {
        "a_ticks_within_2s": m["a_ticks"] > 0 and m["a_tick_lateness_max_s"] <= TICK_LATENESS_S_MAX,
        "a_claimed_within_one_slot": m["b_claimed_before_a"] <= m["a_other_claimed_before_a"],
        # The big result and its evidence flood happened at all (a refused submit skipped that phase).
        "b_big_result_stored": m.get("big_status") in (200, 201),
        "a_read_p99_within_100ms": m["a_read_p99_ms"] <= READ_P99_S_MAX * 1000,
        "a_reads_all_200": set(m["a_read_statuses"]) == {200},
        "b_never_500": server_errors == 0,
        "b_over_quota_429": all(n > 0 for n in refused.values()),
        "b_schedules_within_quota": statuses.get("schedule 201", 0) <= m["scale"]["schedules"],
        "b_429_with_retry_after": not any(k.endswith("429-without-retry-after") for k in statuses),
    }


def _pg_url(plain: str) -> str:
    return plain.replace("postgresql://", "postgresql+psycopg://", 1)


def _sleeper_dsn(ctx: BenchContext) -> str:
    """A DSN of a least-privilege role on a database of its own (a tenant's source refuses a superuser's)."""
    name = ctx.new_database("fair_sleep").rsplit("/", 1)[1]
    with ctx.server.connect("postgres") as conn:
        conn.execute(f"CREATE ROLE {SLEEPER_ROLE} LOGIN PASSWORD '{SLEEPER_ROLE}'")
        conn.execute(f"GRANT CONNECT ON DATABASE {name} TO {SLEEPER_ROLE}")
    return f"postgresql://{SLEEPER_ROLE}:{SLEEPER_ROLE}@127.0.0.1:{ctx.server.port}/{name}"


def run(ctx: BenchContext, engines: tuple[str, ...] = ENGINES) -> dict[str, Any]:
    scale = QUICK if ctx.quick else FULL
    sleep_dsn = _sleeper_dsn(ctx)
    results: dict[str, Any] = {}
    for engine in engines:
        root = ctx.workdir / f"fairness-{engine}"
        root.mkdir(parents=True, exist_ok=True)
        url = _pg_url(ctx.new_database("fairness")) if engine == "postgresql" else f"sqlite:///{root}/dataflow.db"
        console.print(f"[bold]fairness on {engine}[/bold] ({json.dumps(scale)})")
        results[engine] = flood(url, root, sleep_dsn, scale)
    rows = []
    for engine, m in results.items():
        rows.append([
            engine, f"{m['a_tick_lateness_max_s']:.2f}", f"{m['b_claimed_before_a']} / {m['a_other_claimed_before_a']}",
            f"{m['a_claim_wait_s']:.1f}",
            f"{m['a_read_p99_ms']:.1f}", f"{m['server_peak_mib']:.0f}", f"{m['worker_peak_mib']:.0f}",
            ", ".join(f"{k}={v}" for k, v in sorted(m["answers"].items())),
            ", ".join(k for k, ok in m["checks"].items() if not ok) or "all met",
        ])  # fmt: skip
    print_table(
        "Fairness under a flood (tenant B floods, tenant A works)",
        ["engine", "A tick late max s", "B / A's other claims before A's run", "A claim wait s", "A read p99 ms",
         "server peak MiB", "worker peak MiB", "B answers", "checks not met"],
        rows,
    )  # fmt: skip
    payload = {"scale": scale, "worker_concurrency": WORKER_CONCURRENCY, "engines": results,
               "recorded_day": dt.date.today().isoformat()}  # fmt: skip
    write_result("fairness", payload, ctx.server, ctx.quick)
    return payload


def _stopped(signum: int, _frame: object) -> None:
    raise SystemExit(f"bench_fairness: stopped by signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="scaled down: 300 schedules, 100 runs, 100 MiB")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated platform engines")
    args = parser.parse_args(argv)
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    if not set(engines) <= set(ENGINES):
        parser.error(f"--engines: choose from {ENGINES}")
    signal.signal(signal.SIGTERM, _stopped)  # so the scene's processes are stopped by the finally blocks
    with tempfile.TemporaryDirectory(prefix="dataflow-fairness-") as workdir, bench_server() as server:
        payload = run(BenchContext(server=server, quick=args.quick, workdir=Path(workdir)), engines)
    failed = [f"{e}: {k}" for e, m in payload["engines"].items() for k, ok in m["checks"].items() if not ok]
    console.print(f"[red]not met: {', '.join(failed)}[/red]" if failed else "[green]all checks met[/green]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
