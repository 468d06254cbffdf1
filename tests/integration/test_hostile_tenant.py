"""A hostile tenant against the real server (issue 12, item 7; docs/security.md).

One `dataflow serve` subprocess per platform engine (SQLite, then PostgreSQL) serves two tenants: A,
the victim, publishes rows to its own Parquet and Delta sinks; B, the attacker, holds submitter and
operator tokens made with `dataflow tokens create` and a grant to a DSN of a separate "warehouse"
database on the test cluster. Canaries are planted in the server's working directory (`.env`, the
SQLite database), in A's runs (idempotency keys, parameters, published rows), in the platform's
settings (DATAFLOW_DB, DATAFLOW_EVIDENCE_KEY), in a secrets folder, in a set but ungranted variable,
in the service user's home and in the warehouse. Every attack of the issue, with its variants, goes
through HTTP; each test asserts the attack is refused (before recording) or harmless. The four
`test_zz_*` tests, run last, then check everything B received and can still read, every file, table,
role and token of the scene, and A's published data.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from durable_dataflow.core.secrets import SecretScope
from durable_dataflow.datasources import registry
from support import hostile
from support.api_runs import LOGIN_CSRF_FIELD
from support.hostile import TENANT_A, TENANT_B, Arena
from support.pg import PostgresServer

MIB = 1024 * 1024
RSS_GROWTH_MAX = 50 * MIB
ECHO = "b-echo-4f2a9c"  # B's own marker: error messages must not repeat it
ESCAPES = "\u202e\x9b31m\u2066\x1b[2J\x1b]52;c;cHduZWQ=\x07\x1b]8;;http://evil.example/\x07x\r\x08\x7f\u2069"
PG_SLEEP_LIMIT_S = 3
PG_SLEEP_WALL_MAX_S = 25.0
PG_FAILURE = r"^source 'src': the postgres query failed: [^\"]+ \(SQLSTATE [0-9A-Z]{5}\)$"
# Words of PostgreSQL's own messages: none may reach B (only a fixed description and the SQLSTATE).
DRIVER_WORDS = (
    "ERROR:", "DETAIL", "HINT", "LINE 1", "permission denied", "invalid input syntax for", "must be superuser",
    "must be owner", "pg_read_file", "current transaction", "psycopg", "cannot set",
)  # fmt: skip

ENGINES = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(scope="module", params=ENGINES)
def arena(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, postgres_server: PostgresServer
) -> Iterator[Arena]:
    """The scene of one engine (tests/support/hostile.py): the server, the tenants, the canaries."""
    root = tmp_path_factory.mktemp(f"hostile-{request.param}")
    with hostile.arena(request.param, root, postgres_server) as scene:
        yield scene


# ---- helpers -------------------------------------------------------------------------------------


def document(
    sources: dict[str, Any],
    sql: str,
    *,
    columns: dict[str, str] | None = None,
    target: dict[str, Any] | None = None,
    parameters: dict[str, Any] | None = None,
    limits: dict[str, Any] | None = None,
    name: str = "attack",
    description: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": name, "version": 1, "sources": sources, "steps": [{"name": "r", "sql": sql}],
        "output": {"schema": columns or {"v": "string"}, "max_rows": 1000, "max_bytes": "1MiB"},
    }  # fmt: skip
    for key, value in (("target", target), ("parameters", parameters), ("limits", limits),
                       ("description", description)):  # fmt: skip
        if value is not None:
            body[key] = value
    return body


INLINE = {"t": {"kind": "inline", "rows": [{"s": "b-row"}], "schema": {"s": "string"}}}
OWN_CSV = {"t": {"kind": "csv", "path": "mine.csv", "schema": {"s": "string"}}}


def sink(
    location: str, provider: str = "parquet", mode: str = "append", datasource: str | None = None
) -> dict[str, Any]:
    """B's target. By default each provider and location is its own datasource: a tenant's datasource name
    registers one provider and location with its first publication, and another location is refused."""
    name = datasource or f"b.attack.{label(provider + chr(0) + location)}"
    return {"type": "datasources.publication", "provider": provider, "datasource": name,
            "location": location, "mode": mode}  # fmt: skip


def warehouse(query: str) -> dict[str, Any]:
    return {"src": {"kind": "postgres", "dsn": {"secret": "WAREHOUSE_DSN"}, "query": query}}


def submit(
    arena: Arena,
    body: dict[str, Any],
    *,
    token: str = "b_submitter",
    parameters: dict[str, Any] | None = None,
    key: str | None = None,
) -> httpx.Response:
    """B submits a run (inline execution, as `dataflow serve` does by default)."""
    payload: dict[str, Any] = {"definition": body}
    if parameters is not None:
        payload["parameters"] = parameters
    headers = {"Idempotency-Key": key} if key is not None else {}
    return arena.b.request("POST", "/v1/runs", token=arena.tokens[token], json=payload, headers=headers)


def label(text: str) -> str:
    """A short stable name for a loot location of one attack."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def fill(arena: Arena, template: str) -> str:
    """A path or SQL template with the scene's folders filled in."""
    return template.format(root=arena.root, cwd=arena.cwd, data=arena.data_root, sinks=arena.sink_root,
                           secrets=arena.secrets_dir, home=arena.home)  # fmt: skip


def assert_clean(arena: Arena, response: httpx.Response) -> None:
    headers = "\n".join(f"{k}: {v}" for k, v in response.headers.multi_items())
    leaked = hostile.canaries_in(response.text + headers, arena.canaries)
    assert not leaked, f"B received canaries {leaked}: {response.text[:2000]}"


def assert_refused(
    arena: Arena, response: httpx.Response, before: int, codes: tuple[str, ...] = ("invalid_input",)
) -> str:
    """Refused before recording: an error answer naming one of ``codes``, and no run row more."""
    assert_clean(arena, response)
    assert response.status_code in (403, 404, 413, 422), (response.status_code, response.text[:2000])
    assert response.json()["error"]["code"] in codes, response.text[:2000]
    assert arena.run_count() == before, "a refused submission recorded a run"
    return str(response.json()["error"]["message"])


def refused_or_run(arena: Arena, response: httpx.Response, before: int) -> dict[str, Any] | None:
    """Refused before recording (None), or a recorded run that ended (returned): never a 5xx."""
    assert_clean(arena, response)
    if response.status_code in (403, 404, 422):
        assert arena.run_count() == before, "a refused submission recorded a run"
        return None
    assert response.status_code == 201, (response.status_code, response.text[:2000])
    run: dict[str, Any] = response.json()["run"]
    assert run["status"] in ("succeeded", "failed"), run
    return run


def assert_no_driver_text(run: dict[str, Any]) -> None:
    message = run.get("error_message") or ""
    for word in DRIVER_WORDS:
        assert word.casefold() not in message.casefold(), f"driver text {word!r} reached B: {message}"


def assert_loot_clean(arena: Arena) -> None:
    """Whatever B's runs published into B's own sink tree holds no canary."""
    leaked = hostile.canaries_in(hostile.readable_text(arena.sink_root / TENANT_B), arena.canaries)
    assert not leaked, f"B's own sink holds canaries {leaked}"


def assert_a_intact(arena: Arena) -> None:
    """A's published rows, read directly from its sinks, and A's runs: succeeded, verified, verifying."""
    for provider in arena.notes["providers"]:
        assert hostile.published_rows(arena, provider) == arena.a_rows, f"A's {provider} rows changed"
    for run in arena.a_runs.values():
        answer = arena.a.get(f"/v1/runs/{run['run_id']}/evidence")
        assert answer.status_code == 200, answer.text
        found = answer.json()
        assert (found["run"]["status"], found["run"]["recovery_status"]) == ("succeeded", "verified"), found["run"]
        assert found["verification"]["ok"] is True, found["verification"]


# ---- controls: B's legitimate runs work, so every refusal below is a refusal -------------------------


def test_b_can_run_on_its_own_file_and_its_granted_warehouse(arena: Arena) -> None:
    """Proves the attacker's own tree and its granted warehouse DSN work (a refusal below is a real one):
    a CSV of <data-root>/tenant_b and a count over the warehouse table both succeed."""
    own = submit(arena, document(OWN_CSV, "select s as v from t"))
    assert own.status_code == 201 and own.json()["run"]["status"] == "succeeded", own.text
    counted = submit(arena, document(warehouse("select count(*)::int as n from t"), "select cast(n as varchar) as v "
                                     "from src"))  # fmt: skip
    assert counted.status_code == 201 and counted.json()["run"]["status"] == "succeeded", counted.text
    assert counted.json()["run"]["row_count"] == 1
    assert_clean(arena, own)
    assert_clean(arena, counted)
    # The granted role itself may write t: only the source's confinement stops the attacks below.
    with psycopg.connect(arena.warehouse.dsn) as conn:
        conn.execute(WRITE)
        conn.rollback()


# ---- secrets ---------------------------------------------------------------------------------------

SECRET_NAMES = [
    pytest.param("DATAFLOW_DB", id="DATAFLOW_DB"),
    pytest.param("DATAFLOW_EVIDENCE_KEY", id="DATAFLOW_EVIDENCE_KEY"),
    pytest.param("dataflow_db", id="lowercase-dataflow_db"),
    pytest.param("Dataflow_Evidence_Key", id="mixedcase-evidence-key"),
    pytest.param("DATAFLOW_GRANTS", id="DATAFLOW_GRANTS"),
    pytest.param("DATAFLOW_SECRETS_DIR", id="DATAFLOW_SECRETS_DIR"),
    pytest.param("DATAFLOW_API_BODY_BYTES_MAX", id="DATAFLOW_API_BODY_BYTES_MAX"),
    pytest.param("UNGRANTED_API_KEY", id="set-but-ungranted"),
    pytest.param("A_WAREHOUSE_DSN", id="A-env-grant"),
    pytest.param("A_FILE_SECRET", id="A-file-grant"),
    pytest.param("LOOSE_SECRET", id="secrets-folder-file-ungranted"),
    pytest.param("HOME", id="HOME"),
    pytest.param("PATH", id="PATH"),
    pytest.param("NEVER_SET_ANYWHERE_7Q", id="unset"),
]


@pytest.mark.parametrize("placement", ["source_dsn", "target_option"])
@pytest.mark.parametrize("name", SECRET_NAMES)
def test_b_cannot_name_a_secret_that_is_not_granted_to_it(arena: Arena, name: str, placement: str) -> None:
    """Proves {secret: NAME} for the platform's settings (any case), another tenant's grants, a set but
    ungranted variable, a secrets-folder file and an unset name are refused before recording, in a
    postgres source's dsn and in a target option, all with one message that names no variable."""
    before = arena.run_count()
    if placement == "source_dsn":
        body = document({"src": {"kind": "postgres", "dsn": {"secret": name}, "query": "select 'x' as v"}},
                        "select v from src")  # fmt: skip
    else:
        target = {**sink("b_table", provider="postgres"), "options": {"dsn": {"secret": name}}}
        body = document(INLINE, "select s as v from t", target=target)
    message = assert_refused(arena, submit(arena, body, token="b_operator"), before)
    assert name.casefold() not in message.casefold()
    # One refusal for every name (after "source 'src': " or "target option 'dsn': "): it reveals nothing.
    assert message.split(": ", 1)[1] == SecretScope(tenant=TENANT_B).unavailable(), message


# ---- PostgreSQL sources on the granted warehouse DSN -------------------------------------------------

WRITE = "INSERT INTO t VALUES (99, 'pwned')"
REFUSED_QUERIES = [
    pytest.param(f"COMMIT; {WRITE}; SELECT 'x' AS v", id="commit-insert-select"),
    pytest.param("COMMIT; SELECT pg_sleep(75)", id="commit-pg_sleep"),
    pytest.param(f"SELECT 'x' AS v /* */; {WRITE}", id="second-statement-after-block-comment"),
    pytest.param(f"SELECT 'x' AS v -- c\n; {WRITE}", id="second-statement-after-line-comment"),
    pytest.param(f"/* lead */ {WRITE}; SELECT 'x' AS v", id="comment-then-insert"),
    pytest.param(f"SELECT 'x\\' AS v; {WRITE}; --'", id="backslash-is-not-an-escape"),
    pytest.param("COPY (SELECT 1) TO PROGRAM 'touch {root}/copy-program-ran'", id="copy-to-program"),
    pytest.param("COPY t TO '{root}/copied.csv'", id="copy-to-file"),
    pytest.param("SET ROLE postgres", id="set-role"),
    pytest.param("SET ROLE postgres; SELECT 'x' AS v", id="set-role-then-select"),
    pytest.param("SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE", id="set-session-read-write"),
    pytest.param(f"BEGIN READ WRITE; {WRITE}; SELECT 'x' AS v", id="begin-read-write"),
    pytest.param(f"WITH w AS ({WRITE} RETURNING secret_col) SELECT secret_col AS v FROM w", id="insert-cte"),
    pytest.param("WITH w AS (DELETE FROM t RETURNING secret_col) SELECT secret_col AS v FROM w", id="delete-cte"),
    pytest.param("SELECT secret_col AS v INTO loot FROM t", id="select-into"),
    pytest.param("CREATE TABLE loot AS SELECT secret_col AS v FROM t", id="create-table-as"),
    pytest.param(f"DO $$ BEGIN {WRITE}; END $$", id="do-block"),
    pytest.param("SELECT secret_col AS v FROM t FOR UPDATE", id="for-update"),
    pytest.param("CALL pg_catalog.pg_sleep(1)", id="call"),
    pytest.param("EXPLAIN ANALYZE " + f"WITH w AS ({WRITE} RETURNING 1) SELECT 1 FROM w", id="explain-analyze-write"),
]


@pytest.mark.parametrize("query", REFUSED_QUERIES)
def test_b_postgres_scripts_and_writes_are_refused_before_recording(arena: Arena, query: str) -> None:
    """Proves a script (`;`-joined, a second statement after a comment), COPY … TO PROGRAM/file, SET ROLE,
    transaction control, a data-modifying CTE, SELECT INTO and FOR UPDATE on the granted warehouse DSN
    are refused before recording, and the warehouse is unchanged (rows, tables, no program ran)."""
    before = arena.run_count()
    body = document(warehouse(fill(arena, query)), "select cast(v as varchar) as v from src",
                    limits={"time_limit": PG_SLEEP_LIMIT_S})  # fmt: skip
    assert_refused(arena, submit(arena, body), before)
    assert arena.warehouse.rows() == arena.baseline["warehouse_rows"]
    assert arena.warehouse.objects() == arena.baseline["warehouse_objects"]
    assert not (arena.root / "copy-program-ran").exists() and not (arena.root / "copied.csv").exists()


HARMLESS_QUERIES = [
    pytest.param("SELECT 'x' AS v; --", id="trailing-semicolon-and-comment"),
    pytest.param(f"SELECT 'x' AS v -- ; {WRITE}", id="line-comment-hides-second-statement"),
    pytest.param(f"SELECT 'x' AS v /* /* */ ; {WRITE} */", id="nested-comment"),
    pytest.param(f"SELECT $q$ ; {WRITE}; $q$ AS v", id="dollar-quoted-script"),
    pytest.param(f"SELECT E'x\\'; {WRITE}; --' AS v", id="e-string-escaped-quote"),
    pytest.param("SELECT set_config('default_transaction_read_only', 'off', false) AS v", id="read-only-default-off"),
    pytest.param("SELECT set_config('transaction_read_only', 'off', false) AS v", id="transaction-read-only-off"),
    pytest.param("SELECT set_config('role', 'postgres', false) AS v", id="set_config-role"),
    pytest.param("SELECT pg_read_file('/etc/passwd') AS v", id="pg_read_file"),
    pytest.param("SELECT string_agg(d, ',') AS v FROM pg_ls_dir('.') d", id="pg_ls_dir"),
    pytest.param("SELECT lo_import('/etc/passwd')::text AS v", id="lo_import"),
    pytest.param("SELECT current_setting('data_directory') AS v", id="data_directory"),
    pytest.param("SELECT (SELECT string_agg(secret_col, ';') FROM t)::int AS v", id="cast-error-over-canary"),
    pytest.param("SELECT (SELECT string_agg(secret_col, ';') FROM t)::jsonb::text AS v", id="json-error-over-canary"),
    pytest.param("SELECT count(pg_terminate_backend(pid))::text AS v FROM pg_stat_activity "
                 "WHERE pid <> pg_backend_pid()", id="terminate-other-sessions"),
    pytest.param("SELECT string_agg(coalesce(query, ''), ';') AS v FROM pg_stat_activity", id="pg_stat_activity"),
    pytest.param("SELECT nextval('loot_seq')::text AS v", id="nextval-unknown"),
    pytest.param("SELECT txid_current()::text AS v", id="txid_current-needs-write"),
]


@pytest.mark.parametrize("query", HARMLESS_QUERIES)
def test_b_single_postgres_statements_are_harmless(arena: Arena, query: str) -> None:
    """Proves comment and quoting tricks, read-only escapes through set_config, pg_read_file, pg_ls_dir,
    lo_import, a cast error over a canary column and pg_terminate_backend either are refused or run as one
    read-only statement: no write, no new object, no driver text (a fixed description and the SQLSTATE)
    and no canary in the answer, in the error or in what the run published to B's own sink."""
    before = arena.run_count()
    body = document(warehouse(query), "select cast(v as varchar) as v from src", target=sink(f"loot/pg{label(query)}"),
                    limits={"time_limit": 30})  # fmt: skip
    run = refused_or_run(arena, submit(arena, body), before)
    if run is not None and run["status"] == "failed":
        assert_no_driver_text(run)
        if run["error_code"] == "execution_failed" and "postgres query failed" in (run["error_message"] or ""):
            assert re.match(PG_FAILURE, run["error_message"]), run["error_message"]
    assert arena.warehouse.rows() == arena.baseline["warehouse_rows"]
    assert arena.warehouse.objects() == arena.baseline["warehouse_objects"]
    assert_loot_clean(arena)
    assert arena.b.request("GET", "/healthz").json()["status"] == "ok"


@pytest.mark.parametrize(
    "query",
    [
        pytest.param("SELECT pg_sleep(75)::text AS v", id="pg_sleep-75"),
        pytest.param("SELECT set_config('statement_timeout', '0', false) || pg_sleep(75)::text AS v",
                     id="timeout-off-then-sleep"),
        pytest.param("SELECT pg_sleep(75)::text AS v FROM generate_series(1, 2)", id="sleep-per-row"),
    ],
)
def test_b_postgres_sleep_ends_at_the_definitions_time_limit(arena: Arena, query: str) -> None:
    """Proves pg_sleep(75) (also after turning statement_timeout off) is stopped at the run's 3 s time limit
    from the definition's `limits:` block: the run fails limit_exceeded long before 75 s."""
    before = arena.run_count()
    body = document(warehouse(query), "select cast(v as varchar) as v from src",
                    limits={"time_limit": PG_SLEEP_LIMIT_S})  # fmt: skip
    started = time.monotonic()
    run = refused_or_run(arena, submit(arena, body), before)
    elapsed = time.monotonic() - started
    assert elapsed < PG_SLEEP_WALL_MAX_S, f"the sleep ran {elapsed:.1f}s"
    assert run is not None and (run["status"], run["error_code"]) == ("failed", "limit_exceeded"), run
    assert_no_driver_text(run)


# ---- files -----------------------------------------------------------------------------------------

OUTSIDE_PATHS = [
    pytest.param("csv", ".env", id="dotenv-relative"),
    pytest.param("csv", "../.env", id="dotenv-one-up"),
    pytest.param("csv", "../../server-cwd/.env", id="cwd-dotenv-relative"),
    pytest.param("csv", "{cwd}/.env", id="cwd-dotenv-absolute"),
    pytest.param("csv", "{cwd}/.dataflow/dataflow.db", id="sqlite-db-absolute"),
    pytest.param("csv", "../../server-cwd/.dataflow/dataflow.db", id="sqlite-db-relative"),
    pytest.param("csv", "{cwd}/.dataflow/dataflow.db-wal", id="sqlite-wal-absolute"),
    pytest.param("csv", "{root}/server.log", id="server-log"),
    pytest.param("csv", "{root}/grants.yaml", id="grants-file"),
    pytest.param("csv", "{secrets}/LOOSE_SECRET", id="secrets-folder-absolute"),
    pytest.param("csv", "../../secrets/A_FILE_SECRET", id="secrets-folder-relative"),
    pytest.param("csv", "~/.netrc", id="tilde-netrc"),
    pytest.param("csv", "$HOME/.netrc", id="dollar-home-netrc"),
    pytest.param("csv", "${{HOME}}/.netrc", id="braced-home-netrc"),
    pytest.param("csv", "/proc/self/environ", id="proc-self-environ"),
    pytest.param("csv", "../../../../../../../../proc/self/environ", id="proc-self-environ-relative"),
    pytest.param("csv", "/etc/passwd", id="etc-passwd"),
    pytest.param("csv", "file://{cwd}/.env", id="file-url"),
    pytest.param("csv", "../tenant_a/orders.csv", id="A-data-relative"),
    pytest.param("csv", "{data}/tenant_a/orders.csv", id="A-data-absolute"),
    pytest.param("csv", "./../tenant_a/orders.csv", id="A-data-dot-slash"),
    pytest.param("csv", "mine.csv/../../tenant_a/orders.csv", id="A-data-through-own-file"),
    pytest.param("csv", "sub/../../tenant_a/orders.csv", id="A-data-through-missing-folder"),
    pytest.param("csv", "../tenant_a/*.csv", id="glob-star"),
    pytest.param("csv", "../*/orders.csv", id="glob-any-tenant"),
    pytest.param("csv", "*/../../tenant_a/orders.csv", id="glob-then-dotdot"),
    pytest.param("csv", "**/orders.csv", id="glob-recursive"),
    pytest.param("csv", "{data}/*/orders.csv", id="glob-absolute"),
    pytest.param("csv", "../tenant_a/orders.[c]sv", id="glob-bracket"),
    pytest.param("csv", "../tenant_a/orders.cs?", id="glob-question"),
    pytest.param("csv", "{{mine,../tenant_a/orders}}.csv", id="glob-braces"),
    pytest.param("csv", "{root}/reference_a/ref.csv", id="A-granted-root"),
    pytest.param("parquet", "../../sinks/tenant_a/orders", id="A-parquet-sink-relative"),
    pytest.param("parquet", "{sinks}/tenant_a/orders", id="A-parquet-sink-absolute"),
    pytest.param("parquet", "{sinks}/tenant_a/orders/data", id="A-parquet-sink-data"),
    pytest.param("parquet", "{sinks}/tenant_a/*", id="A-parquet-sink-glob"),
    pytest.param("delta", "{sinks}/tenant_a/orders_delta", id="A-delta-sink-absolute"),
    pytest.param("delta", "../../sinks/tenant_a/orders_delta", id="A-delta-sink-relative"),
    pytest.param("delta", "{sinks}/tenant_a/orders_delta/_delta_log/../", id="A-delta-sink-dotdot"),
]


def _file_source(kind: str, path: str) -> dict[str, Any]:
    if kind == "csv":
        return {"t": {"kind": "csv", "path": path, "header": False, "delimiter": "|", "schema": {"s": "string"}}}
    return {"t": {"kind": kind, "path": path}}


@pytest.mark.parametrize("channel", ["cast-error", "publish"])
@pytest.mark.parametrize(("kind", "path"), OUTSIDE_PATHS)
def test_b_cannot_read_a_file_outside_its_tree(arena: Arena, kind: str, path: str, channel: str) -> None:
    """Proves CSV, Parquet and Delta sources on the server's `.env`, the SQLite database and its WAL, the
    log, the grants file, the secrets folder, the home folder, /proc/self/environ, A's data, A's granted
    root and A's sinks — relative, absolute, `..`, globs, URLs — are refused before recording, whether the
    step tries to leak them through a cast error or to publish them into B's own sink."""
    before = arena.run_count()
    column = "s" if kind == "csv" else "secret"
    if channel == "cast-error":
        body = document(_file_source(kind, fill(arena, path)), f"select cast(cast({column} as int) as varchar) as v "
                        "from t")  # fmt: skip
    else:
        body = document(_file_source(kind, fill(arena, path)), f"select cast({column} as varchar) as v from t",
                        target=sink(f"loot/file{label(path + kind)}"))  # fmt: skip
    assert_refused(arena, submit(arena, body), before)
    assert_loot_clean(arena)


ORACLE_PATHS = (
    "{cwd}/.env", "{cwd}/.no-such-file", "{cwd}/.dataflow", "{cwd}/.dataflow/dataflow.db", "{secrets}/A_FILE_SECRET",
    "{secrets}/NO_SUCH_SECRET", "/etc/passwd", "/etc/no-such-file", "/root", "../tenant_a/orders.csv",
    "../tenant_a/no-such.csv",
)


def test_a_refused_path_does_not_say_whether_it_exists_or_what_it_is(arena: Arena) -> None:
    """Proves every source path outside B's roots gets one and the same refusal, whether it exists or not
    and whether it is the platform database or the secrets folder: the refusal is no oracle for mapping
    the server's file system, locating the platform database or the secrets folder, or probing A's files."""
    by_message: dict[str, list[str]] = {}
    for path in ORACLE_PATHS:
        before = arena.run_count()
        source = {"t": {"kind": "csv", "path": fill(arena, path), "schema": {"s": "string"}}}
        message = assert_refused(arena, submit(arena, document(source, "select s as v from t")), before)
        by_message.setdefault(message, []).append(path)
    assert len(by_message) == 1, by_message


STEP_READS = [
    pytest.param("select content as v from read_text('.env')", id="read_text-cwd-dotenv"),
    pytest.param("select content as v from read_text('{cwd}/.env')", id="read_text-absolute"),
    pytest.param("select content as v from read_text('{data}/tenant_a/orders.csv')", id="read_text-A-data"),
    pytest.param("select cast(content as varchar) as v from read_blob('/proc/self/environ')", id="read_blob-environ"),
    pytest.param("select column0 as v from read_csv('.env', header=false)", id="read_csv-dotenv"),
    pytest.param("select cast(secret as varchar) as v from read_csv_auto('{data}/tenant_a/orders.csv')",
                 id="read_csv_auto-A-data"),
    pytest.param("select regexp_extract_all(content, 'a-key-[a-z0-9-]+')::varchar as v "
                 "from read_text('.dataflow/dataflow.db')", id="regexp-over-sqlite-db"),
    pytest.param("select cast(secret as varchar) as v from read_parquet('{sinks}/tenant_a/orders/**/*.parquet')",
                 id="read_parquet-A-sink"),
    pytest.param("select cast(secret as varchar) as v from delta_scan('{sinks}/tenant_a/orders_delta')",
                 id="delta_scan-A-sink"),
    pytest.param("select file as v from glob('{root}/**')", id="glob-listing"),
    pytest.param("select cast(cast(content as int) as varchar) as v from read_text('{cwd}/.env')",
                 id="cast-error-over-dotenv"),
    pytest.param("select string_agg(name || '=' || coalesce(value, ''), ';') as v from duckdb_settings()",
                 id="duckdb_settings"),
    pytest.param("select string_agg(coalesce(install_path, ''), ';') as v from duckdb_extensions()",
                 id="duckdb_extensions"),
    pytest.param("select cast(name as varchar) as v from duckdb_secrets()", id="duckdb_secrets"),
    pytest.param("select string_agg(coalesce(path, ''), ';') as v from duckdb_databases()", id="duckdb_databases"),
    pytest.param("select current_setting('home_directory') as v", id="home_directory"),
    pytest.param("select current_setting('secret_directory') as v", id="secret_directory"),
    pytest.param("select cast(s as varchar) as v from sqlite_scan('{cwd}/.dataflow/dataflow.db', 'dataflow_runs')",
                 id="sqlite_scan"),
    pytest.param("select cast(idempotency_key as varchar) as v from dataflow_runs", id="platform-table-name"),
    pytest.param("attach '{cwd}/.dataflow/dataflow.db' as p", id="attach"),
    pytest.param("copy (select 1) to '{root}/b-copy.csv'", id="copy-to"),
    pytest.param("install httpfs", id="install"),
    pytest.param("set enable_external_access = true", id="set-external-access"),
]


@pytest.mark.parametrize("sql", STEP_READS)
def test_b_steps_cannot_read_files_or_settings_directly(arena: Arena, sql: str) -> None:
    """Proves a step calling read_text/read_blob/read_csv/read_parquet/delta_scan/glob/sqlite_scan, or reading
    duckdb_settings/duckdb_extensions/duckdb_secrets (the home folder), ATTACH, COPY, INSTALL or SET, is
    refused or fails, and nothing it read reaches B: not the answer, not the error, not B's own sink."""
    before = arena.run_count()
    body = document(OWN_CSV, fill(arena, sql), target=sink(f"loot/step{label(sql)}"))
    run = refused_or_run(arena, submit(arena, body), before)
    if run is not None and run["status"] == "succeeded":
        # Only the engine's own catalog may answer (and what it says is scanned below); no file is read.
        assert "duckdb_" in sql or "current_setting" in sql, run
    assert_loot_clean(arena)
    assert not (arena.root / "b-copy.csv").exists()


OWN_FILE_ERRORS = [
    pytest.param("s\n{echo}-cast\n", {"s": "string"}, "select cast(cast(s as int) as varchar) as v from t",
                 id="cast-error"),
    pytest.param("a,b\n1,{echo}-ragged\n2\n", {"a": "int64", "b": "string"}, "select b as v from t",
                 id="ragged-csv"),
    pytest.param("a\n\udcff{echo}-utf8\n", {"a": "string"}, "select a as v from t", id="invalid-utf8"),
    pytest.param("{echo}-header=1\nx\n", None, "select * from t", id="header-as-output-column"),
    pytest.param("{echo}-header=1\nx\n", None, "select zz as v from t", id="header-as-candidate-binding"),
    pytest.param("{echo}-header=1\nx\n", {"zz": "string"}, "select zz as v from t", id="header-vs-declared-schema"),
]


@pytest.mark.parametrize(("content", "schema", "sql"), OWN_FILE_ERRORS)
def test_error_messages_never_quote_the_tenants_own_file_contents(
    arena: Arena, content: str, schema: dict[str, str] | None, sql: str
) -> None:
    """Proves a cast error, a ragged or non-UTF-8 CSV and a header line that is not the declared schema (the
    `.env` shape: `NAME=value` read as a column name) fail without quoting the file's bytes in the message
    (issue: CSV and engine errors echoed raw file bytes, the carrier of the `.env` leak)."""
    name = f"own{label(content + sql)}.csv"
    path = arena.data_root / TENANT_B / name
    path.write_bytes(content.format(echo=ECHO).encode("utf-8", "surrogateescape"))
    source = {"kind": "csv", "path": name, **({"schema": schema} if schema is not None else {})}
    before = arena.run_count()
    answer = submit(arena, document({"t": source}, sql))
    run = refused_or_run(arena, answer, before)
    assert run is None or run["status"] == "failed", run
    message = answer.json()["error"]["message"] if run is None else run["error_message"]
    assert ECHO not in message, message


# ---- sinks -----------------------------------------------------------------------------------------

SINK_ATTACKS = [
    pytest.param("parquet", "{root}/outside/loot", "append", "b_submitter", id="absolute-outside"),
    pytest.param("parquet", "{sinks}/tenant_a/orders", "append", "b_submitter", id="absolute-A-parquet"),
    pytest.param("delta", "{sinks}/tenant_a/orders_delta", "append", "b_submitter", id="absolute-A-delta"),
    pytest.param("parquet", "../tenant_a/orders", "append", "b_submitter", id="dotdot-A-parquet"),
    pytest.param("delta", "../tenant_a/orders_delta", "append", "b_submitter", id="dotdot-A-delta"),
    pytest.param("parquet", "x/../../tenant_a/orders", "append", "b_submitter", id="inner-dotdot-A-parquet"),
    pytest.param("parquet", "./../tenant_a/orders", "append", "b_submitter", id="dot-dotdot-A-parquet"),
    pytest.param("parquet", "..", "append", "b_submitter", id="sink-root-itself"),
    pytest.param("parquet", "../../server-cwd", "append", "b_submitter", id="dotdot-cwd"),
    pytest.param("parquet", "{cwd}/.dataflow", "append", "b_submitter", id="absolute-cwd-dataflow"),
    pytest.param("parquet", "../tenant_a/orders", "overwrite", "b_operator", id="overwrite-dotdot-A-parquet"),
    pytest.param("delta", "../tenant_a/orders_delta", "overwrite", "b_operator", id="overwrite-dotdot-A-delta"),
    pytest.param("delta", "{sinks}/tenant_a/orders_delta", "overwrite", "b_operator", id="overwrite-absolute-A-delta"),
    pytest.param("parquet", "{sinks}/tenant_a/orders", "overwrite", "b_operator", id="overwrite-absolute-A-parquet"),
    pytest.param("parquet", "orders", "overwrite", "b_submitter", id="submitter-overwrite-own"),
]


@pytest.mark.parametrize(("provider", "location", "mode", "token"), SINK_ATTACKS)
def test_b_cannot_write_outside_its_sink_tree(
    arena: Arena, provider: str, location: str, mode: str, token: str
) -> None:
    """Proves absolute and `..` locations (A's Parquet and Delta tables, the server's folders), appends and
    operator overwrites into A's locations, and a submitter's overwrite are refused before recording; nothing
    is created outside and A's rows, runs and evidence are intact."""
    if provider == "delta" and "delta" not in arena.notes["providers"]:
        provider = "parquet"  # deltalake is not installed: the same attack on Parquet (reported in the summary)
    before = arena.run_count()
    body = document(INLINE, f"select '{ECHO}-clobber' as v", target=sink(fill(arena, location), provider, mode))
    codes = ("permission_denied",) if location == "orders" else ("invalid_input", "permission_denied")
    assert_refused(arena, submit(arena, body, token=token), before, codes)
    assert not (arena.root / "outside").exists()
    assert_a_intact(arena)


@pytest.mark.parametrize(
    ("provider", "location", "mode", "token", "datasource"),
    [
        pytest.param("parquet", "orders", "append", "b_submitter", None, id="same-name-as-A-parquet"),
        pytest.param("delta", "orders_delta", "overwrite", "b_operator", None, id="operator-overwrite-own-delta"),
        pytest.param("delta", "orders_delta", "overwrite", "b_submitter", "a.replaceable",
                     id="overwrite-through-an-overwritable-datasource"),
        pytest.param("parquet", "..\\tenant_a\\orders", "append", "b_submitter", None, id="backslashes"),
        pytest.param("parquet", "%2e%2e/tenant_a/orders", "append", "b_submitter", None, id="percent-encoded"),
    ],
)
def test_b_writes_within_its_tree_never_reach_a(
    arena: Arena, provider: str, location: str, mode: str, token: str, datasource: str | None
) -> None:
    """Proves what B may publish lands under <sink-root>/tenant_b only: A's location names, an operator's
    overwrite, an overwrite through a datasource the platform declared overwritable, backslashes and
    percent-encoding leave A's rows and A's verified runs as they were."""
    if provider == "delta" and "delta" not in arena.notes["providers"]:
        provider = "parquet"
    if datasource == "a.replaceable" and not arena.notes.get("registered"):
        with arena.db.begin() as conn:
            registry.register_datasource(conn, "a.replaceable", provider, location, {"allow_overwrite": True})
        arena.notes["registered"] = True
    before = arena.run_count()
    body = document(INLINE, "select 'b-row' as v", target=sink(location, provider, mode, datasource))
    run = refused_or_run(arena, submit(arena, body, token=token), before)
    assert run is None or run["status"] == "succeeded", (run["error_code"], run["error_message"])
    assert_a_intact(arena)


# ---- the HTTP surface --------------------------------------------------------------------------------


def _big_json(size: int) -> bytes:
    """A JSON body of about ``size`` bytes that costs a parser many objects: a list of zeros."""
    count = size // 2
    return b'{"parameters": {"p": [' + b"0," * (count - 1) + b"0]}}"


def test_an_unauthenticated_24_mb_body_is_refused_before_it_is_read(arena: Arena) -> None:
    """Proves a 24 MB JSON body without a token answers 401 and the server's RSS grows by less than 50 MB
    (authentication precedes parsing), and a body over DATAFLOW_API_BODY_BYTES_MAX answers 413."""
    json_headers = {"Content-Type": "application/json"}
    warm = arena.b.request("POST", "/v1/runs", content=b"{}", headers=json_headers)
    assert warm.status_code == 401, warm.text
    before = arena.server.rss_bytes()
    body = _big_json(24 * MIB)
    for _ in range(2):
        answer = arena.b.request("POST", "/v1/runs", content=body, headers=json_headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "unauthenticated", answer.text
    grown = arena.server.rss_bytes() - before
    assert grown < RSS_GROWTH_MAX, f"the server's RSS grew by {grown / MIB:.0f} MB"
    runs_before = arena.run_count()
    too_large = arena.b.request("POST", "/v1/runs", token=arena.tokens["b_submitter"],
                                content=_big_json(hostile.BODY_BYTES_MAX + MIB), headers=json_headers)  # fmt: skip
    assert_refused(arena, too_large, runs_before, ("payload_too_large",))
    assert arena.server.rss_bytes() - before < RSS_GROWTH_MAX


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(b'{"definition": {"na', id="truncated"),
        pytest.param(b"{not json at all", id="malformed"),
        pytest.param(b'{"definition": 1, "definition": 2}', id="duplicate-keys"),
    ],
)
def test_a_bad_body_without_a_token_answers_401(arena: Arena, request_bytes: bytes) -> None:
    """Proves a truncated body (the connection left open, Content-Length larger than sent), a malformed
    one and one with duplicate keys answer 401 without a token: the body is never awaited nor parsed."""
    head = (b"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4096\r\n\r\n")  # fmt: skip
    raw = hostile.raw_exchange(arena.server.port, head + request_bytes, timeout_s=15)
    arena.b.keep_raw("POST /v1/runs (raw)", raw)
    assert raw.startswith(b"HTTP/1.1 401"), raw[:500]


@pytest.mark.parametrize(
    "cursor",
    [
        pytest.param(json.dumps([10**30, "x"]), id="huge-int"),
        pytest.param(json.dumps([-1, "x"]), id="negative"),
        pytest.param(json.dumps([1.5, "x"]), id="float"),
        pytest.param("[1e400, \"x\"]", id="infinite"),
        pytest.param(json.dumps([1, "x\u0000"]), id="nul"),
        pytest.param(json.dumps([1, "x", 3]), id="three-items"),
        pytest.param(json.dumps({"a": 1}), id="object"),
        pytest.param(json.dumps([True, "x"]), id="bool"),
        pytest.param(json.dumps([1, "x" * 500]), id="long-run-id"),
    ],
)
def test_crafted_cursors_answer_422(arena: Arena, cursor: str) -> None:
    """Proves a list cursor this server never issued (10**30, negative, float, infinite, NUL, wrong shape)
    answers 422 invalid_input, never 500, and the answer does not echo it."""
    encoded = base64.urlsafe_b64encode(cursor.encode()).decode().rstrip("=")
    answer = arena.b.request("GET", "/v1/runs", token=arena.tokens["b_submitter"], params={"cursor": encoded})
    assert answer.status_code == 422 and answer.json()["error"]["code"] == "invalid_input", answer.text
    assert encoded not in answer.text
    for raw in ("!!!", "%00", "a" * 10_000):
        bad = arena.b.request("GET", "/v1/runs", token=arena.tokens["b_submitter"], params={"cursor": raw})
        assert bad.status_code == 422, bad.text


def _login(arena: Arena, token: str) -> httpx.Response:
    form = arena.b.request("GET", "/ui/login")
    found = LOGIN_CSRF_FIELD.search(form.text)
    assert form.status_code == 200 and found is not None, form.text
    return arena.b.request("POST", "/ui/login", data={"token": token, "csrf": found.group(1)})


def test_terminal_escapes_in_bs_parameters_reach_no_operator_raw(arena: Arena) -> None:
    """Proves escape sequences, C1 and bidi characters in B's parameters and description, stored as given,
    are shown by the operator's `dataflow show` and `dataflow runs` (and B's web page) only as visible
    escapes: no ESC, C1, bidi or other active character in what the terminal or the browser receives."""
    parameters = {"note": {"type": "string"}}
    ok = submit(arena, document(INLINE, "select $note || s as v from t", parameters=parameters,
                                description=ESCAPES, name="b_escapes"), parameters={"note": ESCAPES})  # fmt: skip
    failed = submit(arena, document(INLINE, "select cast(cast($note as int) as varchar) as v from t",
                                    parameters=parameters, name="b_escapes"), parameters={"note": ESCAPES})  # fmt: skip
    assert ok.status_code == 201 and ok.json()["run"]["parameters"] == {"note": ESCAPES}, ok.text
    assert failed.status_code == 201, failed.text
    shown = []
    for run_id in (ok.json()["run"]["run_id"], failed.json()["run"]["run_id"]):
        result = arena.cli("show", run_id)
        assert result.code in (0, 1), result.output
        shown.append(result.stdout)
        assert "\\u202e" in result.stdout or "\\x9b" in result.stdout, "show did not render the parameter"
    for args in (("runs", "--tenant", TENANT_B), ("runs",), ("ops", "ledger")):
        result = arena.cli(*args)
        assert result.code == 0, result.output
        shown.append(result.stdout)
    for text in shown:
        assert hostile.terminal_active(text) == [], text
    assert _login(arena, arena.tokens["b_submitter"]).status_code == 303
    page = arena.b.request("GET", f"/ui/runs/{ok.json()['run']['run_id']}")
    assert page.status_code == 200, page.text
    assert hostile.terminal_active(page.text) == []


def test_healthz_names_no_database(arena: Arena) -> None:
    """Proves /healthz (no token) says only ok and the engine: not the URL, host, port, user or path."""
    answer = arena.b.request("GET", "/healthz")
    assert answer.status_code == 200 and answer.json()["status"] == "ok", answer.text
    for word in (arena.db_url, "127.0.0.1", str(arena.warehouse.server.port), "postgres@", str(arena.cwd),
                 "dataflow.db", "hostile_platform"):  # fmt: skip
        assert word not in answer.text, word


def test_pages_and_answers_carry_the_security_headers(arena: Arena) -> None:
    """Proves the login page, a logged-in page, an API answer, a 401 and a 404 send a CSP forbidding framing
    and scripts, X-Frame-Options DENY, nosniff and Cache-Control no-store."""
    assert _login(arena, arena.tokens["b_submitter"]).status_code == 303
    answers = [
        arena.b.request("GET", "/ui/login"),
        arena.b.request("GET", "/ui/runs"),
        arena.b.request("GET", "/v1/runs", token=arena.tokens["b_submitter"]),
        arena.b.request("GET", "/v1/runs"),
        arena.b.request("GET", "/no/such/page"),
    ]
    for answer in answers:
        headers = answer.headers
        policy = headers.get("content-security-policy", "")
        assert "frame-ancestors 'none'" in policy and "script-src 'none'" in policy, (answer.url, headers)
        assert headers.get("x-frame-options") == "DENY", answer.url
        assert headers.get("x-content-type-options") == "nosniff", answer.url
        assert "no-store" in headers.get("cache-control", ""), answer.url


def test_login_without_a_valid_csrf_token_is_refused(arena: Arena) -> None:
    """Proves POST /ui/login with B's valid token but no CSRF field, a forged one, or a field without its
    nonce cookie answers 403 and sets no session cookie."""
    token = arena.tokens["b_submitter"]
    with httpx.Client(base_url=arena.server.base_url, timeout=30) as fresh:
        bare = fresh.post("/ui/login", data={"token": token})
        form = fresh.get("/ui/login")
        forged = fresh.post("/ui/login", data={"token": token, "csrf": "0" * 64})
        found = LOGIN_CSRF_FIELD.search(form.text)
        assert found is not None
        fresh.cookies.clear()
        cookieless = fresh.post("/ui/login", data={"token": token, "csrf": found.group(1)})
    for answer in (bare, forged, cookieless):
        arena.b.keep("POST /ui/login", answer)
        assert answer.status_code == 403, answer.text
        assert "ddf_session" not in answer.headers.get("set-cookie", "")


ECHO_BODIES = [
    pytest.param({"definition": document(INLINE, "select s as v from t", parameters={"n": {"type": "int"}}),
                  "parameters": {"n": f"{ECHO}-param"}}, id="parameter-value"),
    pytest.param({"definition": document(INLINE, "select s as v from t", parameters={"n": {"type": "date"}}),
                  "parameters": {"n": f"{ECHO}-date"}}, id="date-parameter"),
    pytest.param({"definition": {**document(INLINE, "select s as v from t"), "name": f"{ECHO}!name"}}, id="name"),
    pytest.param({"definition": {**document(INLINE, "select s as v from t"), "version": f"{ECHO}-v"}}, id="version"),
    pytest.param({"definition": document({"t": {"kind": f"{ECHO}-kind", "path": "x"}}, "select 1 as v")},
                 id="source-kind"),
    pytest.param({"definition": document({"t": {"kind": "csv", "path": "x.csv", "delimiter": f"{ECHO}"}},
                                         "select 1 as v")}, id="delimiter"),
    pytest.param({"definition": document(INLINE, "select s as v from t", columns={"v": f"{ECHO}-type"})},
                 id="output-type"),
    pytest.param({"definition": document(INLINE, "select s as v from t", limits={"time_limit": f"{ECHO}-s"})},
                 id="time-limit"),
    pytest.param({"definition": document(INLINE, "select s as v from t", target=sink(f"../{ECHO}-loc"))},
                 id="target-location"),
    pytest.param({"definition": document(INLINE, "select s as v from t", target=sink("x", f"{ECHO}-provider"))},
                 id="target-provider"),
    pytest.param({"definition": document({"src": {"kind": "postgres", "dsn": f"postgresql://u:{ECHO}@h/d",
                                                  "query": "select 1"}}, "select 1 as v")}, id="plain-dsn"),
    pytest.param({"definition": document({"t": {"kind": "csv", "path": f"{ECHO}-missing.csv"}}, "select 1 as v")},
                 id="missing-path"),
    pytest.param({"definition": document(INLINE, f"select '{ECHO}-sql' as v frm t")}, id="step-sql-syntax"),
    # Not here: a binder error naming a column the step's own SQL spells ("… column "x" not found").
    # The SQL is the definition, which the tenant reads back anyway (/v1/definitions); engine messages
    # keep only quoted names found in the definition's own text, never names read from a file
    # (see [header-as-candidate-binding] below).
    pytest.param({"definition": document(warehouse(f"select '{ECHO}-pg' as v; select 1"), "select v from src")},
                 id="postgres-script"),
    pytest.param({"definition": document(INLINE, "select s as v from t"), "max_attempts": f"{ECHO}-n"},
                 id="max-attempts"),
    pytest.param({"definition_hash": f"sha256:{ECHO}"}, id="definition-hash"),
]


@pytest.mark.parametrize("payload", ECHO_BODIES)
def test_error_messages_do_not_echo_bs_values(arena: Arena, payload: dict[str, Any]) -> None:
    """Proves every refusal of an invalid parameter value, definition field, path, SQL, DSN or hash names
    the field and not the value B submitted (a marker inside each value never comes back)."""
    before = arena.run_count()
    answer = arena.b.request("POST", "/v1/runs", token=arena.tokens["b_submitter"], json=payload)
    run = refused_or_run(arena, answer, before)
    # A recorded run shows B its own definition and parameters back; only its error must not repeat them.
    message = answer.json()["error"]["message"] if run is None else (run["error_message"] or "")
    assert ECHO not in message, message


def test_an_idempotency_conflict_does_not_echo_the_key(arena: Arena) -> None:
    """Proves the 409 for a key reused with another request does not repeat the key B sent."""
    key = f"{ECHO}-key-{hostile.hexid()}"
    first = submit(arena, document(INLINE, "select s as v from t"), key=key)
    assert first.status_code == 201, first.text
    second = submit(arena, document(INLINE, "select s || 'x' as v from t"), key=key)
    assert second.status_code == 409, second.text
    assert key not in second.text and ECHO not in second.text, second.text


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param('{{"definition": {doc}, "definition": {doc}}}', id="top-level"),
        pytest.param('{{"definition": {dup}}}', id="inside-the-definition"),
        pytest.param('{{"definition": {doc}, "parameters": {{"n": 1, "n": 2}}}}', id="parameters"),
    ],
)
def test_duplicate_json_keys_are_refused(arena: Arena, raw: str) -> None:
    """Proves a body with a duplicate key (top level, inside the definition, in the parameters) is refused
    before recording, instead of silently taking one of the values."""
    doc = json.dumps(document(INLINE, "select s as v from t"))
    dup = doc[:-1] + ', "name": "other_name"}'
    before = arena.run_count()
    answer = arena.b.request("POST", "/v1/runs", token=arena.tokens["b_submitter"],
                             content=raw.format(doc=doc, dup=dup).encode(),
                             headers={"Content-Type": "application/json"})  # fmt: skip
    assert_refused(arena, answer, before)


# ---- another tenant's runs ------------------------------------------------------------------------------


def test_b_cannot_reach_as_runs_or_definitions(arena: Arena) -> None:
    """Proves A's runs, evidence and web pages answer 404 to B, reconciling them (as B's operator) too, a
    submission by A's definition hash is not_found, and B's filtered listing and Ops projection show none."""
    b_token, b_operator = arena.tokens["b_submitter"], arena.tokens["b_operator"]
    assert _login(arena, b_token).status_code == 303
    for run in arena.a_runs.values():
        run_id = run["run_id"]
        for path in (f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/evidence"):
            assert arena.b.request("GET", path, token=b_token).status_code == 404
        assert arena.b.request("POST", f"/v1/runs/{run_id}/reconcile", token=b_operator).status_code == 404
        assert arena.b.request("GET", f"/ui/runs/{run_id}").status_code == 404
        before = arena.run_count()
        by_hash = arena.b.request("POST", "/v1/runs", token=b_token, json={"definition_hash": run["definition_hash"]})
        assert_refused(arena, by_hash, before, ("not_found",))
    listed = arena.b.request("GET", "/v1/runs", token=b_token, params={"definition": "a_orders_parquet"})
    assert listed.status_code == 200 and listed.json()["runs"] == [], listed.text
    ops = arena.b.request("GET", "/v1/ops/ledger", token=b_operator)
    assert ops.status_code == 200 and TENANT_A not in ops.text, ops.text
    assert arena.b.request("GET", "/v1/ops/ledger", token=b_token).status_code == 403
    metrics = arena.b.request("GET", "/metrics", token=b_operator)
    assert metrics.status_code == 200 and TENANT_A not in metrics.text


# ---- after every attack ---------------------------------------------------------------------------------


def _harvest(arena: Arena) -> None:
    """Everything B can still read: its runs (every page), each run and its evidence, its definitions,
    the datasources, its Ops projection, its web pages (recorded like every other answer)."""
    b_token = arena.tokens["b_submitter"]
    cursor: str | None = None
    run_ids: list[str] = []
    while True:  # ends: each page moves the cursor back in time, the last has no next_cursor
        params = {"limit": 200, **({"cursor": cursor} if cursor else {})}
        page = arena.b.request("GET", "/v1/runs", token=b_token, params=params)
        assert page.status_code == 200, page.text
        run_ids += [r["run_id"] for r in page.json()["runs"]]
        cursor = page.json()["next_cursor"]
        if not cursor:
            break
    for run_id in run_ids:
        assert arena.b.request("GET", f"/v1/runs/{run_id}", token=b_token).status_code == 200
        assert arena.b.request("GET", f"/v1/runs/{run_id}/evidence", token=b_token).status_code == 200
    for path in ("/v1/definitions", "/v1/datasources"):
        assert arena.b.request("GET", path, token=b_token).status_code == 200
    arena.b.request("GET", "/v1/ops/ledger", token=arena.tokens["b_operator"])
    assert _login(arena, b_token).status_code == 303
    arena.b.request("GET", "/ui/runs")
    for run_id in run_ids[:20]:
        arena.b.request("GET", f"/ui/runs/{run_id}")


def test_zz_nothing_b_received_or_can_read_holds_a_canary(arena: Arena) -> None:
    """Proves, after every attack above, no canary (the `.env` secret, the database URL, the evidence key,
    A's keys, parameters, rows, files, grants and tokens, the secrets folder, the ungranted variable, the
    warehouse column, the service user's home) is in any answer or header B received, nor in what B can read
    later: its runs (every page), each run and its evidence, its definitions, the datasources, its Ops
    projection and web pages, its own data and sink trees, and the stored results of its runs."""
    _harvest(arena)
    leaks: dict[str, list[tuple[list[str], str]]] = {}
    for exchange in arena.b.received:
        found = hostile.canaries_in(exchange.headers + "\n" + exchange.body, arena.canaries)
        if found:
            leaks.setdefault(exchange.what, []).append((found, exchange.body[:800]))
    for tree in arena.b_trees:
        found = hostile.canaries_in(hostile.readable_text(tree), arena.canaries)
        if found:
            leaks[str(tree)] = [(found, "")]
    found = hostile.canaries_in(hostile.stored_results_text(arena.db, TENANT_B), arena.canaries)
    if found:
        leaks["stored results of B's runs"] = [(found, "")]
    assert not leaks, leaks


def test_zz_no_file_appeared_or_changed_outside_bs_trees(arena: Arena) -> None:
    """Proves every file and folder of the scene (the server's working directory, the data and sink roots
    but B's own subtrees, the secrets folder, the home folder, the server's temporary folder, the grants
    file) is exactly as before the attacks: nothing was created, changed or removed."""
    before, after = arena.baseline["files"], arena.files()
    changed = {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert not changed, changed


def test_zz_no_table_role_or_token_appeared(arena: Arena) -> None:
    """Proves no table, view, sequence, function, schema or large object appeared in the platform database
    or the warehouse, the warehouse rows are unchanged, no role appeared in the cluster, and
    `dataflow tokens list --json` lists exactly the tokens made before the attacks."""
    assert arena.platform_objects() == arena.baseline["platform_objects"]
    assert arena.warehouse.objects() == arena.baseline["warehouse_objects"]
    assert arena.warehouse.rows() == arena.baseline["warehouse_rows"]
    assert hostile.roles_now(arena) == arena.baseline["roles"]
    assert hostile.tokens_listed(arena.cli) == arena.baseline["tokens"]


def test_zz_as_published_data_is_intact_and_its_runs_verify(arena: Arena) -> None:
    """Proves, after every attack, A's Parquet and Delta rows read directly from its sinks are the rows A
    published, and each of A's runs is still succeeded / verified with evidence that verifies (as A)."""
    assert_a_intact(arena)
