"""`dataflow --api URL submit` (issue 33 item 5): the definition file's YAML queued through
``POST /v1/runs?queue=true`` for the token's tenant, printed and exited as the local submit is; a replay
returns the same run; `--wait` waits for a worker; `--adopt-evidence-key` is refused over the API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from test_cli_remote import Served, dataflow, remote_dataflow, serving

from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.dataflow.worker import Worker, WorkerOptions


@pytest.fixture
def served(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with serving(db_url, tmp_path, monkeypatch) as found:
        yield found


def test_submit_queues_over_the_api_as_locally(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves `submit` over --api records a queued run of the token's tenant (nothing executed), prints the
    same JSON fields as the local submit, replays the same run under the same key, and a worker then runs it."""
    definition = str(served.examples / "revenue_by_region" / "dataflow.yaml")
    local = dataflow(capsys, "--db", served.db_url, "submit", definition, "-p", "day=2026-11-02", "--tenant", "acme",
                     "-k", "local", "--json")  # fmt: skip
    over_api = remote_dataflow(served, capsys, monkeypatch, "submit", definition, "-p", "day=2026-11-02",
                               "-k", "remote", "--json")  # fmt: skip
    assert (over_api.code, local.code) == (0, 0), over_api.stderr
    local_doc, api_doc = json.loads(local.stdout), json.loads(over_api.stdout)
    assert set(api_doc) == set(local_doc)
    assert api_doc["status"] == "queued" and api_doc["tenant"] == "acme" and api_doc["replayed"] is False
    assert api_doc["principal"] == "token:acme-operator" and api_doc["provenance"]["trigger"] == "api"
    assert served.platform.runs.get(api_doc["run_id"]).status == "queued"

    replay = remote_dataflow(served, capsys, monkeypatch, "submit", definition, "-p", "day=2026-11-02", "-k", "remote")
    assert replay.code == 0 and "replayed: existing run returned" in replay.stdout, replay.output
    assert api_doc["run_id"][:8] in replay.stdout or api_doc["run_id"] in replay.stdout

    Worker(served.platform.runs, WorkerOptions(until_idle=True, poll_interval_s=0.05)).run()
    waited = remote_dataflow(served, capsys, monkeypatch, "submit", definition, "-p", "day=2026-11-02",
                             "-k", "remote", "--wait", "--json")  # fmt: skip
    assert waited.code == 0 and json.loads(waited.stdout)["status"] == "succeeded", waited.output


def test_submit_over_the_api_refuses_what_acts_on_the_database(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--adopt-evidence-key` changes the database's key setting, and `--tenant` names a tenant the token does
    not choose: over --api each exits 2 naming the option (for `run` too), and nothing is recorded."""
    definition = str(served.examples / "revenue_by_region" / "dataflow.yaml")
    said = remote_dataflow(served, capsys, monkeypatch, "submit", definition, "-p", "day=2026-11-02",
                           "--adopt-evidence-key")  # fmt: skip
    assert said.code == 2 and "--adopt-evidence-key" in said.stderr, said.output
    for command in ("submit", "run"):
        other = remote_dataflow(served, capsys, monkeypatch, command, definition, "-p", "day=2026-11-02",
                                "--tenant", "globex")  # fmt: skip
        assert other.code == 2 and "--tenant does not apply under --api" in other.stderr, other.output
    with served.platform.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dataflow_runs)).scalar_one() == 0
