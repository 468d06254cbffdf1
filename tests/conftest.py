"""Shared fixtures: a throwaway PostgreSQL cluster per session and a database URL per test.

`db_url` runs a test on both engines (ids `sqlite` and `postgres`); `pg_url` and `sqlite_url` pin
one. Tests that use PostgreSQL are marked `postgres` automatically. When PostgreSQL cannot start,
its tests skip locally but FAIL when $CI is set or DATAFLOW_REQUIRE_POSTGRES=1, so CI never passes
without them. The machinery lives in tests/support/pg.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

import hypothesis_profiles  # noqa: F401  (registers the ci and long profiles before any test module loads)
from support.pg import PostgresServer, PostgresUnavailable, find_bindir, reap_orphans, save_log
from support.s3 import ACCESS_KEY, SECRET_KEY, MotoServer, S3Place

POSTGRES_FIXTURES = frozenset({"postgres_server", "pg_url"})
S3_FIXTURES = frozenset({"moto_server", "s3"})
SAVED_LOG = pytest.StashKey[Path]()


def _postgres_required() -> bool:
    return bool(os.environ.get("CI")) or os.environ.get("DATAFLOW_REQUIRE_POSTGRES") == "1"


# Markers whose tests .ci/run requires to have run and passed (counted from the JUnit XML).
COUNTED_MARKERS = ("postgres", "spark", "browser", "s3")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if POSTGRES_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)
        if S3_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.s3)
        for marker in COUNTED_MARKERS:
            if item.get_closest_marker(marker) is not None:
                item.user_properties.append((marker, "1"))


def _spark_missing() -> str | None:
    """Why the Spark tests cannot run here (pyspark or Java absent), or None."""
    if importlib.util.find_spec("pyspark") is None:
        return "pyspark is not installed (the spark extra)"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no Java runtime (java on PATH or $JAVA_HOME)"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Spark tests skip locally without pyspark or Java, and FAIL when they are required ($CI or
    # DATAFLOW_REQUIRE_POSTGRES=1, which .ci/run sets), like the PostgreSQL tests.
    if item.get_closest_marker("spark") is None:
        return
    missing = _spark_missing()
    if missing is None:
        return
    if _postgres_required():
        pytest.fail(f"the Spark tests are required here, but {missing}")
    pytest.skip(missing)


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Turning SIGTERM into an exception lets the session fixture's finally block stop the cluster.
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def postgres_server(request: pytest.FixtureRequest) -> Iterator[PostgresServer]:
    """A running throwaway cluster for the whole session, stopped and deleted afterwards."""
    artifacts = Path(request.config.rootpath) / "test-artifacts"
    try:
        reap_orphans(find_bindir())
        server = PostgresServer.launch()
    except PostgresUnavailable as exc:
        exc.log_path = save_log(exc.log_path, artifacts)
        unavailable = exc
    else:
        unavailable = None
    if unavailable is not None:
        message = f"PostgreSQL unavailable: {unavailable.describe()}"
        if _postgres_required():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        yield server
    finally:
        if previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if request.session.testsfailed:
            saved_log = save_log(server.log_path, artifacts)
            if saved_log is not None:
                request.config.stash[SAVED_LOG] = saved_log
        server.destroy()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if (saved_log := config.stash.get(SAVED_LOG, None)) is not None:
        terminalreporter.write_line(f"PostgreSQL server log of this session: {saved_log}")


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh, uniquely named PostgreSQL database for this test (dropped WITH (FORCE) after)."""
    name = f"dataflow_test_{uuid.uuid4().hex[:16]}"
    url = postgres_server.create_database(name)
    try:
        yield url
    finally:
        postgres_server.drop_database(name)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite database file in this test's temporary directory."""
    return f"sqlite:///{tmp_path}/dataflow.db"


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def db_url(request: pytest.FixtureRequest) -> str:
    """The platform database URL, once per engine: the same test proves both."""
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    url: str = request.getfixturevalue(fixture)
    return url


# ---- S3: a real S3 API server (moto_server) on loopback, one per test session ----------------------


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """`moto_server` for the whole session. Without moto[server] the S3 tests skip locally and FAIL
    where they are required ($CI, DATAFLOW_REQUIRE_POSTGRES=1), like the PostgreSQL tests."""
    missing = importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None
    if missing:
        message = "moto[server] and boto3 are not installed (the dev extra)"
        if _postgres_required():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> S3Place:
    """A bucket of this test's own; the credential secrets set in the environment (the local scope)."""
    monkeypatch.setenv("S3_TEST_ACCESS_KEY", ACCESS_KEY)
    monkeypatch.setenv("S3_TEST_SECRET_KEY", SECRET_KEY)
    return S3Place(moto_server, moto_server.new_bucket(), moto_server.endpoint)
