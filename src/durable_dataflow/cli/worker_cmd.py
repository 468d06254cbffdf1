"""`dataflow submit` (record and queue a run) and `dataflow worker` (sweep, claim, execute).

`register(app)` adds both commands to the main CLI (`dataflow submit`, `dataflow worker`); the
global options `--db` and `--lease-ttl` apply, and errors exit through the CLI's one table.

Logs are JSON lines on stderr (structlog): run_id, attempt, event, outcome. They never carry a
secret: the run service scrubs provider errors, and database URLs are not logged.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import structlog
import typer

from durable_dataflow.cli import common, options, remote
from durable_dataflow.cli import runs as cli_runs
from durable_dataflow.core import ledger
from durable_dataflow.core.errors import InputError, StorageUnavailable
from durable_dataflow.dataflow import worker as worker_loop
from durable_dataflow.dataflow.definitions.definitions import load_definition
from durable_dataflow.dataflow.execution import isolation
from durable_dataflow.dataflow.protocol.requests import MAX_ATTEMPTS_DEFAULT
from durable_dataflow.dataflow.protocol.views import RunView
from durable_dataflow.platform import Platform

if TYPE_CHECKING:
    from durable_dataflow.lineage.background import BackgroundDelivery

PORT_MAX = 65_535
OPEN_TRIES_MAX = 12  # with the back-off doubling from 0.1 s to 10 s: about a minute of outage


def _stamped() -> list[structlog.typing.Processor]:
    """What every line carries besides its event: the level and an ISO timestamp (UTC)."""
    return [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]


def configure_logging() -> None:
    """JSON lines on stderr, one per event, with an ISO timestamp and the level.

    Each line reaches the file in one write (structlog's WriteLogger, not PrintLogger, which
    writes the newline separately): workers sharing one log file opened for appending never
    interleave two events on one line."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *_stamped(),
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def route_stdlib_logging(level: int = logging.INFO) -> None:
    """Render the standard library's records (uvicorn's loggers, libraries') as the same JSON lines on
    stderr, with the logger's name: `dataflow serve` then logs one format, as a worker does. A record's
    message becomes the ``event``; StreamHandler writes each line in one call."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *_stamped()],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(sort_keys=True),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # uvicorn's own, when it set them up
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True


def _describe(shown: RunView, created: bool) -> str:
    """One line: the run, whether it was queued or replayed, and its status as `runs` shows it."""
    run = shown.run
    origin = "queued" if created else "replayed: existing run returned, nothing recorded"
    status = "UNRESOLVED" if shown.unresolved else run.status
    return f"run {run.run_id} ({run.definition_name}, {run.mode}) {origin}; status {status}, attempt {run.attempt}"


def submit(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="The dataflow definition (YAML or JSON).")],
    param: options.Params = None,
    idempotency_key: options.IdempotencyKey = None,
    tenant: Annotated[str, typer.Option("--tenant", help="The tenant the run belongs to.")] = "default",
    max_attempts: Annotated[
        int, typer.Option("--max-attempts", help="Attempts allowed before the run fails.")
    ] = MAX_ATTEMPTS_DEFAULT,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run as JSON.")] = False,
    adopt_evidence_key: Annotated[
        bool,
        typer.Option(
            "--adopt-evidence-key",
            help="Record this run even though DATAFLOW_EVIDENCE_KEY (set or not) differs from the ledger's "
            "newest entry: adopts, rotates or drops the key. Only with every run settled and every worker and "
            "server stopped (docs/operations.md).",
        ),
    ] = False,
    wait: cli_runs.Wait = False,
    poll_interval: cli_runs.PollInterval = None,
    wait_timeout: cli_runs.WaitTimeout = None,
) -> None:
    """Record a run and queue it for a worker; nothing is executed here. A replay returns the run."""
    waiting = cli_runs.waiting_of(wait, poll_interval, wait_timeout)
    api = common.state_of(ctx).remote
    if api is not None:
        remote.refuse_options(ctx, "the API records the run for the token's tenant", "tenant")
        _submit_remotely(ctx, api, file, param, idempotency_key, max_attempts, as_json, waiting, adopt_evidence_key)
    request = cli_runs.build_request(load_definition(file), param, idempotency_key, tenant, max_attempts)
    with common.open_platform(ctx) as platform:
        if not adopt_evidence_key:
            ledger.require_key_setting(platform.db, platform.runs.config.evidence_key)
        submission = platform.runs.submit(request)
        shown = common.as_shown(platform, submission.run)
        if waiting is not None:  # a worker executes it: read it until it is settled
            run_id = shown.run.run_id
            shown = cli_runs.wait_until_settled(ctx, shown, lambda: cli_runs.read_shown(platform, run_id), waiting)
    _announce_submitted(ctx, shown, submission.created, as_json, waiting)


def _submit_remotely(
    ctx: typer.Context,
    api: remote.Remote,
    file: Path,
    param: list[str] | None,
    key: str | None,
    max_attempts: int,
    as_json: bool,
    waiting: cli_runs.Waiting | None,
    adopt_evidence_key: bool,
) -> NoReturn:
    """`submit` under --api: ``POST /v1/runs?queue=true`` with the file's YAML, for the token's tenant (the
    server checks its own evidence key); printed and exited as the local submit is."""
    if adopt_evidence_key:
        raise InputError("--adopt-evidence-key acts on the database: run it where the database URL is, not over --api")
    answer = cli_runs.submit_remotely(api, file, param, key, max_attempts, queue=True)
    shown = remote.run_view(answer["run"])
    if waiting is not None:
        run_id = shown.run.run_id
        shown = cli_runs.wait_until_settled(ctx, shown, lambda: cli_runs.read_shown_remotely(api, run_id), waiting)
    _announce_submitted(ctx, shown, bool(answer["created"]), as_json, waiting)


def _announce_submitted(
    ctx: typer.Context, shown: RunView, created: bool, as_json: bool, waiting: cli_runs.Waiting | None
) -> NoReturn:
    """Print the submitted (or replayed) run and exit: 0, or with --wait the run's exit code (9 when
    --wait-timeout passed first), or 3 for a replay of an unresolved run."""
    if as_json:
        common.emit_json(common.run_json(shown, replayed=not created))
        common.print_warning_block(common.stderr_console(), shown, ctx)
    else:
        typer.echo(_describe(shown, created))
        common.print_warning_block(common.stdout_console(), shown, ctx)
    if waiting is not None:  # the outcome as `run` exits with it (9: --wait-timeout passed first)
        raise typer.Exit(common.run_exit_code(shown))
    if shown.unresolved:  # a replay of a run that may have published: exit 3, as `run`'s replay does
        raise typer.Exit(common.EXIT_UNRESOLVED)
    raise typer.Exit(0)


@common.with_limit_options
def worker(
    ctx: typer.Context,
    concurrency: Annotated[int, typer.Option(help="Attempts executed at once (threads).")] = 1,
    once: Annotated[bool, typer.Option("--once", help="Handle one claim (if any) and exit.")] = False,
    until_idle: Annotated[
        bool, typer.Option("--until-idle", help="Exit when nothing is queued, running or in flight.")
    ] = False,
    lease_ttl: Annotated[
        float | None,
        typer.Option("--lease-ttl", help="Lease TTL in seconds (else the global --lease-ttl, DATAFLOW_LEASE_TTL, 30)."),
    ] = None,
    sweep_interval: Annotated[
        float, typer.Option("--sweep-interval", help="Seconds between sweeps of expired leases.")
    ] = worker_loop.SWEEP_INTERVAL_S_DEFAULT,
    poll_interval: Annotated[
        float, typer.Option("--poll-interval", help="Seconds to wait when nothing is queued.")
    ] = worker_loop.POLL_INTERVAL_S_DEFAULT,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", help="Serve Prometheus metrics on this port (default: off; 0: any free port)."),
    ] = None,
    metrics_host: Annotated[
        str, typer.Option("--metrics-host", help="Interface of the metrics port (default: loopback only).")
    ] = "127.0.0.1",
) -> None:
    """Sweep expired leases, claim queued runs and execute them. Without --once/--until-idle it runs
    until SIGTERM/SIGINT, which stops claiming and lets in-flight runs finish."""
    configure_logging()
    # A shared process: each DuckDB execution in an executor process the OS bounds ($DATAFLOW_ISOLATION).
    isolation.configure(isolation.isolation_from_env(isolation.Isolation.PROCESS))
    options = worker_loop.WorkerOptions(
        concurrency=concurrency, once=once, until_idle=until_idle,
        sweep_interval_s=sweep_interval, poll_interval_s=poll_interval,
    )  # fmt: skip
    state = common.state_of(ctx)
    if lease_ttl is not None:
        if not (math.isfinite(lease_ttl) and lease_ttl > 0):  # nan passed "<= 0" and started the worker
            raise InputError(f"--lease-ttl must be a positive number of seconds, got {lease_ttl}")
        state.lease_ttl_s = lease_ttl
    platform = _open_platform(state, options)
    try:
        # A worker extends the chains of runs others recorded: its key setting must be the ledger's.
        ledger.require_key_setting(platform.db, platform.runs.config.evidence_key)
        stop_metrics, observe, observe_lineage = _serve_metrics(platform, metrics_port, metrics_host)
        # Lineage configured: the outbox is delivered in the background (docs/lineage.md); off, nothing starts.
        delivering = _lineage_delivery(platform, observe_lineage)
        loop = worker_loop.Worker(platform.runs, options, observe=observe)
        previous = worker_loop.install_signal_handlers(loop)
        try:
            loop.run()
        finally:
            worker_loop.restore_signal_handlers(previous)
            stop_metrics()
            if delivering is not None:  # the events of the last runs too, when the receiver takes them
                delivering.stop(final_round=True)
    finally:
        platform.close()


def _lineage_delivery(
    platform: Platform, observe: Callable[[int, bool], None] | None
) -> BackgroundDelivery | None:
    """The started background delivery of the lineage outbox (its rounds counted by ``observe`` when the
    worker serves metrics), or None when lineage is not configured (then nothing of lineage is imported)."""
    if not platform.lineage_configured:
        return None
    from durable_dataflow.lineage import background, settings

    return background.start_if_configured(platform.db, True, settings.namespace(), observe)


def _serve_metrics(
    platform: Platform, port: int | None, host: str
) -> tuple[Callable[[], None], worker_loop.RunObserver | None, Callable[[int, bool], None] | None]:
    """With ``--metrics-port``: serve the worker's metrics (api.metrics.WorkerMetrics) from this process and
    observe its runs and lineage deliveries; returns how to stop serving and the two observers (nothing to
    stop, None, None without)."""
    if port is None:
        return (lambda: None), None, None
    if not 0 <= port <= PORT_MAX:
        raise InputError(f"--metrics-port must be between 0 and {PORT_MAX}, got {port}")
    from durable_dataflow.api.metrics import WorkerMetrics  # prometheus-client only when asked for

    metrics = WorkerMetrics(platform.db)
    try:
        stop, bound_port = metrics.serve(port, host)
    except OSError as error:
        raise InputError(f"--metrics-port {port} on {host}: cannot listen ({error.strerror or error})") from error
    structlog.get_logger("dataflow.worker").info("metrics.listening", host=host, port=bound_port)
    return stop, metrics.runs.observe_run, metrics.lineage.observe_delivery


def _open_platform(state: common.CliState, options: worker_loop.WorkerOptions) -> Platform:
    """Open (and migrate) the platform; while the database is briefly down, back off and retry.

    Opening reads the schema version and migrates in transactions that roll back whole, so a retry
    repeats nothing half done. After OPEN_TRIES_MAX failures the worker exits (storage_unavailable).
    """
    backoff = worker_loop.Backoff(options.backoff_initial_s, options.backoff_max_s)
    log = structlog.get_logger("dataflow.worker")
    for tries in range(1, OPEN_TRIES_MAX + 1):
        try:
            return Platform(state.db_url, lease_ttl_s=state.lease_ttl_s, limits=state.limits)
        except StorageUnavailable as error:
            if tries == OPEN_TRIES_MAX:
                raise
            delay_s = backoff.next_delay_s()
            log.warning("storage.unavailable", operation="open", retry_in_s=delay_s, error=error.message)
            time.sleep(delay_s)  # nothing else to do until the database answers: not waiting for an order
    raise AssertionError("unreachable: the last try returns or raises")


def register(app: typer.Typer) -> None:
    """Add `submit` and `worker` to the main CLI."""
    app.command("submit")(submit)
    app.command("worker")(worker)
