"""Leases: one row per (module, subject); the attempt number only grows and is the fencing token.

All times come from the database clock. A lease is *live* while it is not released and
``expires_at_us`` is after the database's now. Once a lease has expired it can never be revived:
heartbeats are fenced by the same check as every other write, so a paused worker that wakes up
after expiry cannot extend it.

Every statement here is a guarded ``UPDATE … WHERE <expected state> RETURNING``; the caller trusts
only the rows returned.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, NoReturn

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core import ledger
from durable_dataflow.core.db import Database, insert_if_absent
from durable_dataflow.core.errors import InputError, LeaseUnavailable, StaleAttempt
from durable_dataflow.core.invariants import invariant
from durable_dataflow.core.schema import leases

LEASE_TTL_S_MIN = 0.05
LEASE_TTL_S_MAX = 24 * 3600.0
LEASE_TTL_S_DEFAULT = 30.0
EXPIRED_BATCH_MAX = 500
EXPIRY_SUBJECTS_MAX = 1000  # subjects one expiry_of statement may name (a read view's page is at most 500)
HOLDER_LENGTH_MAX = 200


@dataclass(frozen=True)
class Lease:
    """A lease as granted: ``attempt`` is the fencing token for every write made under it."""

    module: str
    subject_id: str
    attempt: int
    holder: str
    acquired_at_us: int
    expires_at_us: int
    # With ``acquire(..., chain_head=True)`` (see its precondition): the subject's ledger head as the grant
    # read it, with the grant's clock (the time of the entries the holder appends next in the same transaction).
    chain_head: ledger.Head | None = None


@dataclass(frozen=True)
class ExpiredLease:
    """A lease whose holder stopped heartbeating: its attempt is stale, its outcome not yet decided."""

    module: str
    subject_id: str
    attempt: int
    holder: str
    expires_at_us: int


@dataclass(frozen=True)
class LeaseExpiry:
    """A subject's lease as a read view sees it, judged on the database clock by the statement that read it.

    ``expired``: not released and past ``expires_at_us``: the attempt's holder stopped and no sweeper
    has decided the attempt yet (a sweep releases the lease in the transaction that decides it).
    """

    subject_id: str
    attempt: int
    expires_at_us: int
    released: bool
    expired: bool


def ttl_us(ttl_s: float) -> int:
    if not LEASE_TTL_S_MIN <= ttl_s <= LEASE_TTL_S_MAX:
        raise InputError(f"lease TTL must be between {LEASE_TTL_S_MIN} and {LEASE_TTL_S_MAX} seconds, got {ttl_s}")
    return int(ttl_s * 1_000_000)


def _key(
    module: str | sa.BindParameter[str], subject_id: str | sa.BindParameter[str]
) -> sa.ColumnElement[bool]:
    """The lease of one subject: by value, or by bind parameters in a statement built once."""
    return sa.and_(leases.c.module == module, leases.c.subject_id == subject_id)


def acquire(
    conn: Connection,
    db: Database,
    module: str,
    subject_id: str,
    holder: str,
    ttl_s: float,
    *,
    expected_attempt: int | None = None,
    chain_head: bool = False,
) -> Lease:
    """Grant the next attempt if no live lease exists; raise :class:`LeaseUnavailable` otherwise.

    ``expected_attempt`` makes the grant conditional on the current attempt (a claim that read the
    subject's state under that attempt must not take a lease granted since). ``chain_head``: the grant
    also reads the subject's ledger head (``ledger.head_columns``, in the same round trip) into
    ``Lease.chain_head``, for the entries its holder appends next in the same transaction.

    Precondition of ``chain_head``: before the grant starts, the caller holds a lock that every writer of
    the subject's chain takes too (the claim: the run row, ``runs.fairest_queued``). The lease row's lock
    is not enough: at READ COMMITTED a grant that waited for it (a sweeper closing the expired lease and
    appending its decision) rechecks only the lease row and returns the head its statement's snapshot saw,
    before that writer's entry; appending from it then fails on the ledger's primary key (loudly, never
    a fork: ``tests/integration/test_core_leases.py``).
    """
    holder = holder[:HOLDER_LENGTH_MAX]
    head = ledger.head_parameters(module, subject_id) if chain_head else {}
    if expected_attempt == 0:  # a subject created in this transaction: nothing to update
        row = _insert_first(conn, db, module, subject_id, holder, ttl_s, expected_attempt, head)
    else:
        granted = conn.execute(
            db.statement(_next_grant_statement, expected_attempt is not None, chain_head),
            {**_match(module, subject_id, expected_attempt), "set_holder": holder, "ttl_us": ttl_us(ttl_s), **head},
        ).one_or_none()
        row = granted or _insert_first(conn, db, module, subject_id, holder, ttl_s, expected_attempt, head)
    return _lease_of(row, module, subject_id, holder, chain_head)


def _lease_of(row: Any, module: str, subject_id: str, holder: str, chain_head: bool) -> Lease:
    """The lease a grant's row returned (``_granted``'s columns)."""
    invariant(int(row.attempt) >= 1, "a granted attempt is a positive fencing token")
    acquired_at_us = int(row.acquired_at_us)
    read = None
    if chain_head:
        read = ledger.Head(None if row.head_seq is None else int(row.head_seq), row.head_hash, acquired_at_us)
    return Lease(module, subject_id, int(row.attempt), holder, acquired_at_us, int(row.expires_at_us), read)


@dataclass(frozen=True)
class FirstGrant:
    """A subject's first lease, asked for by a statement of another module that grants it with its own
    read, in the transaction creating the subject (a submit's quota read: protocol/quotas.py)."""

    module: str
    subject_id: str
    holder: str
    ttl_s: float


def first_grant_cte(db: Database) -> sa.CTE:
    """:func:`acquire`'s first grant (``expected_attempt=0``) as a data-modifying CTE returning the
    lease's ``attempt``, ``acquired_at_us`` and ``expires_at_us`` (no row when the subject had a lease);
    its values are :func:`first_grant_parameters`, and the statement hands its row to :func:`granted_first`."""
    return _first_grant_statement(db, False).cte("granted_lease")


def first_grant_parameters(grant: FirstGrant) -> dict[str, Any]:
    """The values of the first grant's bind parameters (:func:`first_grant_cte`'s and ``acquire``'s)."""
    return {
        "lease_module": grant.module, "lease_subject_id": grant.subject_id, "lease_attempt": 1,
        "lease_holder": grant.holder[:HOLDER_LENGTH_MAX], "lease_ttl_us": ttl_us(grant.ttl_s),
    }  # fmt: skip


def granted_first(row: Any, grant: FirstGrant) -> Lease:
    """The lease :func:`first_grant_cte` granted (``row``: the statement's, with the CTE's columns)."""
    return _lease_of(row, grant.module, grant.subject_id, grant.holder[:HOLDER_LENGTH_MAX], False)


def first_refused(grant: FirstGrant) -> NoReturn:
    """LeaseUnavailable: the statement with :func:`first_grant_cte` returned no row, the subject already
    had a lease."""
    raise LeaseUnavailable(f"{grant.module}/{grant.subject_id} is leased by another holder")


def _insert_first(
    conn: Connection,
    db: Database,
    module: str,
    subject_id: str,
    holder: str,
    ttl_s: float,
    expected_attempt: int | None,
    head: dict[str, str],
) -> sa.Row[Any]:
    """The first grant of a subject: ``INSERT … ON CONFLICT DO NOTHING RETURNING``, one statement
    (``head``: ``ledger.head_parameters``, to read the subject's ledger head with it)."""
    if expected_attempt not in (None, 0):
        raise LeaseUnavailable(f"{module}/{subject_id} is leased by another holder or its attempt moved on")
    grant = FirstGrant(module, subject_id, holder, ttl_s)
    statement = db.statement(_first_grant_statement, bool(head))
    return conn.execute(statement, {**first_grant_parameters(grant), **head}).one_or_none() or first_refused(grant)


# The statements every run executes, built once per database (Database.statement): the values are
# bind parameters, the subject and attempt are the ``match_*`` ones (``_match``).
def _match(module: str, subject_id: str, attempt: int | None) -> dict[str, Any]:
    return {"match_module": module, "match_subject_id": subject_id, "match_attempt": attempt}


def _matched_key() -> sa.ColumnElement[bool]:
    return _key(sa.bindparam("match_module"), sa.bindparam("match_subject_id"))


def _granted(chain_head: bool) -> tuple[sa.ColumnElement[Any], ...]:
    """What a grant returns: the lease, and with ``chain_head`` the subject's ledger head (as
    ``head_seq``, ``head_hash``)."""
    granted = (leases.c.attempt, leases.c.acquired_at_us, leases.c.expires_at_us)
    if not chain_head:
        return granted
    seq, entry_hash = ledger.head_columns()
    return (*granted, seq.label("head_seq"), entry_hash.label("head_hash"))


def _next_grant_statement(db: Database, guarded: bool, chain_head: bool) -> sa.Update:
    """The grant of the next attempt over a released or expired lease (``guarded``: only while the
    lease still names ``match_attempt``; ``chain_head``: see ``_granted``)."""
    now = db.now_us_expr()
    free = sa.or_(leases.c.released_at_us.is_not(None), leases.c.expires_at_us <= now)
    if guarded:
        free = sa.and_(free, leases.c.attempt == sa.bindparam("match_attempt"))
    return (
        leases.update()
        .where(_matched_key(), free)
        .values(
            attempt=leases.c.attempt + 1,
            holder=sa.bindparam("set_holder"),
            acquired_at_us=now,
            expires_at_us=now + sa.bindparam("ttl_us", type_=sa.BigInteger()),
            released_at_us=None,
        )
        .returning(*_granted(chain_head))
    )


def _first_grant_statement(db: Database, chain_head: bool) -> sa.Insert:
    """A subject's first grant, ``INSERT … ON CONFLICT DO NOTHING RETURNING`` (its values:
    ``first_grant_parameters``; ``chain_head``: see ``_granted``)."""
    now = db.now_us_expr()
    given = {name: sa.bindparam(f"lease_{name}", type_=leases.c[name].type) for name in ("module", "subject_id",
             "attempt", "holder")}  # fmt: skip
    ttl = sa.bindparam("lease_ttl_us", type_=sa.BigInteger())
    return (
        insert_if_absent(db.dialect, leases, ["module", "subject_id"])
        .values(**given, acquired_at_us=now, expires_at_us=now + ttl)
        .returning(*_granted(chain_head))
    )


def _release_statement(db: Database) -> sa.Update:
    return (
        leases.update()
        .where(_matched_key(), leases.c.attempt == sa.bindparam("match_attempt"), leases.c.released_at_us.is_(None))
        .values(released_at_us=db.now_us_expr())
        .returning(leases.c.attempt)
    )


def heartbeat(conn: Connection, db: Database, module: str, subject_id: str, attempt: int, ttl_s: float) -> int:
    """Extend a live lease; return the new expiry. A stale or expired attempt raises StaleAttempt."""
    now = db.now_us_expr()
    row = conn.execute(
        leases.update()
        .where(
            _key(module, subject_id),
            leases.c.attempt == attempt,
            leases.c.released_at_us.is_(None),
            leases.c.expires_at_us > now,
        )
        .values(expires_at_us=now + ttl_us(ttl_s))
        .returning(leases.c.expires_at_us)
    ).one_or_none()
    if row is None:
        raise StaleAttempt(f"heartbeat refused: attempt {attempt} of {module}/{subject_id} is no longer live")
    return int(row.expires_at_us)


def release(conn: Connection, db: Database, module: str, subject_id: str, attempt: int) -> None:
    """Release the lease of a live attempt (inside its fenced terminal transaction)."""
    row = conn.execute(db.statement(_release_statement), release_parameters(module, subject_id, attempt)).one_or_none()
    released(0 if row is None else 1, module, subject_id, attempt)


def released_cte(db: Database) -> sa.CTE:
    """:func:`release`'s statement as a data-modifying CTE, for a PostgreSQL statement of another module
    that releases the lease with its own writes (a transition's): its values are
    :func:`release_parameters`, and the statement hands the count of rows it returned to :func:`released`."""
    return _release_statement(db).cte("released_lease")


def release_parameters(module: str, subject_id: str, attempt: int) -> dict[str, Any]:
    """The values of :func:`release`'s (and :func:`released_cte`'s) bind parameters."""
    return _match(module, subject_id, attempt)


def released(count: int, module: str, subject_id: str, attempt: int) -> None:
    """StaleAttempt unless a release changed the lease row (``count``: the rows it returned)."""
    if count != 1:
        raise StaleAttempt(f"release refused: attempt {attempt} of {module}/{subject_id} is not the current lease")


def close_expired(conn: Connection, db: Database, module: str, subject_id: str, attempt: int) -> bool:
    """Mark an expired, unreleased lease as released so exactly one sweeper decides its outcome.

    Returns False when another sweeper, a heartbeat or a new attempt got there first.
    """
    row = conn.execute(
        leases.update()
        .where(
            _key(module, subject_id),
            leases.c.attempt == attempt,
            leases.c.released_at_us.is_(None),
            leases.c.expires_at_us <= db.now_us_expr(),
        )
        .values(released_at_us=db.now_us_expr())
        .returning(leases.c.attempt)
    ).one_or_none()
    return row is not None


def list_expired(conn: Connection, db: Database, module: str, limit: int = EXPIRED_BATCH_MAX) -> list[ExpiredLease]:
    """Unreleased leases whose expiry has passed on the database clock, oldest first."""
    rows = conn.execute(
        sa.select(leases.c.subject_id, leases.c.attempt, leases.c.holder, leases.c.expires_at_us)
        .where(
            leases.c.module == module,
            leases.c.released_at_us.is_(None),
            leases.c.expires_at_us <= db.now_us_expr(),
        )
        .order_by(leases.c.expires_at_us)
        .limit(min(limit, EXPIRED_BATCH_MAX))
    ).all()
    return [ExpiredLease(module, r.subject_id, int(r.attempt), r.holder, int(r.expires_at_us)) for r in rows]


HOLDER_LOCK_NAMESPACE = "durable-dataflow.holder:"


def holder_key(holder: sa.ColumnElement[str] | str) -> sa.ColumnElement[int]:
    """The advisory lock key of a holder id (core/holders.py): a 64-bit hash of the namespaced id."""
    value = holder if isinstance(holder, sa.ColumnElement) else sa.literal(holder, sa.String())
    return sa.func.hashtextextended(sa.literal(HOLDER_LOCK_NAMESPACE, sa.String()) + value, 0)


def _dead_holder(db: Database) -> sa.ColumnElement[bool]:
    """SQL (PostgreSQL): a live, unreleased lease whose holder's session has ended (core/holders.py): it was
    granted after the server started, and its holder's advisory lock can be taken (for this transaction)."""
    # A server restart ends every session, live holders' too: only a lease granted since the server
    # started was taken while its holder held the lock (both clocks shifted alike by tests' offsets).
    started_us = sa.cast(sa.func.extract("epoch", sa.func.pg_postmaster_start_time()) * 1_000_000, sa.BigInteger)
    return sa.and_(
        leases.c.released_at_us.is_(None),
        leases.c.expires_at_us > db.now_us_expr(),
        leases.c.acquired_at_us > started_us + int(db.clock_offset_s * 1_000_000),
        sa.func.pg_try_advisory_xact_lock(holder_key(leases.c.holder)),
    )


def list_dead_holders(
    conn: Connection, db: Database, module: str, limit: int = EXPIRED_BATCH_MAX
) -> list[ExpiredLease]:
    """Unexpired leases whose holder process is gone (PostgreSQL; none on SQLite, where the TTL decides)."""
    if db.dialect != "postgresql":
        return []
    rows = conn.execute(
        sa.select(leases.c.subject_id, leases.c.attempt, leases.c.holder, leases.c.expires_at_us)
        .where(leases.c.module == module, _dead_holder(db))
        .order_by(leases.c.acquired_at_us)
        .limit(min(limit, EXPIRED_BATCH_MAX))
    ).all()
    return [ExpiredLease(module, r.subject_id, int(r.attempt), r.holder, int(r.expires_at_us)) for r in rows]


def close_dead_holder(conn: Connection, db: Database, module: str, subject_id: str, attempt: int) -> bool:
    """Close a live lease whose holder is gone, as :func:`close_expired` closes an expired one (False when
    the holder lives, or another sweeper, a release or a new attempt got there first)."""
    if db.dialect != "postgresql":
        return False
    row = conn.execute(
        leases.update()
        .where(_key(module, subject_id), leases.c.attempt == attempt, _dead_holder(db))
        .values(released_at_us=db.now_us_expr())
        .returning(leases.c.attempt)
    ).one_or_none()
    return row is not None


def current(conn: Connection, module: str, subject_id: str) -> Lease | None:
    """The lease row as it is now (live or not), or None when the subject was never leased."""
    row = conn.execute(sa.select(leases).where(_key(module, subject_id))).one_or_none()
    if row is None:
        return None
    return Lease(module, subject_id, int(row.attempt), row.holder, int(row.acquired_at_us), int(row.expires_at_us))


def expiry_of(conn: Connection, db: Database, module: str, subject_ids: Collection[str]) -> dict[str, LeaseExpiry]:
    """The leases of ``subject_ids`` (at most ``EXPIRY_SUBJECTS_MAX``) in one statement, each judged
    expired or not on the database clock; a subject never leased has no entry. Reads only."""
    wanted = sorted(set(subject_ids))
    if not wanted:
        return {}
    if len(wanted) > EXPIRY_SUBJECTS_MAX:
        raise InputError(f"at most {EXPIRY_SUBJECTS_MAX} subjects per lease expiry query, got {len(wanted)}")
    expired = sa.and_(leases.c.released_at_us.is_(None), leases.c.expires_at_us <= db.now_us_expr())
    rows = conn.execute(
        sa.select(
            leases.c.subject_id,
            leases.c.attempt,
            leases.c.expires_at_us,
            leases.c.released_at_us,
            sa.case((expired, 1), else_=0).label("expired"),
        ).where(leases.c.module == module, leases.c.subject_id.in_(wanted))
    ).all()
    return {
        r.subject_id: LeaseExpiry(
            r.subject_id, int(r.attempt), int(r.expires_at_us), r.released_at_us is not None, bool(r.expired)
        )
        for r in rows
    }


def expired_held(db: Database, module: str, subject_id: sa.ColumnElement[str]) -> sa.ColumnElement[bool]:
    """A condition for the caller's own statement: the subject named by ``subject_id`` (a column of the
    caller's table) holds a lease of ``module`` that expired on the database clock and that no sweeper
    has closed. The held leases are few and the partial index ``ix_leases_held_expiry`` serves them, so
    the subquery is read once, not per subject (the table keeps every released lease). Read views use
    it to derive what the next sweep will decide, in the same statement that reads or counts subjects."""
    held_expired = sa.select(leases.c.subject_id).where(
        leases.c.module == module,
        leases.c.released_at_us.is_(None),
        leases.c.expires_at_us <= db.now_us_expr(),
    )
    return subject_id.in_(held_expired)


SubjectJoin = Callable[[sa.Select[Any], sa.ColumnElement[str]], sa.Select[Any]]
"""Narrows a select of lease rows by joining the subject-id column to the caller's own table."""


def held_counts(
    conn: Connection, db: Database, *, module: str | None = None, join_subjects: SubjectJoin | None = None
) -> dict[str, tuple[int, int]]:
    """Held leases per module, ``(live, expired)`` on the database clock, in one pass over held
    leases. ``module`` keeps one module's; ``join_subjects`` narrows them by a join the caller
    builds (few leases are held: a join is cheaper than listing the caller's subjects)."""
    now = db.now_us_expr()
    live = sa.func.count().filter(leases.c.expires_at_us > now)
    expired = sa.func.count().filter(leases.c.expires_at_us <= now)
    query = sa.select(leases.c.module, live, expired).where(leases.c.released_at_us.is_(None)).group_by(leases.c.module)
    if module is not None:
        query = query.where(leases.c.module == module)
    if join_subjects is not None:
        query = join_subjects(query, leases.c.subject_id)
    return {str(m): (int(a), int(b)) for m, a, b in conn.execute(query)}
