"""Red-team findings (issue 12): holes a hostile tenant token opened through the HTTP API, each kept as
a test of the safe behaviour (every one failed before its fix): server paths in refs and messages,
500s from crafted values, an unresolvable run from a NUL location, the overwrite-by-datasource bypass
and the cross-tenant definition timestamp.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.datasources import registry
from support.tenant_server import Server, open_server


@pytest.fixture
def server(db_url: str, tmp_path: Path) -> Iterator[Server]:
    with open_server(db_url, tmp_path, raise_server_exceptions=False) as opened:
        yield opened


def _inline(value: str = "v") -> dict[str, Any]:
    return {"t": {"kind": "inline", "rows": [{"s": value}], "schema": {"s": "string"}}}


CSV = {"t": {"kind": "csv", "path": "mine.csv", "schema": {"s": "string"}}}


def _document(sources: dict[str, Any], sql: str, target: dict[str, Any] | None = None) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "redteam", "version": 1, "sources": sources, "steps": [{"name": "r", "sql": sql}],
        "output": {"schema": {"s": "string"}, "max_rows": 10, "max_bytes": "1MiB"},
    }  # fmt: skip
    if target is not None:
        document["target"] = target
    return document


def _target(provider: str, location: str, **extra: Any) -> dict[str, Any]:
    return {"type": "datasources.publication", "provider": provider, "datasource": "d", "location": location,
            **extra}  # fmt: skip


def _run(answer: Any) -> dict[str, Any]:
    assert answer.status_code == 201, answer.text
    run: dict[str, Any] = answer.json()["run"]
    return run


# ---- (6) internal paths and server facts echoed to a tenant ------------------------------------


def test_publication_refs_do_not_expose_the_servers_sink_paths(server: Server) -> None:
    """A submitter's own parquet publication: the run JSON and its evidence must not name the
    server's absolute sink folder (LOCAL_FIELDS hides base_dir/workspace, but the refs carry it)."""
    run = _run(server.post("acme-submitter", _document(_inline(), "select s from t", _target("parquet", "out"))))
    assert run["status"] == "succeeded", run
    evidence = server.client.get(f"/v1/runs/{run['run_id']}/evidence", headers=server.headers["acme-submitter"])
    seen = json.dumps(run) + evidence.text
    assert str(server.sinks) not in seen


def test_a_step_cannot_learn_the_service_users_home_directory(server: Server) -> None:
    """`select … from duckdb_extensions()` passes the gate; DuckDB's Permission Error quotes
    ~/.duckdb/extensions/…, and the run's error_message returns it (docs/security.md promises no
    step learns the service user's home directory)."""
    for sources in (_inline(), CSV):
        sql = "select extension_name as s from duckdb_extensions()"
        run = _run(server.post("acme-submitter", _document(sources, sql)))
        assert run["status"] == "failed"
        assert str(Path.home()) not in (run["error_message"] or ""), run["error_message"]
        assert ".duckdb" not in (run["error_message"] or "")


def test_a_step_cannot_echo_the_spill_folder_through_a_catalog_error(server: Server) -> None:
    """query_table(<constant>) fails with "Table with name <value> does not exist", and that first
    line is stored and returned: current_setting('temp_directory') (the server's spill folder) leaks."""
    sql = "select s from query_table(current_setting('temp_directory'))"
    run = _run(server.post("acme-submitter", _document(CSV, sql)))
    assert run["status"] == "failed"
    assert "dataflow-spill-" not in (run["error_message"] or ""), run["error_message"]


def test_delta_publish_errors_do_not_echo_absolute_sink_paths(server: Server) -> None:
    """A delta target whose location is a file the tenant's own parquet publication created: the
    delta-rs text ('Invalid table location: Path does not exist: "/abs/…"') is stored in the run's
    error_message and in the reconcile detail. The run must fail, with a message that says why and
    never names the path (issue 26, finding 8: a run that did not fail passed this test)."""
    first = _run(server.post("acme-operator", _document(_inline(), "select s from t", _target("parquet", "out"))))
    stem = hashlib.sha256(f"dataflow/acme/{first['run_id']}".encode()).hexdigest()
    run = _run(server.post("acme-operator", _document(_inline(), "select s from t",
                                                      _target("delta", f"out/data/{stem}.parquet"))))  # fmt: skip
    assert run["status"] == "failed", run
    assert isinstance(run["error_message"], str) and run["error_message"].strip(), run
    assert str(server.sinks) not in run["error_message"], run["error_message"]
    answer = server.client.post(f"/v1/runs/{run['run_id']}/reconcile", json={}, headers=server.headers["acme-operator"])
    assert str(server.sinks) not in answer.text


# ---- (5) crafted requests: 500s and runs that can never resolve -------------------------------


@pytest.mark.parametrize("kind", ["csv", "parquet", "delta"])
def test_a_nul_byte_in_a_source_path_is_invalid_input(server: Server, kind: str) -> None:
    """confine_path() catches OSError/RuntimeError but not the ValueError of Path.resolve()."""
    before = server.run_count()
    answer = server.post("acme-submitter", _document({"t": {"kind": kind, "path": "mine\x00.csv"}}, "select 'x' s"))
    assert answer.status_code == 422, answer.text
    assert server.run_count() == before


@pytest.mark.parametrize("provider", ["parquet", "delta"])
def test_a_nul_byte_in_a_target_location_is_refused_before_recording(server: Server, provider: str) -> None:
    """check_location() lets '\\x00' through; at dispatch resolve_location() raises ValueError, which
    dispatch records as outcome_unknown, and every reconcile is 'undecided' — though nothing can
    ever have been written."""
    before = server.run_count()
    answer = server.post("acme-submitter", _document(_inline(), "select s from t", _target(provider, "o\x00ut")))
    assert answer.status_code == 422, answer.text
    assert server.run_count() == before


@pytest.mark.parametrize("place", ["target option", "inline row"])
def test_deeply_nested_values_in_a_definition_are_invalid_input(server: Server, place: str) -> None:
    """A value nested 500 deep (JSON accepts up to 1000) passes validation, then pydantic's
    model_dump raises 'Maximum serialization depth exceeded' in definition_hash: 500, not 422."""
    nested = "[" * 500 + "]" * 500
    if place == "target option":
        document = _document(_inline(), "select s from t", _target("parquet", "o", options={"x": "HOLE"}))
    else:
        document = _document({"t": {"kind": "inline", "rows": [{"s": "HOLE"}], "schema": {"s": "string"}}},
                             "select 'a' s")  # fmt: skip
    body = '{"definition": ' + json.dumps(document).replace('"HOLE"', nested) + "}"
    answer = server.post_raw("acme-submitter", body)
    assert answer.status_code == 422, answer.text


# ---- roles and tenant isolation -----------------------------------------------------------------


def test_a_submitter_cannot_overwrite_by_naming_an_unrelated_datasource(server: Server) -> None:
    """The overwrite check looks only at target.datasource; the provider and location actually used
    are the definition's. A submitter names another team's 'scratch' parquet datasource (listed by
    GET /v1/datasources) and overwrites its own tenant's delta table that other runs published."""
    for value in ("published-1", "published-2"):
        published = server.post(
            "acme-submitter", _document(_inline(value), "select s from t", _target("delta", "precious"))
        )
        assert _run(published)["status"] == "succeeded"
    with server.platform.db.begin() as conn:
        registry.register_datasource(conn, "globex.scratch", "parquet", "scratch", {"allow_overwrite": True})
    target = {**_target("delta", "precious", mode="overwrite"), "datasource": "globex.scratch"}
    before = server.run_count()
    answer = server.post("acme-submitter", _document(_inline("wiped"), "select s from t", target))
    assert answer.status_code == 403, answer.text
    assert server.run_count() == before


def test_definitions_do_not_reveal_that_another_tenant_ran_the_same_definition(server: Server) -> None:
    """Proves /v1/definitions shows a tenant its own first run of a definition as its registration time:
    the platform-wide time would tell acme that globex ran the same definition earlier (an oracle)."""
    document = _document(_inline("common"), "select s from t")
    _run(server.post("globex-submitter", document))
    server.platform.db.advance_clock(60)  # acme comes a minute later on the database clock
    mine = _run(server.post("acme-submitter", document))
    listed = server.client.get("/v1/definitions", headers=server.headers["acme-submitter"]).json()["definitions"]
    [entry] = [d for d in listed if d["definition_hash"] == mine["definition_hash"]]
    assert entry["registered_at_us"] == mine["created_at_us"]
