"""Forward runs publishing to a Parquet folder on an S3-compatible store (issue 31), on both platform databases,
against a real S3 API server on loopback: publish and replay, a lost answer ending outcome_unknown and reconciled
present, a request that never reached the store reconciled absent and resumed once, a prefix wiped from the store
never re-created nor proven absent. The sink is read back without the provider: the key state objects with boto3,
the data files they name with pyarrow.dataset over pyarrow's S3FileSystem; each key once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from durable_dataflow.core.secrets import SecretScope
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources.objectstore import store_options
from durable_dataflow.datasources.parquet_store import NO_CONDITIONAL_WRITES, key_hash
from durable_dataflow.platform import Platform
from support import flows
from support.cli import make_cli
from support.s3 import ACCESS_KEY, SECRET_KEY, FaultProxy, S3Place, StrippingProxy

FOLDER = "folders/totals"
STATE_PUT = r"/_dataflow/keys/[0-9a-f]{64}\.json$"



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
        "provider": "parquet",
        "datasource": "analytics.totals",
        "location": s3.url(FOLDER),
        "mode": "append",
        "options": s3.options(endpoint),
    }


def run_to(platform: Platform, tmp_path: Path, target: dict[str, Any], key: str = "k1") -> Run:
    return platform.runs.run_inline(flows.request(flows.definition(target), tmp_path, key)).run


def published(s3: S3Place) -> dict[str, dict[str, Any]]:
    """Each published key's state object, read with boto3."""
    client = s3.client()
    found = client.list_objects_v2(Bucket=s3.bucket, Prefix=f"{FOLDER}/_dataflow/keys/").get("Contents") or []
    states = [json.loads(client.get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read()) for o in found]
    return {s["key"]: s for s in states if s["state"] == "published"}


def regions(s3: S3Place) -> list[str]:
    """The regions of every published row, read by pyarrow.dataset from the files the published states name."""
    files = [f"{s3.bucket}/{FOLDER}/{state['file']}" for state in published(s3).values()]
    filesystem = store_options(s3.options(), SecretScope.local(), "test").filesystem()
    table = ds.dataset(files, format="parquet", filesystem=filesystem).to_table(columns=["region"])
    return sorted(table.column("region").to_pylist())


def data_files(s3: S3Place, key: str) -> int:
    prefix = f"{FOLDER}/data/{key_hash(key)}-"
    return int(s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("KeyCount") or 0)


def test_a_run_publishes_to_s3_once_and_a_replay_adds_nothing(platform: Platform, s3: S3Place, tmp_path: Path) -> None:
    run = run_to(platform, tmp_path, s3_target(s3))
    assert (run.status, run.recovery_status) == ("succeeded", "verified")
    key = str(run.publication_idempotency_key)
    assert run.publication_ref == f"parquet+{s3.url(FOLDER)}/_dataflow/keys/{key_hash(key)}.json"
    again = platform.runs.run_inline(flows.request(flows.definition(s3_target(s3)), tmp_path, "k1"))
    assert not again.created
    assert list(published(s3)) == [key] and data_files(s3, key) == 1
    assert regions(s3) == ["north", "south"]
    assert flows.verify(platform, run.run_id).ok


def test_a_lost_answer_is_outcome_unknown_then_reconciled_present(
    platform: Platform, s3: S3Place, tmp_path: Path
) -> None:
    proxy = FaultProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        proxy.lose_answer("PUT", STATE_PUT, then_blackhole=True)
        run = run_to(platform, tmp_path, s3_target(s3, proxy.endpoint))
        assert proxy.fired == 1
        assert (run.status, run.recovery_status) == ("outcome_unknown", "outcome_unknown")
        proxy.heal()
        result = flows.reconcile_as_operator(platform, run.run_id)
    finally:
        proxy.stop()
    assert result.finding == "present"
    assert (result.run.status, result.run.recovery_status) == ("succeeded", "reconciled_present")
    assert list(published(s3)) == [run.publication_idempotency_key]
    assert regions(s3) == ["north", "south"]
    assert flows.verify(platform, run.run_id).ok


def test_a_request_that_never_reached_the_store_is_reconciled_absent_and_resumed_once(
    platform: Platform, s3: S3Place, tmp_path: Path
) -> None:
    proxy = FaultProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        # The state put and everything after it are dropped before reaching the store.
        proxy.lose_answer("PUT", STATE_PUT, forward=False, then_blackhole=True)
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
    key = str(run.publication_idempotency_key)
    assert list(published(s3)) == [key]
    assert data_files(s3, key) == 1  # the first attempt's orphan was removed by the publication over the fence
    assert regions(s3) == ["north", "south"]


def test_a_folder_wiped_from_the_store_is_never_recreated_and_never_proven_absent(
    platform: Platform, s3: S3Place, tmp_path: Path
) -> None:
    """The folder's location was registered when the first run prepared it. Once its objects are gone (deleted, or
    the prefix moved), an unresolved run's reconcile stays undecided and a new run fails before dispatch
    (`location_missing`), creating nothing."""
    proxy = FaultProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        proxy.lose_answer("PUT", STATE_PUT, forward=False, then_blackhole=True)
        unknown = run_to(platform, tmp_path, s3_target(s3, proxy.endpoint), key="lost")
        assert unknown.status == "outcome_unknown"
        proxy.heal()
        client = s3.client()
        for item in client.list_objects_v2(Bucket=s3.bucket, Prefix=FOLDER + "/").get("Contents", []):
            client.delete_object(Bucket=s3.bucket, Key=item["Key"])
        result = flows.reconcile_as_operator(platform, unknown.run_id)
        fresh = run_to(platform, tmp_path, s3_target(s3, proxy.endpoint), key="after")
    finally:
        proxy.stop()
    assert (result.finding, result.run.status) == ("undecided", "outcome_unknown")
    assert fresh.error_code == "location_missing"
    assert (fresh.status, fresh.recovery_status) == ("failed", "no_external_output")
    assert s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=FOLDER + "/").get("KeyCount") == 0



def test_a_store_without_conditional_writes_fails_the_run_before_dispatch(
    platform: Platform, s3: S3Place, tmp_path: Path
) -> None:
    """Behind a store that ignores If-None-Match / If-Match, prepare refuses the location: the run fails with no
    external output, before dispatch is authorized, saying why; nothing is written under the folder."""
    proxy = StrippingProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        run = run_to(platform, tmp_path, s3_target(s3, proxy.endpoint))
    finally:
        proxy.stop()
    assert (run.status, run.recovery_status) == ("failed", "no_external_output")
    assert run.error_message == f"the target cannot be published to: {NO_CONDITIONAL_WRITES}"
    assert "dispatch.authorized" not in flows.kinds(platform, run.run_id)
    assert s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=FOLDER + "/").get("KeyCount") == 0


def test_dataflow_run_publishes_to_s3_once_and_a_replay_adds_nothing(
    s3: S3Place, sqlite_url: str, tmp_path: Path
) -> None:
    """`dataflow run` as a subprocess, credentials as secret references resolved from its environment: the run
    succeeds verified, the same idempotency key again publishes nothing, and the folder holds the key once."""
    document = {
        "name": "totals", "version": 1,
        "sources": {"sales": {"kind": "inline", "rows": flows.ROWS,
                              "schema": {"region": "string", "amount": "decimal(12,2)"}}},
        "steps": [{"name": "totals", "sql": "select region, count(*)::BIGINT as n from sales group by region"}],
        "output": {"schema": {"region": "string", "n": "int64"}, "max_rows": 100, "max_bytes": "1MiB"},
        "target": s3_target(s3),
    }  # fmt: skip
    (tmp_path / "to_s3.yaml").write_text(json.dumps(document))
    cli = make_cli(sqlite_url, tmp_path)
    ran = cli("run", str(tmp_path / "to_s3.yaml"), "--idempotency-key", "nightly", "--json")
    assert ran.code == 0, ran.output
    run = ran.json()
    assert (run["status"], run["recovery_status"]) == ("succeeded", "verified"), run
    again = cli("run", str(tmp_path / "to_s3.yaml"), "--idempotency-key", "nightly", "--json")
    assert again.code == 0 and again.json()["run_id"] == run["run_id"], again.output
    assert ACCESS_KEY not in ran.output + again.output and SECRET_KEY not in ran.output + again.output
    key = run["publication_idempotency_key"]
    assert list(published(s3)) == [key] and data_files(s3, key) == 1
    assert regions(s3) == ["north", "south"]
