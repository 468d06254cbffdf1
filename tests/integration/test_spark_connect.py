"""The Spark engine through Spark Connect (``DATAFLOW_SPARK_REMOTE`` / ``--spark-remote``; issue 14, item 2).

A real Connect server (pyspark's ``SparkConnectServer`` on ``local[2]``, loopback only, with a bearer
token) serves this module. Through it: the cross-engine digests equal DuckDB's, the gate still refuses
before Spark is asked, an execution's session refuses file relations and substitution, errors quote no
file contents, the time limit interrupts the server's job, a server that stops answering or refuses
the token is an ExecutionError naming the gRPC status (never the URL or the token), a restarted server
is reconnected to, and `dataflow run` / `dataflow worker` on the server publish the Spark example
once and verify (the token in a variable: a token on the command line is refused).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deltalake
import pytest

# The other Spark suites' lists and helpers (imported, not copied); their module fixtures stay theirs.
from test_spark_conformance import QUERIES, tpch, tpch_queries  # noqa: F401  (tpch: the TPC-H data fixture)
from test_spark_hostile import (
    CANARY,
    DUCKDB_HOSTILE,
    KNOWN_DANGEROUS,
    assert_canary_errors_withheld,
    assert_refused_before_spark,
    canary_files,  # noqa: F401  (a fixture)
    definition,
    failure,
    run,
)

from durable_dataflow.core.errors import DataflowError, ExecutionError, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import spark_engine
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import SPARK_REMOTE_ENV, ExecutionLimits
from support.cli import EXAMPLES, make_cli
from support.flows import delta_publications
from support.spark_connect import ConnectServer, connect_server

pytestmark = pytest.mark.spark

SPARK_EXAMPLE = EXAMPLES / "tpch_revenue_spark"
# A cancelled job ends in milliseconds; the call returns within the grace, plus a loaded machine's slack.
CANCEL_SLACK_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """One Connect server for the module; the process's engine uses it (any classic session is stopped
    first, and the Connect one after, so later modules of this process start their own)."""
    spark_engine.stop_session()
    log = tmp_path_factory.mktemp("connect") / "server.log"
    with connect_server(log) as started, pytest.MonkeyPatch.context() as patch:
        patch.setenv(SPARK_REMOTE_ENV, started.url)
        yield started
        spark_engine.stop_session()
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)  # pyspark's mark of a process that used Connect


def ctx(base: Path, time_limit_s: float = 120) -> ExecutionContext:
    return ExecutionContext(base, (base,), ExecutionLimits(time_limit_s=time_limit_s))


def test_the_engine_runs_on_the_connect_server(server: ConnectServer, tmp_path: Path) -> None:
    """Proves executions go through Spark Connect (a remote session, not a local JVM), earlier steps are
    checkpointed in the execution's own session (pyspark bound them to the process's first one, and the
    second step failed with DATAFRAME_NOT_FOUND), and each execution's server session is released."""
    result = run(definition(["select n, s from t", "select s as v from s0 order by n"]), tmp_path)
    assert result.table.to_pylist() == [{"v": "a"}, {"v": "b"}]
    assert spark_engine.session().__class__.__module__.startswith("pyspark.sql.connect")
    session = spark_engine.execution_session()
    try:
        assert session.session_id != spark_engine.session().session_id  # type: ignore[attr-defined]
    finally:
        session.stop()


# Two of the conformance queries (the local suite runs them all): a multi-join and the exact Q1.
CONNECT_QUERIES = [q for q in QUERIES if q.name in ("q1_exact", "q5")]


@pytest.mark.parametrize("query", CONNECT_QUERIES, ids=[q.name for q in CONNECT_QUERIES])
def test_tpch_digests_through_connect_equal_duckdb(server: ConnectServer, query: Any, tpch: Path) -> None:  # noqa: F811
    """Proves the cross-engine conformance holds through Spark Connect: the same totally ordered TPC-H
    query gives the same rows and the same output digest as DuckDB."""
    document = tpch_queries.definition(query, tpch)
    duck, spark = (execute(Definition.model_validate({**document, "engine": engine}), {},
                           ExecutionContext(tpch, (tpch,))) for engine in ("duckdb", "spark"))
    assert duck.row_count > 0
    assert (spark.row_count, spark.output_digest) == (duck.row_count, duck.output_digest)
    assert spark.table.equals(duck.table)


HOSTILE = [*(sql for sql, _ in KNOWN_DANGEROUS), *(sql.format(root="/r", cwd="/c", data="/d", sinks="/s",
                                                               secrets="/x", home="/h") for sql in DUCKDB_HOSTILE)]


@pytest.mark.parametrize("sql", HOSTILE, ids=[f"h{i:03d}" for i in range(len(HOSTILE))])
def test_hostile_sql_is_refused_before_the_server_is_asked(
    server: ConnectServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sql: str
) -> None:
    """Proves the four probes of the issue (reflect, java_method, text.`/path`, TRANSFORM … USING) and
    their variants are refused by the gate with a Connect server configured, without a call to it."""
    def refuse(*args: object) -> None:
        raise AssertionError("the gate must refuse before Spark is used")

    monkeypatch.setattr(spark_engine, "session", refuse)
    assert_refused_before_spark(definition(sql), tmp_path)


def test_a_transform_script_is_refused_before_the_server_is_asked(server: ConnectServer, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the gate must refuse before Spark is used")

    monkeypatch.setattr(spark_engine, "session", refuse)
    assert_refused_before_spark(definition("select transform(s) using 'cat /etc/hostname' as (v) from t"), tmp_path)


def test_an_execution_session_refuses_file_relations_and_substitution(server: ConnectServer) -> None:
    """Proves the second line behind the gate holds on the server: an execution's Connect session refuses
    text.`/etc/hostname` and leaves ${system:user.home} and ${env:HOME} unsubstituted."""
    session = spark_engine.execution_session()
    try:
        with pytest.raises(Exception, match=r"TABLE_OR_VIEW_NOT_FOUND|UNSUPPORTED_DATASOURCE_FOR_DIRECT_QUERY"):
            session.sql("select * from text.`/etc/hostname`").collect()
        row = session.sql("select '${system:user.home}' as a, '${env:HOME}' as b").collect()[0]
        assert (row.a, row.b) == ("${system:user.home}", "${env:HOME}")
    finally:
        session.stop()


def test_errors_through_connect_never_quote_file_contents_or_paths(server: ConnectServer,
                                                                    canary_files: Path) -> None:  # noqa: F811
    """Proves Connect's error shape (conditions and parameters sent by the server) is withheld alike: each
    of the canary errors fails as ExecutionError without the canary, the file's folder or the home folder."""
    assert_canary_errors_withheld(canary_files)


def test_a_string_that_is_not_utf8_fails_through_connect(server: ConnectServer, tmp_path: Path) -> None:
    error = failure(definition("select cast(unbase64('qA==') as string) as v"), tmp_path)
    assert isinstance(error, ExecutionError) and "column 'v'" in error.message and "UTF-8" in error.message, error


def test_the_time_limit_interrupts_the_servers_job(server: ConnectServer, tmp_path: Path) -> None:
    """Proves a step that would run for hours ends at the time limit (limit_exceeded) and its job on the
    server is interrupted: the next execution, which needs the server's two cores, runs at once."""
    started = time.monotonic()
    error = failure(definition("select cast(count(*) as string) as v from range(100000000000)"), tmp_path,
                    time_limit_s=3)
    assert isinstance(error, LimitExceeded), error
    assert time.monotonic() - started < 3 + spark_engine.CALL_GRACE_S + CANCEL_SLACK_S
    quick = execute(definition("select cast(count(*) as string) as v from range(1000000)"), {}, ctx(tmp_path, 30))
    assert quick.table.to_pylist() == [{"v": "1000000"}]


def test_a_refused_token_is_an_execution_error_that_never_shows_it(server: ConnectServer, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves a Connect server refusing the credentials fails the execution in seconds with an
    ExecutionError naming UNAUTHENTICATED and the variable, not the URL or the token; the next execution
    with the right URL connects again."""
    wrong = f"sc://localhost:{server.port}/;token=wrong-{CANARY}"
    spark_engine.stop_session()
    monkeypatch.setenv(SPARK_REMOTE_ENV, wrong)
    with pytest.raises(ExecutionError) as caught:
        run(definition("select s as v from t"), tmp_path)
    message = caught.value.message
    assert "UNAUTHENTICATED" in message and SPARK_REMOTE_ENV in message, message
    assert CANARY not in message and server.token not in message and str(server.port) not in message, message
    monkeypatch.setenv(SPARK_REMOTE_ENV, server.url)
    assert run(definition("select s as v from t"), tmp_path).row_count == 2


def test_a_lost_server_fails_in_seconds_and_a_restarted_one_is_reconnected(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Hole: pyspark retries a call the server does not answer for up to 10 minutes, past any time limit,
    and after a server restart the process's session was unknown to it. Now a stopped server fails the
    execution within seconds (ExecutionError, UNAVAILABLE) and, once a server listens there again, the
    next execution opens a new session on it. (Its own server: the module's one keeps serving.)"""
    d = definition("select s as v from t")
    with connect_server(tmp_path / "first.log") as first:
        spark_engine.stop_session()
        monkeypatch.setenv(SPARK_REMOTE_ENV, first.url)
        assert run(d, tmp_path).row_count == 2
        port, token = first.port, first.token
    started = time.monotonic()
    with pytest.raises(ExecutionError) as caught:
        run(d, tmp_path)
    assert "UNAVAILABLE" in caught.value.message and token not in caught.value.message, caught.value.message
    assert time.monotonic() - started < 2 * spark_engine.CONNECT_RETRY_S + CANCEL_SLACK_S
    with connect_server(tmp_path / "second.log", port=port, token=token):
        assert run(d, tmp_path).row_count == 2
    spark_engine.stop_session(lost=True)


def _example(tmp_path: Path) -> Path:
    folder = tmp_path / "example"
    shutil.copytree(SPARK_EXAMPLE, folder, ignore=shutil.ignore_patterns("warehouse"))
    return folder


def test_cli_run_with_spark_remote_publishes_once_and_verifies(server: ConnectServer, tmp_path: Path,
                                                               sqlite_url: str) -> None:
    """Proves `dataflow run --spark-remote sc://…` runs the Spark example on the Connect server: it
    publishes to Delta once, a replay adds nothing, `verify` passes, and no output shows the token."""
    folder = _example(tmp_path)
    cli = make_cli(sqlite_url, tmp_path)
    args = ("run", str(folder / "dataflow.yaml"), "--param", "year_start=1994-01-01", "--idempotency-key", "c-1",
            "--spark-remote", server.url_without_token, "--json")
    token = {"SPARK_CONNECT_AUTHENTICATE_TOKEN": server.token}  # never on the command line
    first = cli(*args, extra_env=token)
    assert first.code == 0, first.output
    found = first.json()
    assert (found["status"], found["recovery_status"]) == ("succeeded", "verified"), found
    table = folder / "warehouse" / "revenue_by_nation"
    assert len(delta_publications(table)) == 1
    assert deltalake.DeltaTable(str(table)).to_pyarrow_table().num_rows == found["row_count"]
    second = cli(*args, extra_env=token)
    assert second.code == 0 and second.json()["replayed"] is True, second.output
    assert len(delta_publications(table)) == 1
    verified = cli("verify", found["run_id"])
    assert verified.code == 0, verified.output
    assert server.token not in first.output + second.output + verified.output


def test_cli_run_and_worker_with_a_wrong_token_fail_the_run_cleanly(server: ConnectServer, tmp_path: Path,
                                                                   sqlite_url: str) -> None:
    """Proves a careless operator's wrong token, through `dataflow run` and a `dataflow worker`, ends each
    run failed (execution_failed, UNAUTHENTICATED), never running, without the token in any output; the
    worker then runs the next queued run with the right one."""
    folder = _example(tmp_path)
    cli = make_cli(sqlite_url, tmp_path)
    wrong = {SPARK_REMOTE_ENV: f"sc://localhost:{server.port}/;token=wrong-{CANARY}"}
    base = ("--param", "year_start=1994-01-01", "--json")
    ran = cli("run", str(folder / "dataflow.yaml"), *base, "--idempotency-key", "w-1", extra_env=wrong)
    assert ran.code != 0, ran.output
    assert CANARY not in ran.output and "UNAUTHENTICATED" in ran.output, ran.output
    ids = []
    for key in ("w-2", "w-3"):
        submitted = cli("submit", str(folder / "dataflow.yaml"), *base, "--idempotency-key", key)
        assert submitted.code == 0, submitted.output
        ids.append(submitted.json()["run_id"])
    worked = cli("worker", "--once", extra_env=wrong)
    assert CANARY not in worked.output, worked.output
    worked = cli("worker", "--until-idle", "--poll-interval", "0.05", extra_env={SPARK_REMOTE_ENV: server.url})
    assert worked.code == 0, worked.output
    shown = [cli("show", run_id, "--json").json() for run_id in ids]
    listed = cli("runs", "--json")
    assert listed.code == 0 and "running" not in {r["status"] for r in listed.json()}, listed.output
    assert (shown[0]["status"], shown[0]["error_code"]) == ("failed", "execution_failed"), shown[0]
    assert "UNAUTHENTICATED" in shown[0]["error_message"] and CANARY not in shown[0]["error_message"], shown[0]
    assert shown[1]["status"] == "succeeded", shown[1]
    assert server.token not in worked.output + listed.output


@pytest.mark.parametrize("command", [["run", "{definition}"], ["worker", "--once"], ["serve", "--port", "0"]])
def test_a_token_on_the_command_line_is_refused(tmp_path: Path, sqlite_url: str, command: list[str]) -> None:
    """Proves `--spark-remote sc://…/;token=…` is refused by `run`, `worker` and `serve` with exit 2
    before anything is recorded or started, without echoing the token: every user of a shared machine
    reads another's command line (ps). The variables are the way."""
    folder = _example(tmp_path)
    cli = make_cli(sqlite_url, tmp_path)
    argv = [part.format(definition=folder / "dataflow.yaml") for part in command]
    urls = (f"sc://localhost:15002/;token={CANARY}", f"sc://h:1/;use_ssl=true;TOKEN={CANARY}",
            f"sc://h:1/; token = {CANARY}")
    for url in urls:
        refused = cli(*argv, "--spark-remote", url)
        assert refused.code == 2, refused.output
        assert "visible to every user" in refused.output and SPARK_REMOTE_ENV in refused.output, refused.output
        assert CANARY not in refused.output, refused.output
    listed = cli("runs", "--json")
    assert listed.code == 0 and listed.json() == [], listed.output


CARELESS_URLS = [
    ("sc://localhost:1/;token={canary}", "UNAVAILABLE"),  # nothing listens there
    ("sc://no-such-host.invalid:15002/;token={canary}", "UNAVAILABLE"),
    ("http://localhost:15002/;token={canary}", "INVALID_CONNECT_URL"),
    ("sc://localhost:port/;token={canary}", "could not be started"),
    ("sc://[::1/;token={canary}", "could not be started"),
]


@pytest.mark.parametrize(("url", "said"), CARELESS_URLS, ids=[f"u{i}" for i in range(len(CARELESS_URLS))])
def test_a_careless_url_is_named_by_status_never_by_address_or_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, said: str
) -> None:
    """Proves a URL where nothing listens, with a host that does not resolve, of the wrong scheme or
    malformed fails the execution as ExecutionError naming the status and the variable, never the
    address or the token."""
    spark_engine.stop_session()
    monkeypatch.setenv(SPARK_REMOTE_ENV, url.format(canary=CANARY))
    with pytest.raises(DataflowError) as caught:
        run(definition("select s as v from t"), tmp_path)
    message = caught.value.message
    assert isinstance(caught.value, ExecutionError) and said in message and SPARK_REMOTE_ENV in message, message
    assert CANARY not in message and "localhost" not in message and "no-such-host" not in message, message
    spark_engine.stop_session(lost=True)


def test_zz_a_local_session_starts_after_connect_in_the_same_process(server: ConnectServer, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Hole: pyspark marks the whole process as Spark Connect once it made a Connect session
    (SPARK_CONNECT_MODE_ENABLED), so a process configured back to a master could never start a local
    session again (CONNECT_URL_NOT_SET). The platform's settings choose the kind. (Last: it starts a JVM.)"""
    assert run(definition("select s as v from t"), tmp_path).row_count == 2  # a Connect session exists
    spark_engine.stop_session()
    monkeypatch.delenv(SPARK_REMOTE_ENV)
    assert run(definition("select s as v from t"), tmp_path).row_count == 2
    assert not spark_engine.session().__class__.__module__.startswith("pyspark.sql.connect")
    spark_engine.stop_session()
