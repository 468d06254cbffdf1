"""The invariant checker used by the fault tests and the soak can fail: each broken invariant it is
meant to catch (3, 6, 7, 8, 9) is fed to it on a real run's ledger and must be reported."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from durable_dataflow.core import ledger
from durable_dataflow.dataflow.protocol import evidence
from durable_dataflow.dataflow.protocol.forward import publication_key
from durable_dataflow.dataflow.protocol.runs import MODULE, Run
from durable_dataflow.platform import Platform
from faults import harness


@pytest.fixture
def forward_run(tmp_path: Path) -> tuple[Run, list[ledger.Entry], list[harness.Publication], str | None]:
    """A real succeeded forward run on SQLite with its ledger, its sink publication and stored digest."""
    definition = harness.inline_definition(tmp_path / "defs", "checked", publish_to="sink")
    with Platform(f"sqlite:///{tmp_path}/p.db") as platform:
        run = platform.runs.run_inline(harness.request_for(definition, {"n": "2"}, "k")).run
        with platform.db.read() as conn:
            entries = ledger.read(conn, MODULE, run.run_id)
            stored = evidence.stored_result_digest(conn, run.run_id)
    pubs = harness.parquet_publications(tmp_path / "defs" / "sink")
    return run, entries, pubs, stored


def _entry(like: ledger.Entry, seq: int, attempt: int, kind: str, **payload: str) -> ledger.Entry:
    return dataclasses.replace(like, seq=seq, attempt=attempt, kind=kind, payload=payload)


def test_a_clean_run_has_no_problem(forward_run: tuple) -> None:  # type: ignore[type-arg]
    """The baseline: a real succeeded forward run with one publication passes every check."""
    run, entries, pubs, stored = forward_run
    assert run.status == "succeeded" and len(pubs) == 1
    assert harness.run_problems(run, entries, pubs, stored) == []


def test_each_broken_invariant_is_reported(forward_run: tuple) -> None:  # type: ignore[type-arg]
    """Doctored ledgers and sinks: a second publication, a missing confirmation, a retry after
    authorization, a stale write and an unrecovered expired attempt are each named."""
    run, entries, pubs, stored = forward_run
    last = entries[-1]
    twice = [*pubs, dataclasses.replace(pubs[0], where="again")]
    assert any(p.startswith("inv6") for p in harness.run_problems(run, entries, twice, stored))
    unconfirmed = [e for e in entries if e.kind != evidence.PUBLICATION_CONFIRMED]
    assert any(p.startswith("inv7") for p in harness.run_problems(run, unconfirmed, pubs, stored))
    retried = [*entries, _entry(last, last.seq + 1, 2, evidence.ATTEMPT_STARTED)]
    assert any(p.startswith("inv8") for p in harness.run_problems(run, retried, pubs, stored))
    stale = [*retried, _entry(last, last.seq + 2, 1, evidence.PUBLICATION_UNKNOWN)]
    assert any(p.startswith("inv3") for p in harness.run_problems(run, stale, pubs, stored))
    before_dispatch = entries[:2]  # recorded + attempt 1 started, then nothing
    queued = run.model_copy(update={"status": "failed"})
    assert any(p.startswith("inv9") for p in harness.run_problems(queued, before_dispatch, [], stored))
    lost = run.model_copy(update={"status": "running"})
    assert any(p.startswith("lost run") for p in harness.run_problems(lost, entries, pubs, stored))
    assert publication_key(run) == pubs[0].key
