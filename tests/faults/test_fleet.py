"""Fleets of real worker processes on PostgreSQL: a database restart under load, and 400 runs of
both modes under 4 workers while parallel clients replay the same idempotency keys."""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from durable_dataflow.api.metrics import Metrics
from durable_dataflow.dataflow.protocol import fleet
from durable_dataflow.platform import Platform
from faults import harness
from support.pg import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

FLEET_TTL_S = 10.0  # generous: these tests inject no lease expiry, a loaded machine must not either
SUBMITTER = Path(__file__).with_name("submitter.py")


def _definitions(tmp_path: Path) -> tuple[Path, Path]:
    atomic = harness.inline_definition(tmp_path / "defs", "fleet_atomic")
    forward = harness.inline_definition(tmp_path / "defs", "fleet_forward", publish_to="sink")
    return atomic, forward


def _start_workers(url: str, count: int, concurrency: int, ttl_s: float, log: Path) -> list:  # type: ignore[type-arg]
    env = harness.worker_env(url, lease_ttl_s=ttl_s)
    args = harness.worker_args(concurrency=concurrency, sweep_interval_s=0.5, poll_interval_s=0.1)
    return [harness.start(args, env, log) for _ in range(count)]


def _alive_workers(platform: Platform) -> int:
    return sum(1 for w in fleet.list_workers(platform.db) if w.role == "worker" and w.state == "alive")


def _submit_inline(platform: Platform, atomic: Path, forward: Path, count: int) -> None:
    for number in range(count):
        definition = (atomic, forward)[number % 2]
        platform.runs.submit(harness.request_for(definition, {"n": str(number)}, f"k-{number}"))


@pytest.mark.timeout(300)
def test_workers_survive_a_postgres_restart(postgres_server: PostgresServer, tmp_path: Path) -> None:
    """Restart PostgreSQL (immediate) while 2 workers run 40 runs: they reconnect, every run ends
    terminal, none is lost or doubled, the workers logged the outage, and the fleet view and metrics show
    both workers alive again (their holder locks taken again by their beats)."""
    url = harness.fresh_database(postgres_server, "restart")
    atomic, forward = _definitions(tmp_path)
    log = tmp_path / "workers.log"
    runs_total = 40
    with harness.open_platform(url) as platform:
        _submit_inline(platform, atomic, forward, runs_total)
        workers = _start_workers(url, 2, 2, 3.0, log)
        try:
            harness.wait_until(lambda: harness.log_events(log)["worker.started"] == 2, 60, "both workers up")
            harness.wait_until(lambda: harness.status_counts(platform.db)["succeeded"] >= 3, 60, "first runs")
            postgres_server.restart()
            harness.wait_all_terminal(platform.db, runs_total, 120, "after the restart")
            # The restart ended the workers' holder-lock sessions: their next beats take the locks again,
            # and the fleet view and the metrics show both alive (none dead) with nothing left queued.
            harness.wait_until(lambda: _alive_workers(platform) == 2, 60, "both workers alive after the restart")
            exposed = Metrics(platform.db, scrape_interval_s=0.0).render().decode()
            assert 'dataflow_workers_alive{role="worker"} 2.0' in exposed
            assert "dataflow_runs_queued 0.0" in exposed and "dataflow_oldest_queued_age_seconds 0.0" in exposed
        finally:
            codes = harness.stop_fleet(workers, log)
        report = harness.check(platform.db, harness.parquet_publications(tmp_path / "defs" / "sink"))
    events = harness.log_events(log)
    assert codes == [0, 0], harness.tail(log)
    assert sum(report.states.values()) == runs_total, report.summary()
    assert report.violations == [], f"{report.violations[:10]}\n{report.summary()}"
    assert events["storage.unavailable"] + events["attempt.abandoned"] >= 1, f"the restart went unseen: {events}"
    assert events["worker.stopped"] == 2, harness.tail(log)


def _clients(url: str, atomic: Path, forward: Path, count: int, clients: int, tmp_path: Path) -> list:  # type: ignore[type-arg]
    procs = []
    for seed in range(clients):
        out = tmp_path / f"client-{seed}.jsonl"
        args = [sys.executable, str(SUBMITTER), url, str(atomic), str(forward), str(count), str(seed), str(out)]
        log = (tmp_path / f"client-{seed}.log").open("wb")
        procs.append(harness.subprocess.Popen(args, stdout=log, stderr=log))
        log.close()
    return procs


RUNS_MANY = 400  # `make soak` runs 200 with faults (and 10,000 at scale); this is the duplicate-key race
WORKERS_MANY = 4
CLIENTS_MANY = 3


@pytest.mark.timeout(480)
def test_many_runs_four_workers_duplicate_keys(postgres_server: PostgresServer, tmp_path: Path) -> None:
    """400 runs of both modes, 4 workers, 3 clients replaying every key at once: exactly one run per
    key (every client got the same run), every run terminal, at most one publication each."""
    url = harness.fresh_database(postgres_server, "fleet")
    atomic, forward = _definitions(tmp_path)
    log = tmp_path / "workers.log"
    started = time.monotonic()
    with harness.open_platform(url) as platform:
        workers = _start_workers(url, WORKERS_MANY, 2, FLEET_TTL_S, log)
        clients = _clients(url, atomic, forward, RUNS_MANY, CLIENTS_MANY, tmp_path)
        try:
            client_codes = [harness.wait_exit(c, tmp_path / "client-0.log", 400) for c in clients]
            harness.wait_all_terminal(platform.db, RUNS_MANY, 400, f"{RUNS_MANY} runs")
        finally:
            codes = harness.stop_fleet(workers, log)
        elapsed_s = time.monotonic() - started
        report = harness.check(platform.db, harness.parquet_publications(tmp_path / "defs" / "sink"))
    print(f"{RUNS_MANY} runs, {WORKERS_MANY} workers, {CLIENTS_MANY} clients: {elapsed_s:.1f}s; {report.summary()}")
    assert client_codes == [0] * CLIENTS_MANY, [harness.tail(tmp_path / f"client-{i}.log") for i in range(3)]
    assert codes == [0] * WORKERS_MANY, harness.tail(log)
    answers: dict[str, set[str]] = defaultdict(set)
    created: dict[str, int] = defaultdict(int)
    for seed in range(CLIENTS_MANY):
        for line in (tmp_path / f"client-{seed}.jsonl").read_text().splitlines():
            item = json.loads(line)
            answers[item["key"]].add(item["run_id"])
            created[item["key"]] += int(item["created"])
    assert len(answers) == RUNS_MANY
    assert all(len(ids) == 1 for ids in answers.values()), "a key named two runs"
    assert set(created.values()) == {1}, "each key must be created exactly once across the clients"
    assert sum(report.states.values()) == RUNS_MANY, report.summary()
    assert report.violations == [], f"{report.violations[:10]}\n{report.summary()}"


@pytest.mark.timeout(120)
def test_sigterm_lets_the_in_flight_run_finish(postgres_server: PostgresServer, tmp_path: Path) -> None:
    """SIGTERM reaching a worker whose forward run is authorized to dispatch (held at
    after_predispatch_commit by a pause, so the signal is certainly in flight with the run) stops
    claiming; the authorized publication is never cut short: the run finishes under attempt 1, its
    rows in the sink once, the next queued run stays queued, and the worker exits 0. (Whether an
    attempt not yet authorized ends ``cancelled`` or finishes depends on which thread runs first after
    SIGCONT; tests/integration/test_execution_interrupt.py holds that case deterministically.)"""
    url = harness.fresh_database(postgres_server, "sigterm")
    atomic, forward = _definitions(tmp_path)
    log = tmp_path / "worker.log"
    with harness.open_platform(url) as platform:
        platform.runs.submit(harness.request_for(forward, {"n": "0"}, "k-0"))
        platform.runs.submit(harness.request_for(atomic, {"n": "1"}, "k-1"))
        env = harness.worker_env(url, lease_ttl_s=FLEET_TTL_S, pause_at="after_predispatch_commit")
        worker = harness.start(harness.worker_args(), env, log)
        harness.wait_until(lambda: harness.is_stopped(worker.pid) or worker.poll() is not None, 60, "the pause")
        worker.send_signal(harness.signal.SIGTERM)  # delivered when the process continues
        harness.resume(worker)
        code = harness.wait_exit(worker, log)
        states = [(r.idempotency_key, r.status, r.attempt) for r in harness.all_runs(platform.db)]
        published = harness.parquet_publications(forward.parent / "sink")
        violations = [v for v in harness.check(platform.db, published).violations if "still queued" not in v]
    events = harness.log_events(log)
    assert code == 0, harness.tail(log)
    assert sorted(states) == [("k-0", "succeeded", 1), ("k-1", "queued", 0)], harness.tail(log)
    assert len(published) == 1 and violations == [], (published, violations)  # k-1 stays queued on purpose
    assert events["worker.stopping"] == 1 and events["run.finished"] == 1, events
