"""The ledger chain and checkpoints on both engines: every kind of damage is detected and named."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from durable_dataflow.core import checkpoints, fencing, hashing, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import EvidenceError
from durable_dataflow.core.schema import ledger_entries
from durable_dataflow.core.secrets import Secret

MODULE = "test"
SUBJECT = "run-1"


def _write_chain(db: Database, count: int = 4, key: Secret | None = None) -> None:
    with db.begin() as conn:
        leases.acquire(conn, db, MODULE, SUBJECT, "writer", 30)
    with fencing.fenced(db, MODULE, SUBJECT, 1) as conn:
        for index in range(count):
            ledger.append(conn, db, MODULE, SUBJECT, 1, f"step.{index}", {"index": index}, evidence_key=key)


def _verify(db: Database, key: Secret | None = None) -> ledger.Verification:
    with db.read() as conn:
        return checkpoints.verify_subject(conn, MODULE, SUBJECT, evidence_key=key)


def _update(db: Database, seq: int, **values: object) -> None:
    with db.begin() as conn:
        conn.execute(
            ledger_entries.update()
            .where(ledger_entries.c.subject_id == SUBJECT, ledger_entries.c.seq == seq)
            .values(**values)
        )


def test_intact_chain_verifies(db: Database) -> None:
    """An untouched chain of four entries verifies, with its head at seq 4."""
    _write_chain(db)
    result = _verify(db)
    assert result.ok, result.reason
    assert (result.head_seq, result.entry_count) == (4, 4)


def test_edited_payload_is_named(db: Database) -> None:
    """Changing one entry's payload in the database breaks the chain exactly at that seq."""
    _write_chain(db)
    _update(db, 2, payload_json='{"index":99}')
    result = _verify(db)
    assert not result.ok
    assert result.broken_seq == 2
    assert "edited" in result.reason


def test_deleted_entry_is_named(db: Database) -> None:
    """Deleting a middle entry is detected at the gap."""
    _write_chain(db)
    with db.begin() as conn:
        conn.execute(ledger_entries.delete().where(ledger_entries.c.seq == 2))
    result = _verify(db)
    assert not result.ok
    assert result.broken_seq == 3
    assert "missing" in result.reason


def test_inserted_entry_is_named(db: Database) -> None:
    """A forged entry spliced in (later entries renumbered) does not chain and is named."""
    _write_chain(db, count=3)
    with db.begin() as conn:
        rows = conn.execute(sa.select(ledger_entries).order_by(ledger_entries.c.seq.desc())).all()
        for row in rows:  # shift seq 2.. up by one, from the top, to make room
            if row.seq >= 2:
                conn.execute(
                    ledger_entries.update().where(ledger_entries.c.seq == row.seq).values(seq=row.seq + 1)
                )
        first = rows[-1]
        forged = dict(first._mapping)
        forged.update(seq=2, kind="forged", payload_json='{"index":7}', prev_hash=first.entry_hash)
        body = ledger.entry_body(MODULE, SUBJECT, 2, 1, "forged", {"index": 7}, first.recorded_at_us)
        forged["entry_hash"] = ledger.chain_hash(first.entry_hash, body)
        conn.execute(ledger_entries.insert().values(**forged))
    result = _verify(db)
    assert not result.ok
    assert result.broken_seq == 3
    assert "does not chain" in result.reason


def test_reordered_entries_are_named(db: Database) -> None:
    """Swapping the seq numbers of two entries is detected."""
    _write_chain(db)
    with db.begin() as conn:
        conn.execute(ledger_entries.update().where(ledger_entries.c.seq == 2).values(seq=100))
        conn.execute(ledger_entries.update().where(ledger_entries.c.seq == 3).values(seq=2))
        conn.execute(ledger_entries.update().where(ledger_entries.c.seq == 100).values(seq=3))
    result = _verify(db)
    assert not result.ok
    assert result.broken_seq == 2


def test_deleted_tail_is_caught_by_the_checkpoint(db: Database) -> None:
    """Removing the last entries leaves a valid-looking chain; the checkpointed head exposes it."""
    _write_chain(db)
    with fencing.fenced(db, MODULE, SUBJECT, 1) as conn:
        checkpoints.write_verified(conn, db, MODULE, SUBJECT, 1, "done", {})
    with db.begin() as conn:
        conn.execute(ledger_entries.delete().where(ledger_entries.c.seq == 4))
    result = _verify(db)
    assert not result.ok
    assert result.broken_seq == 4
    assert "checkpointed head" in result.reason


def test_rebuilt_chain_without_the_key_fails_keyed_verification(db: Database) -> None:
    """Someone without DATAFLOW_EVIDENCE_KEY who edits an entry and rehashes the rest is caught by the MAC."""
    key = Secret("DATAFLOW_EVIDENCE_KEY", "canary-evidence-key-7f3a")
    _write_chain(db, key=key)
    assert _verify(db, key).ok
    with db.begin() as conn:
        rows = conn.execute(sa.select(ledger_entries).order_by(ledger_entries.c.seq)).all()
        prev = ledger.genesis_hash(MODULE, SUBJECT)
        for row in rows:
            payload = {"index": 42} if row.seq == 2 else __import__("json").loads(row.payload_json)
            body = ledger.entry_body(
                MODULE, SUBJECT, row.seq, row.attempt, row.kind, payload, row.recorded_at_us
            )
            new_hash = ledger.chain_hash(prev, body)
            conn.execute(
                ledger_entries.update()
                .where(ledger_entries.c.seq == row.seq)
                .values(
                    payload_json=hashing.canonical_json(payload).decode(), prev_hash=prev, entry_hash=new_hash
                )
            )
            prev = new_hash
    plain = _verify(db)  # the plain chain was rebuilt consistently, but keyed entries are not checked without the key
    assert not plain.ok and plain.broken_seq is None and plain.reason == ledger.KEYED_UNCHECKED_REASON
    keyed = _verify(db, key)
    assert not keyed.ok
    assert keyed.broken_seq == 2
    assert "keyed MAC" in keyed.reason


def test_the_evidence_key_is_never_stored(db: Database) -> None:
    """The evidence key's value appears nowhere in the ledger or checkpoint rows."""
    key = Secret("DATAFLOW_EVIDENCE_KEY", "canary-evidence-key-never-stored")
    _write_chain(db, key=key)
    with fencing.fenced(db, MODULE, SUBJECT, 1) as conn:
        checkpoints.write_verified(conn, db, MODULE, SUBJECT, 1, "done", {}, evidence_key=key)
    with db.read() as conn:
        for table in ("ledger_entries", "checkpoints", "leases"):
            dump = repr(conn.execute(sa.text(f"SELECT * FROM {table}")).all())
            assert key.reveal() not in dump


def test_failed_verification_blocks_the_callers_commit(db: Database) -> None:
    """A checkpoint write on a damaged chain raises EvidenceError and the whole transaction rolls back."""
    _write_chain(db)
    _update(db, 1, kind="tampered")
    with pytest.raises(EvidenceError, match="seq 1"), fencing.fenced(db, MODULE, SUBJECT, 1) as conn:
        ledger.append(conn, db, MODULE, SUBJECT, 1, "run.succeeded", {})
        checkpoints.write_verified(conn, db, MODULE, SUBJECT, 1, "succeeded", {})
    with db.read() as conn:
        kinds = [entry.kind for entry in ledger.read(conn, MODULE, SUBJECT)]
        assert "run.succeeded" not in kinds
        assert checkpoints.latest(conn, MODULE, SUBJECT) is None


def test_facts_check_failure_blocks_the_checkpoint(db: Database) -> None:
    """A chain that verifies but lacks the facts a state needs gets no checkpoint."""
    _write_chain(db)

    def needs_result(entries: object) -> str:
        return "no result.committed entry"

    with (
        pytest.raises(EvidenceError, match=r"no result\.committed"),
        fencing.fenced(db, MODULE, SUBJECT, 1) as conn,
    ):
        checkpoints.write_verified(conn, db, MODULE, SUBJECT, 1, "succeeded", {}, facts_check=needs_result)
