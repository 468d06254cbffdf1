"""The JSON API on SQLite and PostgreSQL: authentication and tenant isolation on every route, roles,
submit/replay/conflict, listing with filters and cursors, evidence, reconciliation, health, metrics."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from durable_dataflow.api import tokens, v1
from durable_dataflow.api.app import create_app
from durable_dataflow.api.errors import HTTP_STATUS_BY_CODE
from durable_dataflow.core import errors
from durable_dataflow.dataflow.protocol.requests import AccessContext
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import contract
from durable_dataflow.platform import Platform
from support.api_runs import (
    API_ROUTES,
    Tokens,
    copy_examples,
    make_atomic_run,
    make_outcome_unknown_run,
    make_queued_run,
    make_tokens,
    tenant_data_root,
)

RUN_ROUTES = [r for r in API_ROUTES if "{run}" in r[1]]
PUBLIC_ROUTES = {("GET", "/healthz")}


@dataclass(frozen=True)
class World:
    platform: Platform
    client: TestClient
    tokens: Tokens
    atomic: Run
    unknown: Run
    examples: Path

    def auth(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    def call(self, method: str, path: str, token: str | None, body: Any = None, **kwargs: Any) -> Any:
        headers = self.auth(token) if token else {}
        headers.update(kwargs.pop("headers", {}))
        url = path.replace("{run}", self.unknown.run_id)
        return self.client.request(method, url, json=body, headers=headers, **kwargs)


@pytest.fixture
def world(db_url: str, tmp_path: Path) -> Iterator[World]:
    platform = Platform(db_url)
    examples = copy_examples(tmp_path)
    atomic = make_atomic_run(platform, examples, "acme")
    unknown = make_outcome_unknown_run(platform, examples, "acme")
    make_atomic_run(platform, examples, "globex")
    app = create_app(platform, data_root=tenant_data_root(tmp_path, examples))
    with TestClient(app) as client:
        yield World(platform, client, make_tokens(platform), atomic, unknown, examples)
    platform.close()


def test_route_list_covers_every_route(world: World) -> None:
    """The parametrized route list is the app's whole documented surface: a new route must join it."""
    document = world.client.app.openapi()  # type: ignore[attr-defined]
    documented = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    listed = {(method, path.replace("{run}", "{run_id}")) for method, path, _ in API_ROUTES}
    assert documented - PUBLIC_ROUTES == listed - {("GET", "/openapi.json")}


@pytest.mark.parametrize(("method", "path", "body"), API_ROUTES)
def test_every_route_refuses_a_missing_or_bad_token(world: World, method: str, path: str, body: Any) -> None:
    """No token, a malformed one, an unknown one and a revoked one all answer 401 with the JSON error."""
    revoked, info = tokens.create_token(world.platform.db, "acme", "operator", "revoked")
    tokens.revoke_token(world.platform.db, info.token_id)
    for token in (None, "not-a-token", "ddf_" + "x" * 43, revoked):
        answer = world.call(method, path, token, body)
        assert answer.status_code == 401, (token, answer.text)
        assert answer.json()["error"]["code"] == "unauthenticated"
        assert answer.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize(("method", "path", "body"), RUN_ROUTES)
def test_another_tenant_gets_404_on_every_run_route(world: World, method: str, path: str, body: Any) -> None:
    """A globex operator asking for an acme run gets 404, the same answer as for a run that does not exist."""
    answer = world.call(method, path, world.tokens.other_operator, body)
    assert answer.status_code == 404, answer.text
    missing = world.call(method, path.replace("{run}", "01a00000-0000-7000-8000-000000000000"), world.tokens.operator)
    assert missing.status_code == 404
    assert answer.json()["error"]["code"] == missing.json()["error"]["code"] == "not_found"
    assert world.platform.runs.get(world.unknown.run_id).status == "outcome_unknown"  # nothing was done


def test_listings_never_show_another_tenants_runs(world: World) -> None:
    """Run lists, definitions and the ops projection of globex hold none of acme's runs or definitions."""
    token = world.tokens.other_operator
    runs = world.call("GET", "/v1/runs", token).json()["runs"]
    assert runs and {r["tenant"] for r in runs} == {"globex"}
    definitions = world.call("GET", "/v1/definitions", token).json()["definitions"]
    assert {d["name"] for d in definitions} == {"revenue_by_region"}
    ops = world.call("GET", "/v1/ops/ledger", token).json()
    assert ops["tenant"] == "globex" and ops["unresolved_total"] == 0
    assert world.unknown.run_id not in str(ops)
    body = {"definition_hash": world.unknown.definition_hash, "parameters": {"day": "2026-11-02"}}
    submitted = world.call("POST", "/v1/runs", token, body)
    assert submitted.status_code == 404  # acme's pinned definition is not globex's to run


@pytest.mark.parametrize(
    ("role", "method", "path", "body", "allowed"),
    [
        ("viewer", "GET", "/v1/runs", None, True),
        ("viewer", "GET", "/v1/runs/{run}/evidence", None, True),
        ("viewer", "POST", "/v1/runs", {"definition_hash": "sha256:" + "0" * 64}, False),
        ("viewer", "POST", "/v1/runs/{run}/reconcile", {}, False),
        ("viewer", "GET", "/v1/ops/ledger", None, False),
        ("viewer", "GET", "/metrics", None, False),
        ("submitter", "POST", "/v1/runs/{run}/reconcile", {}, False),
        ("viewer", "POST", "/v1/runs/{run}/cancel", None, False),
        ("submitter", "POST", "/v1/runs/{run}/cancel", None, False),
        ("submitter", "GET", "/metrics", None, False),
        ("operator", "GET", "/metrics", None, True),
        ("operator", "GET", "/v1/ops/ledger", None, True),
    ],
)
def test_roles(world: World, role: str, method: str, path: str, body: Any, allowed: bool) -> None:
    """Viewers read; submitters also submit; only operators reconcile and read ops and metrics (403 otherwise)."""
    answer = world.call(method, path, getattr(world.tokens, role), body)
    if allowed:
        assert answer.status_code == 200, answer.text
    else:
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"]["code"] == "permission_denied"
    assert world.platform.runs.get(world.unknown.run_id).status == "outcome_unknown"


def test_operator_cancels_a_queued_run_and_is_refused_after_authorization(world: World) -> None:
    """A queued run is cancelled, recording the token as who asked; again changes nothing; the
    outcome_unknown run (dispatch authorized) is 409 with the reconcile instruction and unchanged."""
    queued = make_queued_run(world.platform, world.examples, "acme", "to-cancel")
    path = f"/v1/runs/{queued.run_id}/cancel"
    answer = world.call("POST", path, world.tokens.operator)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["cancelled"] is True
    assert (data["run"]["status"], data["run"]["recovery_status"]) == ("cancelled", "no_external_output")
    evidence = world.call("GET", f"/v1/runs/{queued.run_id}/evidence", world.tokens.viewer).json()
    head = evidence["entries"][-1]
    assert head["kind"] == "run.cancelled" and head["payload"]["principal"].startswith("token:")
    assert head["payload"]["provenance"]["trigger"] == "api" and evidence["verification"]["ok"]
    again = world.call("POST", path, world.tokens.operator)
    assert again.status_code == 200 and again.json()["cancelled"] is False
    refused = world.call("POST", "/v1/runs/{run}/cancel", world.tokens.operator)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "conflict"
    assert f"dataflow reconcile {world.unknown.run_id}" in refused.json()["error"]["message"]
    assert world.platform.runs.get(world.unknown.run_id).status == "outcome_unknown"


def test_submit_created_replayed_and_conflicting(world: World) -> None:
    """201 for a new run, 200 with the same run on replay, 409 for another request under the key."""
    body = {"definition_hash": world.atomic.definition_hash, "parameters": {"day": "2026-11-02"}}
    key = {"Idempotency-Key": "nightly-2026-11-02"}
    first = world.call("POST", "/v1/runs", world.tokens.submitter, body, headers=key)
    assert first.status_code == 201, first.text
    run = first.json()["run"]
    assert run["status"] == "succeeded" and run["row_count"] == world.atomic.row_count
    replay = world.call("POST", "/v1/runs", world.tokens.operator, body, headers=key)
    assert replay.status_code == 200 and replay.json()["run"]["run_id"] == run["run_id"]
    other_day = {**body, "parameters": {"day": "2026-11-03"}}
    conflict = world.call("POST", "/v1/runs", world.tokens.submitter, other_day, headers=key)
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "conflict"
    listed = world.call("GET", "/v1/runs?definition=revenue_by_region", world.tokens.viewer).json()["runs"]
    assert sum(1 for r in listed if r["idempotency_key"] == "nightly-2026-11-02") == 1


def test_list_filters_by_parameter(world: World) -> None:
    """`param=NAME=VALUE` (repeatable, all must match) keeps the runs holding that canonical value, as
    `dataflow runs --param` does; a param without NAME= is 422 naming its position, never echoing it."""
    body = {"definition_hash": world.atomic.definition_hash, "parameters": {"day": "2026-11-03"}}
    other = world.call("POST", "/v1/runs?queue=true", world.tokens.submitter, body).json()["run"]
    viewer = world.tokens.viewer
    listed = world.call("GET", "/v1/runs?param=day%3D2026-11-03", viewer).json()["runs"]
    assert [r["run_id"] for r in listed] == [other["run_id"]] and listed[0]["parameters"] == {"day": "2026-11-03"}
    both = world.call("GET", "/v1/runs?definition=revenue_by_region&param=day=2026-11-02", viewer).json()["runs"]
    assert [r["run_id"] for r in both] == [world.atomic.run_id]
    assert world.call("GET", "/v1/runs?param=day=2026-11-02&param=day=2026-11-03", viewer).status_code == 422
    bad = world.call("GET", "/v1/runs?param=day=2026-11-02&param=s3cr3t", viewer)
    assert bad.status_code == 422 and "param number 2" in bad.text and "s3cr3t" not in bad.text
    assert world.call("GET", "/v1/runs?param=day=2026%00", viewer).status_code == 422


def test_submit_records_the_callers_identity(world: World) -> None:
    """The run's principal, provenance and access-context digest come from the token, trigger api."""
    body = {"definition_hash": world.atomic.definition_hash, "parameters": {"day": "2026-11-02"}}
    answer = world.call("POST", "/v1/runs?queue=true", world.tokens.submitter, body)
    assert answer.status_code == 201
    run = answer.json()["run"]
    assert run["status"] == "queued"  # recorded only, for a worker
    assert run["principal"] == "token:acme-submitter"
    assert run["provenance"]["trigger"] == "api" and run["provenance"]["actor"] == "token:acme-submitter"
    expected = AccessContext("acme", "token:acme-submitter", ("submitter",), (), "token").digest()
    assert run["access_context_digest"] == expected


def test_submit_inline_definition_and_confined_paths(world: World) -> None:
    """An inline document runs against the server's data root; a path escaping it is 422 and records nothing."""
    document = {
        "name": "inline_orders",
        "version": 1,
        "sources": {"orders": {"kind": "csv", "path": "data/orders.csv"}},
        "steps": [{"name": "n", "sql": "select count(*)::BIGINT as n from orders"}],
        "output": {"schema": {"n": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
    }
    ok = world.call("POST", "/v1/runs", world.tokens.submitter, {"definition": document})
    assert ok.status_code == 201, ok.text
    assert ok.json()["run"]["status"] == "succeeded"
    escaping = {**document, "sources": {"orders": {"kind": "csv", "path": "../../../../etc/passwd"}}}
    bad = world.call("POST", "/v1/runs", world.tokens.submitter, {"definition": escaping})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_input"
    both = world.call("POST", "/v1/runs", world.tokens.submitter, {"definition": document, "definition_hash": "x"})
    assert both.status_code == 422
    total = len(world.call("GET", "/v1/runs", world.tokens.viewer).json()["runs"])
    assert total == 3  # atomic, unknown, and the one good inline run


def test_list_filters_and_cursor_pagination(world: World) -> None:
    """Filters narrow the list; pages of 2 walk every run once, newest first; bad cursors and limits are 422."""
    body = {"definition_hash": world.atomic.definition_hash, "parameters": {"day": "2026-11-02"}}
    for _ in range(3):
        assert world.call("POST", "/v1/runs?queue=true", world.tokens.submitter, body).status_code == 201
    viewer = world.tokens.viewer
    unknown = world.call("GET", "/v1/runs?status=outcome_unknown", viewer).json()["runs"]
    assert [r["run_id"] for r in unknown] == [world.unknown.run_id] and unknown[0]["unresolved"] is True
    assert "UNRESOLVED" in unknown[0]["warning"]
    assert len(world.call("GET", "/v1/runs?recovery_status=recorded", viewer).json()["runs"]) == 3
    assert world.call("GET", "/v1/runs?created_after=2999-01-01T00:00:00Z", viewer).json()["runs"] == []
    seen: list[dict[str, Any]] = []
    cursor: str | None = None
    for _ in range(10):
        page = world.call("GET", "/v1/runs", viewer, params={"limit": 2, **({"cursor": cursor} if cursor else {})})
        data = page.json()
        seen.extend(data["runs"])
        cursor = data["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == 5 and len({r["run_id"] for r in seen}) == 5
    keys = [(r["created_at_us"], r["run_id"]) for r in seen]
    assert keys == sorted(keys, reverse=True)
    for bad in ({"cursor": "!!!"}, {"cursor": "WzEsMiwzXQ"}, {"limit": 201}, {"limit": 0}, {"status": "nope"}):
        answer = world.call("GET", "/v1/runs", viewer, params=bad)
        assert answer.status_code == 422, bad
        assert answer.json()["error"]["code"] == "invalid_input"


def test_evidence_shows_entries_verification_and_checkpoint(world: World) -> None:
    """Evidence lists the ledger from run.recorded, a verification that holds, and the verified checkpoint."""
    atomic = world.call("GET", f"/v1/runs/{world.atomic.run_id}/evidence", world.tokens.viewer).json()
    kinds = [e["kind"] for e in atomic["entries"]]
    assert kinds[0] == "run.recorded" and "run.succeeded" in kinds
    assert atomic["verification"]["ok"] is True
    assert atomic["verification"]["entry_count"] == len(kinds)
    assert atomic["checkpoint"]["status"] == "succeeded"
    unknown = world.call("GET", "/v1/runs/{run}/evidence", world.tokens.viewer).json()
    assert "dispatch.authorized" in [e["kind"] for e in unknown["entries"]]
    assert unknown["run"]["status"] == "outcome_unknown"
    assert unknown["checkpoint"]["status"] == "outcome_unknown"  # every terminal state is checkpointed
    assert unknown["checkpoint"]["head_seq"] == unknown["entries"][-1]["seq"]


def test_operator_reconciles_an_outcome_unknown_run(world: World) -> None:
    """The operator's reconcile inspects the sink: present with the digest -> succeeded; again -> 409."""
    answer = world.call("POST", "/v1/runs/{run}/reconcile", world.tokens.operator, {"resume": False})
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["finding"] == "present"
    assert data["run"]["status"] == "succeeded" and data["run"]["recovery_status"] == "reconciled_present"
    assert data["run"]["publication_ref"]
    again = world.call("POST", "/v1/runs/{run}/reconcile", world.tokens.operator, {})
    assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
    atomic = world.call("POST", f"/v1/runs/{world.atomic.run_id}/reconcile", world.tokens.operator, {})
    assert atomic.status_code == 409


def test_healthz_openapi_and_metrics(world: World) -> None:
    """/healthz needs no token; /openapi.json needs one; /metrics shows runs, unresolved and latencies."""
    health = world.client.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    document = world.call("GET", "/openapi.json", world.tokens.viewer).json()
    assert "/v1/runs" in document["paths"] and "/v1/ops/ledger" in document["paths"]
    world.call("GET", "/v1/runs", world.tokens.viewer)
    text = world.call("GET", "/metrics", world.tokens.operator).text
    assert "dataflow_unresolved_runs 1.0" in text
    assert 'dataflow_runs{status="outcome_unknown"} 1.0' in text
    assert 'dataflow_attempt_outcomes_total{outcome="outcome_unknown"} 1.0' in text
    assert 'dataflow_api_request_seconds_count{method="GET",route="/v1/runs",status="200"}' in text


def test_serve_observes_the_duration_of_each_run_it_executes_inline(world: World) -> None:
    """Proves `serve`'s /metrics carries dataflow_run_duration_seconds for the runs it executed inline (it was
    empty on serve: only workers observed it), once per execution: neither a replay nor a queued submit,
    which this process does not execute, is counted."""
    body = {"definition_hash": world.atomic.definition_hash, "parameters": {"day": "2026-11-05"}}
    series = 'dataflow_run_duration_seconds_count{definition="revenue_by_region",mode="atomic"}'
    assert series not in world.call("GET", "/metrics", world.tokens.operator).text
    key = {"Idempotency-Key": "inline-duration"}
    assert world.call("POST", "/v1/runs", world.tokens.submitter, body, headers=key).status_code == 201
    assert world.call("POST", "/v1/runs", world.tokens.submitter, body, headers=key).status_code == 200
    queued = world.call("POST", "/v1/runs?queue=true", world.tokens.submitter,
                        {**body, "parameters": {"day": "2026-11-06"}})  # fmt: skip
    assert queued.status_code == 201 and queued.json()["run"]["status"] == "queued"
    assert f"{series} 1.0" in world.call("GET", "/metrics", world.tokens.operator).text


def test_result_downloads_at_once_are_bounded_and_each_slot_comes_back(world: World) -> None:
    """Proves GET /v1/runs/{id}/result takes one of RESULT_DOWNLOADS_MAX slots for its stream: with every slot
    held (clients that never read) the next download answers 503 storage_unavailable at once (a hostile
    review pinned ≈ 10 MiB of server memory per stalled download, without bound); a finished download gives
    its slot back."""
    slots = world.client.app.state.result_downloads  # type: ignore[attr-defined]
    url = f"/v1/runs/{world.atomic.run_id}/result"
    taken = [slots.acquire(blocking=False) for _ in range(v1.RESULT_DOWNLOADS_MAX)]
    assert all(taken)
    busy = world.call("GET", url, world.tokens.viewer)
    assert busy.status_code == 503 and busy.json()["error"]["code"] == "storage_unavailable", busy.text
    slots.release()
    whole = world.call("GET", url, world.tokens.viewer)
    assert whole.status_code == 200 and len(whole.content) == int(whole.headers["Content-Length"]) > 0
    assert slots.acquire(blocking=False), "the finished download kept its slot"
    for _ in range(v1.RESULT_DOWNLOADS_MAX):
        slots.release()


def test_invented_http_methods_share_one_metrics_label(world: World) -> None:
    """Proves requests with invented methods (HTTP allows any token; each label value was a series kept
    for the life of the process, so an unauthenticated client could grow /metrics without bound) are
    counted under method="other", while the standard methods keep their own label."""
    for index in range(20):
        world.client.request(f"X{index:03d}INVENTED", "/healthz")
    text = world.call("GET", "/metrics", world.tokens.operator).text
    assert "INVENTED" not in text
    assert 'dataflow_api_request_seconds_count{method="other",route="/healthz",status="405"} 20.0' in text


def test_two_apps_have_separate_metrics(world: World) -> None:
    """Each app has its own registry: requests to one never count in the other's histogram."""
    other = TestClient(create_app(world.platform))
    for _ in range(3):
        other.get("/v1/runs", headers=world.auth(world.tokens.viewer))
    text = world.call("GET", "/metrics", world.tokens.operator).text
    assert 'route="/v1/runs"' not in text


def test_every_error_code_has_an_http_status() -> None:
    """The one table maps every DataflowError code the platform defines (none falls through to 500)."""
    classes = [errors.DataflowError, *errors.DataflowError.__subclasses__()]
    frontier = list(classes)
    while frontier:
        for sub in frontier.pop().__subclasses__():
            classes.append(sub)
            frontier.append(sub)
    codes = {c.code for c in classes if c is not errors.DataflowError}
    codes |= {contract.MissingCapability.code, contract.Inconclusive.code}
    assert codes - set(HTTP_STATUS_BY_CODE) == set()
    assert HTTP_STATUS_BY_CODE["not_found"] == 404 and HTTP_STATUS_BY_CODE["unauthenticated"] == 401
    assert HTTP_STATUS_BY_CODE["storage_unavailable"] == 503 and HTTP_STATUS_BY_CODE["conflict"] == 409


def test_tokens_are_stored_only_as_hashes(world: World) -> None:
    """No column of api_tokens holds the token text; listing shows ids, never tokens."""
    import sqlalchemy as sa

    from durable_dataflow.api.schema import api_tokens

    with world.platform.db.read() as conn:
        stored = " ".join(str(v) for row in conn.execute(sa.select(api_tokens)) for v in row)
    for token in (world.tokens.viewer, world.tokens.operator):
        assert token.startswith("ddf_") and token not in stored and token[4:] not in stored
    assert tokens.hash_token(world.tokens.viewer) in stored
    listed = tokens.list_tokens(world.platform.db, "acme")
    assert {t.name for t in listed} == {"acme-viewer", "acme-submitter", "acme-operator"}


def test_healthz_reports_an_unreachable_database(world: World) -> None:
    """When the database cannot be read, /healthz answers 503 storage_unavailable instead of ok."""
    import sqlalchemy as sa

    db = world.platform.db
    reachable = db.read_engine
    unreachable = (
        sa.create_engine("sqlite:////nonexistent-dir/none.db")
        if db.dialect == "sqlite"
        else sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none", connect_args={"connect_timeout": 2})
    )
    db.read_engine = unreachable
    try:
        answer = world.client.get("/healthz")
    finally:
        db.read_engine = reachable
        unreachable.dispose()
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "storage_unavailable"
    assert world.client.get("/healthz").status_code == 200
