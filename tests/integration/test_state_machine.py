"""The recovery protocol (DESIGN §6) as a hypothesis state machine over the REAL code.

Three workers (separate platforms, one database, one shared clock), the real run service,
forward-recovery steps, sweeper and reconciliation, and the real Parquet-folder sink. Each rule is
a step the protocol can take — submit (replays and conflicting replays included), claim, compute,
a whole attempt, the pre-dispatch commit, publish (keeping or losing the response), the terminal
commit, the atomic terminal commit, heartbeat, abandon (a crash), clock moves that expire leases,
sweep, reconcile and resume — interleaved across runs and workers. A write the lease row says must
be refused is predicted before it is made and checked after; after every step the invariants 3,
6, 7, 8, 9, 11 and 14 are checked against the ledger and the sink's manifests read as files
(tests/support/statemachine.py). Only StaleAttempt, LeaseUnavailable and Conflict are expected
errors, each only where predicted; anything else fails the test.

Profiles (tests/hypothesis_profiles.py): ``ci`` by default, ``long`` for ``make soak``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis import target
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from durable_dataflow.core import fencing, leases
from durable_dataflow.core.errors import Conflict, LeaseUnavailable, StaleAttempt
from durable_dataflow.dataflow.execution import results
from durable_dataflow.dataflow.execution.compute import ExecutionResult
from durable_dataflow.dataflow.protocol import attempt as attempts
from durable_dataflow.dataflow.protocol import derivation, evidence, forward, sweeper
from durable_dataflow.dataflow.protocol import reconcile as reconciliation
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.protocol.runs import MODULE, Mode, RecoveryStatus, Run, RunStatus
from durable_dataflow.dataflow.protocol.service import Claim, RunService
from durable_dataflow.datasources.contract import (
    AlreadyPublished,
    Fenced,
    Location,
    Published,
    PublishOutcome,
    PublishTarget,
)
from hypothesis_profiles import CI_EXAMPLES, LONG_PROFILE, machine_settings
from support.statemachine import (
    LEASE_TTL_S,
    WORKERS,
    Bench,
    History,
    World,
    attempt_writes,
    check_all,
    describe,
    read_world,
)

# (tenant, idempotency key): a second tenant reuses a key of the first — a different run.
KEYS = (("t1", "k0"), ("t1", "k1"), ("t1", "k2"), ("t2", "k0"))
# A request flavour: which definition and which parameter. Another flavour under a known key is a
# conflicting replay.
FLAVOURS = {"fwd-a": (Mode.FORWARD_RECOVERY, "2026-11-02"), "fwd-b": (Mode.FORWARD_RECOVERY, "2026-11-03"),
            "atomic": (Mode.ATOMIC, "2026-11-02")}  # fmt: skip
# Rules that are always (or nearly always) enabled get a per-example budget: hypothesis likes to
# repeat a step many times in a row, and a run of 30 replays tests nothing the fifth did not.
# (Clock moves need none: they are enabled only while a lease is live, and two expire it.)
# Steps that end an attempt at once (abandon, a whole attempt) are budgeted too, so the rarer
# interleavings inside one attempt get their share of the steps.
# Reconcile stays enabled while a run is reconciled_absent (a resume may follow); repeated
# inspections of the same absent run add nothing.
BUDGET = {"submit": 6, "heartbeat": 3, "abandon": 2, "execute_whole_attempt": 2, "pause": 2, "reconcile": 4}
SUBMIT_CLOCK_STEP_S = 0.005
# The one reconciler of the model (docs/model.md): who its reconcile and resume attempts record.
RECONCILER = AccessContext(tenant="t1", principal="reconciler", roles=("operator",))
RECONCILER_PROVENANCE = Provenance(actor="reconciler", trigger="cli", host="test")
CLAIM_THEN = ("stop", "compute", "authorize")
# "keep" twice: holding an answer while the lease runs out is the window the fenced terminal commit guards.
RESPONSES = ("commit", "keep", "keep", "lost", "unknown", "in_flight")
MAX_ATTEMPTS = 2  # small, so exhausting the attempts is reachable in a few steps
SWEPT_STATUS = {"recovered": RunStatus.QUEUED, "failed": RunStatus.FAILED}
WORKER = st.integers(min_value=0, max_value=WORKERS - 1)
REACHED: Counter[str] = Counter()  # which protocol situations the examples reached, for the report
SITUATIONS: set[str] = set()  # the distinct situations of the current example: hypothesis' target


def event(name: str) -> None:
    REACHED[name] += 1
    SITUATIONS.add(name)
    hypothesis_event(name)


# The ci run takes about a minute; a failure adds up to 5 minutes of shrinking (hypothesis' own cap).
# The long profile has no time limit.
TIMEOUT_S = 0 if machine_settings().max_examples > CI_EXAMPLES else 900


@dataclass(repr=False)
class Held:
    """An attempt a worker holds in memory: what it computed and what the sink answered it."""

    worker: int
    run_id: str
    attempt: int
    mode: Mode
    result: ExecutionResult | None = None
    located: Location | None = None  # what prepare_target created or found, for the authorization to record
    authorized: bool = False
    outcome: PublishOutcome | None = None
    recorded_digest: str = ""
    paused: bool = False

    def __repr__(self) -> str:
        return f"Held(w{self.worker}, run …{self.run_id[-6:]}, attempt {self.attempt})"


@dataclass(frozen=True, repr=False)
class Request:
    """A publish request as sent: it carries its token and bytes, whatever happens to the attempt."""

    run_id: str
    attempt: int
    key: str
    target: PublishTarget
    table: pa.Table
    digest: str

    def __repr__(self) -> str:
        return f"Request(run …{self.run_id[-6:]}, token {self.attempt})"


def any_held(held: Held) -> bool:
    return True


def needs_compute(held: Held) -> bool:
    return held.result is None


def can_authorize(held: Held) -> bool:
    return held.result is not None and held.mode == Mode.FORWARD_RECOVERY and not held.authorized


def can_publish(held: Held) -> bool:
    return held.authorized and held.outcome is None


def has_outcome(held: Held) -> bool:
    return held.outcome is not None


def can_commit_atomic(held: Held) -> bool:
    return held.result is not None and held.mode == Mode.ATOMIC


class RecoveryMachine(RuleBasedStateMachine):
    def __init__(self, bench: Bench) -> None:
        super().__init__()
        self.bench = bench
        bench.reset()
        self.history = History()
        self.flavour_of: dict[tuple[str, str], str] = {}
        self.held: list[Held] = []
        self.in_flight: list[Request] = []  # publish requests sent and not yet arrived at the sink
        self.refused: list[tuple[str, int, str]] = []  # writes predicted refused (run, attempt, what)
        self.world = self.read()  # as of the last invariant check: what preconditions look at
        self.calls: Counter[str] = Counter()  # per-example rule budget (see BUDGET)
        self.verified: dict[str, tuple[int, str]] = {}  # run -> (entries, status) whose evidence verified
        SITUATIONS.clear()

    # ---- helpers ---------------------------------------------------------------------------

    def within_budget(self, rule_name: str) -> bool:
        return self.calls[rule_name] < BUDGET[rule_name]

    def quiescent(self) -> bool:
        """Nothing but a submit can move: nothing held, deliverable, queued, leased or unresolved."""
        world = self.world
        return not (
            self.held
            or self.overtaken()
            or any(r.released_at_us is None for r in world.leases.values())
            or any(r.status == RunStatus.QUEUED for r in world.runs.values())
            or (reconcilable(world) and self.within_budget("reconcile"))
        )

    def overtaken(self) -> list[Request]:
        """In-flight requests whose run has a newer attempt than their token."""
        return [r for r in self.in_flight if self.world.runs[r.run_id].attempt > r.attempt]

    def svc(self, worker: int) -> RunService:
        return self.bench.platforms[worker].runs

    def read(self) -> World:
        return read_world(self.bench.platforms[0], self.bench.sink)

    def pick(self, data: st.DataObject, when: Callable[[Held], bool], *, paused: bool = False) -> Held:
        return data.draw(st.sampled_from([h for h in self.held if h.paused == paused and when(h)]))

    def has(self, when: Callable[[Held], bool], *, paused: bool = False) -> bool:
        return any(h.paused == paused and when(h) for h in self.held)

    def forget(self, held: Held) -> None:
        self.held.remove(held)

    def fenced_write(self, held: Held, what: str, call: Callable[[], object], *, swallows: bool = False) -> bool:
        """Make a write for ``held``'s attempt; predict from the lease row whether it must be refused.

        Returns True when it was (or had to be) refused. ``swallows``: the code under test catches
        StaleAttempt itself, so refusal shows only as nothing written.
        """
        before = self.read()
        problem = before.lease_problem(held.run_id, held.attempt)
        try:
            call()
            raised = False
        except StaleAttempt:
            raised = True
        after = self.read()
        written = attempt_writes(after.ledgers[held.run_id], held.attempt) - attempt_writes(
            before.ledgers[held.run_id], held.attempt
        )
        if problem:
            event(f"refused as {problem.split(' ')[0]}: {what}")
            self.refused.append((held.run_id, held.attempt, what))
            assert written == 0 and (raised or swallows), (
                f"invariant 3: {what} for attempt {held.attempt} of run {held.run_id} was not refused although "
                f"the attempt is {problem} on the database clock ({written} ledger entries committed)"
            )
        else:
            assert not raised, f"{what}: StaleAttempt for a live attempt {held} (lease {before.leases[held.run_id]})"
        return bool(problem) or raised

    def request(self, tenant: str, key: str, flavour: str) -> RunRequest:
        mode, day = FLAVOURS[flavour]
        forward_run = mode == Mode.FORWARD_RECOVERY
        return RunRequest(
            definition=self.bench.forward if forward_run else self.bench.atomic,
            base_dir=self.bench.base_dir / ("forward" if forward_run else "atomic"),
            parameters={"day": day},
            access=AccessContext(tenant=tenant, principal="machine"),
            provenance=Provenance(actor="machine", trigger="api", host="test"),
            idempotency_key=key,
            max_attempts=MAX_ATTEMPTS,
        )

    # ---- submit and claim ------------------------------------------------------------------

    @precondition(lambda self: self.within_budget("submit") or self.quiescent())
    @rule(slot=st.sampled_from(KEYS), flavour=st.sampled_from(sorted(FLAVOURS)), worker=WORKER, inline=st.booleans())
    def submit(self, slot: tuple[str, str], flavour: str, worker: int, inline: bool) -> None:
        self.calls["submit"] += 1
        known = self.flavour_of.get(slot)
        # SQLite's clock has millisecond steps: keep created_at distinct so that claim_next's
        # oldest-first order is deterministic and hypothesis can replay an example exactly.
        self.bench.advance_clock(SUBMIT_CLOCK_STEP_S)
        before = self.read()
        request = self.request(*slot, flavour)
        if known is not None and known != flavour:
            with pytest.raises(Conflict):
                self.svc(worker).submit(request, claim=inline)
            after = self.read()
            assert (after.counts, after.runs) == (before.counts, before.runs), "invariant 11: a conflict wrote"
            return
        try:
            submission = self.svc(worker).submit(request, claim=inline)
        except Conflict as error:
            raise AssertionError(f"invariant 11: submit of {slot} as {flavour} ({known=}) raised {error}") from error
        if known is not None:
            assert not submission.created and submission.run.run_id == self.history.keys[slot], (
                f"invariant 11: replay of {slot} returned run {submission.run.run_id} (created={submission.created}), "
                f"not {self.history.keys[slot]}"
            )
            after = self.read()
            assert (after.counts, after.runs) == (before.counts, before.runs), "invariant 11: a replay wrote"
            return
        assert submission.created, f"invariant 11: first submit of {slot} did not create a run"
        self.history.keys[slot] = submission.run.run_id
        self.flavour_of[slot] = flavour
        if inline:
            assert submission.run.attempt == 1 and submission.run.status == RunStatus.RUNNING
            self.held.append(Held(worker, submission.run.run_id, 1, FLAVOURS[flavour][0]))

    @initialize(flavour=st.sampled_from(["fwd-a", "fwd-b"]), worker=WORKER, inline=st.booleans())
    def first_submit(self, flavour: str, worker: int, inline: bool) -> None:
        """Every example starts with one forward run recorded, so the steps that follow have work."""
        self.submit(KEYS[0], flavour, worker, inline)

    @precondition(lambda self: any(r.status == RunStatus.QUEUED for r in self.world.runs.values()))
    @rule(worker=WORKER, then=st.sampled_from(CLAIM_THEN))
    def claim(self, worker: int, then: str) -> None:
        """claim_next() by one worker, which may go on at once with the attempt's next steps.

        ``then``: "stop" (the next steps come later, as their own rules), "compute" (run the
        steps: nothing is committed), "authorize" (compute, then the pre-dispatch commit of a
        forward run) — execute_forward's path up to the dispatch, uninterrupted.
        """
        before = self.read()
        queued = {r.run_id for r in before.runs.values() if r.status == RunStatus.QUEUED}
        claim = self.svc(worker).claim_next()
        if not queued:
            assert claim is None, f"claimed run {claim and claim.run.run_id} that was not queued"
            return
        assert claim is not None, f"no claim although {sorted(queued)} are queued: {describe(before)}"
        assert claim.run.run_id in queued
        assert claim.attempt == before.runs[claim.run.run_id].attempt + 1, "the attempt number did not grow by one"
        held = Held(worker, claim.run.run_id, claim.attempt, claim.run.mode)
        self.held.append(held)
        if then != "stop":
            self.do_compute(held)
        if then == "authorize" and can_authorize(held):
            self.do_authorize(held)

    # ---- one attempt's steps ---------------------------------------------------------------

    @precondition(lambda self: self.has(needs_compute))
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        self.do_compute(self.pick(data, needs_compute))

    def do_compute(self, held: Held) -> None:
        svc = self.svc(held.worker)
        run = svc.get(held.run_id)
        started = svc.attempt_of(run, held.attempt)
        if held.mode == Mode.FORWARD_RECOVERY:  # execute_forward prepares the sink before computing
            provider = forward.load_capable_provider(run)
            forward.preflight_target(started, provider)
            held.located = forward.prepare_target(started, provider)
        held.result = attempts.compute(started)

    @precondition(lambda self: self.within_budget("execute_whole_attempt") and self.has(needs_compute))
    @rule(data=st.data())
    def execute_whole_attempt(self, data: st.DataObject) -> None:
        """RunService.execute: the attempt from compute to its terminal commit, as a worker runs it."""
        self.calls["execute_whole_attempt"] += 1
        held = self.pick(data, needs_compute)
        self.forget(held)
        svc = self.svc(held.worker)
        refused = self.fenced_write(
            held, "executing the attempt", lambda: svc.execute(Claim(svc.get(held.run_id), held.attempt)),
            swallows=held.mode == Mode.FORWARD_RECOVERY,
        )  # fmt: skip
        if not refused:
            run = svc.get(held.run_id)
            assert run.status == RunStatus.SUCCEEDED, f"a live attempt ran to its end but the run is {run.status}"

    @precondition(lambda self: self.has(can_authorize))
    @rule(data=st.data())
    def predispatch_commit(self, data: st.DataObject) -> None:
        self.do_authorize(self.pick(data, can_authorize))

    def do_authorize(self, held: Held) -> None:
        svc = self.svc(held.worker)
        result = held.result
        assert result is not None
        refused = self.fenced_write(
            held, "the pre-dispatch commit",
            lambda: forward.authorize_dispatch(
                svc.attempt_of(svc.get(held.run_id), held.attempt), result, held.located
            ),
        )  # fmt: skip
        if refused:
            self.forget(held)  # execute_forward stops here: the sweeper proves the attempt absent
        else:
            held.authorized = True

    @precondition(lambda self: self.has(can_publish))
    @rule(data=st.data(), response=st.sampled_from(RESPONSES))
    def publish(self, data: st.DataObject, response: str) -> None:
        self.do_publish(self.pick(data, can_publish), response)

    def do_publish(self, held: Held, response: str) -> None:
        """Send the stored bytes to the sink with the attempt as token, then handle the answer.

        ``response``: "commit" applies it at once (forward.dispatch's path), "keep" leaves it for a
        later terminal_commit step, "lost" drops it (a crash after the call), "unknown" drops it
        and records outcome_unknown (dispatch on an inconclusive answer), "in_flight": the request
        is still on its way when the worker times out and records outcome_unknown — it reaches the
        sink in a later ``deliver`` step, possibly after a reconcile fenced the key.
        """
        svc = self.svc(held.worker)
        run = svc.get(held.run_id)
        request = Request(held.run_id, held.attempt, forward.publication_key(run), forward.publish_target(run),
                          results.decode_ipc(svc.result_bytes(held.run_id)), str(run.output_digest))  # fmt: skip
        if response == "in_flight":
            self.forget(held)
            self.in_flight.append(request)
            self.record_unknown(held, run)
            return
        held.outcome, held.recorded_digest = self.send(request), request.digest
        if response == "commit":
            self.commit_outcome(held)
        elif response != "keep":
            self.forget(held)
        if response == "unknown":
            self.record_unknown(held, run)

    def send(self, request: Request) -> PublishOutcome:
        """provider.publish, its answer checked against the manifest the sink held just before."""
        before = self.read()
        manifest = before.manifests.get(request.key)
        provider = forward.load_capable_provider(before.runs[request.run_id])
        outcome = provider.publish(request.key, request.attempt, request.table, request.digest, request.target)
        check_publish_answer(manifest, request.attempt, request.digest, outcome)
        stale = before.lease_problem(request.run_id, request.attempt)
        event(f"publish answered {type(outcome).__name__}" + (" (stale attempt)" if stale else ""))
        return outcome

    def record_unknown(self, held: Held, run: Run) -> None:
        svc = self.svc(held.worker)
        self.fenced_write(
            held, "recording outcome_unknown",
            lambda: forward.record_unknown(
                svc.db, run, held.attempt, "no conclusive answer", evidence_key=svc.evidence_key
            ),
            swallows=True,
        )  # fmt: skip

    @precondition(lambda self: self.overtaken())
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """A request sent earlier reaches the sink now; nobody is waiting for its answer any more.

        Only once a newer attempt (a reconcile or resume) exists for its run: arriving before that
        is the "unknown" response of ``publish``, already a step of its own.
        """
        request = data.draw(st.sampled_from(self.overtaken()))
        self.in_flight.remove(request)
        self.send(request)

    @precondition(lambda self: self.has(has_outcome))
    @rule(data=st.data())
    def terminal_commit(self, data: st.DataObject) -> None:
        self.commit_outcome(self.pick(data, has_outcome))

    def commit_outcome(self, held: Held) -> None:
        """forward.apply_publish_outcome for the answer the worker holds: the fenced terminal commit."""
        self.forget(held)
        svc = self.svc(held.worker)
        outcome = held.outcome
        assert outcome is not None
        run = svc.get(held.run_id)
        refused = self.fenced_write(
            held, "the terminal commit",
            lambda: forward.apply_publish_outcome(
                svc.db, run, held.attempt, outcome, held.recorded_digest, evidence_key=svc.evidence_key
            ),
            swallows=True,
        )  # fmt: skip
        conclusive = isinstance(outcome, Published | AlreadyPublished) and outcome.digest == held.recorded_digest
        if not refused and conclusive:
            status = svc.get(held.run_id).status
            assert status == RunStatus.SUCCEEDED, f"a conclusive answer was committed but the run is {status}"

    @precondition(lambda self: self.has(can_commit_atomic))
    @rule(data=st.data())
    def atomic_terminal_commit(self, data: st.DataObject) -> None:
        self.do_atomic_commit(self.pick(data, can_commit_atomic))

    def do_atomic_commit(self, held: Held) -> None:
        self.forget(held)
        svc = self.svc(held.worker)
        result = held.result
        assert result is not None
        refused = self.fenced_write(
            held,
            "the atomic terminal commit",
            lambda: svc.commit_atomic_success(svc.get(held.run_id), held.attempt, result),
        )
        if not refused:
            assert svc.get(held.run_id).status == RunStatus.SUCCEEDED

    @precondition(lambda self: self.has(any_held) and self.within_budget("heartbeat"))
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        self.calls["heartbeat"] += 1
        held = self.pick(data, any_held)
        db = self.bench.platforms[held.worker].db

        def beat() -> None:  # what core.heartbeat.KeepAlive does each beat
            with fencing.fenced(db, MODULE, held.run_id, held.attempt) as conn:
                leases.heartbeat(conn, db, MODULE, held.run_id, held.attempt, LEASE_TTL_S)

        self.fenced_write(held, "a heartbeat", beat)  # a refused worker keeps going: its writes must fail

    @precondition(lambda self: self.has(any_held) and self.within_budget("abandon"))
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        """A crash: the worker forgets the attempt (and whatever answer it had)."""
        self.calls["abandon"] += 1
        self.forget(self.pick(data, any_held))

    @precondition(lambda self: self.has(any_held) and self.within_budget("pause"))
    @rule(data=st.data())
    def pause(self, data: st.DataObject) -> None:
        """SIGSTOP (or a long GC pause): the worker keeps its attempt in memory but does nothing."""
        self.calls["pause"] += 1
        self.pick(data, any_held).paused = True

    @precondition(lambda self: self.has(lambda h: h.paused, paused=True))
    @rule(data=st.data(), response=st.sampled_from(RESPONSES))
    def wake(self, data: st.DataObject, response: str) -> None:
        """The paused worker continues exactly where it stopped, whatever happened meanwhile."""
        held = self.pick(data, lambda h: h.paused, paused=True)
        held.paused = False
        if needs_compute(held):
            self.do_compute(held)
        elif can_authorize(held):
            self.do_authorize(held)
        elif can_publish(held):
            self.do_publish(held, response)
        elif has_outcome(held):
            self.commit_outcome(held)
        else:
            self.do_atomic_commit(held)

    # ---- time, sweeper, reconcile ----------------------------------------------------------

    @precondition(lambda self: any(not r.live(r.attempt, self.world.now_us) for r in self.world.leases.values()))
    @rule(seconds=st.sampled_from([LEASE_TTL_S / 2, LEASE_TTL_S + 1]))
    def advance_clock(self, seconds: float) -> None:
        self.bench.advance_clock(seconds)

    @precondition(lambda self: expected_sweep(self.world))
    @rule(worker=WORKER)
    def sweep(self, worker: int) -> None:
        before = self.read()
        expected = expected_sweep(before)
        decisions = sweeper.sweep(self.bench.platforms[worker].db, evidence_key=self.svc(worker).config.evidence_key)
        got = {(d.run_id, d.attempt): d.decision for d in decisions}
        for decision in got.values():
            event(f"sweep decided {decision}")
        for slot, decision in expected.items():
            number = 8 if decision == "outcome_unknown" else 9
            assert got.get(slot) == decision, (
                f"invariant {number}: the sweeper decided {got.get(slot)!r} for expired attempt {slot[1]} of run "
                f"{slot[0]}, expected {decision!r} ({describe(before)})"
            )
        assert set(got) == set(expected), f"the sweeper decided live attempts: {set(got) - set(expected)}"
        after = self.read()
        for (run_id, _attempt), decision in expected.items():
            status = SWEPT_STATUS.get(decision, RunStatus.OUTCOME_UNKNOWN)
            assert after.runs[run_id].status == status, (
                f"invariant {8 if decision == 'outcome_unknown' else 9}: after {decision!r} run {run_id} is "
                f"{after.runs[run_id].status}"
            )

    @precondition(lambda self: self.within_budget("reconcile") and reconcilable(self.world))
    @rule(data=st.data(), worker=WORKER, resume=st.booleans())
    def reconcile(self, data: st.DataObject, worker: int, resume: bool) -> None:
        """Reconcile (and maybe resume) a run: mostly an unresolved one, sometimes any (a Conflict)."""
        self.calls["reconcile"] += 1
        candidates = reconcilable(self.world)
        run_id = data.draw(st.sampled_from(candidates + sorted(set(self.world.runs) - set(candidates))))
        before = self.read()
        finding, resumed = expected_reconcile(before, run_id, resume)
        try:
            result = reconciliation.reconcile(
                self.svc(worker), run_id, access=RECONCILER, provenance=RECONCILER_PROVENANCE, resume=resume
            )
        except Conflict:
            assert finding == "conflict", f"reconcile refused run {run_id}; expected {finding!r}: {describe(before)}"
            after = self.read()
            assert (after.counts, after.runs) == (before.counts, before.runs), "a refused reconcile wrote"
            return
        except LeaseUnavailable:
            row = before.leases[run_id]
            assert not row.live(row.attempt, before.now_us), f"reconcile found no lease although none was live: {row}"
            return
        event(f"reconcile found {finding}" + (" and resumed" if resumed else ""))
        assert (result.finding, result.resumed) == (finding, resumed), (
            f"reconcile of run {run_id} found {result.finding!r} (resumed={result.resumed}), expected {finding!r} "
            f"(resumed={resumed}); its detail: {result.detail}; {describe(before)}"
        )
        after = self.read()
        run = after.runs[run_id]
        if finding == "present" or resumed:
            assert run.status == RunStatus.SUCCEEDED, f"invariant 7: {finding} but the run is {run.status}"
        elif finding == "absent":
            manifest = after.manifest_for(run)
            assert run.recovery_status == RecoveryStatus.RECONCILED_ABSENT
            assert manifest is not None and manifest["kind"] == "fence", f"invariant 14: absent, no fence: {manifest}"

    def teardown(self) -> None:
        # Steer generation towards examples that reach many distinct situations: the deep ones
        # (a stale publish after a fencing reconcile) are a chain of rare steps.
        target(float(len(SITUATIONS)), label="distinct protocol situations")

    @invariant()
    def protocol_invariants(self) -> None:
        self.world = world = self.read()
        check_all(world, self.history)
        check_chains(self.bench, world, self.verified)


def check_publish_answer(manifest: dict[str, Any] | None, token: int, digest: str, outcome: PublishOutcome) -> None:
    """The sink's answer must follow from its manifest before the call (DESIGN §9)."""
    if manifest is not None and manifest["kind"] == "publication":
        assert isinstance(outcome, AlreadyPublished) and outcome.digest == manifest["digest"], (
            f"invariant 6: the key is published (token {manifest['token']}) but publish with token {token} "
            f"answered {outcome}"
        )
    elif manifest is not None and int(manifest["token"]) > token:
        assert isinstance(outcome, Fenced), (
            f"invariant 14: the key is fenced at {manifest['token']} but publish with token {token} answered {outcome}"
        )
    else:
        assert isinstance(outcome, Published) and outcome.digest == digest, f"publish answered {outcome}"


def expected_sweep(world: World) -> dict[tuple[str, int], str]:
    """DESIGN §6's sweeper rule applied to every expired, unreleased lease."""
    expected: dict[tuple[str, int], str] = {}
    for run_id, row in world.leases.items():
        if row.released_at_us is not None or row.expires_at_us > world.now_us:
            continue
        entries = world.ledgers[run_id]
        if any(e.kind == evidence.DISPATCH_AUTHORIZED for e in entries):
            expected[(run_id, row.attempt)] = "outcome_unknown"
        else:
            run = world.runs[run_id]
            expected[(run_id, row.attempt)] = "recovered" if row.attempt < run.max_attempts else "failed"
    return expected


def reconcilable(world: World) -> list[str]:
    """Runs a reconcile applies to: unresolved after dispatch, or proven absent (to resume)."""
    return sorted(
        r.run_id for r in world.runs.values()
        if r.status == RunStatus.OUTCOME_UNKNOWN or r.recovery_status == RecoveryStatus.RECONCILED_ABSENT
    )  # fmt: skip


def expected_reconcile(world: World, run_id: str, resume: bool) -> tuple[str, bool]:
    """What reconcile must find, from the run's projection and the sink's manifest. An authorized
    attempt whose lease expired is swept to outcome_unknown by the reconcile itself first."""
    run = world.runs[run_id]
    if run.mode != Mode.FORWARD_RECOVERY or run.publication_idempotency_key is None:
        return "conflict", False
    if run.recovery_status == RecoveryStatus.RECONCILED_ABSENT:
        return "absent", resume
    lease = world.leases.get(run_id)
    swept = (
        run.status == RunStatus.RUNNING and run.recovery_status == RecoveryStatus.DISPATCH_AUTHORIZED
        and lease is not None and lease.released_at_us is None and lease.expires_at_us <= world.now_us
    )  # fmt: skip
    if not swept and run.status not in (RunStatus.OUTCOME_UNKNOWN, RunStatus.EVIDENCE_FAILED):
        return "conflict", False
    manifest = world.manifest_for(run)
    if manifest is not None and manifest["kind"] == "publication":
        return ("present" if manifest["digest"] == run.output_digest else "mismatch"), False
    return "absent", resume


def check_chains(bench: Bench, world: World, verified: dict[str, tuple[int, str]]) -> None:
    """Every run's evidence chain verifies, with the facts its state claims (re-checked on change)."""
    platform = bench.platforms[0]
    with platform.db.read() as conn:
        for run in world.runs.values():
            head = (len(world.ledgers[run.run_id]), str(run.status))
            if verified.get(run.run_id) == head:
                continue
            verification = derivation.verify_run(conn, run, platform.runs.config.evidence_key)
            assert verification.ok, f"evidence of run {run.run_id} ({run.status}) fails: {verification.reason}"
            verified[run.run_id] = head


@pytest.fixture
def bench(db_url: str, tmp_path: Path) -> Iterator[Bench]:
    workbench = Bench(db_url, tmp_path)
    yield workbench
    workbench.close()


@pytest.mark.timeout(TIMEOUT_S)
def test_recovery_protocol_holds_under_interleavings(bench: Bench) -> None:
    """Invariants 3, 6, 7, 8, 9, 11, 14 hold over hypothesis-chosen interleavings of the real protocol steps."""
    REACHED.clear()
    run_state_machine_as_test(lambda: RecoveryMachine(bench), settings=machine_settings())
    print("situations reached:", dict(sorted(REACHED.items())))


def test_long_profile_is_registered() -> None:
    """``--hypothesis-profile=long`` selects the soak budget: the profile exists and is larger than ci."""
    from hypothesis import settings

    long = settings.get_profile(LONG_PROFILE)
    assert long.max_examples > settings.get_profile("ci").max_examples
    assert long.stateful_step_count >= settings.get_profile("ci").stateful_step_count
