"""Builders for the API, web and browser tests: example runs in a platform database, and tokens.

`make_outcome_unknown_run` runs the forward-recovery example with the built-in parquet provider
wrapped by the FaultInjectingProvider (the sink commits, then the answer is lost), so the run is
honestly `outcome_unknown` and a later reconciliation with the real provider finds it present.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import yaml
from fastapi.testclient import TestClient

from durable_dataflow.api import tokens
from durable_dataflow.dataflow.definitions.definitions import load_definition
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider, PublishFault
from durable_dataflow.platform import Platform

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def copy_examples(tmp_path: Path) -> Path:
    """A private copy of the examples, so sinks write under the test's temporary directory."""
    target = tmp_path / "examples"
    shutil.copytree(EXAMPLES, target, ignore=shutil.ignore_patterns("warehouse", ".dataflow"))
    return target


def tenant_data_root(tmp_path: Path, examples: Path, tenants: tuple[str, ...] = ("acme", "globex")) -> Path:
    """An API data root where each tenant's folder holds the atomic example's input files, so a
    tenant submitting that definition (relative paths `data/...`) reads its own copy."""
    root = tmp_path / "tenants"
    for tenant in tenants:
        shutil.copytree(examples / "revenue_by_region" / "data", root / tenant / "data")
    return root


def grant_secrets(tmp_path: Path, monkeypatch: Any, grants: dict[str, list[str]]) -> Path:
    """Write a grants file granting each secret (read from the environment variable of its name) to
    the listed tenants, and point DATAFLOW_GRANTS at it; open the Platform afterwards."""
    path = tmp_path / "grants.yaml"
    path.write_text(yaml.safe_dump({"secrets": {name: {"tenants": tenants} for name, tenants in grants.items()}}))
    monkeypatch.setenv("DATAFLOW_GRANTS", str(path))
    return path


def _request(path: Path, tenant: str, key: str | None, day: str = "2026-11-02") -> RunRequest:
    loaded = load_definition(path)
    return RunRequest(
        definition=loaded.definition,
        base_dir=loaded.base_dir,
        parameters={"day": day},
        access=AccessContext(tenant=tenant, principal="test", roles=("operator",), auth_method="test"),
        provenance=Provenance(actor="test", trigger="cli"),
        idempotency_key=key,
    )


def make_atomic_run(platform: Platform, examples: Path, tenant: str, key: str | None = None) -> Run:
    request = _request(examples / "revenue_by_region" / "dataflow.yaml", tenant, key)
    return platform.runs.run_inline(request).run


def make_queued_run(platform: Platform, examples: Path, tenant: str, key: str | None = None) -> Run:
    request = _request(examples / "revenue_by_region" / "dataflow.yaml", tenant, key)
    return platform.runs.submit(request).run


def make_outcome_unknown_run(
    platform: Platform,
    examples: Path,
    tenant: str,
    key: str | None = None,
    fault: PublishFault = "timeout_after_commit",
) -> Run:
    """A forward-recovery run whose provider answer was lost: `outcome_unknown`."""
    registry.register_provider("parquet", lambda: FaultInjectingProvider(ParquetFolderProvider(), fault))
    try:
        request = _request(examples / "daily_orders_publish" / "dataflow.yaml", tenant, key)
        run = platform.runs.run_inline(request).run
    finally:
        registry.unregister_provider("parquet")
    assert run.status == "outcome_unknown", run
    return run


@dataclass(frozen=True)
class Tokens:
    """One token per role in tenant `acme`, and an operator in tenant `globex`."""

    viewer: str
    submitter: str
    operator: str
    other_operator: str


def make_tokens(platform: Platform) -> Tokens:
    def create(tenant: str, role: str, name: str) -> str:
        return tokens.create_token(platform.db, tenant, role, name)[0]

    return Tokens(
        viewer=create("acme", "viewer", "acme-viewer"),
        submitter=create("acme", "submitter", "acme-submitter"),
        operator=create("acme", "operator", "acme-operator"),
        other_operator=create("globex", "operator", "globex-operator"),
    )


LOGIN_CSRF_FIELD = re.compile(r'name="csrf" value="([0-9a-f]+)"')


def web_login(client: TestClient, token: str) -> httpx2.Response:
    """POST the login form as a browser does: GET it first (its nonce cookie and CSRF field), then
    submit the token with that field. Returns the POST's answer."""
    form = client.get("/ui/login")
    found = LOGIN_CSRF_FIELD.search(form.text)
    assert form.status_code == 200 and found is not None, form.text
    return client.post("/ui/login", data={"token": token, "csrf": found.group(1)})


# Every authenticated route: (method, path template, JSON body). {run} is a run of tenant acme; {name}
# is sent as written (no schedule has that name: the routes' checks come before the lookup).
BACKFILL_BODY = {"definition_hash": "sha256:" + "0" * 64, "from": "2026-03-01", "to": "2026-03-07"}
API_ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/runs", {"definition_hash": "sha256:" + "0" * 64, "parameters": {}}),
    ("GET", "/v1/runs", None),
    ("GET", "/v1/runs/{run}", None),
    ("GET", "/v1/runs/{run}/evidence", None),
    ("GET", "/v1/runs/{run}/result", None),
    ("POST", "/v1/runs/{run}/reconcile", {"resume": False}),
    ("POST", "/v1/runs/{run}/cancel", None),
    ("GET", "/v1/definitions", None),
    ("POST", "/v1/definitions/validate", {"definition": {"name": "x"}}),
    ("GET", "/v1/datasources", None),
    ("GET", "/v1/datasources/{name}/partitions", None),
    ("GET", "/v1/schedules", None),
    ("POST", "/v1/schedules", {"definition": {"name": "nightly"}}),
    ("GET", "/v1/schedules/{name}", None),
    ("POST", "/v1/schedules/{name}/pause", None),
    ("POST", "/v1/schedules/{name}/resume", None),
    ("POST", "/v1/backfills", BACKFILL_BODY),
    ("POST", "/v1/backfills/cancel", BACKFILL_BODY),
    ("GET", "/v1/ops/ledger", None),
    ("GET", "/v1/workers", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
]
