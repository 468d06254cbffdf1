"""Read-only catalog statements for the CLI: stored definitions and run-id lookup.

The CLI and the API never build queries (STYLE.md); what they need to list or look up that the
run service does not already offer lives here, as named SQLAlchemy Core statements.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core.errors import InputError, NotFound
from durable_dataflow.dataflow.schema import dataflow_runs, definitions

DEFINITIONS_LIST_MAX = 1000
# A run id may be given by a unique tail of at least this many characters (the random part of a
# UUIDv7: its head is a timestamp and is shared by runs created in the same minute).
RUN_ID_TAIL_CHARS_MIN = 8
RUN_ID_CHARS = 36
RUN_ID_MATCHES_SHOWN_MAX = 5
_RUN_ID_TEXT = re.compile(r"^[0-9a-f-]+$")
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


def resolve_run_id(conn: Connection, text: str) -> str:
    """The full run id for a full id or a unique tail of it (as the run history shows it)."""
    candidate = text.strip().lower()
    if len(candidate) == RUN_ID_CHARS:
        return candidate
    if len(candidate) < RUN_ID_TAIL_CHARS_MIN or not _RUN_ID_TEXT.match(candidate):
        raise InputError(
            f"run id {text!r} is neither a full run id nor a tail of at least {RUN_ID_TAIL_CHARS_MIN} "
            "hexadecimal characters"
        )
    # The pattern is hex and dashes only (checked above), so it carries no LIKE wildcard.
    query = (
        sa.select(dataflow_runs.c.run_id)
        .where(dataflow_runs.c.run_id.like(f"%{candidate}"))
        .order_by(dataflow_runs.c.run_id)
        .limit(RUN_ID_MATCHES_SHOWN_MAX)
    )
    matches = list(conn.execute(query).scalars())
    if not matches:
        raise NotFound(f"run {text} does not exist")
    if len(matches) > 1:
        raise InputError(f"run id tail {text!r} is ambiguous: it matches {', '.join(matches)}; give more characters")
    return str(matches[0])
