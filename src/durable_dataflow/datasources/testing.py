"""A fault-injecting provider wrapper that drives every publish and inspect outcome in tests.

The faults model what a real sink and network can do to a caller: fail before the request leaves
(`fail_before_send`), commit and then lose the answer (`timeout_after_commit`, `drop_response`),
answer with a digest that does not match (`mismatched_digest`) or refuse conclusively (`reject`).
Register it in-process with `registry.register_provider(name, lambda: FaultInjectingProvider(...))`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from durable_dataflow.core.hashing import sha256_bytes
from durable_dataflow.datasources import contract
from durable_dataflow.datasources.contract import (
    AlreadyPublished,
    Capability,
    Inconclusive,
    InspectOutcome,
    Location,
    Provider,
    PublicationRefs,
    PublishOutcome,
    PublishTarget,
    Rejected,
    Undecided,
)

if TYPE_CHECKING:
    import pyarrow as pa

PublishFault = Literal[
    "none", "fail_before_send", "timeout_after_commit", "drop_response", "mismatched_digest", "reject"
]
InspectFault = Literal["none", "undecided", "fail"]


@dataclass
class FaultCounters:
    """How often the wrapper reached the inner provider (tests assert on these)."""

    publish_calls: int = 0
    inner_publish_calls: int = 0
    inspect_calls: int = 0
    inner_inspect_calls: int = 0


class FaultInjectingProvider:
    """Wraps a real provider and injects one publish fault and one inspect fault.

    - fail_before_send: raise Inconclusive without calling the inner provider;
    - timeout_after_commit / drop_response: the inner provider publishes (the sink commits), then
      Inconclusive is raised, as when a timeout or a lost connection swallows the answer;
    - mismatched_digest: AlreadyPublished with a digest that is not the caller's, without writing;
    - reject: Rejected without calling the inner provider;
    - inspect fault `undecided`: Undecided without calling the inner provider; `fail`: the inner
      inspection runs (and may record its fence), then Undecided is returned.
    `fail_times` limits a fault to the first N publish calls (None: every call).
    """

    def __init__(
        self,
        inner: Provider,
        fault: PublishFault = "none",
        inspect_fault: InspectFault = "none",
        fail_times: int | None = None,
    ) -> None:
        self.inner = inner
        self.fault = fault
        self.inspect_fault = inspect_fault
        self.fail_times = fail_times
        self.name = inner.name
        self.capabilities: frozenset[Capability] = inner.capabilities
        self.counters = FaultCounters()
        self._lock = threading.Lock()

    def _active(self) -> bool:
        with self._lock:
            self.counters.publish_calls += 1
            return self.fail_times is None or self.counters.publish_calls <= self.fail_times

    def _inner_publish(
        self, key: str, token: int, table: pa.Table, digest: str, target: PublishTarget
    ) -> PublishOutcome:
        with self._lock:
            self.counters.inner_publish_calls += 1
        return self.inner.publish(key, token, table, digest, target)

    def preflight(self, target: PublishTarget) -> None:
        """The inner provider's preflight, unfaulted (it never touches the sink)."""
        contract.preflight(self.inner, target)

    def prepare(self, target: PublishTarget) -> None:
        """The inner provider's prepare, unfaulted (it runs before dispatch is authorized)."""
        contract.prepare(self.inner, target)

    def locate(self, target: PublishTarget) -> Location | None:
        """The inner provider's locate, unfaulted (it never writes)."""
        return contract.locate(self.inner, target)

    def publish(
        self, key: str, token: int, table: pa.Table, digest: str, target: PublishTarget
    ) -> PublishOutcome:
        """Publish through the inner provider with the configured fault."""
        fault = self.fault if self._active() else "none"
        if fault == "fail_before_send":
            raise Inconclusive("injected fault: the request failed before it was sent")
        if fault == "reject":
            return Rejected("injected fault: the sink rejected the publication")
        if fault == "mismatched_digest":
            other = sha256_bytes(b"mismatched:" + digest.encode("utf-8"))
            refs = PublicationRefs("fault://publication", "fault://datasource", "fault://materialization")
            return AlreadyPublished(refs, other)
        outcome = self._inner_publish(key, token, table, digest, target)
        if fault == "timeout_after_commit":
            raise Inconclusive(f"injected fault: timed out after the sink answered {type(outcome).__name__}")
        if fault == "drop_response":
            raise Inconclusive("injected fault: the connection dropped before the response arrived")
        return outcome

    def inspect(self, key: str, target: PublishTarget, fence: int | None = None) -> InspectOutcome:
        """Inspect through the inner provider with the configured inspect fault."""
        with self._lock:
            self.counters.inspect_calls += 1
        if self.inspect_fault == "undecided":
            return Undecided("injected fault: the sink could not be inspected")
        with self._lock:
            self.counters.inner_inspect_calls += 1
        outcome = self.inner.inspect(key, target, fence)
        if self.inspect_fault == "fail":
            return Undecided(f"injected fault: the answer {type(outcome).__name__} was lost")
        return outcome
