"""Tenant confinement end to end (docs/security.md): each tenant reads only its own data tree, writes
only under its own sink root, names only its granted secrets — through the API, a worker and the CLI.

Every refusal here happens before recording: the answer is an error and no run row exists.
"""

from __future__ import annotations

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
