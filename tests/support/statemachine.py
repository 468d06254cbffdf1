"""Support for the recovery state-machine test: the bench, a read of the world, the invariants.

The bench is three worker platforms on ONE database (each its own ``Database`` object, so each
has its own clock offset: :meth:`Bench.advance_clock` shifts them together) and a fresh sink
folder per example. :func:`read_world` reads everything an invariant needs straight from the
tables and from the sink's ``_manifests/*.json`` files (with ``json``, never through the provider),
and the ``check_*`` functions assert DESIGN §7's invariants 3, 6, 7, 8, 9, 11 and 14 on it; each
failure message starts with ``invariant N:``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from durable_dataflow.core import ledger
from durable_dataflow.core.schema import checkpoints, leases, ledger_entries
from durable_dataflow.dataflow.definitions.definitions import Definition, load_definition
from durable_dataflow.dataflow.protocol import evidence, forward, runs
from durable_dataflow.dataflow.protocol.runs import MODULE, Mode, Run, RunStatus
from durable_dataflow.dataflow.schema import dataflow_runs, definitions, run_results
from durable_dataflow.platform import Platform

REPO = Path(__file__).resolve().parents[2]
FORWARD_EXAMPLE = REPO / "examples" / "daily_orders_publish"
ATOMIC_EXAMPLE = REPO / "examples" / "revenue_by_region"
SINK_LOCATION = "warehouse/daily_revenue"  # the forward example's target location
WORKERS = 3
LEASE_TTL_S = 600.0  # long against real time, so only the shifted clock ever expires a lease
TTL_US = int(LEASE_TTL_S * 1_000_000)

# Entries the sweeper writes for an attempt *after* its lease expired, by design (DESIGN §6).
SWEEPER_KINDS = frozenset({evidence.ATTEMPT_RECOVERED, evidence.ATTEMPT_OUTCOME_UNKNOWN})
START_KINDS = frozenset({evidence.ATTEMPT_STARTED, evidence.RECONCILE_STARTED, evidence.RESUME_STARTED})
# Tables cleared between examples. Definitions are content-addressed and never deleted (the run
# service caches which ones it stored), so they stay; they are counted for "nothing written".
_CLEARED = (run_results, checkpoints, ledger_entries, leases, dataflow_runs)
_COUNTED = (*_CLEARED, definitions)


class Bench:
    """Worker platforms on one database, reset for every example of the machine."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.workdir = workdir
        self.platforms = [
            Platform(url, lease_ttl_s=LEASE_TTL_S, holder=f"worker-{i}", migrate=(i == 0)) for i in range(WORKERS)
        ]
        self.forward: Definition = load_definition(FORWARD_EXAMPLE / "dataflow.yaml").definition
        self.atomic: Definition = load_definition(ATOMIC_EXAMPLE / "dataflow.yaml").definition
        self.examples = 0
        self.base_dir = workdir

    def reset(self) -> None:
        """Empty tables, clocks back to zero, a fresh copy of the example folders (and sink)."""
        with self.platforms[0].db.begin() as conn:
            for table in _CLEARED:
                conn.execute(table.delete())
        for platform in self.platforms:
            platform.db.clock_offset_s = 0.0
        self.examples += 1
        self.base_dir = self.workdir / f"example-{self.examples}"
        only_inputs = shutil.ignore_patterns("warehouse", ".dataflow", "*.db")  # a demo may have left a sink there
        shutil.copytree(FORWARD_EXAMPLE, self.base_dir / "forward", ignore=only_inputs)
        shutil.copytree(ATOMIC_EXAMPLE, self.base_dir / "atomic", ignore=only_inputs)
        if self.examples > 1:
            shutil.rmtree(self.workdir / f"example-{self.examples - 1}", ignore_errors=True)

    @property
    def sink(self) -> Path:
        return self.base_dir / "forward" / SINK_LOCATION

    def advance_clock(self, seconds: float) -> None:
        """One shared database clock: every worker's Database object moves together."""
        for platform in self.platforms:
            platform.db.advance_clock(seconds)

    def close(self) -> None:
        for platform in self.platforms:
            platform.close()


@dataclass(frozen=True)
class LeaseRow:
    attempt: int
    holder: str
    acquired_at_us: int
    expires_at_us: int
    released_at_us: int | None

    def live(self, attempt: int, now_us: int) -> str:
        """Empty when ``attempt`` may write now (the fence's rule), else why it may not."""
        if self.attempt != attempt:
            return f"stale (the current attempt is {self.attempt})"
        if self.released_at_us is not None:
            return "released"
        if self.expires_at_us <= now_us:
            return f"expired {(now_us - self.expires_at_us) / 1e6:.0f} s ago"
        return ""


@dataclass(frozen=True)
class World:
    """Everything the invariants look at, read in one transaction plus the sink folder."""

    now_us: int
    runs: dict[str, Run]
    ledgers: dict[str, list[ledger.Entry]]
    leases: dict[str, LeaseRow]
    stored_digests: dict[str, str]
    duplicate_keys: list[tuple[str, str, int]]
    manifests: dict[str, dict[str, Any]]  # by idempotency key
    raw_manifests: dict[str, bytes]  # by file name
    counts: tuple[int, ...]

    def manifest_for(self, run: Run) -> dict[str, Any] | None:
        key = run.publication_idempotency_key
        return self.manifests.get(key) if key else None

    def lease_problem(self, run_id: str, attempt: int) -> str:
        row = self.leases.get(run_id)
        return "holds no lease" if row is None else row.live(attempt, self.now_us)


def read_world(platform: Platform, sink: Path) -> World:
    db = platform.db
    with db.read() as conn:
        now = db.now_us(conn)
        all_runs = {r.run_id: runs.from_row(r) for r in conn.execute(sa.select(dataflow_runs)).all()}
        ledgers = read_ledgers(conn, all_runs)
        lease_rows = {
            r.subject_id: LeaseRow(int(r.attempt), r.holder, int(r.acquired_at_us), int(r.expires_at_us),
                                   None if r.released_at_us is None else int(r.released_at_us))
            for r in conn.execute(sa.select(leases).where(leases.c.module == MODULE)).all()
        }  # fmt: skip
        digests = sa.select(run_results.c.run_id, run_results.c.output_digest)
        stored = {r.run_id: r.output_digest for r in conn.execute(digests)}
        dup_query = (
            sa.select(dataflow_runs.c.tenant, dataflow_runs.c.idempotency_key, sa.func.count())
            .group_by(dataflow_runs.c.tenant, dataflow_runs.c.idempotency_key)
            .having(sa.func.count() > 1)
        )
        duplicates = [(r[0], r[1], int(r[2])) for r in conn.execute(dup_query).all()]
        per_table = (sa.select(sa.func.count()).select_from(t).scalar_subquery() for t in _COUNTED)
        counts = tuple(int(c) for c in conn.execute(sa.select(*per_table)).one())
    manifests, raw = read_sink(sink)
    return World(now, all_runs, ledgers, lease_rows, stored, duplicates, manifests, raw, counts)


def read_ledgers(conn: sa.Connection, run_ids: Mapping[str, Run]) -> dict[str, list[ledger.Entry]]:
    """Every run's entries in seq order, in one query (the step's hot path)."""
    ledgers: dict[str, list[ledger.Entry]] = {run_id: [] for run_id in run_ids}
    query = sa.select(ledger_entries).where(ledger_entries.c.module == MODULE)
    for r in conn.execute(query.order_by(ledger_entries.c.subject_id, ledger_entries.c.seq)).all():
        entry = ledger.Entry(MODULE, r.subject_id, int(r.seq), int(r.attempt), r.kind, json.loads(r.payload_json),
                             r.prev_hash, r.entry_hash, r.entry_mac, int(r.recorded_at_us))  # fmt: skip
        ledgers.setdefault(r.subject_id, []).append(entry)
    return ledgers


def read_sink(sink: Path) -> tuple[dict[str, dict[str, Any]], dict[str, bytes]]:
    """The sink's manifests read as plain JSON files (the provider is not asked)."""
    manifests: dict[str, dict[str, Any]] = {}
    raw: dict[str, bytes] = {}
    folder = sink / "_manifests"
    if not folder.is_dir():
        return manifests, raw
    for path in sorted(folder.glob("*.json")):
        data = path.read_bytes()
        manifest = json.loads(data)
        key = str(manifest["key"])
        assert path.stem == key_hash(key), f"invariant 6: manifest {path.name} is not named by its key {key!r}"
        assert key not in manifests, f"invariant 6: two manifests record key {key!r}"
        manifests[key] = manifest
        raw[path.name] = data
    return manifests, raw


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def first_seq(entries: list[ledger.Entry], kind: str) -> int | None:
    return next((e.seq for e in entries if e.kind == kind), None)


def sweeper_written(entries: list[ledger.Entry], index: int) -> bool:
    """Whether entry ``index`` is one the sweeper wrote for an expired attempt."""
    entry = entries[index]
    if entry.kind in SWEEPER_KINDS:
        return True
    previous = entries[index - 1] if index > 0 else None
    return (
        entry.kind == evidence.RUN_FAILED
        and entry.payload.get("code") == "attempts_exhausted"
        and previous is not None
        and previous.kind == evidence.ATTEMPT_RECOVERED
        and previous.attempt == entry.attempt
    )


def attempt_writes(entries: list[ledger.Entry], attempt: int) -> int:
    """How many entries the holder of ``attempt`` wrote (the sweeper's are not its writes)."""
    return sum(1 for i, e in enumerate(entries) if e.attempt == attempt and not sweeper_written(entries, i))


@dataclass
class History:
    """What the machine observed across steps, for invariants that span time."""

    expiry_us: dict[tuple[str, int], int] = field(default_factory=dict)  # latest expiry seen
    released_us: dict[tuple[str, int], int] = field(default_factory=dict)  # first release seen
    publications: dict[str, bytes] = field(default_factory=dict)  # first publication manifest per key
    authorized: set[str] = field(default_factory=set)
    keys: dict[tuple[str, str], str] = field(default_factory=dict)  # (tenant, key) -> run_id

    def observe_leases(self, world: World) -> None:
        for run_id, row in world.leases.items():
            slot = (run_id, row.attempt)
            self.expiry_us[slot] = max(self.expiry_us.get(slot, 0), row.expires_at_us)
            if row.released_at_us is not None:
                self.released_us.setdefault(slot, row.released_at_us)


def check_fenced_ledger(world: World, history: History) -> None:
    """Invariant 3: no entry of attempt n after a higher grant, after n's expiry or release."""
    for run_id, entries in world.ledgers.items():
        starts = {e.attempt: e for e in entries if e.kind in START_KINDS}
        for index, entry in enumerate(entries):
            n = entry.attempt
            if n == 0 or sweeper_written(entries, index):
                continue
            later = [s for m, s in starts.items() if m > n and s.seq < entry.seq]
            assert not later, (
                f"invariant 3: run {run_id} entry {entry.seq} ({entry.kind}) of attempt {n} was committed after "
                f"attempt {later[0].attempt} was granted (entry {later[0].seq})"
            )
            start = starts.get(n)
            assert start is not None, f"invariant 3: run {run_id} entry {entry.seq} of attempt {n}, never granted"
            expiry = max(history.expiry_us.get((run_id, n), 0), start.recorded_at_us + TTL_US)
            assert entry.recorded_at_us < expiry, (
                f"invariant 3: run {run_id} entry {entry.seq} ({entry.kind}) of attempt {n} was committed "
                f"{(entry.recorded_at_us - expiry) / 1e6:.0f} s after the attempt's lease expired"
            )
            released = history.released_us.get((run_id, n))
            assert released is None or entry.recorded_at_us <= released, (
                f"invariant 3: run {run_id} entry {entry.seq} ({entry.kind}) of attempt {n} was committed "
                "after its lease was released"
            )


def check_publications(world: World, history: History) -> None:
    """Invariant 6: one manifest per key, of a known run, and a publication never changes."""
    known = {forward.publication_key(r) for r in world.runs.values()}
    for key, manifest in world.manifests.items():
        assert key in known, f"invariant 6: the sink holds key {key!r} of no run"
        if manifest["kind"] != "publication":
            continue
        raw = json.dumps(manifest, sort_keys=True).encode("utf-8")
        first = history.publications.setdefault(key, raw)
        assert first == raw, (
            f"invariant 6: key {key!r} was published twice: first {first.decode()}, now {raw.decode()}"
        )
    for key in history.publications:
        manifest = world.manifests.get(key)
        assert manifest is not None and manifest["kind"] == "publication", (
            f"invariant 6: the publication of key {key!r} disappeared or was replaced by {manifest}"
        )


def check_success_evidence(world: World) -> None:
    """Invariant 7: succeeded only with conclusive evidence of the recorded digest, at the sink too."""
    for run in world.runs.values():
        if run.status != RunStatus.SUCCEEDED:
            continue
        entries = world.ledgers[run.run_id]
        digest = run.output_digest
        assert digest is not None and world.stored_digests.get(run.run_id) == digest, (
            f"invariant 7: run {run.run_id} succeeded but its stored result has digest "
            f"{world.stored_digests.get(run.run_id)}, recorded {digest}"
        )
        if run.mode == Mode.ATOMIC:
            committed = [e for e in entries if e.kind == evidence.RESULT_COMMITTED]
            assert committed and committed[-1].payload.get("output_digest") == digest, (
                f"invariant 7: atomic run {run.run_id} succeeded without result.committed of digest {digest}"
            )
            continue
        conclusive = [e for e in entries if e.kind in evidence.CONCLUSIVE_PRESENCE]
        assert any(e.payload.get("digest") == digest for e in conclusive), (
            f"invariant 7: run {run.run_id} succeeded without a conclusive entry of digest {digest}: "
            f"{[(e.kind, e.payload.get('digest')) for e in conclusive]}"
        )
        manifest = world.manifest_for(run)
        assert manifest is not None and manifest["kind"] == "publication" and manifest["digest"] == digest, (
            f"invariant 7: run {run.run_id} succeeded but the sink holds {manifest} for its key"
        )


def check_no_retry_after_authorization(world: World, history: History) -> None:
    """Invariant 8: after dispatch.authorized a run is never queued and never started again."""
    for run in world.runs.values():
        entries = world.ledgers[run.run_id]
        authorized = first_seq(entries, evidence.DISPATCH_AUTHORIZED)
        if authorized is None:
            assert run.run_id not in history.authorized, f"invariant 8: run {run.run_id} lost its authorization"
            continue
        history.authorized.add(run.run_id)
        assert run.status != RunStatus.QUEUED, (
            f"invariant 8: run {run.run_id} is queued again after its dispatch authorization (entry {authorized})"
        )
        bad = [e for e in entries if e.seq > authorized and e.kind in (evidence.ATTEMPT_STARTED,
                                                                       evidence.ATTEMPT_RECOVERED)]  # fmt: skip
        assert not bad, (
            f"invariant 8: run {run.run_id} has {bad[0].kind} (entry {bad[0].seq}, attempt {bad[0].attempt}) "
            f"after its dispatch authorization (entry {authorized})"
        )


def check_recovered_attempts(world: World) -> None:
    """Invariant 9: a recovered attempt had no authorization; the run was queued again or failed."""
    for run in world.runs.values():
        entries = world.ledgers[run.run_id]
        for index, entry in enumerate(entries):
            if entry.kind != evidence.ATTEMPT_RECOVERED:
                continue
            n = entry.attempt
            assert not any(e.kind == evidence.DISPATCH_AUTHORIZED and e.attempt == n for e in entries), (
                f"invariant 9: run {run.run_id} attempt {n} was recovered although it authorized dispatch"
            )
            after = entries[index + 1 :]
            if any(e.kind in START_KINDS for e in after):
                continue  # queued and claimed again since
            failed = bool(after) and after[0].kind == evidence.RUN_FAILED
            if n >= run.max_attempts:
                assert failed and run.status == RunStatus.FAILED, (
                    f"invariant 9: run {run.run_id} spent {n} of {run.max_attempts} attempts but is {run.status}"
                )
            else:
                assert not failed and run.status == RunStatus.QUEUED, (
                    f"invariant 9: run {run.run_id} attempt {n} was recovered but the run is {run.status}"
                )


def check_one_run_per_key(world: World, history: History) -> None:
    """Invariant 11: one run per (tenant, key), and it stays the run the first submit returned."""
    assert not world.duplicate_keys, f"invariant 11: several runs under one key: {world.duplicate_keys}"
    by_key = {(r.tenant, r.idempotency_key): r.run_id for r in world.runs.values()}
    for slot, run_id in history.keys.items():
        assert by_key.get(slot) == run_id, f"invariant 11: key {slot} names {by_key.get(slot)}, not {run_id}"
    assert len(world.runs) == len(history.keys), (
        f"invariant 11: {len(world.runs)} runs recorded for {len(history.keys)} distinct keys submitted"
    )


def check_fence_holds(world: World) -> None:
    """Invariant 14: once reconcile proved absence fenced at m, no publication below m exists."""
    for run in world.runs.values():
        fences = [
            int(e.payload["fenced_at"]) for e in world.ledgers[run.run_id] if e.kind == evidence.RECONCILE_ABSENT
        ]
        manifest = world.manifest_for(run)
        if not fences or manifest is None:
            continue
        if manifest["kind"] == "publication":
            assert int(manifest["token"]) >= max(fences), (
                f"invariant 14: key of run {run.run_id} was fenced at {max(fences)} by a reconcile but the sink "
                f"holds a publication with token {manifest['token']}"
            )
        else:
            assert int(manifest["token"]) >= max(fences), f"invariant 14: the fence of run {run.run_id} went down"


def check_all(world: World, history: History) -> None:
    history.observe_leases(world)
    check_fenced_ledger(world, history)
    check_publications(world, history)
    check_success_evidence(world)
    check_no_retry_after_authorization(world, history)
    check_recovered_attempts(world)
    check_one_run_per_key(world, history)
    check_fence_holds(world)


def describe(world: World) -> Mapping[str, Any]:
    """A compact picture of the runs, for failure messages."""
    return {
        r.run_id[-6:]: (str(r.mode), str(r.status), str(r.recovery_status), r.attempt) for r in world.runs.values()
    }
