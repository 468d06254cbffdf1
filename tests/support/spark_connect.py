"""A real Spark Connect server for the tests: pyspark's own ``SparkConnectServer`` on ``local[2]``.

It is the one ``sbin/start-connect-server.sh`` starts, in the foreground, bound to the loopback only
and requiring a bearer token. Readiness is the server's own log line saying it listens, read from its
output as it comes (no polling of the port, no sleeps).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyspark

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
READY_LINE = "Spark Connect server started at"
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


@dataclass(frozen=True)
class ConnectServer:
    port: int
    token: str
    pid: int
    log: Path

    @property
    def url(self) -> str:
        """The URL a client connects with, the token included (it is a credential: never print it)."""
        return f"sc://localhost:{self.port}/;token={self.token}"

    @property
    def url_without_token(self) -> str:
        return f"sc://localhost:{self.port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def connect_server(log: Path, *conf: str, port: int | None = None, token: str | None = None,
                   ) -> Iterator[ConnectServer]:
    """Start a Connect server (extra ``key=value`` settings in ``conf``; a free port and a new token unless
    given), yield it once it listens, stop it."""
    home = Path(pyspark.__file__).parent
    port, token = port or _free_port(), token or secrets.token_hex(16)
    settings = [
        "spark.connect.grpc.binding.address=127.0.0.1", f"spark.connect.grpc.binding.port={port}",
        f"spark.connect.authenticate.token={token}", "spark.ui.enabled=false",
        "spark.executor.killOnFatalError.depth=0", *conf,
    ]  # fmt: skip
    argv = [str(home / "bin" / "spark-submit"), "--class", SERVER_CLASS, "--master", "local[2]",
            "--name", "dataflow-test-connect"]  # fmt: skip
    for setting in settings:
        argv += ["--conf", setting]
    env = {**os.environ, "SPARK_HOME": str(home)}
    for name in ("PYSPARK_SUBMIT_ARGS", "SPARK_CONNECT_MODE", "SPARK_REMOTE"):
        env.pop(name, None)
    ready, listening = threading.Event(), []
    with log.open("w") as sink:
        process = subprocess.Popen([*argv, "spark-internal"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, text=True, start_new_session=True)

        def copy() -> None:  # the server's output into the log; ready once it says it listens
            assert process.stdout is not None
            for line in process.stdout:
                sink.write(line.replace(token, "(token)"))
                sink.flush()
                if READY_LINE in line:
                    listening.append(True)
                    ready.set()
            ready.set()  # it exited: the wait below sees that

        reader = threading.Thread(target=copy, name="connect-server-log", daemon=True)
        reader.start()
        try:
            ready.wait(START_TIMEOUT_S)
            if not listening or process.poll() is not None:
                raise RuntimeError(f"the Spark Connect server did not start; its log: {log}")
            yield ConnectServer(port, token, process.pid, log)
        finally:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)
            reader.join(STOP_TIMEOUT_S)
            if process.stdout is not None:
                process.stdout.close()
