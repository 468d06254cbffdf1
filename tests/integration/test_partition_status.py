"""Partition status (issue 27, item 4: `dataflow.partitions.status`, behind `dataflow partitions`, the API
and the page), on SQLite and PostgreSQL platform databases with a Delta sink.

The current publication of a partition is its succeeded run with the highest partition token: a re-run
replaces it, a run refused as superseded never is it; queued, running, unresolved and failed runs after
it are listed with their state; the days of a date range with no run are missing; a range is typed by the
partition column; one tenant never sees another's partitions; and runs recorded before the partition
columns existed are filled in by migration 0011.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durable_dataflow.core import crashpoints, leases
from durable_dataflow.core.errors import InputError, NotFound
from durable_dataflow.dataflow.definitions.definitions import Definition, parse_definition
from durable_dataflow.dataflow.protocol import partitions
from durable_dataflow.dataflow.protocol.partitions import PartitionState, PendingState
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows

DATASOURCE = "analytics.daily_totals"


def _definition(*, provider: str = "delta", columns: tuple[str, ...] = ("day",), sql: str | None = None) -> Definition:
    document = {
        "name": "daily_totals",
        "version": 1,
        "parameters": {"day": {"type": "date"}, "factor": {"type": "int", "default": 1}},
        "sources": {
            "sales": {"kind": "inline", "rows": flows.ROWS, "schema": {"region": "string", "amount": "decimal(12,2)"}},
        },
        "steps": [{"name": "totals", "sql": sql or (
            "select $day::DATE as day, $factor::BIGINT as factor, region, sum(amount)::DECIMAL(18,2) as total "
            "from sales group by region order by region"
        )}],
        "output": {
            "schema": {"day": "date", "factor": "int64", "region": "string", "total": "decimal(18,2)"},
            "max_rows": 100, "max_bytes": "1MiB",
        },
        "target": {
            "type": "datasources.publication", "provider": provider, "datasource": DATASOURCE,
            "location": "daily", "mode": "replace_partition", "partition": {c: f"${c}" for c in columns},
        },
    }  # fmt: skip
    return parse_definition(json.dumps(document), "<test>")


def _run(platform: Platform, tmp_path: Path, defn: Definition, key: str, tenant: str = "acme", **params: Any) -> Run:
    return platform.runs.run_inline(flows.request(defn, tmp_path, key, tenant=tenant, params=params)).run


def _status(platform: Platform, tenant: str = "acme", first: str | None = None, last: str | None = None) -> Any:
    with platform.db.read() as conn:
        return partitions.status(conn, platform.db, tenant, DATASOURCE, first, last)


def _by_label(found: partitions.DatasourceStatus) -> dict[str, partitions.PartitionStatus]:
    return {p.label: p for p in found.partitions}


def test_the_current_publication_is_the_latest_rerun_and_missing_days_are_listed(
    platform: Platform, tmp_path: Path
) -> None:
    """Days 1 and 3 published, day 1 re-run: day 1's current publication is the re-run (token 2, its key,
    digest, rows, definition hash), day 3's its only run, day 2 (and day 4 of the range) missing."""
    defn = _definition()
    first = _run(platform, tmp_path, defn, "d1-a", day="2024-03-01")
    third = _run(platform, tmp_path, defn, "d3-a", day="2024-03-03")
    again = _run(platform, tmp_path, defn, "d1-b", day="2024-03-01", factor=2)
    assert [r.status for r in (first, third, again)] == ["succeeded"] * 3
    found = _status(platform, first="2024-03-01", last="2024-03-04")
    assert found.columns == ("day",)
    assert [p.label for p in found.partitions] == ["2024-03-01", "2024-03-02", "2024-03-03", "2024-03-04"]
    shown = _by_label(found)
    current = shown["2024-03-01"].current
    assert current is not None and current.run.run_id == again.run_id and current.partition_token == 2
    assert current.as_json() == {
        "run_id": again.run_id, "idempotency_key": "d1-b", "definition_hash": again.definition_hash,
        "output_digest": again.output_digest, "row_count": again.row_count, "published_at_us": again.updated_at_us,
        "partition_token": 2,
    }  # fmt: skip
    assert shown["2024-03-01"].pending == () and shown["2024-03-01"].state == PartitionState.PUBLISHED
    assert shown["2024-03-03"].current is not None and shown["2024-03-03"].current.run.run_id == third.run_id
    for day in ("2024-03-02", "2024-03-04"):
        assert (shown[day].state, shown[day].current, shown[day].pending) == (PartitionState.MISSING, None, ())
    unbounded = [p.label for p in _status(platform).partitions]
    assert unbounded == ["2024-03-01", "2024-03-02", "2024-03-03"]  # from the first to the last day seen
    assert [p.label for p in _status(platform, first="2024-03-02").partitions] == ["2024-03-02", "2024-03-03"]


def test_a_superseded_run_is_never_current_nor_shown_after(platform: Platform, tmp_path: Path) -> None:
    """Run A is authorized (token 1); run B of the day is authorized (token 2) and publishes; A's publish
    is refused superseded. B is current; A (failed, but before B by token and creation) is not listed."""
    defn = _definition()
    later: list[Run] = []

    def overlap(point: str) -> None:
        if point == crashpoints.AFTER_PREDISPATCH_COMMIT and not later:
            crashpoints.set_hook(None)
            later.append(_run(platform, tmp_path, defn, "day-b", day="2024-03-01", factor=2))

    crashpoints.set_hook(overlap)
    earlier = _run(platform, tmp_path, defn, "day-a", day="2024-03-01")
    assert (earlier.status, earlier.error_code) == ("failed", "publication_rejected")
    day = _by_label(_status(platform))["2024-03-01"]
    assert day.current is not None and day.current.run.run_id == later[0].run_id
    assert day.current.partition_token == 2 and day.pending == ()


def test_the_current_publication_is_chosen_by_token_not_by_creation(platform: Platform, tmp_path: Path) -> None:
    """Run A of a day is queued first, run B of it is created later and publishes first (token 1): A is
    listed queued after B's publication (it will take a higher token). Then a worker runs A (token 2): the
    sink holds A's rows, so A is current although B is newer."""
    defn = _definition()
    queued = platform.runs.submit(flows.request(defn, tmp_path, "a", params={"day": "2024-03-01"})).run
    newer = _run(platform, tmp_path, defn, "b", day="2024-03-01", factor=2)
    before = _by_label(_status(platform))["2024-03-01"]  # A, created earlier, will publish after B: listed
    assert before.current is not None and before.current.run.run_id == newer.run_id
    assert [(p.view.run.run_id, p.state) for p in before.pending] == [(queued.run_id, PendingState.QUEUED)]
    claim = platform.runs.claim_next()
    assert claim is not None and claim.run.run_id == queued.run_id
    assert platform.runs.execute(claim).status == "succeeded" and newer.status == "succeeded"
    day = _by_label(_status(platform))["2024-03-01"]
    assert day.current is not None and (day.current.run.run_id, day.current.partition_token) == (queued.run_id, 2)
    assert day.pending == ()


def test_runs_after_the_current_publication_are_listed_with_their_state(platform: Platform, tmp_path: Path) -> None:
    """After day 1's publication: a run failing before dispatch (rows outside the partition) shows failed,
    a submitted run queued; a day whose only run's outcome is unknown is missing with it unresolved."""
    # All runs go through one provider name: a datasource is registered with its first run's provider.
    faulty = FaultInjectingProvider(DeltaProvider(), "fail_before_send", fail_times=1)
    registry.register_provider("faulty", lambda: faulty)
    defn = _definition(provider="faulty")
    unknown = _run(platform, tmp_path, defn, "d2", day="2024-03-02")  # its one publish call fails
    assert unknown.status == "outcome_unknown"
    published = _run(platform, tmp_path, defn, "d1", day="2024-03-01")
    outside = "select $day::DATE + 1 as day, 1::BIGINT as factor, 'x' as region, 1::DECIMAL(18,2) as total"
    failed = _run(platform, tmp_path, _definition(provider="faulty", sql=outside), "d1-bad", day="2024-03-01")
    assert (published.status, failed.error_code) == ("succeeded", "partition_violation")
    queued = platform.runs.submit(flows.request(defn, tmp_path, "d1-q", params={"day": "2024-03-01"})).run
    shown = _by_label(_status(platform))
    day1 = shown["2024-03-01"]
    assert day1.current is not None and day1.current.run.run_id == published.run_id
    assert {(p.view.run.run_id, p.state) for p in day1.pending} == {
        (failed.run_id, PendingState.FAILED), (queued.run_id, PendingState.QUEUED)
    }
    day2 = shown["2024-03-02"]
    assert day2.state == PartitionState.MISSING and day2.current is None
    assert [(p.view.run.run_id, p.state) for p in day2.pending] == [(unknown.run_id, PendingState.UNRESOLVED)]
    pending_json = day2.as_json()["after"][0]
    assert pending_json["unresolved"] is True and "reconcile" in pending_json["warning"]


def test_a_tenant_never_sees_another_tenants_partitions(platform: Platform, tmp_path: Path) -> None:
    """Tenant acme's partitions are unknown to tenant other (NotFound, as an unknown datasource), and
    other's own run of the same datasource and day shows only other's publication."""
    defn = _definition()
    mine = _run(platform, tmp_path, defn, "acme-d1", day="2024-03-01")
    with pytest.raises(NotFound, match="no partitioned runs"):
        _status(platform, tenant="other")
    theirs = _run(platform, tmp_path, defn, "other-d1", tenant="other", day="2024-03-01")
    for tenant, run in (("acme", mine), ("other", theirs)):
        day = _by_label(_status(platform, tenant=tenant))["2024-03-01"]
        assert day.current is not None and day.current.run.run_id == run.run_id
        assert day.current.partition_token == 1  # tokens are per tenant too


def test_bad_bounds_and_unknown_datasources_are_refused_clearly(platform: Platform, tmp_path: Path) -> None:
    """A --from that is not a date for a date column, a datasource with no runs, a name that is no text,
    and bounds on a datasource partitioned by two columns: each refused by what is wrong, never echoing
    the value given."""
    _run(platform, tmp_path, _definition(), "d1", day="2024-03-01")
    with pytest.raises(InputError, match=r"--from must be a date \(YYYY-MM-DD\)") as bad:
        _status(platform, first="s3cr3t-not-a-day")
    assert "s3cr3t" not in bad.value.message
    with pytest.raises(InputError, match="--to must be a date"):
        _status(platform, last="2024-02-30")
    with pytest.raises(NotFound) as unknown, platform.db.read() as conn:
        partitions.status(conn, platform.db, "acme", "token=s3cr3t value", None, None)
    assert "s3cr3t" not in unknown.value.message
    with pytest.raises(InputError), platform.db.read() as conn:
        partitions.status(conn, platform.db, "acme", "", None, None)
    two = _definition(columns=("day", "factor"))
    _run(platform, tmp_path, two, "two", day="2024-03-02", factor=3)
    with pytest.raises(InputError, match="one column"):
        _status(platform, first="2024-03-01")
    labels = [p.label for p in _status(platform).partitions]
    assert labels == ["2024-03-01", "day=2024-03-02 factor=3"]  # each run's own partition, as its target says


def test_the_partition_columns_hold_the_resolved_partition(platform: Platform, tmp_path: Path) -> None:
    """A partitioned run's row holds its datasource and canonical partition values; an unpartitioned run's
    holds neither."""
    run = _run(platform, tmp_path, _definition(), "d1", day="2024-03-01")
    plain = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "plain")).run
    with platform.db.read() as conn:
        found = conn.execute(
            sa.select(dataflow_runs.c.run_id, dataflow_runs.c.partition_datasource, dataflow_runs.c.partition_json)
        ).all()
    rows = {row.run_id: (row.partition_datasource, row.partition_json) for row in found}
    assert rows[run.run_id] == (DATASOURCE, '{"day":"2024-03-01"}')
    assert rows[plain.run_id] == (None, None)


def test_more_runs_than_one_lease_query_names_are_read_in_pages(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one lease query naming at most 2 runs, five queued runs of a day are still all listed after
    its publication (the views are read in pages, never one statement over the limit)."""
    defn = _definition()
    published = _run(platform, tmp_path, defn, "d1", day="2024-03-01")
    queued = {platform.runs.submit(flows.request(defn, tmp_path, f"q{n}", params={"day": "2024-03-01"})).run.run_id
              for n in range(5)}  # fmt: skip
    monkeypatch.setattr(leases, "EXPIRY_SUBJECTS_MAX", 2)
    day = _by_label(_status(platform))["2024-03-01"]
    assert day.current is not None and day.current.run.run_id == published.run_id
    assert {p.view.run.run_id for p in day.pending} == queued
    assert {p.state for p in day.pending} == {PendingState.QUEUED}
