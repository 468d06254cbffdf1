"""Fixtures for integration tests: a migrated platform database on each engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from durable_dataflow import migrations
from durable_dataflow.core import crashpoints
from durable_dataflow.core.db import Database
from durable_dataflow.datasources import registry
from durable_dataflow.platform import Platform
from support import flows


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


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    """A platform with the tests' one-minute lease (``flows.LEASE_TTL_S``); afterwards no crash hook and
    no "faulty" provider stay installed. (Test modules that need another platform define their own
    ``platform``.)"""
    with Platform(db_url, lease_ttl_s=flows.LEASE_TTL_S) as opened:
        yield opened
    crashpoints.set_hook(None)
    registry.unregister_provider("faulty")
