"""The unit tier's guard (tests/unit/conftest.py) refuses what would make the tier slow or impure.

Each test below does, inside tests/unit, what a unit test may not (start a process, ask for
PostgreSQL) and proves that it fails with the hint to move the test, by catching pytest's failure.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

Failed = pytest.fail.Exception


def test_starting_a_process_fails_however_it_is_started() -> None:
    """Proves subprocess.run, a directly imported Popen, os.system and os.fork all fail with the hint."""
    from subprocess import Popen

    attempts = [
        lambda: subprocess.run([sys.executable, "-c", "pass"], check=False),
        lambda: Popen([sys.executable, "-c", "pass"]),
        lambda: os.system("true"),
        os.fork,
    ]
    for attempt in attempts:
        with pytest.raises(Failed, match="move this test to tests/integration"):
            attempt()


def test_asking_for_postgresql_fails(request: pytest.FixtureRequest) -> None:
    """Proves pg_url (and so db_url's postgres parametrization) fails instead of starting a cluster."""
    with pytest.raises(Failed, match=r"PostgreSQL .* inside tests/unit"):
        request.getfixturevalue("pg_url")


def test_sqlite_in_a_temporary_file_is_allowed(sqlite_url: str) -> None:
    """Proves the guard leaves the tier its database: a SQLite file in the test's temporary directory."""
    import sqlalchemy as sa

    engine = sa.create_engine(sqlite_url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("select 1")).scalar_one() == 1
    engine.dispose()
