"""The fair claim on SQLite and PostgreSQL: a worker takes the oldest queued run of the tenant with the
fewest running runs, so one tenant's queue cannot hold every worker (issue 29, finding 4)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_dataflow.core import ledger
from durable_dataflow.dataflow.protocol import sweeper
from durable_dataflow.dataflow.protocol.requests import AccessContext
from durable_dataflow.platform import Platform
from faults import harness

FLOOD_RUNS = 8


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=30) as opened:
        yield opened


def _queue(platform: Platform, definition: Path, tenant: str, number: int) -> str:
    request = harness.request_for(definition, {"n": str(number)}, f"{tenant}-{number}")
    request = dataclasses.replace(request, access=AccessContext.local(tenant))
    return platform.runs.submit(request).run.run_id


def test_a_tenant_with_nothing_running_is_served_before_a_flooding_tenant(
    platform: Platform, tmp_path: Path
) -> None:
    """Proves the claim is fair across tenants: tenant B queues many runs before tenant A queues one;
    the first claim takes B's oldest (both have nothing running), and with B running one the next claim
    takes A's run, not B's second (a global FIFO would take B's)."""
    definition = harness.inline_definition(tmp_path / "defs", "fair")
    flood = [_queue(platform, definition, "b-flood", n) for n in range(FLOOD_RUNS)]
    victim = _queue(platform, definition, "a-victim", 0)
    first = platform.runs.claim_next()
    assert first is not None and first.run.run_id == flood[0]
    second = platform.runs.claim_next()
    assert second is not None and second.run.run_id == victim
    third = platform.runs.claim_next()  # A runs one, B runs one, only B has queued runs: FIFO within B
    assert third is not None and third.run.run_id == flood[1]


def test_within_one_tenant_the_claim_is_first_in_first_out(platform: Platform, tmp_path: Path) -> None:
    """Proves one tenant's runs are claimed oldest first, as before: three runs, three claims, in order."""
    definition = harness.inline_definition(tmp_path / "defs", "fifo")
    queued = [_queue(platform, definition, "solo", n) for n in range(3)]
    claimed = [platform.runs.claim_next() for _ in queued]
    assert [c.run.run_id if c is not None else None for c in claimed] == queued
    assert platform.runs.claim_next() is None


def test_a_claim_appends_attempt_started_from_the_head_its_lease_grant_read(
    platform: Platform, tmp_path: Path
) -> None:
    """Proves the claim's transaction reads the run's ledger head in its lease grant, not in a statement
    of its own: the claim's select, the grant, the ledger insert, the run's update, nothing else (the
    code before read the head between the grant and the insert), on a first grant and on a retry's (the
    grant's UPDATE, after a sweep queued the run again); the run's chain verifies after each."""

    definition = harness.inline_definition(tmp_path / "defs", "head")
    run_id = _queue(platform, definition, "t", 0)
    for attempt, grant in ((1, "INSERT INTO leases"), (2, "UPDATE leases")):  # a first grant, then a retry's
        sent = _statements_of(platform, platform.runs.claim_next)
        claim = platform.runs.get(run_id)
        assert (claim.status, claim.attempt) == ("running", attempt)
        assert len(sent) == 4, sent
        assert sent[1].startswith(grant) and "ledger_entries" in sent[1], sent
        assert sent[2].startswith("INSERT INTO ledger_entries") and sent[3].startswith("UPDATE dataflow_runs"), sent
        assert len([s for s in sent if "ledger_entries" in s]) == 2  # no read of the head on its own
        with platform.db.read() as conn:
            entries = ledger.read(conn, "dataflow", run_id)
        assert ledger.verify_entries(entries, "dataflow", run_id).ok
        assert [e.kind for e in entries][-1] == "attempt.started" and entries[-1].seq == len(entries)
        if attempt == 1:  # the attempt's lease expires; the sweeper proves it absent and queues the run again
            platform.db.advance_clock(31)
            assert [d.decision for d in sweeper.sweep(platform.db)] == ["recovered"]


def _statements_of(platform: Platform, act: Callable[[], object]) -> list[str]:
    """The statements ``act`` sends, whitespace folded (BEGIN and savepoints left out)."""
    sent: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        if not statement.lstrip().upper().startswith(("BEGIN", "SAVEPOINT", "RELEASE")):
            sent.append(" ".join(statement.split()))

    sa.event.listen(platform.db.engine, "before_cursor_execute", record)
    try:
        act()
    finally:
        sa.event.remove(platform.db.engine, "before_cursor_execute", record)
    return sent
