"""A postgres source runs its query read-only on real PostgreSQL, typed, fingerprinted by its result."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
import sqlalchemy as sa
from psycopg import sql

from durable_dataflow.core import ledger
from durable_dataflow.core.errors import DataflowError, ExecutionError, InputError, LimitExceeded
from durable_dataflow.core.secrets import SecretGrant, SecretScope
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import postgres_source
from durable_dataflow.dataflow.execution.arrowdigest import output_digest
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from durable_dataflow.dataflow.execution.postgres_source import (
    POSTGRES_FETCH_BATCH_ROWS,
    PostgresStream,
    check_query,
)
from durable_dataflow.dataflow.execution.sources import resolve_sources
from durable_dataflow.platform import Platform
from support import flows

SECRET = "CRM_DSN_PG_SOURCE_TEST"
CANARY = "canary-7d41-tenant-secret"


def _libpq_dsn(sqlalchemy_url: str) -> str:
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


def _definition(query: str) -> Definition:
    return Definition.model_validate({
        "name": "crm", "version": 1,
        "sources": {"customers": {"kind": "postgres", "dsn": {"secret": SECRET}, "query": query}},
        "steps": [{"name": "r", "sql": "select region, sum(credit) as credit, count(*) as n, min(since) as since "
                                        "from customers group by region order by region"}],
        "output": {"schema": {"region": "string", "credit": "decimal(18,2)", "n": "int64", "since": "date"},
                   "max_rows": 10, "max_bytes": "1MiB"},
    })


def test_postgres_source_is_typed_read_only_and_fingerprinted(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves typed rows arrive, the fingerprint is the result's digest, and a writing query is refused."""
    dsn = _libpq_dsn(pg_url)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table customers (id bigint primary key, region text, credit numeric(12,2), "
                     "since date, seen timestamptz)")
        conn.execute("insert into customers values (1, 'north', 10.50, '2026-01-02', now()), "
                     "(2, 'north', 1.25, '2025-05-06', null), (3, 'south', null, '2026-03-04', now())")
    monkeypatch.setenv(SECRET, dsn)
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits())
    d = _definition("select id, region, credit, since, seen from customers order by id")
    [source] = resolve_sources(d, ctx)
    assert isinstance(source.binding, PostgresStream)
    schema, batches = source.binding.batches()
    table = pa.Table.from_batches(list(batches), schema)
    assert table.schema.field("credit").type == pa.decimal128(12, 2)
    assert table.schema.field("seen").type == pa.timestamp("us", tz="UTC")
    assert source.fingerprint == output_digest(table)
    result = execute(d, {}, ctx)
    assert result.sources[0][2] == output_digest(table)
    assert result.table.to_pylist() == [
        {"region": "north", "credit": decimal.Decimal("11.75"), "n": 2, "since": dt.date(2025, 5, 6)},
        {"region": "south", "credit": None, "n": 1, "since": dt.date(2026, 3, 4)},
    ]
    writing = _definition("with gone as (delete from customers returning *) select * from gone")
    # A server-side cursor wraps the query: a data-modifying WITH is refused before it runs (preflight's
    # check_query refuses it earlier still; execute alone leans on the server).
    with pytest.raises(ExecutionError, match=r"the postgres query failed: .*\(SQLSTATE 0A000\)") as caught:
        execute(writing, {}, ctx)
    assert dsn not in caught.value.message
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select count(*) from customers").fetchone() == (3,)


def test_postgres_source_streams_in_batches_and_is_bounded_by_the_source_limit(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a query result larger than one fetch batch streams whole (its fingerprint equals the digest of
    all rows), a numeric without declared precision keeps the first batch's type, and the source byte
    limit stops the stream with limit_exceeded."""
    dsn = _libpq_dsn(pg_url)
    rows = 3 * POSTGRES_FETCH_BATCH_ROWS + 7
    monkeypatch.setenv(SECRET, dsn)
    query = f"select g as id, (g % 5)::text as region, g::numeric / 4 as q from generate_series(1, {rows}) g"
    d = Definition.model_validate({
        "name": "crm", "version": 1,
        "sources": {"customers": {"kind": "postgres", "dsn": {"secret": SECRET}, "query": query}},
        "steps": [{"name": "r", "sql": "select count(*) as n, sum(id) as s from customers"}],
        "output": {"schema": {"n": "int64", "s": "decimal(38,0)"}, "max_rows": 1, "max_bytes": "1MiB"},
    })
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits())
    result = execute(d, {}, ctx)
    assert result.table.to_pylist() == [{"n": rows, "s": decimal.Decimal(rows * (rows + 1) // 2)}]
    [again] = resolve_sources(d, ctx)
    assert isinstance(again.binding, PostgresStream)
    schema, batches = again.binding.batches()
    assert result.sources[0][2] == output_digest(pa.Table.from_batches(list(batches), schema))
    small = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits(source_bytes_max=100_000))
    with pytest.raises(LimitExceeded, match="streamed more than the source limit of 100000 bytes"):
        execute(d, {}, small)


# ---- a hostile tenant's query: read-only session, one statement, no driver text -------------------


def _one_step(query: str, sql_text: str = "select count(*)::bigint as n from s",
              columns: dict[str, str] | None = None) -> Definition:
    return flows.one_step({"s": {"kind": "postgres", "dsn": {"secret": SECRET}, "query": query}},
                          sql_text, columns or {"n": "int64"}, name="crm")


def _ctx(tmp_path: Path, **limits: Any) -> ExecutionContext:
    return ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits(**limits))


@pytest.fixture
def crm(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A database with a table t whose `secret` column holds CANARY, a writing function wr(), one large
    object, and a least-privilege login role that may read t (the role a source should use); the secret
    holds that role's DSN. Yields the admin and reader DSNs, the role and the database name."""
    admin = _libpq_dsn(pg_url)
    role = f"crm_reader_{uuid.uuid4().hex[:12]}"
    ident = sql.Identifier(role)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("create table t (id int, secret text)")
        conn.execute("insert into t values (1, %s), (2, %s)", [f"{CANARY}-1", f"{CANARY}-2"])
        conn.execute("create function wr() returns int language sql as 'insert into t values (99) returning id'")
        conn.execute("select lo_from_bytea(4242, 'a large object')")
        conn.execute(sql.SQL("create role {} login").format(ident))
        conn.execute(sql.SQL("grant select on t to {}").format(ident))
        conn.execute(sql.SQL("grant select on large object 4242 to {}").format(ident))
        dbname = conn.info.dbname
    reader = admin.replace("postgresql://postgres@", f"postgresql://{role}@", 1)
    monkeypatch.setenv(SECRET, reader)
    yield {"admin": admin, "reader": reader, "role": role, "dbname": dbname}
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("drop owned by {}").format(ident))
        conn.execute(sql.SQL("drop role {}").format(ident))


def _untouched(admin: str) -> None:
    """t still holds its two rows and the database its one large object."""
    with psycopg.connect(admin) as conn:
        assert conn.execute("select count(*) from t").fetchone() == (2,)
        assert conn.execute("select count(*) from pg_largeobject_metadata").fetchone() == (1,)


def _ms(setting: str) -> int:
    """A PostgreSQL duration setting ('29998ms', '10s', '1min', '0') in milliseconds."""
    units = {"ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000}
    number = setting.rstrip("minhs")
    return int(number) * units[setting[len(number):] or "ms"]


def test_the_session_is_read_only_and_time_limited_from_its_first_statement(
    crm: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the source's settings are connection options that win over the database's own defaults
    (ALTER DATABASE … SET read-write, no timeouts, backslash-escaping strings), that the DSN's other
    `options` are kept (a trailing backslash in them cannot swallow ours), and that with them a string
    sqlglot reads as one statement is one statement for the server too."""
    with psycopg.connect(crm["admin"], autocommit=True) as conn:
        db = sql.Identifier(crm["dbname"])
        for setting in ("default_transaction_read_only = off", "statement_timeout = 0", "lock_timeout = 0",
                        "idle_in_transaction_session_timeout = 0", "standard_conforming_strings = off"):
            conn.execute(sql.SQL("alter database {} set " + setting).format(db))
    options = urllib.parse.quote("-c application_name=crm\\")
    monkeypatch.setenv(SECRET, f"{crm['reader']}?options={options}")
    names = ("default_transaction_read_only", "transaction_read_only", "standard_conforming_strings",
             "statement_timeout", "idle_in_transaction_session_timeout", "lock_timeout", "application_name")
    query = ", ".join(f"current_setting('{n}') as {n}" for n in names) + ", 'x\\' as a, ';select 2;--' as b"
    d = _one_step(f"select {query}", "select * from s", {n: "string" for n in (*names, "a", "b")})
    check_query("s", d.sources["s"])
    [row] = execute(d, {}, _ctx(tmp_path, time_limit_s=30)).table.to_pylist()
    assert (row["default_transaction_read_only"], row["transaction_read_only"]) == ("on", "on")
    assert (row["standard_conforming_strings"], row["a"], row["b"]) == ("on", "x\\", ";select 2;--")
    assert 20_000 < _ms(row["statement_timeout"]) <= 30_000
    assert 20_000 < _ms(row["idle_in_transaction_session_timeout"]) <= 30_000
    assert _ms(row["lock_timeout"]) == postgres_source.POSTGRES_LOCK_TIMEOUT_MS
    assert row["application_name"] == "crm"


@pytest.mark.parametrize("options", [
    "-c default_transaction_read_only=off",
    "-c statement_timeout=0",
    "--statement-timeout=0",
    "-cLOCK_TIMEOUT=0",
    "-c idle_in_transaction_session_timeout=0",
    "-c standard_conforming_strings=off",
    "-c search_path=public -c Default_Transaction_Read_Only=off",
    "-B 100",
    "-c",
])
def test_a_dsn_whose_options_would_undo_the_sessions_settings_is_refused(
    crm: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: str
) -> None:
    """Proves a DSN `options` that sets one of the source's own settings (in any spelling PostgreSQL
    accepts), or holds anything but settings, is refused before the query runs, naming the setting but not
    the value; without the check the DSN's value would simply have been replaced or applied."""
    monkeypatch.setenv(SECRET, f"{crm['reader']}?password={CANARY}&options={urllib.parse.quote(options)}")
    with pytest.raises(ExecutionError) as caught:
        execute(_one_step("select wr() as w"), {}, _ctx(tmp_path))
    message = caught.value.message
    assert message.startswith(f"source 's': the DSN in secret {SECRET!r} ")
    assert CANARY not in message and "off" not in message and "=0" not in message
    assert "which the source sets itself" in message or "other than settings" in message
    _untouched(crm["admin"])


def test_a_query_cannot_lift_its_statement_timeout_for_later_batches(crm: dict[str, str], tmp_path: Path) -> None:
    """Proves, reading the stream directly (no watch thread to cancel it), that a query turning
    statement_timeout off in its first batch is still stopped by the server near the 1 s limit in its second:
    the source sets statement_timeout to the time left before every FETCH."""
    query = ("select g, case when g = 1 then set_config('statement_timeout', '0', false) end as c, "
             "case when g = 150 then pg_sleep(6)::text end as z from generate_series(1, 300) g")
    [source] = resolve_sources(_one_step(query), _ctx(tmp_path, time_limit_s=1))
    assert isinstance(source.binding, PostgresStream)
    started = time.monotonic()
    _schema, batches = source.binding.batches()
    with pytest.raises(LimitExceeded, match="exceeded the time limit of 1 s"):
        list(batches)
    assert time.monotonic() - started < 3.5


def _backends_of(admin: str, role: str) -> list[str]:
    with psycopg.connect(admin) as conn:
        rows = conn.execute("select state from pg_stat_activity where usename = %s", [role]).fetchall()
    return [str(r[0]) for r in rows]


def test_a_session_left_idle_in_its_transaction_is_ended_by_the_server(crm: dict[str, str], tmp_path: Path) -> None:
    """Proves idle_in_transaction_session_timeout is the time left: a stream whose reader stops after the
    first batch (a stalled or stopped worker) does not keep its transaction and snapshot open on the server
    past the time limit; the next read is limit_exceeded."""
    query = "select g from generate_series(1, 1000) g"
    [source] = resolve_sources(_one_step(query), _ctx(tmp_path, time_limit_s=1))
    assert isinstance(source.binding, PostgresStream)
    _schema, batches = source.binding.batches()
    assert next(batches).num_rows == postgres_source.POSTGRES_FIRST_FETCH_ROWS
    assert _backends_of(crm["admin"], crm["role"]) == ["idle in transaction"]
    deadline = time.monotonic() + 10
    while _backends_of(crm["admin"], crm["role"]) and time.monotonic() < deadline:  # polls: the server's timer
        time.sleep(0.1)
    assert _backends_of(crm["admin"], crm["role"]) == []
    with pytest.raises(LimitExceeded):
        next(batches)


def test_a_lock_wait_ends_with_lock_timeout_and_its_sqlstate(
    crm: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves lock_timeout is a session option: a query waiting for a lock another session holds fails
    after POSTGRES_LOCK_TIMEOUT_MS (shortened here) with SQLSTATE 55P03, long before its 30 s time limit."""
    monkeypatch.setattr(postgres_source, "POSTGRES_LOCK_TIMEOUT_MS", 300)
    with psycopg.connect(crm["admin"]) as holder:
        holder.execute("lock table t in access exclusive mode")
        started = time.monotonic()
        with pytest.raises(ExecutionError, match=r"\(SQLSTATE 55P03\)") as caught:
            execute(_one_step("select id from t"), {}, _ctx(tmp_path, time_limit_s=30))
        assert type(caught.value) is ExecutionError
        assert time.monotonic() - started < 10


@pytest.mark.parametrize(("query", "sqlstate"), [
    ("with x as (insert into t values (9) returning id) select id from x", "0A000"),
    ("select set_config('default_transaction_read_only', 'off', false) as a, wr() as b", "25006"),
    ("with s as (select set_config('default_transaction_read_only', 'off', false) as a) select wr() from s",
     "25006"),
    ("select set_config('transaction_read_only', 'off', false) as a", "25001"),
    ("select 1 as a; commit; select wr()", "42601"),
    ("commit; select pg_sleep(75)", "42601"),
    ("select 1 as a -- c\n; delete from t", "42601"),
    ("select 1 as a; set role postgres", "42601"),
    ("select set_config('role', 'postgres', false) as a", "42501"),
    ("select set_config('session_authorization', 'postgres', false) as a", "42501"),
    ("copy t to program 'touch /tmp/dataflow-pwned'", "42601"),
    ("select pg_read_file('/etc/hostname') as a", "42501"),
    ("select lo_import('/etc/hostname') as a", "42501"),
    ("select lo_export(4242, '/tmp/dataflow-pwned') as a", "42501"),
    ("select query_to_xml('insert into t values (7)', true, false, '')::text as a", "0A000"),
    ("select query_to_xml('select pg_read_file(''/etc/hostname'')', true, false, '')::text as a", "42501"),
    ("select id from t for update", "25006"),
])
def test_hostile_queries_are_refused_by_the_server_even_without_preflight(
    crm: dict[str, str], tmp_path: Path, query: str, sqlstate: str
) -> None:
    """Proves the second line of defence, with preflight's parse skipped (execute alone): the extended
    protocol refuses a script, the read-only session refuses writes (also after the query turns the
    session default off), and the least-privilege role refuses server files, large objects and other roles.
    Each fails with its SQLSTATE and a fixed description, nothing is written and no file appears."""
    with pytest.raises(ExecutionError) as caught:
        execute(_one_step(query), {}, _ctx(tmp_path))
    assert type(caught.value) is ExecutionError
    assert caught.value.message.startswith("source 's': the postgres query failed: ")
    assert caught.value.message.endswith(f"(SQLSTATE {sqlstate})")
    assert "/etc" not in caught.value.message and "postgres'" not in caught.value.message
    _untouched(crm["admin"])
    assert not Path("/tmp/dataflow-pwned").exists()


def _postgres_statement_count(admin: str, query: str) -> int:
    """How many statements PostgreSQL itself runs for the string (simple query protocol, default settings)."""
    with psycopg.connect(admin, autocommit=True) as conn:
        cur = conn.cursor()
        cur.execute(query)  # no parameters: the simple protocol, where a string may hold several statements
        count = 1
        while cur.nextset():
            count += 1
        return count


@pytest.mark.parametrize(("query", "statements"), [
    ("select 1 as a -- ; select 2", 1),
    ("select 1 as a -- x\n; select 2", 2),
    ("select 1 as a -- x\r; select 2", 2),
    ("select 1 as a /* ; */ ; select 2", 2),
    ("select 1 as a /* /* ; */ ; select 2 */", 1),
    ("select 1 as a /* /* */ */ ; select 2", 2),
    ("select $$;$$ as a", 1),
    ("select $t$ $$ ; $$ $t$ as a", 1),
    ("select $$x$$ as a; select 2", 2),
    ("select 'x\\' as a, ';select 2;--' as b", 1),
    ("select E'x\\' as a, ';select 2;--' as b", 2),
    ("select e'\\\\' as a; select 2", 2),
    ("select U&'d\\0061t' as a; select 2", 2),
    ("select 'a'';' as a", 1),
    ('select 1 as ";"', 1),
    ("select 1 as a;", 1),
    ("select 1 as a; -- a trailing comment", 1),
    ("select 1 as a;; select 2", 2),
])
def test_check_query_sees_the_statements_postgresql_sees(crm: dict[str, str], query: str, statements: int) -> None:
    """Proves sqlglot's PostgreSQL tokenizer is not fooled by comments (nested ones too), dollar quotes,
    escape strings or quoted identifiers: check_query admits exactly the strings PostgreSQL runs as one
    statement (with standard_conforming_strings on, which the session enforces) and refuses the others."""
    assert _postgres_statement_count(crm["admin"], query) == statements
    spec = _one_step(query).sources["s"]
    if statements == 1:
        check_query("s", spec)
        return
    with pytest.raises(InputError, match=r"^source 's': the postgres query must be exactly one statement") as caught:
        check_query("s", spec)
    assert "select 2" not in caught.value.message


@pytest.mark.parametrize("query", [
    "select 1 as n; delete from t",
    "select 1 as n -- pwn_marker\n; commit",
    "select 1 as n /* ; */ ; select 2",
    "select $$;$$ as n; select 2",
    "commit; select pg_sleep(75)",
    "select 1 as n \\; select 2",
    "with d as (delete from t returning *) select count(*) as n from d",
    "with a as (select 1), b as (update t set id = 1 returning id) select count(*) as n from a",
    "select 1 as n into pwn_marker",
    "select id as n from t for share",
    "copy t to program 'touch pwn_marker'",
    "set role postgres",
    "explain select 1",
    "select 'pwn_marker",
    "select 1 /* pwn_marker",
])
def test_a_script_or_a_non_read_query_is_refused_before_the_run_is_recorded(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, query: str
) -> None:
    """Proves, on both platform engines, that submitting a postgres source whose query is not exactly one
    read statement raises invalid_input before anything is recorded (no run, no ledger entry, no
    definition) and before the DSN is used, with a message naming the source and the rule, not the query."""
    monkeypatch.setenv(SECRET, f"postgresql://crm:{CANARY}@127.0.0.1:1/crm")
    with Platform(db_url) as platform:
        before = flows.row_counts(platform)
        with pytest.raises(InputError, match=r"^source 's': the postgres query (must|cannot)") as caught:
            platform.runs.run_inline(flows.request(_one_step(query), tmp_path, "refused"))
        assert flows.row_counts(platform) == before
    message = caught.value.message
    assert "pwn_marker" not in message and "delete" not in message and CANARY not in message


def _platform_text(platform: Platform) -> str:
    """Every row of every platform table, as text: what anyone reading the database later could see."""
    with platform.db.read() as conn:
        return "\n".join(repr(conn.execute(sa.text(f"SELECT * FROM {t}")).fetchall())
                         for t in flows.row_counts(platform))


def test_a_cast_error_never_puts_the_values_it_read_into_the_run(
    db_url: str, crm: dict[str, str], tmp_path: Path
) -> None:
    """Proves, through a recorded run on both platform engines, that a query casting a secret column's
    values to int (the cast error's server text quotes them) fails with a fixed description and SQLSTATE
    22P02, and the values appear neither in the run's error_message nor anywhere in the platform database."""
    query = "select (select string_agg(secret, ';') from t)::int as n"
    with Platform(db_url) as platform:
        run = platform.runs.run_inline(flows.request(_one_step(query), tmp_path, "leak")).run
        assert CANARY not in str(run.error_message)
        assert run.status == "failed" and run.error_code == "execution_failed"
        assert run.error_message == ("source 's': the postgres query failed: a value has the wrong form for its "
                                     "type (invalid input syntax) (SQLSTATE 22P02)")
        with platform.db.read() as conn:
            assert CANARY not in repr(ledger.read(conn, "dataflow", run.run_id))
        assert CANARY not in _platform_text(platform)


def _cannot_connect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dsn: str) -> DataflowError:
    monkeypatch.setenv(SECRET, dsn)
    with pytest.raises(ExecutionError) as caught:
        execute(_one_step("select 1 as a"), {}, _ctx(tmp_path))
    assert caught.value.message.startswith(
        f"source 's': cannot connect to PostgreSQL with the DSN in secret {SECRET!r}: "
    )
    return caught.value


def test_connection_errors_name_the_failure_without_any_driver_text(
    crm: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves every kind of connection failure (malformed DSN, unknown database or role, a bad client or
    server option, an unresolvable host) is a fixed description: neither the password, nor the host, port,
    user or database names libpq and the server quote (some of them unquoted) reach the message."""
    host, port = "127.0.0.1", crm["admin"].split("@", 1)[1].split("/", 1)[0].split(":")[1]
    server = f"{host}:{port}"
    cases = {
        f"postgresql://postgres:{CANARY}@{server}/{CANARY}": "the database does not exist",
        f"postgresql://{CANARY}:{CANARY}@{server}/postgres": "the server refused the credentials (authentication)",
        f"postgresql://postgres:{CANARY}@{server}/postgres?sslmode={CANARY}": "a connection parameter has an "
                                                                             "invalid value",
        f"postgresql://postgres:{CANARY}@{server}/postgres?options=-c%20work_mem%3D{CANARY}": "the server refused a "
                                                                                             "session option",
        f"postgresql://crm:first@{CANARY}@{server}/crm": "the host name does not resolve",
        f"postgresql://u:pa ss{CANARY}@{server}/db": "it is not a valid PostgreSQL connection string (conninfo)",
        f"host={host} port={port} password={CANARY} dbname": "it is not a valid PostgreSQL connection string "
                                                             "(conninfo)",
        f"postgresql://u:{CANARY}@[::1/db": "it is not a valid PostgreSQL connection string (conninfo)",
    }
    for dsn, description in cases.items():
        error = _cannot_connect(tmp_path, monkeypatch, dsn)
        assert error.message.endswith(f": {description}"), (dsn, error.message)
        assert CANARY not in error.message and port not in error.message and host not in error.message


@pytest.mark.postgres
def test_a_tenant_run_refuses_a_dsn_whose_role_may_read_server_files(
    crm: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a tenant's source is refused a superuser DSN (or one of a member of pg_read_server_files):
    such a role reads any server file from a read-only SELECT. The local operator may still use one,
    and the tenant's least-privilege reader role runs."""
    tenant = dataclasses.replace(_ctx(tmp_path), secrets=SecretScope(tenant="acme", grants={
        SECRET: SecretGrant(SECRET, "env", SECRET, frozenset({"acme"}))}))  # fmt: skip
    d = _one_step("select id from t")
    assert execute(d, {}, tenant).table.to_pylist() == [{"n": 2}]
    monkeypatch.setenv(SECRET, crm["admin"])  # the postgres superuser
    with pytest.raises(InputError, match="least-privilege role"):
        execute(d, {}, tenant)
    assert execute(d, {}, _ctx(tmp_path)).table.to_pylist() == [{"n": 2}]
    with psycopg.connect(crm["admin"], autocommit=True) as conn:
        conn.execute(sql.SQL("grant pg_read_server_files to {}").format(sql.Identifier(crm["role"])))
    monkeypatch.setenv(SECRET, crm["reader"])
    with pytest.raises(InputError, match="least-privilege role"):
        execute(d, {}, tenant)
