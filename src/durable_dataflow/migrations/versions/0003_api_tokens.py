"""API tokens (stored as SHA-256 hashes only).

Revision ID: 0003_api_tokens
Revises: 0002_dataflow
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_api_tokens"
down_revision = "0002_dataflow"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("token_id", sa.String(32), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("role", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("token_hash", sa.String(71), nullable=False),
        sa.Column("created_at_us", sa.BigInteger, nullable=False),
        sa.Column("revoked_at_us", sa.BigInteger, nullable=True),
        sa.UniqueConstraint("token_hash", name="uq_api_tokens_hash"),
    )
    op.create_index("ix_api_tokens_tenant", "api_tokens", ["tenant"])


def downgrade() -> None:
    op.drop_index("ix_api_tokens_tenant", table_name="api_tokens")
    op.drop_table("api_tokens")
