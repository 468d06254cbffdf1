"""Prometheus metrics on a per-application registry (no global state: two apps, two registries).

Platform-wide families are read from the database at scrape time (:class:`_DatabaseCollector`), so every
worker's runs count, not only the ones this process saw; they are read at most once per
``SCRAPE_INTERVAL_S_MIN`` (a scrape storm reads the cached families), each by an indexed query. Every
status and recovery status has a series, zero included, so alerts need no ``or vector(0)``. Counts that
only grow are counters (``…_total``). Latencies and run durations are observed by the process itself:
``serve`` its requests, a worker (``dataflow worker --metrics-port``, :class:`WorkerMetrics`) the attempts
it carried to their end. The alert rules shipped in deploy/alerts.yml read these names (docs/operations.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from durable_dataflow.core import leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.units import US_PER_S
from durable_dataflow.dataflow.protocol import evidence, fleet, runs
from durable_dataflow.dataflow.protocol.runs import RecoveryStatus, Run, RunStatus
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.ops import ledger as ops_ledger

# Which ledger entry kinds count as which attempt outcome.
ATTEMPT_OUTCOME_KINDS: dict[str, tuple[str, ...]] = {
    "succeeded": (evidence.RUN_SUCCEEDED,),
    "failed": (evidence.RUN_FAILED,),
    "recovered": (evidence.ATTEMPT_RECOVERED,),
    "outcome_unknown": (evidence.PUBLICATION_UNKNOWN, evidence.ATTEMPT_OUTCOME_UNKNOWN),
    "evidence_failed": (evidence.EVIDENCE_FAILED,),
    "reconciled_present": (evidence.RECONCILE_PRESENT,),
    "reconciled_absent": (evidence.RECONCILE_ABSENT,),
    "cancelled": (evidence.RUN_CANCELLED,),
}
# The request histogram's method label: any other method (HTTP lets a client invent them, and each
# label value is a series kept for the life of the process) is counted as "other".
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"})
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RUN_DURATION_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)
# The database-backed families are read at most once per this interval; scrapes in between get the
# families of the last read (Prometheus scrapes every 15-60 s: a storm of scrapes costs no reads).
SCRAPE_INTERVAL_S_MIN = 2.0
# Distinct definition names the run-duration histogram keeps a series for (a submitter names definitions,
# and each label value is a series for the life of the process); later ones are counted as "other".
DEFINITION_LABELS_MAX = 200
METRICS_HOST_DEFAULT = "127.0.0.1"  # a worker's metrics port listens on loopback unless told otherwise

Family = GaugeMetricFamily | CounterMetricFamily


class _DatabaseCollector(Collector):
    """Platform-wide run, queue, lease, schedule and fleet families, read from the database (cached)."""

    def __init__(
        self, db: Database, interval_s: float = SCRAPE_INTERVAL_S_MIN, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.db = db
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._families: list[Family] | None = None
        self._read_at_s = 0.0

    def collect(self) -> Iterator[Family]:
        with self._lock:  # concurrent scrapes wait for the one read, then share it
            now_s = self._clock()
            if self._families is None or now_s - self._read_at_s >= self.interval_s:
                self._families = self._read()
                self._read_at_s = now_s
            families = self._families
        return iter(families)

    def _read(self) -> list[Family]:
        with self.db.read() as conn:
            now_us = self.db.now_us(conn)
            by_status = ops_ledger.runs_by_status(conn)
            by_recovery = ops_ledger.runs_by_recovery_status(conn)
            kinds = ops_ledger.ledger_kind_counts(conn)
            unresolved_total, oldest = ops_ledger.unresolved_runs(conn, self.db, now_us, limit=1)
            oldest_queued_us = runs.oldest_created_us(conn, RunStatus.QUEUED)
            failures = runs.failures_by_error_code(conn)
            expired = leases.held_counts(conn, self.db, module=runs.MODULE).get(runs.MODULE, (0, 0))[1]
            oldest_due_us = schedules.oldest_due_us(conn)
            lineage_pending = ledger.outbox_count(conn)
        found = fleet.list_workers(self.db)
        return [
            *_run_families(by_status, by_recovery, unresolved_total, oldest[0].age_s if oldest else 0.0),
            _gauge("dataflow_oldest_queued_age_seconds",
                   "Age of the oldest queued run, database clock (0 when none)", _age_s(now_us, oldest_queued_us)),
            _gauge("dataflow_expired_leases", "Run leases expired on the database clock and not yet swept", expired),
            _gauge("dataflow_schedule_lag_seconds", "How long the earliest due schedule has waited for an evaluation "
                   "(0 when none is due)", _age_s(now_us, oldest_due_us)),
            _counter("dataflow_attempt_outcomes", "Attempt outcomes recorded in the ledger", "outcome",
                     {o: sum(kinds.get(k, 0) for k in ks) for o, ks in ATTEMPT_OUTCOME_KINDS.items()}),
            _counter("dataflow_run_failures", "Failed runs by error code", "error_code", failures),
            *_fleet_families(found),
            _gauge("dataflow_lineage_pending", "Ledger entries waiting for lineage delivery (0 when lineage is off)",
                   lineage_pending),
        ]  # fmt: skip


def _age_s(now_us: int, since_us: int | None) -> float:
    return 0.0 if since_us is None else max(0.0, (now_us - since_us) / US_PER_S)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _labelled(family: Family, values: dict[str, int] | dict[str, float]) -> Family:
    for label, value in values.items():
        family.add_metric([label], value)
    return family


def _counter(name: str, documentation: str, label: str, values: dict[str, int]) -> Family:
    return _labelled(CounterMetricFamily(name, documentation, labels=[label]), values)


def _run_families(
    by_status: dict[str, int], by_recovery: dict[str, int], unresolved_total: int, oldest_unresolved_s: float
) -> list[Family]:
    statuses = {s.value: by_status.get(s.value, 0) for s in RunStatus}  # a zero series for every status
    recoveries = {s.value: by_recovery.get(s.value, 0) for s in RecoveryStatus}
    return [
        _labelled(GaugeMetricFamily("dataflow_runs", "Dataflow runs by status", labels=["status"]), statuses),
        _labelled(GaugeMetricFamily("dataflow_runs_recovery", "Dataflow runs by Core recovery status",
                                    labels=["recovery_status"]), recoveries),
        _gauge("dataflow_runs_queued", "Runs queued for a worker", statuses[RunStatus.QUEUED.value]),
        _gauge("dataflow_runs_running", "Runs with an attempt in progress", statuses[RunStatus.RUNNING.value]),
        _gauge("dataflow_unresolved_runs", "Unresolved runs (need an operator)", unresolved_total),
        _gauge("dataflow_oldest_unresolved_age_seconds",
               "Age of the oldest unresolved run on the database clock (0 when none)", oldest_unresolved_s),
    ]  # fmt: skip


def _fleet_families(found: Sequence[fleet.WorkerView]) -> list[Family]:
    alive = GaugeMetricFamily("dataflow_workers_alive", "Worker processes and serve sweepers alive, by role",
                              labels=["role"])  # fmt: skip
    for role in fleet.Role:
        alive.add_metric([role.value], sum(1 for w in found if w.role == role and w.state == fleet.WorkerState.ALIVE))
    age = GaugeMetricFamily(
        "dataflow_worker_last_beat_age_seconds",
        "Seconds since each running (not stopped) process's last heartbeat, on the database clock",
        labels=["holder", "role", "state"],
    )
    for w in found:
        if w.state != fleet.WorkerState.STOPPED:
            age.add_metric([w.holder, w.role, str(w.state)], w.last_beat_age_s)
    return [alive, age]


class RunMetrics:
    """Run durations observed by the process that carried each attempt to its end."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration_seconds = Histogram(
            "dataflow_run_duration_seconds",
            "Seconds from an attempt's claim to the end of its run, by definition and mode",
            ["definition", "mode"],
            buckets=RUN_DURATION_BUCKETS_S,
            registry=registry,
        )
        self._definitions: set[str] = set()
        self._lock = threading.Lock()

    def observe_run(self, run: Run, seconds: float) -> None:
        with self._lock:
            if run.definition_name not in self._definitions and len(self._definitions) < DEFINITION_LABELS_MAX:
                self._definitions.add(run.definition_name)
            shown = run.definition_name if run.definition_name in self._definitions else "other"
        self.duration_seconds.labels(shown, str(run.mode)).observe(seconds)


class LineageMetrics:
    """Lineage events this process delivered, and its delivery rounds that failed (docs/lineage.md)."""

    OUTCOMES = ("delivered", "failed")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "dataflow_lineage_events",
            "Lineage events delivered by this process, and its delivery rounds stopped by a failed emit",
            ["outcome"],
            registry=registry,
        )
        for outcome in self.OUTCOMES:  # a zero series for each, so alerts need no `or vector(0)`
            self.events.labels(outcome)

    def observe_delivery(self, delivered: int, failed: bool) -> None:
        if delivered:
            self.events.labels("delivered").inc(delivered)
        if failed:
            self.events.labels("failed").inc()


class Metrics:
    """One application's metrics."""

    def __init__(
        self,
        db: Database,
        scrape_interval_s: float = SCRAPE_INTERVAL_S_MIN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.request_seconds = Histogram(
            "dataflow_api_request_seconds",
            "HTTP request latency by route template and status",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.commit_seconds = Histogram(
            "dataflow_api_commit_seconds",
            "Latency of the API operations that commit (submit, reconcile), end to end",
            ["operation"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.runs = RunMetrics(self.registry)
        self.lineage = LineageMetrics(self.registry)
        self.registry.register(_DatabaseCollector(db, scrape_interval_s, clock))

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        shown = method if method in HTTP_METHODS else "other"
        self.request_seconds.labels(shown, route, str(status)).observe(seconds)

    def observe_commit(self, operation: str, seconds: float) -> None:
        self.commit_seconds.labels(operation).observe(seconds)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


class WorkerMetrics:
    """A worker's metrics (``dataflow worker --metrics-port``): the platform-wide families, as on ``serve``,
    and the run durations this worker observed, served over HTTP by prometheus-client in this process."""

    def __init__(self, db: Database, scrape_interval_s: float = SCRAPE_INTERVAL_S_MIN) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.runs = RunMetrics(self.registry)
        self.lineage = LineageMetrics(self.registry)
        self.registry.register(_DatabaseCollector(db, scrape_interval_s))

    def serve(self, port: int, host: str = METRICS_HOST_DEFAULT) -> tuple[Callable[[], None], int]:
        """Listen on ``host:port`` (0: any free port) in a daemon thread; returns the function that stops it
        and the port bound."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join()

        return stop, int(server.server_address[1])

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
