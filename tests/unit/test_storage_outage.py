"""How a worker's log tells one outage of the platform database (dataflow.worker.StorageOutage): which
success ends it. A fake clock and a list logger; no database."""

from __future__ import annotations

from typing import Any

from durable_dataflow.core.errors import StorageUnavailable
from durable_dataflow.dataflow.worker import StorageOutage


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


def _outage() -> tuple[StorageOutage, _Log, list[float]]:
    log, now = _Log(), [100.0]
    return StorageOutage(log, clock=lambda: now[0]), log, now


DOWN = StorageUnavailable("the platform database is unavailable")


def test_only_a_success_of_an_operation_that_failed_ends_the_outage() -> None:
    """Proves a heartbeat's success does not end an outage only claims are in (claims time out behind a
    lock while the heartbeat's row is free): no recovery until a claim works, then one, with the outage's
    duration and its failures (the code of stop 41 ended it at any success)."""
    outage, log, now = _outage()
    outage.failed("claim", DOWN, 0.01)
    now[0] += 2.0
    assert not outage.succeeded("beat")
    outage.failed("claim", DOWN, 0.02)
    now[0] += 1.0
    assert outage.succeeded("claim")
    assert [event for event, _ in log.events] == ["storage.unavailable", "storage.unavailable", "storage.recovered"]
    assert log.events[-1][1] == {"operation": "claim", "outage_s": 3.0, "failures": 2}
    assert not outage.succeeded("claim")  # over: nothing more is logged


def test_an_operation_that_failed_once_and_waits_does_not_hold_the_outage_open() -> None:
    """Proves the outage ends at the first success of any operation that failed during it: a schedule
    evaluation that failed once and is next tried a minute later does not keep it open while claims work
    again (requiring every failed operation to succeed delayed the recovery by that minute)."""
    outage, log, _now = _outage()
    outage.failed("schedules", DOWN, 0.01)
    outage.failed("claim", DOWN, 0.02)
    assert outage.succeeded("claim")
    assert [event for event, _ in log.events][-1] == "storage.recovered"
    assert not outage.succeeded("schedules")  # a later success of the other one logs nothing
