"""Typed execution: resolve sources, run the SQL steps on the definition's engine, stream the bounded result.

Everything here is recomputable and nothing is committed: the caller (the run service) stores the
IPC bytes, digests and row count in its fenced terminal transaction. All bounds (rows, bytes,
time, memory, spill) are enforced by the engine while the result streams, before the caller can
commit anything; every engine or Arrow error at any batch becomes a ``DataflowError`` naming the step.

The engine is the definition's ``engine``: DuckDB by default (``duckdb_engine.py``), or Apache
Spark (``spark_engine.py``, the ``spark`` extra). ``engine.py`` is the interface both implement;
``compute`` owns the registry that chooses between them (docs/engines.md).
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import pyarrow as pa

from durable_dataflow.core import crashpoints
from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions import parameters
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import isolation, progress, results, store_sources
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.engine import Engine, EngineRun
from durable_dataflow.dataflow.execution.postgres_source import check_query
from durable_dataflow.dataflow.execution.resultstream import BoundedResult
from durable_dataflow.dataflow.execution.sources import (
    ResolvedSource,
    check_unchanged,
    confine_path,
    resolve_sources,
    source_fingerprint_digest,
)

# engine name -> (module, the Python package it needs, the extra that installs it)
ENGINES: dict[str, tuple[str, str, str | None]] = {
    "duckdb": ("durable_dataflow.dataflow.execution.duckdb_engine", "duckdb", None),
    "spark": ("durable_dataflow.dataflow.execution.spark_engine", "pyspark", "spark"),
}


def engine_for(d: Definition) -> Engine:
    """The engine a definition asks for; InputError, before anything is recorded, when it is not installed."""
    module_name, needs, extra = ENGINES[d.engine]
    if extra is not None:
        try:
            importlib.import_module(needs)
        except ImportError:
            raise InputError(
                f"definition {d.name!r} asks for engine {d.engine!r}, which is not installed here: "
                f"install the {extra!r} extra (pip install 'durable-dataflow[{extra}]')"
            ) from None
    return cast(Engine, importlib.import_module(module_name).ENGINE)


@dataclass(frozen=True)
class ExecutionResult:
    """The typed result of one execution (as stored IPC bytes) and the digests that describe it."""

    row_count: int
    output_digest: str
    ipc_bytes: memoryview  # the stored IPC stream, a view of the collector's Arrow buffer (never copied)
    source_fingerprint_digest: str
    sources: tuple[tuple[str, str, str], ...]  # (name, kind, fingerprint) in definition order

    @property
    def table(self) -> pa.Table:
        """The result decoded from its IPC bytes (a view over them, not a copy of the values)."""
        return results.decode_ipc(self.ipc_bytes)


def preflight(d: Definition, ctx: ExecutionContext) -> None:
    """Everything that can be refused without reading data: the SQL gate, undeclared $parameters and
    file paths outside the allowed roots. Call it before recording a run so hostile input leaves no trace.
    """
    engine_for(d).gate(d, ctx.limits)
    for name, spec in d.sources.items():
        check_query(name, spec)  # a postgres source: exactly one read statement
        path = getattr(spec, "path", None)
        if store_sources.is_store_source(spec):
            store_sources.preflight(name, spec, ctx)  # the tenant's grants and the options, no network
        elif isinstance(path, str):
            confine_path(name, path, ctx)


def check_interrupted(ctx: ExecutionContext) -> None:
    """Interrupted when the process was told to stop: before an engine starts, nothing is left to stop."""
    if ctx.interruption is not None:
        ctx.interruption.check()


def execute(
    d: Definition,
    params: Mapping[str, Any],
    ctx: ExecutionContext,
    sources: list[ResolvedSource] | None = None,
    progress_sink: progress.ProgressSink | None = None,
) -> ExecutionResult:
    """Resolve sources (unless given), run the steps sandboxed, type, bound and digest the result."""
    canonical = parameters.check_parameters(d, params)
    engine = engine_for(d)
    gated = engine.gate(d, ctx.limits)  # refuse hostile SQL before reading any source
    # The time limit counts from the caller's start (resolution included) or from here.
    deadline_at = ctx.deadline_at if ctx.deadline_at is not None else time.monotonic() + ctx.limits.time_limit_s
    ctx = dataclasses.replace(ctx, deadline_at=deadline_at)
    resolved = sources if sources is not None else resolve_sources(d, ctx)
    check_interrupted(ctx)  # resolution (hashing, listing) is not interrupted midway: look once it is done
    job = EngineRun(d, canonical, resolved, ctx.limits, deadline_at, progress_sink, ctx.interruption)
    try:
        result = _run(engine, job, gated)
    except Exception:
        # A file swapped while the engine read it may have made the engine fail on (and quote) other
        # bytes than were fingerprinted: that is reported as the change, never with the engine's text.
        check_unchanged(resolved)
        raise
    check_unchanged(resolved)
    recorded = tuple((s.name, s.kind, s.fingerprint) for s in resolved)
    return ExecutionResult(
        row_count=result.row_count,
        output_digest=result.output_digest,
        ipc_bytes=result.ipc_bytes,
        source_fingerprint_digest=source_fingerprint_digest(recorded),
        sources=recorded,
    )


def _run(engine: Engine, job: EngineRun, gated: Sequence[object]) -> BoundedResult:
    """The engine's run here, or, for DuckDB in a process that isolates (``isolation.configure``: `dataflow
    worker` and `dataflow serve`), in an executor process the operating system bounds. Spark runs in its
    own JVM, bounded by spark.driver.memory, and stays here."""
    pool = isolation.current()
    if pool is None or engine.name != "duckdb":
        return engine.run(job, gated)
    crashpoints.reach(crashpoints.DURING_EXECUTION)  # the executor does not: a fault test stops this process
    return pool.run(job, gated, job.definition.output.max_bytes_int)
