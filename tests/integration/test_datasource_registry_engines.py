"""The named-datasource registry on both engines: register, get and list, and plain credentials refused.

Split from tests/unit/test_provider_contract.py (issue 28, item 6): these tests build the datasources
table on SQLite and on PostgreSQL (pg_url), and the unit tier starts no database server.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_dataflow.core.errors import Conflict, InputError, NotFound
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.schema import metadata


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    """The datasources table built from `schema.metadata`, on SQLite and on PostgreSQL (pg_url)."""
    sqlite_url = f"sqlite:///{tmp_path}/registry.db"
    url = sqlite_url if request.param == "sqlite" else request.getfixturevalue("pg_url")
    eng = sa.create_engine(url)
    metadata.create_all(eng)
    yield eng
    eng.dispose()


def test_register_get_and_list_datasources(engine: sa.Engine) -> None:
    """A registered datasource reads back with its options; a second registration of the name is a Conflict."""
    with engine.begin() as conn:
        registry.register_datasource(
            conn, "analytics.revenue", "postgres", "public.revenue", {"dsn": {"secret": "CRM_DSN"}, "batch": 10}
        )
        registry.register_datasource(conn, "lake.orders", "delta", "warehouse/orders", {})
    with engine.begin() as conn:
        found = registry.get_datasource(conn, "analytics.revenue")
        assert (found.provider, found.location) == ("postgres", "public.revenue")
        assert found.options == {"dsn": {"secret": "CRM_DSN"}, "batch": 10}
        assert found.registered_at.tzinfo is not None
        assert [d.name for d in registry.list_datasources(conn)] == ["analytics.revenue", "lake.orders"]
        with pytest.raises(Conflict):
            registry.register_datasource(conn, "lake.orders", "delta", "elsewhere", {})
        with pytest.raises(NotFound):
            registry.get_datasource(conn, "missing")


@pytest.mark.parametrize(
    "options",
    [
        {"dsn": "postgresql://u:p@h/db"},
        {"password": "hunter2"},
        {"auth": {"api_key": "abc"}},
        {"Token": "t"},
        {"secret": "plain"},
    ],
)
def test_plain_credentials_are_refused(engine: sa.Engine, options: dict[str, object]) -> None:
    """A plain value under a credential-like option name is InputError, and nothing is stored."""
    with engine.begin() as conn:
        with pytest.raises(InputError, match="credential"):
            registry.register_datasource(conn, "x", "postgres", "t", options)
        assert registry.list_datasources(conn) == []
