"""Inline execution never blocks reads (issue 29 finding 2), on SQLite and PostgreSQL. FastAPI's thread pool
is shrunk to one thread, so on the old code one slow inline submit held every thread a read needs; the
slow run is a DuckDB execution held at its DURING_EXECUTION point by an Event the test controls (no sleep
decides an order). While it is held, reads and /healthz answer, and a second inline submit past the
inline limit answers 429 with Retry-After at once, recording nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from durable_dataflow.api.app import create_app
from durable_dataflow.core import crashpoints
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import Tokens, make_tokens

GATE_WAIT_S = 30.0  # the held execution goes on by itself after this, so a failing test cannot hang
ANSWER_WAIT_S = 10.0  # how long a read may take while the slow run is held (it answers in milliseconds)


@dataclass
class Gate:
    """Holds the first execution that reaches DURING_EXECUTION until ``release``; later ones pass."""

    entered: threading.Event
    release: threading.Event
    held_once: bool = False

    def hook(self, point: str) -> None:
        if point != crashpoints.DURING_EXECUTION or self.held_once:
            return
        self.held_once = True
        self.entered.set()
        self.release.wait(GATE_WAIT_S)


@dataclass(frozen=True)
class Held:
    platform: Platform
    client: TestClient
    tokens: Tokens
    slow: Future[Any]  # the inline submit held at its execution

    def submit(self, token: str, day: str, *, queue: bool = False) -> Any:
        return submit(self.client, token, day, queue=queue)

    def runs(self) -> int:
        with self.platform.db.read() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(dataflow_runs)).scalar_one())


def submit(client: TestClient, token: str, day: str, *, queue: bool = False) -> Any:
    body = {"definition": flows.daily_flow(), "parameters": {"day": day}}
    headers = {"Authorization": f"Bearer {token}"}
    return client.post("/v1/runs?queue=true" if queue else "/v1/runs", json=body, headers=headers)


def one_api_thread() -> None:
    """FastAPI's (anyio's) thread pool down to one thread: the old code's 40 threads, all held."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = 1


@pytest.fixture
def held(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Held]:
    monkeypatch.setenv("DATAFLOW_INLINE_EXECUTIONS_MAX", "2")
    monkeypatch.setenv("DATAFLOW_QUOTA_INLINE_EXECUTIONS", "1")
    gate = Gate(threading.Event(), threading.Event())
    crashpoints.set_hook(gate.hook)
    platform = Platform(db_url)
    pool = ThreadPoolExecutor(max_workers=4)
    try:
        with TestClient(create_app(platform, data_root=tmp_path / "tenants")) as client:
            client.portal.call(one_api_thread)  # type: ignore[union-attr]  # set inside the app's event loop
            tokens = make_tokens(platform)
            slow = pool.submit(submit, client, tokens.submitter, "2026-03-01")
            assert gate.entered.wait(GATE_WAIT_S), "the slow inline run never started executing"
            yield Held(platform, client, tokens, slow)
            gate.release.set()
            assert slow.result(GATE_WAIT_S).status_code == 201
    finally:
        gate.release.set()
        crashpoints.set_hook(None)
        pool.shutdown(wait=True)
        platform.close()


def answered_promptly(call: Any) -> Any:
    """``call()``'s answer, which must come while the slow run is still held."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(call).result(ANSWER_WAIT_S)


def test_reads_answer_while_an_inline_run_executes(held: Held) -> None:
    """With the one API thread free of the held inline run, GET /v1/runs?limit=1 and /healthz answer."""
    headers = {"Authorization": f"Bearer {held.tokens.viewer}"}
    listed = answered_promptly(lambda: held.client.get("/v1/runs?limit=1", headers=headers))
    assert listed.status_code == 200 and listed.json()["runs"][0]["status"] == "running"
    assert answered_promptly(lambda: held.client.get("/healthz")).status_code == 200
    assert not held.slow.done()


def test_a_second_inline_submit_past_the_tenant_limit_answers_429(held: Held) -> None:
    """The tenant's inline_executions quota is 1: its second inline submit answers 429 (Retry-After, the quota
    named) and records nothing, while a queued submit of the same tenant is recorded as before."""
    refused = answered_promptly(lambda: held.submit(held.tokens.submitter, "2026-03-02"))
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["quota"] == "inline_executions"
    assert held.runs() == 1
    queued = answered_promptly(lambda: held.submit(held.tokens.submitter, "2026-03-02", queue=True))
    assert queued.status_code == 201 and queued.json()["run"]["status"] == "queued"


def test_the_server_wide_inline_limit_refuses_every_tenant(held: Held) -> None:
    """The server admits 2 inline executions: another tenant's inline run (not held) completes, and with the
    held one plus a third tenant's, the server is full for everyone: 429 inline_executions_max."""
    done = answered_promptly(lambda: held.submit(held.tokens.other_operator, "2026-03-02"))
    assert done.status_code == 201 and done.json()["run"]["status"] == "succeeded"
    executor = held.client.app.state.inline  # type: ignore[attr-defined]
    executor._reserve("initech")  # a third tenant's execution in flight
    try:
        refused = answered_promptly(lambda: held.submit(held.tokens.other_operator, "2026-03-03"))
    finally:
        executor._release("initech")
    assert refused.status_code == 429 and refused.json()["error"]["quota"] == "inline_executions_max"
    assert "Retry-After" in refused.headers
