"""`dataflow serve`, `dataflow tokens create|list|revoke` and `dataflow ops ledger`.

``register(app)`` adds them to the main CLI. The database is the global ``--db``, else
``DATAFLOW_DB``, else the embedded default; access to it is the platform-level credential, so
`ops ledger` here is platform-wide, and only here can a platform operator token be created
(`tokens create --platform`): the API's projection is platform-wide for that token alone.
Errors propagate to the CLI's one error table (``cli.common``). Every value shown in a table goes
through ``printable`` inside a ``Text``: a submitter's definition name or key can neither move the
terminal's cursor nor be read as Rich markup.
"""

from __future__ import annotations

import json
import math
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import structlog
import typer
from rich.table import Table
from rich.text import Text

from durable_dataflow.api import tokens as api_tokens
from durable_dataflow.cli import common, worker_cmd
from durable_dataflow.core import ledger
from durable_dataflow.core.errors import InputError, StorageUnavailable
from durable_dataflow.core.text import printable
from durable_dataflow.dataflow import worker as worker_loop
from durable_dataflow.dataflow.execution import isolation
from durable_dataflow.dataflow.execution.interruption import Interruption
from durable_dataflow.dataflow.protocol import fleet, sweeper
from durable_dataflow.dataflow.worker import SWEEP_INTERVAL_S_DEFAULT
from durable_dataflow.platform import Platform

if TYPE_CHECKING:
    from durable_dataflow.lineage.background import BackgroundDelivery

DEFAULT_PORT = 8080
PORT_MAX = 65_535
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
SHUTDOWN_GRACE_S = 3  # after SIGTERM, uvicorn waits this long for open requests (interrupted ones answer sooner)
SWEEP_INTERVAL_S_MAX = 86_400.0  # a day: longer leaves crashed runs undecided for no reason
SWEEPER_STOP_WAIT_S = 60.0  # a batch in progress finishes its decisions (one transaction each) first
# The longest wait between two tries of the sweep while the platform database is down.
SWEEP_RETRY_S_MAX = worker_loop.BACKOFF_MAX_S
log = structlog.get_logger("dataflow.serve")

tokens_app = typer.Typer(help="Create, list and revoke API tokens (stored as hashes only).", no_args_is_help=True)
ops_app = typer.Typer(help="Ops: the read-only, platform-wide ledger projection.", no_args_is_help=True)


class ServeSweeper:
    """The sweeper of `dataflow serve`: every ``interval_s`` it decides the expired attempts of the
    platform database (``dataflow.protocol.sweeper.sweep``), as every worker does, so an embedded deployment
    with no worker still turns a crashed attempt into ``outcome_unknown`` or a retry. Many sweepers at
    once are safe (exactly one decides each attempt). A background thread; :meth:`stop` ends it
    between two sweeps and waits for it. While the database is down it retries after a back-off that
    doubles from ``interval_s`` up to SWEEP_RETRY_S_MAX, logging each failed try (so the repeats thin out)
    and ``storage.recovered`` once it answers again. ``wait`` and ``clock`` are injected for tests."""

    def __init__(
        self,
        platform: Platform,
        interval_s: float,
        *,
        wait: Callable[[float], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.platform = platform
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wait = wait if wait is not None else self._stop.wait
        self._thread = threading.Thread(target=self._loop, name="dataflow-serve-sweeper", daemon=True)
        self._backoff = worker_loop.Backoff(interval_s, max(interval_s, SWEEP_RETRY_S_MAX))
        self._outage = worker_loop.StorageOutage(log, clock)
        self._retry_in_s: float | None = None  # set while the database is down: the next try's delay
        # Its row in the fleet table (role sweeper), beaten before each sweep that is due a beat: its TTL
        # covers BEATS_PER_TTL sweep intervals, so a long interval never reads as a dead sweeper.
        ttl_s = max(fleet.ttl_from_env(), interval_s * fleet.BEATS_PER_TTL)
        self.heartbeat = fleet.Heartbeat(platform.db, platform.runs.config.holder, fleet.Role.SWEEPER, 1, ttl_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = SWEEPER_STOP_WAIT_S) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        try:
            self.heartbeat.stopped()
        except StorageUnavailable as error:  # the row then reads dead after its TTL
            log.warning("sweeper.unmarked", error=error.message)

    def _loop(self) -> None:
        """Runs until stopped: this loop is meant to run for the server's whole life."""
        while not self._stop.is_set():
            full = self.sweep_once() >= sweeper.SWEEP_BATCH_MAX
            if self._retry_in_s is not None:
                self._wait(self._retry_in_s)
            elif not full:  # a full batch: more expired leases may wait, sweep again at once
                self._wait(self.interval_s)

    def sweep_once(self) -> int:
        """One sweep; never raises (a down database or a bug is logged, the next sweep tries again)."""
        key = self.platform.runs.config.evidence_key
        try:
            self.platform.runs.holder_lock.ensure()
            self.heartbeat.maybe_beat(time.monotonic(), 0, self.platform.runs.holder_lock.held)
            decisions = sweeper.sweep(self.platform.db, evidence_key=key, batch=sweeper.SWEEP_BATCH_MAX)
        except StorageUnavailable as error:
            self._retry_in_s = self._backoff.next_delay_s()
            self._outage.failed("sweep", error, self._retry_in_s)
            return 0
        except Exception as error:
            log.error("sweep.failed", error_type=type(error).__name__, note="the next sweep tries again")
            return 0
        self._retry_in_s = None
        self._backoff.reset()
        self._outage.succeeded("sweep")
        for decision in decisions:
            if decision.decision != sweeper.Decision.SKIPPED:
                log.warning(
                    "sweep.decided", run_id=decision.run_id, attempt=decision.attempt, outcome=decision.decision
                )
        return len(decisions)


@common.with_limit_options
def serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="Interface to listen on"),
    port: int = typer.Option(DEFAULT_PORT, help="TCP port (0: any free port, printed at start-up)"),
    data_root: Path | None = typer.Option(
        None,
        help="Tenant data: each tenant's sources resolve under DIR/<tenant> "
        "(default: $DATAFLOW_DATA_ROOT, else ./.dataflow/data)",
    ),
    sink_root: Path | None = typer.Option(
        None,
        help="Tenant file sinks: each tenant's relative locations resolve under DIR/<tenant> "
        "(default: $DATAFLOW_SINK_ROOT, else the data root)",
    ),
    body_bytes_max: int | None = typer.Option(
        None,
        "--body-bytes-max",
        help="Largest request body in bytes (default: $DATAFLOW_API_BODY_BYTES_MAX, else 4 MiB)",
    ),
    log_level: str = typer.Option("info", help="uvicorn log level"),
    sweep_interval: float = typer.Option(
        SWEEP_INTERVAL_S_DEFAULT,
        "--sweep-interval",
        help="Seconds between sweeps of expired leases, as a worker does (0: never sweep)",
    ),
) -> None:
    """Serve the JSON API (/v1), the web operator view (/ui), /metrics and /healthz; sweep expired leases."""
    _check_serve_options(host, port, log_level, sweep_interval)
    worker_cmd.configure_logging()
    worker_cmd.route_stdlib_logging()
    # A shared process: each DuckDB execution in an executor process the OS bounds ($DATAFLOW_ISOLATION).
    isolation.configure(isolation.isolation_from_env(isolation.Isolation.PROCESS))
    from durable_dataflow.api.app import create_app

    with common.open_platform(ctx) as platform:
        # The server records, executes and reconciles runs: its key setting must be the ledger's.
        ledger.require_key_setting(platform.db, platform.runs.config.evidence_key)
        application = create_app(platform, data_root=data_root, sink_root=sink_root, body_bytes_max=body_bytes_max)
        sweeping = ServeSweeper(platform, sweep_interval) if sweep_interval > 0 else None
        if sweeping is not None:
            sweeping.start()
        # Lineage configured: the outbox is delivered in the background (docs/lineage.md); off, nothing starts.
        delivering = _lineage_delivery(platform, application.state.metrics.lineage.observe_delivery)
        previous = signal.signal(signal.SIGTERM, _stop_serving)
        try:
            _run_uvicorn(application, host, port, log_level, platform.runs.interruption)
        finally:
            signal.signal(signal.SIGTERM, previous)
            if sweeping is not None:
                sweeping.stop()
            if delivering is not None:
                delivering.stop()


def _lineage_delivery(platform: Platform, observe: Callable[[int, bool], None]) -> BackgroundDelivery | None:
    """The started background delivery of the lineage outbox (its rounds counted by ``observe``: /metrics),
    or None when lineage is not configured."""
    if not platform.lineage_configured:
        return None
    from durable_dataflow.lineage import background, settings

    return background.start_if_configured(platform.db, True, settings.namespace(), observe)


def _check_serve_options(host: str, port: int, log_level: str, sweep_interval: float) -> None:
    """Refuse, before anything starts, what uvicorn or the sweeper would fail on later (or misread)."""
    if not host.strip():  # uvicorn binds every interface for "": say so explicitly
        raise InputError("--host must name an interface: 127.0.0.1, or 0.0.0.0 for every interface")
    if not 0 <= port <= PORT_MAX:
        raise InputError(f"--port must be 0 (any free port) to {PORT_MAX}")
    try:  # uvicorn exits 3 for a host it cannot bind, the status of an unresolved run
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise InputError("--host does not resolve to an address") from None
    if log_level not in LOG_LEVELS:
        raise InputError(f"--log-level must be one of: {', '.join(LOG_LEVELS)}")
    if not (math.isfinite(sweep_interval) and 0 <= sweep_interval <= SWEEP_INTERVAL_S_MAX):
        raise InputError(
            f"--sweep-interval must be 0 (never sweep) or a number of seconds up to {SWEEP_INTERVAL_S_MAX:.0f}"
        )


def _run_uvicorn(application: Any, host: str, port: int, log_level: str, executions: Interruption) -> None:
    """uvicorn.run, except that SIGTERM/SIGINT also interrupt the inline executions in flight, and open
    requests get SHUTDOWN_GRACE_S. uvicorn waits for every open request before it stops, and an inline
    submit holds one until its execution ends (a Spark job: minutes): now the execution stops as at its
    time limit and its run ends cancelled (interrupted), as in a worker (docs/deployment.md)."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            executions.request(signal.Signals(sig).name, "api")  # two attribute writes: safe in a handler
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        application, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        log_config=None,  # uvicorn's records go through the JSON lines route_stdlib_logging set up
    )  # fmt: skip
    server = Server(config)
    server.run()
    if not server.started:  # as uvicorn.run: a port it could not bind
        raise SystemExit(STARTUP_FAILURE)


def _stop_serving(signum: int, frame: FrameType | None) -> None:
    """SIGTERM outside uvicorn's own handler: before it starts, and when its graceful shutdown re-raises
    the signal. Stop with exit 0 through the clean-up (the sweeper's stop, the platform's close)."""
    raise typer.Exit(common.EXIT_OK)


@tokens_app.command("create")
def tokens_create(
    ctx: typer.Context,
    tenant: str | None = typer.Option(None, help="The tenant the token acts for (required without --platform)"),
    role: str | None = typer.Option(None, help="viewer | submitter | operator (required without --platform)"),
    platform_wide: bool = typer.Option(
        False,
        "--platform",
        help="A platform_operator token: no tenant; reads only the platform-wide ops ledger and /metrics",
    ),
    name: str | None = typer.Option(None, help="A name for the token (recorded as the run principal)"),
) -> None:
    """Create a token and print it ONCE: only its hash is stored."""
    if platform_wide and (tenant is not None or role is not None):
        common.fail("--platform takes neither --tenant nor --role: a platform operator token belongs to no tenant")
    if not platform_wide and (tenant is None or role is None):
        common.fail("give --tenant and --role for a tenant token, or --platform for a platform operator token")
    with common.open_platform(ctx) as platform:
        if tenant is None or role is None:
            token, info = api_tokens.create_platform_token(platform.db, name)
        else:
            token, info = api_tokens.create_token(platform.db, tenant, role, name)
    typer.echo(token)
    named = f" ({info.name})" if name is not None else ""  # unnamed, the name is the id: say it once
    typer.echo(
        f"created {info.token_id}{named} for {_scope_text(info)}, role {info.role.value}; "
        "this is the only time the token is shown",
        err=True,
    )


def _scope_text(info: api_tokens.TokenInfo) -> str:
    return "the whole platform (every tenant's ops ledger)" if info.is_platform else f"tenant {info.tenant}"


@tokens_app.command("list")
def tokens_list(
    ctx: typer.Context,
    tenant: str | None = typer.Option(None, help="Only this tenant's tokens"),
    as_json: bool = typer.Option(False, "--json", help="JSON lines instead of a table"),
) -> None:
    """List tokens (their ids, tenants, roles and names; never the tokens)."""
    with common.open_platform(ctx) as platform:
        found = api_tokens.list_tokens(platform.db, tenant)
    if as_json:
        for info in found:
            typer.echo(json.dumps({**info.__dict__, "role": info.role.value, "platform": info.is_platform}))
        return
    table = Table("id", "tenant", "role", "name", "created", "revoked")
    for info in found:
        tenant_cell = Text("* (platform-wide)", style="bold") if info.is_platform else _cell(info.tenant)
        cells = (info.token_id, info.role.value, info.name, _when(info.created_at_us), _when(info.revoked_at_us))
        table.add_row(_cell(cells[0]), tenant_cell, *(_cell(c) for c in cells[1:]))
    common.stdout_console().print(table)


@tokens_app.command("revoke")
def tokens_revoke(
    ctx: typer.Context,
    token_id: str = typer.Argument(..., help="The token id (tok_...) from `dataflow tokens list`"),
) -> None:
    """Revoke a token: every later request with it answers 401."""
    with common.open_platform(ctx) as platform:
        info = api_tokens.revoke_token(platform.db, token_id)
    typer.echo(f"revoked {info.token_id} ({info.name}) at {_when(info.revoked_at_us)}")


@ops_app.command("ledger")
def ops_ledger(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="The projection as one JSON document"),
    tenant: str | None = typer.Option(None, help="Only this tenant (default: platform-wide)"),
    entries: bool = typer.Option(False, "--entries", help="Also count every ledger entry (scans the whole ledger)"),
) -> None:
    """The platform-wide ledger projection: counts by module and recovery status, unresolved runs and ages."""
    from durable_dataflow.ops import ledger

    api = common.state_of(ctx).remote
    if api is not None:  # the token decides the scope: its tenant, or every tenant for a platform token
        if tenant is not None or entries:
            raise InputError("--tenant and --entries do not apply under --api: the token's scope is shown")
        document: dict[str, Any] = api.call("GET", "/v1/ops/ledger")
    else:
        with common.open_platform(ctx) as platform:
            document = ledger.read_projection(platform.db, tenant, count_entries=entries).as_json()
    if as_json:
        typer.echo(json.dumps(document, indent=2, sort_keys=True))
        return
    _print_projection(document)


def _when(us: int | None) -> str:
    if us is None:
        return "-"
    from datetime import UTC, datetime

    return datetime.fromtimestamp(us / 1_000_000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _print_projection(data: dict[str, Any]) -> None:
    console = common.stdout_console()
    columns = ("module", "subjects", "entries", "checkpoints", "live leases", "expired leases")
    modules = Table(*columns, title="Ledger by module")
    for m in data["modules"]:
        modules.add_row(
            _cell(m["module"]),
            *(
                _cell("-" if m[k] is None else str(m[k]))
                for k in ("subjects", "entries", "checkpoints", "leases_live", "leases_expired")
            ),
        )
    console.print(modules)
    # By the pair, as the Ops page shows it: cancelled and failed share the no_external_output recovery.
    states = Table("status", "recovery status", "runs", title="Dataflow runs by status")
    for state in data["runs_by_state"]:
        states.add_row(_cell(state["status"]), _cell(state["recovery_status"]), _cell(str(state["runs"])))
    console.print(states)
    hours = data["recent_failures_window_s"] // 3600
    failures = Table("error code", "runs", title=f"Failed runs in the last {hours} h by error code")
    for code, count in data["recent_failures"].items():
        failures.add_row(_cell(code), _cell(str(count)))
    console.print(failures if data["recent_failures"] else Text(f"No failed runs in the last {hours} h"))
    total = data["unresolved_total"]
    console.print(Text(f"Unresolved runs: {total}", style="bold red" if total else "green"))
    if total:
        headers = ("run", "tenant", "definition", "recovery status", "key", "output digest", "age s")
        unresolved = Table(*headers, title="Unresolved")
        for u in data["unresolved"]:
            key = u["publication_idempotency_key"] or u["idempotency_key"]
            unresolved.add_row(
                *(_cell(v) for v in (u["run_id"], u["tenant"], u["definition_name"], u["recovery_status"], key)),
                _cell(u["output_digest"] or "-"), _cell(f"{u['age_s']:.0f}"),
            )  # fmt: skip
        console.print(unresolved)
        oldest = data["oldest_unresolved"]
        run_id = printable(oldest["run_id"], multiline=False)
        console.print(
            Text(
                f"Oldest unresolved: {run_id} ({oldest['age_s']:.0f} s). External output may exist: "
                f"reconcile it (`dataflow reconcile {run_id}`); never infer absence.",
                style="bold red",
            )
        )


def _cell(value: str) -> Text:
    """A table cell: never read as Rich markup, on one line, with no character a terminal would act on."""
    return Text(printable(value, multiline=False))


def register(app: typer.Typer) -> None:
    """Add `serve`, `tokens` and `ops` to the main CLI."""
    app.command("serve")(serve)
    app.add_typer(tokens_app, name="tokens")
    app.add_typer(ops_app, name="ops")
