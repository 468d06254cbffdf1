"""Small dataflow definitions and requests for protocol tests (no files needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml

from durable_dataflow.core import ledger
from durable_dataflow.dataflow.definitions.definitions import Definition, parse_definition
from durable_dataflow.dataflow.protocol import derivation, reconcile, runs
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import Provider
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform

ROWS = [
    {"region": "north", "amount": "10.50"},
    {"region": "south", "amount": "4.25"},
    {"region": "north", "amount": "1.00"},
]


# The smallest valid definition document, as YAML (tests/unit pins its hash).
MINIMAL_YAML = """\
name: tiny
version: 1
sources:
  nums: {kind: inline, rows: [{n: 1}, {n: 2}], schema: {n: int64}}
steps:
  - {name: total, sql: "select sum(n) as total from nums"}
output:
  schema: {total: int64}
  max_rows: 10
  max_bytes: 64KiB
"""


# A definition with one date parameter and an inline source (no file to read): the schedule and
# backfill tests' flow, as YAML and as a JSON document (with an optional schedule block).
DAILY_YAML = """\
name: daily
version: 1
parameters:
  day: {type: date}
sources:
  nums: {kind: inline, rows: [{n: 1}], schema: {n: int64}}
steps:
  - {name: result, sql: "select $day::DATE as day, sum(n) as total from nums"}
output:
  schema: {day: date, total: int64}
  max_rows: 10
  max_bytes: 64KiB
"""


def daily_flow(schedule: dict[str, Any] | None = None, name: str = "daily") -> dict[str, Any]:
    """DAILY_YAML as a JSON document named ``name``, with ``schedule``."""
    document: dict[str, Any] = {**yaml.safe_load(DAILY_YAML), "name": name}
    if schedule is not None:
        document["schedule"] = schedule
    return document


def one_step(
    sources: dict[str, Any],
    sql: str,
    columns: dict[str, str],
    *,
    name: str = "flow",
    max_rows: int = 1000,
    max_bytes: str = "1MiB",
) -> Definition:
    """A definition of the given sources and one step named ``result`` with the declared output columns."""
    return Definition.model_validate({
        "name": name, "version": 1, "sources": sources,
        "steps": [{"name": "result", "sql": sql}],
        "output": {"schema": columns, "max_rows": max_rows, "max_bytes": max_bytes},
    })  # fmt: skip


def definition(
    target: dict[str, Any] | None = None,
    *,
    name: str = "totals",
    extra_sources: dict[str, Any] | None = None,
    sql: str | None = None,
) -> Definition:
    """Totals per region from an inline source; with a target it is a forward-recovery dataflow."""
    document: dict[str, Any] = {
        "name": name,
        "version": 1,
        "parameters": {"factor": {"type": "int", "default": 1}},
        "sources": {
            "sales": {"kind": "inline", "rows": ROWS, "schema": {"region": "string", "amount": "decimal(12,2)"}},
            **(extra_sources or {}),
        },
        "steps": [
            {
                "name": "totals",
                "sql": sql
                or (
                    "select region, (sum(amount) * $factor)::DECIMAL(18,2) as total, count(*)::BIGINT as n "
                    "from sales group by region order by region"
                ),
            }
        ],
        "output": {
            "schema": {"region": "string", "total": "decimal(18,2)", "n": "int64"},
            "max_rows": 100,
            "max_bytes": "1MiB",
        },
    }
    if target is not None:
        document["target"] = target
    return parse_definition(json.dumps(document), "<test>")


def daily_partition_definition(datasource: str, provider: str) -> Definition:
    """One row a day (``day`` = the parameter), replacing that day's partition of ``datasource`` at ``daily``."""
    document = {
        "name": "daily_totals", "version": 1, "parameters": {"day": {"type": "date"}},
        "sources": {"nums": {"kind": "inline", "rows": [{"n": 1}], "schema": {"n": "int64"}}},
        "steps": [{"name": "result", "sql": "select $day::DATE as day, n from nums"}],
        "output": {"schema": {"day": "date", "n": "int64"}, "max_rows": 10, "max_bytes": "64KiB"},
        "target": {"type": "datasources.publication", "provider": provider, "datasource": datasource,
                   "location": "daily", "mode": "replace_partition", "partition": {"day": "$day"}},
    }  # fmt: skip
    return parse_definition(json.dumps(document), "<test>")


def parquet_target(provider: str = "parquet", location: str = "sink") -> dict[str, Any]:
    return {
        "type": "datasources.publication",
        "provider": provider,
        "datasource": "analytics.totals",
        "location": location,
        "mode": "append",
    }


def request(
    defn: Definition,
    base_dir: Path,
    key: str | None = None,
    *,
    tenant: str = "acme",
    params: dict[str, Any] | None = None,
    max_attempts: int = 3,
) -> RunRequest:
    return RunRequest(
        defn,
        base_dir,
        params or {},
        AccessContext(tenant, "tester", ("operator",), (), "test"),
        Provenance("tester", "cli"),
        idempotency_key=key,
        max_attempts=max_attempts,
    )


#: The lease of the platforms tests open: long against real time, so a host that stalls a test for
#: seconds (a neighbour's fsync, two xdist processes on two cores) never expires one mid-run; a test
#: expires leases by moving the database clock (``expire_leases``).
LEASE_TTL_S = 60.0


def expire_leases(platform: Platform) -> None:
    """Move this platform's database clock just past every lease it has granted so far."""
    platform.db.advance_clock(platform.runs.config.lease_ttl_s + 1)


def kinds(platform: Platform, run_id: str) -> list[str]:
    with platform.db.read() as conn:
        return [entry.kind for entry in ledger.read(conn, "dataflow", run_id)]


def row_counts(platform: Platform) -> dict[str, int]:
    """Rows per platform table: 'nothing written' means these are unchanged."""
    tables = ("ledger_entries", "leases", "checkpoints", "definitions", "dataflow_runs", "run_results")
    with platform.db.read() as conn:
        return {t: int(conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one()) for t in tables}


def manifests(sink: Path) -> list[dict[str, Any]]:
    """Publication manifests of a Parquet-folder sink, read directly from disk."""
    folder = sink / "_manifests"
    if not folder.exists():
        return []
    found = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    return [m for m in found if m.get("kind") == "publication"]


def delta_live_files(table: Path) -> dict[str, dict[str, Any]]:
    """The Delta log replayed by hand (adds minus removes), without delta-rs: each live file's path and
    its partition values."""
    live: dict[str, dict[str, Any]] = {}
    for commit in sorted((table / "_delta_log").glob("*.json")):
        for line in commit.read_text("utf-8").splitlines():
            action = json.loads(line) if line.strip() else {}
            if "add" in action:
                live[action["add"]["path"]] = action["add"].get("partitionValues") or {}
            elif "remove" in action:
                live.pop(action["remove"]["path"], None)
    return live


def delta_publications(table_dir: Path, key: str | None = None) -> list[dict[str, Any]]:
    """Publication commits in a Delta table's log, read from the JSON commit files directly."""
    log = table_dir / "_delta_log"
    found: list[dict[str, Any]] = []
    for commit in sorted(log.glob("*.json")) if log.exists() else []:
        for line in commit.read_text().splitlines():
            info = json.loads(line).get("commitInfo")
            if info and info.get("dataflow_kind") == "publication" and (key is None or info.get("dataflow_key") == key):
                found.append(info)
    return found


# ---- forward runs, faults and reconciliation, as the recovery tests drive them ----------------------

OPERATOR = AccessContext("acme", "tester", ("operator",), (), "test")
OPERATOR_PROVENANCE = Provenance("tester", "cli")


def install_faulty(fault: str, inspect_fault: str = "none", inner: Provider | None = None) -> FaultInjectingProvider:
    """Register provider "faulty": ``inner`` (Delta by default) with one publish and one inspect fault."""
    provider = FaultInjectingProvider(inner or DeltaProvider(), fault, inspect_fault)  # type: ignore[arg-type]
    registry.register_provider("faulty", lambda: provider)
    return provider


def forward(platform: Platform, base_dir: Path, provider: str, key: str) -> Run:
    """An inline forward run of the totals definition to ``provider`` at ``<base_dir>/sink``."""
    return platform.runs.run_inline(request(definition(parquet_target(provider)), base_dir, key)).run


def reconcile_as_operator(platform: Platform, run_id: str, *, resume: bool = False) -> reconcile.Reconciliation:
    """Reconcile as the tenant's operator who submitted the test runs."""
    return reconcile.reconcile(platform.runs, run_id, access=OPERATOR, provenance=OPERATOR_PROVENANCE, resume=resume)


def verify(platform: Platform, run_id: str) -> ledger.Verification:
    """What `dataflow verify` says of the run as stored now."""
    with platform.db.read() as conn:
        return derivation.verify_run(conn, runs.get(conn, run_id), platform.runs.config.evidence_key)


@dataclass(frozen=True)
class StoredResult:
    """The shape of an ExecutionResult that ``results.store`` reads: bytes to store as a run's result."""

    ipc_bytes: memoryview
    row_count: int = 1
    output_digest: str = "sha256:" + "0" * 64
    source_fingerprint_digest: str = "sha256:" + "0" * 64
    sources: tuple[tuple[str, str, str], ...] = ()
