"""The Delta provider on an S3-compatible store (issue 31), against a real S3 API server (moto_server on
loopback): publish and replay, fences, concurrent writers, a missing table or bucket, a lost answer,
and the tenancy of s3:// targets. The sink is read back without delta-rs (its log replayed with boto3)."""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa
import pytest

from durable_dataflow.core.errors import ExecutionError, InputError
from durable_dataflow.core.hashing import sha256_bytes
from durable_dataflow.core.secrets import SecretScope
from durable_dataflow.datasources import objectstore
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    Absent,
    AlreadyPublished,
    Fenced,
    Inconclusive,
    Present,
    Published,
    PublishTarget,
    Undecided,
)
from durable_dataflow.datasources.delta import DeltaProvider
from support.s3 import FaultProxy, S3Place, StrippingProxy, delta_log_rows, delta_publication_commits

WRITERS = 6


def rows(n: int = 3, start: int = 0) -> pa.Table:
    return pa.table({"id": pa.array(range(start, start + n), pa.int64()), "v": pa.array(["x"] * n, pa.string())})


def target(s3: S3Place, prefix: str = "tables/t", endpoint: str | None = None, **kw: Any) -> PublishTarget:
    return PublishTarget("ds", s3.url(prefix), "append", s3.options(endpoint), **kw)


def prepared(s3: S3Place, prefix: str = "tables/t") -> PublishTarget:
    t = target(s3, prefix)
    DeltaProvider().prepare(t)
    return t


def test_publish_then_replay_commits_once_and_reads_back(s3: S3Place) -> None:
    provider = DeltaProvider()
    t = prepared(s3)
    first = provider.publish("K", 1, rows(), sha256_bytes(b"k"), t)
    assert isinstance(first, Published)
    assert first.refs.publication_ref == f"delta+{s3.url('tables/t')}#txn=K"
    again = provider.publish("K", 2, rows(), sha256_bytes(b"k"), t)
    assert again == AlreadyPublished(first.refs, sha256_bytes(b"k"))
    assert provider.inspect("K", t) == Present(first.refs, sha256_bytes(b"k"), 1)
    client = s3.client()
    assert delta_publication_commits(client, s3.bucket, "tables/t", "K") == 1
    read = delta_log_rows(client, s3.bucket, "tables/t")
    assert read.num_rows == 3 and sorted(read.column("id").to_pylist()) == [0, 1, 2]


def test_a_fence_refuses_a_stale_token_and_admits_its_holder(s3: S3Place) -> None:
    provider = DeltaProvider()
    t = prepared(s3)
    assert provider.inspect("K", t, fence=3) == Absent(3)
    assert provider.publish("K", 2, rows(), sha256_bytes(b"k"), t) == Fenced(3)
    assert isinstance(provider.publish("K", 3, rows(), sha256_bytes(b"k"), t), Published)
    assert delta_publication_commits(s3.client(), s3.bucket, "tables/t", "K") == 1


def test_concurrent_publishers_of_one_key_publish_it_once(s3: S3Place) -> None:
    t = prepared(s3)
    outcomes: list[object] = []
    barrier = threading.Barrier(WRITERS)

    def publish(token: int) -> None:
        provider = DeltaProvider()
        barrier.wait()
        outcomes.append(provider.publish("K", token, rows(), sha256_bytes(b"k"), t))

    threads = [threading.Thread(target=publish, args=(n + 1,)) for n in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(isinstance(o, Published) for o in outcomes) == 1, outcomes
    assert sum(isinstance(o, AlreadyPublished) for o in outcomes) == WRITERS - 1, outcomes
    assert delta_publication_commits(s3.client(), s3.bucket, "tables/t", "K") == 1
    assert delta_log_rows(s3.client(), s3.bucket, "tables/t").num_rows == 3


def test_concurrent_writers_of_different_keys_lose_no_commit(s3: S3Place) -> None:
    """Each log entry is created with If-None-Match: *, so two writers racing for one version cannot
    both write it: the loser decides again on the new snapshot. Every key's rows are there, once."""
    t = prepared(s3)
    outcomes: list[object] = []
    barrier = threading.Barrier(WRITERS)

    def publish(n: int) -> None:
        provider = DeltaProvider()
        barrier.wait()
        outcomes.append(provider.publish(f"K{n}", 1, rows(2, start=10 * n), sha256_bytes(b"%d" % n), t))

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(isinstance(o, Published) for o in outcomes), outcomes
    read = delta_log_rows(s3.client(), s3.bucket, "tables/t")
    assert sorted(read.column("id").to_pylist()) == sorted(i for n in range(WRITERS) for i in (10 * n, 10 * n + 1))


def test_a_table_never_prepared_or_a_missing_bucket_is_never_absent(s3: S3Place) -> None:
    provider = DeltaProvider()
    unprepared = target(s3, "never/prepared")
    outcome = provider.inspect("K", unprepared, fence=2)
    assert isinstance(outcome, Undecided) and LOCATION_MISSING in outcome.reason
    with pytest.raises(Inconclusive):
        provider.publish("K", 1, rows(), sha256_bytes(b"k"), unprepared)
    assert s3.client().list_objects_v2(Bucket=s3.bucket).get("KeyCount") == 0  # nothing created
    gone = PublishTarget("ds", "s3://no-such-bucket-here/t", "append", s3.options())
    assert isinstance(provider.inspect("K", gone, fence=2), Undecided)
    with pytest.raises(Inconclusive):
        provider.publish("K", 1, rows(), sha256_bytes(b"k"), gone)


def test_prepare_refuses_a_missing_bucket(s3: S3Place) -> None:
    with pytest.raises(ExecutionError, match="NoSuchBucket"):
        DeltaProvider().prepare(PublishTarget("ds", "s3://no-such-bucket-here/t", "append", s3.options()))


def test_a_lost_answer_is_inconclusive_and_inspection_proves_the_publication(s3: S3Place) -> None:
    """The proxy forwards the log entry's PUT and drops its answer, then every later request: the
    store committed, the provider never heard. Publish raises Inconclusive; once the store can be
    reached again, inspect proves Present with the digest, and a replay publishes nothing."""
    proxy = FaultProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        provider = DeltaProvider()
        t = target(s3, endpoint=proxy.endpoint)
        provider.prepare(t)
        proxy.lose_answer("PUT", r"/_delta_log/\d{20}\.json$", then_blackhole=True)
        with pytest.raises(Inconclusive) as raised:
            provider.publish("K", 1, rows(), sha256_bytes(b"k"), t)
        assert proxy.fired == 1
        assert "127.0.0.1" not in raised.value.message and s3.bucket not in raised.value.message
        proxy.heal()
        found = provider.inspect("K", t, fence=2)
        assert isinstance(found, Present) and found.digest == sha256_bytes(b"k") and found.token == 1
        assert isinstance(provider.publish("K", 2, rows(), sha256_bytes(b"k"), t), AlreadyPublished)
    finally:
        proxy.stop()
    assert delta_publication_commits(s3.client(), s3.bucket, "tables/t", "K") == 1
    assert delta_log_rows(s3.client(), s3.bucket, "tables/t").num_rows == 3


def test_a_lost_answer_the_retry_hears_of_is_decided_from_the_log(s3: S3Place) -> None:
    """Only the one answer is lost: delta-rs retries the PUT, the store refuses it (412: the entry
    exists), and the provider decides again on the new snapshot: its own publication, AlreadyPublished
    with its digest, never a second commit."""
    proxy = FaultProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        provider = DeltaProvider()
        t = target(s3, endpoint=proxy.endpoint)
        provider.prepare(t)
        proxy.lose_answer("PUT", r"/_delta_log/\d{20}\.json$", then_blackhole=False)
        outcome = provider.publish("K", 1, rows(), sha256_bytes(b"k"), t)
        assert proxy.fired == 1
        assert isinstance(outcome, AlreadyPublished | Published) and outcome.digest == sha256_bytes(b"k")
    finally:
        proxy.stop()
    assert delta_publication_commits(s3.client(), s3.bucket, "tables/t", "K") == 1


# ---- tenancy ------------------------------------------------------------------------------------


def grant(s3: S3Place, prefix: str, access: frozenset[str] = frozenset({"write"})) -> objectstore.StoreGrant:
    url = objectstore.parse_url(s3.url(prefix), "grant")
    return objectstore.StoreGrant(url, access, s3.endpoint, "us-east-1", True)


def tenant_target(
    s3: S3Place, prefix: str, grants: tuple[objectstore.StoreGrant, ...], **options: Any
) -> PublishTarget:
    opts = {k: v for k, v in s3.options().items() if k in objectstore.CREDENTIAL_OPTIONS}
    opts.update(options)
    scope = SecretScope.local()  # the credentials resolve; what is under test is the confinement
    return PublishTarget("ds", s3.url(prefix), "append", opts, secrets=scope, store_grants=grants)


@pytest.mark.parametrize(
    ("prefix", "granted", "access", "why"),
    [
        ("other/t", "mine", "write", "outside the object-store prefixes"),
        ("mine-not/t", "mine", "write", "outside the object-store prefixes"),  # segment-wise, not textual
        ("mine/t", "mine", "read", "outside the object-store prefixes"),  # read-only grant
    ],
)
def test_a_tenant_target_outside_its_granted_prefixes_is_refused(
    s3: S3Place, prefix: str, granted: str, access: str, why: str
) -> None:
    t = tenant_target(s3, prefix, (grant(s3, granted, frozenset({access})),))
    with pytest.raises(InputError, match=why) as raised:
        DeltaProvider().preflight(t)
    assert s3.bucket not in raised.value.message
    assert s3.client().list_objects_v2(Bucket=s3.bucket).get("KeyCount") == 0


def test_a_tenant_names_neither_another_endpoint_nor_no_credentials(s3: S3Place) -> None:
    grants = (grant(s3, "mine"),)
    with pytest.raises(InputError, match="differs from the endpoint granted"):
        elsewhere = tenant_target(s3, "mine/t", grants, endpoint="http://169.254.169.254", allow_http=True)
        DeltaProvider().preflight(elsewhere)
    bare = PublishTarget("ds", s3.url("mine/t"), "append", {}, store_grants=grants)
    with pytest.raises(InputError, match="needs credentials"):
        DeltaProvider().preflight(bare)
    with pytest.raises(InputError, match="outside"):
        DeltaProvider().preflight(tenant_target(s3, "mine/t", ()))


def test_a_granted_tenant_target_publishes_at_the_granted_endpoint(s3: S3Place) -> None:
    t = tenant_target(s3, "mine/t", (grant(s3, "mine"),))  # no endpoint in the options: the grant's
    provider = DeltaProvider()
    provider.prepare(t)
    assert isinstance(provider.publish("K", 1, rows(), sha256_bytes(b"k"), t), Published)
    assert delta_log_rows(s3.client(), s3.bucket, "mine/t").num_rows == 3


@pytest.mark.parametrize(
    "location",
    ["s3://Bad_Bucket/t", "s3://ok-bucket/a/../b", "s3://ok-bucket/a//b", "s3://ok-bucket/a?x=1", "s3://ok-bucket/a\nb"],
)
def test_a_malformed_s3_location_is_refused_before_the_store(s3: S3Place, location: str) -> None:
    with pytest.raises(InputError) as raised:
        DeltaProvider().preflight(PublishTarget("ds", location, "append", s3.options()))
    assert location not in raised.value.message


def test_a_plain_credential_or_an_unknown_option_is_refused(s3: S3Place) -> None:
    options = {**s3.options(), "access_key_id": "AKIAPLAINVALUE"}
    with pytest.raises(InputError, match="secret reference") as raised:
        DeltaProvider().preflight(PublishTarget("ds", s3.url("t"), "append", options))
    assert "AKIAPLAINVALUE" not in raised.value.message
    with pytest.raises(InputError, match="unknown object-store option"):
        DeltaProvider().preflight(PublishTarget("ds", s3.url("t"), "append", {**s3.options(), "endpoint_url": "x"}))
    with pytest.raises(InputError, match="plain http"):
        DeltaProvider().preflight(PublishTarget("ds", s3.url("t"), "append", {**s3.options(), "allow_http": False}))


def test_a_store_that_ignores_conditional_writes_is_refused_at_prepare(s3: S3Place) -> None:
    """delta-rs creates each log entry with If-None-Match: *; behind a store that ignores it, two writers could
    both write one version. prepare refuses such a store (the run fails before dispatch), creating nothing."""
    stripping = StrippingProxy(s3.endpoint.removeprefix("http://")).start()
    try:
        with pytest.raises(InputError, match="does not honour conditional writes"):
            DeltaProvider().prepare(target(s3, endpoint=stripping.endpoint))
    finally:
        stripping.stop()
    assert s3.client().list_objects_v2(Bucket=s3.bucket).get("KeyCount") == 0
