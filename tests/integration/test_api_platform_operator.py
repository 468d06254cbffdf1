"""The platform operator on SQLite and PostgreSQL: a token bound to no tenant, created only from the CLI,
that reads the platform-wide Ops projection (/v1/ops/ledger, /ui/ops) and /metrics and nothing else,
while every tenant token keeps seeing only its own tenant."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from durable_dataflow.api import operations, tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.api.auth import SESSION_COOKIE
from durable_dataflow.core import errors
from durable_dataflow.dataflow.protocol import runs
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.platform import Platform
from support.api_runs import (
    API_ROUTES,
    Tokens,
    copy_examples,
    make_atomic_run,
    make_outcome_unknown_run,
    make_queued_run,
    make_tokens,
)
from support.cli import make_cli

# The platform-wide reads, and the two actions a platform operator may take on any tenant's run (issue 33).
PLATFORM_ROUTES = {
    ("GET", "/v1/ops/ledger"),
    ("GET", "/metrics"),
    ("GET", "/v1/workers"),
    ("POST", "/v1/runs/{run}/reconcile"),
    ("POST", "/v1/runs/{run}/cancel"),
}
# Every authenticated route but the platform routes; {run} is acme's unresolved run.
TENANT_ROUTES = [r for r in API_ROUTES if (r[0], r[1]) not in PLATFORM_ROUTES]


@dataclass(frozen=True)
class Platforms:
    platform: Platform
    client: TestClient
    tokens: Tokens
    platform_token: str
    acme_unknown: Run
    globex_unknown: Run
    db_url: str
    examples: Path

    def call(self, method: str, path: str, token: str, body: Any = None) -> Any:
        url = path.replace("{run}", self.acme_unknown.run_id)
        return self.client.request(method, url, json=body, headers={"Authorization": f"Bearer {token}"})

    def web(self, token: str) -> TestClient:
        """A browser session for ``token`` (the session cookie set directly: the login form is tested elsewhere)."""
        return TestClient(self.client.app, follow_redirects=False, cookies={SESSION_COOKIE: token})


@pytest.fixture
def world(db_url: str, tmp_path: Path) -> Iterator[Platforms]:
    """Two tenants, each with a succeeded run and an unresolved (outcome_unknown) one."""
    platform = Platform(db_url)
    examples = copy_examples(tmp_path)
    make_atomic_run(platform, examples, "acme")
    acme_unknown = make_outcome_unknown_run(platform, examples, "acme", key="acme-day")
    make_atomic_run(platform, examples, "globex")
    globex_unknown = make_outcome_unknown_run(platform, examples, "globex", key="globex-day")
    platform_token = tokens.create_platform_token(platform.db, "oncall")[0]
    app = create_app(platform, data_root=examples / "revenue_by_region")
    with TestClient(app) as client:
        yield Platforms(
            platform, client, make_tokens(platform), platform_token, acme_unknown, globex_unknown, db_url, examples
        )
    platform.close()


def unresolved_ids(projection: dict[str, Any]) -> set[str]:
    return {u["run_id"] for u in projection["unresolved"]}


def test_platform_token_reads_every_tenants_unresolved_runs(world: Platforms) -> None:
    """GET /v1/ops/ledger with the platform token is the platform-wide projection: tenant null, both
    tenants' unresolved runs listed with their tenants, every run counted."""
    answer = world.call("GET", "/v1/ops/ledger", world.platform_token)
    assert answer.status_code == 200, answer.text
    projection = answer.json()
    assert projection["tenant"] is None
    assert unresolved_ids(projection) == {world.acme_unknown.run_id, world.globex_unknown.run_id}
    assert projection["unresolved_total"] == 2
    assert {u["tenant"] for u in projection["unresolved"]} == {"acme", "globex"}
    assert sum(projection["runs_by_status"].values()) == 4


@pytest.mark.parametrize(("role", "tenant"), [("operator", "acme"), ("other_operator", "globex")])
def test_tenant_operator_reads_only_its_own_tenant(world: Platforms, role: str, tenant: str) -> None:
    """A tenant operator's /v1/ops/ledger holds its own tenant's unresolved run and counts only."""
    own = world.acme_unknown if tenant == "acme" else world.globex_unknown
    other = world.globex_unknown if tenant == "acme" else world.acme_unknown
    answer = world.call("GET", "/v1/ops/ledger", getattr(world.tokens, role))
    assert answer.status_code == 200, answer.text
    projection = answer.json()
    assert projection["tenant"] == tenant
    assert unresolved_ids(projection) == {own.run_id}
    assert sum(projection["runs_by_status"].values()) == 2
    assert other.run_id not in answer.text


def test_ops_page_is_platform_wide_for_the_platform_token_only(world: Platforms) -> None:
    """/ui/ops lists both tenants' unresolved runs (with a tenant column, no run links) for the platform
    token, and only acme's for acme's operator; the platform token's landing page is /ui/ops."""
    browser = world.web(world.platform_token)
    landing = browser.get("/ui/runs")
    assert landing.status_code == 303 and landing.headers["location"] == "/ui/ops"
    page = browser.get("/ui/ops")
    assert page.status_code == 200, page.text
    html = page.text
    assert "platform-wide" in html
    assert world.acme_unknown.run_id in html and world.globex_unknown.run_id in html
    assert ">globex<" in html and ">acme<" in html
    assert f'href="/ui/runs/{world.acme_unknown.run_id}"' not in html  # a run page it could not open
    assert 'href="/ui/runs"' not in html  # no run history in its navigation
    tenant_html = world.web(world.tokens.operator).get("/ui/ops").text
    assert world.acme_unknown.run_id in tenant_html
    assert world.globex_unknown.run_id not in tenant_html
    assert "platform-wide" not in tenant_html


def test_platform_token_reads_metrics(world: Platforms) -> None:
    """/metrics answers the platform token with the platform-wide gauges (both unresolved runs)."""
    answer = world.call("GET", "/metrics", world.platform_token)
    assert answer.status_code == 200, answer.text
    assert "dataflow_unresolved_runs 2.0" in answer.text


@pytest.mark.parametrize(("method", "path", "body"), TENANT_ROUTES)
def test_platform_token_is_refused_on_every_tenant_endpoint(
    world: Platforms, method: str, path: str, body: Any
) -> None:
    """Submit, reconcile, run reads, definitions, datasources and the schema answer the platform token
    403 with a message asking for a tenant token, and nothing is recorded or changed."""
    answer = world.call(method, path, world.platform_token, body)
    assert answer.status_code == 403, answer.text
    assert answer.json()["error"]["code"] == "permission_denied"
    assert "needs a tenant token" in answer.json()["error"]["message"]
    with world.platform.db.read() as conn:
        assert len(runs.list_page(conn, limit=100)) == 4  # nothing submitted
    assert world.platform.runs.get(world.acme_unknown.run_id).status == "outcome_unknown"


def test_route_lists_cover_every_route(world: Platforms) -> None:
    """The refused and the platform-wide routes together are the app's whole authenticated surface, so a
    new route must decide which it is; and no route creates a token (the POSTs are all listed here)."""
    document = world.client.app.openapi()  # type: ignore[attr-defined]
    documented = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    listed = {(m, p.replace("{run}", "{run_id}")) for m, p, _ in TENANT_ROUTES} | {
        (m, p.replace("{run}", "{run_id}")) for m, p in PLATFORM_ROUTES
    }
    assert documented - {("GET", "/healthz")} == listed - {("GET", "/openapi.json")}
    posts = {path for method, path in documented if method == "POST"}
    assert posts == {
        "/v1/runs", "/v1/runs/{run_id}/reconcile", "/v1/runs/{run_id}/cancel", "/v1/schedules",
        "/v1/schedules/{name}/pause", "/v1/schedules/{name}/resume", "/v1/backfills",
        "/v1/backfills/cancel", "/v1/definitions/validate",
    }  # fmt: skip
    assert not any("token" in path for _, path in documented)


def test_platform_token_is_refused_on_tenant_pages(world: Platforms) -> None:
    """The run page and the reconcile form answer the platform token 403; logging out still works."""
    browser = world.web(world.platform_token)
    run_page = browser.get(f"/ui/runs/{world.acme_unknown.run_id}")
    assert run_page.status_code == 403
    assert "needs a tenant token" in run_page.text
    reconcile = browser.post(f"/ui/runs/{world.acme_unknown.run_id}/reconcile", data={"csrf": "x"})
    assert reconcile.status_code == 403
    assert world.platform.runs.get(world.acme_unknown.run_id).status == "outcome_unknown"
    logout = browser.post("/ui/logout", data={"csrf": "wrong"})
    assert logout.status_code == 403 and "stale" in logout.text  # past the role check, stopped by CSRF only


def test_a_platform_caller_has_no_tenant_even_past_the_endpoint_check(world: Platforms) -> None:
    """The second line: a tenant-scoped operation handed a platform caller directly refuses it."""
    info = tokens.authenticate(world.platform.db, world.platform_token)
    caller = operations.Caller(info)
    assert caller.ops_tenant is None
    with pytest.raises(errors.PermissionDenied):
        operations.list_runs(world.platform, caller)
    with pytest.raises(errors.PermissionDenied):
        operations.get_run(world.platform, caller, world.acme_unknown.run_id)
    with pytest.raises(errors.PermissionDenied):
        caller.access()


def test_platform_role_and_tenant_cannot_be_had_through_a_tenant_token(world: Platforms) -> None:
    """create_token refuses the platform role and the platform tenant; a tenant role never holds the
    platform role, and the platform role holds no tenant role."""
    db = world.platform.db
    with pytest.raises(errors.InputError, match="--platform"):
        tokens.create_token(db, "acme", "platform_operator")
    with pytest.raises(errors.InputError, match="tenant"):
        tokens.create_token(db, tokens.PLATFORM_TENANT, "operator")
    operator = tokens.authenticate(db, world.tokens.operator)
    platform_info = tokens.authenticate(db, world.platform_token)
    assert not operator.allows(tokens.Role.PLATFORM_OPERATOR) and not operator.is_platform
    assert platform_info.is_platform and platform_info.tenant == tokens.PLATFORM_TENANT
    assert not any(platform_info.allows(role) for role in tokens.TENANT_ROLES)


def test_cli_creates_and_lists_a_platform_token_that_the_api_accepts(world: Platforms, tmp_path: Path) -> None:
    """`dataflow tokens create --platform` prints a token that reads the platform-wide projection;
    `tokens list` marks it platform-wide; mixing --platform with --tenant or --role is refused (exit 2)."""
    cli = make_cli(world.db_url, tmp_path)
    created = cli("tokens", "create", "--platform", "--name", "night-shift")
    assert created.code == 0, created.output
    token = created.stdout.strip()
    assert token.startswith("ddf_") and "the whole platform" in created.stderr
    answer = world.call("GET", "/v1/ops/ledger", token)
    assert answer.status_code == 200, answer.text
    assert unresolved_ids(answer.json()) == {world.acme_unknown.run_id, world.globex_unknown.run_id}
    assert world.call("GET", "/v1/runs", token).status_code == 403

    listed = cli("tokens", "list")
    assert listed.code == 0, listed.output
    row = next(line for line in listed.stdout.splitlines() if "night-shift" in line)
    assert "platform-wide" in row and "platform_operator" in row
    as_json = [line for line in cli("tokens", "list", "--json").stdout.splitlines() if "night-shift" in line]
    assert len(as_json) == 1 and '"platform": true' in as_json[0] and '"tenant": "*"' in as_json[0]

    for extra in (("--tenant", "acme"), ("--role", "operator")):
        mixed = cli("tokens", "create", "--platform", *extra)
        assert mixed.code == 2 and "--platform takes neither" in mixed.stderr, mixed.output
    by_role = cli("tokens", "create", "--tenant", "acme", "--role", "platform_operator")
    assert by_role.code == 2 and "--platform" in by_role.stderr, by_role.output
    assert cli("tokens", "create").code == 2


def test_tokens_create_names_an_unnamed_token_once(world: Platforms, tmp_path: Path) -> None:
    """`dataflow tokens create` without --name says `created tok_x for …` (not `tok_x (tok_x)`), with --name
    `created tok_x (NAME) for …`, each message one whole line ending in a newline."""
    cli = make_cli(world.db_url, tmp_path)
    unnamed = cli("tokens", "create", "--tenant", "acme", "--role", "viewer")
    assert unnamed.code == 0, unnamed.output
    assert unnamed.stderr.startswith("created tok_") and "(" not in unnamed.stderr.split(" for ")[0]
    assert unnamed.stderr.endswith("\n")
    named = cli("tokens", "create", "--tenant", "acme", "--role", "viewer", "--name", "ci-reader")
    assert named.code == 0, named.output
    assert " (ci-reader) for tenant acme" in named.stderr and named.stderr.endswith("\n")


def _head(world: Platforms, run_id: str) -> dict[str, Any]:
    """The run's newest ledger entry, read as the run's own tenant (the platform token reads no evidence)."""
    token = world.tokens.operator if world.platform.runs.get(run_id).tenant == "acme" else world.tokens.other_operator
    evidence = world.call("GET", f"/v1/runs/{run_id}/evidence", token).json()
    assert evidence["verification"]["ok"], evidence["verification"]
    head: dict[str, Any] = evidence["entries"][-1]
    return head


def test_platform_token_reconciles_and_cancels_runs_of_two_tenants(world: Platforms) -> None:
    """Issue 33: the platform token reconciles acme's and globex's outcome_unknown runs (present ->
    succeeded) and cancels a queued run of each; every ledger entry names the platform principal
    (token:oncall), its provenance (trigger api) and the platform access context's digest."""
    platform_access = operations.Caller(tokens.authenticate(world.platform.db, world.platform_token)).operator_access()
    for unknown in (world.acme_unknown, world.globex_unknown):
        answer = world.call("POST", f"/v1/runs/{unknown.run_id}/reconcile", world.platform_token, {"resume": False})
        assert answer.status_code == 200, answer.text
        assert answer.json()["finding"] == "present" and answer.json()["run"]["status"] == "succeeded"
        entries = world.call("GET", f"/v1/runs/{unknown.run_id}/evidence", _token_of(world, unknown)).json()["entries"]
        started = next(e for e in entries if e["kind"] == "reconcile.started")
        assert started["payload"]["principal"] == "token:oncall"
        assert started["payload"]["access_context_digest"] == platform_access.digest()
        assert started["payload"]["provenance"]["trigger"] == "api"
    for tenant in ("acme", "globex"):
        queued = make_queued_run(world.platform, world.examples, tenant, f"{tenant}-to-cancel")
        answer = world.call("POST", f"/v1/runs/{queued.run_id}/cancel", world.platform_token)
        assert answer.status_code == 200, answer.text
        assert answer.json()["cancelled"] is True and answer.json()["run"]["status"] == "cancelled"
        head = _head(world, queued.run_id)
        assert head["kind"] == "run.cancelled" and head["payload"]["principal"] == "token:oncall"
        assert head["payload"]["access_context_digest"] == platform_access.digest()


def _token_of(world: Platforms, run: Run) -> str:
    return world.tokens.operator if run.tenant == "acme" else world.tokens.other_operator


def test_tenant_operators_still_cannot_touch_another_tenants_runs(world: Platforms) -> None:
    """With the platform token able to act across tenants, acme's operator still gets 404 reconciling or
    cancelling globex's run, and a viewer 403 on its own; nothing changes."""
    for action in ("reconcile", "cancel"):
        path = f"/v1/runs/{world.globex_unknown.run_id}/{action}"
        answer = world.call("POST", path, world.tokens.operator)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", answer.text
        own = world.call("POST", f"/v1/runs/{world.acme_unknown.run_id}/{action}", world.tokens.viewer)
        assert own.status_code == 403, own.text
    assert world.platform.runs.get(world.globex_unknown.run_id).status == "outcome_unknown"
    assert world.platform.runs.get(world.acme_unknown.run_id).status == "outcome_unknown"
    missing = world.call("POST", "/v1/runs/no-such-run/cancel", world.platform_token)
    assert missing.status_code == 404, missing.text
