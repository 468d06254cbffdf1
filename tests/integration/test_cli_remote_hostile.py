"""The remote CLI against servers that are not the API (found by a hostile review): a redirect never
carries the token to another host, JSON of the wrong shape is "not the API" (exit 2), and an --api URL
with a query or fragment (where a secret may hide) is refused without being echoed."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from test_cli_remote import dataflow

from durable_dataflow.cli import remote
from support.cli import SCRUBBED_ENV

TOKEN = "ddf_hostile-review-token-0123456789"
RUN = "01a22bc7-d32f-7928-93b7-4aca38676ea7"


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Records every Authorization header it sees; answers with the class's ``answer``."""

    seen: ClassVar[list[str]] = []
    status: ClassVar[int] = 200
    location: ClassVar[str] = ""
    body: ClassVar[bytes] = b"{}"

    def _answer(self) -> None:
        type(self).seen.append(self.headers.get("Authorization", ""))
        self.send_response(self.status)
        if self.location:
            self.send_header("Location", self.location)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def do_GET(self) -> None:  # the standard library's name
        self._answer()

    def do_POST(self) -> None:  # the standard library's name
        self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
        self._answer()

    def log_message(self, format: str, *args: Any) -> None:  # the standard library's signature
        return


def _serve(handler: type[http.server.BaseHTTPRequestHandler]) -> tuple[http.server.ThreadingHTTPServer, str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name in (*SCRUBBED_ENV, remote.API_URL_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(remote.TOKEN_VARIABLE, TOKEN)
    yield TOKEN


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_the_token_stays(
    token: str, capsys: pytest.CaptureFixture[str], status: int
) -> None:
    """Proves a 30x from --api is refused (exit 2, naming the redirect) and the token never reaches the host
    it names: urllib's default handler carried the Authorization header along (GET and POST alike)."""

    class Target(_Recorder):
        seen: ClassVar[list[str]] = []

    target, target_url = _serve(Target)

    class Redirecting(_Recorder):
        seen: ClassVar[list[str]] = []
        status = 0
        location = ""

    Redirecting.status, Redirecting.location = status, target_url + "/v1/runs"
    first, first_url = _serve(Redirecting)
    try:
        for args in (("runs", "--json"), ("show", RUN), ("cancel", RUN)):
            said = dataflow(capsys, "--api", first_url, *args)
            assert said.code == 2 and "redirect" in said.stderr, said.output
            assert token not in said.output
        assert Redirecting.seen and Target.seen == [], Target.seen
    finally:
        for server in (first, target):
            server.shutdown()
            server.server_close()


@pytest.mark.parametrize("body", [b"[1, 2]", b"\"a string\"", b"42"])
def test_json_that_is_not_the_apis_shape_exits_2(token: str, capsys: pytest.CaptureFixture[str], body: bytes) -> None:
    """Proves a server answering JSON that is not an object (the API's answers always are) exits 2 "is --api
    right?", not an internal error (exit 1, a KeyError or TypeError)."""

    class Answering(_Recorder):
        seen: ClassVar[list[str]] = []

    Answering.body = body
    server, url = _serve(Answering)
    try:
        for args in (("runs",), ("show", RUN), ("partitions", "daily")):
            said = dataflow(capsys, "--api", url, *args)
            assert said.code == 2 and "is --api right?" in said.stderr, (args, said.output)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/?token=QSECRET", "http://127.0.0.1:9/#QSECRET",
                                 "https://h.example/api?x=QSECRET"])  # fmt: skip
def test_an_api_url_with_a_query_or_fragment_is_refused_unechoed(
    token: str, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """Proves --api with a query or fragment exits 2 before any request, and the message does not repeat
    the URL (its query is where a pasted secret would be): it was appended to and echoed in errors."""
    said = dataflow(capsys, "--api", url, "runs")
    assert said.code == 2 and "without a query" in said.stderr, said.output
    assert "QSECRET" not in said.output
