"""The web operator view through the ASGI app: login cookie, the unresolved-run warning, the run page,
CSRF-safe reconciliation, role and tenant checks, and the accessibility basics of every page."""

from __future__ import annotations

import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from durable_dataflow.api.app import create_app
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.platform import Platform
from support.api_runs import (
    Tokens,
    copy_examples,
    make_atomic_run,
    make_outcome_unknown_run,
    make_queued_run,
    make_tokens,
    web_login,
)

PAGES = ["/ui/runs", "/ui/runs/{run}", "/ui/ops", "/ui/schedules"]


class Web:
    def __init__(self, platform: Platform, unknown: Run, atomic: Run, tokens: Tokens) -> None:
        self.platform = platform
        self.unknown = unknown
        self.atomic = atomic
        self.tokens = tokens
        self.app = create_app(platform)

    def client(self, token: str | None = None) -> TestClient:
        client = TestClient(self.app, follow_redirects=False)
        if token is not None:
            answer = web_login(client, token)
            assert answer.status_code == 303, answer.text
        return client

    def url(self, page: str) -> str:
        return page.replace("{run}", self.unknown.run_id)


@pytest.fixture
def web(db_url: str, tmp_path: Path) -> Iterator[Web]:
    platform = Platform(db_url)
    examples = copy_examples(tmp_path)
    atomic = make_atomic_run(platform, examples, "acme")
    unknown = make_outcome_unknown_run(platform, examples, "acme")
    yield Web(platform, unknown, atomic, make_tokens(platform))
    platform.close()


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert found is not None, "no CSRF field on the page"
    return found.group(1)


class _Alerts(HTMLParser):
    """Collects the text inside every role="alert" element."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.alerts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.depth:
            self.depth += 1
        elif ("role", "alert") in attrs:
            self.depth = 1
            self.alerts.append("")

    def handle_endtag(self, tag: str) -> None:
        if self.depth:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.alerts[-1] += data


def alerts_of(html: str) -> list[str]:
    parser = _Alerts()
    parser.feed(html)
    return [" ".join(a.split()) for a in parser.alerts]


@pytest.mark.parametrize("page", PAGES)
def test_pages_without_a_session_go_to_login(web: Web, page: str) -> None:
    """Without the session cookie (or with a bad one) every page redirects to the login form."""
    assert web.client().get(web.url(page)).headers["location"] == "/ui/login"
    bad = TestClient(web.app, follow_redirects=False, cookies={"ddf_session": "ddf_" + "y" * 43})
    assert bad.get(web.url(page)).headers["location"] == "/ui/login"


def test_login_sets_a_strict_httponly_cookie_and_refuses_bad_tokens(web: Web) -> None:
    """A good token gets an HttpOnly, SameSite=Strict cookie; a bad one gets the form again with 401."""
    client = web.client()
    ok = web_login(client, web.tokens.viewer)
    cookie = next(c for c in ok.headers.get_list("set-cookie") if c.startswith("ddf_session=")).lower()
    assert ok.status_code == 303 and "httponly" in cookie and "samesite=strict" in cookie
    bad = web_login(web.client(), "ddf_nope")
    assert bad.status_code == 401 and "unknown or revoked" in bad.text


def test_history_warns_loudly_about_the_unresolved_run(web: Web) -> None:
    """The history page carries a role=alert block with the meaning, key, digest and what to do; never 'failed'."""
    html = web.client(web.tokens.viewer).get("/ui/runs").text
    alerts = [a for a in alerts_of(html) if web.unknown.run_id in a or str(web.unknown.output_digest) in a]
    assert len(alerts) == 1, alerts_of(html)
    warning = alerts[0]
    assert "Unresolved" in warning and "external output may exist" in warning
    assert str(web.unknown.publication_idempotency_key) in warning
    assert str(web.unknown.output_digest) in warning
    assert "reconcile" in warning.lower()
    assert "failed" not in warning.lower() and "absent" not in warning.lower()
    assert web.atomic.run_id in html and "outcome_unknown" in html and "verified" in html


def test_run_page_shows_timeline_verification_and_publication(web: Web) -> None:
    """The run page lists the ledger entries, the verification result and the publication references."""
    html = web.client(web.tokens.viewer).get(web.url("/ui/runs/{run}")).text
    for kind in ("run.recorded", "attempt.started", "dispatch.authorized", "publication.unknown"):
        assert kind in html
    assert "The evidence chain verifies" in html
    assert "Publication idempotency key" in html and str(web.unknown.publication_idempotency_key) in html
    assert "<button" in html and "Reconcile</button>" not in html  # viewers get no Reconcile button


def test_pages_show_parameters_and_the_history_filters_by_definition(web: Web) -> None:
    """The run page and the history show each run's parameters; the history filters by definition name
    and by one NAME=VALUE parameter."""
    client = web.client(web.tokens.viewer)
    page = client.get(f"/ui/runs/{web.atomic.run_id}").text
    assert "Parameters" in page and "day=2026-11-02" in page
    history = client.get("/ui/runs").text
    assert '<th scope="col">Parameters</th>' in history and "day=2026-11-02" in history
    atomic_only = client.get("/ui/runs?definition=revenue_by_region").text
    assert web.atomic.run_id in atomic_only and web.unknown.run_id not in atomic_only
    publish_only = client.get("/ui/runs?definition=daily_orders_publish&param=day%3D2026-11-02").text
    assert web.unknown.run_id in publish_only and web.atomic.run_id not in publish_only
    assert 'value="daily_orders_publish"' in publish_only
    none = client.get("/ui/runs?param=day%3D2026-11-03").text
    assert web.atomic.run_id not in none and web.unknown.run_id not in none and "No runs match." in none
    bad = client.get("/ui/runs?param=2026-11-02")
    assert bad.status_code == 422 and "2026-11-02" not in bad.text


def test_operator_reconciles_from_the_run_page(web: Web) -> None:
    """The operator's form POST (with its CSRF token) reconciles and the page shows the finding."""
    client = web.client(web.tokens.operator)
    page = client.get(web.url("/ui/runs/{run}")).text
    assert "Reconcile</button>" in page
    without_csrf = client.post(web.url("/ui/runs/{run}/reconcile"), data={"csrf": "0" * 64})
    assert without_csrf.status_code == 403
    assert web.platform.runs.get(web.unknown.run_id).status == "outcome_unknown"
    answer = client.post(web.url("/ui/runs/{run}/reconcile"), data={"csrf": csrf_of(page)})
    assert answer.status_code == 303
    shown = client.get(answer.headers["location"]).text
    assert "Reconciliation result: present" in shown and "reconciled_present" in shown
    assert web.platform.runs.get(web.unknown.run_id).status == "succeeded"


def test_operator_cancels_from_the_run_page(web: Web, tmp_path: Path) -> None:
    """A queued run's page offers the operator a Cancel button (not a viewer, nor the unresolved run's
    page); the form POST with its CSRF token cancels it and the page says so."""
    queued = make_queued_run(web.platform, copy_examples(tmp_path / "more"), "acme", "web-cancel")
    viewer_page = web.client(web.tokens.viewer).get(f"/ui/runs/{queued.run_id}").text
    assert "Cancel this run</button>" not in viewer_page
    assert "Cancel this run</button>" not in web.client(web.tokens.operator).get(web.url("/ui/runs/{run}")).text
    client = web.client(web.tokens.operator)
    page = client.get(f"/ui/runs/{queued.run_id}").text
    assert "Cancel this run</button>" in page
    assert client.post(f"/ui/runs/{queued.run_id}/cancel", data={"csrf": "0" * 64}).status_code == 403
    assert web.platform.runs.get(queued.run_id).status == "queued"
    answer = client.post(f"/ui/runs/{queued.run_id}/cancel", data={"csrf": csrf_of(page)})
    assert answer.status_code == 303
    shown = client.get(answer.headers["location"]).text
    assert "<strong>Cancelled.</strong>" in shown and "run.cancelled" in shown
    assert web.platform.runs.get(queued.run_id).status == "cancelled"
    refused = client.post(web.url("/ui/runs/{run}/cancel"), data={"csrf": csrf_of(page)})
    assert refused.status_code == 409 and "dataflow reconcile" in refused.text


def test_viewers_cannot_reconcile_or_see_ops(web: Web) -> None:
    """A viewer's reconcile POST (even with a valid CSRF token) and the ops page are 403."""
    client = web.client(web.tokens.viewer)
    csrf = csrf_of(client.get("/ui/runs").text)
    assert client.post(web.url("/ui/runs/{run}/reconcile"), data={"csrf": csrf}).status_code == 403
    assert client.get("/ui/ops").status_code == 403
    assert web.platform.runs.get(web.unknown.run_id).status == "outcome_unknown"


def test_another_tenant_gets_404_on_the_run_page(web: Web) -> None:
    """A globex operator opening or reconciling an acme run gets 404 and changes nothing."""
    client = web.client(web.tokens.other_operator)
    assert client.get(web.url("/ui/runs/{run}")).status_code == 404
    csrf = csrf_of(client.get("/ui/runs").text)
    assert client.post(web.url("/ui/runs/{run}/reconcile"), data={"csrf": csrf}).status_code == 404
    assert web.unknown.run_id not in client.get("/ui/ops").text
    assert web.platform.runs.get(web.unknown.run_id).status == "outcome_unknown"


def test_ops_page_shows_the_oldest_unresolved_run(web: Web) -> None:
    """The ops page counts the unresolved run and names it as the oldest."""
    html = web.client(web.tokens.operator).get("/ui/ops").text
    assert "Unresolved runs: 1" in html and f"Oldest unresolved: {web.unknown.run_id}" in html


@pytest.mark.parametrize("page", [*PAGES, "/ui/login"])
def test_pages_have_language_labels_and_header_scopes(web: Web, page: str) -> None:
    """Every page declares its language; every table header has a scope; every input has a label."""
    html = web.client(web.tokens.operator).get(web.url(page)).text
    assert '<html lang="en">' in html
    assert all("scope=" in th for th in re.findall(r"<th\b[^>]*>", html))
    for field_id in re.findall(r'<(?:input|select)\b[^>]*\bid="([^"]+)"', html):
        assert f'for="{field_id}"' in html, field_id
    for hidden in re.findall(r"<input\b[^>]*>", html):
        assert 'type="hidden"' in hidden or "id=" in hidden, hidden
