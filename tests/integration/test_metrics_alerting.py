"""Metrics for alerting (issue 33 item 2), on SQLite and PostgreSQL: a zero series for every status, the
queue, failure, lease, schedule and fleet families from the database (cached for SCRAPE_INTERVAL_S_MIN),
counters typed as counters, run durations observed by a worker, the worker's own metrics port, and the
shipped alert rules (deploy/alerts.yml) checked by promtool and naming only exposed metrics."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from durable_dataflow.api.metrics import Metrics, WorkerMetrics
from durable_dataflow.dataflow.protocol import fleet
from durable_dataflow.dataflow.protocol.runs import RecoveryStatus, RunStatus
from durable_dataflow.dataflow.worker import Worker, WorkerOptions
from durable_dataflow.platform import Platform
from faults import harness

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "alerts.yml"
OPERATIONS = REPO / "docs" / "operations.md"
WAIT_S = 60.0
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})? (?P<value>\S+)$")


def samples(text: str) -> dict[str, float]:
    """Every sample of an exposition, keyed by its name and labels as written."""
    found = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            found[match["name"] + (match["labels"] or "")] = float(match["value"])
    return found


def _failing_definition(folder: Path) -> Path:
    """An atomic definition that binds (on empty tables) but fails when it reads its rows: a text that is
    no number cast to an integer."""
    path = harness.inline_definition(folder, "metrics_failing")
    path.write_text(path.read_text().replace("qty * $n as qty", "cast('x' || item as bigint) * $n as qty"))
    return path


def test_metrics_have_zero_series_and_count_queue_failures_and_fleet(db_url: str, tmp_path: Path) -> None:
    """A fresh platform exposes a zero series for every status and recovery status and zero queue gauges;
    after one run succeeds, one fails, one is queued 30 s (database clock) and a worker row registers:
    queued 1, oldest queued age >= 30 s, the failure counted under its error code (a counter), the attempt
    outcomes a counter, the worker alive; the families are read once per interval (a second render inside
    it shows the cached values), and the worker observed both runs' durations by definition and mode."""
    with Platform(db_url) as platform:
        clock = [0.0]
        metrics = Metrics(platform.db, scrape_interval_s=60.0, clock=lambda: clock[0])
        fresh = samples(metrics.render().decode())
        for status in RunStatus:
            assert fresh[f'dataflow_runs{{status="{status.value}"}}'] == 0.0
        for recovery in RecoveryStatus:
            assert fresh[f'dataflow_runs_recovery{{recovery_status="{recovery.value}"}}'] == 0.0
        assert fresh["dataflow_runs_queued"] == fresh["dataflow_oldest_queued_age_seconds"] == 0.0
        assert fresh['dataflow_workers_alive{role="worker"}'] == 0.0
        assert fresh["dataflow_schedule_lag_seconds"] == fresh["dataflow_expired_leases"] == 0.0

        good = harness.inline_definition(tmp_path / "defs", "metrics_good")
        platform.runs.submit(harness.request_for(good, {"n": "1"}, "good"))
        platform.runs.submit(harness.request_for(_failing_definition(tmp_path / "defs"), {"n": "1"}, "bad"))
        observed = WorkerMetrics(platform.db)
        Worker(
            platform.runs, WorkerOptions(until_idle=True, poll_interval_s=0.05), observe=observed.runs.observe_run
        ).run()
        platform.db.advance_clock(-30)
        platform.runs.submit(harness.request_for(good, {"n": "2"}, "queued"))
        platform.db.advance_clock(30)
        fleet.register(
            platform.db, holder="h:1:a", role=fleet.Role.WORKER, concurrency=1, ttl_s=60, holder_locked=False
        )

        assert samples(metrics.render().decode()) == fresh  # inside the interval: the cached read
        clock[0] = 61.0
        shown = samples(metrics.render().decode())
        durations = samples(observed.render().decode())  # it reads the fleet: while the database is open
    assert shown["dataflow_runs_queued"] == 1.0 and shown['dataflow_runs{status="queued"}'] == 1.0
    assert shown["dataflow_oldest_queued_age_seconds"] >= 29.0
    failures = {k: v for k, v in shown.items() if k.startswith("dataflow_run_failures_total{")}
    assert sum(failures.values()) == 1.0, failures
    assert shown['dataflow_attempt_outcomes_total{outcome="succeeded"}'] == 1.0
    assert shown['dataflow_workers_alive{role="worker"}'] == 1.0
    assert shown['dataflow_worker_last_beat_age_seconds{holder="h:1:a",role="worker",state="alive"}'] >= 0.0
    exposition = metrics.render().decode()
    assert "# TYPE dataflow_attempt_outcomes_total counter" in exposition
    assert "# TYPE dataflow_run_failures_total counter" in exposition
    assert durations['dataflow_run_duration_seconds_count{definition="metrics_good",mode="atomic"}'] == 1.0
    assert durations['dataflow_run_duration_seconds_count{definition="metrics_failing",mode="atomic"}'] == 1.0


def test_worker_metrics_port_serves_the_fleet_and_its_runs(db_url: str, tmp_path: Path) -> None:
    """`dataflow worker --metrics-port 0` logs the port it bound; that port serves the worker's metrics:
    itself alive in dataflow_workers_alive and, after it executed a run, that run's duration; SIGTERM stops
    it with exit 0. Without the option no port is opened (no metrics.listening line)."""
    log = tmp_path / "worker.log"
    with harness.open_platform(db_url) as platform:
        definition = harness.inline_definition(tmp_path / "defs", "metrics_port")
        platform.runs.submit(harness.request_for(definition, {"n": "1"}, "k-0"))
        worker = harness.start(
            [*harness.worker_args(), "--metrics-port", "0"], harness.worker_env(db_url, lease_ttl_s=30), log
        )
        try:
            harness.wait_until(lambda: harness.log_events(log)["metrics.listening"] == 1, WAIT_S, "the port")
            port = next(_logged_ports(log))
            url = f"http://127.0.0.1:{port}/metrics"

            def ready() -> bool:
                shown = samples(urllib.request.urlopen(url, timeout=5).read().decode())
                ran = shown.get('dataflow_run_duration_seconds_count{definition="metrics_port",mode="atomic"}')
                return ran == 1.0 and shown.get('dataflow_workers_alive{role="worker"}') == 1.0

            harness.wait_until(ready, WAIT_S, "the worker alive and its run observed")
        finally:
            worker.send_signal(signal.SIGTERM)
            code = harness.wait_exit(worker, log)
    assert code == 0, harness.tail(log)


def _logged_ports(log: Path) -> Iterator[int]:
    for line in log.read_text().splitlines():
        if '"metrics.listening"' in line:
            yield int(json.loads(line)["port"])


def _exposed_names(sqlite_url: str) -> set[str]:
    with Platform(sqlite_url) as platform:
        text = Metrics(platform.db).render().decode() + WorkerMetrics(platform.db).render().decode()
    names = set(re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE))
    return names | {match["name"] for line in text.splitlines() if (match := _SAMPLE.match(line))}


def test_shipped_alert_rules_pass_promtool_and_name_exposed_metrics(sqlite_url: str) -> None:
    """deploy/alerts.yml passes `promtool check rules` (PromQL syntax and rule shape); every metric each
    rule's expression names is one /metrics exposes (a renamed metric fails here); each alert is explained
    in docs/operations.md."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: run scripts/install-system-deps.sh (Debian package prometheus)")
    checked = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    exposed = _exposed_names(sqlite_url)
    operations = OPERATIONS.read_text()
    for rule in rules:
        named = set(re.findall(r"\bdataflow_[a-z_]+\b", rule["expr"]))
        assert named and named <= exposed, (rule["alert"], named - exposed)
        assert f"`{rule['alert']}`" in operations, rule["alert"]
    assert {r["alert"] for r in rules} >= {
        "DataflowUnresolvedRuns", "DataflowOldestUnresolvedAge", "DataflowNoLiveWorker", "DataflowQueueAge",
        "DataflowScheduleLag", "DataflowFailureRate",
    }  # fmt: skip
