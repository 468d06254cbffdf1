"""A real S3 API server for tests, and a proxy in front of it that loses answers.

`MotoServer` runs `moto_server` (moto[server]: S3 over HTTP, with conditional writes) on loopback, one
process per test session; never the in-process mock. Each test gets a bucket of its own.

`FaultProxy` sits between the platform and the store: a plain HTTP forwarder on loopback that counts
requests and, when armed, forwards a matching request to the store and then *drops the answer* (closes
the client's connection without a byte): the store did the write, the client never hears so. With
``then_blackhole`` every later request is dropped the same way (forwarded or not, as configured), so the
client's retries cannot learn the outcome either: the publication ends Inconclusive, exactly the
textbook lost answer. ``heal()`` lets requests through again (reconcile then sees the store).
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import subprocess
import sys
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from support.pg import free_port

ACCESS_KEY = "testing-access-key"
SECRET_KEY = "testing-secret-key"
REGION = "us-east-1"
START_TIMEOUT_S = 30.0


class MotoServer:
    """`moto_server` on 127.0.0.1:PORT, stopped by `stop()`."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        binary = Path(sys.executable).with_name("moto_server")
        self._log = log_path.open("wb")
        self._process = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        # Ready when the server says it listens (werkzeug prints " * Running on URL" once bound): the lines
        # are read as they come, then a thread copies the rest to the log. A timer stops a server that
        # never says so.
        assert self._process.stdout is not None
        timer = threading.Timer(START_TIMEOUT_S, self._process.kill)
        timer.start()
        try:
            for line in self._process.stdout:  # ends at the ready line, or at EOF when the process exits
                self._log.write(line)
                if f"Running on {self.endpoint}".encode() in line:
                    break
            else:
                code = self._process.wait()
                raise RuntimeError(f"moto_server exited with {code} before listening; see {log_path}")
        finally:
            timer.cancel()
        self._drain = threading.Thread(target=self._copy_output, daemon=True)
        self._drain.start()

    def _copy_output(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:  # ends when the process exits
            self._log.write(line)
            self._log.flush()

    def client(self, endpoint: str | None = None) -> Any:
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def new_bucket(self) -> str:
        name = f"dataflow-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._drain.join(timeout=10)
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._log.close()


@dataclass(frozen=True)
class S3Place:
    """A fresh bucket on the session's store, and how a definition reaches it."""

    server: MotoServer
    bucket: str
    endpoint: str

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def options(self, endpoint: str | None = None) -> dict[str, object]:
        """A definition's store options: the endpoint and credentials as secret references."""
        return {
            "endpoint": endpoint or self.endpoint,
            "allow_http": True,
            "region": REGION,
            "access_key_id": {"secret": "S3_TEST_ACCESS_KEY"},
            "secret_access_key": {"secret": "S3_TEST_SECRET_KEY"},
        }

    def client(self) -> Any:
        return self.server.client()


@dataclass
class _Rule:
    method: str
    path: re.Pattern[str]
    forward: bool  # forward the request before dropping its answer (the store does the write)
    then_blackhole: bool
    then_forward: bool
    fired: int = 0


@dataclass
class FaultProxy:
    """A forwarding proxy on loopback to ``upstream`` (host:port) that can lose answers."""

    upstream: str
    requests: Counter[str] = field(default_factory=Counter)
    log: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    _rule: _Rule | None = None
    _blackhole: bool = False
    _blackhole_forwards: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in separate writes: without TCP_NODELAY, Nagle's algorithm holds the
            # body back for the client's delayed ACK (about 40 ms on every answer).
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:  # ends at the zero-length chunk
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(chunks)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _handle(self) -> None:
                body = self._body()
                path = self.path.split("?", 1)[0]
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    headers["Content-Length"] = str(len(body))
                drop, forward = proxy._decide(self.command, path, headers)
                status = None
                if forward:
                    status, reason, answer_headers, answer = proxy._forward(self.command, self.path, headers, body)
                if drop or status is None:
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response_only(status, reason)
                # A HEAD answer's Content-Length is the object's size (it has no body): passed as it is.
                passed = ("transfer-encoding", "connection") if self.command == "HEAD" else (
                    "transfer-encoding", "connection", "content-length")
                for name, value in answer_headers:
                    if name.lower() not in passed:
                        self.send_header(name, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(answer)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def errors_to(self, stream: Any) -> None:
        """Write the handler's tracebacks (a client gone mid-answer: broken pipes) to ``stream`` instead
        of stderr."""
        import traceback

        self._server.handle_error = lambda request, address: traceback.print_exc(file=stream)  # type: ignore[method-assign]

    def lose_answer(
        self, method: str, path_pattern: str, *, forward: bool = True, then_blackhole: bool = True,
        then_forward: bool = False,
    ) -> None:
        """Arm: the next ``method`` request whose path matches is forwarded (``forward``) and its answer
        dropped; with ``then_blackhole`` every later request is dropped too (forwarded when
        ``then_forward``), until ``heal()``."""
        with self._lock:
            self._rule = _Rule(method, re.compile(path_pattern), forward, then_blackhole, then_forward)

    def heal(self) -> None:
        with self._lock:
            self._rule = None
            self._blackhole = False

    @property
    def fired(self) -> int:
        return 0 if self._rule is None else self._rule.fired

    def _decide(self, method: str, path: str, headers: dict[str, str]) -> tuple[bool, bool]:
        """(drop the answer, forward the request)."""
        with self._lock:
            self.requests[method] += 1
            self.log.append((method, path, headers))
            if self._blackhole:
                return True, self._blackhole_forwards
            rule = self._rule
            if rule is not None and rule.fired == 0 and method == rule.method and rule.path.search(path):
                rule.fired += 1
                if rule.then_blackhole:
                    self._blackhole = True
                    self._blackhole_forwards = rule.then_forward
                return True, rule.forward
            return False, True

    def _forward(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        host, _, port = self.upstream.partition(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            connection.request(method, path, body=body, headers=headers)
            answer = connection.getresponse()
            data = answer.read()
            return answer.status, answer.reason, answer.getheaders(), data
        finally:
            connection.close()


def delta_log_rows(client: Any, bucket: str, prefix: str) -> Any:
    """The Delta table's current rows read without delta-rs: its JSON log replayed with boto3 (add and
    remove actions; the small tables of the tests have no checkpoint, which is asserted) and the live
    data files read with pyarrow over the store's API. An independent reader of what was published."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/_delta_log/")
    names = sorted(o["Key"] for o in listed.get("Contents", []))
    assert not any(n.endswith(".checkpoint.parquet") for n in names), "a checkpoint: replay it too"
    live: dict[str, None] = {}
    for name in names:
        if not re.search(r"/\d{20}\.json$", name):
            continue
        for line in client.get_object(Bucket=bucket, Key=name)["Body"].read().decode().splitlines():
            action = json.loads(line) if line.strip() else {}
            if "add" in action:
                live[action["add"]["path"]] = None
            elif "remove" in action:
                live.pop(action["remove"]["path"], None)
    tables = []
    for path in live:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{path}")["Body"].read()
        tables.append(pq.read_table(pa.BufferReader(body)))
    return pa.concat_tables(tables, promote_options="permissive") if tables else None


def delta_publication_commits(client: Any, bucket: str, prefix: str, key: str) -> int:
    """How many commits of the table's log carry key's publication (an app transaction above 0)."""
    import json

    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/_delta_log/")
    count = 0
    for name in (o["Key"] for o in listed.get("Contents", [])):
        if not re.search(r"/\d{20}\.json$", name):
            continue
        text = client.get_object(Bucket=bucket, Key=name)["Body"].read().decode()
        actions = [json.loads(line) for line in text.splitlines() if line.strip()]
        if any("txn" in a and a["txn"]["appId"] == key and a["txn"]["version"] > 0 for a in actions):
            count += 1
    return count


class StrippingProxy(FaultProxy):
    """A store that ignores conditional writes: the proxy drops If-None-Match and If-Match from every request."""

    def _decide(self, method: str, path: str, headers: dict[str, str]) -> tuple[bool, bool]:
        for name in [h for h in headers if h.lower() in ("if-none-match", "if-match")]:
            del headers[name]
        return super()._decide(method, path, headers)
