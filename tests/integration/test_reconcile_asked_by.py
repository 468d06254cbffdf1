"""Operator-started attempts record who asked (issue 13, item 6): the `reconcile.started` and
`resume.started` entries carry the caller's provenance, principal and access context digest, as
`run.recorded` does for a submit, whether the operator used the API or the CLI; on both engines."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from durable_dataflow import __version__
from durable_dataflow.api.app import create_app
from durable_dataflow.cli import app as cli_app
from durable_dataflow.core import ledger
from durable_dataflow.dataflow.protocol import evidence
from durable_dataflow.dataflow.protocol.requests import AccessContext
from durable_dataflow.dataflow.protocol.runs import MODULE
from durable_dataflow.platform import Platform
from support.api_runs import (
    Tokens,
    copy_examples,
    make_outcome_unknown_run,
    make_tokens,
    tenant_data_root,
    web_login,
)

# The acme operator token of support.api_runs.make_tokens, as its access context is built from the token.
OPERATOR_ACCESS = AccessContext(
    tenant="acme", principal="token:acme-operator", roles=("operator",), auth_method="token"
)


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url) as opened:
        yield opened


def _api(platform: Platform, tmp_path: Path, examples: Path) -> tuple[TestClient, Tokens]:
    app = create_app(platform, data_root=tenant_data_root(tmp_path, examples))
    return TestClient(app), make_tokens(platform)


def _reconcile_by_api(client: TestClient, token: str, run_id: str, resume: bool) -> dict[str, Any]:
    answer = client.post(
        f"/v1/runs/{run_id}/reconcile", json={"resume": resume}, headers={"Authorization": f"Bearer {token}"}
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _started(platform: Platform, run_id: str, kind: str) -> Mapping[str, Any]:
    with platform.db.read() as conn:
        entries = [e for e in ledger.read(conn, MODULE, run_id) if e.kind == kind]
    assert len(entries) == 1, [e.kind for e in entries]
    return entries[0].payload


def _assert_asked_by(payload: Mapping[str, Any], access: AccessContext, trigger: str) -> None:
    assert payload["principal"] == access.principal
    assert payload["access_context_digest"] == access.digest()
    provenance = payload["provenance"]
    assert (provenance["actor"], provenance["trigger"]) == (access.principal, trigger)
    assert provenance["host"] == socket.gethostname() and provenance["client_version"] == __version__
    assert provenance["parent_run"] is None and provenance["requested_at"]
    assert payload["holder"]  # the lease holder is still recorded beside who asked


def test_api_reconcile_records_the_operator_token(platform: Platform, tmp_path: Path) -> None:
    """An operator token's reconcile (sink committed, answer lost: present) writes reconcile.started with the
    token's principal, the digest of its access context and trigger api; the evidence still verifies."""
    examples = copy_examples(tmp_path)
    run = make_outcome_unknown_run(platform, examples, "acme")
    client, tokens = _api(platform, tmp_path, examples)
    with client:
        assert _reconcile_by_api(client, tokens.operator, run.run_id, resume=False)["finding"] == "present"
        shown = client.get(f"/v1/runs/{run.run_id}/evidence", headers={"Authorization": f"Bearer {tokens.operator}"})
    _assert_asked_by(_started(platform, run.run_id, evidence.RECONCILE_STARTED), OPERATOR_ACCESS, "api")
    assert shown.json()["verification"]["ok"] is True, shown.json()["verification"]


def test_api_resume_records_the_operator_token_in_both_starts(platform: Platform, tmp_path: Path) -> None:
    """With resume=true after a proven absence, both reconcile.started and resume.started name the operator
    token: the re-dispatch of the stored result says who asked for it."""
    examples = copy_examples(tmp_path)
    run = make_outcome_unknown_run(platform, examples, "acme", fault="fail_before_send")
    client, tokens = _api(platform, tmp_path, examples)
    with client:
        answer = _reconcile_by_api(client, tokens.operator, run.run_id, resume=True)
    assert (answer["finding"], answer["resumed"], answer["run"]["status"]) == ("absent", True, "succeeded")
    for kind in (evidence.RECONCILE_STARTED, evidence.RESUME_STARTED):
        _assert_asked_by(_started(platform, run.run_id, kind), OPERATOR_ACCESS, "api")


def test_web_reconcile_form_records_the_operator_token(platform: Platform, tmp_path: Path) -> None:
    """The run page's Reconcile form (an operator's login cookie and CSRF field) records the same caller as the
    JSON API: the operator token's principal, its access context digest and trigger api."""
    examples = copy_examples(tmp_path)
    run = make_outcome_unknown_run(platform, examples, "acme")
    tokens = make_tokens(platform)
    with TestClient(create_app(platform), follow_redirects=False) as client:
        assert web_login(client, tokens.operator).status_code == 303
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', client.get(f"/ui/runs/{run.run_id}").text)
        assert csrf is not None, "no CSRF field on the run page"
        answer = client.post(f"/ui/runs/{run.run_id}/reconcile", data={"csrf": csrf.group(1)})
    assert answer.status_code == 303 and answer.headers["location"].endswith("reconciled=present")
    _assert_asked_by(_started(platform, run.run_id, evidence.RECONCILE_STARTED), OPERATOR_ACCESS, "api")


def test_cli_reconcile_records_the_os_user(platform: Platform, db_url: str, tmp_path: Path) -> None:
    """`dataflow reconcile --resume` records the operating-system user (the CLI's access context for the run's
    tenant) with trigger cli in reconcile.started and resume.started."""
    run = make_outcome_unknown_run(platform, copy_examples(tmp_path), "acme", fault="fail_before_send")
    result = CliRunner().invoke(cli_app, ["--db", db_url, "reconcile", run.run_id, "--resume", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["resumed"] is True
    local = AccessContext.local("acme")
    for kind in (evidence.RECONCILE_STARTED, evidence.RESUME_STARTED):
        _assert_asked_by(_started(platform, run.run_id, kind), local, "cli")
