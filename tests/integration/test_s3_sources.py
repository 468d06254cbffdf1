"""Sources on an S3-compatible object store (issue 31, item 2, and the source half of item 3): Parquet (an
object, a prefix, a glob), CSV with declared types and Delta pinned by version, read from `s3://` on a real
moto server over HTTP; fingerprints by ETag, size and version id; an object rewritten while the run read it
fails the attempt; a tenant reads only inside the prefixes granted to it, refused before recording.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from durable_dataflow.core.errors import ExecutionError, InputError, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition, parse_definition
from durable_dataflow.dataflow.execution import compute, isolation, store_sources, workspace
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from durable_dataflow.dataflow.execution.sources import check_unchanged, resolve_sources
from durable_dataflow.dataflow.protocol.requests import AccessContext
from durable_dataflow.dataflow.protocol.validation import validate_definition
from durable_dataflow.datasources.objectstore import StoreOptions
from durable_dataflow.platform import Platform
from support import flows
from support.cli import make_cli
from support.s3 import ACCESS_KEY, REGION, SECRET_KEY, S3Place
from support.tenant_server import open_server

CANARY = "canary-s3-7d41"


def _parquet_bytes(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def _put(s3: S3Place, key: str, body: bytes) -> None:
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=body)


def _numbers(start: int, stop: int) -> bytes:
    return _parquet_bytes(pa.table({"n": pa.array(range(start, stop), pa.int64())}))


def _ctx(tmp_path: Path, **limits: Any) -> ExecutionContext:
    return ExecutionContext(base_dir=tmp_path, allowed_roots=(tmp_path,), limits=ExecutionLimits(**limits))


def _source(s3: S3Place, kind: str, key: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "path": s3.url(key), "options": s3.options(), **extra}


def _store(s3: S3Place) -> StoreOptions:
    return StoreOptions(endpoint=s3.endpoint, region=REGION, allow_http=True, access_key_id=ACCESS_KEY,
                        secret_access_key=SECRET_KEY)  # fmt: skip


@pytest.fixture
def facts(s3: S3Place) -> S3Place:
    """facts/a.parquet (n 0..9), facts/sub/b.parquet (n 100..104), and what a prefix read skips: a writer's
    temporary `_tmp.parquet`, a hidden folder's object and a non-Parquet object (each holding a canary)."""
    _put(s3, "facts/a.parquet", _numbers(0, 10))
    _put(s3, "facts/sub/b.parquet", _numbers(100, 105))
    _put(s3, "facts/_tmp.parquet", _numbers(10_000, 10_001))
    _put(s3, "facts/.hidden/c.parquet", _numbers(20_000, 20_001))
    _put(s3, "facts/notes.txt", CANARY.encode())
    _put(s3, "facts2/x.parquet", _numbers(30_000, 30_001))  # beside the prefix, never under it
    return s3


# ---- reading through `dataflow run` ---------------------------------------------------------------------


def test_a_parquet_object_a_prefix_and_a_glob_are_read_by_dataflow_run(
    facts: S3Place, db_url: str, tmp_path: Path
) -> None:
    """Proves `dataflow run` reads one object, a prefix (its sub-folders' objects too, names starting with `_`
    or `.`, non-Parquet objects and the sibling prefix `facts2` left out) and a glob (one segment deep) from
    s3://, each with its own fingerprint recorded, on both platform databases."""
    document = {
        "name": "s3_read", "version": 1,
        "sources": {
            "one": _source(facts, "parquet", "facts/a.parquet"),
            "folder": _source(facts, "parquet", "facts"),
            "globbed": _source(facts, "parquet", "facts/*.parquet"),
        },
        "steps": [{"name": "r", "sql": "select 'one' as s, count(*) as c, sum(n) as t from one "
                                       "union all select 'folder', count(*), sum(n) from folder "
                                       "union all select 'globbed', count(*), sum(n) from globbed order by s"}],
        "output": {"schema": {"s": "string", "c": "int64", "t": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
    }  # fmt: skip
    (tmp_path / "s3_read.yaml").write_text(yaml.safe_dump(document, sort_keys=False))
    cli = make_cli(db_url, tmp_path)
    ran = cli("run", str(tmp_path / "s3_read.yaml"), "--json")
    assert ran.code == 0, ran.output
    run = ran.json()
    assert run["status"] == "succeeded", run
    shown = cli("result", run["run_id"], "--format", "json")
    assert json.loads(shown.stdout) == [
        {"s": "folder", "c": 15, "t": 45 + 510},
        {"s": "globbed", "c": 10, "t": 45},
        {"s": "one", "c": 10, "t": 45},
    ]
    assert ACCESS_KEY not in ran.output and SECRET_KEY not in ran.output


def test_a_tenant_reads_inside_its_granted_prefix_and_nothing_else_before_recording(
    db_url: str, tmp_path: Path, s3: S3Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a served tenant reads s3:// inside the prefix the grants file gives it for reading (at the
    grant's endpoint, with its granted credential secrets), and that each of these is refused before
    anything is recorded, with a message that names neither the URL nor a secret: a location outside the
    prefix (the other tenant's, and a sibling `acme2`), a prefix granted only for writing, another endpoint,
    no credentials, credentials not granted to it, and a plain credential value."""
    _put(s3, "acme/t.parquet", _parquet_bytes(pa.table({"s": ["acme-row"]})))
    _put(s3, "acme2/t.parquet", _parquet_bytes(pa.table({"s": [CANARY]})))
    _put(s3, "globex/t.parquet", _parquet_bytes(pa.table({"s": [CANARY]})))
    _put(s3, "written/t.parquet", _parquet_bytes(pa.table({"s": [CANARY]})))
    monkeypatch.setenv("GLOBEX_KEY", CANARY)
    grants = {
        "secrets": {"S3_TEST_ACCESS_KEY": {"tenants": ["acme"]}, "S3_TEST_SECRET_KEY": {"tenants": ["acme"]},
                    "GLOBEX_KEY": {"tenants": ["globex"]}},
        "object_stores": [
            {"prefix": s3.url("acme"), "tenants": ["acme"], "access": ["read"], "endpoint": s3.endpoint,
             "region": REGION, "allow_http": True},
            {"prefix": s3.url("written"), "tenants": ["acme"], "access": ["write"], "endpoint": s3.endpoint,
             "region": REGION, "allow_http": True},
        ],
    }  # fmt: skip
    (tmp_path / "grants.yaml").write_text(yaml.safe_dump(grants))
    monkeypatch.setenv("DATAFLOW_GRANTS", str(tmp_path / "grants.yaml"))

    def reading(key: str, **options: Any) -> dict[str, Any]:
        source = {"kind": "parquet", "path": s3.url(key), "options": options}
        return {
            "name": "tenant_s3", "version": 1, "sources": {"t": source},
            "steps": [{"name": "r", "sql": "select s from t"}],
            "output": {"schema": {"s": "string"}, "max_rows": 10, "max_bytes": "1MiB"},
        }  # fmt: skip

    credentials = {"access_key_id": {"secret": "S3_TEST_ACCESS_KEY"},
                   "secret_access_key": {"secret": "S3_TEST_SECRET_KEY"}}  # fmt: skip
    with open_server(db_url, tmp_path / "served") as server:
        own = server.post("acme-submitter", reading("acme/t.parquet", **credentials))
        assert own.status_code == 201, own.text
        assert own.json()["run"]["status"] == "succeeded", own.text
        # The grant's endpoint is used even when the definition gives none.
        named = server.post("acme-submitter", reading("acme/t.parquet", endpoint=s3.endpoint, allow_http=True,
                                                      **credentials))  # fmt: skip
        assert named.json()["run"]["status"] == "succeeded", named.text
        before = server.run_count()
        refusals = [
            ("acme-submitter", reading("globex/t.parquet", **credentials), "outside the object-store prefixes"),
            ("acme-submitter", reading("acme2/t.parquet", **credentials), "outside the object-store prefixes"),
            ("acme-submitter", reading("written/t.parquet", **credentials), "outside the object-store prefixes"),
            ("acme-submitter", reading("acme/t.parquet", endpoint="http://127.0.0.2:9", allow_http=True,
                                       **credentials), "differs from the endpoint granted"),
            ("acme-submitter", reading("acme/t.parquet"), "needs credentials"),
            ("globex-submitter", reading("acme/t.parquet", **credentials), "not granted to this tenant"),
            ("globex-submitter", reading("acme/t.parquet", access_key_id={"secret": "GLOBEX_KEY"},
                                         secret_access_key={"secret": "GLOBEX_KEY"}),
             "outside the object-store prefixes"),
            ("acme-submitter", reading("acme/t.parquet", access_key_id={"secret": "GLOBEX_KEY"},
                                       secret_access_key={"secret": "GLOBEX_KEY"}), "not granted to this tenant"),
            ("acme-submitter", reading("acme/t.parquet", access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY),
             "must be a secret reference"),
        ]  # fmt: skip
        for who, document, expected in refusals:
            answer = server.post(who, document)
            assert answer.status_code in (400, 422), answer.text
            assert expected in answer.text, answer.text
            for secret in (s3.bucket, ACCESS_KEY, SECRET_KEY, CANARY, s3.endpoint):
                assert secret not in answer.text, (secret, answer.text)
            assert server.run_count() == before, "a refused submission recorded a run"


# ---- reading in process ---------------------------------------------------------------------------------


def test_a_csv_object_is_read_with_its_declared_types(s3: S3Place, tmp_path: Path) -> None:
    """Proves a CSV object's declared columns arrive as declared (`007` as the int64 7, a decimal exactly),
    undeclared ones inferred, a header-less object named by its schema; a value that is not of its declared
    type fails invalid input naming the source and the column, not the value."""
    _put(s3, "in/x.csv", b"n,amount,label\n007,1.10,a\n2,2.25,b\n")
    _put(s3, "in/bare.csv", b"5|x\n6|y\n")
    d = flows.one_step(
        {"x": _source(s3, "csv", "in/x.csv", schema={"n": "int64", "amount": "decimal(10,2)"}),
         "bare": _source(s3, "csv", "in/bare.csv", header=False, delimiter="|", schema={"k": "int32", "v": "string"})},
        "select x.n, x.amount, x.label, typeof(x.n) as t, (select sum(k) from bare) as k from x order by n",
        {"n": "int64", "amount": "decimal(10,2)", "label": "string", "t": "string", "k": "int64"},
    )  # fmt: skip
    rows = execute(d, {}, _ctx(tmp_path)).table.to_pylist()
    assert [(r["n"], str(r["amount"]), r["label"], r["t"], r["k"]) for r in rows] == [
        (2, "2.25", "b", "BIGINT", 11), (7, "1.10", "a", "BIGINT", 11)
    ]
    _put(s3, "in/x.csv", f"n,amount,label\n{CANARY},1.10,a\n".encode())
    with pytest.raises(InputError) as refused:
        execute(d, {}, _ctx(tmp_path))
    assert "source 'x'" in refused.value.message and "column 'n'" in refused.value.message
    assert CANARY not in refused.value.message


def test_a_delta_table_on_s3_is_read_at_its_pinned_version(s3: S3Place, tmp_path: Path) -> None:
    """Proves a Delta table written to s3:// (delta-rs, storage options) is read at the version a source
    pins and at its latest without one, fingerprinted by table id and version: the same version gives the
    same fingerprint, another version another."""
    import deltalake  # the delta extra, part of dev: a missing package fails the test
    url = s3.url("warehouse/orders")
    options = _store(s3).delta_storage_options()
    first = pa.table({"n": [1, 2], "p": ["x", "y"]})
    deltalake.write_deltalake(url, first, storage_options=options, partition_by=["p"])
    second = pa.table({"n": [40], "p": ["x"]})
    deltalake.write_deltalake(url, second, storage_options=options, mode="append", partition_by=["p"])

    def read(version: int | None) -> tuple[list[dict[str, Any]], str]:
        source = _source(s3, "delta", "warehouse/orders", **({} if version is None else {"version": version}))
        d = flows.one_step({"t": source}, "select p, sum(n) as n from t group by p order by p",
                           {"p": "string", "n": "int64"})  # fmt: skip
        result = execute(d, {}, _ctx(tmp_path))
        return result.table.to_pylist(), result.sources[0][2]

    pinned, at_zero = read(0)
    assert pinned == [{"p": "x", "n": 1}, {"p": "y", "n": 2}]
    assert read(0)[1] == at_zero
    latest, at_one = read(None)
    assert latest == [{"p": "x", "n": 41}, {"p": "y", "n": 2}] and at_one != at_zero
    with pytest.raises(InputError, match="not a delta table"):
        read_missing = flows.one_step({"t": _source(s3, "delta", "warehouse/none")}, "select 1 as n", {"n": "int64"})
        execute(read_missing, {}, _ctx(tmp_path))


@pytest.mark.parametrize("path", ["../other/x.parquet", "/etc/x.parquet", "s3://elsewhere/t/x.parquet", "a//b.parquet"])
def test_a_delta_log_naming_a_file_outside_the_table_is_refused(path: str) -> None:
    """Proves an add action's path must lie under the table's prefix (a log may name any path or URL)."""
    table = store_sources.objectstore.parse_url("s3://bucket/t", "table")
    store_sources._delta_file_inside("t", "p=x/part-0.parquet", table)
    store_sources._delta_file_inside("t", "s3://bucket/t/p=x/part-0.parquet", table)
    with pytest.raises(InputError, match="outside the table's prefix"):
        store_sources._delta_file_inside("t", path, table)


def test_executions_in_an_executor_process_read_the_store(facts: S3Place, tmp_path: Path) -> None:
    """Proves the s3 sources' bindings cross to an executor process (`dataflow worker` and `serve` run DuckDB
    there): a prefix and a CSV object with declared types read there give the right rows."""
    _put(facts, "in/x.csv", b"n\n007\n")
    d = flows.one_step(
        {"folder": _source(facts, "parquet", "facts/"), "x": _source(facts, "csv", "in/x.csv", schema={"n": "int64"})},
        "select (select sum(n) from folder) as t, (select sum(n) from x) as n",
        {"t": "int64", "n": "int64"},
    )  # fmt: skip
    executors = isolation.ExecutorPool()
    try:
        with isolation.using(executors):
            result = execute(d, {}, _ctx(tmp_path))
            assert executors.pids(), "the execution did not run in an executor"
    finally:
        executors.close()
    assert result.table.to_pylist() == [{"t": 555, "n": 7}]


# ---- fingerprints and the changed-while-read check ------------------------------------------------------


def _fingerprint(d: Definition, tmp_path: Path) -> str:
    return resolve_sources(d, _ctx(tmp_path))[0].fingerprint


def test_a_fingerprint_changes_with_an_object_and_only_then(facts: S3Place, tmp_path: Path) -> None:
    """Proves a prefix's fingerprint is stable while its objects stay, unmoved by an object it skips, and
    changes when one of its objects is rewritten; in a versioned bucket, rewriting the same bytes (same
    ETag, same size) is a new version and changes it too."""
    d = flows.one_step({"f": _source(facts, "parquet", "facts")}, "select n from f", {"n": "int64"})
    first = _fingerprint(d, tmp_path)
    _put(facts, "facts/_tmp.parquet", _numbers(1, 2))  # skipped: a writer's temporary object
    _put(facts, "facts/notes.txt", b"other")
    assert _fingerprint(d, tmp_path) == first
    _put(facts, "facts/sub/b.parquet", _numbers(100, 106))
    rewritten = _fingerprint(d, tmp_path)
    assert rewritten != first
    _put(facts, "facts/sub/b.parquet", _numbers(100, 106))  # the same bytes: the same object, unversioned
    assert _fingerprint(d, tmp_path) == rewritten
    facts.client().put_bucket_versioning(Bucket=facts.bucket, VersioningConfiguration={"Status": "Enabled"})
    _put(facts, "facts/sub/b.parquet", _numbers(100, 106))
    versioned = _fingerprint(d, tmp_path)
    assert versioned != rewritten
    assert resolve_sources(d, _ctx(tmp_path))[0].objects[-1].version_id
    _put(facts, "facts/sub/b.parquet", _numbers(100, 106))  # the same bytes again: another version
    assert _fingerprint(d, tmp_path) != versioned


def test_an_object_rewritten_while_the_run_read_it_fails_the_attempt(facts: S3Place, tmp_path: Path) -> None:
    """Proves an object rewritten between resolution (which stamped it) and the engine's read fails the
    execution as changed while the run read it (recomputable), naming the object's name only; untouched
    objects pass `check_unchanged`."""
    d = flows.one_step({"f": _source(facts, "parquet", "facts")}, "select sum(n) as t from f", {"t": "int64"})
    ctx = _ctx(tmp_path)
    resolved = resolve_sources(d, ctx)
    check_unchanged(resolved)  # nothing changed yet
    _put(facts, "facts/a.parquet", _numbers(0, 11))
    with pytest.raises(ExecutionError, match="changed while the run read it") as changed:
        execute(d, {}, ctx, sources=resolved)
    assert "'a.parquet'" in changed.value.message and facts.bucket not in changed.value.message
    facts.client().delete_object(Bucket=facts.bucket, Key="facts/sub/b.parquet")
    fresh = resolve_sources(d, ctx)
    _put(facts, "facts/a.parquet", _numbers(0, 12))
    with pytest.raises(ExecutionError, match="changed while the run read it"):
        check_unchanged(fresh)


def test_the_source_limit_counts_the_objects_sizes(facts: S3Place, tmp_path: Path) -> None:
    """Proves source_bytes_max is enforced on the objects' total size before anything is read."""
    d = flows.one_step({"f": _source(facts, "parquet", "facts")}, "select n from f", {"n": "int64"})
    with pytest.raises(LimitExceeded, match="larger than the source limit"):
        resolve_sources(d, _ctx(tmp_path, source_bytes_max=100))


# ---- refusals --------------------------------------------------------------------------------------------


def test_a_missing_bucket_object_or_prefix_is_a_clear_error(facts: S3Place, tmp_path: Path) -> None:
    """Proves a bucket that does not exist, a key naming no object or prefix, a glob matching nothing and a
    missing CSV object each fail invalid input saying which, without the URL."""
    cases = [
        ({**_source(facts, "parquet", "facts"), "path": "s3://no-such-bucket-4411/facts"}, "bucket does not exist"),
        (_source(facts, "parquet", "nothing/here"), "no parquet object at the path"),
        (_source(facts, "parquet", "facts/*.csv"), "no object matches the glob"),
        (_source(facts, "csv", "facts/none.csv"), "the object does not exist"),
    ]
    for source, expected in cases:
        d = flows.one_step({"f": source}, "select 1 as n", {"n": "int64"})
        with pytest.raises(InputError, match=expected) as refused:
            resolve_sources(d, _ctx(tmp_path))
        assert facts.bucket not in refused.value.message and "s3://" not in refused.value.message


def _parse(source: dict[str, Any]) -> Definition:
    document = {"name": "d", "version": 1, "sources": {"t": source}, "steps": [{"name": "r", "sql": "select 1 as n"}],
                "output": {"schema": {"n": "int64"}, "max_rows": 1, "max_bytes": "1KiB"}}  # fmt: skip
    return parse_definition(json.dumps(document), "d.json")


@pytest.mark.parametrize(("source", "expected"), [
    ({"kind": "parquet", "path": "s3://b-ok/k", "options": {"endpiont": "http://x"}}, "unknown object-store option"),
    ({"kind": "csv", "path": "s3://b-ok/k.csv", "options": {"access_key_id": CANARY, "secret_access_key": CANARY}},
     "must be a secret reference"),
    ({"kind": "delta", "path": "s3://b-ok/t", "options": {"access_key_id": {"secret": "A"}}}, "give both"),
    ({"kind": "parquet", "path": "local/x.parquet", "options": {"region": "us-east-1"}}, "only with an s3:// path"),
    ({"kind": "csv", "path": "s3://b-ok/*.csv"}, "not a glob"),
    ({"kind": "parquet", "path": "s3://b-ok/{a,b}.parquet"}, "must not contain '{'"),
    ({"kind": "csv", "path": "s3://b-ok/k.csv", "header": False}, "needs a schema"),
    ({"kind": "parquet", "path": "s3://B_bad/k"}, "bucket name"),
    ({"kind": "parquet", "path": "s3://b-ok/a/../k"}, "'..' segments"),
    ({"kind": "parquet", "path": "s3://b-ok/k", "options": {"endpoint": "http://127.0.0.1:9"}}, "allow_http"),
])  # fmt: skip
def test_a_definition_with_bad_store_options_is_refused(source: dict[str, Any], expected: str) -> None:
    """Proves an unknown option, a plain credential value, half a key pair, options on a local path, a CSV
    glob, braces, a header-less CSV object without a schema, a bad bucket or key and plain http without
    allow_http are refused when the definition is parsed, never echoing a value."""
    with pytest.raises(InputError, match=expected) as refused:
        _parse(source)
    assert CANARY not in refused.value.message


def test_a_definition_without_store_options_keeps_its_hash() -> None:
    """Proves a source without `options` writes no options into its canonical body (the hashes of every
    definition recorded before object stores stay as they were), and one with options keeps them."""
    from durable_dataflow.dataflow.definitions.definitions import canonical_body

    plain = _parse({"kind": "parquet", "path": "x.parquet"})
    assert "options" not in canonical_body(plain)["sources"]["t"]
    stored = _parse({"kind": "parquet", "path": "s3://b-ok/x.parquet", "options": {"region": "us-east-1"}})
    assert canonical_body(stored)["sources"]["t"]["options"] == {"region": "us-east-1"}
    assert Definition.model_validate(canonical_body(stored)) == stored


@pytest.mark.spark  # needs pyspark: skipped locally without it, a failure where Spark is required (CI)
def test_engine_spark_refuses_an_s3_source_before_recording(tmp_path: Path) -> None:
    """Proves a definition on engine spark with an s3:// source is refused by preflight (what runs before a
    run is recorded), naming the source and the engine to use."""
    source = {"kind": "parquet", "path": "s3://b-ok/x.parquet"}
    document = {"name": "d", "version": 1, "engine": "spark", "sources": {"t": source},
                "steps": [{"name": "r", "sql": "select 1 as n"}],
                "output": {"schema": {"n": "int64"}, "max_rows": 1, "max_bytes": "1KiB"}}  # fmt: skip
    with pytest.raises(InputError, match="engine spark does not read s3:// sources"):
        compute.preflight(Definition.model_validate(document), _ctx(tmp_path))
    document["engine"] = "duckdb"
    compute.preflight(Definition.model_validate(document), _ctx(tmp_path))


def test_validate_reads_only_the_schemas_of_s3_sources(facts: S3Place, sqlite_url: str, tmp_path: Path) -> None:
    """Proves `dataflow validate`'s check describes s3 sources from their footers and headers (a declared
    type applied): a wrong output type is a problem naming the step and column, a missing prefix names the
    source; nothing is recorded."""
    _put(facts, "in/x.csv", b"n,label\n1,a\n")
    document: dict[str, Any] = {
        "name": "v", "version": 1,
        "sources": {"f": _source(facts, "parquet", "facts"),
                    "x": _source(facts, "csv", "in/x.csv", schema={"n": "int32"})},
        "steps": [{"name": "r", "sql": "select n, (select typeof(n) from x limit 1) as t from f"}],
        "output": {"schema": {"n": "date", "t": "string"}, "max_rows": 100, "max_bytes": "1MiB"},
    }  # fmt: skip
    access, space = AccessContext.local("default"), workspace.local(tmp_path)
    with Platform(sqlite_url) as platform:
        report = validate_definition(platform.runs, Definition.model_validate(document), {}, space, access)
        assert [(p.step, p.column) for p in report.problems] == [("r", "n")], report.problems
        document["output"]["schema"]["n"] = "int64"
        report = validate_definition(platform.runs, Definition.model_validate(document), {}, space, access)
        assert report.valid, report.problems
        document["sources"]["f"]["path"] = facts.url("missing")
        missing = validate_definition(platform.runs, Definition.model_validate(document), {}, space, access)
        assert [p.source for p in missing.problems] == ["f"], missing.problems



def test_the_object_caps_are_the_local_caps() -> None:
    """Proves a store's Parquet source and Delta snapshot are capped as a local folder and snapshot are."""
    from durable_dataflow.dataflow.execution import sources

    assert store_sources.PARQUET_OBJECTS_MAX == sources.PARQUET_FOLDER_FILES_MAX
    assert store_sources.DELTA_OBJECTS_MAX == sources.DELTA_FILES_MAX
