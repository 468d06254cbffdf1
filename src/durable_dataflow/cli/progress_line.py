"""The live progress line of ``dataflow run`` on a terminal: phase, engine progress, rows and bytes.

Shown on stderr only when stderr is a terminal and the output is not JSON, so pipes, logs and
``--json`` stay clean. Reports arrive from the execution's watch thread; Rich's status is updated
under its own lock.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from rich.text import Text

from durable_dataflow.cli import common
from durable_dataflow.dataflow.execution.progress import Phase, Progress, ProgressSink


def describe(name: str, report: Progress, elapsed_s: float) -> str:
    """One line: ``<name>: executing 42% · 1,204 rows · 3.1 MiB · 12.4 s``."""
    parts = [f"{name}: {report.phase.value}"]
    if report.percent is not None and report.phase == Phase.EXECUTING:
        parts[0] += f" {report.percent:.0f}%"
    if report.result_rows or report.result_bytes:
        parts.append(f"{report.result_rows:,} rows")
        parts.append(_approximate_size(report.result_bytes))
    parts.append(f"{elapsed_s:.1f} s")
    return " · ".join(parts)


def _approximate_size(size: int) -> str:
    for unit, name in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if size >= unit:
            return f"{size / unit:.1f} {name}"
    return f"{size} B"


@contextlib.contextmanager
def run_progress(name: str, as_json: bool) -> Iterator[ProgressSink | None]:
    """A progress sink drawing the line while the block runs, or None when nobody watches a terminal."""
    if as_json or not sys.stderr.isatty():
        yield None
        return
    started = time.monotonic()
    with common.stderr_console().status(Text(f"{name}: starting")) as status:

        def sink(report: Progress) -> None:
            status.update(Text(describe(name, report, time.monotonic() - started)))

        yield sink
