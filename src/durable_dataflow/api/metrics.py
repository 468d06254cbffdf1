"""Prometheus metrics on a per-application registry (no global state: two apps, two registries).

Run counts are read from the database at scrape time, so every worker's runs count, not only the
ones this server process saw. Latencies are observed by this process.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from durable_dataflow.core.db import Database
from durable_dataflow.dataflow.protocol import evidence
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


class _DatabaseCollector(Collector):
    """Platform-wide run gauges, read from the projection and the ledger at scrape time."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.db.read() as conn:
            now_us = self.db.now_us(conn)
            by_status = ops_ledger.runs_by_status(conn)
            by_recovery = ops_ledger.runs_by_recovery_status(conn)
            kinds = ops_ledger.ledger_kind_counts(conn)
            unresolved_total, oldest = ops_ledger.unresolved_runs(conn, self.db, now_us, limit=1)
        runs = GaugeMetricFamily("dataflow_runs", "Dataflow runs by status", labels=["status"])
        for status, count in by_status.items():
            runs.add_metric([status], count)
        yield runs
        recovery = GaugeMetricFamily(
            "dataflow_runs_recovery", "Dataflow runs by Core recovery status", labels=["recovery_status"]
        )
        for status, count in by_recovery.items():
            recovery.add_metric([status], count)
        yield recovery
        yield GaugeMetricFamily(
            "dataflow_unresolved_runs", "Unresolved runs (need an operator)", value=unresolved_total
        )
        yield GaugeMetricFamily(
            "dataflow_oldest_unresolved_age_seconds",
            "Age of the oldest unresolved run on the database clock (0 when none)",
            value=oldest[0].age_s if oldest else 0.0,
        )
        outcomes = GaugeMetricFamily(
            "dataflow_attempt_outcomes", "Attempt outcomes recorded in the ledger", labels=["outcome"]
        )
        for outcome, outcome_kinds in ATTEMPT_OUTCOME_KINDS.items():
            outcomes.add_metric([outcome], sum(kinds.get(kind, 0) for kind in outcome_kinds))
        yield outcomes


class Metrics:
    """One application's metrics."""

    def __init__(self, db: Database) -> None:
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
        self.registry.register(_DatabaseCollector(db))

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        shown = method if method in HTTP_METHODS else "other"
        self.request_seconds.labels(shown, route, str(status)).observe(seconds)

    def observe_commit(self, operation: str, seconds: float) -> None:
        self.commit_seconds.labels(operation).observe(seconds)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
