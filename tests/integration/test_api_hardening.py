"""The hardened HTTP surface (issue 12, item 5) on SQLite and PostgreSQL: the token is checked before a
body is read, bodies over the limit answer 413 (declared or chunked), crafted cursors answer 422,
control characters reach no page raw, /healthz names no host or driver, every response carries the
security headers, the login form has a CSRF token, error messages never echo a request value, and
duplicate JSON (and YAML) keys are refused."""

from __future__ import annotations

import base64
import json
import logging
import socket
import unicodedata
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from durable_dataflow.api import middleware, operations, tokens
from durable_dataflow.api.app import HEALTH_UNREACHABLE, create_app
from durable_dataflow.core import strictjson
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.text import printable
from durable_dataflow.dataflow.definitions.definitions import load_definition
from durable_dataflow.dataflow.protocol import runs
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.platform import Platform
from support.api_runs import Tokens, copy_examples, make_atomic_run, make_tokens, tenant_data_root, web_login

BODY_LIMIT = 16 * 1024
CHUNK_BYTES = 1024
# A body cut off in the middle: the JSON parser fails on it, so a 422 proves it was parsed.
TRUNCATED_JSON = b'{"definition_hash": "sha256:0000'
HOSTILE = "x\x1b[31mred\x1b]8;;http://evil\x07\u202eevil\u2066\x9bend"
HOSTILE_CHARACTERS = ("\x1b", "\x07", "\u202e", "\u2066", "\x9b")


@dataclass(frozen=True)
class Served:
    platform: Platform
    app: FastAPI
    client: TestClient
    tokens: Tokens
    atomic: Run

    def auth(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    platform = Platform(db_url)
    examples = copy_examples(tmp_path)
    atomic = make_atomic_run(platform, examples, "acme")
    app = create_app(platform, data_root=tenant_data_root(tmp_path, examples), body_bytes_max=BODY_LIMIT)
    with TestClient(app, follow_redirects=False) as client:
        yield Served(platform, app, client, make_tokens(platform), atomic)
    platform.close()


async def _chunks(count: int, pulled: list[int], chunk: bytes = b"x" * CHUNK_BYTES) -> AsyncIterator[bytes]:
    for index in range(count):
        pulled.append(index)
        yield chunk


def _streamed_post(app: FastAPI, path: str, count: int, headers: dict[str, str]) -> tuple[httpx2.Response, int]:
    """POST ``count`` chunks without a Content-Length (chunked), straight into the ASGI app, which pulls
    each chunk only when it reads the body; returns the answer and how many chunks were pulled."""
    pulled: list[int] = []

    async def post() -> httpx2.Response:
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://testserver") as client:
            answer = await client.post(path, content=_chunks(count, pulled), headers=headers)
            await answer.aread()
            return answer

    answer = anyio.run(post)
    assert "content-length" not in {k.lower() for k in answer.request.headers}
    return answer, len(pulled)


def _empty_root(tmp_path: Path) -> Path:
    root = tmp_path / "empty-data-root"
    root.mkdir(exist_ok=True)
    return root


def _error(answer: httpx2.Response, status: int, code: str) -> str:
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code, answer.text
    message: str = answer.json()["error"]["message"]
    return message


# ---- 1. authentication before the body is read ---------------------------------------------------------

BODY_ROUTES = [("/v1/runs", "submitter"), ("/v1/runs/{run}/reconcile", "operator")]


@pytest.mark.parametrize(("path", "role"), BODY_ROUTES)
def test_a_truncated_body_answers_401_without_a_token_and_422_with_one(served: Served, path: str, role: str) -> None:
    """A truncated JSON body with no token or a bad token answers 401 (it was never parsed); the same
    body with a valid token of the route's role answers 422, so the body really is parsed after."""
    url = path.replace("{run}", served.atomic.run_id)
    for headers in ({}, served.auth("ddf_" + "x" * 43), {"Authorization": "Basic Zm9vOmJhcg=="}):
        headers = {**headers, "Content-Type": "application/json"}
        answer = served.client.post(url, content=TRUNCATED_JSON, headers=headers)
        _error(answer, 401, "unauthenticated")
    answer = served.client.post(url, content=TRUNCATED_JSON, headers=served.auth(getattr(served.tokens, role)))
    assert "JSON decode error" in _error(answer, 422, "invalid_input")


@pytest.mark.parametrize(("path", "role"), BODY_ROUTES)
def test_an_unauthenticated_body_is_never_read(served: Served, path: str, role: str) -> None:
    """Streamed chunk by chunk, an unauthenticated body is not pulled at all (401); a valid token's is
    pulled whole."""
    url = path.replace("{run}", served.atomic.run_id)
    answer, pulled = _streamed_post(served.app, url, 4, {})
    _error(answer, 401, "unauthenticated")
    assert pulled == 0
    answer, pulled = _streamed_post(served.app, url, 4, served.auth(getattr(served.tokens, role)))
    assert "JSON decode error" in _error(answer, 422, "invalid_input") and pulled == 4


def test_the_request_bodies_stay_documented(served: Served) -> None:
    """The OpenAPI document still describes both JSON bodies (fields and bounds), read by hand or not."""
    paths = served.app.openapi()["paths"]
    submit = paths["/v1/runs"]["post"]["requestBody"]
    assert submit["required"] is True
    schema = submit["content"]["application/json"]["schema"]
    assert {"definition", "definition_hash", "parameters", "max_attempts"} <= set(schema["properties"])
    assert schema["properties"]["max_attempts"]["maximum"] == 20 and schema["additionalProperties"] is False
    reconcile = paths["/v1/runs/{run_id}/reconcile"]["post"]["requestBody"]
    assert reconcile["required"] is False
    assert "resume" in reconcile["content"]["application/json"]["schema"]["properties"]


def test_validation_errors_keep_their_shape(served: Served) -> None:
    """A body the model refuses answers 422 invalid_input naming `body.<field>`, as FastAPI did; a missing
    submit body is `body: Field required`; an empty reconcile body means its defaults."""
    auth = served.auth(served.tokens.submitter)
    answer = served.client.post("/v1/runs", json={"definition_hash": "sha256:x", "max_attempts": 0}, headers=auth)
    assert "invalid request: body.max_attempts: Input should be greater than or equal to 1" in _error(
        answer, 422, "invalid_input"
    )
    assert "body: Field required" in _error(served.client.post("/v1/runs", headers=auth), 422, "invalid_input")
    reconcile = served.client.post(
        f"/v1/runs/{served.atomic.run_id}/reconcile", headers=served.auth(served.tokens.operator)
    )
    _error(reconcile, 409, "conflict")  # the defaults were used: an atomic run has nothing to reconcile


# ---- 2. the request-body size limit --------------------------------------------------------------------


def test_a_declared_body_over_the_limit_answers_413_on_every_kind_of_route(served: Served) -> None:
    """A Content-Length over the limit answers 413 payload_too_large on the API (with or without a token)
    and on the login form; a body of exactly the limit is read as usual."""
    big = b" " * (BODY_LIMIT + 1)
    auth = served.auth(served.tokens.submitter)
    for headers in (auth, {}):
        message = _error(served.client.post("/v1/runs", content=big, headers=headers), 413, "payload_too_large")
        assert str(BODY_LIMIT) in message
    form = {"token": "ddf_x", "csrf": "0" * (BODY_LIMIT + 1)}
    _error(served.client.post("/ui/login", data=form), 413, "payload_too_large")
    exact = json.dumps({"definition_hash": "sha256:" + "0" * 64}).encode().ljust(BODY_LIMIT)
    assert served.client.post("/v1/runs", content=exact, headers=auth).status_code == 404


def test_a_chunked_body_over_the_limit_answers_413_and_stops_being_read(served: Served) -> None:
    """Without a Content-Length the body is counted as it arrives: past the limit the answer is 413 and
    no further chunk is pulled; on the login form too."""
    count = 4 * BODY_LIMIT // CHUNK_BYTES
    auth = served.auth(served.tokens.submitter)
    answer, pulled = _streamed_post(served.app, "/v1/runs", count, auth)
    _error(answer, 413, "payload_too_large")
    assert pulled == BODY_LIMIT // CHUNK_BYTES + 1
    login = {"Content-Type": "application/x-www-form-urlencoded"}
    answer, pulled = _streamed_post(served.app, "/ui/login", count, login)
    _error(answer, 413, "payload_too_large")
    assert pulled == BODY_LIMIT // CHUNK_BYTES + 1


def test_the_body_limit_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, served: Served, tmp_path: Path
) -> None:
    """DATAFLOW_API_BODY_BYTES_MAX sets the limit (bytes or a size), 4 MiB without it; a bad value is an
    InputError naming the variable without echoing it; the explicit keyword wins."""
    assert middleware.body_bytes_max_from_env({}) == 4 * 1024 * 1024
    assert middleware.body_bytes_max_from_env({"DATAFLOW_API_BODY_BYTES_MAX": "1KiB"}) == 1024
    assert middleware.body_bytes_max_from_env({"DATAFLOW_API_BODY_BYTES_MAX": "1KiB"}, override=10) == 10
    for bad in ("lots-canary", "0"):
        with pytest.raises(InputError, match=r"^DATAFLOW_API_BODY_BYTES_MAX") as caught:
            middleware.body_bytes_max_from_env({"DATAFLOW_API_BODY_BYTES_MAX": bad})
        assert "canary" not in caught.value.message
    monkeypatch.setenv("DATAFLOW_API_BODY_BYTES_MAX", "1KiB")
    client = TestClient(create_app(served.platform, data_root=_empty_root(tmp_path)))
    _error(client.post("/v1/runs", content=b" " * 1025), 413, "payload_too_large")


# ---- 3. cursors ----------------------------------------------------------------------------------------


def _cursor(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


@pytest.mark.parametrize("value", [[10**30, "x"], [2**63, "x"], [-1, "x"], [-(10**30), "x"], [1, "a\x00b"]])
def test_a_crafted_cursor_answers_422_never_500(served: Served, value: list[Any]) -> None:
    """A cursor whose time is outside 0..2**63-1 (an overflow in the database) or whose run id holds a NUL
    answers 422 invalid_input on the API and an error page (not a 500) on the web history."""
    viewer = served.tokens.viewer
    answer = served.client.get("/v1/runs", params={"cursor": _cursor(value)}, headers=served.auth(viewer))
    _error(answer, 422, "invalid_input")
    web = TestClient(served.app, follow_redirects=False)
    assert web_login(web, viewer).status_code == 303
    assert web.get("/ui/runs", params={"cursor": _cursor(value)}).status_code == 422


def test_the_largest_cursor_time_is_accepted(served: Served) -> None:
    """The boundary 2**63-1 is a valid cursor: it lists every run older than it (all of them)."""
    answer = served.client.get(
        "/v1/runs", params={"cursor": _cursor([2**63 - 1, "x"])}, headers=served.auth(served.tokens.viewer)
    )
    assert answer.status_code == 200, answer.text
    assert [r["run_id"] for r in answer.json()["runs"]] == [served.atomic.run_id]
    assert operations.decode_cursor(_cursor([0, "x"])) == (0, "x")


NUL_RUN = "%00"  # a run id holding a NUL, as a path segment


def test_a_nul_in_a_run_id_a_filter_or_a_hash_is_refused_alike_on_both_engines(served: Served) -> None:
    """PostgreSQL cannot compare a text holding a NUL (its driver raises, which was a 500): a run id with
    one is not found, a history filter with one (or a status that is not one) is invalid input, and a
    definition_hash with one names no definition, on SQLite and PostgreSQL, on the API and the pages;
    nothing is recorded."""
    operator = served.auth(served.tokens.operator)
    for method, path in (("GET", "/v1/runs/{}"), ("GET", "/v1/runs/{}/evidence"), ("POST", "/v1/runs/{}/reconcile"),
                         ("POST", "/v1/runs/{}/cancel")):  # fmt: skip
        _error(served.client.request(method, path.format(NUL_RUN), headers=operator), 404, "not_found")
    for params in ({"definition": "a\x00b"}, {"definition": "\x00"}):
        _error(served.client.get("/v1/runs", params=params, headers=operator), 422, "invalid_input")
    submitter = served.auth(served.tokens.submitter)
    for path in ("/v1/runs", "/v1/runs?queue=true"):
        answer = served.client.post(path, json={"definition_hash": "sha256:\x00"}, headers=submitter)
        _error(answer, 404, "not_found")
    web = TestClient(served.app, follow_redirects=False)
    assert web_login(web, served.tokens.viewer).status_code == 303
    for params in ({"status": "\x00"}, {"recovery_status": "\x00"}, {"status": "bogus"}):
        assert web.get("/ui/runs", params=params).status_code == 422, params
    assert web.get(f"/ui/runs/{NUL_RUN}").status_code == 404
    with served.platform.db.read() as conn:
        assert runs.list_page(conn) == [served.atomic]


def test_a_malformed_form_on_a_page_answers_the_html_error_page_with_422(served: Served) -> None:
    """Proves a login form whose token is too long, or with more fields than Starlette parses, answers
    422 invalid_input as the page's HTML error (it was JSON, and the field count a 400 the status table
    does not have), naming no submitted value."""
    web = TestClient(served.app, follow_redirects=False)
    assert web_login(web, "x" * 201).status_code == 422
    answer = web_login(web, "x" * 201)
    assert answer.headers["content-type"].startswith("text/html") and "invalid_input" in answer.text
    assert "x" * 201 not in answer.text
    crowded = b"&".join(b"a%d=b" % i for i in range(1100))  # Starlette parses at most 1000
    answer = web.post("/ui/login", content=crowded, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert answer.status_code == 422 and answer.headers["content-type"].startswith("text/html"), answer.text


# ---- 4. control characters on pages --------------------------------------------------------------------


def test_printable_escapes_controls_and_bidi_and_keeps_the_rest() -> None:
    """printable writes every C0/C1 control, DEL, bidi control and line separator as a visible escape,
    keeps tab and newline unless told to escape them, and leaves other text (accents, emoji) alone."""
    assert printable("a\x1b[31mb") == "a\\x1b[31mb"
    assert printable("\x00\x7f\x9b\u202a\u202e\u2066\u2069\u200f\u061c\u2028") == (
        "\\x00\\x7f\\x9b\\u202a\\u202e\\u2066\\u2069\\u200f\\u061c\\u2028"
    )
    assert printable("tab\tand\nline\r") == "tab\tand\nline\\x0d"
    assert printable("tab\tand\nline", multiline=False) == "tab\\x09and\\x0aline"
    plain = "Zoë 🚀 naïve — 2026-11-02 <b>"
    assert printable(plain) == plain
    every = "".join(chr(code) for code in range(0x110000))
    controls = {c for c in every if unicodedata.category(c) == "Cc"} | set("\u061c\u200e\u200f\u2028\u2029")
    controls |= {chr(code) for code in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}
    assert set(printable(every)) & controls == {"\t", "\n"}
    assert set(printable(every, multiline=False)) & controls == set()


def test_a_hostile_parameter_reaches_the_pages_as_visible_escapes(served: Served) -> None:
    """A run whose string parameter (and the target datasource it publishes to) holds terminal escapes, a
    C1 control and bidi overrides, and a run whose engine error may quote that parameter: no page holds
    any such character raw; the run page shows the datasource with each of them as a visible escape."""
    document = {
        "name": "echo", "version": 1, "parameters": {"who": {"type": "string"}},
        "sources": {"nums": {"kind": "inline", "rows": [{"n": 1}], "schema": {"n": "int64"}}},
        "steps": [{"name": "result", "sql": "select n, $who as who from nums"}],
        "output": {"schema": {"n": "int64", "who": "string"}, "max_rows": 10, "max_bytes": "1MiB"},
        "target": {"type": "datasources.publication", "provider": "parquet", "datasource": HOSTILE,
                   "location": "echoes"},
    }  # fmt: skip
    failing = {**document, "steps": [{"name": "result", "sql": "select cast($who as BIGINT) as n from nums"}]}
    runs = []
    for definition in (document, failing):
        body = {"definition": definition, "parameters": {"who": HOSTILE}}
        answer = served.client.post("/v1/runs", json=body, headers=served.auth(served.tokens.submitter))
        assert answer.status_code == 201, answer.text
        assert answer.json()["run"]["parameters"] == {"who": HOSTILE}  # the API returns the value as it was given
        runs.append(answer.json()["run"])
    assert [run["status"] for run in runs] == ["succeeded", "failed"]
    web = TestClient(served.app, follow_redirects=False)
    assert web_login(web, served.tokens.viewer).status_code == 303
    for page in (*(f"/ui/runs/{run['run_id']}" for run in runs), "/ui/runs"):
        html = web.get(page).text
        assert not [c for c in HOSTILE_CHARACTERS if c in html], page
    html = web.get(f"/ui/runs/{runs[0]['run_id']}").text
    assert f"parquet → {printable(HOSTILE)}</dd>" in html
    assert "\\x1b[31mred" in html and "\\u202eevil" in html and "\\x9bend" in html


# ---- 5. /healthz ---------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_healthz_names_no_host_port_user_or_driver_text(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Against a PostgreSQL URL on a closed loopback port, /healthz answers 503 storage_unavailable with a
    fixed message: no host, port, user, password, database name or driver text; the log has the detail."""
    port = _closed_port()
    user, password, database = f"canary_user_{uuid.uuid4().hex[:8]}", f"pw{uuid.uuid4().hex}", "canary_db_x"
    platform = Platform(f"postgresql://{user}:{password}@127.0.0.1:{port}/{database}", migrate=False)
    try:
        client = TestClient(create_app(platform, data_root=_empty_root(tmp_path)))
        with caplog.at_level(logging.WARNING, logger="durable_dataflow.api.app"):
            answer = client.get("/healthz")
    finally:
        platform.close()
    assert _error(answer, 503, "storage_unavailable") == HEALTH_UNREACHABLE
    for secret in (user, password, database, str(port), "127.0.0.1", "psycopg", "connection", "refused"):
        assert secret not in answer.text, secret
    assert any("unreachable" in r.getMessage() for r in caplog.records), caplog.records


# ---- 6. security headers -------------------------------------------------------------------------------


def _answers(served: Served, monkeypatch: pytest.MonkeyPatch) -> dict[str, httpx2.Response]:
    auth = served.auth(served.tokens.operator)
    web = TestClient(served.app, follow_redirects=False)
    web_login(web, served.tokens.operator)

    def broken(*args: Any, **kwargs: Any) -> Run:
        raise RuntimeError("a bug")

    monkeypatch.setattr(operations, "get_run", broken)
    crashing = TestClient(served.app, raise_server_exceptions=False)
    return {
        "healthz": served.client.get("/healthz"),
        "api": served.client.get("/v1/runs", headers=auth),
        "api 401": served.client.get("/v1/runs"),
        "api 404": served.client.get("/v1/nothing-here", headers=auth),
        "api 413": served.client.post("/v1/runs", content=b" " * (BODY_LIMIT + 1), headers=auth),
        "api 500": crashing.get(f"/v1/runs/{served.atomic.run_id}", headers=auth),
        "login": web.get("/ui/login"),
        "history": web.get("/ui/runs"),
        "run page": web.get(f"/ui/runs/{served.atomic.run_id}"),
        "ops page": web.get("/ui/ops"),
        "redirect": TestClient(served.app, follow_redirects=False).get("/ui/runs"),
        "static": served.client.get("/static/style.css"),
    }


def test_every_response_carries_the_security_headers(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """API answers (errors, a 413 and a 500 included), pages, redirects and the stylesheet carry a strict
    CSP, X-Frame-Options DENY, nosniff and no-referrer; everything but the static stylesheet is no-store."""
    for name, answer in _answers(served, monkeypatch).items():
        headers = answer.headers
        csp = headers.get("content-security-policy", "")
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "script-src 'none'" in csp, name
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp, name
        assert headers.get("x-frame-options") == "DENY", name
        assert headers.get("x-content-type-options") == "nosniff", name
        assert headers.get("referrer-policy") == "no-referrer", name
        if name == "static":
            assert answer.status_code == 200 and "no-store" not in headers.get("cache-control", "")
        else:
            assert headers.get("cache-control") == "no-store", name


def test_pages_need_nothing_the_policy_forbids(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """No page has a script, an inline style or event handler, or a resource from another origin, so the
    strict policy breaks nothing (tests/acceptance/test_browser.py drives them in Chromium)."""
    for name, answer in _answers(served, monkeypatch).items():
        if not answer.headers.get("content-type", "").startswith("text/html"):
            continue
        html = answer.text.lower()
        assert "<script" not in html and " style=" not in html and "<style" not in html, name
        assert " onclick=" not in html and " onload=" not in html and "javascript:" not in html, name
        assert 'src="http' not in html and 'href="http' not in html, name


# ---- 7. the login form's CSRF token --------------------------------------------------------------------


def test_the_login_form_sets_a_strict_nonce_cookie_and_a_csrf_field(served: Served) -> None:
    """GET /ui/login sets ddf_login_csrf (HttpOnly, SameSite=Strict, only for /ui/login) and puts the HMAC
    of it in the form; reloading keeps the same nonce, so two open tabs both work."""
    client = TestClient(served.app, follow_redirects=False)
    form = client.get("/ui/login")
    cookie = form.headers["set-cookie"].lower()
    assert cookie.startswith("ddf_login_csrf=") and "httponly" in cookie and "samesite=strict" in cookie
    assert "path=/ui/login" in cookie
    nonce = client.cookies["ddf_login_csrf"]
    assert nonce not in form.text  # the form holds the HMAC of the nonce, never the nonce
    again = client.get("/ui/login")
    assert client.cookies["ddf_login_csrf"] == nonce
    assert 'name="csrf"' in again.text
    assert web_login(client, served.tokens.viewer).status_code == 303


def test_a_login_without_a_matching_csrf_is_403_before_any_token_lookup(
    served: Served, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A login POST with no CSRF field, a wrong one, one without the nonce cookie, or one from another
    server process answers 403, sets no session and never looks the token up."""
    lookups: list[str | None] = []
    real = tokens.authenticate

    def counting(db: Any, presented: str | None) -> Any:
        lookups.append(presented)
        return real(db, presented)

    token = served.tokens.viewer
    client = TestClient(served.app, follow_redirects=False)
    field = client.get("/ui/login").text.split('name="csrf" value="')[1].split('"')[0]
    other_app = create_app(served.platform, data_root=_empty_root(tmp_path))
    other = TestClient(other_app, follow_redirects=False)
    other_field = other.get("/ui/login").text.split('name="csrf" value="')[1].split('"')[0]
    monkeypatch.setattr(tokens, "authenticate", counting)
    attempts = [
        (client, {"token": token}),
        (client, {"token": token, "csrf": "0" * 64}),
        (client, {"token": token, "csrf": other_field}),
        (TestClient(served.app, follow_redirects=False), {"token": token, "csrf": field}),
    ]
    for sender, data in attempts:
        answer = sender.post("/ui/login", data=data)
        assert answer.status_code == 403, (data, answer.text)
        assert "ddf_session" not in answer.headers.get("set-cookie", "")
    assert lookups == []
    ok = client.post("/ui/login", data={"token": token, "csrf": field})
    assert ok.status_code == 303 and lookups == [token]


# ---- 8. error messages name the field, never the value -------------------------------------------------

CANARY = f"canary-{uuid.uuid4().hex[:12]}"
CANARY_INT = 987_654_321_987
CANARY_NAME = CANARY.replace("-", "_")  # for fields that must hold an identifier to get that far


def _inline(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "canaried", "version": 1, "parameters": {"day": {"type": "date"}},
        "sources": {"nums": {"kind": "inline", "rows": [{"n": 1}], "schema": {"n": "int64"}}},
        "steps": [{"name": "result", "sql": "select n from nums"}],
        "output": {"schema": {"n": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
    }  # fmt: skip
    for path, value in changes.items():
        holder = document
        *parents, last = path.split(".")
        for parent in parents:
            holder = holder[int(parent)] if isinstance(holder, list) else holder[parent]
        holder[last] = value
    return document


TARGET = {"type": "datasources.publication", "provider": "parquet", "datasource": "d", "location": "l"}
GOOD_REQUEST = {"definition_hash": "{atomic}", "parameters": {"day": "2026-11-02"}}
# (where the canary is, the request body, extra headers). Every request is refused because of the canary.
CANARY_REQUESTS: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("parameters.day", {"definition": _inline(), "parameters": {"day": CANARY}}, {}),
    ("parameters.day as a number", {"definition": _inline(), "parameters": {"day": CANARY_INT}}, {}),
    ("parameters.day registered", {"definition_hash": "{atomic}", "parameters": {"day": CANARY}}, {}),
    ("definition_hash", {"definition_hash": CANARY}, {}),
    ("max_attempts", {"definition_hash": "{atomic}", "max_attempts": CANARY}, {}),
    ("max_attempts as a number", {"definition_hash": "{atomic}", "max_attempts": CANARY_INT}, {}),
    ("parameters as a string", {"definition_hash": "{atomic}", "parameters": CANARY}, {}),
    ("definition as a string", {"definition": CANARY}, {}),
    ("definition.name", {"definition": _inline(name=CANARY)}, {}),
    ("definition.version", {"definition": _inline(version=CANARY)}, {}),
    ("definition.version as a number", {"definition": _inline(version=CANARY_INT**2)}, {}),
    ("parameter type", {"definition": _inline(**{"parameters.day.type": CANARY})}, {}),
    ("parameter default", {"definition": _inline(**{"parameters.day.default": CANARY})}, {}),
    ("source kind", {"definition": _inline(**{"sources.nums.kind": CANARY})}, {}),
    ("source schema type", {"definition": _inline(**{"sources.nums.schema": {"n": CANARY}})}, {}),
    ("inline row value", {"definition": _inline(**{"sources.nums.rows": [{"n": CANARY_INT**2}]})}, {}),
    (
        "csv delimiter",
        {"definition": _inline(**{"sources.nums": {"kind": "csv", "path": "x.csv", "delimiter": CANARY}})},
        {},
    ),
    (
        "postgres dsn",
        {"definition": _inline(**{"sources.nums": {"kind": "postgres", "dsn": CANARY, "query": "select 1"}})},
        {},
    ),
    ("step name", {"definition": _inline(**{"steps.0.name": CANARY})}, {}),
    ("step name twice", {"definition": _inline(steps=[{"name": CANARY_NAME, "sql": "select 1"}] * 2)}, {}),
    ("output schema type", {"definition": _inline(**{"output.schema": {"n": CANARY}})}, {}),
    ("output max_rows", {"definition": _inline(**{"output.max_rows": CANARY})}, {}),
    ("output max_bytes", {"definition": _inline(**{"output.max_bytes": CANARY})}, {}),
    ("output max_bytes too big", {"definition": _inline(**{"output.max_bytes": CANARY_INT})}, {}),
    ("limits.time_limit", {"definition": _inline(limits={"time_limit": CANARY})}, {}),
    ("limits.memory", {"definition": _inline(limits={"memory": CANARY})}, {}),
    ("limits.threads", {"definition": _inline(limits={"threads": CANARY})}, {}),
    ("limits.memory above the platform", {"definition": _inline(limits={"memory": f"{CANARY_INT}B"})}, {}),
    ("target mode", {"definition": _inline(target={**TARGET, "mode": CANARY})}, {}),
    ("target credential option", {"definition": _inline(target={**TARGET, "options": {"password": CANARY}})}, {}),
    ("idempotency key too long", GOOD_REQUEST, {"Idempotency-Key": CANARY * 20}),
    ("idempotency key not printable", GOOD_REQUEST, {"Idempotency-Key": CANARY + "\x7f"}),
]


@pytest.mark.parametrize(("where", "body", "headers"), CANARY_REQUESTS, ids=[r[0] for r in CANARY_REQUESTS])
def test_no_error_message_echoes_a_request_value(
    served: Served, where: str, body: dict[str, Any], headers: dict[str, str]
) -> None:
    """A request refused because of the canary in one field answers 4xx with a message that may name the
    field and the rule, but never contains the canary (nor the canary number)."""
    if isinstance(body.get("definition"), dict):
        body = {"parameters": {"day": "2026-11-02"}, **body}  # the inline document's one parameter, unless set
    text = json.dumps(body).replace('"{atomic}"', json.dumps(served.atomic.definition_hash))
    auth = {**served.auth(served.tokens.submitter), "Content-Type": "application/json"}
    answer = served.client.post("/v1/runs", content=text.encode(), headers={**auth, **headers})
    assert 400 <= answer.status_code < 500 and set(answer.json()) == {"error"}, (where, answer.text)
    assert CANARY not in answer.text and CANARY_NAME not in answer.text, (where, answer.text)
    assert str(CANARY_INT) not in answer.text and str(CANARY_INT**2) not in answer.text, (where, answer.text)


@pytest.mark.parametrize(
    "params",
    [{"status": CANARY}, {"recovery_status": CANARY}, {"limit": CANARY}, {"limit": CANARY_INT},
     {"created_after": CANARY}, {"cursor": CANARY}, {"definition": CANARY * 20}],
)  # fmt: skip
def test_no_list_error_echoes_a_query_value(served: Served, params: dict[str, Any]) -> None:
    """A run listing refused because of the canary in a query parameter never echoes it; nor does a
    reconcile body refused for its `resume` value."""
    answer = served.client.get("/v1/runs", params=params, headers=served.auth(served.tokens.viewer))
    _error(answer, 422, "invalid_input")
    assert CANARY not in answer.text and str(CANARY_INT) not in answer.text, answer.text
    operator = served.auth(served.tokens.operator)
    url = f"/v1/runs/{served.atomic.run_id}/reconcile"
    reconcile = served.client.post(url, json={"resume": CANARY}, headers=operator)
    assert CANARY not in _error(reconcile, 422, "invalid_input")


# ---- 9. duplicate keys ---------------------------------------------------------------------------------


def test_an_api_body_with_a_duplicate_key_is_refused_naming_its_path(served: Served) -> None:
    """`max_attempts` twice at the top, or a key twice deep inside the definition, answers 422 naming the
    key's path and no value; nothing is recorded."""
    auth = {**served.auth(served.tokens.submitter), "Content-Type": "application/json"}
    top = b'{"definition_hash": "sha256:' + b"0" * 64 + b'", "max_attempts": 1, "max_attempts": 20}'
    message = _error(served.client.post("/v1/runs", content=top, headers=auth), 422, "invalid_input")
    assert message == "invalid request: body: duplicate key max_attempts"
    deep = json.dumps({"definition": _inline()}).replace('"kind": "inline"', f'"kind": "inline", "kind": "{CANARY}"')
    message = _error(served.client.post("/v1/runs", content=deep.encode(), headers=auth), 422, "invalid_input")
    assert message == "invalid request: body: duplicate key definition.sources.nums.kind"
    listed = served.client.get("/v1/runs", headers=served.auth(served.tokens.viewer)).json()["runs"]
    assert [r["run_id"] for r in listed] == [served.atomic.run_id]


def test_definition_files_with_duplicate_keys_are_refused_naming_the_path(tmp_path: Path) -> None:
    """A JSON definition file and a YAML one holding a key twice are refused by load_definition with the
    key's path (and, for YAML, its line), never the values."""
    document = json.dumps(_inline())
    as_json = tmp_path / "flow.json"
    as_json.write_text(document.replace('"max_rows": 10', f'"max_rows": 10, "max_rows": "{CANARY}"'))
    with pytest.raises(InputError, match=r"flow\.json: invalid JSON: duplicate key output\.max_rows$") as caught:
        load_definition(as_json)
    assert CANARY not in caught.value.message
    as_yaml = tmp_path / "flow.yaml"
    as_yaml.write_text(
        "name: canaried\nversion: 1\nsources:\n  nums: {kind: inline, rows: [{n: 1}], schema: {n: int64}}\n"
        f"steps:\n  - name: result\n    sql: select n from nums\n    sql: {CANARY}\n"
        "output: {schema: {n: int64}, max_rows: 10, max_bytes: 1MiB}\n"
    )
    with pytest.raises(InputError, match=r"line 8, column 5: duplicate key steps\[0\]\.sql$") as caught:
        load_definition(as_yaml)
    assert CANARY not in caught.value.message
    as_json.write_text(document)
    assert load_definition(as_json).definition.name == "canaried"


def test_strict_json_names_the_first_duplicate_by_path() -> None:
    """strictjson.loads refuses a repeated key at any depth (in lists too) with its path, and parses
    documents without repeats exactly as json.loads does."""
    with pytest.raises(strictjson.DuplicateKey, match=r"^duplicate key a\[1\]\.b\.c$"):
        strictjson.loads('{"a": [{}, {"b": {"c": 1, "c": 2}}]}')
    with pytest.raises(strictjson.DuplicateKey, match=r"^duplicate key x$"):
        strictjson.loads('{"x": 1, "x": 1}')
    text = '{"a": [1, {"b": null}], "c": "d", "e": {"f": [true, 1.5]}}'
    assert strictjson.loads(text) == json.loads(text)
