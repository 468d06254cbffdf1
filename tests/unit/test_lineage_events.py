"""Every ledger entry kind the transition table appends has its lineage event, or is declared to have none
(issue 32, item 3): a new transition cannot silently emit nothing; and each terminal status has the event a
catalog expects (COMPLETE, FAIL, ABORT) among its transition's entries."""

from __future__ import annotations

import pytest
from openlineage.client.event_v2 import RunState

from durable_dataflow.dataflow.protocol.runs import RunStatus
from durable_dataflow.dataflow.protocol.transition_table import TABLE
from durable_dataflow.lineage import events

TERMINAL_EVENT = {RunStatus.SUCCEEDED: RunState.COMPLETE, RunStatus.FAILED: RunState.FAIL,
                  RunStatus.CANCELLED: RunState.ABORT}  # fmt: skip


def test_every_appended_kind_is_classified_once() -> None:
    """Proves each kind of TABLE is either mapped to an event type or declared eventless, never both."""
    appended = {kind for transition in TABLE.values() for kind in transition.kinds}
    mapped, eventless = set(events.EVENT_TYPES), set(events.NO_EVENT_KINDS)
    assert mapped.isdisjoint(eventless)
    assert appended - mapped - eventless == set(), "a transition's entry kind has no lineage decision"
    assert mapped | eventless >= appended


@pytest.mark.parametrize("outcome", sorted(TABLE, key=str))
def test_each_terminal_status_emits_its_event(outcome: object) -> None:
    """Proves a transition that ends a run succeeded, failed or cancelled appends an entry whose event is
    COMPLETE, FAIL or ABORT, and an outcome-unknown transition one whose event is OTHER."""
    transition = TABLE[outcome]  # type: ignore[index]
    types = {events.EVENT_TYPES[k] for k in transition.kinds if k in events.EVENT_TYPES}
    if transition.status in TERMINAL_EVENT:
        assert TERMINAL_EVENT[transition.status] in types, (outcome, transition.kinds)
    if transition.status == RunStatus.OUTCOME_UNKNOWN:
        assert RunState.OTHER in types, (outcome, transition.kinds)
