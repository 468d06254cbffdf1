"""Schema migrations (Alembic) for every part's tables, applied on open and by ``dataflow db upgrade``.

Each part defines its tables once, as SQLAlchemy Core metadata in its own ``schema`` module; the
migrations here create exactly those tables, and a test checks that a database built by the
migrations equals one built from the metadata, on both engines.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from durable_dataflow.core.db import Database

# The schema modules in dependency order; a module that is not present yet is skipped.
SCHEMA_MODULES = (
    "durable_dataflow.core.schema",
    "durable_dataflow.datasources.schema",
    "durable_dataflow.dataflow.schema",
    "durable_dataflow.api.schema",
)
# A constant key for PostgreSQL's advisory lock, so concurrent processes upgrade one at a time.
UPGRADE_LOCK_KEY = 0x0D_F10A_5EED


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
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None  # the package ships its migrations
    return head


def current_revision(db: Database) -> str | None:
    with db.read() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(db: Database, revision: str = "head") -> None:
    """Bring the database to ``revision``; safe when several processes do it at once."""
    config = _config()
    with db.begin() as conn:
        if db.dialect == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK_KEY})
        if revision == "head" and MigrationContext.configure(conn).get_current_revision() == head_revision():
            return
        config.attributes["connection"] = conn
        command.upgrade(config, revision)
