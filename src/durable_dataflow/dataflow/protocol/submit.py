"""Submission (DESIGN §6): record a run, or return the one its idempotency key already names.

Commit budget (DESIGN §10): a submit is one commit (inline: the record and attempt 1's claim
together); a replay of an existing key costs none, it only reads. Everything the workspace forbids
is refused before anything is recorded (:meth:`Submitter.check_placement`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import exc
from sqlalchemy.engine import Connection

from durable_dataflow.core import crashpoints, hashing, leases
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import Conflict, InputError, NotFound
from durable_dataflow.core.holders import HolderLock
from durable_dataflow.core.secrets import SecretScope
from durable_dataflow.dataflow.definitions import catalog, parameters
from durable_dataflow.dataflow.definitions.definitions import Definition, definition_hash, partition_column_kind
from durable_dataflow.dataflow.execution import compute, limits, workspace
from durable_dataflow.dataflow.execution.workspace import Workspace
from durable_dataflow.dataflow.protocol import attempt, forward, quotas, runs, transitions
from durable_dataflow.dataflow.protocol.requests import AccessContext, RunRequest, check_request, request_hash
from durable_dataflow.dataflow.protocol.runs import Mode, RecoveryStatus, Run, RunStatus
from durable_dataflow.dataflow.protocol.service_config import ServiceConfig
from durable_dataflow.datasources import contract, registry
from durable_dataflow.datasources.contract import MissingCapability

DEFINITIONS_CACHED_MAX = 256


@dataclass(frozen=True)
class Submission:
    run: Run
    created: bool  # False: an existing run was returned for this idempotency key (a replay)


class Definitions:
    """Parsed definition bodies by hash (content-addressed and immutable, so reusable), and the hashes
    known to be stored (stored definitions are never deleted: later submits skip the lookup)."""

    def __init__(self) -> None:
        self._parsed: OrderedDict[str, Definition] = OrderedDict()
        self._stored: set[str] = set()
        self._lock = threading.Lock()

    def remember(self, d_hash: str, defn: Definition) -> None:
        with self._lock:
            self._parsed[d_hash] = defn
            self._parsed.move_to_end(d_hash)
            while len(self._parsed) > DEFINITIONS_CACHED_MAX:
                self._parsed.popitem(last=False)

    def stored(self, d_hash: str) -> bool:
        return d_hash in self._stored

    def mark_stored(self, d_hash: str) -> None:
        if len(self._stored) >= DEFINITIONS_CACHED_MAX:
            self._stored.clear()
        self._stored.add(d_hash)

    def of_run(self, db: Database, run: Run) -> Definition:
        with self._lock:
            cached = self._parsed.get(run.definition_hash)
        if cached is not None:
            return cached
        with db.read() as conn:
            body = catalog.definition_body(conn, run.definition_hash)
        if body is None:
            raise NotFound(f"definition {run.definition_hash} of run {run.run_id} is not stored")
        defn = Definition.model_validate(json.loads(body))
        self.remember(run.definition_hash, defn)
        return defn


class Submitter:
    """Records runs against one platform database, under one service configuration."""

    def __init__(
        self,
        db: Database,
        config: ServiceConfig,
        definitions: Definitions,
        holder_lock: HolderLock,
        platform_files: tuple[Path, ...],
    ) -> None:
        self.db = db
        self.config = config
        self.definitions = definitions
        self.holder_lock = holder_lock
        self.platform_files = platform_files  # no source may read them (nor the secrets folder)

    def limits_for(self, defn: Definition) -> limits.ExecutionLimits:
        """The platform's limits narrowed by what the definition asks; asking for more is InputError."""
        return limits.effective(self.config.limits, defn.limits, defn.output.max_bytes_int)

    def secret_scope(self, space: Workspace, tenant: str) -> SecretScope:
        """A tenant run names only its tenant's granted secrets; a local run uses the operator's scope."""
        return self.config.grants.scope(tenant if space.scope == "tenant" else None)

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
        self.definitions.remember(d_hash, defn)
        run_id = runs.new_run_id()
        values = run_values(request, run_id, key or f"run:{run_id}", d_hash, r_hash, params, target)
        values["workspace_json"] = hashing.canonical_json(space.as_json()).decode("utf-8")
        try:
            with self.db.begin() as conn:
                run = self._record(conn, defn, d_hash, values, claim)
            self.definitions.mark_stored(d_hash)
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
        ctx = attempt.context_for(space, self.limits_for(defn), self.platform_files, scope)
        compute.preflight(defn, ctx)

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
        workspace.check_location(space, str(target["location"]), target.get("options") or {})
        if target.get("mode") == "replace_partition":
            check_partition_provider(defn, str(target["provider"]), target.get("partition") or {})
        if target.get("mode") == "overwrite":
            with self.db.read() as conn:
                registered = registry.get_datasource_or_none(conn, str(target["datasource"]))
            workspace.check_overwrite(roles, target, registered)

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
        inserted already holding what Outcome.STARTED projects, so it is written once. The tenant's quotas
        are checked first (``quotas.check_submit``, which inline also grants the lease): a refusal writes
        nothing."""
        grant = None
        if claim:
            self.holder_lock.ensure()  # before the grant: a sweeper can tell this process died (core/holders.py)
            grant = leases.FirstGrant(runs.MODULE, values["run_id"], self.config.holder, self.config.lease_ttl_s)
        now_us, lease = quotas.check_submit(self.db, conn, self.config.quotas, values["tenant"], grant=grant)
        if lease is not None:
            now_us = lease.acquired_at_us  # the run and attempt.started are recorded after their lease
        if not self.definitions.stored(d_hash):
            catalog.store_definition(conn, self.db, defn, d_hash)
        return transitions.record(conn, self.db, values, lease, now_us, evidence_key=self.config.evidence_key)


def check_partition_provider(defn: Definition, name: str, partition: Mapping[str, Any]) -> None:
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


def run_values(
    request: RunRequest,
    run_id: str,
    key: str,
    d_hash: str,
    r_hash: str,
    params: Mapping[str, Any],
    target: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The new run's row (without its workspace, which the caller adds)."""
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
