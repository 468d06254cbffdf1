"""`dataflow cancel RUN` as a real process, on both engines: a queued run is cancelled (once), shown and
verified; a finished run is refused with exit 5 and nothing written.

Cancellation in the other tiers: the protocol on both engines (queued, running, authorized, racing
claims, projections that lie), tests/integration/test_cancel.py; a real worker SIGSTOPped while its run
is cancelled, tests/faults/test_cancel_pause.py. `dataflow backfill cancel`: tests/acceptance/test_cli_schedules.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.cli import Cli, make_cli
from support.flows import MINIMAL_YAML


@pytest.fixture
def cli(db_url: str, tmp_path: Path) -> Cli:
    return make_cli(db_url, tmp_path)


def test_cancel_a_queued_run_then_a_finished_one(cli: Cli, tmp_path: Path) -> None:
    flow = tmp_path / "tiny.yaml"
    flow.write_text(MINIMAL_YAML, encoding="utf-8")
    queued = cli("submit", str(flow), "--idempotency-key", "to-cancel", "--json")
    assert queued.code == 0, queued.output
    run_id = queued.json()["run_id"]
    done = cli("cancel", run_id[-12:], "--json")
    assert done.code == 0, done.output
    answer = done.json()
    assert answer["cancelled"] is True and answer["status"] == "cancelled"
    assert answer["recovery_status"] == "no_external_output" and answer["error_code"] == "cancelled"
    again = cli("cancel", run_id)
    assert again.code == 0 and "already cancelled" in again.output, again.output
    shown = cli("show", run_id)
    assert shown.code == 0 and "cancelled" in shown.output and "run.cancelled" in shown.output, shown.output
    assert cli("verify", run_id).code == 0
    finished = cli("run", str(flow), "--json")
    assert finished.code == 0, finished.output
    refused = cli("cancel", finished.json()["run_id"])
    assert refused.code == 5, refused.output
    assert "already succeeded" in refused.output and "Traceback" not in refused.output
    history = cli("show", finished.json()["run_id"])
    assert "run.cancelled" not in history.output
