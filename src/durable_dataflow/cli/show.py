"""``dataflow show``, ``dataflow verify`` and ``dataflow result``: read one run and its evidence.

Human renderings pass every stored value through ``printable`` (ledger payloads hold a submitter's
parameters and error messages); ``--json`` stays exact JSON. Under ``--api`` each reads the API instead of
the database: ``show`` and ``verify`` the run's evidence, ``result`` the stored bytes as an Arrow IPC stream
(``GET /v1/runs/{id}/result``), exported here exactly as the local command exports them.
"""

from __future__ import annotations

import sys
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from durable_dataflow.cli import common, remote, render
from durable_dataflow.core.errors import DataflowError, InputError, NotFound
from durable_dataflow.core.text import printable
from durable_dataflow.dataflow.execution import results
from durable_dataflow.dataflow.execution.results import EXPORT_FORMATS, ExportFormat
from durable_dataflow.dataflow.protocol import runs, views

if TYPE_CHECKING:
    import pyarrow as pa

RunArgument = Annotated[str, typer.Argument(metavar="RUN", help="The run id (or its tail as `runs` shows it).")]


def _ledger_table(entries: list[dict[str, Any]]) -> Table:
    """The ledger entries as ``views.entry_json`` gives them (locally, or from the API's evidence)."""
    table = Table(title="ledger", title_justify="left")
    for column in ("seq", "attempt", "kind", "time"):
        table.add_column(column, no_wrap=True)
    table.add_column("payload", overflow="fold")
    for entry in entries:
        table.add_row(
            Text(str(entry["seq"])),
            Text(str(entry["attempt"])),
            Text(printable(entry["kind"])),
            Text(common.time_text(entry["recorded_at_us"])),
            Text(printable(common.short_payload(entry["payload"]))),
        )
    return table


def _evidence(ctx: typer.Context, run_id: str) -> dict[str, Any] | None:
    """Under --api: ``GET /v1/runs/{id}/evidence`` (the run, its entries, checkpoint and verification)."""
    api = common.state_of(ctx).remote
    if api is None:
        return None
    evidence: dict[str, Any] = api.call("GET", f"/v1/runs/{urllib.parse.quote(run_id, safe='')}/evidence")
    return evidence


def show_command(
    ctx: typer.Context,
    run_id: RunArgument,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run, its ledger and checkpoint as JSON.")] = False,
) -> None:
    """A run's fields, its ledger entries and latest checkpoint, and the warning if unresolved."""
    evidence = _evidence(ctx, run_id)
    if evidence is not None:  # the API's evidence holds `show --json`'s fields exactly (views.RunEvidence)
        document = {**evidence["run"], "ledger": evidence["entries"], "checkpoint": evidence["checkpoint"]}
        view = remote.run_view(evidence["run"])
    else:
        with common.open_platform(ctx) as platform, platform.db.read() as conn:
            page = views.run_page(conn, platform.db, runs.resolve_run_id(conn, run_id))  # reads only, never sweeps
        document, view = page.as_json(), page.shown.view
    if as_json:
        common.emit_json(document)
        return
    checkpoint = document["checkpoint"]
    console = common.stdout_console()
    console.print(render.run_panel(view))
    console.print(_ledger_table(document["ledger"]))
    if checkpoint is None:
        console.print("checkpoint: none (no verified state yet)")
    else:
        console.print(
            Text(
                printable(
                    f"checkpoint: {checkpoint['status']} at attempt {checkpoint['attempt']}, head seq "
                    f"{checkpoint['head_seq']} {checkpoint['head_hash']}, "
                    f"verified {common.time_text(checkpoint['verified_at_us'])}"
                )
            )
        )
    common.print_warning_block(console, view, ctx)


def verify_command(
    ctx: typer.Context,
    run_id: RunArgument,
    as_json: Annotated[bool, typer.Option("--json", help="Print the verification as JSON.")] = False,
) -> None:
    """Recompute the run's evidence chain and check its facts: exit 0 when it verifies, 1 when not."""
    evidence = _evidence(ctx, run_id)
    if evidence is not None:  # the API's verification is `verify --json`'s document exactly
        found = views.RunVerification.from_json(evidence["verification"])
    else:
        with common.open_platform(ctx) as platform, platform.db.read() as conn:
            found = views.verification(conn, runs.resolve_run_id(conn, run_id), platform.config.evidence_key)
    result = found.result
    code = common.EXIT_OK if result.ok else common.EXIT_ERROR
    if as_json:
        common.emit_json(found.as_json())
        raise typer.Exit(code)
    console = common.stdout_console()
    if result.ok:
        keyed = ", keyed" if result.keyed else ""
        console.print(
            Text(
                f"evidence verified: {result.entry_count} entries, "
                f"head seq {result.head_seq} {result.head_hash}{keyed}",
                style="green",
            )
        )
        raise typer.Exit(code)
    where = f" (broken at seq {result.broken_seq})" if result.broken_seq is not None else ""
    console.print(Text(printable(f"evidence NOT verified{where}: {result.reason}"), style="bold red"))
    raise typer.Exit(code)


def result_command(
    ctx: typer.Context,
    run_id: RunArgument,
    fmt: Annotated[str, typer.Option("--format", "-f", metavar="FORMAT", help="csv, parquet or json.")] = "csv",
    output: Annotated[Path | None, typer.Option("--output", "-o", metavar="FILE",
                                                    help="Write to this file instead of stdout.")] = None,
) -> None:
    """The run's stored result (the committed bytes), exported as CSV, Parquet or JSON."""
    if fmt not in EXPORT_FORMATS:
        raise InputError(f"--format {fmt!r} is not one of: {', '.join(EXPORT_FORMATS)}")
    export_format: ExportFormat = fmt  # narrowed by the membership check above
    if export_format == "parquet" and output is None and sys.stdout.isatty():
        raise InputError("refusing to write Parquet (binary) to a terminal: pass --output PATH or redirect stdout")
    api = common.state_of(ctx).remote
    if api is not None:
        table = _result_remotely(api, run_id)
    else:
        with common.open_platform(ctx) as platform:
            with platform.db.read() as conn:
                full_id = runs.resolve_run_id(conn, run_id)
            with platform.db.read() as conn:  # what RunService.result_bytes reads, without importing the engine
                stored = results.stored_bytes(conn, full_id)
            table = results.decode_ipc(stored)
    data = results.export(table, export_format)
    if output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    try:
        output.write_bytes(data)
    except OSError as error:
        raise InputError(f"cannot write {output}: {error.strerror or error}") from None
    common.stderr_console().print(Text(f"wrote {table.num_rows} rows ({len(data)} bytes, {fmt}) to {output}"))


def _result_remotely(api: remote.Remote, run_id: str) -> pa.Table:
    """`result` under --api: ``GET /v1/runs/{id}/result``, the stored Arrow IPC stream read batch by batch
    as it arrives (never held as bytes besides the table); an answer cut short is storage_unavailable
    (exit 7). A run that stored no result answers 409 there; here it is the local command's not_found
    (exit 4), with the same message."""
    try:
        with (
            api.stream("GET", f"/v1/runs/{remote.quoted(run_id)}/result", remote.ARROW_STREAM_MEDIA_TYPE) as answer,
            results.ipc_reader(answer) as reader,
        ):
            return reader.read_all()
    except DataflowError as error:
        if error.code == "conflict":  # the route's one conflict: the run stored no result
            raise NotFound(error.message) from None
        raise


def register(app: typer.Typer) -> None:
    app.command("show")(show_command)
    app.command("verify")(verify_command)
    app.command("result")(result_command)
