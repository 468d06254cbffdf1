"""``dataflow datasources declare|list|forget``: the platform operator's named datasources.

A declaration names a sink (provider and location) for every tenant, or for one, with options such
as ``allow_overwrite: true`` — the only way a target below the operator role may overwrite (the
submit check compares a target with exactly this record). Runs register their own datasources with
their first publication (docs/providers.md); those show here too. Whoever holds the database URL is
the platform operator, so the command needs no token. ``forget`` is the operator's declaration that
a datasource's created locations are really gone (docs/providers.md, "Locate"): until then a run
never creates a registered location again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from durable_dataflow.cli import common
from durable_dataflow.core.names import check_tenant
from durable_dataflow.core.text import printable

if TYPE_CHECKING:
    from durable_dataflow.datasources.registry import Datasource

datasources_app = typer.Typer(
    help="Named datasources: declared by the platform, or registered by runs.", no_args_is_help=True
)


@datasources_app.command("declare")
def declare_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The datasource name a target's `datasource` field gives.")],
    provider: Annotated[str, typer.Option("--provider", help="The provider (parquet, delta, postgres, …).")],
    location: Annotated[str, typer.Option("--location", help="The location exactly as targets write it.")],
    allow_overwrite: Annotated[
        bool,
        typer.Option("--allow-overwrite", help="Let a target that is exactly it overwrite."),
    ] = False,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="Declare it for one tenant only (default: every tenant).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the declaration as JSON.")] = False,
) -> None:
    """Declare a named datasource; the same name again (for that tenant) is a conflict (exit 5)."""
    from durable_dataflow.datasources import registry
    from durable_dataflow.datasources.schema import PLATFORM_DECLARED

    options = {"allow_overwrite": True} if allow_overwrite else {}
    whose = PLATFORM_DECLARED if tenant is None else check_tenant(tenant)  # "" or "*" is no tenant
    with common.open_platform(ctx) as platform, platform.db.begin() as conn:
        declared = registry.register_datasource(conn, name, provider, location, options, tenant=whose)
    if as_json:
        common.emit_json(_json(declared))
        return
    whom = "every tenant" if declared.tenant == PLATFORM_DECLARED else f"tenant {declared.tenant}"
    common.stdout_console().print(Text(printable(f"declared {declared.name} ({declared.provider}) for {whom}")))


@datasources_app.command("list")
def list_command(
    ctx: typer.Context,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="What this tenant sees (its registrations and the declarations).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the datasources as a JSON list.")] = False,
) -> None:
    """The declared and registered datasources (every tenant's, or what --tenant sees)."""
    from durable_dataflow.datasources import registry

    with common.open_platform(ctx) as platform, platform.db.read() as conn:
        found = registry.list_datasources(conn, tenant)
    if as_json:
        common.emit_json([_json(d) for d in found])
        return
    table = Table()
    for column in ("name", "tenant", "provider", "location", "overwrite", "registered by"):
        table.add_column(column, no_wrap=True)
    for d in found:
        table.add_row(
            *(Text(printable(str(v))) for v in (d.name, d.tenant, d.provider, d.location)),
            Text("yes" if d.options.get("allow_overwrite") is True else ""),
            Text(d.created_by_run or "platform"),
        )
    common.stdout_console().print(table)


@datasources_app.command("forget")
def forget_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The datasource name, as the tenant's targets give it.")],
    tenant: Annotated[
        str, typer.Option("--tenant", help="The tenant whose datasource it is (local runs: default).")
    ] = "default",
    yes: Annotated[
        bool, typer.Option("--yes", help="Confirm: the locations are really gone (a reconcile may then publish again).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was forgotten as JSON.")] = False,
) -> None:
    """Declare that a datasource's created locations are really gone: the next run creates its
    location afresh. Recorded in the ledger with who asked. Without --yes nothing is changed (exit 2)."""
    from durable_dataflow.core import ledger
    from durable_dataflow.core.errors import InputError
    from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, asked_by
    from durable_dataflow.datasources import registry

    whose = check_tenant(tenant)
    registry.check_name_text(name)
    if not yes:
        raise InputError(
            "forgetting a datasource's locations lets the next run create them afresh, and a reconcile may then find "
            "an earlier run's key absent there and publish it again: pass --yes once the old locations are really gone"
        )
    access = AccessContext.local(whose)
    who = asked_by(access, Provenance(actor=access.principal, trigger="cli"))
    with common.open_platform(ctx) as platform, platform.db.begin() as conn:
        key = platform.runs.config.evidence_key
        subject = (registry.LEDGER_MODULE, registry.ledger_subject(whose, name))
        problem = ledger.check_key_setting(conn, key, subject=subject)
        if problem:
            raise InputError(problem)
        forgotten = registry.forget_locations(conn, platform.db, whose, name, who, evidence_key=key)
    if as_json:
        common.emit_json({"name": name, "tenant": whose, "places_forgotten": forgotten})
        return
    common.stdout_console().print(
        Text(printable(f"forgot {forgotten} location(s) of {name} for tenant {whose}: the next run creates it afresh"))
    )


def _json(d: Datasource) -> dict[str, object]:
    return {
        "name": d.name, "tenant": d.tenant, "provider": d.provider, "location": d.location,
        "options": dict(d.options), "registered_at": d.registered_at.isoformat(), "created_by_run": d.created_by_run,
    }  # fmt: skip


def register(app: typer.Typer) -> None:
    app.add_typer(datasources_app, name="datasources")
