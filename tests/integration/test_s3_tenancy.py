"""Object-store tenancy through the API (issue 31 item 3, docs/security.md): a tenant publishes to an
s3:// prefix the grants file grants it for writing, at the grant's endpoint, with granted credential
secrets; every other s3:// target is refused before anything is recorded, and no refusal echoes the
URL or a secret. Against a real S3 API server (moto_server on loopback), on both platform databases."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.s3 import ACCESS_KEY, REGION, SECRET_KEY, S3Place, delta_log_rows
from support.tenant_server import Server, open_server

CANARY_SECRET = "canary-s3-secret-7c1d"


@pytest.fixture
def server(db_url: str, tmp_path: Path, s3: S3Place, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    monkeypatch.setenv("ACME_S3_KEY", ACCESS_KEY)
    monkeypatch.setenv("ACME_S3_SECRET", SECRET_KEY)
    monkeypatch.setenv("SERVER_S3_SECRET", CANARY_SECRET)  # not granted to anyone
    grants = {
        # Both tenants may name the credentials: what keeps globex out of acme's prefix is the store grant.
        "secrets": {"ACME_S3_KEY": {"tenants": ["acme", "globex"]}, "ACME_S3_SECRET": {"tenants": ["acme", "globex"]}},
        "object_stores": [
            {"prefix": s3.url("acme"), "tenants": ["acme"], "access": ["read", "write"],
             "endpoint": s3.endpoint, "region": REGION, "allow_http": True},
            {"prefix": s3.url("shared/reports"), "tenants": ["*"], "access": ["read"],
             "endpoint": s3.endpoint, "region": REGION, "allow_http": True},
        ],
    }  # fmt: skip
    path = tmp_path / "grants.yaml"
    path.write_text(yaml.safe_dump(grants))
    monkeypatch.setenv("DATAFLOW_GRANTS", str(path))
    with open_server(db_url, tmp_path) as opened:
        yield opened


def document(location: str, **options: Any) -> dict[str, Any]:
    return {
        "name": "to_s3", "version": 1,
        "sources": {"t": {"kind": "inline", "rows": [{"s": "acme-row"}], "schema": {"s": "string"}}},
        "steps": [{"name": "r", "sql": "select s from t"}],
        "output": {"schema": {"s": "string"}, "max_rows": 10, "max_bytes": "1MiB"},
        "target": {"type": "datasources.publication", "provider": "delta", "datasource": "acme.out",
                   "location": location, "mode": "append", "options": options},
    }  # fmt: skip


CREDENTIALS = {"access_key_id": {"secret": "ACME_S3_KEY"}, "secret_access_key": {"secret": "ACME_S3_SECRET"}}


def test_a_tenant_publishes_to_its_granted_prefix_at_the_granted_endpoint(server: Server, s3: S3Place) -> None:
    answer = server.post("acme-submitter", document(s3.url("acme/out"), **CREDENTIALS))
    assert answer.status_code == 201, answer.text
    run = answer.json()["run"]
    assert run["status"] == "succeeded", answer.text
    assert delta_log_rows(s3.client(), s3.bucket, "acme/out").column("s").to_pylist() == ["acme-row"]


def refused(server: Server, answer: Any, before: int, s3: S3Place, why: str) -> None:
    assert answer.status_code in (400, 403, 422), answer.text
    assert why in answer.text, answer.text
    assert s3.bucket not in answer.text and CANARY_SECRET not in answer.text and SECRET_KEY not in answer.text
    assert server.run_count() == before


def test_every_other_s3_target_is_refused_before_recording(server: Server, s3: S3Place) -> None:
    before = server.run_count()
    cases = [
        ("globex-submitter", document(s3.url("acme/out"), **CREDENTIALS), "outside the object-store prefixes"),
        ("acme-submitter", document(s3.url("globex/out"), **CREDENTIALS), "outside the object-store prefixes"),
        ("acme-submitter", document(s3.url("acme-evil/out"), **CREDENTIALS), "outside the object-store prefixes"),
        ("acme-submitter", document(s3.url("shared/reports/x"), **CREDENTIALS), "outside the object-store prefixes"),
        ("acme-submitter", document(s3.url("acme/out")), "needs credentials"),
        (
            "acme-submitter",
            document(s3.url("acme/out"), endpoint="http://169.254.169.254", allow_http=True, **CREDENTIALS),
            "differs from the endpoint granted",
        ),
        (
            "acme-submitter",
            document(s3.url("acme/out"), access_key_id={"secret": "ACME_S3_KEY"},
                     secret_access_key={"secret": "SERVER_S3_SECRET"}),
            "not granted",
        ),
        ("acme-submitter", document(s3.url("acme/out"), endpoint_url="http://x", **CREDENTIALS), "unknown"),
    ]
    for who, body, why in cases:
        refused(server, server.post(who, body), before, s3, why)
    assert s3.client().list_objects_v2(Bucket=s3.bucket).get("KeyCount") == 0
