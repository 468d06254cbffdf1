"""Read views of runs: what the CLI, the JSON API and the web pages show, derived once, here.

A run's projection says what the last committed transaction made of it. A read view adds what the
projection cannot say by itself: an attempt whose lease has expired on the database clock and that
no sweeper has decided yet (the sweeper runs in ``dataflow worker`` and ``dataflow serve``; with
neither running, such a run stays ``running`` for good). The view predicts the sweeper's decision
by the sweeper's rule (``dataflow.protocol.sweeper``): a dispatch authorization anywhere in the run's history
means external output may exist, so the run is shown **unresolved** with a warning; otherwise the
attempt is proven absent and the warning says the next sweep retries it (or, with no attempt left,
fails it). Views only read: deciding is the sweeper's, in its own fenced transaction.

Also here, once, for every reader: the ledger-entry JSON, the warning of a run, the time and age
texts. Their outputs are documented forms (docs/cli.md, docs/api.md) and stay byte-identical.

**One door for reads.** The CLI (`runs`, `show`, `verify`), the JSON API (`GET /v1/runs`,
`/v1/runs/{id}`, `/v1/runs/{id}/evidence`, the run in every answer) and the web pages read runs and
their evidence only through the functions at the end of this module. Each returns a frozen value with
one ``as_json()``, so the same run is the same JSON everywhere; a reader adds only its envelope
(``{"run": ...}``) and its rendering. The Ops projection has its own door, ``ops.ledger.read_projection``
(ops sits above dataflow and reads through this module).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from sqlalchemy.engine import Connection

from durable_dataflow.core import checkpoints, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.invariants import invariant
from durable_dataflow.core.units import US_PER_S
from durable_dataflow.dataflow.definitions import catalog
from durable_dataflow.dataflow.protocol import derivation, evidence, runs
from durable_dataflow.dataflow.protocol.runs import MODULE, RecoveryStatus, Run, RunStatus
from durable_dataflow.dataflow.protocol.transition_table import TABLE

if TYPE_CHECKING:
    from durable_dataflow.core.secrets import Secret

# ---- times -------------------------------------------------------------------------------------

TimeForm = Literal["iso", "utc"]
_AGE_UNITS = (("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1))


def time_text(us: int | None, form: TimeForm = "iso", *, missing: str = "-") -> str:
    """A database-clock time (µs since the epoch), in UTC: ``iso`` is ISO 8601 with milliseconds
    (``2026-11-02T09:15:03.123+00:00``, the terminal's panels and tables); ``utc`` is
    ``2026-11-02 09:15:03 UTC`` (the web pages, token lists). ``None`` is ``missing``."""
    if us is None:
        return missing
    moment = dt.datetime.fromtimestamp(us / US_PER_S, tz=dt.UTC)
    if form == "iso":
        return moment.isoformat(timespec="milliseconds")
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def age_text(seconds: float) -> str:
    """A terminal table's short age, in its largest unit only: ``45s``, ``3m``, ``5h``, ``3d`` (the
    pages, with room for more, write ``duration_text``). Negative ages are 0 s."""
    rest = max(0, int(seconds))
    unit, size = next((unit, size) for unit, size in _AGE_UNITS if rest >= size or size == 1)
    return f"{rest // size}{unit}"


def duration_text(us: int) -> str:
    """A human duration from its microseconds (the web pages' durations and ages): ``850 ms``,
    ``12.3 s``, ``4 min 05 s``, ``2 h 03 min``, ``3 d 04 h``. Cut, never rounded up (59.99 s is
    ``59.9 s``, not ``60.0 s``); a negative duration (clocks of two hosts) is ``0 ms``."""
    us = max(0, int(us))
    if us < US_PER_S:
        return f"{us // 1_000} ms"
    if us < 60 * US_PER_S:
        tenths = us // (US_PER_S // 10)
        return f"{tenths // 10}.{tenths % 10} s"
    seconds = us // US_PER_S
    if seconds < 3_600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    if seconds < 86_400:
        return f"{seconds // 3_600} h {seconds % 3_600 // 60:02d} min"
    return f"{seconds // 86_400} d {seconds % 86_400 // 3_600:02d} h"


# ---- durations and phases of a run -------------------------------------------------------------

FINISHED_STATUSES = runs.FINISHED_STATUSES  # the states a run leaves no more (kept by runs, which counts them)
# The status a ledger entry leaves a run in: the last entry of every transition that sets one
# (``transition_table.TABLE``). Every other entry keeps the status (dispatch.authorized of a running
# attempt, reconcile.started, reconcile.undecided, the first entry of a two-entry transition).
_STATUS_AFTER: Mapping[str, RunStatus] = {t.kinds[-1]: t.status for t in TABLE.values() if t.status is not None}
# The name of the moment a run reached a state in which it waits for nobody (finished) or for an operator
# (unresolved), by the entry that put it there.
_END_NAMES: Mapping[str, str] = {
    evidence.RUN_SUCCEEDED: "succeeded",
    evidence.RUN_FAILED: "failed",
    evidence.RECONCILE_ABSENT: "reconciled absent",
    evidence.RUN_CANCELLED: "cancelled",
    evidence.PUBLICATION_UNKNOWN: "outcome unknown",
    evidence.ATTEMPT_OUTCOME_UNKNOWN: "outcome unknown",
    evidence.PUBLICATION_MISMATCH: "publication mismatch",
    evidence.RECONCILE_MISMATCH: "publication mismatch",
    evidence.EVIDENCE_FAILED: "evidence failed",
}
_FIRST_NAMES: Mapping[str, str] = {
    evidence.RUN_RECORDED: "recorded",
    evidence.ATTEMPT_STARTED: "started",
    evidence.DISPATCH_AUTHORIZED: "dispatch authorized",
}


class Milestone(NamedTuple):
    """A moment of a run (``recorded``, ``started``, ``dispatch authorized``, ``confirmed``, …) on the
    database clock, as its ledger entry recorded it."""

    name: str
    at_us: int


class Phase(NamedTuple):
    """The time between two milestones; the last phase of a run that has not finished ends now."""

    name: str
    start_us: int
    end_us: int


def run_milestones(entries: Iterable[tuple[str, int]]) -> list[Milestone]:
    """A run's milestones from its ledger entries ``(kind, recorded_at_us)`` in ledger order: recorded,
    the first attempt's start, the first dispatch authorization (forward recovery), and the entry that
    put the run in its present state when that state is final or unresolved: ``confirmed`` (the sink's
    confirmation, or a reconciliation that found the publication), ``succeeded``, ``failed``,
    ``reconciled absent``, ``cancelled``, ``outcome unknown``, ``publication mismatch``, ``evidence
    failed``. A queued or running run has no such entry yet."""
    return _scan(list(entries))[0]


def run_phases(entries: Iterable[tuple[str, int]], now_us: int) -> list[Phase]:
    """The phases between a run's milestones (``run_milestones``), oldest first, each named
    ``"A → B"``: ``recorded → started``, ``started → dispatch authorized``, ``dispatch authorized →
    confirmed`` (or ``→ failed``, ``→ outcome unknown``, …). A run that has not finished ends with
    an open phase to ``now_us`` (the database clock), named ``"A → now (still STATUS)"``: still
    queued, running, or unresolved (outcome_unknown, evidence_failed)."""
    marks, status = _scan(list(entries))
    phases = [Phase(f"{a.name} → {b.name}", a.at_us, b.at_us) for a, b in pairwise(marks)]
    if marks and status is not None and status not in FINISHED_STATUSES:
        last = marks[-1]
        phases.append(Phase(f"{last.name} → now (still {status})", last.at_us, max(now_us, last.at_us)))
    return phases


def _scan(entries: Sequence[tuple[str, int]]) -> tuple[list[Milestone], RunStatus | None]:
    """``run_milestones`` and the status the entries leave the run in (None before ``run.recorded``)."""
    marks: dict[str, tuple[int, int]] = {}  # name -> (index, at_us) of the first entry of its kind
    status: RunStatus | None = None
    entered = -1  # the index of the entry that put the run in ``status``
    for index, (kind, at_us) in enumerate(entries):
        if kind in _FIRST_NAMES and _FIRST_NAMES[kind] not in marks:
            marks[_FIRST_NAMES[kind]] = (index, at_us)
        after = _STATUS_AFTER.get(kind)
        if after is not None and after != status:
            status, entered = after, index
    if entered >= 0 and entries[entered][0] in _END_NAMES:
        kind, at_us = entries[entered]
        name = _END_NAMES[kind]
        if kind == evidence.RUN_SUCCEEDED and entered > 0 and entries[entered - 1][0] in evidence.CONCLUSIVE_PRESENCE:
            entered, name, at_us = entered - 1, "confirmed", entries[entered - 1][1]
        marks[name] = (entered, at_us)
    ordered = sorted(marks.items(), key=lambda item: item[1][0])
    return [Milestone(name, at_us) for name, (_, at_us) in ordered], status


def elapsed_us(run: Run, now_us: int) -> int | None:
    """How long a run has taken, from its projection alone (no ledger read: the run list is one query):
    recorded → its final transition for a finished run, recorded → ``now_us`` for a queued or running
    one, and None for an unresolved (or unreadable) run, whose ``updated_at_us`` moves with every
    reconcile attempt (see ``FINISHED_STATUSES``)."""
    if run.corrupt is not None:
        return None
    if run.status in FINISHED_STATUSES:
        return max(0, run.updated_at_us - run.created_at_us)
    if run.status in (RunStatus.QUEUED, RunStatus.RUNNING):
        return max(0, now_us - run.created_at_us)
    return None


# ---- the ledger --------------------------------------------------------------------------------


def entry_json(entry: ledger.Entry) -> dict[str, Any]:
    """One ledger entry as JSON (the payload as a plain dict): the one form of `dataflow show --json`'s
    ``ledger`` and the evidence's ``entries`` (docs/cli.md, docs/api.md)."""
    return {
        "seq": entry.seq,
        "attempt": entry.attempt,
        "kind": entry.kind,
        "payload": dict(entry.payload),
        "prev_hash": entry.prev_hash,
        "entry_hash": entry.entry_hash,
        "recorded_at_us": entry.recorded_at_us,
    }


def checkpoint_json(checkpoint: checkpoints.Checkpoint | None) -> dict[str, Any] | None:
    """The latest verified checkpoint as JSON (its facts as a plain dict), or None: every field it has."""
    if checkpoint is None:
        return None
    return {
        "module": checkpoint.module,
        "subject_id": checkpoint.subject_id,
        "attempt": checkpoint.attempt,
        "head_seq": checkpoint.head_seq,
        "head_hash": checkpoint.head_hash,
        "status": checkpoint.status,
        "facts": dict(checkpoint.facts),
        "verified_at_us": checkpoint.verified_at_us,
    }


# ---- runs --------------------------------------------------------------------------------------


def warning_of(run: Run) -> str | None:
    """The run's stored warning; an unresolved run always has one, even if the projection lacks it."""
    if run.warning:
        return run.warning
    return runs.unresolved_warning(run) if run.unresolved else None


def expired_after_authorization_warning(run: Run) -> str:
    """An expired attempt that authorized dispatch, not yet swept: unresolved, never 'failed'."""
    return (
        "UNRESOLVED: the attempt's lease expired after dispatch authorization, and no sweeper has decided "
        "it yet: external output may exist. The publication may have reached the sink under idempotency key "
        f"{run.publication_idempotency_key or run.idempotency_key} with output digest {run.output_digest}. "
        "Do not re-run it; reconcile by inspecting the sink (reconcile sweeps the run first): "
        f"`dataflow reconcile {run.run_id}`."
    )


def expired_before_authorization_warning(run: Run) -> str:
    """An expired attempt that never authorized dispatch: proven absent; the next sweep decides it."""
    where = f"lease expired before dispatch authorization (attempt {run.attempt} of {run.max_attempts}): "
    if run.attempt < run.max_attempts:
        return where + "no external output was created; it will be retried by the next sweep."
    return where + "no external output was created; the next sweep fails the run (no attempt left)."


NextStep = Literal["reconcile", "verify"]


@dataclass(frozen=True)
class RunView:
    """A run as a reader shows it: the projection, plus what its expired lease means."""

    run: Run
    lease_expired: bool  # the current attempt's lease expired (database clock) and no sweeper decided it
    unresolved: bool
    warning: str | None

    @property
    def next_step(self) -> NextStep | None:
        """The command an unresolved run needs: ``reconcile`` (the sink decides) or ``verify`` (the ledger)."""
        if not self.unresolved:
            return None
        return "verify" if self.run.recovery_status == RecoveryStatus.EVIDENCE_FAILED else "reconcile"

    @property
    def reconcilable(self) -> bool:
        """Reconcile applies: outcome_unknown, or an expired attempt after dispatch authorization."""
        return self.run.status == RunStatus.OUTCOME_UNKNOWN or (self.lease_expired and self.next_step == "reconcile")

    def public(self) -> dict[str, Any]:
        """The documented run JSON (``Run.public()``) with ``warning`` and ``unresolved`` derived and
        ``lease_expired`` added after ``unresolved``."""
        data = self.run.public()
        data["warning"] = self.warning
        data["unresolved"] = self.unresolved
        data["lease_expired"] = self.lease_expired
        return data


def plain(run: Run) -> RunView:
    """The view of a run without its lease (a run a write just returned, whose attempt this process holds)."""
    return RunView(run, lease_expired=False, unresolved=run.unresolved, warning=warning_of(run))


def derive(
    items: Sequence[Run], expiry: Mapping[str, leases.LeaseExpiry], after_authorization: Collection[str]
) -> list[RunView]:
    """The views of ``items`` from their leases (``leases.expiry_of``) and the ids of the runs that are
    unresolved by their expired lease after a dispatch authorization (``runs.expired_after_authorization``,
    the one definition Ops and ``/metrics`` count by too)."""
    shown = []
    for run in items:
        lease = expiry.get(run.run_id)
        expired = lease is not None and lease.expired
        if run.run_id in after_authorization:
            # Judged by the later statement: its lease expired even if the earlier read just missed it.
            shown.append(RunView(run, True, True, expired_after_authorization_warning(run)))
        elif expired and run.status == RunStatus.RUNNING:
            shown.append(RunView(run, True, run.unresolved, expired_before_authorization_warning(run)))
        else:
            shown.append(RunView(run, expired, run.unresolved, warning_of(run)))
    return shown


def load(conn: Connection, db: Database, items: Sequence[Run]) -> list[RunView]:
    """The views of ``items``, read in the caller's transaction: one statement for the leases and, only
    when a running run's lease expired, one that applies the definition of unresolved to those runs."""
    expiry = leases.expiry_of(conn, db, MODULE, [run.run_id for run in items])
    expired_running = [
        run.run_id
        for run in items
        if run.status == RunStatus.RUNNING and (lease := expiry.get(run.run_id)) is not None and lease.expired
    ]
    return derive(items, expiry, runs.expired_after_authorization(conn, db, expired_running))


def load_one(conn: Connection, db: Database, run: Run) -> RunView:
    return load(conn, db, [run])[0]


def unresolved_page(
    conn: Connection, db: Database, tenant: str | None = None, *, limit: int
) -> tuple[int, list[RunView]]:
    """The number of unresolved runs (platform-wide or one tenant's) and the oldest ``limit`` of them as
    shown, oldest first: the Ops projection and ``/metrics`` count by the definition the views show by."""
    total, page = runs.unresolved_page(conn, db, tenant, limit=limit)
    found = [run for run, _ in page]
    expiry = leases.expiry_of(conn, db, MODULE, [run.run_id for run in found])
    shown = derive(found, expiry, {run.run_id for run, after_authorization in page if after_authorization})
    invariant(all(view.unresolved for view in shown), "every run the unresolved query found is shown unresolved")
    return total, shown


# ---- a tenant's pinned definitions (Ops: read-only, tenant-scoped) -----------------------------


def tenant_definitions(conn: Connection, tenant: str, *, limit: int) -> list[tuple[Any, ...]]:
    """Rows of ``(definition_hash, name, version, registered_at_us, runs)``: the definitions the
    tenant's runs pinned, by name, newest version first, each first used at the tenant's own first run."""
    return catalog.tenant_definitions(conn, runs.usage_by_definition(tenant), limit=limit)


def tenant_definition_body(conn: Connection, tenant: str, d_hash: str) -> str | None:
    """The canonical body of a pinned definition the tenant has used, else None: a tenant never
    sees another tenant's SQL."""
    return catalog.tenant_definition_body(conn, runs.usage_by_definition(tenant), d_hash)


# ---- the one door: what `runs`, `show`, `verify`, the JSON API and the pages read ---------------


@dataclass(frozen=True)
class ShownRun:
    """One run as read now: its view and the database's now, from which its age counts."""

    view: RunView
    now_us: int

    def as_json(self) -> dict[str, Any]:
        """The documented run JSON as shown (``RunView.public``: the derived ``warning`` and
        ``unresolved``, ``lease_expired``), plus ``age_s`` on the database clock."""
        data = self.view.public()
        data["age_s"] = max(0, self.now_us - self.view.run.created_at_us) / US_PER_S
        return data


@dataclass(frozen=True)
class RunList:
    """Runs as read now, newest first (`dataflow runs`, ``GET /v1/runs``, ``/ui/runs``)."""

    views: tuple[RunView, ...]
    now_us: int
    more: bool  # the listing found a run after the last one here (a next page exists)

    def as_json(self) -> list[dict[str, Any]]:
        """Each run as ``ShownRun.as_json`` gives it, at the one ``now_us`` of this read."""
        return [ShownRun(view, self.now_us).as_json() for view in self.views]


@dataclass(frozen=True)
class RunPage:
    """`dataflow show`: the run as read now, its ledger entries in order and its latest checkpoint."""

    shown: ShownRun
    entries: tuple[ledger.Entry, ...]
    checkpoint: checkpoints.Checkpoint | None

    def as_json(self) -> dict[str, Any]:
        """The run JSON plus ``ledger`` (``entry_json`` each) and ``checkpoint`` (``checkpoint_json``)."""
        return {
            **self.shown.as_json(),
            "ledger": [entry_json(entry) for entry in self.entries],
            "checkpoint": checkpoint_json(self.checkpoint),
        }


@dataclass(frozen=True)
class RunVerification:
    """`dataflow verify`: the run's chain recomputed from genesis and the facts of its state checked."""

    run_id: str
    result: ledger.Verification

    def as_json(self) -> dict[str, Any]:
        """Every field of the verification, with the run it is of; ``reason`` is null when there is none."""
        result = self.result
        return {
            "run_id": self.run_id,
            "ok": result.ok,
            "entry_count": result.entry_count,
            "head_seq": result.head_seq,
            "head_hash": result.head_hash,
            "keyed": result.keyed,
            "broken_seq": result.broken_seq,
            "reason": result.reason or None,
        }

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> RunVerification:
        """The verification ``as_json`` gave (a remote `verify` reads it from the API's evidence)."""
        return cls(
            document["run_id"],
            ledger.Verification(
                ok=document["ok"], head_seq=document["head_seq"], head_hash=document["head_hash"],
                entry_count=document["entry_count"], keyed=document["keyed"],
                broken_seq=document["broken_seq"], reason=document["reason"] or "",
            ),
        )  # fmt: skip


@dataclass(frozen=True)
class RunEvidence:
    """``GET /v1/runs/{id}/evidence`` and the web run page: `show`'s page with `verify`'s verification."""

    page: RunPage
    verification: RunVerification

    def as_json(self) -> dict[str, Any]:
        """``run``, ``entries`` and ``checkpoint`` exactly as `show --json` gives them (its run fields, its
        ``ledger``, its ``checkpoint``), and ``verification`` exactly as `verify --json` prints it."""
        page = self.page.as_json()
        return {
            "run": self.page.shown.as_json(),
            "entries": page["ledger"],
            "verification": self.verification.as_json(),
            "checkpoint": page["checkpoint"],
        }


def shown(conn: Connection, db: Database, run: Run) -> ShownRun:
    """A run a caller already holds (a write's answer), as read now: its lease on the database clock."""
    return ShownRun(load_one(conn, db, run), db.now_us(conn))


def shown_run(conn: Connection, db: Database, run_id: str, tenant: str | None = None) -> ShownRun:
    """One run as read now; another tenant's run is NotFound, exactly like one that does not exist."""
    return shown(conn, db, runs.get(conn, run_id, tenant))


def run_list(
    conn: Connection,
    db: Database,
    *,
    limit: int,
    tenant: str | None = None,
    status: str | None = None,
    recovery_status: str | None = None,
    definition_name: str | None = None,
    created_after_us: int | None = None,
    created_before_us: int | None = None,
    before: tuple[int, str] | None = None,
    parameters: Mapping[str, str] | None = None,
) -> RunList:
    """At most ``limit`` runs, newest first, filtered as ``runs.list_page`` filters; ``more`` says whether
    a next page exists (asked for one run more, within ``runs.PAGE_SIZE_MAX``)."""
    found = runs.list_page(
        conn,
        tenant=tenant,
        status=status,
        recovery_status=recovery_status,
        definition_name=definition_name,
        created_after_us=created_after_us,
        created_before_us=created_before_us,
        before=before,
        limit=limit + 1,
        parameters=parameters,
    )
    page = found[:limit]
    shown_views = load(conn, db, page)  # reads only: an expired lease is shown, never swept
    return RunList(tuple(shown_views), db.now_us(conn), more=len(found) > limit)


def run_page(conn: Connection, db: Database, run_id: str, tenant: str | None = None) -> RunPage:
    """`dataflow show`'s read, in the caller's one transaction: the run, its ledger and checkpoint."""
    found = shown_run(conn, db, run_id, tenant)
    entries = tuple(ledger.read(conn, MODULE, run_id))
    return RunPage(found, entries, checkpoints.latest(conn, MODULE, run_id))


def verification(
    conn: Connection,
    run_id: str,
    key: Secret | None,
    tenant: str | None = None,
    *,
    checks: evidence.ResultChecks | None = None,
) -> RunVerification:
    """`dataflow verify`'s read: the chain against the latest checkpoint and the run's facts
    (``derivation.verify_run``); a failure is a result naming the seq, never an exception. A server
    passes its ``checks`` (cached per ledger head, a few at a time); `dataflow verify` reads afresh."""
    run = runs.get(conn, run_id, tenant)
    return RunVerification(run_id, derivation.verify_run(conn, run, key, checks=checks))


def run_evidence(
    conn: Connection,
    db: Database,
    run_id: str,
    key: Secret | None,
    tenant: str | None = None,
    *,
    checks: evidence.ResultChecks | None = None,
) -> RunEvidence:
    """The evidence of one run in one read transaction: `show`'s page and `verify`'s verification."""
    return RunEvidence(run_page(conn, db, run_id, tenant), verification(conn, run_id, key, tenant, checks=checks))


# ---- activity: what the pages chart --------------------------------------------------------------

DAY_US = 86_400 * US_PER_S


def window_start_us(now_us: int, days: int, bucket_us: int) -> int:
    """The first bucket of a window of ``days`` days that ends with the bucket holding ``now_us``
    (buckets start at multiples of ``bucket_us`` from the epoch: whole hours and days in UTC)."""
    last = now_us - now_us % bucket_us
    return last - (days * DAY_US // bucket_us - 1) * bucket_us


@dataclass(frozen=True)
class Activity:
    """The runs of a window of days ending now (database clock): per bucket and outcome now
    (``runs.outcome_counts``) and, when asked, the durations of succeeded runs per definition
    (``runs.duration_stats``)."""

    start_us: int
    now_us: int
    counts: list[tuple[int, str, int]]
    durations: list[runs.DurationStats]
    more_definitions: bool  # more definitions had succeeded runs than ``durations`` holds


def activity(
    conn: Connection,
    db: Database,
    tenant: str | None,
    *,
    days: int,
    bucket_us: int,
    definition_name: str | None = None,
    durations: bool,
) -> Activity:
    """One tenant's runs of the last ``days`` days (None: every tenant's, for a platform operator),
    bucketed by ``bucket_us``: two aggregate statements in the caller's read transaction."""
    now_us = db.now_us(conn)
    start_us = window_start_us(now_us, days, bucket_us)
    counts = runs.outcome_counts(
        conn, db, tenant=tenant, since_us=start_us, bucket_us=bucket_us, definition_name=definition_name
    )
    stats, more = (
        runs.duration_stats(conn, tenant=tenant, since_us=start_us, definition_name=definition_name)
        if durations
        else ([], False)
    )
    return Activity(start_us, now_us, counts, stats, more)
