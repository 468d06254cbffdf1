"""`dataflow serve`, `dataflow tokens create|list|revoke` and `dataflow ops ledger`.

``register(app)`` adds them to the main CLI. The database is the global ``--db``, else
``DATAFLOW_DB``, else the embedded default; access to it is the platform-level credential, so
`ops ledger` here is platform-wide while the API's projection is scoped to the caller's tenant.
Errors propagate to the CLI's one error table (``cli.common``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from durable_dataflow.api import tokens as api_tokens
from durable_dataflow.cli import common

DEFAULT_PORT = 8080

tokens_app = typer.Typer(help="Create, list and revoke API tokens (stored as hashes only).", no_args_is_help=True)
ops_app = typer.Typer(help="Ops: the read-only, platform-wide ledger projection.", no_args_is_help=True)


@common.with_limit_options
def serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="Interface to listen on"),
    port: int = typer.Option(DEFAULT_PORT, help="TCP port (0: any free port, printed at start-up)"),
    data_root: Path | None = typer.Option(
        None, help="Where API-submitted source paths resolve (default: first $DATAFLOW_DATA_ROOTS entry, else cwd)"
    ),
    log_level: str = typer.Option("info", help="uvicorn log level"),
) -> None:
    """Serve the JSON API (/v1), the web operator view (/ui), /metrics and /healthz."""
    import uvicorn

    from durable_dataflow.api.app import create_app

    with common.open_platform(ctx) as platform:
        application = create_app(platform, data_root=data_root)
        uvicorn.run(application, host=host, port=port, log_level=log_level)


@tokens_app.command("create")
def tokens_create(
    ctx: typer.Context,
    tenant: str = typer.Option(..., help="The tenant the token acts for"),
    role: str = typer.Option(..., help="viewer | submitter | operator"),
    name: str | None = typer.Option(None, help="A name for the token (recorded as the run principal)"),
) -> None:
    """Create a token and print it ONCE: only its hash is stored."""
    with common.open_platform(ctx) as platform:
        token, info = api_tokens.create_token(platform.db, tenant, role, name)
    typer.echo(token)
    typer.echo(
        f"created {info.token_id} ({info.name}) for tenant {info.tenant}, role {info.role.value}; "
        "this is the only time the token is shown",
        err=True,
    )


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
            typer.echo(json.dumps({**info.__dict__, "role": info.role.value}))
        return
    table = Table("id", "tenant", "role", "name", "created", "revoked")
    for info in found:
        table.add_row(
            info.token_id, info.tenant, info.role.value, info.name, _when(info.created_at_us), _when(info.revoked_at_us)
        )
    Console().print(table)


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

    with common.open_platform(ctx) as platform:
        projection = ledger.read_projection(platform.db, tenant, count_entries=entries)
    if as_json:
        typer.echo(json.dumps(projection.as_json(), indent=2, sort_keys=True))
        return
    _print_projection(projection.as_json())


def _when(us: int | None) -> str:
    if us is None:
        return "-"
    from datetime import UTC, datetime

    return datetime.fromtimestamp(us / 1_000_000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _print_projection(data: dict[str, Any]) -> None:
    console = Console()
    columns = ("module", "subjects", "entries", "checkpoints", "live leases", "expired leases")
    modules = Table(*columns, title="Ledger by module")
    for m in data["modules"]:
        modules.add_row(
            m["module"],
            *(
                "-" if m[k] is None else str(m[k])
                for k in ("subjects", "entries", "checkpoints", "leases_live", "leases_expired")
            ),
        )
    console.print(modules)
    recovery = Table("recovery status", "runs", title="Dataflow runs by recovery status")
    for status, count in data["runs_by_recovery_status"].items():
        recovery.add_row(status, str(count))
    console.print(recovery)
    total = data["unresolved_total"]
    style = "bold red" if total else "green"
    console.print(f"[{style}]Unresolved runs: {total}[/{style}]")
    if total:
        headers = ("run", "tenant", "definition", "recovery status", "key", "output digest", "age s")
        unresolved = Table(*headers, title="Unresolved")
        for u in data["unresolved"]:
            key = u["publication_idempotency_key"] or u["idempotency_key"]
            unresolved.add_row(
                u["run_id"], u["tenant"], u["definition_name"], u["recovery_status"],
                key, u["output_digest"] or "-", f"{u['age_s']:.0f}",
            )  # fmt: skip
        console.print(unresolved)
        oldest = data["oldest_unresolved"]
        console.print(
            f"[bold red]Oldest unresolved: {oldest['run_id']} ({oldest['age_s']:.0f} s). External output may exist: "
            f"reconcile it (`dataflow reconcile {oldest['run_id']}`); never infer absence.[/bold red]"
        )


def register(app: typer.Typer) -> None:
    """Add `serve`, `tokens` and `ops` to the main CLI."""
    app.command("serve")(serve)
    app.add_typer(tokens_app, name="tokens")
    app.add_typer(ops_app, name="ops")
