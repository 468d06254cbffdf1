"""Datasource registrations: a tenant per datasource (names are per tenant) and the run whose first
publication registered it (``datasources.register_target``, recorded before dispatch can be
authorized), so an inspection that finds a sink location missing can tell a datasource the platform
created from one it never registered.

Every existing row was declared by the platform (only ``register_datasource`` wrote the table), so it
gets the tenant ``'*'`` (``schema.PLATFORM_DECLARED``: every tenant may name it, as before) and no
``created_by_run``. The primary key moves from ``name`` to ``(tenant, name)``; the table is rebuilt
(copy, drop, rename) because SQLite cannot change a primary key in place.

Downgrade keeps the platform's declarations and drops the registrations (0005 had none, and its
key cannot hold one name for two tenants).

Revision ID: 0006_datasource_registrations
Revises: 0005_run_workspace
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_datasource_registrations"
down_revision = "0005_run_workspace"
branch_labels = None
depends_on = None

COMMON = "name, provider, location, options_json, registered_at"


def _common_columns() -> list[sa.Column[object]]:
    return [
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("provider", sa.String(100), nullable=False),
        sa.Column("location", sa.String(2000), nullable=False),
        sa.Column("options_json", sa.Text, nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "datasources_0006",
        sa.Column("tenant", sa.String(128), nullable=False),
        *_common_columns(),
        sa.Column("created_by_run", sa.String(36), nullable=True),
        sa.PrimaryKeyConstraint("tenant", "name", name="pk_datasources"),
    )
    op.execute(
        f"INSERT INTO datasources_0006 (tenant, {COMMON}, created_by_run) "
        f"SELECT '*', {COMMON}, NULL FROM datasources"
    )
    op.drop_table("datasources")
    op.rename_table("datasources_0006", "datasources")


def downgrade() -> None:
    op.create_table(
        "datasources_0005",
        *_common_columns(),
        sa.PrimaryKeyConstraint("name", name="datasources_pkey"),
    )
    op.execute(f"INSERT INTO datasources_0005 ({COMMON}) SELECT {COMMON} FROM datasources WHERE tenant = '*'")
    op.drop_table("datasources")
    op.rename_table("datasources_0005", "datasources")
