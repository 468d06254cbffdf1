"""Run page and /docs polish (issue 30): ledger facts as JSON, no alert link to the page it is on,
and /docs names where the API reference is."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from durable_dataflow.api import web
from durable_dataflow.api.app import create_app
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.platform import Platform
from support.api_runs import Tokens, copy_examples, make_outcome_unknown_run, make_tokens, web_login

FACT = re.compile(r'<li><span class="muted">([^<]*)</span> <code>([^<]*)</code></li>')


@pytest.fixture
def site(db_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Run, Tokens]]:
    platform = Platform(db_url)
    unknown = make_outcome_unknown_run(platform, copy_examples(tmp_path), "acme")
    tokens = make_tokens(platform)
    yield TestClient(create_app(platform), follow_redirects=False), unknown, tokens
    platform.close()


def _page(client: TestClient, token: str, url: str) -> str:
    assert web_login(client, token).status_code == 303
    answer = client.get(url)
    assert answer.status_code == 200, answer.text
    return answer.text


def test_ledger_facts_are_json_values(site: tuple[TestClient, Run, Tokens]) -> None:
    """Every fact in the run page's ledger timeline parses as JSON (strings and an object's keys in double
    quotes, never a Python repr's single ones), the facts include a string and an object, and the
    filter writes a missing value as `null`, not `None`."""
    client, unknown, tokens = site
    text = _page(client, tokens.viewer, f"/ui/runs/{unknown.run_id}")
    facts = [(name, json.loads(html.unescape(value))) for name, value in FACT.findall(text)]
    assert facts, "no ledger facts on the run page"
    kinds = {type(value) for _, value in facts}
    assert str in kinds and dict in kinds, facts
    assert web.json_value(None) == "null" and web.json_value({"a": None}) == '{"a": null}'


def test_the_alert_links_to_the_run_only_from_other_pages(site: tuple[TestClient, Run, Tokens]) -> None:
    """The unresolved alert's "open the run" link is absent on that run's own page and present on the
    runs list, where it leads somewhere."""
    client, unknown, tokens = site
    link = f'<a href="/ui/runs/{unknown.run_id}">open the run</a>'
    own = _page(client, tokens.viewer, f"/ui/runs/{unknown.run_id}")
    assert 'role="alert"' in own and link not in own and "press Reconcile below" in own
    assert link in client.get("/ui/runs").text


def test_docs_says_where_the_api_reference_is(site: tuple[TestClient, Run, Tokens]) -> None:
    """GET /docs (and /redoc) answer 404 not_found whose message names /openapi.json and docs/api.md."""
    client, _, _ = site
    for path in ("/docs", "/redoc"):
        answer = client.get(path)
        assert answer.status_code == 404, answer.text
        error = answer.json()["error"]
        assert error["code"] == "not_found", error
        assert "/openapi.json" in error["message"] and "docs/api.md" in error["message"], error
