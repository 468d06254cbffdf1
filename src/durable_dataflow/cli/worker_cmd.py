"""`dataflow submit` (record and queue a run) and `dataflow worker` (sweep, claim, execute).

`register(app)` adds both commands to the main CLI. The module also runs on its own
(`python -m durable_dataflow.cli.worker_cmd worker --once`), which the fault tests use so that a
worker process imports no more than it needs.

Logs are JSON lines on stderr (structlog): run_id, attempt, event, outcome. They never carry a
secret: the run service scrubs provider errors, and database URLs are not logged.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import structlog
import typer

from durable_dataflow.core.errors import DataflowError, InputError
from durable_dataflow.dataflow import worker as worker_loop
from durable_dataflow.dataflow.definitions import load_definition
from durable_dataflow.dataflow.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.runs import Run
from durable_dataflow.platform import Platform

EXIT_INPUT = 2
EXIT_ERROR = 1
PARAMS_MAX = 100


def configure_logging() -> None:
    """JSON lines on stderr, one per event, with an ISO timestamp and the level."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def parse_params(pairs: list[str]) -> dict[str, str]:
    """`k=v` pairs into raw string parameters (typed later against the definition)."""
    if len(pairs) > PARAMS_MAX:
        raise InputError(f"at most {PARAMS_MAX} --param values are accepted")
    params: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InputError(f"--param expects NAME=VALUE, got {pair!r}")
        if name in params:
            raise InputError(f"--param {name} is given twice")
        params[name] = value
    return params


def _fail(error: DataflowError) -> typer.Exit:
    typer.echo(f"error [{error.code}]: {error.message}", err=True)
    return typer.Exit(EXIT_INPUT if isinstance(error, InputError) else EXIT_ERROR)


def _describe(run: Run, created: bool) -> str:
    origin = "queued" if created else "existing run for this idempotency key"
    line = f"run {run.run_id} ({run.definition_name}, {run.mode}) {origin}: status {run.status}, attempt {run.attempt}"
    if run.warning:
        line += f"\nWARNING: {run.warning}"
    return line


def submit(
    file: Annotated[Path, typer.Argument(help="The dataflow definition (YAML or JSON).")],
    param: Annotated[list[str] | None, typer.Option("--param", help="A parameter, NAME=VALUE (repeatable).")] = None,
    idempotency_key: Annotated[
        str | None, typer.Option("--idempotency-key", help="Replays of this key return the existing run.")
    ] = None,
    tenant: Annotated[str, typer.Option("--tenant", help="The tenant the run belongs to.")] = "default",
    as_json: Annotated[bool, typer.Option("--json", help="Print the run as JSON.")] = False,
) -> None:
    """Record a run and queue it for a worker; nothing is executed here."""
    try:
        loaded = load_definition(file)
        request = RunRequest(
            definition=loaded.definition,
            base_dir=loaded.base_dir,
            parameters=parse_params(param or []),
            access=AccessContext.local(tenant),
            provenance=Provenance(actor=AccessContext.local(tenant).principal, trigger="cli"),
            idempotency_key=idempotency_key,
        )
        with Platform() as platform:
            submission = platform.runs.submit(request)
    except DataflowError as error:
        raise _fail(error) from None
    if as_json:
        typer.echo(json.dumps({**submission.run.public(), "created": submission.created}, sort_keys=True))
    else:
        typer.echo(_describe(submission.run, submission.created))


def worker(
    concurrency: Annotated[int, typer.Option(help="Attempts executed at once (threads).")] = 1,
    once: Annotated[bool, typer.Option("--once", help="Handle one claim (if any) and exit.")] = False,
    until_idle: Annotated[
        bool, typer.Option("--until-idle", help="Exit when nothing is queued, running or in flight.")
    ] = False,
    lease_ttl: Annotated[
        float | None, typer.Option("--lease-ttl", help="Lease TTL in seconds (default DATAFLOW_LEASE_TTL or 30).")
    ] = None,
    sweep_interval: Annotated[
        float, typer.Option("--sweep-interval", help="Seconds between sweeps of expired leases.")
    ] = worker_loop.SWEEP_INTERVAL_S_DEFAULT,
    poll_interval: Annotated[
        float, typer.Option("--poll-interval", help="Seconds to wait when nothing is queued.")
    ] = worker_loop.POLL_INTERVAL_S_DEFAULT,
) -> None:
    """Sweep expired leases, claim queued runs and execute them. Without --once/--until-idle it runs
    until SIGTERM/SIGINT, which stops claiming and lets in-flight runs finish."""
    configure_logging()
    try:
        options = worker_loop.WorkerOptions(
            concurrency=concurrency, once=once, until_idle=until_idle,
            sweep_interval_s=sweep_interval, poll_interval_s=poll_interval,
        )  # fmt: skip
        platform = _open_platform(lease_ttl)
    except DataflowError as error:
        raise _fail(error) from None
    try:
        loop = worker_loop.Worker(platform.runs, options)
        previous = worker_loop.install_signal_handlers(loop)
        try:
            loop.run()
        finally:
            worker_loop.restore_signal_handlers(previous)
    finally:
        platform.close()


def _open_platform(lease_ttl_s: float | None) -> Platform:
    """Open the platform (migrations included); a database down at start-up is an error, not a wait."""
    if lease_ttl_s is not None and lease_ttl_s <= 0:
        raise InputError(f"--lease-ttl must be a positive number of seconds, got {lease_ttl_s}")
    return Platform(lease_ttl_s=lease_ttl_s)


def register(app: typer.Typer) -> None:
    """Add `submit` and `worker` to the main CLI."""
    app.command("submit")(submit)
    app.command("worker")(worker)


def main() -> None:
    """Run these two commands on their own (`python -m durable_dataflow.cli.worker_cmd`)."""
    app = typer.Typer(add_completion=False, no_args_is_help=True)
    register(app)
    app()


if __name__ == "__main__":
    main()
