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

from durable_dataflow.dataflow.protocol import fleet
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


def test_workers_over_the_api_with_a_platform_token(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves an operator with only a platform token sees the fleet over --api (issue 33's done-when): `workers
    --json` equals the local one, the table names each process and its state; a tenant's token exits 1
    permission_denied, as GET /v1/workers refuses it."""
    fleet.register(served.platform.db, holder="h:1:a", role=fleet.Role.WORKER, concurrency=2, ttl_s=60,
                   holder_locked=False)  # fmt: skip
    fleet.register(served.platform.db, holder="h:2:b", role=fleet.Role.WORKER, concurrency=1, ttl_s=60,
                   holder_locked=False)  # fmt: skip
    fleet.mark_stopped(served.platform.db, "h:2:b")
    local = dataflow(capsys, "--db", served.db_url, "workers", "--json")
    over_api = remote_dataflow(served, capsys, monkeypatch, "workers", "--json", token=served.platform_token)
    assert (over_api.code, local.code) == (0, 0), over_api.output
    local_doc, api_doc = json.loads(local.stdout), json.loads(over_api.stdout)
    drop = ("last_beat_age_s",)  # counted on each read's clock
    assert [{k: v for k, v in w.items() if k not in drop} for w in api_doc["workers"]] == [
        {k: v for k, v in w.items() if k not in drop} for w in local_doc["workers"]
    ]
    assert (api_doc["alive"], api_doc["stopped"]) == (1, 1)
    table = remote_dataflow(served, capsys, monkeypatch, "workers", token=served.platform_token)
    assert table.code == 0 and "h:1:a" in table.stdout and "1 alive" in table.stdout, table.output
    tenant = remote_dataflow(served, capsys, monkeypatch, "workers")
    assert tenant.code == 1 and tenant.stderr.startswith("error [permission_denied]:"), tenant.output
