"""Fixtures of the fault tests: a PostgreSQL sink database beside the platform database."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from support.pg import PostgresServer


@pytest.fixture
def sink_dsn(postgres_server: PostgresServer) -> Iterator[str]:
    """A second, fresh database of the throwaway server for the PostgreSQL-table provider."""
    name = f"dataflow_sink_{uuid.uuid4().hex[:16]}"
    url = postgres_server.create_database(name)
    try:
        yield url.replace("postgresql+psycopg://", "postgresql://")
    finally:
        postgres_server.drop_database(name)
