"""The engine interface: resolved sources and checked steps in, a bounded Arrow result out.

An engine (``execution/duckdb_engine.py``, ``execution/spark_engine.py``) imports this module, never the reverse:
``compute.engine_for`` chooses one by the definition's ``engine`` field through a small registry.
Everything an engine does is recomputable and commits nothing; every bound (rows, bytes, time,
memory, spill) is enforced while the result streams, and every engine or Arrow error becomes a
``DataflowError`` naming the step or source (docs/engines.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from durable_dataflow.dataflow.definitions.definitions import Definition
    from durable_dataflow.dataflow.execution import interruption, progress
    from durable_dataflow.dataflow.execution.limits import ExecutionLimits
    from durable_dataflow.dataflow.execution.resultstream import BoundedResult
    from durable_dataflow.dataflow.execution.sources import ResolvedSource

RESULT_BATCH_ROWS = 16 * 1024  # rows per Arrow record batch of a streamed result
PROGRESS_INTERVAL_S = 0.5  # how often a watched execution reports progress


@dataclass(frozen=True)
class EngineRun:
    """One execution, as the engine sees it: every value checked and every source resolved."""

    definition: Definition
    params: Mapping[str, Any]  # canonical parameter values (dataflow.definitions.parameters.check_parameters)
    resolved: Sequence[ResolvedSource]
    limits: ExecutionLimits
    deadline_at: float  # time.monotonic() at which the execution's time is up
    progress_sink: progress.ProgressSink | None = None
    # The process's interruption (SIGINT, SIGTERM): the engine stops as if its time were up, and raises
    # core.errors.Interrupted instead of LimitExceeded.
    interruption: interruption.Interruption | None = None
    # False in an executor process (execution/isolation.py): the parent reached crashpoints.DURING_EXECUTION
    # itself, so a fault test's crash or pause stops the worker, not its executor.
    crashpoints_reached: bool = True


class Engine(Protocol):
    """What the execution needs of an engine."""

    name: str

    def gate(self, d: Definition, limits: ExecutionLimits) -> Sequence[object]:
        """Every step checked (and so refusable) before any source is read: the gated steps."""
        ...

    def run(self, job: EngineRun, gated: Sequence[object]) -> BoundedResult:
        """Bind the sources, run the gated steps and stream the last one's result, bounded."""
        ...
