"""The run service: submit (with replay), claim, and the atomic-mode attempt (DESIGN §6).

Commit budget (DESIGN §10): an inline atomic run costs 2 commits — record+claim, then the fenced
terminal transaction; a replay of an existing key costs none (it only reads). Forward-recovery
attempts continue in :mod:`durable_dataflow.dataflow.protocol.forward`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import traceback
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy import exc
from sqlalchemy.engine import Connection

from durable_dataflow.core import crashpoints, fencing, hashing, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import (
    Conflict,
    DataflowError,
    EvidenceError,
    ExecutionError,
    InputError,
    Interrupted,
    LeaseUnavailable,
    NotFound,
    StaleAttempt,
)
from durable_dataflow.core.heartbeat import Heartbeats
from durable_dataflow.core.holders import HolderLock
from durable_dataflow.core.secrets import Secret, SecretScope
from durable_dataflow.dataflow.definitions import catalog, parameters
from durable_dataflow.dataflow.definitions.definitions import (
    Definition,
    definition_hash,
    partition_column_kind,
)
from durable_dataflow.dataflow.execution import (
    compute,
    context,
    interruption,
    limits,
    progress,
    results,
    sources,
    workspace,
)
from durable_dataflow.dataflow.execution.compute import ExecutionResult
from durable_dataflow.dataflow.execution.workspace import Workspace
from durable_dataflow.dataflow.protocol import cancel, forward, runs, transitions
from durable_dataflow.dataflow.protocol.requests import AccessContext, RunRequest, check_request, request_hash
from durable_dataflow.dataflow.protocol.runs import MODULE, Mode, RecoveryStatus, Run, RunStatus
from durable_dataflow.dataflow.protocol.service_config import LEASE_TTL_ENV as LEASE_TTL_ENV
from durable_dataflow.dataflow.protocol.service_config import ServiceConfig as ServiceConfig
from durable_dataflow.dataflow.protocol.service_config import lease_ttl_from_env as lease_ttl_from_env
from durable_dataflow.dataflow.protocol.transitions import Outcome
from durable_dataflow.datasources import contract, registry
from durable_dataflow.datasources.contract import MissingCapability

DEFINITIONS_CACHED_MAX = 256

_log = structlog.get_logger("dataflow.service")


@dataclass(frozen=True)
class Submission:
    run: Run
    created: bool  # False: an existing run was returned for this idempotency key (a replay)


@dataclass(frozen=True)
class Claim:
    run: Run
    attempt: int


class RunService:
    """Records, claims and executes runs against one platform database."""

    def __init__(self, db: Database, config: ServiceConfig | None = None) -> None:
        self.db = db
        self.config = config or ServiceConfig()
        self._platform_files = db.files()  # no source may read them (nor the secrets folder)
        # Definitions are content-addressed and immutable: a parsed body can be reused by hash.
        self._definitions: OrderedDict[str, Definition] = OrderedDict()
        self._definitions_lock = threading.Lock()
        self._stored_definitions: set[str] = set()
        # Held before any lease is taken, so a sweeper can tell this process died (core/holders.py).
        self.holder_lock = HolderLock(db, self.config.holder)
        self.heartbeats = Heartbeats(db)  # one thread beats every lease of this service's attempts
        # Requested by the process's signal handlers (dataflow run, worker): every execution of this
        # service stops, and an attempt not yet authorized to dispatch is cancelled (fail below).
        self.interruption = interruption.Interruption()
        self._executing: dict[str, Claim] = {}  # run id -> the attempt this process carries
        self._executing_lock = threading.Lock()

    def close(self) -> None:
        """Stop the heartbeat thread and release the holder lock (``Platform.close``)."""
        self.heartbeats.close()
        self.holder_lock.close()

    def _remember(self, d_hash: str, defn: Definition) -> None:
        with self._definitions_lock:
            self._definitions[d_hash] = defn
            self._definitions.move_to_end(d_hash)
            while len(self._definitions) > DEFINITIONS_CACHED_MAX:
                self._definitions.popitem(last=False)

    @property
    def evidence_key(self) -> Secret | None:
        return self.config.evidence_key

    def limits_for(self, defn: Definition) -> limits.ExecutionLimits:
        """The platform's limits narrowed by what the definition asks; asking for more is InputError."""
        return limits.effective(self.config.limits, defn.limits, defn.output.max_bytes_int)

    # ---- reading ---------------------------------------------------------------------------

    def get(self, run_id: str, tenant: str | None = None) -> Run:
        with self.db.read() as conn:
            return runs.get(conn, run_id, tenant)

    def definition_of(self, run: Run) -> Definition:
        with self._definitions_lock:
            cached = self._definitions.get(run.definition_hash)
        if cached is not None:
            return cached
        with self.db.read() as conn:
            body = catalog.definition_body(conn, run.definition_hash)
        if body is None:
            raise NotFound(f"definition {run.definition_hash} of run {run.run_id} is not stored")
        defn = Definition.model_validate(json.loads(body))
        self._remember(run.definition_hash, defn)
        return defn

    def result_bytes(self, run_id: str) -> bytes:
        with self.db.read() as conn:
            return results.stored_bytes(conn, run_id)

    # ---- submit ----------------------------------------------------------------------------

    def submit(self, request: RunRequest, *, claim: bool = False) -> Submission:
        """Record a run (and, inline, claim attempt 1 in the same commit); replays return the existing run."""
        check_request(request)
        defn = request.definition
        params = parameters.check_parameters(defn, request.parameters)
        d_hash = definition_hash(defn)
        target = defn.target.recorded() if defn.target is not None else None
        r_hash = request_hash(d_hash, params, target)
        key = request.idempotency_key
        if key is not None:
            existing = self._replay(request.access.tenant, key, r_hash)
            if existing is not None:
                return Submission(existing, created=False)
        space = request.workspace or workspace.local(request.base_dir)
        self.check_placement(defn, space, request.access)
        self._remember(d_hash, defn)
        run_id = runs.new_run_id()
        values = _run_values(request, run_id, key or f"run:{run_id}", d_hash, r_hash, params, target)
        values["workspace_json"] = hashing.canonical_json(space.as_json()).decode("utf-8")
        try:
            with self.db.begin() as conn:
                run = self._record(conn, defn, d_hash, values, claim)
            # Stored definitions are never deleted: once committed, later submits skip the lookup.
            if len(self._stored_definitions) >= DEFINITIONS_CACHED_MAX:
                self._stored_definitions.clear()
            self._stored_definitions.add(d_hash)
        except exc.IntegrityError as error:
            existing = self._replay(request.access.tenant, values["idempotency_key"], r_hash)
            if existing is None:
                raise Conflict("the run could not be recorded: a concurrent write conflicted") from error
            return Submission(existing, created=False)
        crashpoints.reach(crashpoints.AFTER_RECORD if not claim else crashpoints.AFTER_CLAIM)
        return Submission(run, created=True)

    def check_placement(self, defn: Definition, space: Workspace, access: AccessContext) -> None:
        """What ``submit`` refuses before recording a run of ``defn`` in ``space`` for ``access``, also
        for runs submitted later (a schedule's ticks): secrets not available, a sink location outside
        the sink root, an overwrite the caller may not do, sources outside the data roots, SQL the
        engine's gate refuses. Parameters are not checked here: a schedule's come with each tick."""
        target = defn.target.recorded() if defn.target is not None else None
        scope = self.secret_scope(space, access.tenant)
        self._check_workspace(defn, target, space, scope, access.roles)
        compute.preflight(defn, context_for(space, self.limits_for(defn), self._platform_files, scope))

    def secret_scope(self, space: Workspace, tenant: str) -> SecretScope:
        """A tenant run names only its tenant's granted secrets; a local run uses the operator's scope."""
        return self.config.grants.scope(tenant if space.scope == "tenant" else None)

    def _check_workspace(
        self,
        defn: Definition,
        target: Mapping[str, Any] | None,
        space: Workspace,
        scope: SecretScope,
        roles: tuple[str, ...],
    ) -> None:
        """What the workspace forbids, refused before anything is recorded: secrets not available in
        this scope, a sink location outside the sink root, an overwrite the caller may not do."""
        workspace.check_secrets(scope, workspace.secret_names(target, iter(defn.sources.items())))
        if target is None:
            return
        workspace.check_location(space, str(target["location"]))
        if target.get("mode") == "replace_partition":
            self._check_partition_provider(defn, str(target["provider"]), target.get("partition") or {})
        if target.get("mode") == "overwrite":
            with self.db.read() as conn:
                registered = registry.get_datasource_or_none(conn, str(target["datasource"]))
            workspace.check_overwrite(roles, target, registered)

    def _check_partition_provider(self, defn: Definition, name: str, partition: Mapping[str, Any]) -> None:
        """A replace_partition target needs a provider that replaces a partition atomically (Delta,
        PostgreSQL; not the Parquet folder), and one that selects each partition column's kind exactly
        (Delta: not a timestamp or decimal column): refused before anything is recorded."""
        try:
            provider = registry.load_provider(name)
        except MissingCapability:
            return  # reported as the run's missing capability, as for any other target
        if forward.PARTITION_CAPABILITY not in provider.capabilities:
            raise InputError(
                f"provider {provider.name!r} cannot replace a partition atomically: "
                "target mode replace_partition needs the delta or postgres provider"
            )
        kinds = contract.partition_kinds(provider)
        for column in partition:
            kind = partition_column_kind(defn, str(column))
            if kind is not None and kind not in kinds:
                raise InputError(
                    f"provider {provider.name!r} cannot replace a partition by a {kind} column ({str(column)!r}): "
                    f"its partition columns are {', '.join(sorted(kinds))}"
                )

    def run_workspace(self, run: Run) -> tuple[Workspace, SecretScope]:
        """The workspace a run was recorded with, and the secrets it may name."""
        space = workspace.of_run(run.workspace, run.base_dir, run.provenance.get("trigger"))
        return space, self.secret_scope(space, run.tenant)

    def _replay(self, tenant: str, key: str, r_hash: str) -> Run | None:
        with self.db.read() as conn:
            existing = runs.find_by_key(conn, tenant, key)
        if existing is not None and existing.request_hash != r_hash:
            raise Conflict(
                f"the idempotency key already names run {existing.run_id} with a different request "
                f"({existing.request_hash}); nothing was written"
            )
        return existing

    def _record(self, conn: Connection, defn: Definition, d_hash: str, values: dict[str, Any], claim: bool) -> Run:
        """The run's row and its first entries; inline (``claim``), attempt 1's lease too, and the row is
        inserted already holding what Outcome.STARTED projects, so it is written once."""
        if d_hash not in self._stored_definitions:
            catalog.store_definition(conn, self.db, defn, d_hash)
        row = dict(values)
        entries = transitions.items(Outcome.RECORDED, 0, [_recorded_payload(values)])
        if claim:
            lease = self._lease(conn, values["run_id"], expected_attempt=0)
            started = transitions.TABLE[Outcome.STARTED]
            row.update(attempt=lease.attempt, status=started.status, recovery_status=started.recovery)
            entries += transitions.items(Outcome.STARTED, lease.attempt, [{"holder": lease.holder}])
        run = runs.insert(conn, self.db, row)
        ledger.append_many(
            conn, self.db, MODULE, run.run_id, entries,
            evidence_key=self.config.evidence_key, new_subject_at_us=run.created_at_us,
        )  # fmt: skip
        return run

    def _lease(self, conn: Connection, run_id: str, expected_attempt: int) -> leases.Lease:
        self.holder_lock.ensure()
        return leases.acquire(
            conn, self.db, MODULE, run_id, self.config.holder, self.config.lease_ttl_s,
            expected_attempt=expected_attempt,
        )  # fmt: skip

    def _start_attempt(self, conn: Connection, run_id: str, expected_attempt: int) -> Run:
        lease = self._lease(conn, run_id, expected_attempt)
        started = transitions.items(Outcome.STARTED, lease.attempt, [{"holder": lease.holder}])
        ledger.append_many(conn, self.db, MODULE, run_id, started, evidence_key=self.config.evidence_key)
        projected = transitions.TABLE[Outcome.STARTED]
        return runs.update(
            conn, self.db, run_id,
            attempt=lease.attempt, status=projected.status, recovery_status=projected.recovery,
        )  # fmt: skip

    # ---- claim -----------------------------------------------------------------------------

    def claim_next(self) -> Claim | None:
        """Claim the oldest queued run (``FOR UPDATE SKIP LOCKED`` on PostgreSQL)."""
        try:
            with self.db.begin() as conn:
                row = runs.oldest_queued(conn, skip_locked=self.db.dialect == "postgresql")
                if row is None:
                    return None
                run = self._start_attempt(conn, row.run_id, expected_attempt=int(row.attempt))
        except LeaseUnavailable:
            return None
        crashpoints.reach(crashpoints.AFTER_CLAIM)
        return Claim(run, run.attempt)

    # ---- execute ---------------------------------------------------------------------------

    def execute(self, claim: Claim, progress_sink: progress.ProgressSink | None = None) -> Run:
        """Carry one claimed attempt to its end, heartbeating the lease meanwhile."""
        run, attempt = claim.run, claim.attempt
        final: Run | None = None
        with self._executing_lock:
            self._executing[run.run_id] = claim
        try:
            with self.heartbeats.keep_alive(MODULE, run.run_id, attempt, self.config.lease_ttl_s):
                if run.mode == Mode.ATOMIC:
                    final = self._execute_atomic(run, attempt, progress_sink)
                else:
                    forward.execute_forward(self, run, attempt, progress_sink)
        finally:
            with self._executing_lock:
                self._executing.pop(run.run_id, None)
        return final if final is not None else self.get(run.run_id)

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
        cancelled = (cancel.interrupt(self, claim.run, claim.attempt, cause) for claim in claims)
        return [run for run in cancelled if run is not None]

    def compute(self, run: Run, progress_sink: progress.ProgressSink | None = None) -> ExecutionResult:
        """Resolve sources and run the steps: recomputable, nothing committed.

        Every in-process error becomes a ``DataflowError`` here, so the caller always records a
        terminal entry: an unexpected one is an ``ExecutionError`` naming its type (its text may
        quote data or driver details, so it goes to the log, not to the run).
        """
        progress.report(progress_sink, progress.Progress(progress.Phase.EXECUTING))
        try:
            defn = self.definition_of(run)
            # The time limit counts from here: resolution (hashing, listing) and the engine together.
            space, scope = self.run_workspace(run)
            ctx = context_for(space, self.limits_for(defn), self._platform_files, scope).started()
            ctx = dataclasses.replace(ctx, interruption=self.interruption)
            compute.check_interrupted(ctx)
            resolved = sources.resolve_sources(defn, ctx)
            # The engine watches for an interruption while it runs; the caller looks last, right before
            # its terminal (atomic) or pre-dispatch (forward) commit.
            return compute.execute(defn, run.parameters, ctx, resolved, progress_sink)
        except DataflowError:
            raise
        except Exception as error:  # no in-process error may leave a run running
            # The frames, not the message: an unexpected error's text may quote data or credentials.
            _log.error(
                "execution.unexpected_error", run_id=run.run_id, error_type=type(error).__name__,
                frames="".join(traceback.format_tb(error.__traceback__)),
            )  # fmt: skip
            raise ExecutionError(
                f"the execution failed with an unexpected {type(error).__name__} (details are in the process log)"
            ) from None

    def _execute_atomic(self, run: Run, attempt: int, progress_sink: progress.ProgressSink | None) -> Run | None:
        """The attempt's end; returns the committed run when this attempt's terminal commit succeeded."""
        try:
            result = self.compute(run, progress_sink)
            progress.report(progress_sink, progress.Progress(
                progress.Phase.COMMITTING, None, result.row_count, len(result.ipc_bytes)
            ))  # fmt: skip
            self.interruption.check()  # the last look: a signal from here on finds the run committed
        except DataflowError as error:
            self.fail(run, attempt, error)
            return None
        crashpoints.reach(crashpoints.BEFORE_TERMINAL_COMMIT)
        final: Run | None = None
        try:
            final = self.commit_atomic_success(run, attempt, result)
        except EvidenceError as error:
            self.record_evidence_failure(run, attempt, error.message)
        crashpoints.reach(crashpoints.AFTER_TERMINAL_COMMIT)
        return final

    def commit_atomic_success(self, run: Run, attempt: int, result: ExecutionResult) -> Run:
        """ONE fenced transaction: result, ledger, verification, checkpoint, projection, release."""
        with fencing.fenced_chain(self.db, MODULE, run.run_id, attempt) as (conn, held):
            results.store(conn, run.run_id, attempt, result)
            return transitions.apply(
                conn, self.db, run, attempt, Outcome.ATOMIC_SUCCEEDED,
                [results.facts(result), {"output_digest": result.output_digest}],
                evidence_key=self.config.evidence_key,
                projection={
                    "row_count": result.row_count, "output_digest": result.output_digest,
                    "source_fingerprint_digest": result.source_fingerprint_digest,
                },
                held=held, stored_result=result.ipc_bytes,
            )  # fmt: skip

    def fail(self, run: Run, attempt: int, error: DataflowError, **facts: Any) -> Run | None:
        """Terminal failure with nothing dispatched: no external output was created (None: fenced off).
        An interruption is no failure: the attempt is cancelled (dataflow.protocol.cancel.interrupt)."""
        cause = self.interruption.cause
        if isinstance(error, Interrupted) and cause is not None:
            return cancel.interrupt(self, run, attempt, cause)
        message = error.message[: transitions.MESSAGE_CHARS_MAX]
        return transitions.conclude(
            self.db, run, attempt, Outcome.FAILED_BEFORE_DISPATCH,
            [{"code": error.code, "message": message, "no_external_output": True, **facts}],
            evidence_key=self.config.evidence_key, projection={"error_code": error.code, "error_message": message},
        )  # fmt: skip

    def record_evidence_failure(self, run: Run, attempt: int, reason: str) -> Run | None:
        """Verification refused a transition: the run is unresolved, with the reason (None: fenced off)."""
        try:
            return transitions.record_evidence_failure(
                self.db, run, attempt, reason, evidence_key=self.config.evidence_key
            )
        except StaleAttempt:
            return None

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


def context_for(
    space: Workspace, bounds: limits.ExecutionLimits, platform_files: tuple[Path, ...], scope: SecretScope
) -> context.ExecutionContext:
    """The workspace's roots and secrets; never readable: the secrets folder and platform_files."""
    forbidden = (*platform_files, *context.secrets_folders())
    return context.ExecutionContext(
        base_dir=space.base_dir, allowed_roots=space.data_roots, limits=bounds, forbidden=forbidden, secrets=scope
    )


def _run_values(
    request: RunRequest,
    run_id: str,
    key: str,
    d_hash: str,
    r_hash: str,
    params: Mapping[str, Any],
    target: Mapping[str, Any] | None,
) -> dict[str, Any]:
    mode = Mode.FORWARD_RECOVERY if target is not None else Mode.ATOMIC
    return {
        "run_id": run_id,
        "tenant": request.access.tenant,
        "idempotency_key": key,
        "definition_hash": d_hash,
        "definition_name": request.definition.name,
        "request_hash": r_hash,
        "mode": mode,
        "status": RunStatus.QUEUED,
        "recovery_status": RecoveryStatus.RECORDED,
        "attempt": 0,
        "max_attempts": request.max_attempts,
        "parameters_json": hashing.canonical_json(dict(params)).decode("utf-8"),
        "provenance_json": hashing.canonical_json(request.provenance.as_json()).decode("utf-8"),
        "principal": request.access.principal,
        "access_context_digest": request.access.digest(),
        "target_json": hashing.canonical_json(dict(target)).decode("utf-8") if target is not None else None,
        "base_dir": str(request.base_dir),
        **_partition_values(target, params),
    }


def _partition_values(target: Mapping[str, Any] | None, params: Mapping[str, Any]) -> dict[str, Any]:
    """A partitioned run's datasource and partition (``forward.run_partition``'s values, resolved once
    here), stored on its row for partition status; nothing for any other run."""
    partition = (target or {}).get("partition")
    if target is None or not partition:
        return {}
    resolved = parameters.resolve_partition(partition, params)
    return {
        "partition_datasource": str(target["datasource"]),
        "partition_json": hashing.canonical_json(resolved).decode("utf-8"),
    }


def _recorded_payload(values: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "run_id": values["run_id"],
        "tenant": values["tenant"],
        "idempotency_key": values["idempotency_key"],
        "definition_hash": values["definition_hash"],
        "request_hash": values["request_hash"],
        "mode": str(values["mode"]),
        "provenance": json.loads(values["provenance_json"]),
        "access_context_digest": values["access_context_digest"],
        "max_attempts": values["max_attempts"],
        "principal": values["principal"],
        "workspace_digest": transitions.workspace_digest(json.loads(values["workspace_json"])),
    }
