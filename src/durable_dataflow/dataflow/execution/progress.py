"""Progress of one run, reported to whoever watches it (``dataflow run`` on a terminal).

A report never changes what a run does: sinks are called from the running thread and must be
cheap and never raise (an exception from a sink is swallowed, so a broken terminal cannot fail a run).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Phase(enum.StrEnum):
    RECORDING = "recording"  # the run and its first ledger entries are being committed
    EXECUTING = "executing"  # sources are read and the steps run in the engine
    COMMITTING = "committing"  # the fenced terminal (or pre-dispatch) transaction
    PUBLISHING = "publishing"  # the provider is called with the stored result


@dataclass(frozen=True)
class Progress:
    """One report: the phase, the engine's own estimate and what the result stream has delivered."""

    phase: Phase
    percent: float | None = None  # DuckDB's query progress, 0-100; None when unknown
    result_rows: int = 0
    result_bytes: int = 0  # Arrow IPC bytes of the result so far


ProgressSink = Callable[[Progress], None]


def report(sink: ProgressSink | None, progress: Progress) -> None:
    """Hand progress to sink, if any; a failing sink never fails the run."""
    if sink is None:
        return
    try:
        sink(progress)
    except Exception:  # a progress display must never change a run's outcome
        return
