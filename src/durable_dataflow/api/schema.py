"""The API part's table: API tokens, stored only as SHA-256 hashes of the token text.

The token itself is shown once, when it is created, and never stored or shown again.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

TOKEN_ID_LENGTH = 32
TENANT_LENGTH = 128
ROLE_LENGTH = 32
TOKEN_NAME_LENGTH = 200
HASH_LENGTH = 71  # "sha256:" + 64 hex digits

api_tokens = sa.Table(
    "api_tokens",
    metadata,
    sa.Column("token_id", sa.String(TOKEN_ID_LENGTH), primary_key=True),
    sa.Column("tenant", sa.String(TENANT_LENGTH), nullable=False),
    sa.Column("role", sa.String(ROLE_LENGTH), nullable=False),
    sa.Column("name", sa.String(TOKEN_NAME_LENGTH), nullable=False),
    sa.Column("token_hash", sa.String(HASH_LENGTH), nullable=False),
    sa.Column("created_at_us", sa.BigInteger, nullable=False),
    sa.Column("revoked_at_us", sa.BigInteger, nullable=True),
    sa.UniqueConstraint("token_hash", name="uq_api_tokens_hash"),
    sa.Index("ix_api_tokens_tenant", "tenant"),
)
