"""Forward runs publishing to a Delta table on an S3-compatible store (issue 31), on both platform
databases, against a real S3 API server on loopback: publish and replay, a lost answer ending
outcome_unknown and reconciled present, a request that never reached the store reconciled absent and
resumed. The table is read back without delta-rs (its log replayed with boto3): each key once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.platform import Platform
from support import flows
from support.s3 import FaultProxy, S3Place, delta_log_rows, delta_publication_commits

TABLE = "tables/totals"
# A commit of the table after its creation (version 0 is `prepare`'s, before dispatch is authorized).
LATER_COMMIT = r"/_delta_log/(?!0{20})\d{20}\.json$"



# These runs make many requests to a store on loopback (a probe, the marker, state objects; lost answers
# retried by boto3 with back-off), so on a loaded CI machine one attempt can outlast the shared fixture's
# 5 s lease; nothing here depends on a lease expiring (a CI run saw an attempt lose its lease mid-flight).
LEASE_TTL_S = 30


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=LEASE_TTL_S) as opened:
        yield opened

def s3_target(s3: S3Place, endpoint: str | None = None) -> dict[str, Any]:
    return {
        "type": "datasources.publication",
        "provider": "delta",
        "datasource": "analytics.totals",
        "location": s3.url(TABLE),
        "mode": "append",
        "options": s3.options(endpoint),
    }


def run_to(platform: Platform, tmp_path: Path, target: dict[str, Any], key: str = "k1") -> Run:
    return platform.runs.run_inline(flows.request(flows.definition(target), tmp_path, key)).run


def regions(s3: S3Place) -> list[str]:
    table = delta_log_rows(s3.client(), s3.bucket, TABLE)
    return sorted(table.column("region").to_pylist())


def test_a_run_publishes_to_s3_once_and_a_replay_adds_nothing(platform: Platform, s3: S3Place, tmp_path: Path) -> None:
    run = run_to(platform, tmp_path, s3_target(s3))
    assert (run.status, run.recovery_status) == ("succeeded", "verified")
    assert run.publication_ref == f"delta+{s3.url(TABLE)}#txn={run.publication_idempotency_key}"
    again = platform.runs.run_inline(flows.request(flows.definition(s3_target(s3)), tmp_path, "k1"))
    assert not again.created
    assert delta_publication_commits(s3.client(), s3.bucket, TABLE, str(run.publication_idempotency_key)) == 1
    assert regions(s3) == ["north", "south"]
    assert flows.verify(platform, run.run_id).ok


def test_a_lost_answer_is_outcome_unknown_then_reconciled_present(
    platform: Platform, s3: S3Place, tmp_path: Path
) -> None:
    proxy = FaultProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        proxy.lose_answer("PUT", LATER_COMMIT, then_blackhole=True)
        run = run_to(platform, tmp_path, s3_target(s3, proxy.endpoint))
        assert proxy.fired == 1
        assert (run.status, run.recovery_status) == ("outcome_unknown", "outcome_unknown")
        assert run.warning and "127.0.0.1" not in run.warning and s3.bucket not in run.warning
        proxy.heal()
        result = flows.reconcile_as_operator(platform, run.run_id)
    finally:
        proxy.stop()
    assert result.finding == "present"
    assert (result.run.status, result.run.recovery_status) == ("succeeded", "reconciled_present")
    assert delta_publication_commits(s3.client(), s3.bucket, TABLE, str(run.publication_idempotency_key)) == 1
    assert regions(s3) == ["north", "south"]
    assert flows.verify(platform, run.run_id).ok


def test_a_request_that_never_reached_the_store_is_reconciled_absent_and_resumed_once(
    platform: Platform, s3: S3Place, tmp_path: Path
) -> None:
    proxy = FaultProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        # The commit's PUT and everything after it are dropped before reaching the store.
        proxy.lose_answer("PUT", LATER_COMMIT, forward=False, then_blackhole=True)
        run = run_to(platform, tmp_path, s3_target(s3, proxy.endpoint))
        assert run.status == "outcome_unknown"
        proxy.heal()
        absent = flows.reconcile_as_operator(platform, run.run_id)
        assert absent.finding == "absent"
        assert (absent.run.status, absent.run.recovery_status) == ("failed", "reconciled_absent")
        resumed = flows.reconcile_as_operator(platform, run.run_id, resume=True)
    finally:
        proxy.stop()
    assert resumed.resumed and resumed.run.status == "succeeded"
    assert delta_publication_commits(s3.client(), s3.bucket, TABLE, str(run.publication_idempotency_key)) == 1
    assert regions(s3) == ["north", "south"]


def test_a_table_deleted_from_the_store_is_never_recreated_and_never_proven_absent(
    platform: Platform, s3: S3Place, tmp_path: Path
) -> None:
    """The table's location was registered when the first run created it. Once its objects are gone
    (deleted, or the prefix moved), a new run fails before dispatch (`location_missing`) and creates
    nothing, and an unresolved run's reconcile stays undecided: absence is never inferred from a
    missing prefix on a store either."""
    proxy = FaultProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        proxy.lose_answer("PUT", LATER_COMMIT, forward=False, then_blackhole=True)
        unknown = run_to(platform, tmp_path, s3_target(s3, proxy.endpoint), key="lost")
        assert unknown.status == "outcome_unknown"
        proxy.heal()
        client = s3.client()
        for item in client.list_objects_v2(Bucket=s3.bucket, Prefix=TABLE + "/").get("Contents", []):
            client.delete_object(Bucket=s3.bucket, Key=item["Key"])
        result = flows.reconcile_as_operator(platform, unknown.run_id)
        # The same place: the same endpoint (one bucket name at another endpoint is another place).
        fresh = run_to(platform, tmp_path, s3_target(s3, proxy.endpoint), key="after")
    finally:
        proxy.stop()
    assert (result.finding, result.run.status) == ("undecided", "outcome_unknown")
    assert fresh.error_code == "location_missing"
    assert (fresh.status, fresh.recovery_status) == ("failed", "no_external_output")
    assert s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=TABLE + "/").get("KeyCount") == 0
