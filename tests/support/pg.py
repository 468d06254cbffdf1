"""A throwaway PostgreSQL cluster for the test suite.

One cluster per pytest session: initdb into a temporary directory, a free loopback port, trust
authentication for the `postgres` role, fsync off. Tests get a fresh database each from
`create_database`. Fault tests use `restart("immediate")`, `stop()` and `start()`.

When the session runs as root, initdb and pg_ctl run as the `postgres` OS user (initdb refuses
root). A session that dies without tearing down (SIGKILL) leaves its cluster behind; the next
session reaps it (`reap_orphans`), since every cluster directory records the pid that owns it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

# Prefix of every cluster directory, so orphans of killed sessions can be found and reaped.
CLUSTER_DIR_PREFIX = "dataflow-pg-"
OWNER_FILE = "owner.pid"
# pg_ctl -w waits at most this long for start, stop or restart (crash recovery included).
PG_CTL_WAIT_S = 60
# A hung pg_ctl or initdb is killed after this long, so the session fails instead of hanging.
COMMAND_TIMEOUT_S = 120
# Another process may take the free port between our probe and the server's bind: try again.
START_ATTEMPT_MAX = 3
# Lines of the server log quoted in a failure message.
LOG_TAIL_LINES = 40
CONNECT_TIMEOUT_S = 5
TOOLS = ("initdb", "pg_ctl", "postgres")
DB_NAME_PATTERN = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresUnavailable(Exception):
    """The cluster could not be found or started; `log_path` holds the server log, if any."""

    def __init__(self, reason: str, log_path: Path | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.log_path = log_path

    def describe(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return self.reason
        tail = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return f"{self.reason}\nserver log: {self.log_path}\n" + "\n".join(tail)


def _has_tools(bindir: Path) -> bool:
    return all(os.access(bindir / tool, os.X_OK) for tool in TOOLS)


def find_bindir() -> Path | None:
    """Directory holding initdb, pg_ctl and postgres, or None.

    Looked up in order: $DATAFLOW_PG_BINDIR, PATH (symlinks resolved, since pg_ctl looks for
    postgres beside its real self), `pg_config --bindir`, then /usr/lib/postgresql/*/bin
    (highest version first).
    """
    candidates: list[Path] = []
    if override := os.environ.get("DATAFLOW_PG_BINDIR"):
        candidates.append(Path(override))
    if initdb := shutil.which("initdb"):
        candidates.append(Path(os.path.realpath(initdb)).parent)
    if pg_config := shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            )
            candidates.append(Path(out.stdout.strip()))

    def version(path: str) -> int:
        match = re.search(r"/postgresql/(\d+)/", path)
        return int(match.group(1)) if match else 0

    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)
    candidates.extend(Path(p) for p in debian)
    return next((c for c in candidates if _has_tools(c)), None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class _RunAs:
    """How to run a PostgreSQL binary: directly, or as the `postgres` OS user when we are root."""

    prefix: tuple[str, ...]
    uid: int | None
    gid: int | None

    @staticmethod
    def detect() -> _RunAs:
        if os.geteuid() != 0:
            return _RunAs(prefix=(), uid=None, gid=None)
        import pwd

        try:
            entry = pwd.getpwnam("postgres")
        except KeyError as exc:
            raise PostgresUnavailable(
                "running as root, but there is no 'postgres' OS user to run initdb as "
                "(installing the postgresql package creates it)"
            ) from exc
        runuser = shutil.which("runuser")
        prefix = (runuser, "-u", "postgres", "--") if runuser else ("su", "postgres", "-s", "/bin/sh", "-c")
        return _RunAs(prefix=prefix, uid=entry.pw_uid, gid=entry.pw_gid)

    def command(self, argv: list[str]) -> list[str]:
        if self.prefix and self.prefix[0] == "su":
            import shlex

            return [*self.prefix, shlex.join(argv)]
        return [*self.prefix, *argv]

    def chown(self, path: Path) -> None:
        if self.uid is not None and self.gid is not None:
            os.chown(path, self.uid, self.gid)


class PostgresServer:
    """A running throwaway cluster. Create with `PostgresServer.launch(...)`; end with `destroy()`."""

    def __init__(self, bindir: Path, root: Path, run_as: _RunAs) -> None:
        self.bindir = bindir
        self.root = root
        self.port = 0
        self._run_as = run_as

    # -- paths and URLs ------------------------------------------------------------------------
    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    @property
    def admin_url(self) -> str:
        return self.url("postgres")

    def url(self, dbname: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{dbname}"

    # -- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def launch(cls, bindir: Path | None = None) -> PostgresServer:
        """initdb a new cluster in a temporary directory and start it; raises PostgresUnavailable."""
        found = bindir or find_bindir()
        if found is None:
            raise PostgresUnavailable(
                "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found on PATH, via "
                "pg_config or in /usr/lib/postgresql/*/bin; run scripts/install-system-deps.sh as root"
            )
        run_as = _RunAs.detect()
        # Root's pytest temp dirs are private (0700); the postgres user must reach its cluster.
        base = "/tmp" if run_as.uid is not None else None
        root = Path(tempfile.mkdtemp(prefix=CLUSTER_DIR_PREFIX, dir=base))
        (root / OWNER_FILE).write_text(str(os.getpid()))
        run_as.chown(root)
        server = cls(found, root, run_as)
        try:
            server._initdb()
            server._start_on_free_port()
        except BaseException:
            server.destroy()
            raise
        return server

    def _initdb(self) -> None:
        self._pg(
            "initdb", "-D", str(self.data_dir), "-U", "postgres", "--auth=trust",
            "--encoding=UTF8", "--locale=C", "--no-sync",
        )  # fmt: skip

    def _options(self) -> str:
        return (
            f"-c port={self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
            "-c fsync=off -c max_connections=200"
        )

    def _start_on_free_port(self) -> None:
        last: PostgresUnavailable | None = None
        for _ in range(START_ATTEMPT_MAX):
            self.port = free_port()
            try:
                self.start()
                return
            except PostgresUnavailable as exc:
                last = exc
        assert last is not None
        raise last

    def start(self) -> None:
        self._pg_ctl("start", "-o", self._options(), "-l", str(self.log_path))
        self.check_accepting()

    def stop(self, mode: str = "fast") -> None:
        self._pg_ctl("stop", "-m", mode)

    def restart(self, mode: str = "immediate") -> None:
        """Restart (by default as after a crash: no shutdown checkpoint), then wait until it accepts."""
        self._pg_ctl("restart", "-m", mode, "-o", self._options(), "-l", str(self.log_path))
        self.check_accepting()

    def destroy(self) -> None:
        """Stop the server (if running) and delete its directory. Safe to call twice."""
        if (self.data_dir / "postmaster.pid").exists():
            with contextlib.suppress(PostgresUnavailable):
                self.stop("fast")
        if (self.data_dir / "postmaster.pid").exists():
            with contextlib.suppress(PostgresUnavailable):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def check_accepting(self) -> None:
        """Connect once; pg_ctl -w has already waited for the server to report it is ready."""
        try:
            with self.connect("postgres") as conn:
                conn.execute("select 1")
        except psycopg.Error as exc:
            raise PostgresUnavailable(f"server on port {self.port} does not accept connections: {exc}",
                                      self.log_path) from exc

    # -- databases -----------------------------------------------------------------------------
    def connect(self, dbname: str) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname=dbname,
            autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
        )  # fmt: skip

    def create_database(self, name: str) -> str:
        _check_db_name(name)
        with self.connect("postgres") as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop even while sessions are still connected (a test may leak an engine)."""
        _check_db_name(name)
        with self.connect("postgres") as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    # -- running binaries ----------------------------------------------------------------------
    def _pg_ctl(self, *args: str) -> None:
        self._pg("pg_ctl", "-D", str(self.data_dir), "-w", "-t", str(PG_CTL_WAIT_S), *args)

    def _pg(self, tool: str, *args: str) -> None:
        argv = self._run_as.command([str(self.bindir / tool), *args])
        try:
            done = subprocess.run(
                argv, cwd=self.root, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PostgresUnavailable(f"{tool} {args[:3]} failed: {exc}", self.log_path) from exc
        if done.returncode != 0:
            raise PostgresUnavailable(
                f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}", self.log_path
            )


def _check_db_name(name: str) -> None:
    if not DB_NAME_PATTERN.match(name):
        raise ValueError(f"database name {name!r} must match {DB_NAME_PATTERN.pattern}")


def save_log(log_path: Path | None, artifacts_dir: Path) -> Path | None:
    """Copy a server log out of the cluster directory (which teardown deletes) for a failure message."""
    if log_path is None or not log_path.exists():
        return None
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    target = artifacts_dir / f"postgres-server-{os.getpid()}-{int(time.time())}.log"
    shutil.copyfile(log_path, target)
    return target


def reap_orphans(bindir: Path | None) -> list[Path]:
    """Stop and delete clusters left by test sessions that died without teardown (e.g. SIGKILL)."""
    reaped: list[Path] = []
    for root in Path(tempfile.gettempdir()).glob(f"{CLUSTER_DIR_PREFIX}*"):
        reaped.extend(_reap_one(root, bindir))
    if tempfile.gettempdir() != "/tmp":
        for root in Path("/tmp").glob(f"{CLUSTER_DIR_PREFIX}*"):
            reaped.extend(_reap_one(root, bindir))
    return reaped


def _reap_one(root: Path, bindir: Path | None) -> list[Path]:
    try:
        owner = int((root / OWNER_FILE).read_text().strip())
    except (OSError, ValueError):
        return []  # Not ours, or still being created: leave it alone.
    if _pid_alive(owner) or bindir is None:
        return []
    orphan = PostgresServer(bindir, root, _RunAs.detect())
    orphan.destroy()
    return [root]
