"""The hostile-tenant harness (tests/integration/test_hostile_tenant.py): a real `dataflow serve`
subprocess over a platform database, two tenants with CLI-made tokens, canaries planted wherever a
tenant must never reach, a warehouse database on the test cluster, and the recorder of everything
the attacking tenant received.

Nothing here asserts an attack's outcome; it builds the scene and gathers the evidence.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import unicodedata
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import sqlalchemy as sa
import yaml
from psycopg import sql

from support.cli import SCRUBBED_ENV, Cli, make_cli
from support.pg import PostgresServer

SERVER_START_S = 60.0
SERVER_STOP_S = 20.0
POLL_S = 0.05
HTTP_TIMEOUT_S = 120.0
LISTENING = re.compile(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)")
TENANT_A = "tenant_a"
TENANT_B = "tenant_b"
# A body limit above the 24 MB attack, so that attack proves authentication precedes parsing (401)
# rather than the limit (413); a larger body proves the limit.
BODY_BYTES_MAX = 32 * 1024 * 1024
# Characters a terminal or a page would act on: C0 but tab and newline, DEL, C1, bidi, separators.
_BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u2028\u2029"
TERMINAL_ACTIVE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")


def hexid() -> str:
    return uuid.uuid4().hex[:12]


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


# ---- the server process ------------------------------------------------------------------------


@dataclass
class ServerProcess:
    """`dataflow serve` running as a subprocess; its log (stdout and stderr) goes to ``log_path``."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_bytes(self) -> int:
        """The server's resident set size (VmRSS of /proc/<pid>/status)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc/<pid>/status")

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=SERVER_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=SERVER_STOP_S)


def start_server(args: list[str], *, cwd: Path, env: Mapping[str, str], log_path: Path) -> ServerProcess:
    """Start ``python -m durable_dataflow.cli ARGS`` and wait (bounded) until uvicorn says where it listens."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "durable_dataflow.cli", *args], cwd=cwd, env=dict(env), stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    deadline = time.monotonic() + SERVER_START_S
    while True:
        found = LISTENING.search(log_path.read_bytes())
        if found is not None:
            return ServerProcess(proc, int(found.group(1)), log_path)
        if proc.poll() is not None:
            raise AssertionError(f"dataflow serve exited {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"dataflow serve did not listen within {SERVER_START_S}s")
        time.sleep(POLL_S)


# ---- what the attacker received ----------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """One answer the attacker got: what it asked, the status, every header and the body."""

    what: str
    status: int
    headers: str
    body: str


class Recorder:
    """An HTTP client for the attacking tenant that keeps every answer it receives."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.client = httpx.Client(base_url=base_url, timeout=HTTP_TIMEOUT_S, follow_redirects=False)
        self.received: list[Exchange] = []

    def request(self, method: str, url: str, *, token: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = dict(kwargs.pop("headers", None) or {})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        response = self.client.request(method, url, headers=headers, **kwargs)
        self.keep(f"{method} {url}", response)
        return response

    def keep(self, what: str, response: httpx.Response) -> None:
        headers = "\n".join(f"{k}: {v}" for k, v in response.headers.multi_items())
        self.received.append(Exchange(what, response.status_code, headers, response.text))

    def keep_raw(self, what: str, raw: bytes) -> None:
        head, _, body = raw.partition(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0].split()
        status = int(status_line[1]) if len(status_line) > 1 and status_line[1].isdigit() else 0
        self.received.append(Exchange(what, status, head.decode("latin-1"), body.decode("utf-8", "replace")))

    def close(self) -> None:
        self.client.close()


def raw_exchange(port: int, request: bytes, timeout_s: float = 30.0) -> bytes:
    """Send raw bytes and read the answer until its body is complete, the peer closes or time runs out.

    The connection stays open for writing: a truncated body is still awaited by a server that reads it.
    """
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            data = b"".join(chunks)
            head, sep, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if sep and length is not None and len(body) >= int(length.group(1)):
                break
    return b"".join(chunks)


def canaries_in(text: str, canaries: Mapping[str, str]) -> list[str]:
    """The names of the canaries ``text`` contains (case-insensitively)."""
    folded = text.casefold()
    return sorted(name for name, value in canaries.items() if value.casefold() in folded)


def terminal_active(text: str) -> list[str]:
    """Every character of ``text`` a terminal or a page would act on, as its code point name."""
    return sorted({f"U+{ord(c):04X} {unicodedata.name(c, 'control')}" for c in TERMINAL_ACTIVE.findall(text)})


# ---- files, tables, tokens -----------------------------------------------------------------------


def tree_snapshot(root: Path, skip: tuple[Path, ...]) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root`` but ``skip``'s subtrees: files with size and mtime, links with targets."""
    found: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip]
        for name in [*dirnames, *filenames]:
            path = here / name
            if path in skip:
                continue
            stat = path.lstat()
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = ("link", os.readlink(path))
            elif path.is_dir():
                found[key] = ("dir",)
            else:
                found[key] = ("file", stat.st_size, stat.st_mtime_ns)
    return found


def readable_text(folder: Path) -> str:
    """What a tenant can read in one of its own trees: Parquet files as their values, others as text."""
    parts: list[str] = []
    for path in sorted(folder.rglob("*")) if folder.exists() else []:
        if path.is_symlink() or not path.is_file():
            parts.append(str(path))
            continue
        data = path.read_bytes()
        parts.append(f"{path}\n{data.decode('latin-1')}")
        if path.suffix == ".parquet":
            with contextlib.suppress(Exception):  # a partial or foreign file: its raw bytes are kept above
                parts.append(json.dumps(pq.read_table(path).to_pylist(), default=str))
    return "\n".join(parts)


def stored_results_text(engine: sa.Engine, tenant: str) -> str:
    """The stored results of a tenant's runs, decoded (what the tenant computed, whether or not it got it)."""
    query = sa.text(
        "SELECT r.bytes FROM run_results r JOIN dataflow_runs d ON d.run_id = r.run_id WHERE d.tenant = :tenant"
    )
    parts = []
    with engine.connect() as conn:
        for (data,) in conn.execute(query, {"tenant": tenant}):
            table = ipc.open_stream(pa.py_buffer(bytes(data))).read_all()
            parts.append(json.dumps(table.to_pylist(), default=str))
    return "\n".join(parts)


def sqlite_objects(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return {f"{t}:{n}" for t, n in conn.execute(sa.text("SELECT type, name FROM sqlite_master"))}


PG_OBJECTS = """
SELECT c.relkind::text || ':' || n.nspname || '.' || c.relname FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%'
UNION ALL
SELECT 'function:' || n.nspname || '.' || p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
UNION ALL
SELECT 'schema:' || nspname FROM pg_namespace
UNION ALL
SELECT 'large_object:' || oid::text FROM pg_largeobject_metadata
"""


def pg_objects(connect: Callable[[], psycopg.Connection[Any]]) -> set[str]:
    with connect() as conn:
        return {str(row[0]) for row in conn.execute(PG_OBJECTS)}


def tokens_listed(cli: Cli) -> list[dict[str, Any]]:
    listed = cli("tokens", "list", "--json")
    assert listed.code == 0, listed.output
    return [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]


# ---- the scene -----------------------------------------------------------------------------------


@dataclass
class Warehouse:
    """A PostgreSQL database beside the platform's, reached by tenant B through a granted DSN of a
    least-privilege role that may nevertheless write table ``t`` (only the source must stop it)."""

    server: PostgresServer
    name: str
    role: str
    dsn: str  # the granted DSN (libpq form, with the role's password)

    def admin(self) -> psycopg.Connection[Any]:
        return self.server.connect(self.name)

    def rows(self) -> list[tuple[Any, ...]]:
        with self.admin() as conn:
            return list(conn.execute("SELECT id, secret_col FROM t ORDER BY id").fetchall())

    def objects(self) -> set[str]:
        return pg_objects(self.admin)


@dataclass
class Arena:
    """Everything one engine's hostile-tenant module needs; built by :func:`arena`."""

    engine: str
    root: Path
    cwd: Path
    data_root: Path
    sink_root: Path
    secrets_dir: Path
    home: Path
    db_url: str
    server: ServerProcess
    cli: Cli
    warehouse: Warehouse
    db: sa.Engine
    tokens: dict[str, str]
    canaries: dict[str, str]
    b: Recorder
    a: httpx.Client
    a_runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    a_rows: list[dict[str, Any]] = field(default_factory=list)
    baseline: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    platform_objects: Callable[[], set[str]] = set

    @property
    def b_trees(self) -> tuple[Path, Path]:
        return (self.data_root / TENANT_B, self.sink_root / TENANT_B)

    def run_count(self) -> int:
        with self.db.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM dataflow_runs")).scalar_one())

    def files(self) -> dict[str, tuple[Any, ...]]:
        """Every file of the scene but the attacker's own trees and the SQLite database's own files."""
        skip = [*self.b_trees, self.server.log_path]
        skip += [self.cwd / ".dataflow" / f"dataflow.db{suffix}" for suffix in ("", "-wal", "-shm", "-journal")]
        return tree_snapshot(self.root, tuple(skip))


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _warehouse(server: PostgresServer, tag: str, password: str, canary: str) -> Warehouse:
    name, role = f"hostile_wh_{tag}", f"hostile_b_{tag}"
    server.create_database(name)
    with server.connect("postgres") as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), sql.Literal(password)))
        conn.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(name), sql.Identifier(role)))
    with server.connect(name) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, secret_col text NOT NULL)")
        conn.execute("INSERT INTO t VALUES (1, %s), (2, %s)", [f"{canary}-1", f"{canary}-2"])
        conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON t TO {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT USAGE, CREATE ON SCHEMA public TO {}").format(sql.Identifier(role)))
    dsn = f"postgresql://{role}:{password}@127.0.0.1:{server.port}/{name}"
    return Warehouse(server, name, role, dsn)


def _drop_warehouse(warehouse: Warehouse) -> None:
    warehouse.server.drop_database(warehouse.name)
    with warehouse.server.connect("postgres") as conn:
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(warehouse.role)))


def a_publication(provider: str, location: str) -> dict[str, Any]:
    """Tenant A's definition: its own CSV plus a parameter, published to its own sink."""
    return {
        "name": f"a_orders_{provider}", "version": 1,
        "parameters": {"note": {"type": "string"}},
        "sources": {"orders": {"kind": "csv", "path": "orders.csv", "schema": {"id": "int64", "secret": "string"}}},
        "steps": [{"name": "r", "sql": "select id, secret, $note as note from orders order by id"}],
        "output": {"schema": {"id": "int64", "secret": "string", "note": "string"}, "max_rows": 10,
                   "max_bytes": "1MiB"},
        "target": {"type": "datasources.publication", "provider": provider, "datasource": f"a.orders_{provider}",
                   "location": location, "mode": "append"},
    }  # fmt: skip


def published_rows(arena: Arena, provider: str) -> list[dict[str, Any]]:
    """Tenant A's published rows, read directly from its sink (not through the platform)."""
    columns = ["id", "secret", "note"]
    if provider == "parquet":
        files = sorted((arena.sink_root / TENANT_A / "orders" / "data").rglob("*.parquet"))
        tables = [pq.read_table(f).select(columns) for f in files]
        return sorted(pa.concat_tables(tables).to_pylist(), key=lambda r: r["id"]) if tables else []
    import deltalake

    table = deltalake.DeltaTable(str(arena.sink_root / TENANT_A / "orders_delta"))
    return sorted(table.to_pyarrow_table().select(columns).to_pylist(), key=lambda r: r["id"])


def delta_available() -> bool:
    try:
        import deltalake  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def arena(engine: str, root: Path, postgres: PostgresServer) -> Iterator[Arena]:
    """Build the scene for one platform engine, start the server, let tenant A publish, take the baseline."""
    tag = hexid()
    canaries = {
        "dotenv": f"cnry-dotenv-{tag}", "evidence_key": f"cnry-evkey-{tag}", "ungranted_env": f"cnry-ungranted-{tag}",
        "a_grant_env": f"cnry-agrant-{tag}", "a_grant_file": f"cnry-agrantfile-{tag}",
        "loose_file": f"cnry-loosefile-{tag}", "b_dsn_password": f"cnry-bdsnpw-{tag}", "a_key": f"a-key-cnry-{tag}",
        "a_param": f"cnry-aparam-{tag}", "a_file": f"cnry-afile-{tag}", "a_reference": f"cnry-aref-{tag}",
        "warehouse": f"cnry-wh-{tag}", "home": f"home-cnry-{tag}", "netrc": f"cnry-netrc-{tag}",
        "etc_passwd": "root:x:0:0:",
    }  # fmt: skip
    cwd, data_root, sink_root = root / "server-cwd", root / "data", root / "sinks"
    secrets_dir, home, reference = root / "secrets", root / canaries["home"], root / "reference_a"
    for folder in (cwd, data_root / TENANT_B, sink_root, secrets_dir, home, reference, root / "server-tmp"):
        folder.mkdir(parents=True, exist_ok=True)
    _write(cwd / ".env", f"WAREHOUSE_ROOT_PASSWORD={canaries['dotenv']}\nDATAFLOW_EVIDENCE_KEY={canaries['dotenv']}\n")
    _write(home / ".netrc", f"machine warehouse login root password {canaries['netrc']}\n")
    _write(secrets_dir / "A_FILE_SECRET", canaries["a_grant_file"])
    _write(secrets_dir / "LOOSE_SECRET", canaries["loose_file"])
    _write(data_root / TENANT_A / "orders.csv", f"id,secret\n1,{canaries['a_file']}-1\n2,{canaries['a_file']}-2\n")
    _write(reference / "ref.csv", f"s\n{canaries['a_reference']}\n")
    _write(data_root / TENANT_B / "mine.csv", "s\nb-own-row\n")
    _write(data_root / TENANT_B / "digits.csv", "s\n41\n")
    with contextlib.ExitStack() as cleanup:
        warehouse = _warehouse(postgres, tag, canaries["b_dsn_password"], canaries["warehouse"])
        cleanup.callback(_drop_warehouse, warehouse)
        platform_db = f"hostile_platform_{tag}"
        if engine == "sqlite":
            db_url = f"sqlite:///{cwd}/.dataflow/dataflow.db"
            canaries["db_url"] = db_url
        else:
            postgres.create_database(platform_db)
            cleanup.callback(postgres.drop_database, platform_db)
            db_url = f"postgresql+psycopg://postgres:cnry-dbpw-{tag}@127.0.0.1:{postgres.port}/{platform_db}"
            canaries["db_password"] = f"cnry-dbpw-{tag}"
            canaries["db_name"] = platform_db
        grants = {
            "secrets": {
                "WAREHOUSE_DSN": {"tenants": [TENANT_B]},
                "A_WAREHOUSE_DSN": {"tenants": [TENANT_A]},
                "A_FILE_SECRET": {"file": "A_FILE_SECRET", "tenants": [TENANT_A]},
            },
            "data_roots": [{"path": str(reference), "tenants": [TENANT_A]}],
        }
        grants_path = _write(root / "grants.yaml", yaml.safe_dump(grants))
        platform_env = {
            "DATAFLOW_EVIDENCE_KEY": canaries["evidence_key"], "DATAFLOW_GRANTS": str(grants_path),
            "DATAFLOW_SECRETS_DIR": str(secrets_dir),
        }  # fmt: skip
        server_env = {
            **{k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}, **platform_env, "DATAFLOW_DB": db_url,
            "DATAFLOW_API_BODY_BYTES_MAX": str(BODY_BYTES_MAX), "HOME": str(home), "TMPDIR": str(root / "server-tmp"),
            "UNGRANTED_API_KEY": canaries["ungranted_env"],
            "A_WAREHOUSE_DSN": f"postgresql://a_user:{canaries['a_grant_env']}@127.0.0.1:1/a",
            "WAREHOUSE_DSN": warehouse.dsn,
        }  # fmt: skip
        plain = make_cli(db_url, cwd)
        cli = Cli(db_url=plain.db_url, cwd=plain.cwd, env={**plain.env, **platform_env})
        tokens: dict[str, str] = {}
        for label, args in (("a_submitter", ("--tenant", TENANT_A, "--role", "submitter")),
                            ("a_operator", ("--tenant", TENANT_A, "--role", "operator")),
                            ("b_submitter", ("--tenant", TENANT_B, "--role", "submitter")),
                            ("b_operator", ("--tenant", TENANT_B, "--role", "operator")),
                            ("platform", ("--platform",))):  # fmt: skip
            made = cli("tokens", "create", *args, "--name", label)
            assert made.code == 0 and made.stdout.strip(), made.output
            tokens[label] = made.stdout.strip()
        for label in ("a_submitter", "a_operator", "platform"):
            canaries[f"token_{label}"] = tokens[label]
        server = start_server(
            ["--db", db_url, "serve", "--port", "0", "--data-root", str(data_root), "--sink-root", str(sink_root)],
            cwd=cwd, env=server_env, log_path=root / "server.log",
        )  # fmt: skip
        cleanup.callback(server.stop)
        db = sa.create_engine(db_url)
        cleanup.callback(db.dispose)
        b = Recorder(server.base_url)
        cleanup.callback(b.close)
        a = httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S,
                         headers={"Authorization": f"Bearer {tokens['a_submitter']}"})  # fmt: skip
        cleanup.callback(a.close)
        scene = Arena(
            engine=engine, root=root, cwd=cwd, data_root=data_root, sink_root=sink_root, secrets_dir=secrets_dir,
            home=home, db_url=db_url, server=server, cli=cli, warehouse=warehouse, db=db, tokens=tokens,
            canaries=canaries, b=b, a=a,
        )  # fmt: skip
        if engine == "sqlite":
            scene.platform_objects = lambda: sqlite_objects(db)
        else:
            scene.platform_objects = lambda: pg_objects(lambda: postgres.connect(platform_db))
        _tenant_a_publishes(scene)
        scene.baseline = {
            "files": scene.files(), "platform_objects": scene.platform_objects(),
            "warehouse_objects": warehouse.objects(), "warehouse_rows": warehouse.rows(),
            "tokens": tokens_listed(cli), "roles": _roles(postgres),
        }  # fmt: skip
        yield scene


def _roles(postgres: PostgresServer) -> set[str]:
    with postgres.connect("postgres") as conn:
        return {str(r[0]) for r in conn.execute("SELECT rolname FROM pg_roles")}


def roles_now(arena: Arena) -> set[str]:
    return _roles(arena.warehouse.server)


def _tenant_a_publishes(scene: Arena) -> None:
    """Tenant A publishes its rows to Parquet and (if deltalake is installed) Delta, and reads its granted
    reference root; every run must succeed and verify, or the suite would prove nothing."""
    note, key = scene.canaries["a_param"], scene.canaries["a_key"]
    providers = ["parquet", "delta"] if delta_available() else ["parquet"]
    scene.notes["providers"] = providers
    for provider in providers:
        location = "orders" if provider == "parquet" else "orders_delta"
        answer = scene.a.post("/v1/runs", json={"definition": a_publication(provider, location),
                                                "parameters": {"note": note}},
                              headers={"Idempotency-Key": f"{key}-{provider}"})  # fmt: skip
        assert answer.status_code == 201, answer.text
        run = answer.json()["run"]
        assert (run["status"], run["recovery_status"]) == ("succeeded", "verified"), run
        scene.a_runs[provider] = run
    reference = {
        "name": "a_reference", "version": 1,
        "sources": {"ref": {"kind": "csv", "path": str(scene.root / "reference_a" / "ref.csv"),
                            "schema": {"s": "string"}}},
        "steps": [{"name": "r", "sql": "select s from ref"}],
        "output": {"schema": {"s": "string"}, "max_rows": 10, "max_bytes": "1MiB"},
    }  # fmt: skip
    answer = scene.a.post("/v1/runs", json={"definition": reference}, headers={"Idempotency-Key": f"{key}-ref"})
    assert answer.status_code == 201 and answer.json()["run"]["status"] == "succeeded", answer.text
    scene.a_runs["reference"] = answer.json()["run"]
    scene.a_rows = [{"id": i, "secret": f"{scene.canaries['a_file']}-{i}", "note": note} for i in (1, 2)]
    for provider in providers:
        assert published_rows(scene, provider) == scene.a_rows, provider
