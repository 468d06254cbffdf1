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
    import deltalake  # the delta extra, part of dev: a missing package fails the test
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


def test_a_key_ending_in_a_space_is_refused(served: Server, s3: S3Place) -> None:
    """Finding: delta-rs parses a table URL with the WHATWG rules, which strip trailing spaces, so the Delta
    sink `s3://b/acme/out ` was created and committed at `acme/out` while the provider's own inspection
    (pyarrow, boto3: keys taken literally) looked at `acme/out /_delta_log`: what inspection sees is not
    where the publication lands. A key ending in a space is now refused."""
    before = served.run_count()
    for location in (s3.url("acme/out "), s3.url("acme/out /")):
        answer = served.post("acme-submitter", reading(inline(), delta_target(location)))
        assert_refused(served, answer, before, s3, "space")
    assert keys(s3, "acme/") == []
    with pytest.raises(InputError, match="space"):
        objectstore.parse_url("s3://bucket-ok/a/b ", "path")
    assert objectstore.parse_url("s3://bucket-ok/a b/c", "path").key == "a b/c"


# ---- a careless user at the CLI ---------------------------------------------------------------------------


def _cli_document(location: str, provider: str, options: dict[str, Any]) -> dict[str, Any]:
    target = {"type": "datasources.publication", "provider": provider, "datasource": "local.out",
              "location": location, "mode": "append", "options": options}  # fmt: skip
    return reading(inline(), target)


@pytest.mark.parametrize("provider", ["delta", "parquet_folder"])
@pytest.mark.parametrize("fault", ["missing bucket", "unreachable endpoint"])
def test_dataflow_run_against_a_broken_store_fails_clearly(
    s3: S3Place, db_url: str, tmp_path: Path, provider: str, fault: str
) -> None:
    """`dataflow run` to an s3:// sink that cannot be written (no such bucket, nothing listening at the
    endpoint) exits non-zero, leaves no run `running` or `outcome_unknown`, writes nothing, and echoes no
    secret. (A wrong secret key is not tried: moto_server does not check signatures.)"""
    from support.cli import make_cli
    from support.pg import free_port

    options = s3.options()
    location = s3.url("out/table")
    if fault == "missing bucket":
        location = "s3://no-such-bucket-4b1e/out/table"
    else:
        options["endpoint"] = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(_cli_document(location, provider, options)))
    cli = make_cli(db_url, tmp_path)
    ran = cli("run", str(tmp_path / "d.yaml"), "--json")
    assert ran.code != 0, ran.output
    for secret in (ACCESS_KEY, SECRET_KEY, CANARY):
        assert secret not in ran.output, (secret, ran.output)
    listed = cli("runs", "--json")
    assert listed.code == 0, listed.output
    statuses = [r["status"] for r in listed.json()]
    assert statuses and all(s in ("failed", "refused") for s in statuses), (statuses, ran.output)
    assert keys(s3, "out/") == []


# ---- messages ----------------------------------------------------------------------------------------------


def test_a_store_failing_during_the_scan_names_neither_the_endpoint_nor_the_bucket(
    db_url: str, tmp_path: Path, s3: S3Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant's source whose objects are resolved but whose store stops answering while the engine scans
    them: the run fails (recomputable: the objects cannot be proven unchanged), and its error, which the
    tenant reads, names neither the grant's endpoint (an internal host of the platform's) nor the bucket
    nor a key."""
    from support.s3 import FaultProxy

    for name in ("a", "b"):
        s3.client().put_object(Bucket=s3.bucket, Key=f"acme/in/{name}.parquet",
                               Body=_parquet_bytes(pa.table({"s": [f"row-{name}"]})))  # fmt: skip
    proxy = FaultProxy(s3.endpoint.removeprefix("http://")).start()
    proxy.errors_to(io.StringIO())
    grants = {
        "secrets": {"S3_TEST_ACCESS_KEY": {"tenants": ["acme"]}, "S3_TEST_SECRET_KEY": {"tenants": ["acme"]}},
        "object_stores": [{"prefix": s3.url("acme"), "tenants": ["acme"], "access": ["read"],
                           "endpoint": proxy.endpoint, "region": REGION, "allow_http": True}],
    }  # fmt: skip
    (tmp_path / "grants.yaml").write_text(yaml.safe_dump(grants))
    monkeypatch.setenv("DATAFLOW_GRANTS", str(tmp_path / "grants.yaml"))
    try:
        with open_server(db_url, tmp_path / "served") as server:
            # Resolution reads a.parquet's footer; b.parquet is first read by the scan.
            proxy.lose_answer("GET", r"/acme/in/b\.parquet", forward=False, then_blackhole=True)
            source = {"kind": "parquet", "path": s3.url("acme/in"), "options": dict(CREDENTIALS)}
            answer = server.post("acme-submitter", reading(source))
            assert answer.status_code == 201, answer.text
            run = answer.json()["run"]
            assert run["status"] == "failed" and proxy.fired, answer.text
            message = str(run["error_message"])
            assert "source 't'" in message, message
            port = proxy.endpoint.rsplit(":", 1)[1]
            for secret in (s3.bucket, "acme/in", port, "127.0.0.1", ACCESS_KEY):
                assert secret not in message, (secret, message)
    finally:
        proxy.stop()


def test_a_corrupt_object_found_by_the_scan_names_neither_the_bucket_nor_the_key(
    served: Server, s3: S3Place
) -> None:
    """A prefix whose second object is not Parquet (resolution reads only the first one's footer): the run
    fails without naming the bucket or the key (pyarrow's own text quotes both; the engine withholds them)."""
    s3.client().put_object(Bucket=s3.bucket, Key="acme/in/a.parquet", Body=_parquet_bytes(pa.table({"s": ["a"]})))
    s3.client().put_object(Bucket=s3.bucket, Key="acme/in/b.parquet", Body=b"not parquet at all " * 10)
    source = {"kind": "parquet", "path": s3.url("acme/in"), "options": dict(CREDENTIALS)}
    answer = served.post("acme-submitter", reading(source))
    assert answer.status_code == 201, answer.text
    run = answer.json()["run"]
    message = str(run["error_message"])
    assert run["status"] == "failed" and "Parquet" in message, answer.text
    for secret in (s3.bucket, "acme/in", s3.endpoint):
        assert secret not in message, (secret, message)


# ---- exactly once across tenants ----------------------------------------------------------------------------


def test_two_tenants_with_one_idempotency_key_on_a_shared_prefix_each_publish_once(
    db_url: str, tmp_path: Path, s3: S3Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tenants granted one writable prefix submit the same definition under the same Idempotency-Key:
    the sink key derives from the tenant and the key, so each publishes its own rows once (neither is
    taken for the other's publication) and each replay adds nothing."""
    from support.s3 import delta_publication_commits

    grants = {
        "secrets": {"S3_TEST_ACCESS_KEY": {"tenants": ["*"]}, "S3_TEST_SECRET_KEY": {"tenants": ["*"]}},
        "object_stores": [{"prefix": s3.url("shared"), "tenants": ["acme", "globex"], "access": ["write"],
                           "endpoint": s3.endpoint, "region": REGION, "allow_http": True}],
    }  # fmt: skip
    (tmp_path / "grants.yaml").write_text(yaml.safe_dump(grants))
    monkeypatch.setenv("DATAFLOW_GRANTS", str(tmp_path / "grants.yaml"))
    document = reading(inline(), delta_target(s3.url("shared/out")))
    with open_server(db_url, tmp_path / "served") as server:
        published = []
        for who in ("acme-submitter", "globex-submitter", "acme-submitter", "globex-submitter"):
            headers = {**server.headers[who], "Idempotency-Key": "2026-12-01"}
            answer = server.client.post("/v1/runs", json={"definition": document}, headers=headers)
            assert answer.status_code in (200, 201), answer.text
            run = answer.json()["run"]
            assert run["status"] == "succeeded", answer.text
            published.append(run["publication_idempotency_key"])
    assert published[0] != published[1] and published[2:] == published[:2], published
    for key in published[:2]:
        assert delta_publication_commits(s3.client(), s3.bucket, "shared/out", key) == 1
