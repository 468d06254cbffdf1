"""Property-based and leak tests of the API: schemathesis-generated requests from the OpenAPI document
never get a 500, and a planted secret never appears in any response body or header."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from durable_dataflow.api.app import create_app
from durable_dataflow.platform import Platform
from support.api_runs import (
    Tokens,
    copy_examples,
    grant_secrets,
    make_atomic_run,
    make_outcome_unknown_run,
    make_tokens,
    tenant_data_root,
    web_login,
)

EXAMPLES_PER_OPERATION = 12  # per operation of the OpenAPI document: every one is tried, with a dozen bodies


@pytest.fixture
def served(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[FastAPI, Tokens, Platform]]:
    platform = Platform(sqlite_url)
    examples = copy_examples(tmp_path)
    make_atomic_run(platform, examples, "acme")
    make_outcome_unknown_run(platform, examples, "acme")
    app = create_app(platform, data_root=tenant_data_root(tmp_path, examples))
    yield app, make_tokens(platform), platform
    platform.close()


def _fuzz(app: FastAPI, headers: dict[str, str], operation: Any, seen: dict[str, set[int]]) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        answer = case.call(app=app, headers=headers)
        seen.setdefault(operation.label, set()).add(answer.status_code)
        assert answer.status_code < 500, (operation.label, answer.status_code, answer.text[:500])
        if answer.status_code >= 400:
            assert set(answer.json()) == {"error"}, answer.text[:500]

    check()


def test_generated_requests_never_get_a_server_error(served: tuple[FastAPI, Tokens, Platform]) -> None:
    """Every documented operation, fed schemathesis-generated inputs with an operator token, answers < 500."""
    app, tokens, _ = served
    schema = schemathesis.openapi.from_dict(app.openapi())
    headers = {"Authorization": f"Bearer {tokens.operator}"}
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        _fuzz(app, headers, result.ok(), seen)
    assert "POST /v1/runs" in seen and "GET /v1/runs/{run_id}/evidence" in seen


CANARY_SECRET = "DDF_CANARY_DSN"


def test_a_planted_secret_appears_in_no_response(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A definition references a secret DSN; its value shows up in no JSON or HTML body and no header."""
    password = f"canary-{uuid.uuid4().hex}"
    value = f"postgresql://canary_user:{password}@127.0.0.1:1/canary_db"
    monkeypatch.setenv(CANARY_SECRET, value)
    grant_secrets(tmp_path, monkeypatch, {CANARY_SECRET: ["acme"]})
    platform = Platform(db_url)
    try:
        tokens = make_tokens(platform)
        client = TestClient(create_app(platform, data_root=tmp_path), follow_redirects=False)
        document = {
            "name": "canary",
            "version": 1,
            "sources": {"crm": {"kind": "postgres", "dsn": {"secret": CANARY_SECRET}, "query": "select 1 as n"}},
            "steps": [{"name": "n", "sql": "select n::BIGINT as n from crm"}],
            "output": {"schema": {"n": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
        }
        auth = {"Authorization": f"Bearer {tokens.operator}"}
        submitted = client.post("/v1/runs", json={"definition": document}, headers=auth)
        assert submitted.status_code == 201, submitted.text
        run_id = submitted.json()["run"]["run_id"]
        assert submitted.json()["run"]["status"] == "failed"  # the DSN points nowhere: the source read failed
        answers = [submitted]
        for path in ("/v1/runs", f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/evidence", "/v1/definitions",
                     "/v1/datasources", "/v1/ops/ledger", "/metrics", "/openapi.json"):  # fmt: skip
            answers.append(client.get(path, headers=auth))
        answers.append(client.post(f"/v1/runs/{run_id}/reconcile", json={}, headers=auth))
        assert web_login(client, tokens.operator).status_code == 303
        for page in ("/ui/runs", f"/ui/runs/{run_id}", "/ui/ops"):
            answers.append(client.get(page))
        assert all(a.status_code < 500 for a in answers)
        for answer in answers:
            blob = answer.text + " ".join(f"{k}: {v}" for k, v in answer.headers.items())
            assert password not in blob, answer.request.url
            assert value not in blob
        assert re.search(CANARY_SECRET, answers[3].text)  # the reference by name is shown, the value is not
    finally:
        platform.close()
