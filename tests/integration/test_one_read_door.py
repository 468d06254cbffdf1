"""One door for reads (issue 28, item 5): the CLI and the JSON API give the same JSON for the same run.

A succeeded, a failed, a queued and an outcome_unknown run are recorded on a real database; each is read
with the CLI in process (Typer's CliRunner: `runs --json`, `show --json`, `verify --json`) and with the
API (FastAPI's TestClient: `GET /v1/runs`, `/v1/runs/{id}`, `/v1/runs/{id}/evidence`), and the documents
are compared object for object, `age_s` aside (seconds since the run was recorded: two reads differ).
A shape check reads the source: the modules behind those commands and routes compose no read of their own.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from durable_dataflow.api.app import create_app
from durable_dataflow.cli import app as cli_app
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import copy_examples, make_outcome_unknown_run, make_tokens, tenant_data_root

SRC = Path(__file__).resolve().parents[2] / "src" / "durable_dataflow"
# The one field of the run JSON that depends on the moment of the read.
MOMENT_FIELDS = ("age_s",)


@dataclass(frozen=True)
class Reader:
    """The same database, read by the CLI (in process) and by the API (as the acme viewer)."""

    db_url: str
    client: TestClient
    token: str
    runs: dict[str, Run]  # by what each run is: succeeded, failed, queued, outcome_unknown

    def cli(self, *args: str, code: int = 0) -> Any:
        result = CliRunner().invoke(cli_app, ["--db", self.db_url, *args])
        assert result.exit_code == code, (args, result.output)
        return json.loads(result.stdout)

    def api(self, path: str) -> Any:
        answer = self.client.get(path, headers={"Authorization": f"Bearer {self.token}"})
        assert answer.status_code == 200, answer.text
        return answer.json()


def _failed_run(platform: Platform, base_dir: Path) -> Run:
    """A run whose result has more rows than its output allows: failed, limit_exceeded."""
    defn = flows.one_step(
        {"nums": {"kind": "inline", "rows": [{"n": 1}, {"n": 2}], "schema": {"n": "int64"}}},
        "select n from nums",
        {"n": "int64"},
        name="too_many",
        max_rows=1,
    )
    run = platform.runs.run_inline(flows.request(defn, base_dir, "failed")).run
    assert run.status == "failed", run
    return run


@pytest.fixture
def reader(db_url: str, tmp_path: Path) -> Iterator[Reader]:
    platform = Platform(db_url)
    examples = copy_examples(tmp_path)
    made = {
        "succeeded": platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "succeeded")).run,
        "failed": _failed_run(platform, tmp_path),
        "queued": platform.runs.submit(flows.request(flows.definition(name="later"), tmp_path, "queued")).run,
        "outcome_unknown": make_outcome_unknown_run(platform, examples, "acme"),
    }
    assert made["succeeded"].status == "succeeded" and made["queued"].status == "queued"
    app = create_app(platform, data_root=tenant_data_root(tmp_path, examples))
    with TestClient(app) as client:
        yield Reader(db_url, client, make_tokens(platform).viewer, made)
    platform.close()


def _at_no_moment(run: dict[str, Any]) -> dict[str, Any]:
    """The run JSON without the fields that depend on when it was read (each must be there)."""
    assert all(isinstance(run[name], float) and run[name] >= 0 for name in MOMENT_FIELDS), run
    return {name: value for name, value in run.items() if name not in MOMENT_FIELDS}


RUN_KINDS = ("succeeded", "failed", "queued", "outcome_unknown")


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_show_and_the_api_give_the_same_run_and_evidence(reader: Reader, kind: str) -> None:
    """`show --json`'s run equals GET /v1/runs/{id}'s and the evidence's run; its ledger and checkpoint
    equal the evidence's entries and checkpoint, byte for byte once serialized."""
    run_id = reader.runs[kind].run_id
    shown = reader.cli("show", run_id, "--json")
    ledger, checkpoint = shown.pop("ledger"), shown.pop("checkpoint")
    one = reader.api(f"/v1/runs/{run_id}")
    evidence = reader.api(f"/v1/runs/{run_id}/evidence")
    assert _at_no_moment(shown) == _at_no_moment(one["run"]) == _at_no_moment(evidence["run"])
    assert list(shown) == list(one["run"]) == list(evidence["run"])  # the same fields in the same order
    assert json.dumps(ledger) == json.dumps(evidence["entries"]) and ledger
    assert json.dumps(checkpoint) == json.dumps(evidence["checkpoint"])
    assert (checkpoint is None) == (kind == "queued")  # every terminal state is checkpointed, a queued run not
    assert set(evidence) == {"run", "entries", "verification", "checkpoint"}


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_verify_and_the_evidence_give_the_same_verification(reader: Reader, kind: str) -> None:
    """`verify --json` prints exactly the evidence's `verification` object, run id and null reason included."""
    run_id = reader.runs[kind].run_id
    verified = reader.cli("verify", run_id, "--json")
    assert json.dumps(verified) == json.dumps(reader.api(f"/v1/runs/{run_id}/evidence")["verification"])
    assert verified["run_id"] == run_id and verified["ok"] is True and verified["reason"] is None


def test_runs_and_the_api_list_the_same_runs(reader: Reader) -> None:
    """`runs --tenant acme --json` lists the runs GET /v1/runs lists to acme, in order, each the same JSON."""
    listed = reader.cli("runs", "--tenant", "acme", "--json")
    answer = reader.api("/v1/runs")
    assert answer["next_cursor"] is None
    assert [_at_no_moment(run) for run in listed] == [_at_no_moment(run) for run in answer["runs"]]
    assert {run["run_id"] for run in listed} == {run.run_id for run in reader.runs.values()}


# ---- shape: the commands and routes compose no read of their own -----------------------------------

# The modules behind `runs`, `show`, `verify`, GET /v1/runs, /v1/runs/{id}, /v1/runs/{id}/evidence and
# the web history and run pages.
READERS = ("cli/show.py", "cli/runs.py", "api/operations.py", "api/v1.py", "api/web.py")
# What each used to compose its reads from; only the read module (dataflow.protocol.views) calls these now.
COMPOSED_READS = {
    "ledger.read",
    "checkpoints.latest",
    "transitions.verify_run",
    "derivation.verify_run",
    "runs.list_page",
    "views.load",
    "views.load_one",
    "views.entry_json",
}
# Storage modules the read-only modules no longer import (cli/runs.py still imports core.ledger: `run`
# checks the evidence-key setting before it writes).
STORAGE_IMPORTS = {"durable_dataflow.core.ledger", "durable_dataflow.core.checkpoints",
                   "durable_dataflow.dataflow.protocol.transitions",
                   "durable_dataflow.dataflow.protocol.derivation"}  # fmt: skip


def _tree(module: str) -> ast.Module:
    return ast.parse((SRC / module).read_text(), filename=module)


def _calls(tree: ast.AST) -> set[str]:
    """Every ``name.attribute(...)`` call in ``tree``, as ``name.attribute``."""
    return {
        f"{node.func.value.id}.{node.func.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
    }


def _imports(tree: ast.AST) -> set[str]:
    """Every module imported, ``from package import module`` counted as ``package.module``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("module", READERS)
def test_the_readers_call_no_storage_read_themselves(module: str) -> None:
    """None of the modules behind those commands and routes calls a storage read the read module composes."""
    assert _calls(_tree(module)) & COMPOSED_READS == set(), module


@pytest.mark.parametrize("module", ("cli/show.py", "cli/runs.py", "api/operations.py"))
def test_the_read_commands_import_views(module: str) -> None:
    """`show`, `verify`, `runs` and the API's operations import the read module."""
    assert "durable_dataflow.dataflow.protocol.views" in _imports(_tree(module)), module


@pytest.mark.parametrize("module", ("cli/show.py", "api/operations.py", "api/v1.py", "api/web.py"))
def test_the_read_only_modules_import_no_storage_module_they_composed_from(module: str) -> None:
    """`show`/`verify` and the API's run reads no longer import the ledger, checkpoints, transitions or derivation."""
    assert _imports(_tree(module)) & STORAGE_IMPORTS == set(), module
