"""The fault-injecting wrapper drives each outcome, checked against a real Parquet-folder sink."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from durable_dataflow.core.hashing import sha256_bytes
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import (
    Absent,
    AlreadyPublished,
    Inconclusive,
    Present,
    Published,
    PublishTarget,
    Rejected,
    Undecided,
)
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider

DIGEST = sha256_bytes(b"result")


def rows() -> pa.Table:
    return pa.table({"id": pa.array([1, 2], pa.int64())})


@pytest.fixture
def target(tmp_path: Path) -> PublishTarget:
    prepared = PublishTarget("ds", str(tmp_path / "sink"), "append", {})
    ParquetFolderProvider().prepare(prepared)  # as the platform does before authorizing dispatch
    return prepared


def test_fail_before_send_never_reaches_the_sink(target: PublishTarget) -> None:
    """fail_before_send raises Inconclusive without calling the inner provider; the sink stays absent."""
    wrapper = FaultInjectingProvider(ParquetFolderProvider(), "fail_before_send")
    with pytest.raises(Inconclusive):
        wrapper.publish("k", 1, rows(), DIGEST, target)
    assert wrapper.counters.inner_publish_calls == 0
    assert ParquetFolderProvider().inspect("k", target) == Absent(None)


@pytest.mark.parametrize("fault", ["timeout_after_commit", "drop_response"])
def test_lost_answer_after_commit_is_inconclusive_but_the_sink_has_it(fault: str, target: PublishTarget) -> None:
    """The inner provider commits, the wrapper raises Inconclusive; inspection then proves Present with the digest."""
    wrapper = FaultInjectingProvider(ParquetFolderProvider(), fault)  # type: ignore[arg-type]
    with pytest.raises(Inconclusive):
        wrapper.publish("k", 1, rows(), DIGEST, target)
    assert wrapper.counters.inner_publish_calls == 1
    found = ParquetFolderProvider().inspect("k", target, fence=2)
    assert isinstance(found, Present)
    assert found.digest == DIGEST


def test_mismatched_digest_is_already_published_with_another_digest(target: PublishTarget) -> None:
    """mismatched_digest answers AlreadyPublished with a digest that differs from the caller's, writing nothing."""
    wrapper = FaultInjectingProvider(ParquetFolderProvider(), "mismatched_digest")
    outcome = wrapper.publish("k", 1, rows(), DIGEST, target)
    assert isinstance(outcome, AlreadyPublished)
    assert outcome.digest != DIGEST
    assert ParquetFolderProvider().inspect("k", target) == Absent(None)


def test_reject_returns_rejected_without_calling_the_sink(target: PublishTarget) -> None:
    """reject returns Rejected and never calls the inner provider."""
    wrapper = FaultInjectingProvider(ParquetFolderProvider(), "reject")
    assert isinstance(wrapper.publish("k", 1, rows(), DIGEST, target), Rejected)
    assert wrapper.counters.inner_publish_calls == 0


def test_fail_times_limits_the_fault_to_the_first_calls(target: PublishTarget) -> None:
    """With fail_times=1 the first publish fails before sending and the second reaches the sink."""
    wrapper = FaultInjectingProvider(ParquetFolderProvider(), "fail_before_send", fail_times=1)
    with pytest.raises(Inconclusive):
        wrapper.publish("k", 1, rows(), DIGEST, target)
    assert isinstance(wrapper.publish("k", 2, rows(), DIGEST, target), Published)


def test_inspect_faults_are_undecided(target: PublishTarget) -> None:
    """inspect_fault=undecided skips the sink; inspect_fault=fail records the fence but loses the answer."""
    skipped = FaultInjectingProvider(ParquetFolderProvider(), inspect_fault="undecided")
    assert isinstance(skipped.inspect("k", target, fence=4), Undecided)
    assert ParquetFolderProvider().inspect("k", target) == Absent(None)
    lost = FaultInjectingProvider(ParquetFolderProvider(), inspect_fault="fail")
    assert isinstance(lost.inspect("k", target, fence=4), Undecided)
    assert ParquetFolderProvider().inspect("k", target) == Absent(4)


def test_wrapper_registers_in_process_and_keeps_capabilities(target: PublishTarget) -> None:
    """register_provider makes the wrapper loadable by name, with the inner provider's capabilities."""
    registry.register_provider("faulty", lambda: FaultInjectingProvider(ParquetFolderProvider(), "reject"))
    try:
        loaded = registry.load_provider("faulty")
        registry.require_capabilities(loaded, {"publish", "inspect"})
        assert isinstance(loaded.publish("k", 1, rows(), DIGEST, target), Rejected)
    finally:
        registry.unregister_provider("faulty")
