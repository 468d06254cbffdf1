"""The run service: one platform database's facade over submission, claims and attempts (DESIGN §6).

It owns what lives as long as the process: the definitions cache, the holder lock, the heartbeat
thread, the interruption its signal handlers request, and the attempts it carries. The protocol's
steps live in their modules and take values, not the service: submission in
:mod:`~durable_dataflow.dataflow.protocol.submit`, an attempt's facts and shared steps (claim,
compute, the atomic terminal commit, failure) in :mod:`~durable_dataflow.dataflow.protocol.attempt`,
forward recovery in :mod:`~durable_dataflow.dataflow.protocol.forward`.

Commit budget (DESIGN §10): an inline atomic run costs 2 commits — record+claim, then the fenced
terminal transaction; a replay of an existing key costs none (it only reads).
"""

from __future__ import annotations

import threading

from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import DataflowError, StaleAttempt
from durable_dataflow.core.heartbeat import Heartbeats
from durable_dataflow.core.holders import HolderLock
from durable_dataflow.core.secrets import Secret, SecretScope
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import interruption, limits, progress, results, workspace
from durable_dataflow.dataflow.execution.compute import ExecutionResult
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.workspace import Workspace
from durable_dataflow.dataflow.protocol import attempt, cancel, evidence, forward, runs, transitions
from durable_dataflow.dataflow.protocol.attempt import Attempt, Claim
from durable_dataflow.dataflow.protocol.attempt import context_for as context_for
from durable_dataflow.dataflow.protocol.requests import AccessContext, RunRequest
from durable_dataflow.dataflow.protocol.runs import MODULE, Mode, Run, RunStatus
from durable_dataflow.dataflow.protocol.service_config import LEASE_TTL_ENV as LEASE_TTL_ENV
from durable_dataflow.dataflow.protocol.service_config import ServiceConfig as ServiceConfig
from durable_dataflow.dataflow.protocol.service_config import lease_ttl_from_env as lease_ttl_from_env
from durable_dataflow.dataflow.protocol.submit import DEFINITIONS_CACHED_MAX as DEFINITIONS_CACHED_MAX
from durable_dataflow.dataflow.protocol.submit import Definitions, Submission, Submitter

__all__ = ["Claim", "RunService", "Submission"]


class RunService:
    """Records, claims and executes runs against one platform database."""

    def __init__(self, db: Database, config: ServiceConfig | None = None) -> None:
        self.db = db
        self.config = config or ServiceConfig()
        self._definitions = Definitions()
        # Held before any lease is taken, so a sweeper can tell this process died (core/holders.py).
        self.holder_lock = HolderLock(db, self.config.holder)
        self.heartbeats = Heartbeats(db)  # one thread beats every lease of this service's attempts
        # Requested by the process's signal handlers (dataflow run, worker): every execution of this
        # service stops, and an attempt not yet authorized to dispatch is cancelled (attempt.fail_run).
        self.interruption = interruption.Interruption()
        # No source may read the database's files, nor the spill folder where executions (any tenant's)
        # spill their intermediate data.
        spill = self.config.limits.temp_dir
        platform_files = (*db.files(), *((spill.resolve(),) if spill is not None else ()))
        self._submitter = Submitter(db, self.config, self._definitions, self.holder_lock, platform_files)
        self._executing: dict[str, Claim] = {}  # run id -> the attempt this process carries
        self._executing_lock = threading.Lock()
        # The stored results its readers verify (the API's evidence): cached per ledger head, a few at once.
        self.result_checks = evidence.ResultChecks()

    def close(self) -> None:
        """Stop the heartbeat thread and release the holder lock (``Platform.close``)."""
        self.heartbeats.close()
        self.holder_lock.close()

    @property
    def evidence_key(self) -> Secret | None:
        return self.config.evidence_key

    def limits_for(self, defn: Definition) -> limits.ExecutionLimits:
        """The platform's limits narrowed by what the definition asks; asking for more is InputError."""
        return self._submitter.limits_for(defn)

    # ---- reading ---------------------------------------------------------------------------

    def get(self, run_id: str, tenant: str | None = None) -> Run:
        with self.db.read() as conn:
            return runs.get(conn, run_id, tenant)

    def definition_of(self, run: Run) -> Definition:
        return self._definitions.of_run(self.db, run)

    def result_bytes(self, run_id: str) -> bytes:
        with self.db.read() as conn:
            return results.stored_bytes(conn, run_id)

    # ---- submit ----------------------------------------------------------------------------

    def submit(self, request: RunRequest, *, claim: bool = False) -> Submission:
        """Record a run (and, inline, claim attempt 1 in the same commit); replays return the existing run."""
        return self._submitter.submit(request, claim=claim)

    def check_placement(self, defn: Definition, space: Workspace, access: AccessContext) -> None:
        """What ``submit`` refuses before recording a run (submit.Submitter.check_placement)."""
        self._submitter.check_placement(defn, space, access)

    def context_of(self, defn: Definition, space: Workspace, tenant: str) -> ExecutionContext:
        """The execution context a run of ``defn`` in ``space`` would get (roots, limits, files no source
        may read, secrets): ``dataflow validate`` reads the sources' schemas through it."""
        scope = self.secret_scope(space, tenant)
        return context_for(space, self.limits_for(defn), self._submitter.platform_files, scope)

    def secret_scope(self, space: Workspace, tenant: str) -> SecretScope:
        """A tenant run names only its tenant's granted secrets; a local run uses the operator's scope."""
        return self._submitter.secret_scope(space, tenant)

    def run_workspace(self, run: Run) -> tuple[Workspace, SecretScope]:
        """The workspace a run was recorded with, and the secrets it may name."""
        space = workspace.of_run(run.workspace, run.base_dir, run.provenance.get("trigger"))
        return space, self.secret_scope(space, run.tenant)

    # ---- claim and execute -----------------------------------------------------------------

    def claim_next(self) -> Claim | None:
        """Claim the oldest queued run (``FOR UPDATE SKIP LOCKED`` on PostgreSQL)."""
        return attempt.claim_next(self.db, self.holder_lock, self.config)

    def attempt_of(self, run: Run, number: int) -> Attempt:
        """Attempt ``number`` of ``run`` as a value, built once when it starts; a DataflowError when a
        fact cannot be had (the definition is not stored, it asks for more than this platform allows)."""
        try:
            defn = self.definition_of(run)
            space, scope = self.run_workspace(run)
            target = forward.publish_target(run, scope) if run.mode == Mode.FORWARD_RECOVERY else None
            return Attempt(
                run=run, number=number, holder=self.config.holder, lease_ttl_s=self.config.lease_ttl_s,
                definition=defn, workspace=space, secrets=scope, limits=self.limits_for(defn),
                platform_files=self._submitter.platform_files, target=target, interruption=self.interruption,
                evidence_key=self.config.evidence_key, db=self.db,
            )  # fmt: skip
        except DataflowError:
            raise
        except Exception as error:  # as in the compute step: no in-process error may leave a run running
            raise attempt.unexpected_error(run.run_id, error) from None

    def execute(self, claim: Claim, progress_sink: progress.ProgressSink | None = None) -> Run:
        """Carry one claimed attempt to its end, heartbeating the lease meanwhile."""
        run, number = claim.run, claim.attempt
        final: Run | None = None
        with self._executing_lock:
            self._executing[run.run_id] = claim
        try:
            with self.heartbeats.keep_alive(MODULE, run.run_id, number, self.config.lease_ttl_s):
                if claim.refused is not None:  # a quota refuses its execution (attempt.Claim)
                    final = self.fail(run, number, claim.refused)
                else:
                    final = self._carry(run, number, progress_sink)
        finally:
            with self._executing_lock:
                self._executing.pop(run.run_id, None)
        return final if final is not None else self.get(run.run_id)

    def _carry(self, run: Run, number: int, progress_sink: progress.ProgressSink | None) -> Run | None:
        """Build the attempt, then run it in its mode; from here on no step calls back into the service."""
        try:
            started = self.attempt_of(run, number)
        except DataflowError as error:
            self.fail(run, number, error)
            return None
        if run.mode == Mode.ATOMIC:
            return attempt.execute_atomic(started, progress_sink)
        forward.execute_forward(started, progress_sink)
        return None

    def cancel_interrupted(self) -> list[Run]:
        """Cancel, from any thread, the attempts this process still carries that have not authorized a
        dispatch (``dataflow run`` told twice to stop does not wait for its engine). Each is closed under
        the fence first, so its own thread writes nothing more; an authorized one is left as it is, to
        finish or to be swept like a crashed attempt's. Returns the runs cancelled."""
        cause = self.interruption.cause
        with self._executing_lock:
            claims = list(self._executing.values())
        if cause is None:
            return []
        cancelled = (
            cancel.interrupt(self.db, claim.run, claim.attempt, cause, evidence_key=self.evidence_key)
            for claim in claims
        )
        return [run for run in cancelled if run is not None]

    def compute(self, run: Run, progress_sink: progress.ProgressSink | None = None) -> ExecutionResult:
        """Resolve sources and run the steps of ``run``'s current attempt: recomputable, nothing committed."""
        return attempt.compute(self.attempt_of(run, run.attempt), progress_sink)

    def commit_atomic_success(self, run: Run, number: int, result: ExecutionResult) -> Run:
        """ONE fenced transaction: result, ledger, verification, checkpoint, projection, release."""
        return attempt.commit_atomic_success(self.attempt_of(run, number), result)

    def fail(self, run: Run, number: int, error: DataflowError, *, missing_capability: bool = False) -> Run | None:
        """Terminal failure with nothing dispatched (attempt.fail_run; None: fenced off)."""
        return attempt.fail_run(
            self.db, run, number, error, interruption=self.interruption, evidence_key=self.evidence_key,
            missing_capability=missing_capability,
        )  # fmt: skip

    def record_evidence_failure(self, run: Run, number: int, reason: str) -> Run | None:
        """Verification refused a transition: the run is unresolved, with the reason (None: fenced off)."""
        return transitions.evidence_failed_unless_stale(self.db, run, number, reason, evidence_key=self.evidence_key)

    def run_inline(self, request: RunRequest, progress_sink: progress.ProgressSink | None = None) -> Submission:
        """Record, claim and execute in this process (``dataflow run``); a replay executes nothing."""
        progress.report(progress_sink, progress.Progress(progress.Phase.RECORDING))
        submission = self.submit(request, claim=True)
        if not submission.created:
            return submission
        try:
            run = self.execute(Claim(submission.run, submission.run.attempt), progress_sink)
        except StaleAttempt:
            run = self.get(submission.run.run_id)
            if run.status != RunStatus.CANCELLED:
                raise  # another attempt owns the run now (its lease was swept): exit 8, as documented
        return Submission(run, created=True)
