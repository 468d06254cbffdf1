"""Leases and the fenced transaction on both engines, with expiry on the database clock."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from durable_dataflow.core import fencing, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import InputError, LeaseUnavailable, StaleAttempt
from durable_dataflow.core.invariants import InvariantViolation
from durable_dataflow.core.schema import ledger_entries

MODULE = "test"
WAIT_S = 30.0


def _acquire(db: Database, subject: str = "s", ttl_s: float = 30) -> leases.Lease:
    with db.begin() as conn:
        return leases.acquire(conn, db, MODULE, subject, "holder", ttl_s)


def _entries(db: Database, subject: str = "s") -> list[str]:
    with db.read() as conn:
        return [entry.kind for entry in ledger.read(conn, MODULE, subject)]


def test_attempts_grow_and_a_live_lease_is_exclusive(db: Database) -> None:
    """The first grant is attempt 1; a second grant while it is live is refused; after expiry it is 2."""
    assert _acquire(db).attempt == 1
    with pytest.raises(LeaseUnavailable):
        _acquire(db)
    db.advance_clock(31)
    assert _acquire(db).attempt == 2


def test_fenced_write_commits_only_for_the_current_live_attempt(db: Database) -> None:
    """Attempt 1 writes while live; after expiry and a new grant, its write is refused and leaves nothing."""
    _acquire(db, ttl_s=5)
    with fencing.fenced(db, MODULE, "s", 1) as conn:
        ledger.append(conn, db, MODULE, "s", 1, "by.one", {})
    db.advance_clock(6)
    with pytest.raises(StaleAttempt, match="lost its lease"), fencing.fenced(db, MODULE, "s", 1) as conn:
        ledger.append(conn, db, MODULE, "s", 1, "late.one", {})
    _acquire(db, ttl_s=5)
    with (
        pytest.raises(StaleAttempt, match="current attempt is 2"),
        fencing.fenced(db, MODULE, "s", 1) as conn,
    ):
        ledger.append(conn, db, MODULE, "s", 1, "stale.one", {})
    with fencing.fenced(db, MODULE, "s", 2) as conn:
        ledger.append(conn, db, MODULE, "s", 2, "by.two", {})
    assert _entries(db) == ["by.one", "by.two"]


def test_heartbeat_extends_but_cannot_revive(db: Database) -> None:
    """A heartbeat before expiry extends the lease; after expiry it raises StaleAttempt."""
    _acquire(db, ttl_s=5)
    db.advance_clock(4)
    with db.begin() as conn:
        fencing.check_fence(conn, db, MODULE, "s", 1)
        leases.heartbeat(conn, db, MODULE, "s", 1, 5)
    db.advance_clock(4)  # 8 s after the grant: alive only thanks to the heartbeat
    with fencing.fenced(db, MODULE, "s", 1):
        pass
    db.advance_clock(2)
    with pytest.raises(StaleAttempt), db.begin() as conn:
        leases.heartbeat(conn, db, MODULE, "s", 1, 5)


def test_release_ends_the_attempt(db: Database) -> None:
    """After release the attempt can no longer write, and the next grant follows at once."""
    _acquire(db)
    with fencing.fenced(db, MODULE, "s", 1) as conn:
        leases.release(conn, db, MODULE, "s", 1)
    with pytest.raises(StaleAttempt, match="released"), fencing.fenced(db, MODULE, "s", 1):
        pass
    assert _acquire(db).attempt == 2


def test_expiry_follows_the_database_clock_not_the_process_clock(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose own clock runs a day ahead (or behind) sees the same lease state as the database."""
    _acquire(db, ttl_s=10)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 86_400)
    with fencing.fenced(db, MODULE, "s", 1):
        pass  # the process thinks the lease expired a day ago; the database says it is live
    with db.begin() as conn:
        assert leases.list_expired(conn, db, MODULE) == []
    monkeypatch.setattr(time, "time", lambda: real_time() - 86_400)
    db.advance_clock(11)  # the database clock moves past the expiry
    with db.begin() as conn:
        expired = leases.list_expired(conn, db, MODULE)
    assert [(e.subject_id, e.attempt) for e in expired] == [("s", 1)]


def test_close_expired_decides_once(db: Database) -> None:
    """Only one sweeper closes an expired attempt; a live or already-closed one is left alone."""
    _acquire(db, ttl_s=5)
    with db.begin() as conn:
        assert not leases.close_expired(conn, db, MODULE, "s", 1)
    db.advance_clock(6)
    with db.begin() as conn:
        assert leases.close_expired(conn, db, MODULE, "s", 1)
    with db.begin() as conn:
        assert not leases.close_expired(conn, db, MODULE, "s", 1)
        assert leases.list_expired(conn, db, MODULE) == []


def test_expected_attempt_guards_the_grant(db: Database) -> None:
    """A claim that read attempt 1 cannot take a lease after someone else's attempt 2 was granted."""
    _acquire(db, ttl_s=5)
    db.advance_clock(6)
    _acquire(db, ttl_s=5)
    db.advance_clock(6)
    with pytest.raises(LeaseUnavailable), db.begin() as conn:
        leases.acquire(conn, db, MODULE, "s", "late", 5, expected_attempt=1)
    with db.begin() as conn:
        assert leases.acquire(conn, db, MODULE, "s", "ok", 5, expected_attempt=2).attempt == 3


def test_ttl_bounds_are_input_errors(db: Database) -> None:
    """A zero or absurd TTL is refused with a message naming the bounds."""
    with pytest.raises(InputError, match="lease TTL"), db.begin() as conn:
        leases.acquire(conn, db, MODULE, "s", "h", 0)


def test_stale_transaction_rolls_back_everything(db: Database) -> None:
    """A StaleAttempt raised by the fence leaves no row of that transaction behind."""
    _acquire(db, ttl_s=5)
    db.advance_clock(6)
    with pytest.raises(StaleAttempt), fencing.fenced(db, MODULE, "s", 1) as conn:
        ledger.append(conn, db, MODULE, "s", 1, "never", {})
    with db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(ledger_entries)).scalar_one() == 0


def test_the_heartbeat_thread_beats_a_lease_registered_ahead_of_a_later_one(db: Database) -> None:
    """Proves the one heartbeat thread is woken for a lease whose first beat comes before every beat it is
    waiting for: with a 30 s lease registered (its beat due in 10 s), a 1.5 s lease registered next must be
    beaten within about 0.5 s (its TTL/3), not after the 10 s the thread was waiting. Also: a lease
    registered behind an earlier beat (the 30 s one) does not stop that earlier beat. Waits on the
    database's own view of the lease, with a deadline, never for a fixed time."""
    from durable_dataflow.core.heartbeat import Heartbeats

    long_lease, short_lease = _acquire(db, "long", ttl_s=30), _acquire(db, "short", ttl_s=1.5)
    beats = Heartbeats(db)
    try:
        with beats.keep_alive(MODULE, "long", long_lease.attempt, 30), \
                beats.keep_alive(MODULE, "short", short_lease.attempt, 1.5):  # fmt: skip
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                with db.read() as conn:
                    found = leases.expiry_of(conn, db, MODULE, ["short"])["short"]
                if found.expires_at_us > short_lease.expires_at_us:
                    break
            else:
                raise AssertionError("the 1.5 s lease was not beaten within 5 s: the thread slept on the 30 s one")
            with db.read() as conn:
                assert not leases.expiry_of(conn, db, MODULE, ["short"])["short"].expired
    finally:
        beats.close()


def _head(db: Database, subject: str = "s") -> tuple[int | None, str | None]:
    with db.read() as conn:
        entries = ledger.read(conn, MODULE, subject)
    return (entries[-1].seq, entries[-1].entry_hash) if entries else (None, None)


def test_a_grant_asked_for_the_chain_head_reads_it_with_the_grants_clock(db: Database) -> None:
    """Proves ``acquire(..., chain_head=True)`` returns the subject's ledger head as the grant saw it: an
    empty chain on a first grant, the last entry on the next grant (its update path), each with the
    grant's own database clock; entries appended from it chain on and verify. Without the flag, none."""
    with db.begin() as conn:
        first = leases.acquire(conn, db, MODULE, "s", "holder", 5, expected_attempt=0, chain_head=True)
    assert first.chain_head == ledger.Head(None, None, first.acquired_at_us)
    with fencing.fenced(db, MODULE, "s", 1) as conn:
        ledger.append(conn, db, MODULE, "s", 1, "by.one", {})
        ledger.append(conn, db, MODULE, "s", 1, "by.one.again", {})
    db.advance_clock(6)
    with db.begin() as conn:
        second = leases.acquire(conn, db, MODULE, "s", "holder", 5, expected_attempt=1, chain_head=True)
        assert second.chain_head == ledger.Head(*_head(db), second.acquired_at_us)
        assert second.chain_head.seq == 2
        ledger.append_many(conn, db, MODULE, "s", [(2, "by.two", {})], head=second.chain_head)
    with db.read() as conn:
        entries = ledger.read(conn, MODULE, "s")
        assert ledger.verify_entries(entries, MODULE, "s").ok
    assert [e.kind for e in entries] == ["by.one", "by.one.again", "by.two"]
    assert entries[-1].recorded_at_us == second.acquired_at_us
    db.advance_clock(6)
    with db.begin() as conn:
        assert leases.acquire(conn, db, MODULE, "s", "holder", 5).chain_head is None


def test_an_append_starts_from_one_head_only(db: Database) -> None:
    """Proves ``append_many`` refuses two heads at once (a new subject's time and a head read elsewhere)."""
    with pytest.raises(InvariantViolation, match="one head"), db.begin() as conn:
        ledger.append_many(
            conn, db, MODULE, "s", [(1, "k", {})], new_subject_at_us=1, head=ledger.Head(None, None, 1)
        )


def test_a_beat_that_raises_unexpectedly_is_logged_once_and_beats_go_on(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves an unexpected error of a heartbeat is not swallowed silently: one ``heartbeat.failed``
    error naming the lease and the error's type (not its message) however many beats fail, and the
    lease is beaten again once the error is gone (fails when the thread logs nothing, logs every beat,
    or stops beating). A bug stand-in replaces the beat's statement; the database is real."""
    from structlog.testing import capture_logs

    from durable_dataflow.core.heartbeat import Heartbeats

    lease = _acquire(db, "hb", ttl_s=30)
    real_heartbeat = leases.heartbeat
    failures = {"left": 3}
    failed_thrice, beaten_after = threading.Event(), threading.Event()

    def flaky(*args: object, **kwargs: object) -> int:
        if failures["left"] > 0:
            failures["left"] -= 1
            if failures["left"] == 0:
                failed_thrice.set()
            raise RuntimeError("a message that must not reach the log")
        expires = real_heartbeat(*args, **kwargs)  # type: ignore[arg-type]
        beaten_after.set()
        return expires

    monkeypatch.setattr(leases, "heartbeat", flaky)
    beats = Heartbeats(db)
    with capture_logs() as logs:
        try:
            with beats.keep_alive(MODULE, "hb", lease.attempt, 0.3):  # a beat every 0.1 s
                assert failed_thrice.wait(10), "the beats stopped after an unexpected error"
                assert beaten_after.wait(10), "the lease was not beaten again once the error was gone"
        finally:
            beats.close()
    failed = [entry for entry in logs if entry["event"] == "heartbeat.failed"]
    assert len(failed) == 1 and failed[0]["error"] == "RuntimeError" and failed[0]["subject_id"] == "hb"
    assert "must not reach" not in repr(logs)


def test_a_grants_chain_head_is_its_own_subjects_in_its_own_module(db: Database) -> None:
    """Proves the head a grant reads is its subject's, not a neighbour's: subjects with 3 and 1 entries, the
    same subject name with 5 entries in another module, and a subject with none each get their own head
    (fails when the head subqueries lose the subject or module predicate: the single-subject tests pass)."""

    def append(module: str, subject: str, kinds: int) -> None:
        with db.begin() as conn:
            for n in range(kinds):
                ledger.append(conn, db, module, subject, 1, f"e{n}", {})

    append(MODULE, "a", 3)
    append(MODULE, "b", 1)
    append("elsewhere", "a", 5)
    for subject, seq in (("a", 3), ("b", 1), ("c", None)):
        with db.begin() as conn:
            lease = leases.acquire(conn, db, MODULE, subject, "holder", 5, expected_attempt=0, chain_head=True)
        assert lease.chain_head is not None
        assert (lease.chain_head.seq, lease.chain_head.entry_hash) == _head(db, subject) and lease.chain_head.seq == seq


def test_an_append_refuses_a_held_chain_and_a_head_together(db: Database) -> None:
    """Proves ``append_many`` refuses a held chain and a head read elsewhere at once (the third pair)."""
    held = ledger.HeldChain(MODULE, "s", (), 1, None)
    with pytest.raises(InvariantViolation, match="one head"), db.begin() as conn:
        ledger.append_many(conn, db, MODULE, "s", [(1, "k", {})], held=held, head=ledger.Head(None, None, 1))


@pytest.mark.postgres
def test_a_chain_head_read_without_the_callers_lock_can_be_stale_and_then_fails_loudly(pg_db: Database) -> None:
    """Proves why ``acquire(chain_head=True)`` needs the caller to hold a lock every chain writer takes (the
    claim: the run row), and that a stale head never forks a chain: a grant that waits for the lease row
    while a sweeper-like writer closes the expired lease and appends its decision returns the head its
    snapshot saw, one entry short; appending from it fails on the ledger's primary key and the chain stays
    intact (found by a review; the claim cannot meet this, its select holds the run row first)."""
    db = pg_db
    with db.begin() as conn:
        leases.acquire(conn, db, MODULE, "raced", "h", 30, expected_attempt=0)
    with fencing.fenced(db, MODULE, "raced", 1) as conn:
        ledger.append(conn, db, MODULE, "raced", 1, "by.one", {})
    db.advance_clock(31)  # attempt 1's lease expired: free for the grant, closable by a sweeper
    holding, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def sweeper_like() -> None:
        with db.begin() as conn:
            assert leases.close_expired(conn, db, MODULE, "raced", 1)  # locks the lease row
            ledger.append(conn, db, MODULE, "raced", 1, "swept", {})
            holding.set()
            assert release.wait(WAIT_S)

    def grant() -> None:
        try:
            with db.begin() as conn:
                lease = leases.acquire(conn, db, MODULE, "raced", "h2", 30, expected_attempt=1, chain_head=True)
                outcome["head"] = lease.chain_head
                ledger.append_many(conn, db, MODULE, "raced", [(lease.attempt, "by.two", {})], head=lease.chain_head)
        except sa.exc.IntegrityError as error:
            outcome["error"] = error

    writer, granter = threading.Thread(target=sweeper_like), threading.Thread(target=grant)
    writer.start()
    try:
        assert holding.wait(WAIT_S)
        granter.start()
        deadline = time.monotonic() + WAIT_S
        while not _waiting_for_a_lock(db):  # the grant now waits for the lease row the writer holds
            assert time.monotonic() < deadline, "the grant never waited for the lease row"
    finally:
        release.set()
        writer.join(WAIT_S)
        if granter.ident is not None:  # started
            granter.join(WAIT_S)
    head = outcome["head"]
    assert isinstance(head, ledger.Head) and head.seq == 1  # the writer's entry (seq 2) was not in it
    assert isinstance(outcome.get("error"), sa.exc.IntegrityError)
    with db.read() as conn:
        entries = ledger.read(conn, MODULE, "raced")
    assert [e.kind for e in entries] == ["by.one", "swept"] and ledger.verify_entries(entries, MODULE, "raced").ok


def _waiting_for_a_lock(db: Database) -> bool:
    with db.read() as conn:
        waiting = (
            "select count(*) from pg_stat_activity where wait_event_type = 'Lock' and datname = current_database()"
        )
        return bool(conn.execute(sa.text(waiting)).scalar_one())
