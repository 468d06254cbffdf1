"""`POST /v1/definitions/validate` (issue 30, item 2): a definition checked as a run in the caller's tenant
would check it, reading no data and recording nothing, on SQLite and PostgreSQL platform databases.

Each invalid case is one small change to a valid definition over the tenant's own Parquet and CSV files;
the answer names the step, source, column or parameter concerned. After every request the platform's
tables hold no run, no ledger entry and no definition.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from durable_dataflow.api.app import create_app
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.execution.validate import SPARK_NOT_BOUND
from durable_dataflow.dataflow.protocol.requests import AccessContext
from durable_dataflow.dataflow.protocol.validation import validate_definition
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import Tokens, make_tokens

PATH = "/v1/definitions/validate"
VALID: dict[str, Any] = {
    "name": "segments",
    "version": 1,
    "parameters": {"day": {"type": "date"}},
    "sources": {
        "orders": {"kind": "parquet", "path": "orders.parquet"},
        "regions": {"kind": "csv", "path": "regions.csv", "schema": {"segment": "string", "region": "string"}},
    },
    "steps": [
        {"name": "daily", "sql": "select segment, amount from orders where day = $day"},
        {"name": "by_segment", "sql": "select d.segment, r.region, sum(d.amount) as total, count(*) as n "
                                      "from daily d join regions r using (segment) group by d.segment, r.region"},
    ],
    "output": {"schema": {"segment": "string", "region": "string", "total": "float64", "n": "int64"},
               "max_rows": 100, "max_bytes": "1MiB"},
    "target": {"type": "datasources.publication", "provider": "parquet", "datasource": "analytics.segments",
               "location": "segments"},
}


def _changed(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    document = copy.deepcopy(VALID)
    change(document)
    return document


def _set(path: tuple[str | int, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(document: dict[str, Any]) -> None:
        node: Any = document
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


# (case, the change, the parameters, what the problem names, a phrase of its message)
CASES: list[tuple[str, Callable[[dict[str, Any]], None], dict[str, Any], dict[str, str], str]] = [
    ("wrong_type", _set(("output", "schema", "segment"), "int64"), {"day": "2026-11-02"},
     {"step": "by_segment", "column": "segment"}, "is text (string) but output.schema declares int64"),
    ("missing_column", _set(("output", "schema", "customers"), "int64"), {"day": "2026-11-02"},
     {"step": "by_segment", "column": "customers"}, "has no column 'customers' that output.schema declares"),
    ("unknown_source", _set(("steps", 0, "sql"), "select segment, amount from nowhere"), {"day": "2026-11-02"},
     {"step": "daily"}, "nowhere"),
    ("unknown_column", _set(("steps", 0, "sql"), "select segmnt, amount from orders"), {"day": "2026-11-02"},
     {"step": "daily", "column": "segmnt"}, "segmnt"),
    ("undeclared_parameter", _set(("steps", 0, "sql"), "select segment, amount from orders where day = $when"),
     {"day": "2026-11-02"}, {"step": "daily"}, "uses $when, which is not a declared parameter"),
    ("bad_parameter", lambda d: None, {"day": "yesterday"}, {"parameter": "day"}, "is declared date"),
    ("missing_parameter", lambda d: None, {}, {"parameter": "day"}, "is required and has no default"),
    ("path_outside_roots", _set(("sources", "orders", "path"), "../globex/orders.parquet"), {"day": "2026-11-02"},
     {"source": "orders"}, "resolves outside the run's data roots"),
    ("declared_source_column_missing", _set(("sources", "regions", "schema"), {"zone": "string"}),
     {"day": "2026-11-02"}, {"source": "regions"}, "no column 'zone' that its schema declares"),
    ("target_preflight", _set(("target", "mode"), "overwrite"), {"day": "2026-11-02"}, {},
     "the target cannot be published to: a parquet folder publishes each key as its own file"),
    ("float_to_decimal", _set(("output", "schema", "total"), "decimal(18,2)"), {"day": "2026-11-02"},
     {"step": "by_segment", "column": "total"}, "a float-to-decimal cast rounds silently"),
]


@pytest.fixture
def world(platform: Platform, tmp_path: Path) -> Iterator[tuple[TestClient, Tokens]]:
    tenant = tmp_path / "tenants" / "acme"
    tenant.mkdir(parents=True)
    (tmp_path / "tenants" / "globex").mkdir()
    orders = pa.table({"day": pa.array(["2026-11-02"]).cast(pa.date32()), "segment": ["retail"], "amount": [1.5]})
    pq.write_table(orders, tenant / "orders.parquet")
    pq.write_table(orders, tmp_path / "tenants" / "globex" / "orders.parquet")
    (tenant / "regions.csv").write_text("segment,region\nretail,north\n")
    with TestClient(create_app(platform, data_root=tmp_path / "tenants", sink_root=tmp_path / "sinks")) as client:
        yield client, make_tokens(platform)


def _validate(client: TestClient, token: str, document: dict[str, Any], params: dict[str, Any]) -> Any:
    body = {"definition": document, "parameters": params}
    return client.post(PATH, json=body, headers={"Authorization": f"Bearer {token}"})


def test_a_valid_definition_is_valid_and_nothing_is_recorded(
    platform: Platform, world: tuple[TestClient, Tokens]
) -> None:
    """The valid definition answers 200 valid with the bound result's columns and Arrow types, and the
    platform's tables (runs, ledger, definitions, results, leases) stay empty."""
    client, keys = world
    before = flows.row_counts(platform)
    answer = _validate(client, keys.submitter, VALID, {"day": "2026-11-02"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["valid"] is True and body["problems"] == [], body
    assert body["result_columns"] == [
        {"name": "segment", "type": "string"}, {"name": "region", "type": "string"},
        {"name": "total", "type": "double"}, {"name": "n", "type": "int64"},
    ]
    assert flows.row_counts(platform) == before == {name: 0 for name in before}


@pytest.mark.parametrize(("case", "change", "params", "concerns", "phrase"), CASES, ids=[c[0] for c in CASES])
def test_each_mistake_is_named_and_nothing_is_recorded(
    platform: Platform,
    world: tuple[TestClient, Tokens],
    case: str,
    change: Callable[[dict[str, Any]], None],
    params: dict[str, Any],
    concerns: dict[str, str],
    phrase: str,
) -> None:
    """One change to the valid definition answers 200 invalid with a problem naming what it concerns (the
    operator's token, so the overwrite reaches the target's preflight); nothing is recorded."""
    client, keys = world
    answer = _validate(client, keys.operator, _changed(change), params)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["valid"] is False, body
    matching = [p for p in body["problems"] if phrase in p["message"]]
    assert matching, (case, body["problems"])
    assert all(matching[0][field] == value for field, value in concerns.items()), (case, matching[0])
    assert flows.row_counts(platform) == {name: 0 for name in flows.row_counts(platform)}


def test_a_step_reading_a_file_by_path_is_refused(platform: Platform, world: tuple[TestClient, Tokens]) -> None:
    """read_parquet('/etc/passwd') in a step is refused by the sandbox's file-read check, naming the step,
    as a run refuses it; a document that does not parse is 422; a viewer may not validate."""
    client, keys = world
    hostile = _changed(_set(("steps", 0, "sql"), "select * from read_parquet('/etc/passwd')"))
    body = _validate(client, keys.submitter, hostile, {"day": "2026-11-02"}).json()
    assert body["valid"] is False
    [problem] = body["problems"]
    assert problem["step"] == "daily" and "reads files itself (table function read_parquet)" in problem["message"]
    assert "passwd" not in str(body["notes"])
    broken = _validate(client, keys.submitter, {"name": "x"}, {})
    assert broken.status_code == 422 and broken.json()["error"]["code"] == "invalid_input"
    assert _validate(client, keys.viewer, VALID, {}).status_code == 403


def test_a_postgres_source_is_described_without_its_rows(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A postgres source's query is described (LIMIT 0 on its read-only session): its columns bind, a
    wrong output type is found, and a query over a missing table is a problem naming the source."""
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table validate_customers (id bigint, region text)")
    monkeypatch.setenv("VALIDATE_PG_DSN", dsn)
    document: dict[str, Any] = {
        "name": "crm", "version": 1,
        "sources": {"customers": {"kind": "postgres", "dsn": {"secret": "VALIDATE_PG_DSN"},
                                  "query": "select id, region from validate_customers;"}},
        "steps": [{"name": "r", "sql": "select region, count(*) as n from customers group by region"}],
        "output": {"schema": {"region": "int64", "n": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
    }
    with Platform(f"sqlite:///{tmp_path / 'p.db'}") as platform:
        access, space = AccessContext.local("default"), workspace.local(tmp_path)
        report = validate_definition(platform.runs, Definition.model_validate(document), {}, space, access)
        assert [(p.step, p.column) for p in report.problems] == [("r", "region")], report.problems
        document["sources"]["customers"]["query"] = "select id from no_such_table"
        report = validate_definition(platform.runs, Definition.model_validate(document), {}, space, access)
        assert [p.source for p in report.problems] == ["customers"] and "SQLSTATE 42P01" in report.problems[0].message
        assert flows.row_counts(platform) == {name: 0 for name in flows.row_counts(platform)}


def test_a_spark_definition_is_checked_up_to_the_bind(sqlite_url: str, tmp_path: Path) -> None:
    """engine: spark is gated, its parameters and sources' schemas checked, and a note says the steps were
    not bound (that needs a Spark session, which validation never starts); a gate refusal is a problem."""
    pytest.importorskip("pyspark")
    orders = pa.table({"day": pa.array(["2026-11-02"]).cast(pa.date32()), "segment": ["retail"], "amount": [1.5]})
    pq.write_table(orders, tmp_path / "orders.parquet")
    (tmp_path / "regions.csv").write_text("segment,region\nretail,north\n")
    document = {**copy.deepcopy(VALID), "engine": "spark"}
    access, space = AccessContext.local("default"), workspace.local(tmp_path)
    with Platform(sqlite_url) as platform:
        params = {"day": "2026-11-02"}
        report = validate_definition(platform.runs, Definition.model_validate(document), params, space, access)
        assert report.valid and report.notes == [SPARK_NOT_BOUND], (report.problems, report.notes)
        document["steps"][0]["sql"] = "insert into orders select * from orders"
        refused = validate_definition(platform.runs, Definition.model_validate(document), params, space, access)
        assert [p.step for p in refused.problems] == ["daily"], refused.problems


def test_a_delta_source_is_described_from_its_log(sqlite_url: str, tmp_path: Path) -> None:
    """A Delta source's schema comes from its snapshot (a pinned version too): a wrong output type over it
    is a problem naming the step and the column; a version the table does not have names the source."""
    deltalake = pytest.importorskip("deltalake")
    table = pa.table({"day": pa.array(["2026-11-02"]).cast(pa.date32()), "segment": ["retail"], "amount": [1.5]})
    deltalake.write_deltalake(str(tmp_path / "orders"), table)
    document: dict[str, Any] = {
        "name": "delta_in", "version": 1, "sources": {"orders": {"kind": "delta", "path": "orders", "version": 0}},
        "steps": [{"name": "r", "sql": "select segment, sum(amount) as total from orders group by segment"}],
        "output": {"schema": {"segment": "int64", "total": "float64"}, "max_rows": 10, "max_bytes": "1MiB"},
    }  # fmt: skip
    access, space = AccessContext.local("default"), workspace.local(tmp_path)
    with Platform(sqlite_url) as platform:
        report = validate_definition(platform.runs, Definition.model_validate(document), {}, space, access)
        assert [(p.step, p.column) for p in report.problems] == [("r", "segment")], report.problems
        document["sources"]["orders"]["version"] = 7
        missing = validate_definition(platform.runs, Definition.model_validate(document), {}, space, access)
        assert [p.source for p in missing.problems] == ["orders"], missing.problems
