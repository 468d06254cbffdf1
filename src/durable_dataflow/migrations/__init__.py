"""Schema migrations (Alembic) for every part's tables, applied on open and by ``dataflow db upgrade``.

Each part defines its tables once, as SQLAlchemy Core metadata in its own ``schema`` module; the
migrations here create exactly those tables, and a test checks that a database built by the
migrations equals one built from the metadata, on both engines.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.invariants import InvariantViolation

if TYPE_CHECKING:
    from alembic.config import Config

# The schema modules in dependency order; a module that is not present yet is skipped.
SCHEMA_MODULES = (
    "durable_dataflow.core.schema",
    "durable_dataflow.datasources.schema",
    "durable_dataflow.dataflow.schema",
    "durable_dataflow.dataflow.schedules.schedule_schema",
    "durable_dataflow.api.schema",
)
# A constant key for PostgreSQL's advisory lock, so concurrent processes upgrade one at a time.
UPGRADE_LOCK_KEY = 0x0D_F10A_5EED
# The newest migration's revision (tests/migration checks it is Alembic's head). Opening an
# up-to-date database compares against it with one read and never imports Alembic, which with the
# dialect modules it loads costs ~20 MiB and ~0.3 s in every process (CLI, worker, server).
HEAD_REVISION = "0017_tenant_result_bytes"


def all_metadata() -> list[sa.MetaData]:
    """The metadata objects of every part that defines tables."""
    found = []
    for name in SCHEMA_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is None or not (name == error.name or name.startswith(error.name + ".")):
                raise  # a real import error inside an existing schema module
            continue
        found.append(module.metadata)
    return found


def _config() -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent))
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_config()).get_current_head()
    if head is None:  # not an assert, which vanishes under ``python -O``
        raise InvariantViolation("alembic found no head revision, but the package ships its migrations")
    return head


def current_revision(db: Database) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with db.read() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _is_at_head(db: Database) -> bool:
    """One read: the recorded revision is HEAD_REVISION (False when the table does not exist yet)."""
    with db.read() as conn:
        if not sa.inspect(conn).has_table("alembic_version"):
            return False
        return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == HEAD_REVISION


def upgrade(db: Database, revision: str = "head") -> None:
    """Bring the database to ``revision``; safe when several processes do it at once."""
    if revision == "head" and _is_at_head(db):
        return
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    config = _config()
    with db.begin() as conn:
        if db.dialect == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK_KEY})
        if revision == "head" and MigrationContext.configure(conn).get_current_revision() == head_revision():
            return
        current = MigrationContext.configure(conn).get_current_revision()
        if current is not None and not is_known(current):
            raise InputError(newer_schema(current))
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def is_known(revision: str) -> bool:
    """Whether ``revision`` is one of this version's migrations (else a newer version wrote it)."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        return ScriptDirectory.from_config(_config()).get_revision(revision) is not None
    except CommandError:
        return False


def newer_schema(revision: str) -> str:
    """The refusal of a database migrated by a newer version of the platform."""
    return (
        f"the database's schema is at revision {revision!r}, which this version does not know: a newer "
        "version migrated it; run that version (a schema is never migrated down)"
    )
