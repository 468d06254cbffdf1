"""Forward recovery (DESIGN §6 steps 1-5): runs that publish to an external sink, never twice.

1. Check the provider's publish and inspect capabilities, and its preflight of the target (what is
   knowable without writing: location, secrets, table name), before anything else; then let it
   prepare the sink location, so that a location missing later is never read as absence.
2. Execute (recomputable).
3. Pre-dispatch fenced commit: the bounded result and its digests, ``dispatch.authorized``.
   From this commit on, dispatch "may have started" and the attempt is never retried.
4. Call the provider with the stable key, the attempt as fencing token, and the stored result.
5. Record what the sink conclusively said, or ``outcome_unknown`` when it said nothing conclusive.
   An ``InputError`` from publish is conclusive: providers raise it only before touching the sink.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Connection

from durable_dataflow.core import checkpoints, crashpoints, fencing, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import DataflowError, EvidenceError, ExecutionError, InputError, StaleAttempt
from durable_dataflow.core.secrets import Secret, SecretScope
from durable_dataflow.dataflow.definitions.parameters import resolve_partition
from durable_dataflow.dataflow.execution import progress, results, workspace
from durable_dataflow.dataflow.execution.compute import ExecutionResult
from durable_dataflow.dataflow.protocol import attempt as attempts
from durable_dataflow.dataflow.protocol import evidence, partition_tokens, runs, transitions
from durable_dataflow.dataflow.protocol.attempt import Attempt
from durable_dataflow.dataflow.protocol.runs import MODULE, Run
from durable_dataflow.dataflow.protocol.transitions import Outcome
from durable_dataflow.datasources import contract, registry
from durable_dataflow.datasources.contract import (
    Capability,
    Fenced,
    Inconclusive,
    MissingCapability,
    Provider,
    Published,
    PublishOutcome,
    PublishTarget,
    Rejected,
)

REQUIRED_CAPABILITIES: tuple[Capability, ...] = ("publish", "inspect")
# What a provider must also declare for a target with mode replace_partition.
PARTITION_CAPABILITY: Capability = "replace_partition"
# The dispatch.authorized field that records the prepared location ({place_digest, identity}).
SINK_LOCATION = transitions.SINK_LOCATION


def publication_key(run: Run) -> str:
    """The sink key of the run's publication: stable for the run, never per attempt. Once the dispatch
    authorization recorded it, that key (runs authorized before this rule keep their run-id keys).
    Otherwise it derives from the tenant and the run's idempotency key, not from the run id: a run
    recorded again under the same key publishes under the same sink key, so after the platform database
    was restored from a dump taken before the first run was recorded, a re-submission of its key finds
    the publication at the sink (the same digest: nothing written twice; another: left unresolved)
    instead of publishing a second time (docs/runbooks.md). A run submitted without a key has
    ``run:<run_id>`` as its idempotency key, so its sink key is its own."""
    if run.publication_idempotency_key is not None:
        return run.publication_idempotency_key
    return f"dataflow/{run.tenant}/key/{hashlib.sha256(run.idempotency_key.encode('utf-8')).hexdigest()}"


class PartitionViolation(DataflowError):
    """Result rows lie outside the run's partition: nothing is dispatched."""

    code = "partition_violation"


def run_partition(run: Run) -> dict[str, Any] | None:
    """The run's partition values: its target's partition with parameter references resolved with the
    run's recorded parameters (the same values on every call: execution, dispatch, resume); None for a
    target without a partition."""
    partition = (run.target or {}).get("partition")
    if not partition:
        return None
    return resolve_partition(partition, run.parameters or {})


def check_partition_rows(table: Any, partition: Mapping[str, Any]) -> None:
    """Every row's partition columns equal the partition values (a null is a violation);
    PartitionViolation names the first column with violations and how many rows, never a value."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for column, value in partition.items():
        if column not in table.column_names:
            raise PartitionViolation(f"the result has no partition column {column!r}")
        values = table.column(column)
        try:
            wanted = contract.typed_scalar(value, values.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            raise PartitionViolation(
                f"the partition value of column {column!r} does not fit the column's type"
            ) from None
        # Arrow scalars only: a Python value here (False) would make pyarrow import pandas (typed_scalar).
        unequal = contract.typed_scalar(False, pa.bool_())
        matching = pc.sum(pc.fill_null(pc.equal(values, wanted), unequal).cast(pa.int64())).as_py() or 0
        outside = table.num_rows - int(matching)
        if outside:
            raise PartitionViolation(
                f"{outside} result rows have a value of partition column {column!r} outside the run's partition: "
                "nothing was published"
            )


def publish_target(run: Run, scope: SecretScope | None = None, partition_token: int | None = None) -> PublishTarget:
    """The run's target inside its workspace: relative locations start at its sink root, secrets
    resolve in ``scope`` (without one, a tenant run gets no secrets at all: it fails closed). A
    partitioned target carries the run's partition values and ``partition_token``."""
    space = workspace.of_run(run.workspace, run.base_dir, run.provenance.get("trigger"))
    target = run.target or {}
    options = dict(target.get("options") or {})
    options["base_dir"] = str(space.sink_root)
    partition = run_partition(run)
    return PublishTarget(
        datasource=str(target["datasource"]),
        location=str(target["location"]),
        mode=target.get("mode", "append"),
        options=options,
        absolute_locations=space.absolute_locations,
        secrets=scope or SecretScope(tenant=run.tenant if space.scope == "tenant" else None),
        partition=partition,
        partition_token=partition_token if partition is not None else None,
        store_grants=space.object_stores,
    )


def load_capable_provider(run: Run) -> Provider:
    """The run's provider, with publish and inspect; raises MissingCapability otherwise."""
    provider = registry.load_provider(str((run.target or {}).get("provider")))
    registry.require_capabilities(provider, needed_capabilities(run.target))
    return provider


def needed_capabilities(target: Mapping[str, Any] | None) -> tuple[Capability, ...]:
    """What the target's provider must declare: publish and inspect, and replace_partition for a
    target with that mode (checked before a run is recorded too: `RunService.check_placement`)."""
    if (target or {}).get("mode") == "replace_partition":
        return (*REQUIRED_CAPABILITIES, PARTITION_CAPABILITY)
    return REQUIRED_CAPABILITIES


def preflight_target(attempt: Attempt, provider: Provider) -> None:
    """The provider's checks of the target that need no write; InputError, or ExecutionError naming
    the type of anything unexpected (its text may quote a path or a value)."""
    try:
        contract.preflight(provider, _target(attempt))
    except InputError as error:
        raise InputError(f"the target cannot be published to: {error.message}") from None
    except DataflowError:
        raise
    except Exception as error:  # nothing was written, so any failure here ends the attempt conclusively
        raise ExecutionError(f"the target preflight failed with an unexpected {type(error).__name__}") from None


def prepare_target(attempt: Attempt, provider: Provider) -> contract.Location | None:
    """The provider's creation of the sink location, before dispatch can be authorized, so a location
    missing at a later inspection is never taken for absence. First the datasource's registration is
    recorded (a no-op after its first publication; its name at another location is an InputError), so
    an inspection can tell a location the platform created from one it never did. A location the
    datasource was already created at is never created again: missing, or replaced by another table
    or folder, the run fails (`LocationGone`); the first time at a place, what the provider created
    there is recorded. Returns where the location is and what it is (None for a provider that does
    not locate), for the dispatch authorization to record. Nothing is published here, so a failure
    ends the attempt conclusively; its text is not repeated (it may quote a path)."""
    run, db = attempt.run, attempt.db
    try:
        with db.begin() as conn:
            registry.register_target(conn, run.tenant, run.target or {}, run.run_id)
        target = _target(attempt)
        found, recorded = check_location(db, run, provider, target)
        contract.prepare(provider, target)
        if found is not None and recorded is None:
            return record_prepared_location(db, run, provider, target)
        return found
    except InputError as error:
        raise InputError(f"the target cannot be published to: {error.message}") from None
    except DataflowError:
        raise
    except OSError as error:
        raise ExecutionError(f"the sink location cannot be created: {contract.describe_exception(error)}") from None
    except Exception as error:
        raise ExecutionError(f"preparing the sink location failed with an unexpected {type(error).__name__}") from None


def _datasource(run: Run) -> str:
    return str((run.target or {}).get("datasource"))


def _target(attempt: Attempt) -> PublishTarget:
    """The attempt's publish target (a forward attempt is always given one)."""
    if attempt.target is None:
        raise ExecutionError(f"run {attempt.run.run_id} has no target to publish to")
    return attempt.target


def check_location(
    db: Database,
    run: Run,
    provider: Provider,
    target: PublishTarget,
    authorized: Mapping[str, Any] | None = None,
) -> tuple[contract.Location | None, registry.RecordedLocation | None]:
    """Where the run's target resolves now and what was recorded when its datasource was first prepared
    there. Raises `LocationGone` when the recorded location is missing or another is in its place: the
    one rule for a new run's prepare (which then creates nothing) and reconcile (which then inspects
    nothing). With ``authorized`` (the location the run's ``dispatch.authorized`` recorded, for
    reconcile) it is judged against that instead: another place, nothing there, or another table or
    folder there is `LocationGone` too. ``(None, None)`` for a provider that does not locate."""
    found = contract.locate(provider, target)
    if found is None:
        return None, None
    if authorized is not None:
        problem = registry.authorized_location_problem(
            _datasource(run), authorized, found.place, found.identity, _thing(provider)
        )
        if problem is not None:
            raise contract.LocationGone(problem)
        return found, None
    with db.read() as conn:
        recorded = registry.recorded_location(conn, run.tenant, _datasource(run), found.place)
        problem = (
            registry.location_problem(_datasource(run), recorded, found.identity, _thing(provider))
            if recorded is not None
            else registry.unrecorded_location_problem(conn, run.tenant, _datasource(run), found)
        )
    if problem is not None:
        raise contract.LocationGone(problem)
    return found, recorded


def _thing(provider: Provider) -> str:
    """What a provider's location is, for a reason: a table or a folder."""
    return "folder" if provider.name == "parquet" else "table"


def record_prepared_location(db: Database, run: Run, provider: Provider, target: PublishTarget) -> contract.Location:
    """Record what the provider prepared at the target's place, the first time this datasource is
    prepared there; a concurrent first preparer that recorded another identity fails this run."""
    found = contract.locate(provider, target)
    if found is None or found.identity is None:
        raise ExecutionError("the sink location was prepared but cannot be found: nothing was published")
    with db.begin() as conn:
        stored = registry.record_location(conn, run.tenant, _datasource(run), found.place, found.identity, run.run_id)
    problem = registry.location_problem(_datasource(run), stored, found.identity, _thing(provider))
    if problem is not None:
        raise contract.LocationGone(problem)
    return found


def location_fact(found: contract.Location | None) -> dict[str, Any] | None:
    """What the dispatch authorization records of the prepared location (None for a provider that does
    not locate): its place's digest and identity, never the place."""
    if found is None:
        return None
    return {"place_digest": registry.place_digest(found.place), "identity": found.identity}


def authorized_location(conn: Connection, run: Run) -> Mapping[str, Any] | None:
    """The location the run's first ``dispatch.authorized`` recorded, or None (a run authorized before
    locations were recorded, or a provider that does not locate)."""
    for entry in ledger.read(conn, MODULE, run.run_id):
        if entry.kind == evidence.DISPATCH_AUTHORIZED:
            found = entry.payload.get(SINK_LOCATION)
            return found if isinstance(found, Mapping) else None
    return None


def authorized_partition_token(conn: Connection, run: Run) -> int | None:
    """The partition token the run's first ``dispatch.authorized`` took (a resume copies that payload,
    so it publishes under the same token), or None (a target without a partition)."""
    for entry in ledger.read(conn, MODULE, run.run_id):
        if entry.kind == evidence.DISPATCH_AUTHORIZED:
            token = entry.payload.get(partition_tokens.PARTITION_TOKEN)
            return token if isinstance(token, int) else None
    return None


def execute_forward(attempt: Attempt, progress_sink: progress.ProgressSink | None = None) -> None:
    """Carry a forward attempt from its provider's checks to its recorded publication (steps 1-5)."""
    try:
        provider = load_capable_provider(attempt.run)
    except MissingCapability as error:
        attempts.fail(attempt, error, missing_capability=True)
        return
    try:
        preflight_target(attempt, provider)
        located = prepare_target(attempt, provider)
    except DataflowError as error:
        attempts.fail(attempt, error)
        return
    crashpoints.reach(crashpoints.AFTER_PREPARE)
    try:
        result = attempts.compute(attempt, progress_sink)
    except DataflowError as error:
        attempts.fail(attempt, error)
        return
    progress.report(progress_sink, progress.Progress(
        progress.Phase.COMMITTING, None, result.row_count, len(result.ipc_bytes)
    ))  # fmt: skip
    try:
        partition = run_partition(attempt.run)
        if partition is not None:
            check_partition_rows(results.decode_ipc(result.ipc_bytes), partition)
        attempt.interruption.check()  # the last look: a signal from here on finds the dispatch authorized
    except DataflowError as error:
        attempts.fail(attempt, error)
        return
    _authorize_then_dispatch(attempt, provider, result, located, progress_sink)


def _authorize_then_dispatch(
    attempt: Attempt,
    provider: Provider,
    result: ExecutionResult,
    located: contract.Location | None,
    progress_sink: progress.ProgressSink | None,
) -> None:
    crashpoints.reach(crashpoints.BEFORE_PREDISPATCH_COMMIT)
    try:
        authorize_dispatch(attempt, result, located)
    except StaleAttempt:
        return  # never authorized: the sweeper proves this attempt absent and retries the run
    except EvidenceError as error:  # the chain did not verify: nothing is dispatched on it
        attempts.record_evidence_failure(attempt, error.message)
        return
    crashpoints.reach(crashpoints.AFTER_PREDISPATCH_COMMIT)
    progress.report(progress_sink, progress.Progress(progress.Phase.PUBLISHING, None, result.row_count))
    dispatch(attempt.db, attempt.run, attempt.number, provider, _target(attempt), evidence_key=attempt.evidence_key)


def authorize_dispatch(attempt: Attempt, result: ExecutionResult, located: contract.Location | None) -> Run:
    """The pre-dispatch fenced commit: result, digests, ``dispatch.authorized`` (with the prepared
    location's place digest and identity, which reconcile holds the target to; ``located`` is what
    `prepare_target` returned, None only for a provider that does not locate). The chain it extends
    must verify first (EvidenceError otherwise): a publication is never authorized on evidence that
    could not later prove its success, such as entries written under another evidence-key setting."""
    run, number, db = attempt.run, attempt.number, attempt.db
    with fencing.fenced_chain(db, MODULE, run.run_id, number) as (conn, held):
        verification = checkpoints.verify_subject(
            conn, MODULE, run.run_id, evidence_key=attempt.evidence_key, held=held
        )
        if not verification.ok:
            where = f" at seq {verification.broken_seq}" if verification.broken_seq is not None else ""
            raise EvidenceError(f"the run's evidence failed verification{where} before dispatch: {verification.reason}")
        partition = run_partition(run)
        token = ahead = None
        if partition is not None:
            if not results.stored_at_once(result):  # a result in pieces is streamed before the token's row lock
                ahead = results.store(conn, run.run_id, number, result)
            # In this commit: the later authorized run of a partition wins.
            token = partition_tokens.take(conn, run.tenant, _datasource(run), partition)
        authorized = transitions.authorize_dispatch(
            conn, db, run, number, result, publication_key(run), sink_location=location_fact(located),
            partition_token=token, evidence_key=attempt.evidence_key, held=held, stored_ahead=ahead,
        )  # fmt: skip (it stores the result, unless ahead, and counts its bytes: transitions.apply)
        return authorized


def dispatch(
    db: Database, run: Run, attempt: int, provider: Provider, target: PublishTarget, *, evidence_key: Secret | None
) -> None:
    """Steps 4 and 5: publish the *stored* bytes under the stable key with fence ``attempt``, to
    ``target`` (the run's, without a partition token: the one its authorization took is added here)."""
    with db.read() as conn:
        run = runs.get(conn, run.run_id)  # as the authorization left it: its recorded digest
        table = results.decode_ipc(results.stored_bytes(conn, run.run_id))
        token = authorized_partition_token(conn, run)
    recorded_digest = str(run.output_digest)
    tokened = dataclasses.replace(target, partition_token=token if target.partition is not None else None)
    try:
        outcome: PublishOutcome = provider.publish(publication_key(run), attempt, table, recorded_digest, tokened)
    except Inconclusive as error:
        crashpoints.reach(crashpoints.AFTER_PROVIDER_CALL)
        reason = f"the provider could not say whether it published: {error.message}"
        record_unknown(db, run, attempt, reason, evidence_key=evidence_key)
        return
    except InputError as error:  # the contract: raised only before the sink was touched, so conclusive
        crashpoints.reach(crashpoints.AFTER_PROVIDER_CALL)
        refused = Rejected(f"the target was refused before any write: {error.message}")
        apply_publish_outcome(db, run, attempt, refused, recorded_digest, evidence_key=evidence_key)
        return
    except Exception as error:  # anything unexpected at dispatch is an unknown outcome
        crashpoints.reach(crashpoints.AFTER_PROVIDER_CALL)
        reason = f"the provider call failed inconclusively: {type(error).__name__}"
        record_unknown(db, run, attempt, reason, evidence_key=evidence_key)
        return
    crashpoints.reach(crashpoints.AFTER_PROVIDER_CALL)
    apply_publish_outcome(db, run, attempt, outcome, recorded_digest, evidence_key=evidence_key)


def apply_publish_outcome(
    db: Database, run: Run, attempt: int, outcome: PublishOutcome, recorded_digest: str, *, evidence_key: Secret | None
) -> None:
    """Record the sink's answer in the attempt's fenced terminal commit (nothing for a fenced one)."""
    crashpoints.reach(crashpoints.BEFORE_TERMINAL_COMMIT)
    try:
        if isinstance(outcome, Fenced):
            return  # this attempt is stale and wrote nothing at the sink; it records nothing
        if isinstance(outcome, Rejected):
            transitions.reject_publication(db, run, attempt, outcome.reason, evidence_key=evidence_key)
        elif outcome.digest != recorded_digest:
            mismatch = Outcome.PUBLICATION_MISMATCH
            transitions.record_mismatch(db, run, attempt, mismatch, outcome, evidence_key=evidence_key)
        else:
            how = "published" if isinstance(outcome, Published) else "already_published"
            published = Outcome.PUBLISHED
            transitions.succeed_publication(db, run, attempt, published, outcome, how, evidence_key=evidence_key)
    except StaleAttempt:
        return  # the lease was lost: the sweeper marks this authorized attempt outcome_unknown
    except EvidenceError as error:
        transitions.evidence_failed_unless_stale(db, run, attempt, error.message, evidence_key=evidence_key)
    crashpoints.reach(crashpoints.AFTER_TERMINAL_COMMIT)


def record_unknown(db: Database, run: Run, attempt: int, reason: str, *, evidence_key: Secret | None) -> None:
    """No conclusive response: ``outcome_unknown``; no automatic retry, ever."""
    try:
        transitions.publication_unknown(db, run, attempt, reason, evidence_key=evidence_key)
    except DataflowError:
        return  # the database is down: the sweeper will find the authorized attempt expired
