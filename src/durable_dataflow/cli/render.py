"""Rich renderings of runs: the detail panel and the history table.

Values are wrapped in ``Text`` so that brackets in user data are never read as Rich markup, and
pass through ``printable`` first: a submitter's parameter, key, name or error message reaches the
operator's terminal with its control and bidirectional characters shown as escapes, never acted on.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from durable_dataflow.cli import common
from durable_dataflow.core.text import printable
from durable_dataflow.dataflow.protocol.runs import Run, RunStatus, parameters_text
from durable_dataflow.dataflow.protocol.views import RunView

# The history's parameters cell is cut here, with an ellipsis: `runs --json` carries every value whole.
PARAMETERS_CELL_CHARS_MAX = 40


def _field_rows(view: RunView) -> list[tuple[str, str | Text | None]]:
    run = view.run
    return [
        ("run id", run.run_id),
        ("definition", f"{run.definition_name} ({run.definition_hash})"),
        ("tenant", run.tenant),
        ("idempotency key", run.idempotency_key),
        ("mode", run.mode),
        ("status", common.status_text(view)),
        ("recovery status", run.recovery_status),
        ("attempt", f"{run.attempt} of at most {run.max_attempts}"),
        ("lease", "expired, not yet swept" if view.lease_expired else None),
        ("parameters", common.short_payload(run.parameters)),
        ("rows", None if run.row_count is None else str(run.row_count)),
        ("output digest", run.output_digest),
        ("source fingerprints", run.source_fingerprint_digest),
        ("request hash", run.request_hash),
        ("access context", f"{run.principal} ({run.access_context_digest})"),
        ("provenance", common.short_payload(run.provenance)),
        ("target", None if run.target is None else common.short_payload(run.target)),
        ("publication key", run.publication_idempotency_key),
        ("publication ref", run.publication_ref),
        ("datasource ref", run.datasource_ref),
        ("materialization", run.materialization_ref),
        ("error", f"[{run.error_code}] {run.error_message}" if run.error_code else None),
        ("created", common.time_text(run.created_at_us)),
        ("updated", common.time_text(run.updated_at_us)),
    ]


def run_panel(shown: Run | RunView, *, title: str = "run") -> Panel:
    """Every field of a run that is set, in a two-column grid."""
    view = common.view_of(shown)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    for label, value in _field_rows(view):
        if value is None:
            continue
        grid.add_row(label, value if isinstance(value, Text) else Text(printable(value)))
    border = "yellow" if view.unresolved else ("green" if view.run.status == RunStatus.SUCCEEDED else "red")
    return Panel(grid, title=Text(title), border_style=border, expand=False)


def _one_line(value: str) -> str:
    """A history cell's text: a newline or tab in it is shown as an escape, so every run is one row."""
    return printable(value, multiline=False)


def history_table(items: Sequence[Run | RunView], now_s: float) -> Table:
    """The run history: unresolved runs carry their warning, in bold yellow, never 'failed'."""
    table = Table(show_lines=False, expand=False)
    for column in ("run", "definition", "parameters", "status", "recovery", "error", "attempt", "rows", "age"):
        table.add_column(column, no_wrap=True)
    table.add_column("WARNING", overflow="fold")
    for view in map(common.view_of, items):
        run = view.run
        # Shown whole, never truncated: its last sentence is the action to take.
        warning_cell = Text(_one_line(view.warning or ""), style="bold yellow" if view.unresolved else "yellow")
        table.add_row(
            Text(_one_line(common.short_id(run.run_id))),
            Text(_one_line(run.definition_name)),
            Text(_one_line(parameters_text(run.parameters, PARAMETERS_CELL_CHARS_MAX))),
            common.status_text(view),
            Text(_one_line(run.recovery_status), style="bold yellow" if view.unresolved else ""),
            # The code only (the message is on `dataflow show`): which runs failed of what, at a glance.
            Text(_one_line(run.error_code or ""), style="red" if run.status == RunStatus.FAILED else ""),
            Text(f"{run.attempt}/{run.max_attempts}"),
            Text("" if run.row_count is None else str(run.row_count)),
            Text(common.age_text(run.created_at_us, now_s)),
            warning_cell,
        )
    return table
