"""The evidence-key setting (DATAFLOW_EVIDENCE_KEY) as the CLI processes check it, beyond `submit`, `run`,
`worker`, `serve` and `reconcile`: `dataflow backfill` (submit and cancel) and `dataflow schedules tick`
refuse a setting other than the ledger's, and an empty or blank key is refused, not used.

From the red team against cancellation and backfills (commit cf6f558): on a keyed platform, `dataflow
backfill` without DATAFLOW_EVIDENCE_KEY recorded unkeyed runs (after which every keyed worker refused to
start, and a running one ended them evidence_failed), and `dataflow backfill cancel` without it exited 1
claiming that each run's evidence "fails its keyed MAC". Now all three refuse with exit 2, naming the
variable (never the key), and write nothing.

SQLite only: what is proven is the processes' refusal; ledger.check_key_setting, and the other commands'
refusals, are proven on both engines by tests/integration/test_evidence_key_consistency.py. A worker never
logs the key: tests/acceptance/test_worker_canary.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.cli import Cli, make_cli
from support.flows import DAILY_YAML

KEY = "canary-evidence-key-redteam-41c9"
WITH_KEY = {"DATAFLOW_EVIDENCE_KEY": KEY}
FLOW = DAILY_YAML


@pytest.fixture
def cli(sqlite_url: str, tmp_path: Path) -> Cli:
    return make_cli(sqlite_url, tmp_path)


def _runs(cli: Cli) -> list[tuple[str, str]]:
    listed = cli("runs", "--json", extra_env=WITH_KEY)
    assert listed.code == 0, listed.output
    data = listed.json()
    items = data["runs"] if isinstance(data, dict) else data
    return sorted((item["run_id"], item["status"]) for item in items)


def test_backfill_and_tick_refuse_another_evidence_key_setting(cli: Cli, tmp_path: Path) -> None:
    """Proves the finding: a keyed platform with a queued keyed backfill; without the key, `backfill`,
    `backfill cancel` and `schedules tick` each exit 2 naming DATAFLOW_EVIDENCE_KEY, and nothing is
    recorded or cancelled; with the key the cancel works."""
    flow = tmp_path / "daily.yaml"
    flow.write_text(FLOW, encoding="utf-8")
    days = ("--from", "2026-03-01", "--to", "2026-03-02")
    keyed = cli("backfill", str(flow), *days, "--json", extra_env=WITH_KEY)
    assert keyed.code == 0, keyed.output
    before = _runs(cli)
    assert len(before) == 2
    for args in (("backfill", str(flow), "--from", "2026-03-03", "--to", "2026-03-04"),
                 ("backfill", "cancel", str(flow), *days), ("schedules", "tick")):  # fmt: skip
        refused = cli(*args)
        assert refused.code == 2, (args, refused.output)
        assert "error [invalid_input]:" in refused.stderr and "DATAFLOW_EVIDENCE_KEY" in refused.stderr, refused.output
        assert KEY not in refused.output
        assert _runs(cli) == before, args
    cancelled = cli("backfill", "cancel", str(flow), *days, "--json", extra_env=WITH_KEY)
    assert cancelled.code == 0, cancelled.output
    assert [day["outcome"] for day in cancelled.json()] == ["cancelled", "cancelled"]


@pytest.mark.parametrize("key", ["", "   ", "\n"])
def test_an_empty_evidence_key_is_refused_not_used(cli: Cli, tmp_path: Path, key: str) -> None:
    """Proves an empty (or blank) DATAFLOW_EVIDENCE_KEY is refused with exit 2 before anything runs: it
    was used as a key, so the ledger was "keyed" with a MAC anyone can compute. The same from the
    secrets directory."""
    flow = tmp_path / "flow.yaml"
    flow.write_text(FLOW)
    refused = cli("run", str(flow), "--param", "day=2026-11-02", extra_env={"DATAFLOW_EVIDENCE_KEY": key})
    assert refused.code == 2 and "DATAFLOW_EVIDENCE_KEY is set but empty" in refused.stderr, refused.output
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir(exist_ok=True)
    (secrets_dir / "DATAFLOW_EVIDENCE_KEY").write_text(key)
    refused = cli("runs", extra_env={"DATAFLOW_SECRETS_DIR": str(secrets_dir)})
    assert refused.code == 2 and "DATAFLOW_EVIDENCE_KEY is set but empty" in refused.stderr, refused.output
    assert cli("runs", "--json").json() == []
