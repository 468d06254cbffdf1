"""A SIGKILLed worker reads dead (issue 33 item 1): on PostgreSQL within seconds, whatever its TTL (its holder
lock goes with its session); on SQLite once its TTL has passed. A SIGTERMed one reads stopped. A SIGSTOPped
one reads dead past its TTL and alive again after SIGCONT, in the fleet view and the metrics (item 7)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from durable_dataflow.api.metrics import Metrics
from durable_dataflow.dataflow.protocol import fleet
from durable_dataflow.dataflow.protocol.fleet import WorkerState
from faults import harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

START_WAIT_S = 60.0
PG_DEAD_WITHIN_S = 5.0  # "within a few seconds": the lock is free as soon as the server ends the session
PG_TTL_S = 120.0  # far longer than the wait: on PostgreSQL only the holder lock can tell in time
SQLITE_TTL_S = 1.5


def _states(db_url: str) -> dict[int, WorkerState]:
    with harness.open_platform(db_url) as platform:
        return {w.pid: w.state for w in fleet.list_workers(platform.db)}


def test_a_sigkilled_worker_reads_dead_and_a_sigtermed_one_stopped(db_url: str, tmp_path: Path) -> None:
    """Two idle `dataflow worker` processes register alive; the SIGKILLed one reads dead — on PostgreSQL
    within PG_DEAD_WITHIN_S although its TTL is 120 s, on SQLite once its 1.5 s TTL has passed —, the
    SIGTERMed one reads stopped, and `dataflow workers --json` and dataflow_workers_alive show the same."""
    postgres = db_url.startswith("postgresql")
    ttl_s = PG_TTL_S if postgres else SQLITE_TTL_S
    log = tmp_path / "workers.log"
    env = harness.worker_env(db_url, lease_ttl_s=30, extra={fleet.WORKER_TTL_ENV: str(ttl_s)})
    killed, stopped = (harness.start(harness.worker_args(), env, log) for _ in range(2))
    try:
        harness.wait_until(
            lambda: [_states(db_url).get(p.pid) for p in (killed, stopped)] == [WorkerState.ALIVE] * 2,
            START_WAIT_S, "both workers alive",
        )  # fmt: skip
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        harness.wait_until(
            lambda: _states(db_url)[killed.pid] == WorkerState.DEAD,
            PG_DEAD_WITHIN_S if postgres else ttl_s + START_WAIT_S, "the killed worker dead",
        )  # fmt: skip
        assert _alive_metric(db_url) == 1.0  # the metrics count the killed one out, as the view does
        stopped.send_signal(signal.SIGTERM)
        assert harness.wait_exit(stopped, log) == 0, harness.tail(log)
    finally:
        for proc in (killed, stopped):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert _states(db_url)[stopped.pid] == WorkerState.STOPPED
    shown = harness.subprocess.run(
        [*harness.WORKER_CMD, "workers", "--json"], env=env, capture_output=True, text=True, check=True, cwd=tmp_path
    )

    states = {w["pid"]: w["state"] for w in json.loads(shown.stdout)["workers"]}
    assert states == {killed.pid: "dead", stopped.pid: "stopped"}


def _alive_metric(db_url: str) -> float:
    with harness.open_platform(db_url) as platform:
        exposed = Metrics(platform.db, scrape_interval_s=0.0).render().decode()
    found = re.search(r'^dataflow_workers_alive\{role="worker"\} ([0-9.]+)$', exposed, re.MULTILINE)
    assert found is not None, exposed
    return float(found.group(1))


def test_a_sigstopped_worker_reads_dead_past_its_ttl_and_alive_after_sigcont(db_url: str, tmp_path: Path) -> None:
    """Proves the fleet view and dataflow_workers_alive follow a paused process (issue 33 item 7): a SIGSTOPped
    worker stops beating, so past its TTL it reads dead — on PostgreSQL too, where its session and holder
    lock outlive the pause — and the metric counts one live worker fewer; after SIGCONT its next beat makes
    it alive again and the metric recovers. The other worker stays alive throughout."""
    ttl_s = SQLITE_TTL_S
    log = tmp_path / "workers.log"
    env = harness.worker_env(db_url, lease_ttl_s=30, extra={fleet.WORKER_TTL_ENV: str(ttl_s)})
    paused, running = (harness.start(harness.worker_args(), env, log) for _ in range(2))
    try:
        both_alive = [WorkerState.ALIVE] * 2
        harness.wait_until(
            lambda: [_states(db_url).get(p.pid) for p in (paused, running)] == both_alive, START_WAIT_S, "both alive"
        )
        assert _alive_metric(db_url) == 2.0
        paused.send_signal(signal.SIGSTOP)
        harness.wait_until(lambda: harness.is_stopped(paused.pid), 10, "the pause")
        harness.wait_until(lambda: _states(db_url)[paused.pid] == WorkerState.DEAD, ttl_s + START_WAIT_S, "dead")
        assert _states(db_url)[running.pid] == WorkerState.ALIVE
        assert _alive_metric(db_url) == 1.0
        harness.resume(paused)
        harness.wait_until(lambda: _states(db_url)[paused.pid] == WorkerState.ALIVE, START_WAIT_S, "alive again")
        assert _alive_metric(db_url) == 2.0
        for proc in (paused, running):
            proc.send_signal(signal.SIGTERM)
        assert [harness.wait_exit(p, log) for p in (paused, running)] == [0, 0], harness.tail(log)
    finally:
        for proc in (paused, running):
            if proc.poll() is None:
                harness.resume(proc)
                proc.kill()
                proc.wait(10)
