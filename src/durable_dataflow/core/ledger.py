"""The recovery ledger: append-only, hash-chained entries per (module, subject).

Each entry's hash covers the previous entry's hash and the canonical JSON of the entry itself,
so an edited, deleted, inserted or reordered entry breaks the chain at a seq that verification
names. The first entry chains from a per-subject genesis value. When an evidence key is
configured, each entry also carries an HMAC of its hash: someone with database access but without
the key can rebuild plain hashes, but not the MACs. The key itself is never stored. A chain that
carries MACs never verifies without the key (its MACs would go unchecked), and a process whose key
setting differs from the ledger it would extend is refused before it writes
(``check_key_setting``).

While ``Database.ledger_outbox`` is on, each append also writes the entries' keys to
``ledger_outbox`` in the same transaction, so a deliverer outside (lineage, docs/lineage.md) finds
exactly the committed entries and nothing that did not commit; off, an append costs what it did.

Appends assume an open transaction whose caller already serializes writers of the subject (the
lease row lock of a fenced transaction, or the insert of a new subject); the primary key
``(module, subject_id, seq)`` refuses a racing duplicate anyway.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core import hashing
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.invariants import invariant
from durable_dataflow.core.schema import KIND_LENGTH, ledger_entries, ledger_outbox
from durable_dataflow.core.secrets import Secret

ENTRIES_PER_SUBJECT_MAX = 10_000
PAYLOAD_BYTES_MAX = 256 * 1024
MODULES_SAMPLED_MAX = 16  # check_key_setting reads one entry per module, for at most this many modules
KEY_NAME = "DATAFLOW_EVIDENCE_KEY"
KEYED_UNCHECKED_REASON = f"keyed entries not checked: set {KEY_NAME} to verify their MACs"


@dataclass(frozen=True)
class Entry:
    """One ledger entry as stored."""

    module: str
    subject_id: str
    seq: int
    attempt: int
    kind: str
    payload: Mapping[str, Any]
    prev_hash: str
    entry_hash: str
    entry_mac: str | None
    recorded_at_us: int

    def body(self) -> dict[str, Any]:
        """The part of the entry its hash covers (everything but the hashes themselves)."""
        return entry_body(
            self.module, self.subject_id, self.seq, self.attempt, self.kind, self.payload, self.recorded_at_us
        )


@dataclass(frozen=True)
class Head:
    """A subject's last entry as the caller's transaction read it (``seq`` and ``entry_hash`` None: an
    empty chain), and the database clock read by the same statement: the time of the entries appended
    after it."""

    seq: int | None
    entry_hash: str | None
    now_us: int


@dataclass(frozen=True)
class Verification:
    """The result of verifying one subject's chain. ``broken_seq`` names the first bad entry."""

    ok: bool
    head_seq: int
    head_hash: str
    entry_count: int
    keyed: bool
    broken_seq: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class HeldChain:
    """A subject's chain as the caller's write transaction holds it, so nothing of it is read twice.

    ``entries`` were read under the lock that serializes the subject's writers (the fence statement,
    ``core.fencing.fenced_chain``), followed by what this transaction appended since; ``now_us`` is
    the database clock that statement read (the time of this transaction's entries) and
    ``verified_head`` the ``(seq, hash)`` of the subject's latest checkpoint, read alongside.
    Rows a transaction inserted itself cannot change before it commits, so verifying them as
    written is verifying them as stored.
    """

    module: str
    subject_id: str
    entries: tuple[Entry, ...]
    now_us: int
    verified_head: tuple[int, str] | None

    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last entry; ``(0, genesis)`` for an empty chain."""
        if not self.entries:
            return 0, genesis_hash(self.module, self.subject_id)
        return self.entries[-1].seq, self.entries[-1].entry_hash

    def extended(self, appended: Sequence[Entry]) -> HeldChain:
        return HeldChain(self.module, self.subject_id, (*self.entries, *appended), self.now_us, self.verified_head)


def genesis_hash(module: str, subject_id: str) -> str:
    """The value the first entry of a subject chains from."""
    return hashing.digest({"genesis": "durable-dataflow/ledger/v1", "module": module, "subject": subject_id})


def entry_body(
    module: str,
    subject_id: str,
    seq: int,
    attempt: int,
    kind: str,
    payload: Mapping[str, Any],
    recorded_at_us: int,
) -> dict[str, Any]:
    return {
        "module": module,
        "subject_id": subject_id,
        "seq": seq,
        "attempt": attempt,
        "kind": kind,
        "payload": dict(payload),
        "recorded_at_us": recorded_at_us,
    }


def chain_hash(prev_hash: str, body: Mapping[str, Any]) -> str:
    """``sha256(prev_hash ‖ canonical(body))``."""
    return hashing.sha256_bytes(prev_hash.encode("ascii") + b"\n" + hashing.canonical_json(dict(body)))


def entry_mac(key: Secret, entry_hash: str) -> str:
    """The keyed MAC of an entry hash, ``hmac-sha256:<hex>``-shaped as ``sha256:<hex>``."""
    mac = hmac.new(key.reveal().encode("utf-8"), entry_hash.encode("ascii"), hashlib.sha256)
    return hashing.PREFIX + mac.hexdigest()


def append(
    conn: Connection,
    db: Database,
    module: str,
    subject_id: str,
    attempt: int,
    kind: str,
    payload: Mapping[str, Any],
    *,
    evidence_key: Secret | None = None,
) -> Entry:
    """Append one entry to the subject's chain inside the caller's transaction."""
    return append_many(conn, db, module, subject_id, [(attempt, kind, payload)], evidence_key=evidence_key)[-1]


def append_many(
    conn: Connection,
    db: Database,
    module: str,
    subject_id: str,
    items: Sequence[tuple[int, str, Mapping[str, Any]]],
    *,
    evidence_key: Secret | None = None,
    new_subject_at_us: int | None = None,
    held: HeldChain | None = None,
    head: Head | None = None,
) -> list[Entry]:
    """Append entries ``(attempt, kind, payload)`` in order: one head-and-clock read, one insert.

    ``new_subject_at_us`` is for a subject created in the caller's transaction: the chain is empty,
    and the given database time (read in that transaction) is the entries' time, so nothing is read.
    ``held`` is the chain the caller's transaction already read under the subject's lock: its head
    and clock are used, so nothing is read either. ``head`` is the head a statement of the caller's
    read while it held a lock every writer of the subject takes (``head_columns``: the claim's lease
    grant, under the run row), so nothing is read either; a stale one fails on the primary key.
    """
    if not items:
        raise InputError("append_many needs at least one entry")
    invariant(
        (new_subject_at_us is not None) + (held is not None) + (head is not None) <= 1,
        "an append starts from one head: a new subject's, a held chain's or one read with the caller's lock",
    )
    if new_subject_at_us is not None:
        return _insert_chained(conn, db, module, subject_id, items, 0, genesis_hash(module, subject_id),
                               new_subject_at_us, evidence_key)  # fmt: skip
    if held is not None:
        seq, prev_hash = _held_head(held, module, subject_id, len(items))
        return _insert_chained(conn, db, module, subject_id, items, seq, prev_hash, held.now_us, evidence_key)
    if head is None:
        read = conn.execute(db.statement(_head_statement), head_parameters(module, subject_id)).one()
        head = Head(None if read.seq is None else int(read.seq), read.entry_hash, int(read.now_us))
    seq = 0 if head.seq is None else head.seq
    _check_room(module, subject_id, seq, len(items))
    prev_hash = genesis_hash(module, subject_id) if head.seq is None else str(head.entry_hash)
    return _insert_chained(conn, db, module, subject_id, items, seq, prev_hash, head.now_us, evidence_key)


def _held_head(held: HeldChain, module: str, subject_id: str, count: int) -> tuple[int, str]:
    """The held chain's head, to append ``count`` entries after; InputError when it is another subject's
    chain or the entries would pass the subject's bound."""
    if (held.module, held.subject_id) != (module, subject_id):
        raise InputError(f"the held chain is {held.module}/{held.subject_id}, not {module}/{subject_id}")
    seq, prev_hash = held.head()
    _check_room(module, subject_id, seq, count)
    return seq, prev_hash


def _check_room(module: str, subject_id: str, seq: int, count: int) -> None:
    """InputError when ``count`` entries after ``seq`` would pass the subject's entry bound."""
    if seq + count > ENTRIES_PER_SUBJECT_MAX:
        raise InputError(f"subject {module}/{subject_id} reached {ENTRIES_PER_SUBJECT_MAX} ledger entries")


def head_columns() -> tuple[sa.ScalarSelect[int], sa.ScalarSelect[str]]:
    """The last entry of the subject named by the bind parameters ``head_module`` and ``head_subject_id``
    (``head_parameters``), as two scalar subqueries ``(seq, entry_hash)``, NULL for an empty chain: for a
    statement of another module that reads the head in its own round trip (the claim's lease grant,
    core.leases), which then passes it to ``append_many`` as ``head``."""
    subject = (
        ledger_entries.c.module == sa.bindparam("head_module"),
        ledger_entries.c.subject_id == sa.bindparam("head_subject_id"),
    )

    def last(column: sa.ColumnElement[Any]) -> sa.ScalarSelect[Any]:
        return sa.select(column).where(*subject).order_by(ledger_entries.c.seq.desc()).limit(1).scalar_subquery()

    return last(ledger_entries.c.seq), last(ledger_entries.c.entry_hash)


def head_parameters(module: str, subject_id: str) -> dict[str, str]:
    """The values of ``head_columns``'s bind parameters."""
    return {"head_module": module, "head_subject_id": subject_id}


def _head_statement(db: Database) -> sa.Select[int, int, str]:
    """The subject's head ``(seq, entry_hash)`` (NULLs for an empty chain) and the database clock,
    in one round trip."""
    seq, entry_hash = head_columns()
    return sa.select(db.now_us_expr().label("now_us"), seq.label("seq"), entry_hash.label("entry_hash"))


def _insert_chained(
    conn: Connection,
    db: Database,
    module: str,
    subject_id: str,
    items: Sequence[tuple[int, str, Mapping[str, Any]]],
    seq: int,
    prev_hash: str,
    recorded_at_us: int,
    evidence_key: Secret | None,
) -> list[Entry]:
    entries, rows = _chain(module, subject_id, items, seq, prev_hash, recorded_at_us, evidence_key)
    conn.execute(_INSERT_ENTRIES, rows)
    if db.ledger_outbox:
        conn.execute(_INSERT_OUTBOX, [_outbox_row(entry) for entry in entries])
    return entries


def _chain(
    module: str,
    subject_id: str,
    items: Sequence[tuple[int, str, Mapping[str, Any]]],
    seq: int,
    prev_hash: str,
    recorded_at_us: int,
    evidence_key: Secret | None,
) -> tuple[list[Entry], list[dict[str, Any]]]:
    entries: list[Entry] = []
    rows: list[dict[str, Any]] = []
    for attempt, kind, payload in items:
        seq += 1
        entry, payload_json = _chained(
            module, subject_id, seq, attempt, kind, payload, prev_hash, recorded_at_us, evidence_key
        )
        entries.append(entry)
        rows.append(_row(entry, payload_json))
        prev_hash = entry.entry_hash
    return entries, rows


def _outbox_row(entry: Entry) -> dict[str, Any]:
    return {"module": entry.module, "subject_id": entry.subject_id, "seq": entry.seq}


_INSERT_ENTRIES = ledger_entries.insert()  # built once: every run appends through it
_INSERT_OUTBOX = ledger_outbox.insert()


@dataclass(frozen=True)
class PendingEntries:
    """Entries chained and not yet written: :func:`entries_ctes` writes them inside another module's
    PostgreSQL statement, so they cost no round trip of their own. A new subject's first entries
    (:func:`first_entries`) go into the INSERT of the subject; a held chain's next ones
    (:func:`held_entries`) into the statement of the transition that appends them."""

    entries: list[Entry]
    parameters: dict[str, Any]  # the values of entries_ctes's bind parameters
    outbox: bool  # whether their outbox rows are written too (``Database.ledger_outbox`` when prepared)


def first_entries(
    db: Database,
    module: str,
    subject_id: str,
    items: Sequence[tuple[int, str, Mapping[str, Any]]],
    recorded_at_us: int,
    *,
    evidence_key: Secret | None = None,
) -> PendingEntries:
    """``items`` as a new subject's first entries at ``recorded_at_us`` (the caller's database time),
    as ``append_many(..., new_subject_at_us=...)`` would write them."""
    if not items:
        raise InputError("first_entries needs at least one entry")
    return _pending(db, module, subject_id, items, 0, genesis_hash(module, subject_id), recorded_at_us, evidence_key)


def held_entries(
    db: Database,
    module: str,
    subject_id: str,
    items: Sequence[tuple[int, str, Mapping[str, Any]]],
    held: HeldChain,
    *,
    evidence_key: Secret | None = None,
) -> PendingEntries:
    """``items`` after the held chain's head at its clock, as ``append_many(..., held=held)`` would write
    them (the caller's statement inserts them: :func:`entries_ctes`)."""
    if not items:
        raise InputError("held_entries needs at least one entry")
    seq, prev_hash = _held_head(held, module, subject_id, len(items))
    return _pending(db, module, subject_id, items, seq, prev_hash, held.now_us, evidence_key)


def _pending(
    db: Database,
    module: str,
    subject_id: str,
    items: Sequence[tuple[int, str, Mapping[str, Any]]],
    seq: int,
    prev_hash: str,
    recorded_at_us: int,
    evidence_key: Secret | None,
) -> PendingEntries:
    entries, rows = _chain(module, subject_id, items, seq, prev_hash, recorded_at_us, evidence_key)
    parameters = {f"entry{i}_{name}": value for i, row in enumerate(rows) for name, value in row.items()}
    outbox = db.ledger_outbox
    if outbox:
        kept = (_outbox_row(entry) for entry in entries)
        parameters.update({f"outbox{i}_{name}": value for i, row in enumerate(kept) for name, value in row.items()})
    return PendingEntries(entries, parameters, outbox)


def entries_ctes(count: int, outbox: bool) -> tuple[sa.CTE, ...]:
    """The INSERTs of ``count`` pending entries (and, with ``outbox``, their outbox rows) as data-modifying
    CTEs, for another module's PostgreSQL statement (which adds them with ``add_cte``); their values are
    :class:`PendingEntries`'s ``parameters``, and ``count`` and ``outbox`` its ``entries``' length and
    ``outbox``. Build it through ``Database.statement`` with both in its shape."""
    tables = (ledger_entries, ledger_outbox) if outbox else (ledger_entries,)
    # one single-row INSERT per row: SQLAlchemy caches its compiled form, not a multi-row VALUES's
    return tuple(
        table.insert().values({c.name: sa.bindparam(f"{prefix}{i}_{c.name}", type_=c.type) for c in table.c})
        .cte(f"pending_{prefix}_{i}")
        for table, prefix in zip(tables, ("entry", "outbox"), strict=False)
        for i in range(count)
    )  # fmt: skip


def _chained(
    module: str,
    subject_id: str,
    seq: int,
    attempt: int,
    kind: str,
    payload: Mapping[str, Any],
    prev_hash: str,
    recorded_at_us: int,
    key: Secret | None,
) -> tuple[Entry, str]:
    if not kind or len(kind) > KIND_LENGTH:
        raise InputError(f"ledger entry kind must be 1 to {KIND_LENGTH} characters, got {kind!r}")
    payload_json = hashing.canonical_json(dict(payload)).decode("utf-8")
    if len(payload_json) > PAYLOAD_BYTES_MAX:
        raise InputError(f"ledger entry payload is {len(payload_json)} bytes, over {PAYLOAD_BYTES_MAX}")
    stored_payload = json.loads(payload_json)  # exactly what a reader will see, so the hash verifies
    body = entry_body(module, subject_id, seq, attempt, kind, stored_payload, recorded_at_us)
    this_hash = chain_hash(prev_hash, body)
    mac = entry_mac(key, this_hash) if key is not None else None
    entry = Entry(module, subject_id, seq, attempt, kind, stored_payload, prev_hash, this_hash, mac, recorded_at_us)
    return entry, payload_json


def _row(entry: Entry, payload_json: str) -> dict[str, Any]:
    return {
        "module": entry.module,
        "subject_id": entry.subject_id,
        "seq": entry.seq,
        "attempt": entry.attempt,
        "kind": entry.kind,
        "payload_json": payload_json,
        "prev_hash": entry.prev_hash,
        "entry_hash": entry.entry_hash,
        "entry_mac": entry.entry_mac,
        "recorded_at_us": entry.recorded_at_us,
    }


def read(conn: Connection, module: str, subject_id: str) -> list[Entry]:
    """All entries of one subject, in seq order."""
    rows = conn.execute(
        sa.select(ledger_entries)
        .where(ledger_entries.c.module == module, ledger_entries.c.subject_id == subject_id)
        .order_by(ledger_entries.c.seq)
        .limit(ENTRIES_PER_SUBJECT_MAX + 1)
    ).all()
    return [_entry_from_row(row) for row in rows]


def chain_outerjoin(
    query: sa.Select[Any], module: str | sa.ColumnElement[str], subject_id: str | sa.ColumnElement[str]
) -> sa.Select[Any]:
    """``query`` (one row) outer-joined to every entry of the subject (values or bind parameters), in
    seq order: each row carries one entry's columns (NULL when the chain is empty). Read them back
    with :func:`entries_of_rows`; the caller's own columns must not be named like the entry columns."""
    on = sa.and_(ledger_entries.c.module == module, ledger_entries.c.subject_id == subject_id)
    return (
        query.add_columns(*ledger_entries.c)
        .outerjoin(ledger_entries, on)
        .order_by(ledger_entries.c.seq)
        .limit(ENTRIES_PER_SUBJECT_MAX + 1)
    )


def entries_of_rows(rows: Sequence[sa.Row[Any]]) -> list[Entry]:
    """The entries of rows read with :func:`chain_outerjoin` (none for an empty chain)."""
    return [_entry_from_row(row) for row in rows if row.seq is not None]


UNREADABLE_PAYLOAD = {"unreadable_payload": True}


def _payload_of(text: str) -> Mapping[str, Any]:
    """A stored payload; one that is not a JSON object (damaged or edited by hand) reads as
    ``UNREADABLE_PAYLOAD``, whose hash matches no stored entry, so verification names its seq."""
    try:
        payload = json.loads(text)
    except (TypeError, ValueError):
        return dict(UNREADABLE_PAYLOAD)
    return payload if isinstance(payload, dict) else dict(UNREADABLE_PAYLOAD)


def _entry_from_row(row: sa.Row[Any]) -> Entry:
    return Entry(
        module=row.module,
        subject_id=row.subject_id,
        seq=int(row.seq),
        attempt=int(row.attempt),
        kind=row.kind,
        payload=_payload_of(row.payload_json),
        prev_hash=row.prev_hash,
        entry_hash=row.entry_hash,
        entry_mac=row.entry_mac,
        recorded_at_us=int(row.recorded_at_us),
    )


def verify_entries(
    entries: Sequence[Entry],
    module: str,
    subject_id: str,
    *,
    evidence_key: Secret | None = None,
    expected_head: tuple[int, str] | None = None,
) -> Verification:
    """Recompute the chain from genesis and check contiguity, hashes, MACs and a known head.

    ``expected_head`` is a (seq, hash) pair recorded earlier (a checkpoint): the chain must still
    contain it, which catches a deleted tail that the chain alone cannot show. Without a key, a chain
    holding any entry with a MAC does not verify (``KEYED_UNCHECKED_REASON``, no ``broken_seq``):
    its MACs would go unchecked. With a key, every entry must carry a MAC that verifies.
    """
    prev_hash = genesis_hash(module, subject_id)
    keyed = evidence_key is not None
    for index, entry in enumerate(entries):
        problem = _entry_problem(entry, index + 1, prev_hash, module, subject_id, evidence_key)
        if problem:
            return Verification(False, index, prev_hash, len(entries), keyed, entry.seq, problem)
        prev_hash = entry.entry_hash
    head_seq = len(entries)
    if expected_head is not None:
        seq, expected_hash = expected_head
        if seq > head_seq or entries[seq - 1].entry_hash != expected_hash:
            reason = f"the chain no longer holds the checkpointed head at seq {seq}: entries were removed or replaced"
            return Verification(False, head_seq, prev_hash, len(entries), keyed, seq, reason)
    if not keyed and any(entry.entry_mac is not None for entry in entries):
        # The plain chain holds, but its MACs are what someone with database access cannot forge:
        # without the key nothing proves the entries were not rebuilt, so this is not "verified".
        return Verification(False, head_seq, prev_hash, len(entries), True, None, KEYED_UNCHECKED_REASON)
    return Verification(True, head_seq, prev_hash, len(entries), keyed)


def _entry_problem(
    entry: Entry, expected_seq: int, prev_hash: str, module: str, subject_id: str, key: Secret | None
) -> str:
    if entry.module != module or entry.subject_id != subject_id:
        return f"entry seq {entry.seq} belongs to another subject"
    if entry.seq != expected_seq:
        return f"seq {expected_seq} is missing or out of order (found {entry.seq}): entries deleted or inserted"
    if entry.prev_hash != prev_hash:
        return f"entry seq {entry.seq} does not chain from seq {entry.seq - 1}: entries inserted, removed or reordered"
    if chain_hash(prev_hash, entry.body()) != entry.entry_hash:
        return f"entry seq {entry.seq} was edited: its content no longer matches its hash"
    if key is not None and (
        entry.entry_mac is None or not hmac.compare_digest(entry.entry_mac, entry_mac(key, entry.entry_hash))
    ):
        return (
            f"entry seq {entry.seq} fails its keyed MAC: it was written or rewritten without the evidence key"
        )
    return ""


def verify(
    conn: Connection,
    module: str,
    subject_id: str,
    *,
    evidence_key: Secret | None = None,
    expected_head: tuple[int, str] | None = None,
) -> Verification:
    """Read and verify one subject's chain inside the caller's transaction."""
    entries = read(conn, module, subject_id)
    return verify_entries(entries, module, subject_id, evidence_key=evidence_key, expected_head=expected_head)


def newest_entries(conn: Connection) -> list[Entry]:
    """The head entry of the last subject of each module (at most ``MODULES_SAMPLED_MAX`` modules).

    Each is one backward step of the primary key ``(module, subject_id, seq)``: a bounded, indexed
    read however large the ledger is. Dataflow's subjects are time-ordered UUIDv7 run ids, so its
    last subject is its newest run.
    """
    found: list[Entry] = []
    below: str | None = None
    for _ in range(MODULES_SAMPLED_MAX):
        query = sa.select(ledger_entries)
        if below is not None:
            query = query.where(ledger_entries.c.module < below)
        row = conn.execute(
            query.order_by(
                ledger_entries.c.module.desc(), ledger_entries.c.subject_id.desc(), ledger_entries.c.seq.desc()
            ).limit(1)
        ).first()
        if row is None:
            break
        found.append(_entry_from_row(row))
        below = row.module
    return found


def _head_entry(conn: Connection, module: str, subject_id: str) -> list[Entry]:
    row = conn.execute(
        sa.select(ledger_entries)
        .where(ledger_entries.c.module == module, ledger_entries.c.subject_id == subject_id)
        .order_by(ledger_entries.c.seq.desc())
        .limit(1)
    ).first()
    return [] if row is None else [_entry_from_row(row)]


def check_key_setting(
    conn: Connection, evidence_key: Secret | None, *, subject: tuple[str, str] | None = None
) -> str:
    """Why a process with this evidence-key setting must not extend the ledger, or "" when it may.

    The ledger is keyed when its newest entry (``newest_entries``; or the head of ``subject``, a
    ``(module, subject_id)`` chain the caller is about to extend) carries a MAC. Without a key, a
    keyed ledger is refused; with a key, an unkeyed ledger is refused, and so is a keyed one whose
    newest MAC this key does not reproduce (another key). An empty ledger accepts either setting.
    Entries written under the other setting would make a run's chain fail verification, and a run
    would end ``evidence_failed`` after it published. The message never contains the key.
    """
    sample = newest_entries(conn) if subject is None else _head_entry(conn, *subject)
    if not sample:
        return ""
    newest = max(sample, key=lambda entry: entry.recorded_at_us)
    scope = "the platform database's ledger" if subject is None else f"the chain of {subject[0]}/{subject[1]}"
    where = f"its newest entry, {newest.module}/{newest.subject_id} seq {newest.seq}"
    docs = 'docs/operations.md, "The evidence key"'
    if evidence_key is None:
        if newest.entry_mac is None:
            return ""
        return (
            f"{scope} is keyed ({where}, carries a MAC) but {KEY_NAME} is not set: entries written without "
            f"the key would not verify, and a run would end evidence_failed after publishing. Set {KEY_NAME} "
            f"to the key {scope} is written with ({docs})"
        )
    if newest.entry_mac is None:
        return (
            f"{KEY_NAME} is set but {scope} is not keyed ({where}, carries no MAC): entries written with the "
            f"key would not verify, and a run would end evidence_failed after publishing. Unset {KEY_NAME}, "
            f"or adopt the key as {docs} describes"
        )
    if not hmac.compare_digest(newest.entry_mac, entry_mac(evidence_key, newest.entry_hash)):
        return (
            f"{KEY_NAME} does not reproduce the MAC of {scope} ({where}): it is not the key {scope} is "
            f"written with. Set that key, or rotate keys as {docs} describes"
        )
    return ""


def require_key_setting(
    db: Database, evidence_key: Secret | None, *, subject: tuple[str, str] | None = None
) -> None:
    """Raise ``InputError`` (exit 2 in the CLI) with ``check_key_setting``'s problem, if any."""
    with db.read() as conn:
        problem = check_key_setting(conn, evidence_key, subject=subject)
    if problem:
        raise InputError(problem)


# ---- read-only counts and lookups for read views and the Ops projection ------------------------


def has_kind(module: str, subject_id: sa.ColumnElement[str], kind: str) -> sa.ColumnElement[bool]:
    """A condition for the caller's own statement: the chain of the subject named by ``subject_id`` (a
    column of the caller's table, correlated) holds at least one entry of ``kind``. The primary key's
    ``(module, subject_id)`` prefix serves it: one subject's chain is read, never the whole ledger. It is
    a scalar subquery on purpose: PostgreSQL may run an ``EXISTS`` as one hashed subplan, a scan of
    every entry of every subject, where the caller asks about a handful of subjects."""
    first = (
        sa.select(ledger_entries.c.seq)
        .where(
            ledger_entries.c.module == module,
            ledger_entries.c.subject_id == subject_id,
            ledger_entries.c.kind == kind,
        )
        .limit(1)
        .correlate_except(ledger_entries)
        .scalar_subquery()
    )
    return first.is_not(None)


# The most subjects :func:`first_payloads_of_kind` asks about in one statement.
KIND_SUBJECTS_PER_QUERY_MAX = 500


def first_payloads_of_kind(
    conn: Connection, module: str, subject_ids: Sequence[str], kind: str
) -> dict[str, Mapping[str, Any]]:
    """The payload of the first entry of ``kind`` in each subject's chain that has one (a read view's
    facts about a page of subjects, such as the partition token each run's dispatch authorization took).
    Read in statements of at most ``KIND_SUBJECTS_PER_QUERY_MAX`` subjects; the primary key serves each."""
    found: dict[str, Mapping[str, Any]] = {}
    wanted = sorted(set(subject_ids))
    for start in range(0, len(wanted), KIND_SUBJECTS_PER_QUERY_MAX):
        chunk = wanted[start : start + KIND_SUBJECTS_PER_QUERY_MAX]
        rows = conn.execute(
            sa.select(ledger_entries.c.subject_id, ledger_entries.c.payload_json)
            .where(
                ledger_entries.c.module == module,
                ledger_entries.c.subject_id.in_(chunk),
                ledger_entries.c.kind == kind,
            )
            .order_by(ledger_entries.c.subject_id, ledger_entries.c.seq)
        ).all()
        for row in rows:
            found.setdefault(row.subject_id, _payload_of(row.payload_json))
    return found


def kind_counts(conn: Connection, module: str) -> dict[str, int]:
    """The number of a module's entries per kind."""
    query = (
        sa.select(ledger_entries.c.kind, sa.func.count())
        .where(ledger_entries.c.module == module)
        .group_by(ledger_entries.c.kind)
    )
    return {str(kind): int(count) for kind, count in conn.execute(query)}


def subject_and_entry_counts(
    conn: Connection,
    *,
    count_entries: bool,
    exclude_module: str | None = None,
    module: str | None = None,
    subjects: sa.Select[tuple[str]] | None = None,
) -> dict[str, tuple[int, int | None]]:
    """Per module, ``(subjects, entries)``: subjects are their first entries (seq 1, a small partial
    index); counting every entry scans the whole ledger, so entries are None unless
    ``count_entries``. ``exclude_module`` leaves a module out; ``module`` with ``subjects`` (a
    select of subject ids) counts only those subjects of that module."""
    first = ledger_entries.c.seq == 1
    if count_entries:
        query = sa.select(ledger_entries.c.module, sa.func.count().filter(first), sa.func.count())
    else:
        query = sa.select(ledger_entries.c.module, sa.func.count(), sa.null()).where(first)
    if exclude_module is not None:
        query = query.where(ledger_entries.c.module != exclude_module)
    if module is not None and subjects is not None:
        query = query.where(ledger_entries.c.module == module, ledger_entries.c.subject_id.in_(subjects))
    rows = conn.execute(query.group_by(ledger_entries.c.module)).all()
    return {str(m): (int(n), None if e is None else int(e)) for m, n, e in rows}


# ---- the outbox: keys of committed entries awaiting delivery outside ---------------------------

OUTBOX_BATCH_MAX = 1000  # the most keys one call of pending_outbox returns

OutboxKey = tuple[str, str, int]  # (module, subject_id, seq): the entry's primary key


def pending_outbox(conn: Connection, limit: int, *, skip_locked: bool = False) -> list[OutboxKey]:
    """The oldest keys in the outbox (by module, subject, seq), at most ``limit`` (capped at
    ``OUTBOX_BATCH_MAX``). ``skip_locked`` (PostgreSQL, inside a write transaction) locks the keys it
    returns and skips those another deliverer holds, so several deliverers share the work."""
    query = (
        sa.select(ledger_outbox.c.module, ledger_outbox.c.subject_id, ledger_outbox.c.seq)
        .order_by(ledger_outbox.c.module, ledger_outbox.c.subject_id, ledger_outbox.c.seq)
        .limit(max(0, min(limit, OUTBOX_BATCH_MAX)))
    )
    if skip_locked:
        query = query.with_for_update(skip_locked=True)
    return [(str(row.module), str(row.subject_id), int(row.seq)) for row in conn.execute(query)]


def delete_outbox(conn: Connection, keys: Sequence[OutboxKey]) -> int:
    """Delete delivered keys; the number deleted (a key another deliverer deleted first counts 0)."""
    deleted = 0
    for module, subject_id, seq in keys:
        result = conn.execute(
            sa.delete(ledger_outbox).where(
                ledger_outbox.c.module == module, ledger_outbox.c.subject_id == subject_id, ledger_outbox.c.seq == seq
            )
        )
        deleted += int(result.rowcount or 0)
    return deleted


def outbox_count(conn: Connection) -> int:
    """The number of keys awaiting delivery."""
    return int(conn.execute(sa.select(sa.func.count()).select_from(ledger_outbox)).scalar_one())

