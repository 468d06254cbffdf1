"""Partition tokens (issue 27): one monotonic counter per tenant, datasource and partition value.

A run whose target has `mode: replace_partition` takes the next token inside its pre-dispatch fenced
commit (`forward.authorize_dispatch`) and records it in `dispatch.authorized` (`partition_token`); a
resume re-dispatches with that recorded token. The sink keeps the highest token it applied per
partition and refuses a lower one (`contract.SUPERSEDED`), so of two overlapping runs of a partition
the one authorized later wins, and an old run resumed later never replaces a newer publication.
This module owns the `partition_tokens` table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core import hashing
from durable_dataflow.core.db import insert_if_absent
from durable_dataflow.dataflow.schema import partition_tokens

# The dispatch.authorized field holding the token.
PARTITION_TOKEN = "partition_token"


def partition_digest(partition: Mapping[str, Any]) -> str:
    """The digest that names a partition (its column -> canonical value map) in the table."""
    return hashing.digest(dict(partition))


def take(conn: Connection, tenant: str, datasource: str, partition: Mapping[str, Any]) -> int:
    """The next token of the partition (1 for the first), in the caller's transaction: the row is
    created at 0 when missing, then raised by one (PostgreSQL's row lock, SQLite's write lock, order
    concurrent takers; the commit that records the token is the one that raised it)."""
    where = {"tenant": tenant, "datasource": datasource, "partition_digest": partition_digest(partition)}
    conn.execute(
        insert_if_absent(conn.dialect.name, partition_tokens, list(where)).values(**where, token=0)
    )
    match = sa.and_(*(partition_tokens.c[name] == value for name, value in where.items()))
    conn.execute(sa.update(partition_tokens).where(match).values(token=partition_tokens.c.token + 1))
    token = conn.execute(sa.select(partition_tokens.c.token).where(match)).scalar_one()
    return int(token)
