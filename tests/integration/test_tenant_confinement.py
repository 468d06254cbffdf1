"""Tenant confinement end to end (docs/security.md): each tenant reads only its own data tree, writes
only under its own sink root, names only its granted secrets — through the API, a worker and the CLI.

Every refusal here happens before recording: the answer is an error and no run row exists. The last
sections hold the red team's findings through the API (issue 12): a tenant learns none of the server's
paths (its sink root, the service user's home, the spill folder) from refs or error messages; a crafted
definition (a NUL byte in a path or location, a value nested 500 deep) is invalid input, never a 500 or a
run that can never resolve; naming another datasource does not lift the overwrite check; and a
definition's registration time does not reveal that another tenant ran it first.

The same promises against a real `dataflow serve` subprocess and a hostile tenant with canaries
everywhere: tests/integration/test_hostile_tenant.py; the data path in process (table functions,
symlinks, Delta logs, the PostgreSQL source): tests/integration/test_data_path_attacks.py; the HTTP surface
(bodies, cursors, headers, CSRF, echoed values): tests/integration/test_api_hardening.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from durable_dataflow.datasources import registry
from support import flows
from support.api_runs import grant_secrets
from support.cli import make_cli
from support.tenant_server import Server, open_server

CANARY = "canary-5f0b2e91"


@pytest.fixture
def server(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    monkeypatch.setenv("ACME_SINK_DSN", f"postgresql://acme:{CANARY}@127.0.0.1:1/acme")
    monkeypatch.setenv("PLATFORM_LOOKALIKE", CANARY)
    grant_secrets(tmp_path, monkeypatch, {"ACME_SINK_DSN": ["acme"]})
    with open_server(db_url, tmp_path, mine=lambda tenant: f"{tenant}-{CANARY}") as opened:
        yield opened


def _reading(path: str) -> dict[str, Any]:
    return _document({"t": {"kind": "csv", "path": path, "schema": {"s": "string"}}}, "select s from t")


def _document(sources: dict[str, Any], sql: str, target: dict[str, Any] | None = None) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "confined", "version": 1, "sources": sources, "steps": [{"name": "r", "sql": sql}],
        "output": {"schema": {"s": "string"}, "max_rows": 10, "max_bytes": "1MiB"},
    }  # fmt: skip
    if target is not None:
        document["target"] = target
    return document


def _refused(server: Server, answer: Any, before: int, code: str = "invalid_input") -> None:
    assert answer.json()["error"]["code"] == code, answer.text
    assert CANARY not in answer.text
    assert server.run_count() == before, "a refused submission recorded a run"


def _inline(value: str = "v") -> dict[str, Any]:
    return {"t": {"kind": "inline", "rows": [{"s": value}], "schema": {"s": "string"}}}


CSV = {"t": {"kind": "csv", "path": "mine.csv", "schema": {"s": "string"}}}


def _target(provider: str, location: str, **extra: Any) -> dict[str, Any]:
    return {"type": "datasources.publication", "provider": provider, "datasource": "d", "location": location,
            **extra}  # fmt: skip


def _run(answer: Any) -> dict[str, Any]:
    assert answer.status_code == 201, answer.text
    run: dict[str, Any] = answer.json()["run"]
    return run



def test_a_tenant_reads_its_own_tree_and_nothing_of_another(server: Server) -> None:
    """Proves relative paths resolve in <data-root>/<tenant>, and `..`, absolute paths and the data root
    itself (the other tenant's files, the whole tree) are refused before recording."""
    own = server.post("acme-submitter", _reading("mine.csv"))
    assert own.status_code == 201 and own.json()["run"]["status"] == "succeeded", own.text
    before = server.run_count()
    for path in ("../globex/mine.csv", str(server.data / "globex" / "mine.csv"), "..", str(server.data)):
        _refused(server, server.post("acme-submitter", _reading(path)), before)


def test_the_platform_settings_and_ungranted_secrets_cannot_be_named(server: Server) -> None:
    """Proves `{secret: DATAFLOW_DB}`, another tenant's grant and an ungranted environment variable are
    refused before recording with one message, in sources and in target options alike."""
    before = server.run_count()
    messages = set()
    for who, name in (("acme-operator", "DATAFLOW_DB"), ("globex-operator", "ACME_SINK_DSN"),
                      ("acme-operator", "PLATFORM_LOOKALIKE"), ("acme-operator", "NEVER_SET_ANYWHERE")):  # fmt: skip
        source = {"t": {"kind": "postgres", "dsn": {"secret": name}, "query": "select 'x' as s"}}
        answer = server.post(who, _document(source, "select s from t"))
        _refused(server, answer, before)
        messages.add(answer.json()["error"]["message"])
        target = {"type": "datasources.publication", "provider": "postgres", "datasource": "d",
                  "location": "t", "options": {"dsn": {"secret": name}}}  # fmt: skip
        inline = {"t": {"kind": "inline", "rows": [{"s": "x"}], "schema": {"s": "string"}}}
        _refused(server, server.post(who, _document(inline, "select s from t", target)), before)
    assert len(messages) == 1, messages


def test_sinks_land_under_the_tenants_sink_root_and_never_outside(server: Server, tmp_path: Path) -> None:
    """Proves a relative location publishes under <sink-root>/<tenant>/, while an absolute location or a
    `..` climb to the other tenant's sink is refused before recording and creates nothing."""
    inline = {"t": {"kind": "inline", "rows": [{"s": "acme-row"}], "schema": {"s": "string"}}}
    published = server.post("acme-submitter", _document(inline, "select s from t", flows.parquet_target(location="t")))
    assert published.json()["run"]["status"] == "succeeded", published.text
    files = sorted((server.sinks / "acme" / "t" / "data").rglob("*.parquet"))
    assert [pq.read_table(f).column("s").to_pylist() for f in files] == [["acme-row"]]
    before = server.run_count()
    outside = tmp_path / "outside"
    for location in (str(outside), "../globex/t", "t/../../globex/t"):
        document = _document(inline, "select s from t", flows.parquet_target(location=location))
        answer = server.post("globex-submitter", document)
        _refused(server, answer, before)
    assert not outside.exists() and not (server.sinks / "globex").exists()


def test_overwrite_needs_an_operator_or_a_datasource_that_declares_it(server: Server) -> None:
    """Proves a submitter's `mode: overwrite` is refused (403, nothing recorded), an operator's runs, and a
    registered datasource with allow_overwrite lets a submitter overwrite."""
    inline = {"t": {"kind": "inline", "rows": [{"s": "v"}], "schema": {"s": "string"}}}
    target = {**flows.parquet_target(location="t"), "mode": "overwrite"}
    before = server.run_count()
    _refused(server, server.post("acme-submitter", _document(inline, "select s from t", target)), before,
             "permission_denied")  # fmt: skip
    assert server.post("acme-operator", _document(inline, "select s from t", target)).status_code == 201
    with server.platform.db.begin() as conn:
        registry.register_datasource(conn, "analytics.replaceable", "parquet", "t", {"allow_overwrite": True})
    declared = {**target, "datasource": "analytics.replaceable"}
    assert server.post("acme-submitter", _document(inline, "select s from t", declared)).status_code == 201


def test_a_worker_obeys_the_workspace_recorded_with_the_run(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a queued tenant run executes with the roots it was recorded with, not the worker's own
    settings: the worker's DATAFLOW_DATA_ROOTS covers a folder outside the tenant's tree, the tenant's
    file is swapped for a symlink into it after recording, and the run fails without reading it."""
    queued = server.post("acme-submitter", _reading("mine.csv"), queue="true")
    assert queued.status_code == 201, queued.text
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "loot.csv").write_text(f"s\nloot-{CANARY}\n")
    mine = server.data / "acme" / "mine.csv"
    mine.unlink()
    os.symlink(outside / "loot.csv", mine)
    monkeypatch.setenv("DATAFLOW_DATA_ROOTS", str(outside))
    claim = server.platform.runs.claim_next()
    assert claim is not None
    run = server.platform.runs.execute(claim)
    assert (run.status, run.error_code) == ("failed", "invalid_input"), run
    assert CANARY not in (run.error_message or "")


def test_the_cli_refuses_absolute_sink_locations_unless_the_operator_allows(sqlite_url: str, tmp_path: Path) -> None:
    """Proves `dataflow run` refuses an absolute target location by default (exit 2, nothing written)
    and publishes there with DATAFLOW_ALLOW_ABSOLUTE_LOCATIONS=1."""
    outside = tmp_path / "lake" / "t"
    definition = tmp_path / "flow" / "dataflow.json"
    definition.parent.mkdir()
    document = _document({"t": {"kind": "inline", "rows": [{"s": "v"}], "schema": {"s": "string"}}},
                         "select s from t", flows.parquet_target(location=str(outside)))  # fmt: skip
    definition.write_text(json.dumps(document))
    cli = make_cli(sqlite_url, tmp_path)
    refused = cli("run", str(definition), "--json")
    assert refused.code == 2 and "DATAFLOW_ALLOW_ABSOLUTE_LOCATIONS" in refused.stderr, refused.output
    assert not outside.exists()
    allowed = cli("run", str(definition), "--json", extra_env={"DATAFLOW_ALLOW_ABSOLUTE_LOCATIONS": "1"})
    assert allowed.code == 0 and allowed.json()["status"] == "succeeded", allowed.output
    assert list((outside / "data").rglob("*.parquet"))


def test_serve_refuses_to_start_on_a_data_root_that_exposes_the_working_directory(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Proves `dataflow serve` exits before listening when DATAFLOW_DATA_ROOT is its working directory."""
    (tmp_path / ".env").write_text(f"SECRET={CANARY}\n")
    cli = make_cli(sqlite_url, tmp_path)
    result = cli("serve", "--port", "0", extra_env={"DATAFLOW_DATA_ROOT": str(tmp_path)})
    assert result.code == 2 and "--data-root" in result.stderr, result.output
    assert CANARY not in result.output


# ---- the red team through the HTTP API (issue 12) ---------------------------------------------------------
# Holes a hostile tenant token opened, each kept as a test of the safe behaviour (every one failed before
# its fix). The numbers are the red team's.


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
    stem = hashlib.sha256(str(first["publication_idempotency_key"]).encode()).hexdigest()
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
