"""The definitions catalogue: every statement on the ``definitions`` table (this module owns it).

Definitions are stored once per content hash by the run service (:func:`store_definition`) and
read here for the run service (:func:`definition_body`), the CLI (every stored definition) and
Ops (a tenant's pinned definitions: only those its own runs used). The CLI and the API never
build queries (STYLE.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core import hashing
from durable_dataflow.core.db import Database, insert_if_absent
from durable_dataflow.core.errors import NotFound
from durable_dataflow.dataflow.schema import definitions

if TYPE_CHECKING:  # the CLI's listings read stored bodies only: they need not load the parser (pyarrow)
    from durable_dataflow.dataflow.definitions.definitions import Definition

DEFINITIONS_LIST_MAX = 1000
_HASH_PREFIX = "sha256:"


@dataclass(frozen=True)
class StoredDefinition:
    """One pinned definition as registered: content-addressed and immutable."""

    definition_hash: str
    name: str
    version: int
    registered_at_us: int
    body: dict[str, Any]

    def public(self) -> dict[str, Any]:
        """The documented JSON form (docs/cli.md)."""
        return {
            "definition_hash": self.definition_hash,
            "name": self.name,
            "version": self.version,
            "registered_at_us": self.registered_at_us,
            "body": self.body,
        }


def _from_row(row: sa.Row[Any]) -> StoredDefinition:
    return StoredDefinition(
        definition_hash=row.definition_hash,
        name=row.name,
        version=int(row.version),
        registered_at_us=int(row.registered_at_us),
        body=json.loads(row.body_json),
    )


def list_definitions(conn: Connection, *, limit: int = DEFINITIONS_LIST_MAX) -> list[StoredDefinition]:
    """Every stored definition, by name, newest version (then newest registration) first."""
    query = (
        sa.select(definitions)
        .order_by(definitions.c.name, definitions.c.version.desc(), definitions.c.registered_at_us.desc())
        .limit(max(1, min(limit, DEFINITIONS_LIST_MAX)))
    )
    return [_from_row(row) for row in conn.execute(query).all()]


def get_definition(conn: Connection, name_or_hash: str) -> StoredDefinition:
    """A definition by its exact hash (``sha256:…``), else the newest version registered under a name."""
    if name_or_hash.startswith(_HASH_PREFIX):
        query = sa.select(definitions).where(definitions.c.definition_hash == name_or_hash)
    else:
        query = (
            sa.select(definitions)
            .where(definitions.c.name == name_or_hash)
            .order_by(definitions.c.version.desc(), definitions.c.registered_at_us.desc())
            .limit(1)
        )
    row = conn.execute(query).first()
    if row is None:
        raise NotFound(f"no stored definition named or hashed {name_or_hash!r}")
    return _from_row(row)


def store_definition(conn: Connection, db: Database, defn: Definition, d_hash: str) -> None:
    """Store the definition once: rows are content-addressed, so a concurrent submit of the same
    definition inserting first is success, not a conflict (``INSERT … ON CONFLICT DO NOTHING``)."""
    from durable_dataflow.dataflow.definitions.definitions import canonical_body  # loaded already by the submitter

    conn.execute(
        insert_if_absent(db.dialect, definitions, ["definition_hash"]).values(
            definition_hash=d_hash,
            name=defn.name,
            version=defn.version,
            body_json=hashing.canonical_json(canonical_body(defn)).decode("utf-8"),
            registered_at_us=db.now_us_expr(),
        )
    )


def definition_body(conn: Connection, d_hash: str) -> str | None:
    """The stored canonical body (JSON text) of a definition, else None."""
    body = conn.execute(
        sa.select(definitions.c.body_json).where(definitions.c.definition_hash == d_hash)
    ).scalar_one_or_none()
    return None if body is None else str(body)


# ---- a tenant's pinned definitions (Ops: read-only, tenant-scoped) -----------------------------


def _tenant_definitions(usage: sa.Subquery) -> sa.Select[Any]:
    """A tenant's definitions with its own first use as their registration time: the platform-wide
    time would tell a tenant that (and when) another tenant ran the same definition first. ``usage``
    is the tenant's runs per definition (``runs.usage_by_definition``, joined here by the read module
    ``dataflow.protocol.views``: this module does not read runs)."""
    return sa.select(
        definitions.c.definition_hash,
        definitions.c.name,
        definitions.c.version,
        usage.c.registered_at_us,
        usage.c.runs,
    ).join(usage, usage.c.definition_hash == definitions.c.definition_hash)


def tenant_definitions(conn: Connection, usage: sa.Subquery, *, limit: int) -> list[tuple[Any, ...]]:
    """Rows of ``(definition_hash, name, version, registered_at_us, runs)``: the definitions the
    tenant's runs (``usage``) pinned, by name, newest version first."""
    query = _tenant_definitions(usage).order_by(definitions.c.name, definitions.c.version.desc())
    return [tuple(row) for row in conn.execute(query.limit(limit))]


def tenant_definition_body(conn: Connection, usage: sa.Subquery, d_hash: str) -> str | None:
    """The canonical body of a pinned definition the tenant has used, else None: a tenant never
    sees another tenant's SQL. A hash holding a NUL names none (PostgreSQL cannot compare it)."""
    if "\x00" in d_hash:
        return None
    visible = _tenant_definitions(usage).where(definitions.c.definition_hash == d_hash)
    if conn.execute(visible).first() is None:
        return None
    return definition_body(conn, d_hash)
