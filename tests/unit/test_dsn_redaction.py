"""Connection strings never print their credentials (issue 13, item 10: one DSN scrubber).

``core.db.redact_url`` is the one scrubber: the platform database URL in ``dataflow db`` output,
``Database.info`` and the ``--db`` hint the CLI prints, and the unsupported-scheme error. The
PostgreSQL sources (``dataflow.postgres_source``) and sinks (``datasources.postgres_table``) do
not scrub: ``datasources.pgerrors.describe_connect`` describes a failed connection in fixed words
and never echoes the DSN nor the driver's text. Both are checked with a password in each form a
DSN can carry it: the URL's userinfo, a ``key=value`` conninfo string, a query parameter.
"""

from __future__ import annotations

import psycopg
import pytest

from durable_dataflow.core.db import UNPARSEABLE_URL, normalize_url, redact_url
from durable_dataflow.core.errors import InputError
from durable_dataflow.datasources import pgerrors

SECRET = "s3cr3t-Pw"

DSNS = {
    "url": f"postgresql://alice:{SECRET}@db.example:5432/app",
    "driver-url": f"postgresql+psycopg://alice:{SECRET}@db.example:5432/app",
    "keyword-value": f"host=db.example port=5432 dbname=app user=alice password={SECRET}",
    "query-parameter": f"postgresql://alice@db.example:5432/app?password={SECRET}&sslmode=require",
    "query-sslpassword": f"postgresql://alice@db.example/app?sslpassword={SECRET}",
}


@pytest.mark.parametrize("form", sorted(DSNS))
def test_redact_url_never_shows_the_password(form: str) -> None:
    assert SECRET not in redact_url(DSNS[form])


def test_redact_url_keeps_what_locates_the_database() -> None:
    assert redact_url(DSNS["driver-url"]) == "postgresql+psycopg://alice:***@db.example:5432/app"
    assert redact_url(DSNS["query-parameter"]) == "postgresql://alice@db.example:5432/app?password=***&sslmode=require"
    assert redact_url("sqlite:///./.dataflow/dataflow.db") == "sqlite:///./.dataflow/dataflow.db"
    assert redact_url(DSNS["keyword-value"]) == UNPARSEABLE_URL  # not a URL: never echoed


@pytest.mark.parametrize("form", sorted(DSNS))
def test_the_unsupported_scheme_error_never_shows_the_password(form: str) -> None:
    url = DSNS[form].replace("postgresql", "mysql", 1)
    with pytest.raises(InputError) as raised:
        normalize_url(url)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize("form", sorted(DSNS))
@pytest.mark.parametrize(
    "driver_text",
    [
        'connection to server at "db.example" failed: FATAL:  password authentication failed for user "alice"',
        "invalid connection option",
        "something unexpected",
    ],
)
def test_a_failed_connection_is_described_without_the_dsn(form: str, driver_text: str) -> None:
    """The sources' and the sinks' connect errors: the driver text may quote the DSN; neither leaves."""
    error = psycopg.OperationalError(f"{driver_text} (dsn: {DSNS[form]})")
    described = pgerrors.describe_connect(error, DSNS[form])
    assert SECRET not in described and "alice" not in described and "db.example" not in described


def test_an_invalid_conninfo_is_named_without_echoing_it() -> None:
    dsn = f"host=db.example password='{SECRET}"  # unterminated quote
    assert pgerrors.describe_connect(psycopg.OperationalError(dsn), dsn) == pgerrors.INVALID_CONNINFO
