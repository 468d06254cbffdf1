"""The worker loop (DESIGN §6 claim and sweeper, §10 distributed deployment).

A worker sweeps expired leases every sweep interval, claims queued runs (``FOR UPDATE SKIP
LOCKED`` on PostgreSQL) up to its concurrency, and carries each claimed attempt to its end in a
thread (the core is synchronous; :meth:`RunService.execute` heartbeats the lease meanwhile).
Any number of workers on any number of hosts may share one database: claims and sweeper
decisions are guarded updates, so two workers never take or decide the same attempt.

Database outages: claiming and sweeping are guarded statements, so they are retried after a
bounded exponential back-off. An attempt that loses the database mid-execution is never
retried here: it is abandoned, its lease expires, and a sweeper decides it by the protocol
(proven absent and retried before dispatch authorization, ``outcome_unknown`` after it).

Stopping: :meth:`Worker.request_stop` stops claiming; in-flight attempts run to their end (or their
leases expire) and nothing is half written, because every write of an attempt is one fenced
transaction. SIGTERM/SIGINT in the CLI (:func:`install_signal_handlers`) also interrupt the service's
executions (dataflow.execution.interruption): an attempt not yet authorized to dispatch stops its engine within a
second and ends ``cancelled`` (reason ``interrupted``, its lease released); one already authorized
finishes its publication.

Heartbeat: the worker keeps its row in the fleet table (dataflow.protocol.fleet): registered at start,
beaten every ``fleet.beat_interval_s(worker_ttl_s)`` from this loop (one UPDATE; the loop's waits are
capped so a beat is never late by more than a poll), and marked stopped when :meth:`Worker.run` returns.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

import structlog

from durable_dataflow.core.errors import DataflowError, InputError, StaleAttempt, StorageUnavailable
from durable_dataflow.dataflow.protocol import fleet, runs, sweeper
from durable_dataflow.dataflow.protocol.runs import Run, RunStatus
from durable_dataflow.dataflow.protocol.service import Claim, RunService
from durable_dataflow.dataflow.schedules import schedules

# The database pool holds 8 + 16 connections; each in-flight attempt uses up to two at once (its
# work and its heartbeat), plus the loop's own: more threads would wait on the pool, not work.
CONCURRENCY_MAX = 8
SWEEP_INTERVAL_S_DEFAULT = 1.0  # a dead holder's run is recovered by the next sweep (core/holders.py)
# Seconds between evaluations of the schedules' due ticks (dataflow.schedules.schedules; every worker may evaluate).
SCHEDULE_INTERVAL_S_DEFAULT = 15.0
# The most one turn of the loop spends evaluating schedules (after a whole schedule): a backlog of many
# due schedules is worked off over several turns, each followed by a claim, so runs are still claimed.
SCHEDULE_BUDGET_S = 1.0
POLL_INTERVAL_S_DEFAULT = 1.0
ABANDONED_NOTE = "left to the sweeper once its lease expires; never retried blindly"
INTERVAL_S_MIN = 0.01
# The earliest next-due instant is read again at most this often (a worker polling every 10 ms read it
# once per run): a schedule applied meanwhile with an earlier tick is decided at most this late.
DUE_PROBE_S_MIN = 1.0
INTERVAL_S_MAX = 3600.0
# Back-off after the database was unavailable: doubles from the initial delay up to the maximum.
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 10.0
BACKOFF_FACTOR = 2.0

T = TypeVar("T")
# Told of each attempt that ended its run by itself: the run as it ended, and the attempt's seconds from
# claim to end (the worker's metrics observe run durations and failures through it).
RunObserver = Callable[[Run, float], None]


@dataclass(frozen=True)
class WorkerOptions:
    """How one worker process behaves; validated on construction."""

    concurrency: int = 1
    once: bool = False  # handle one claim (or none, if nothing is queued) and exit
    until_idle: bool = False  # exit once nothing is queued or running anywhere and nothing is in flight
    sweep_interval_s: float = SWEEP_INTERVAL_S_DEFAULT
    schedule_interval_s: float = SCHEDULE_INTERVAL_S_DEFAULT
    poll_interval_s: float = POLL_INTERVAL_S_DEFAULT
    backoff_initial_s: float = BACKOFF_INITIAL_S
    backoff_max_s: float = BACKOFF_MAX_S
    # The heartbeat row's TTL (dataflow.protocol.fleet): DATAFLOW_WORKER_TTL_S, else 15 s; beats every third.
    worker_ttl_s: float = field(default_factory=fleet.ttl_from_env)

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= CONCURRENCY_MAX:
            raise InputError(f"concurrency must be between 1 and {CONCURRENCY_MAX}, got {self.concurrency}")
        intervals = ("sweep_interval_s", "schedule_interval_s", "poll_interval_s", "backoff_initial_s", "backoff_max_s")
        for name in intervals:
            value = getattr(self, name)
            if not INTERVAL_S_MIN <= value <= INTERVAL_S_MAX:
                raise InputError(f"{name} must be between {INTERVAL_S_MIN} and {INTERVAL_S_MAX} s, got {value}")
        fleet.ttl_from_env(self.worker_ttl_s)  # refuses a TTL out of its bounds


@dataclass
class WorkerSummary:
    """What one worker did, for its last log line and for tests."""

    claimed: int = 0
    # Each attempt once, under its own outcome: the status it ended the run with, or "fenced" / "abandoned".
    outcomes: dict[str, int] = field(default_factory=dict)
    abandoned: int = 0  # attempts left to the sweeper (fenced off, database lost, unexpected error)
    swept: dict[str, int] = field(default_factory=dict)  # sweeper decision -> count
    storage_failures: int = 0
    stopped_by_request: bool = False
    schedule_evaluations: int = 0  # evaluations of the due schedules ended (each decided what was due then)


class Backoff:
    """Bounded exponential delay for retrying guarded statements while the database is down."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._next_s = initial_s

    def next_delay_s(self) -> float:
        delay = self._next_s
        self._next_s = min(self._max_s, self._next_s * BACKOFF_FACTOR)
        return delay

    def reset(self) -> None:
        self._next_s = self._initial_s


class StorageOutage:
    """One outage of the platform database as the logs tell it: ``storage.unavailable`` at each failed
    try the caller reports (it retries after a Backoff, so the repeats thin out up to the back-off's
    maximum), each with the outage's age and failures so far, then ``storage.recovered`` once, with
    the outage's duration, at the first success of an operation that failed during it: another
    operation's success (a heartbeat's, while claims time out behind a lock) does not end it, and one
    that failed once and is not tried again for a while (a schedule evaluation) does not hold it open.
    ``clock`` is injected for tests."""

    def __init__(self, log: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._clock = clock
        self._started_s: float | None = None
        self._failures = 0
        self._failing: set[str] = set()  # the operations that failed during the outage

    def failed(self, operation: str, error: StorageUnavailable, retry_in_s: float) -> None:
        now_s = self._clock()
        if self._started_s is None:
            self._started_s, self._failures = now_s, 0
        self._failures += 1
        self._failing.add(operation)
        self._log.warning(
            "storage.unavailable", operation=operation, retry_in_s=round(retry_in_s, 3), failures=self._failures,
            outage_s=round(now_s - self._started_s, 3), error=error.message,
        )  # fmt: skip

    def succeeded(self, operation: str) -> bool:
        """Note ``operation``'s success; True when that ended the outage (the caller's back-off ends too)."""
        if self._started_s is None or operation not in self._failing:
            return False
        self._failing.clear()
        outage_s = round(self._clock() - self._started_s, 3)
        self._log.info("storage.recovered", operation=operation, outage_s=outage_s, failures=self._failures)
        self._started_s = None
        return True


class Worker:
    """Sweeps, claims and executes runs of one platform database until stopped or idle."""

    def __init__(
        self,
        service: RunService,
        options: WorkerOptions | None = None,
        *,
        log: Any = None,
        observe: RunObserver | None = None,
        role: fleet.Role = fleet.Role.WORKER,
    ) -> None:
        self.service = service
        self.options = options or WorkerOptions()
        self._observe = observe
        self.heartbeat = fleet.Heartbeat(
            service.db, service.config.holder, role, self.options.concurrency, self.options.worker_ttl_s
        )
        self.summary = WorkerSummary()
        self._log = log if log is not None else structlog.get_logger("dataflow.worker")
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._inflight: dict[futures.Future[None], Claim] = {}
        self._backoff = Backoff(self.options.backoff_initial_s, self.options.backoff_max_s)
        self._outage = StorageOutage(self._log)
        self._last_sweep_s: float | None = None
        self._last_schedules_s: float | None = None
        # The earliest schedule's next-due instant on this process's monotonic clock (None: unknown or none),
        # and when it was last read (``_schedules_due``).
        self._next_due_s: float | None = None
        self._due_probed_s = 0.0
        self._summary_lock = threading.Lock()
        # Whether the last claim found nothing. The next polls then read whether anything is queued (one
        # indexed statement, autocommit on PostgreSQL) before claiming: an idle claim is a transaction of
        # up to four round trips (the fairest tenant's run, then any unlocked one), and idle workers polling
        # every 10 ms took the CPU a busy submitter needed (docs/performance.md, §2).
        self._found_nothing = False

    # ---- control ---------------------------------------------------------------------------

    def request_stop(self, reason: str = "requested") -> None:
        """Stop claiming; in-flight attempts finish (or their leases expire).

        Safe from any thread and from a signal handler: it only sets a flag (logging here could
        deadlock on the log's write lock held by the interrupted main thread); the loop logs it.
        """
        if not self._stop.is_set():
            self._stop_reason = reason
            self.summary.stopped_by_request = True
            self._stop.set()

    def run(self) -> WorkerSummary:
        """The loop; it runs forever unless stopped, ``once`` or ``until_idle`` (see WorkerOptions)."""
        config = self.service.config
        self._log.info(
            "worker.started", holder=config.holder, lease_ttl_s=config.lease_ttl_s,
            concurrency=self.options.concurrency, once=self.options.once, until_idle=self.options.until_idle,
        )  # fmt: skip
        pool = futures.ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="dataflow-attempt")
        try:
            while not self._stop.is_set() and self._step(pool):
                pass
            if self._stop_reason is not None:
                self._log.info("worker.stopping", event_reason=self._stop_reason, inflight=len(self._inflight))
        finally:
            pool.shutdown(wait=True)  # in-flight attempts end by themselves: never cut one short
            self._reap()
            self._mark_stopped()
        self._log.info(
            "worker.stopped", claimed=self.summary.claimed, outcomes=self.summary.outcomes,
            abandoned=self.summary.abandoned, swept=self.summary.swept,
            storage_failures=self.summary.storage_failures,
        )  # fmt: skip
        return self.summary

    # ---- one turn of the loop --------------------------------------------------------------

    def _step(self, pool: futures.ThreadPoolExecutor) -> bool:
        """One turn: reap, beat and sweep when due, claim when there is room. False ends the loop."""
        self._reap()
        if self.heartbeat.due_in_s(time.monotonic()) == 0 and not self._guarded("beat", self._beat)[0]:
            return True
        if self._sweep_due() and not self._guarded("sweep", self._sweep)[0]:
            return True
        if self._schedules_due() and not self._guarded("schedules", self._evaluate_schedules)[0]:
            return True
        if len(self._inflight) >= self.options.concurrency:
            self._wait_for_room()
            return True
        if self._stop.is_set():  # asked for during this turn's beat, sweep or schedules (a SIGTERM's handler
            return False  # runs wherever the main thread is): a run claimed now would only be cancelled
        queued: bool | None = True
        if self._found_nothing:  # an idle poll: one indexed read first, the claim's transaction only if worth it
            ok, queued = self._guarded("claim", self._anything_queued)
            if not ok:
                return True
        claim = None
        if queued:
            ok, claim = self._guarded("claim", self.service.claim_next)
            if not ok:  # claim again, not probe, until it works: a probe's success would end the back-off
                self._found_nothing = False
                return True
            self._found_nothing = claim is None
        if claim is not None:
            self._start(pool, claim)
            if self.options.once:
                self._wait_for_inflight()
                return False
            return True
        if self.options.once:
            self._log.info("worker.nothing_queued")
            return False
        if self.options.until_idle and not self._inflight and self._idle():
            self._log.info("worker.idle")
            return False
        self._wait_for_work()
        return True

    def _anything_queued(self) -> bool:
        with self.service.db.read() as conn:
            return runs.any_queued(conn)

    def _idle(self) -> bool:
        """Sweep first (a dead worker's run is not idle until decided), then: nothing queued or running."""
        ok, _ = self._guarded("sweep", self._sweep)
        if not ok:
            return False
        ok, busy = self._guarded("idle_check", self._runs_pending)
        return ok and not busy

    def _runs_pending(self) -> bool:
        with self.service.db.read() as conn:
            return runs.any_queued(conn) or bool(runs.list_page(conn, status=RunStatus.RUNNING, limit=1))

    def _schedules_due(self) -> bool:
        """An evaluation is due at the earliest schedule's next-due instant, read after the last evaluation
        (and again every poll interval, at most once per ``DUE_PROBE_S_MIN``: an apply meanwhile may bring
        it closer), and at the latest ``schedule_interval_s`` after the last one."""
        last = self._last_schedules_s
        now = time.monotonic()
        if last is None or now - last >= self.options.schedule_interval_s:
            return True
        if self._next_due_s is not None and now >= self._next_due_s:
            return True
        if now - self._due_probed_s >= max(self.options.poll_interval_s, DUE_PROBE_S_MIN):
            self._due_probed_s = now
            try:
                until_s = schedules.seconds_until_due(self.service.db)
            except StorageUnavailable:  # the claim after it meets the outage too, logs it and backs off
                until_s = None
            self._next_due_s = None if until_s is None else now + until_s
            return self._next_due_s is not None and now >= self._next_due_s
        return False

    def _evaluate_schedules(self) -> None:
        """Decide and submit the due ticks; the tick keys make it safe for every worker to do so."""
        self._last_schedules_s = time.monotonic()
        self._next_due_s = None
        try:
            evaluation = schedules.evaluate(self.service.db, self.service, budget_s=SCHEDULE_BUDGET_S)
            if not evaluation.complete:  # schedules are still due: evaluate again after this turn's claim
                self._next_due_s = time.monotonic()
        except StorageUnavailable:
            raise  # the caller backs off
        except Exception as error:  # a bug in one tenant's schedule must not stop this worker's runs
            self._log.error("schedules.unevaluated", error_type=type(error).__name__,
                            note="runs are still claimed; the next evaluation tries again")  # fmt: skip
            return
        finally:
            self.summary.schedule_evaluations += 1
        for decided in evaluation.decisions:
            if decided.new:
                self._log.info("schedule.tick", tenant=decided.tenant, schedule=decided.name, tick=decided.tick,
                               decision=decided.decision, run_id=decided.run_id)  # fmt: skip

    def _sweep_due(self) -> bool:
        last = self._last_sweep_s
        return last is None or time.monotonic() - last >= self.options.sweep_interval_s

    def _sweep(self) -> None:
        decisions = sweeper.sweep(self.service.db, evidence_key=self.service.config.evidence_key)
        self._last_sweep_s = time.monotonic()
        for decision in decisions:
            self.summary.swept[decision.decision] = self.summary.swept.get(decision.decision, 0) + 1
            if decision.decision != sweeper.Decision.SKIPPED:
                self._log.info(
                    "sweep.decided", run_id=decision.run_id, attempt=decision.attempt, outcome=decision.decision
                )
        if len(decisions) >= sweeper.SWEEP_BATCH_MAX:
            self._last_sweep_s = None  # a full batch: more expired leases may wait, sweep again next turn

    def _guarded(self, operation: str, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """Run a guarded (claim/sweep/read) operation; on a down database log, back off, report failure."""
        try:
            value = fn()
        except StorageUnavailable as error:
            self.summary.storage_failures += 1
            delay_s = self._backoff.next_delay_s()
            self._outage.failed(operation, error, delay_s)
            self._stop.wait(delay_s)
            return False, None
        if self._outage.succeeded(operation):
            self._backoff.reset()
        return True, value

    def _beat(self) -> None:
        """The heartbeat row (one UPDATE), with the holder lock taken again first if its session was lost."""
        lock = self.service.holder_lock
        lock.ensure()
        self.heartbeat.maybe_beat(time.monotonic(), len(self._inflight), lock.held)

    def _mark_stopped(self) -> None:
        try:
            self.heartbeat.stopped()
        except StorageUnavailable as error:  # the row then reads dead after its TTL: still the truth, roughly
            self._log.warning("worker.unmarked", error=error.message, note="the row reads dead after its TTL")

    def _wait_s(self) -> float:
        """A wait of the loop: the poll interval, cut short when the next beat is due sooner."""
        return max(INTERVAL_S_MIN, min(self.options.poll_interval_s, self.heartbeat.due_in_s(time.monotonic())))

    def _wait_for_room(self) -> None:
        futures.wait(list(self._inflight), timeout=self._wait_s(), return_when=futures.FIRST_COMPLETED)

    def _wait_for_inflight(self) -> None:
        """Until every attempt in flight ended, waking every poll interval (and beating when due): a signal
        the kernel gave another thread only marks the handler due, and it runs when this (main) thread runs
        Python again."""
        while futures.wait(list(self._inflight), timeout=self._wait_s()).not_done:
            if self.heartbeat.due_in_s(time.monotonic()) == 0:
                self._guarded("beat", self._beat)

    def _wait_for_work(self) -> None:
        self._stop.wait(self._wait_s())

    # ---- attempts --------------------------------------------------------------------------

    def _start(self, pool: futures.ThreadPoolExecutor, claim: Claim) -> None:
        self.summary.claimed += 1
        self._log.info("run.claimed", run_id=claim.run.run_id, attempt=claim.attempt, mode=str(claim.run.mode))
        self._inflight[pool.submit(self._execute, claim)] = claim

    def _reap(self) -> None:
        for done in [f for f in self._inflight if f.done()]:
            claim = self._inflight.pop(done)
            error = done.exception()
            if error is not None:  # only the run observer's bug can escape _execute: it must not pass unseen
                self._log.error("attempt_thread.failed", run_id=claim.run.run_id, attempt=claim.attempt,
                                error_type=type(error).__name__, note="the run is as its own lines say")  # fmt: skip

    def _execute(self, claim: Claim) -> None:
        """Carry one attempt to its end; the attempt never raises (a failure leaves it to the sweeper), only
        the observer called after ``run.finished`` can (``_reap`` logs it)."""
        log = self._log.bind(run_id=claim.run.run_id, attempt=claim.attempt)
        started_s = time.monotonic()
        try:
            run = self.service.execute(claim)
        except StorageUnavailable as error:
            self._abandoned(log, "storage_unavailable", error.message)
            return
        except StaleAttempt as error:  # a sweep, a cancel or a newer attempt closed it: it owns the run now
            self._abandoned(log, error.code, error.message, "fenced off: this attempt writes nothing more")
            return
        except DataflowError as error:
            self._abandoned(log, error.code, error.message)
            return
        except Exception as error:  # a bug must not take the worker down; the lease decides the attempt
            self._abandoned(log, "unexpected_error", type(error).__name__)
            return
        if not ended_by(run, claim.attempt):
            # The protocol returns quietly when a step is fenced off (forward's authorization, a sink's
            # fence, a terminal commit after the lease was lost): the run's state then belongs to the
            # sweeper or to a newer attempt, never to this one, whose own outcome is "fenced".
            note = "fenced off: this attempt wrote no end of its own; the run's state is another's"
            self._abandoned(log, StaleAttempt.code, "the attempt was fenced off", note, run=run)
            return
        with self._summary_lock:
            self.summary.outcomes[str(run.status)] = self.summary.outcomes.get(str(run.status), 0) + 1
        elapsed_s = time.monotonic() - started_s
        log.info(
            "run.finished", outcome=str(run.status), recovery_status=str(run.recovery_status),
            unresolved=run.unresolved, error_code=run.error_code,
        )  # fmt: skip
        if self._observe is not None:  # after the run's own line: an observer's bug cannot hide its end
            self._observe(run, elapsed_s)

    def _abandoned(
        self, log: Any, reason: str, detail: str, note: str = ABANDONED_NOTE, run: Run | None = None
    ) -> None:
        """Count and log an attempt that ended without a result of its own, once, under its reason;
        ``run`` is the run as another left it (logged as ``run_status``/``run_attempt``, never as ours)."""
        outcome = "fenced" if reason == StaleAttempt.code else "abandoned"
        with self._summary_lock:
            self.summary.abandoned += 1
            self.summary.outcomes[outcome] = self.summary.outcomes.get(outcome, 0) + 1
        current = {} if run is None else {"run_status": str(run.status), "run_attempt": run.attempt}
        log.warning(
            "attempt.abandoned", outcome=outcome, reason=reason, error=detail, note=note, **current,
        )  # fmt: skip


def ended_by(run: Run, attempt: int) -> bool:
    """Whether ``run`` (as read after attempt ``attempt`` returned) shows that attempt's own end: it
    still names that attempt and is terminal. A newer attempt, or a run queued or running again, means
    the attempt was fenced off and its state is another's to report."""
    return run.attempt == attempt and run.status not in (RunStatus.QUEUED, RunStatus.RUNNING)


SignalHandler = Callable[[int, FrameType | None], Any] | int | None


def install_signal_handlers(worker: Worker) -> dict[int, SignalHandler]:
    """SIGTERM/SIGINT stop claiming and interrupt the executions in flight (call from the main thread,
    which only waits: the attempts run in the pool's threads); returns the previous handlers."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        worker.service.interruption.request(name, "worker")  # two attribute writes: safe here
        worker.request_stop(name)

    previous: dict[int, SignalHandler] = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, on_signal)
    return previous


def restore_signal_handlers(previous: dict[int, SignalHandler]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
