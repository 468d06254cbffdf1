"""``dataflow validate`` and ``POST /v1/definitions/validate``: what a run of a definition would refuse or
fail on, found without reading data and without recording anything (no run, no ledger entry).

The checks, in the order a run makes them: what ``submit`` refuses (``RunService.check_placement``:
secrets, the sink root, an overwrite the caller may not do, the partition's provider, and the SQL gate,
undeclared ``$parameters`` and source paths outside the data roots), then the parameters, the sources'
schemas, the bind over empty tables and the output's types (``execution.validate``), then the target's
provider, its capabilities and its preflight (``datasources.contract.preflight``). A refusal by the
placement checks stops there: SQL the gate refuses is never bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from durable_dataflow.core.errors import DataflowError, InputError
from durable_dataflow.dataflow.definitions import parameters
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import validate
from durable_dataflow.dataflow.execution.validate import Problem, Report
from durable_dataflow.dataflow.execution.workspace import Workspace
from durable_dataflow.dataflow.protocol import forward
from durable_dataflow.dataflow.protocol.requests import AccessContext
from durable_dataflow.dataflow.protocol.service import RunService
from durable_dataflow.datasources import contract, registry


def _concerning(d: Definition, message: str) -> Problem:
    """A refusal as a problem naming the step or source its message names."""
    step = next((s.name for s in d.steps if f"step {s.name!r}" in message), None)
    source = next((name for name in d.sources if f"source {name!r}" in message), None)
    return Problem(message, step=step, source=source)


def validate_definition(
    service: RunService, d: Definition, raw_params: Mapping[str, Any], space: Workspace, access: AccessContext
) -> Report:
    """Every problem a run of ``d`` with ``raw_params`` in ``space`` would meet before its data is read."""
    report = validate.new_report(d)
    try:
        service.check_placement(d, space, access)
    except DataflowError as error:
        report.problems.append(_concerning(d, error.message))
        validate.bound_parameters(d, raw_params, report)
        report.notes.append("the steps were not bound: the definition is refused before any source is read")
        return report
    ctx = service.context_of(d, space, access.tenant)
    validate.check_steps(d, raw_params, ctx, report)
    _check_target(service, d, raw_params, space, access, report)
    return report


def _check_target(
    service: RunService,
    d: Definition,
    raw_params: Mapping[str, Any],
    space: Workspace,
    access: AccessContext,
    report: Report,
) -> None:
    """The target's provider (installed, with the capabilities its mode needs) and its preflight: the
    checks it makes without writing (location inside its root, secrets, table name)."""
    if d.target is None:
        return
    recorded = d.target.recorded()
    partition = None
    if d.target.partition is not None:
        try:
            partition = parameters.resolve_partition(d.target.partition, parameters.check_parameters(d, raw_params))
        except InputError:
            report.notes.append("the target's partition was not resolved: the parameters do not fit")
    options = {**dict(recorded.get("options") or {}), "base_dir": str(space.sink_root)}
    target = contract.PublishTarget(
        datasource=d.target.datasource, location=d.target.location, mode=d.target.mode, options=options,
        absolute_locations=space.absolute_locations, secrets=service.secret_scope(space, access.tenant),
        partition=partition, store_grants=space.object_stores,
    )  # fmt: skip
    try:
        provider = registry.load_provider(d.target.provider)
        registry.require_capabilities(provider, forward.needed_capabilities(recorded))
        contract.preflight(provider, target)
    except DataflowError as error:
        report.problems.append(Problem(f"the target cannot be published to: {error.message}"))
    except Exception as error:  # a provider's own failure: its text may quote a path or a value
        report.problems.append(Problem(f"the target preflight failed with an unexpected {type(error).__name__}"))
