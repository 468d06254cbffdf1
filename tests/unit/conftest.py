"""The unit tier stays pure and fast: no database server, no process, no JVM (issue 28, item 6).

A test here runs in this interpreter on SQLite files and in-process libraries only. So, inside
tests/unit:

- the PostgreSQL cluster fixture (``postgres_server``, which ``pg_url`` and the ``postgres``
  parametrization of ``db_url`` start) fails the test instead of starting a server;
- starting a process fails the test: ``subprocess`` (``run``, ``Popen``, ``check_output``, and
  through it Spark's JVM gateway), ``os.system``, ``os.fork`` and ``os.posix_spawn``;
- a test marked ``postgres`` or ``spark`` fails before it runs.

Such a test belongs in tests/integration (tests/acceptance for the CLI or the server in a
subprocess, tests/faults for signals). ``typer.testing.CliRunner`` runs the CLI in-process and is fine.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest

# What a unit test may not do, and where the test belongs instead.
MOVE_HINT = "tests/unit is pure (no database server, no process, no JVM): move this test to tests/integration"
# Markers of tests that need what the unit tier never starts.
IMPURE_MARKERS = ("postgres", "spark")


def _refuse(what: str) -> Any:
    def refused(*args: object, **kwargs: object) -> NoReturn:
        pytest.fail(f"{what} inside tests/unit: {MOVE_HINT}", pytrace=False)

    return refused


@pytest.fixture(scope="session")
def postgres_server() -> NoReturn:
    """Overrides the session's PostgreSQL cluster (tests/conftest.py) for this tier: using it fails."""
    pytest.fail(f"PostgreSQL (postgres_server, pg_url or db_url[postgres]) inside tests/unit: {MOVE_HINT}")


@pytest.fixture(scope="module", autouse=True)
def no_process_started() -> Iterator[None]:
    """Every way to start a process fails, for each module of the tier (module scope, so it is in place
    before the module's own module-scoped fixtures start, and gone before another tier's module runs)."""
    with pytest.MonkeyPatch.context() as patch:
        # _execute_child is what every Popen, run, call and check_output goes through, however imported.
        patch.setattr(subprocess.Popen, "_execute_child", _refuse("a subprocess"))
        for name in ("system", "fork", "forkpty", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                patch.setattr(os, name, _refuse(f"os.{name}"))
        yield


@pytest.fixture(autouse=True)
def no_impure_marker(request: pytest.FixtureRequest) -> None:
    """A test marked postgres or spark fails before it runs: it needs what this tier never starts."""
    for marker in IMPURE_MARKERS:
        if request.node.get_closest_marker(marker) is not None:
            pytest.fail(f"a test marked {marker!r} inside tests/unit: {MOVE_HINT}", pytrace=False)
