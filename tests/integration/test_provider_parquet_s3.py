"""The Parquet-folder provider on an S3-compatible store (issue 31), against a real moto S3 server over HTTP.

Every check reads the store directly with boto3 (the key's state objects, the data files) or with an
independent reader (pyarrow.dataset over pyarrow's own S3FileSystem), never through the provider. The
contract's common tests run on the store too (tests/integration/test_provider_common.py, `parquet-s3`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from durable_dataflow.core.errors import ExecutionError, InputError
from durable_dataflow.core.hashing import sha256_bytes
from durable_dataflow.core.secrets import SecretScope
from durable_dataflow.datasources import contract
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    Absent,
    AlreadyPublished,
    Fenced,
    Inconclusive,
    Present,
    Published,
    PublishTarget,
    Rejected,
    Undecided,
)
from durable_dataflow.datasources.objectstore import StoreGrant, parse_url, store_options
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider
from durable_dataflow.datasources.parquet_store import NO_CONDITIONAL_WRITES, key_hash
from support.s3 import FaultProxy, StrippingProxy

CONCURRENT_PUBLISHERS = 8
PREFIX = "warehouse/out"


def rows(n: int, offset: int = 0) -> pa.Table:
    return pa.table({"id": pa.array(range(offset, offset + n), pa.int64())})


def digest_of(label: str) -> str:
    return sha256_bytes(label.encode("utf-8"))


def target_for(s3: Any, endpoint: str | None = None, prefix: str = PREFIX, **kwargs: Any) -> PublishTarget:
    return PublishTarget("analytics.out", s3.url(prefix), "append", s3.options(endpoint), **kwargs)


@pytest.fixture
def target(s3: Any) -> PublishTarget:
    """A prepared location on the test's bucket, as the platform prepares it before authorizing dispatch."""
    made = target_for(s3)
    contract.prepare(ParquetFolderProvider(), made)
    return made


@pytest.fixture
def proxy(moto_server: Any) -> Iterator[FaultProxy]:
    started = FaultProxy(moto_server.endpoint.removeprefix("http://")).start()
    try:
        yield started
    finally:
        started.stop()


class Store:
    """The bucket read directly with boto3."""

    def __init__(self, s3: Any, prefix: str = PREFIX) -> None:
        self.client = s3.client()
        self.bucket = s3.bucket
        self.prefix = prefix

    def names(self, under: str = "") -> list[str]:
        full = f"{self.prefix}/{under}"
        found = self.client.list_objects_v2(Bucket=self.bucket, Prefix=full).get("Contents") or []
        return sorted(str(o["Key"])[len(self.prefix) + 1 :] for o in found)

    def state(self, key: str) -> dict[str, Any] | None:
        name = f"{self.prefix}/_dataflow/keys/{key_hash(key)}.json"
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        state: dict[str, Any] = json.loads(body)
        return state

    def data_files(self, key: str) -> list[str]:
        return self.names(f"data/{key_hash(key)}-")

    def published_rows(self, s3: Any) -> dict[str, int]:
        """Each published key's rows, read by pyarrow.dataset over pyarrow's S3FileSystem from the files the
        published state objects name: the sink as an independent reader sees it."""
        files: dict[str, str] = {}
        for name in self.names("_dataflow/keys/"):
            state = json.loads(self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}")["Body"].read())
            if state["state"] == "published":
                files[state["key"]] = f"{self.bucket}/{self.prefix}/{state['file']}"
        filesystem = store_options(s3.options(), SecretScope.local(), "test").filesystem()
        return {
            key: ds.dataset(path, format="parquet", filesystem=filesystem).count_rows()
            for key, path in files.items()
        }


# ---- publish, replay, fences -------------------------------------------------------------------------


def test_publish_once_then_replays_write_nothing(s3: Any, target: PublishTarget) -> None:
    """A key publishes once: its state object is created, one data file; replays with any token get the stored
    refs and digest and write no second state or data file."""
    provider = ParquetFolderProvider()
    first = provider.publish("run-1/out", 1, rows(3), digest_of("a"), target)
    assert isinstance(first, Published) and first.digest == digest_of("a")
    store = Store(s3)
    before = store.names()
    for token in (1, 2, 7):
        again = provider.publish("run-1/out", token, rows(5), digest_of("other"), target)
        assert again == AlreadyPublished(first.refs, digest_of("a"))
    assert store.names() == before
    state = store.state("run-1/out")
    assert state is not None
    assert {k: state[k] for k in ("state", "key", "digest", "token", "rows")} == {
        "state": "published", "key": "run-1/out", "digest": digest_of("a"), "token": 1, "rows": 3
    }  # fmt: skip
    assert store.data_files("run-1/out") == [state["file"]]
    assert first.refs.publication_ref == f"parquet+{s3.url(PREFIX)}/_dataflow/keys/{key_hash('run-1/out')}.json"
    assert first.refs.materialization_ref == f"parquet+{s3.url(PREFIX)}/{state['file']}"
    assert provider.inspect("run-1/out", target, fence=4) == Present(first.refs, digest_of("a"), 1)
    assert store.published_rows(s3) == {"run-1/out": 3}


def test_a_fence_refuses_a_stale_publish_and_admits_its_holder(s3: Any, target: PublishTarget) -> None:
    """inspect(fence=5) writes the fenced state; token 4 is Fenced with no data file written; the fence only grows;
    token 9 (at the fence) publishes over it, and then Present wins over any fence."""
    provider = ParquetFolderProvider()
    store = Store(s3)
    assert provider.inspect("k", target) == Absent(None)
    assert store.state("k") is None  # an inspection without a fence writes nothing
    assert provider.inspect("k", target, fence=5) == Absent(5)
    assert provider.inspect("k", target, fence=2) == Absent(5)
    assert provider.inspect("k", target, fence=9) == Absent(9)
    assert (store.state("k") or {})["state"] == "fenced"
    assert provider.publish("k", 4, rows(2), digest_of("k"), target) == Fenced(9)
    assert store.data_files("k") == []
    published = provider.publish("k", 9, rows(2), digest_of("k"), target)
    assert isinstance(published, Published)
    assert (store.state("k") or {})["fence"] == 9
    assert provider.inspect("k", target, fence=20) == Present(published.refs, digest_of("k"), 9)
    assert provider.publish("k", 1, rows(2), digest_of("k"), target) == AlreadyPublished(published.refs, digest_of("k"))


def test_concurrent_publishers_of_one_key_publish_once(s3: Any, target: PublishTarget) -> None:
    """8 threads publish one key at once: the store lets exactly one state put through, the others read its
    publication (AlreadyPublished) and remove their own data files."""
    barrier = threading.Barrier(CONCURRENT_PUBLISHERS)

    def publish(token: int) -> object:
        barrier.wait()
        return ParquetFolderProvider().publish("race", token, rows(3), digest_of("r"), target)

    with ThreadPoolExecutor(CONCURRENT_PUBLISHERS) as pool:
        outcomes = list(pool.map(publish, range(1, CONCURRENT_PUBLISHERS + 1)))
    published = [o for o in outcomes if isinstance(o, Published)]
    assert len(published) == 1, outcomes
    assert all(o == AlreadyPublished(published[0].refs, digest_of("r")) for o in outcomes if o is not published[0])
    store = Store(s3)
    assert store.data_files("race") == [(store.state("race") or {})["file"]]
    assert store.published_rows(s3) == {"race": 3}


def test_a_fence_racing_stale_publishers_never_lets_both_win(s3: Any, target: PublishTarget) -> None:
    """A fencing inspection (fence 5) races token-2 publishers: either Absent(5) and nothing published, or Present."""
    barrier = threading.Barrier(CONCURRENT_PUBLISHERS)

    def act(i: int) -> object:
        barrier.wait()
        if i == 0:
            return ParquetFolderProvider().inspect("fence-race", target, fence=5)
        return ParquetFolderProvider().publish("fence-race", 2, rows(1), digest_of("f"), target)

    with ThreadPoolExecutor(CONCURRENT_PUBLISHERS) as pool:
        outcomes = list(pool.map(act, range(CONCURRENT_PUBLISHERS)))
    state = Store(s3).state("fence-race")
    if isinstance(outcomes[0], Absent):
        assert outcomes[0].fenced_at == 5
        assert all(isinstance(o, Fenced) for o in outcomes[1:]), outcomes
        assert state is not None and state["state"] == "fenced"
    else:
        assert isinstance(outcomes[0], Present), outcomes
        assert state is not None and state["state"] == "published"
    assert sum(isinstance(o, Published) for o in outcomes) == (state["state"] == "published")


def test_only_append_is_offered(s3: Any, target: PublishTarget) -> None:
    """overwrite / replace_partition: refused at preflight (InputError) and Rejected by publish, nothing written."""
    provider = ParquetFolderProvider()
    for mode in ("overwrite", "replace_partition"):
        other = PublishTarget("analytics.out", target.location, mode, target.options)  # type: ignore[arg-type]
        with pytest.raises(InputError, match="only mode 'append'"):
            contract.preflight(provider, other)
        assert isinstance(provider.publish("k", 1, rows(1), digest_of("k"), other), Rejected)
    assert Store(s3).names("_dataflow/keys/") == [] and Store(s3).names("data/") == []


def test_publishing_over_a_fence_removes_the_orphans_of_earlier_attempts(s3: Any, target: PublishTarget) -> None:
    """An attempt that died after its data file and before its state put left an orphan; the recovery fences the
    key (Absent: the orphan is no publication) and its publication removes the orphan."""
    store = Store(s3)
    orphan = f"{PREFIX}/data/{key_hash('k')}-t1-deadbeef.parquet"
    store.client.put_object(Bucket=s3.bucket, Key=orphan, Body=b"partial")
    provider = ParquetFolderProvider()
    assert provider.inspect("k", target, fence=2) == Absent(2)
    assert isinstance(provider.publish("k", 2, rows(2), digest_of("k"), target), Published)
    assert store.data_files("k") == [(store.state("k") or {})["file"]]
    assert provider.read(target).num_rows == 2


# ---- the location: marker, bucket, conditional writes ------------------------------------------------------


@pytest.mark.parametrize("fence", [None, 3])
def test_a_location_without_its_marker_is_undecided_and_never_absent(s3: Any, fence: int | None) -> None:
    """Never prepared, or its marker deleted (the prefix moved or wiped): inspect is Undecided with LOCATION_MISSING
    and publish Inconclusive, with or without a fence, and neither writes anything."""
    provider = ParquetFolderProvider()
    unprepared = target_for(s3)
    found = provider.inspect("k", unprepared, fence=fence)
    assert isinstance(found, Undecided) and found.reason.endswith(LOCATION_MISSING)
    with pytest.raises(Inconclusive, match=LOCATION_MISSING):
        provider.publish("k", 1, rows(1), digest_of("k"), unprepared)
    assert Store(s3).names() == []
    provider.prepare(unprepared)
    assert provider.inspect("k", unprepared, fence=fence) == Absent(fence)
    Store(s3).client.delete_object(Bucket=s3.bucket, Key=f"{PREFIX}/_dataflow/location.json")
    found = provider.inspect("k", unprepared, fence=7)
    assert isinstance(found, Undecided) and found.reason.endswith(LOCATION_MISSING)
    with pytest.raises(Inconclusive, match=LOCATION_MISSING):
        provider.publish("k", 9, rows(1), digest_of("k"), unprepared)
    state = Store(s3).state("k")
    assert Store(s3).data_files("k") == []
    assert state is None if fence is None else (state or {})["state"] == "fenced"


def test_a_missing_bucket_is_undecided_never_absent(s3: Any) -> None:
    """A bucket that does not exist (deleted, or another endpoint): inspect Undecided, publish Inconclusive, locate
    finds nothing, and prepare refuses to create it."""
    provider = ParquetFolderProvider()
    gone = PublishTarget("analytics.out", "s3://no-such-bucket-here/out", "append", s3.options())
    for fence in (None, 2):
        found = provider.inspect("k", gone, fence=fence)
        assert isinstance(found, Undecided) and "the bucket does not exist" in found.reason
        assert found.reason.endswith(LOCATION_MISSING)
    with pytest.raises(Inconclusive, match="the bucket does not exist"):
        provider.publish("k", 1, rows(1), digest_of("k"), gone)
    located = provider.locate(gone)
    assert located.identity is None and not located.occupied
    with pytest.raises(ExecutionError, match="the bucket does not exist"):
        provider.prepare(gone)
    names = [b["Name"] for b in Store(s3).client.list_buckets()["Buckets"]]
    assert "no-such-bucket-here" not in names


def test_locate_names_the_marker_and_prepare_never_replaces_it(s3: Any, target: PublishTarget) -> None:
    """The marker's id is the location's identity; a second prepare keeps it; the place names the endpoint."""
    provider = ParquetFolderProvider()
    first = provider.locate(target)
    assert first.identity is not None and first.identity.startswith("parquet-store:")
    assert s3.endpoint in first.place and s3.url(PREFIX) in first.place
    provider.prepare(target)
    assert provider.locate(target) == first
    assert Store(s3).names("_dataflow/probes/") == []  # the probe objects are removed



def test_a_store_that_ignores_conditional_writes_is_refused_at_prepare(s3: Any, moto_server: Any) -> None:
    """Behind a store that ignores If-None-Match, prepare refuses the location with a clear reason and creates no
    marker; inspect and publish there stay Undecided / Inconclusive (no marker), never silently unsafe."""
    stripping = StrippingProxy(moto_server.endpoint.removeprefix("http://")).start()
    try:
        unsafe = target_for(s3, stripping.endpoint)
        with pytest.raises(InputError) as refused:
            ParquetFolderProvider().prepare(unsafe)
        assert refused.value.message == NO_CONDITIONAL_WRITES
        assert Store(s3).names() == []
        with pytest.raises(Inconclusive, match=LOCATION_MISSING):
            ParquetFolderProvider().publish("k", 1, rows(1), digest_of("k"), unsafe)
    finally:
        stripping.stop()


# ---- lost answers, over HTTP ------------------------------------------------------------------------------


def test_a_lost_answer_to_the_state_put_is_inconclusive_then_inspected_present(
    s3: Any, target: PublishTarget, proxy: FaultProxy
) -> None:
    """The state put reaches the store and its answer is lost, and so is every retry: publish raises Inconclusive.
    Healed, inspect proves the publication Present with its digest, a replay is AlreadyPublished, and an
    independent reader sees the key's rows once."""
    through = target_for(s3, proxy.endpoint)
    proxy.lose_answer("PUT", r"/_dataflow/keys/", then_blackhole=True)
    with pytest.raises(Inconclusive, match="writing the state of key 'k' failed"):
        ParquetFolderProvider().publish("k", 1, rows(4), digest_of("k"), through)
    assert proxy.fired == 1
    proxy.heal()
    found = ParquetFolderProvider().inspect("k", through, fence=2)
    assert isinstance(found, Present) and (found.digest, found.token) == (digest_of("k"), 1)
    again = ParquetFolderProvider().publish("k", 2, rows(4), digest_of("k"), through)
    assert again == AlreadyPublished(found.refs, digest_of("k"))
    assert Store(s3).published_rows(s3) == {"k": 4}
    assert len(Store(s3).data_files("k")) == 1


def test_a_lost_answer_retried_by_the_client_is_recognized_as_this_publication(
    s3: Any, target: PublishTarget, proxy: FaultProxy
) -> None:
    """The state put lands, its answer is lost, the client retries: the store refuses the retry (412), and publish
    reads the state and finds its own data file named there: Published, not AlreadyPublished."""
    through = target_for(s3, proxy.endpoint)
    proxy.lose_answer("PUT", r"/_dataflow/keys/", then_blackhole=False)
    outcome = ParquetFolderProvider().publish("k", 1, rows(2), digest_of("k"), through)
    assert isinstance(outcome, Published), outcome
    assert proxy.fired == 1
    assert Store(s3).published_rows(s3) == {"k": 2}


def test_a_lost_answer_to_a_fence_is_undecided_and_the_fence_holds(
    s3: Any, target: PublishTarget, proxy: FaultProxy
) -> None:
    """The fence put lands and every answer is lost: inspect is Undecided (it changes nothing for the caller);
    healed, the fence is there and refuses a lower token."""
    through = target_for(s3, proxy.endpoint)
    proxy.lose_answer("PUT", r"/_dataflow/keys/", then_blackhole=True)
    assert isinstance(ParquetFolderProvider().inspect("k", through, fence=6), Undecided)
    proxy.heal()
    assert ParquetFolderProvider().inspect("k", through) == Absent(6)
    assert ParquetFolderProvider().publish("k", 5, rows(1), digest_of("k"), through) == Fenced(6)


def test_a_lost_answer_to_the_data_put_is_rejected_and_the_key_stays_absent(
    s3: Any, target: PublishTarget, proxy: FaultProxy
) -> None:
    """Before the state put nothing is published: a data file whose answer is lost is Rejected, the key is Absent,
    and its later publication is the only one an independent reader sees."""
    through = target_for(s3, proxy.endpoint)
    proxy.lose_answer("PUT", r"/data/", then_blackhole=True)
    rejected = ParquetFolderProvider().publish("k", 1, rows(2), digest_of("k"), through)
    assert isinstance(rejected, Rejected) and "before the commit point" in rejected.reason
    proxy.heal()
    assert ParquetFolderProvider().inspect("k", through, fence=2) == Absent(2)
    assert isinstance(ParquetFolderProvider().publish("k", 2, rows(2), digest_of("k"), through), Published)
    assert Store(s3).published_rows(s3) == {"k": 2}
    assert len(Store(s3).data_files("k")) == 1  # the orphan was removed by the publication over the fence


def test_a_state_that_cannot_be_read_is_inconclusive_never_rejected(
    s3: Any, target: PublishTarget, proxy: FaultProxy
) -> None:
    """The key is published (say by a run recorded under the same idempotency key before the platform
    database was restored from a dump); this publish cannot read its state (the answer to the GET is lost).
    Nothing proves the key unpublished, so the answer is Inconclusive, never Rejected ("nothing created")."""
    first = ParquetFolderProvider().publish("k", 1, rows(2), digest_of("k"), target)
    assert isinstance(first, Published)
    through = target_for(s3, proxy.endpoint)
    proxy.lose_answer("GET", r"/_dataflow/keys/", then_blackhole=True)
    with pytest.raises(Inconclusive, match="the store could not be read"):
        ParquetFolderProvider().publish("k", 1, rows(2), digest_of("k"), through)
    assert proxy.fired == 1
    proxy.heal()
    assert isinstance(ParquetFolderProvider().inspect("k", through), Present)
    assert Store(s3).published_rows(s3) == {"k": 2}


# ---- tenancy ---------------------------------------------------------------------------------------------------


def test_a_location_outside_the_granted_prefixes_is_refused_before_the_store_is_touched(
    s3: Any, proxy: FaultProxy
) -> None:
    """A tenant's target outside its write grants (another prefix, or a prefix granted for reading only): InputError
    from preflight, prepare, publish and inspect, and not one request reaches the store."""

    def grant(prefix: str, access: str) -> StoreGrant:
        return StoreGrant(parse_url(s3.url(prefix), "grant"), frozenset({access}), proxy.endpoint, "us-east-1", True)

    provider = ParquetFolderProvider()
    refused = "outside the object-store prefixes granted"
    for grants in ((grant("elsewhere", "write"),), (grant(PREFIX, "read"),), (grant("warehouse/o", "write"),)):
        confined = target_for(s3, proxy.endpoint, store_grants=grants)
        with pytest.raises(InputError, match=refused):
            contract.preflight(provider, confined)
        with pytest.raises(InputError, match=refused):
            provider.prepare(confined)
        with pytest.raises(InputError, match=refused):
            provider.publish("k", 1, rows(1), digest_of("k"), confined)
        with pytest.raises(InputError, match=refused):
            provider.inspect("k", confined, fence=2)
    assert sum(proxy.requests.values()) == 0
    connection = ("endpoint", "region", "allow_http")  # the grant's replace them
    options = {k: v for k, v in s3.options().items() if k not in connection}
    granted = PublishTarget(
        "analytics.out", s3.url(PREFIX), "append", options, store_grants=(grant("warehouse", "write"),)
    )
    provider.prepare(granted)
    assert isinstance(provider.publish("k", 1, rows(1), digest_of("k"), granted), Published)
    assert sum(proxy.requests.values()) > 0  # the grant's endpoint, not the definition's, was used


def test_an_unreadable_state_object_is_undecided_and_inconclusive(s3: Any, target: PublishTarget) -> None:
    """A state object that is not the key's record: inspect Undecided, publish Inconclusive; the reason names the
    object by its stem, never the bucket or URL."""
    provider = ParquetFolderProvider()
    Store(s3).client.put_object(
        Bucket=s3.bucket, Key=f"{PREFIX}/_dataflow/keys/{key_hash('k')}.json", Body=b"{not json"
    )
    found = provider.inspect("k", target)
    assert found == Undecided(
        f"parquet inspection of key 'k' failed: state object {key_hash('k')}.json is not valid JSON"
    )
    with pytest.raises(Inconclusive, match="is not valid JSON") as caught:
        provider.publish("k", 1, rows(1), digest_of("k"), target)
    assert s3.bucket not in caught.value.message
