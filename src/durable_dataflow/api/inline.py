"""The API's inline executions, in a bounded executor of their own (docs/deployment.md#quotas).

``POST /v1/runs`` without ``queue=true`` records, claims and executes the run before it answers. Run
in FastAPI's thread pool (about 40 threads shared by every endpoint), enough slow inline submits held
every thread, and every read, ``/healthz`` and page waited behind them. Here each admitted inline
submit gets a thread of its own, and admission is bounded twice: at most ``inline_executions_max``
at once on this server (all tenants), and at most the tenant's ``inline_executions`` quota. A submit
that finds no free slot is refused at once with QuotaExceeded (429, ``Retry-After``), before anything
is read or recorded; it never waits for a slot. FastAPI's threads stay free for everything else.

The threads are daemon threads, as FastAPI's are: a server told to stop does not wait an hour for an
execution; its lease expires and a sweeper settles the run, as after any crash. A slot is released
when its execution ends, not when its caller goes away, so a disconnected client frees no slot early.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar, cast

from durable_dataflow.core.errors import QuotaExceeded
from durable_dataflow.core.invariants import invariant
from durable_dataflow.dataflow.protocol import quotas
from durable_dataflow.dataflow.protocol.quotas import Quota, Quotas

ResultT = TypeVar("ResultT")
INLINE_EXECUTOR_NAME = "dataflow-inline"
PLATFORM_SLOTS_QUOTA = "inline_executions_max"  # the quota a refusal names when the server is full


class InlineExecutor:
    """Admits inline executions up to the server's and each tenant's limit; runs each on its own thread."""

    def __init__(self, limits: Quotas) -> None:
        self._quotas = limits
        self._lock = threading.Lock()
        self._running_total = 0
        self._running_by_tenant: dict[str, int] = {}

    def running(self, tenant: str | None = None) -> int:
        """Inline executions in flight: on the whole server, or of ``tenant``."""
        with self._lock:
            return self._running_total if tenant is None else self._running_by_tenant.get(tenant, 0)

    async def run(self, tenant: str, work: Callable[[], ResultT]) -> ResultT:
        """``work()`` on a thread of its own, once a slot is free for ``tenant``; QuotaExceeded otherwise."""
        self._reserve(tenant)
        future: Future[ResultT] = Future()
        thread = threading.Thread(
            target=self._carry, args=(tenant, work, future), name=f"{INLINE_EXECUTOR_NAME}-{tenant}", daemon=True
        )
        try:
            thread.start()
        except BaseException:
            self._release(tenant)
            raise
        return await asyncio.wrap_future(future)

    def _carry(self, tenant: str, work: Callable[[], ResultT], future: Future[ResultT]) -> None:
        """Run ``work`` and free its slot *before* handing its outcome to the awaiting request: a client that
        has its answer finds the slot free (it was released after the answer, so an immediate next submit
        could be refused as if the finished execution were still running)."""
        try:
            running = future.set_running_or_notify_cancel()
            value = work() if running else None
        except BaseException as error:  # handed to the awaiting request, which answers it
            self._release(tenant)
            future.set_exception(error)
            return
        self._release(tenant)
        if running:
            future.set_result(cast(ResultT, value))

    def _reserve(self, tenant: str) -> None:
        tenant_max = self._quotas.of(tenant).inline_executions
        with self._lock:
            if self._running_total >= self._quotas.inline_executions_max:
                raise server_full(self._quotas.inline_executions_max)
            held = self._running_by_tenant.get(tenant, 0)
            if held >= tenant_max:
                raise quotas.refusal(
                    Quota.INLINE_EXECUTIONS, tenant_max,
                    f"this tenant has {held} inline runs executing; retry later, or submit with queue=true",
                )  # fmt: skip
            self._running_total += 1
            self._running_by_tenant[tenant] = held + 1

    def _release(self, tenant: str) -> None:
        with self._lock:
            held = self._running_by_tenant.get(tenant, 0)
            invariant(held > 0 and self._running_total > 0, "an inline slot is released once per reservation")
            self._running_total -= 1
            if held == 1:
                del self._running_by_tenant[tenant]
            else:
                self._running_by_tenant[tenant] = held - 1


def server_full(slots: int) -> QuotaExceeded:
    """The refusal when every inline slot of the server is taken: it names the server's limit only."""
    retry_after_s = quotas.SETTING_BY_QUOTA[Quota.INLINE_EXECUTIONS].retry_after_s
    return QuotaExceeded(
        f"quota {PLATFORM_SLOTS_QUOTA} ({slots}) exceeded: this server's inline executions are all in use; "
        "retry later, or submit with queue=true; nothing was recorded",
        quota=PLATFORM_SLOTS_QUOTA,
        limit=slots,
        retry_after_s=retry_after_s,
    )
