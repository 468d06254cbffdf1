"""The result_bytes quota reads a counter per tenant instead of summing the tenant's results.

``tenant_result_bytes`` holds, per tenant, the bytes of every result its runs stored; ``results.store``
adds each result's size in the transaction that stores it. The quota's check summed
``length(run_results.bytes)`` over all of a tenant's runs on every submit: its cost grew with the
tenant's history (each stored result one index lookup per submit). This revision creates the table
and fills it from the results already stored, in the same migration transaction.

Revision ID: 0017_tenant_result_bytes
Revises: 0016_runs_by_tenant_definition
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_tenant_result_bytes"
down_revision = "0016_runs_by_tenant_definition"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant_result_bytes",
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("stored_bytes", sa.BigInteger, nullable=False),
    )
    op.execute(
        "INSERT INTO tenant_result_bytes (tenant, stored_bytes) "
        "SELECT r.tenant, SUM(LENGTH(rr.bytes)) FROM run_results rr "
        "JOIN dataflow_runs r ON r.run_id = rr.run_id GROUP BY r.tenant"
    )


def downgrade() -> None:
    op.drop_table("tenant_result_bytes")
