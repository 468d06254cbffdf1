"""Hostile tenants and careless users against the object-store support (issue 31): each test is an attack
found in review, through the served API (two tenants, acme and globex, each granted its own prefix of one
bucket on a real moto S3 server), the CLI or the providers. Every refusal comes before anything is
recorded and names neither a bucket nor a secret."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from durable_dataflow.core.errors import InputError
from durable_dataflow.datasources import objectstore
from support.s3 import ACCESS_KEY, REGION, SECRET_KEY, S3Place
from support.tenant_server import Server, open_server

CANARY = "canary-hostile-5e2a"
CREDENTIALS = {"access_key_id": {"secret": "S3_TEST_ACCESS_KEY"}, "secret_access_key": {"secret": "S3_TEST_SECRET_KEY"}}


def _parquet_bytes(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


@pytest.fixture
def served(db_url: str, tmp_path: Path, s3: S3Place, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """acme may read and write s3://BUCKET/acme, globex s3://BUCKET/globex; both may name the credentials."""
    grants = {
        "secrets": {"S3_TEST_ACCESS_KEY": {"tenants": ["acme", "globex"]},
                    "S3_TEST_SECRET_KEY": {"tenants": ["acme", "globex"]}},
        "object_stores": [
            {"prefix": s3.url(tenant), "tenants": [tenant], "access": ["read", "write"], "endpoint": s3.endpoint,
             "region": REGION, "allow_http": True}
            for tenant in ("acme", "globex")
        ],
    }  # fmt: skip
    (tmp_path / "grants.yaml").write_text(yaml.safe_dump(grants))
    monkeypatch.setenv("DATAFLOW_GRANTS", str(tmp_path / "grants.yaml"))
    with open_server(db_url, tmp_path / "served") as server:
        yield server


def reading(source: dict[str, Any], target: dict[str, Any] | None = None) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "hostile", "version": 1, "sources": {"t": source},
        "steps": [{"name": "r", "sql": "select s from t"}],
        "output": {"schema": {"s": "string"}, "max_rows": 10, "max_bytes": "1MiB"},
    }  # fmt: skip
    if target is not None:
        document["target"] = target
    return document


def inline() -> dict[str, Any]:
    return {"kind": "inline", "rows": [{"s": "acme-row"}], "schema": {"s": "string"}}


def delta_target(location: str, **options: Any) -> dict[str, Any]:
    return {"type": "datasources.publication", "provider": "delta", "datasource": "acme.out",
            "location": location, "mode": "append", "options": {**CREDENTIALS, **options}}  # fmt: skip


def assert_refused(server: Server, answer: Any, before: int, s3: S3Place, why: str) -> None:
    assert answer.status_code in (400, 403, 422), answer.text
    assert why in answer.text, answer.text
    for secret in (s3.bucket, ACCESS_KEY, SECRET_KEY, CANARY):
        assert secret not in answer.text, (secret, answer.text)
    assert server.run_count() == before, "a refused submission recorded a run"


def keys(s3: S3Place, prefix: str) -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    return [str(item["Key"]) for item in listed.get("Contents") or ()]


# ---- URL tricks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dots", ["%2e%2e", "%2E%2E", ".%2e", "%2e."])
def test_percent_encoded_dot_segments_do_not_leave_the_granted_prefix(
    served: Server, s3: S3Place, dots: str
) -> None:
    """Finding: delta-rs parses a table URL as a URL, so `s3://b/acme/%2e%2e/globex/t` is the table
    `s3://b/globex/t` to it, while the confinement saw a key under `acme/`: acme read globex's Delta table
    and published into globex's prefix. A `%` in an object key is now refused (pyarrow and boto3 take a key
    literally, delta-rs decodes it: the same URL must name the same object to every reader)."""
    deltalake = pytest.importorskip("deltalake")
    store = objectstore.StoreOptions(endpoint=s3.endpoint, region=REGION, allow_http=True,
                                     access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY)  # fmt: skip
    storage = store.delta_storage_options()
    deltalake.write_deltalake(s3.url("globex/t"), pa.table({"s": [CANARY]}), storage_options=storage)
    before = served.run_count()
    source = {"kind": "delta", "path": s3.url(f"acme/{dots}/globex/t"), "options": dict(CREDENTIALS)}
    assert_refused(served, served.post("acme-submitter", reading(source)), before, s3, "'%'")
    target = delta_target(s3.url(f"acme/{dots}/globex/out"))
    assert_refused(served, served.post("acme-submitter", reading(inline(), target)), before, s3, "'%'")
    assert keys(s3, "globex/out") == []


def test_a_percent_sign_in_a_key_is_refused_everywhere() -> None:
    """The rule itself: `%` anywhere in the key (a bucket name cannot hold one)."""
    for url in ("s3://bucket-ok/a%20b", "s3://bucket-ok/%2e%2e", "s3://bucket-ok/a/%2fb", "S3://bucket-ok/x%"):
        with pytest.raises(InputError, match="'%'"):
            objectstore.parse_url(url, "path")
    assert objectstore.parse_url("S3://bucket-ok/a b/c.parquet", "path").url == "s3://bucket-ok/a b/c.parquet"
