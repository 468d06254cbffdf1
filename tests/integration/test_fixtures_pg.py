"""The database fixtures themselves: both engines answer, databases are isolated, restarts recover."""

from __future__ import annotations

import sqlalchemy as sa

from support.pg import PostgresServer

# The table the isolation tests create; each test gets its own database, so both can create it.
PROBE_TABLE = "fixture_isolation_probe"


def test_db_url_yields_a_working_engine(db_url: str) -> None:
    """db_url gives a usable database on each engine: SQLAlchemy runs `select 1` through it."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("select 1")).scalar_one() == 1
            expected = "sqlite" if db_url.startswith("sqlite") else "postgresql"
            assert conn.dialect.name == expected
    finally:
        engine.dispose()


def _create_probe_table_in_fresh_database(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            assert not sa.inspect(conn).has_table(PROBE_TABLE), "pg_url gave a database another test used"
            conn.execute(sa.text(f"create table {PROBE_TABLE} (id integer primary key)"))
            assert sa.inspect(conn).has_table(PROBE_TABLE)
    finally:
        engine.dispose()


def test_pg_url_database_is_isolated_first(pg_url: str) -> None:
    """pg_url is a fresh database: the probe table is absent before this test creates it."""
    _create_probe_table_in_fresh_database(pg_url)


def test_pg_url_database_is_isolated_second(pg_url: str) -> None:
    """pg_url is a fresh database: the probe table the other test created is absent here too."""
    _create_probe_table_in_fresh_database(pg_url)


def test_pg_url_names_differ_per_test(postgres_server: PostgresServer, pg_url: str) -> None:
    """Each pg_url is its own database on the session's server, distinct from the admin database."""
    assert pg_url.startswith(f"postgresql+psycopg://postgres@127.0.0.1:{postgres_server.port}/")
    assert pg_url != postgres_server.admin_url


def test_restart_immediate_accepts_connections_again(postgres_server: PostgresServer, pg_url: str) -> None:
    """After an immediate (crash-like) restart the server accepts connections and kept committed rows."""
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("create table survivor (id integer primary key)"))
            conn.execute(sa.text("insert into survivor values (7)"))
        old_pid = _backend_pid(engine)
        postgres_server.restart()
        engine.dispose()  # Pooled connections died with the old server processes.
        with engine.connect() as conn:
            assert conn.execute(sa.text("select id from survivor")).scalar_one() == 7
        assert _backend_pid(engine) != old_pid
    finally:
        engine.dispose()


def _backend_pid(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        pid: int = conn.execute(sa.text("select pg_backend_pid()")).scalar_one()
        return pid


def test_stop_then_start_serves_the_same_databases(postgres_server: PostgresServer, pg_url: str) -> None:
    """stop() refuses connections until start() brings the same cluster back with its databases."""
    engine = sa.create_engine(pg_url)
    try:
        postgres_server.stop()
        engine.dispose()
        refused = False
        try:
            with engine.connect():
                pass
        except sa.exc.OperationalError:
            refused = True
        assert refused, "a stopped server still accepted a connection"
        postgres_server.start()
        with engine.connect() as conn:
            assert conn.execute(sa.text("select current_database()")).scalar_one() == pg_url.rsplit("/", 1)[1]
    finally:
        engine.dispose()
