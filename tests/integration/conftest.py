"""Fixtures for integration tests: a migrated platform database on each engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from durable_dataflow import migrations
from durable_dataflow.core.db import Database


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    """A migrated Database on the engine of this parametrization, disposed afterwards."""
    database = Database(db_url)
    migrations.upgrade(database)
    yield database
    database.dispose()


@pytest.fixture
def pg_db(pg_url: str) -> Iterator[Database]:
    """A migrated Database on PostgreSQL only, for tests that need real concurrent processes."""
    database = Database(pg_url)
    migrations.upgrade(database)
    yield database
    database.dispose()
