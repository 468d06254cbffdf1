"""Delivery of the outbox: each pending key's entry becomes its event (``lineage.events``), emitted through
the OpenLineage client, and the key is deleted only after the emit returned.

At least once: a process that dies between an emit and the deletion leaves the key, and the next delivery
sends the same event again (same event id). A receiver that fails stops the batch there: what follows stays
pending, in order, for the next delivery; the failure is logged (``lineage.undelivered``, the error's type
only: a transport's message may hold its URL or credentials) and reported, never raised.

On PostgreSQL a batch is taken with ``FOR UPDATE SKIP LOCKED`` in a transaction held while it is emitted
(only the outbox rows are locked: runs insert new keys and never wait), so several deliverers share the
work. On SQLite a writer would block every run for the emits' duration: the batch is read, emitted, then
deleted in a short write transaction; two deliverers at once may both send an event (receivers de-duplicate
by event id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from sqlalchemy.engine import Connection

from durable_dataflow.core import ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import NotFound
from durable_dataflow.core.ledger import OutboxKey
from durable_dataflow.dataflow.protocol import runs
from durable_dataflow.lineage import events

if TYPE_CHECKING:
    from openlineage.client import OpenLineageClient
    from openlineage.client.event_v2 import RunEvent

BATCH_MAX = 200  # keys one delivery takes
FLUSH_BATCHES_MAX = 10_000  # a flush stops after this many batches even if keys keep arriving

_log = structlog.get_logger("dataflow.lineage")


@dataclass(frozen=True)
class Delivery:
    """What one delivery did: events emitted, entries that map to no event, and whether an emit failed."""

    delivered: int = 0
    skipped: int = 0  # entries whose kind becomes no event (their keys are deleted all the same)
    failed: bool = False  # an emit failed: the batch stopped there, and its rest stays pending
    error_type: str = ""  # the failed emit's exception type, "" when none failed

    def plus(self, other: Delivery) -> Delivery:
        return Delivery(
            self.delivered + other.delivered, self.skipped + other.skipped, other.failed, other.error_type
        )


Planned = list[tuple[OutboxKey, "RunEvent | None"]]


def deliver_pending(
    db: Database, client: OpenLineageClient, *, namespace: str, limit: int = BATCH_MAX
) -> Delivery:
    """Deliver one batch of at most ``limit`` pending keys; an empty outbox delivers nothing."""
    if db.dialect == "postgresql":
        with db.begin() as conn:
            planned = plan(conn, ledger.pending_outbox(conn, limit, skip_locked=True), namespace)
            outcome, done = _emit(client, planned)
            ledger.delete_outbox(conn, done)
        return outcome
    with db.read() as conn:
        planned = plan(conn, ledger.pending_outbox(conn, limit), namespace)
    outcome, done = _emit(client, planned)
    if done:
        with db.begin() as conn:
            ledger.delete_outbox(conn, done)
    return outcome


def flush(db: Database, client: OpenLineageClient, *, namespace: str) -> Delivery:
    """Deliver until nothing is pending or an emit fails."""
    total = Delivery()
    for _ in range(FLUSH_BATCHES_MAX):
        outcome = deliver_pending(db, client, namespace=namespace)
        total = total.plus(outcome)
        if outcome.failed or outcome.delivered + outcome.skipped == 0:
            break
    return total


def pending_count(db: Database) -> int:
    with db.read() as conn:
        return ledger.outbox_count(conn)


def plan(conn: Connection, keys: Sequence[OutboxKey], namespace: str) -> Planned:
    """Each key with the event its entry becomes (None: no event), in the keys' order. Each run's row and
    chain are read once; a key whose entry or run is gone (never, short of a hand edit) becomes no event."""
    chains: dict[tuple[str, str], tuple[runs.Run | None, dict[int, ledger.Entry], list[ledger.Entry]]] = {}
    planned: Planned = []
    for key in keys:
        module, subject_id, seq = key
        if module != runs.MODULE:
            planned.append((key, None))
            continue
        if (module, subject_id) not in chains:
            chains[(module, subject_id)] = _read_run(conn, subject_id)
        run, by_seq, chain = chains[(module, subject_id)]
        entry = by_seq.get(seq)
        event = None if run is None or entry is None else events.event_for(run, entry, chain, namespace)
        planned.append((key, event))
    return planned


def _read_run(conn: Connection, run_id: str) -> tuple[runs.Run | None, dict[int, ledger.Entry], list[ledger.Entry]]:
    try:
        run = runs.get(conn, run_id)
    except NotFound:
        return None, {}, []
    chain = ledger.read(conn, runs.MODULE, run_id)
    return run, {entry.seq: entry for entry in chain}, chain


def _emit(client: OpenLineageClient, planned: Planned) -> tuple[Delivery, list[OutboxKey]]:
    """Emit in order, stopping at the first failure; the keys done (emitted or mapping to no event)."""
    done: list[OutboxKey] = []
    delivered = skipped = 0
    for key, event in planned:
        if event is None:
            skipped += 1
            done.append(key)
            continue
        try:
            client.emit(event)
        except Exception as error:  # any transport's failure: the receiver is down, the event waits
            _log.warning("lineage.undelivered", error_type=type(error).__name__, pending_from=f"{key[0]}/{key[1]}")
            return Delivery(delivered, skipped, True, type(error).__name__), done
        delivered += 1
        done.append(key)
    return Delivery(delivered, skipped), done
