"""Acceptance: docs/tutorial.md runs as written (issue 30, item 1). Every `sh` block of the page, in order,
is one bash script run with `set -euo pipefail` in an empty folder with only `dataflow` (this checkout's)
on the PATH, so the page and this test cannot drift apart: a changed command or output breaks it.

The end state is read with deltalake's own reader, never through the platform: each of the four days is
in the Delta table exactly once, the crashed day included, which its reconciliation found present.
"""

from __future__ import annotations

import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from deltalake import DeltaTable

from support.cli import REPO_ROOT, SCRUBBED_ENV
from support.docs import blocks_of

pytestmark = pytest.mark.timeout(300)
TUTORIAL = REPO_ROOT / "docs" / "tutorial.md"
SCRIPT_TIMEOUT_S = 240


def tutorial_script() -> str:
    """The page's `sh` blocks, in order, as one script (read by support.docs, as every document's are)."""
    blocks = [block.text for block in blocks_of(TUTORIAL) if block.language == "sh"]
    assert len(blocks) >= 5, "the tutorial lost its command blocks"
    return "".join(blocks)


def test_the_tutorial_runs_as_written(tmp_path: Path) -> None:
    """The whole tutorial exits 0; validate, the backfill and the reconciliation say what the page says;
    the Delta table holds each day once, with the day's completed orders."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV and k != "DATAFLOW_ALLOW_ABSOLUTE_LOCATIONS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", tutorial_script()], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=SCRIPT_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "valid: daily_revenue version 1" in done.stdout
    assert "the process was killed (exit status 137)" in done.stdout
    assert "UNRESOLVED" in done.stdout and "finding: present" in done.stdout
    assert "4 partition(s): 4 published, 0 missing, 0 unresolved run(s)" in done.stdout
    rows = DeltaTable(str(tmp_path / "daily" / "warehouse" / "daily_revenue")).to_pyarrow_table().to_pylist()
    found = sorted((str(r["day"]), r["region"], r["revenue"], r["orders"]) for r in rows)
    assert found == [
        ("2026-11-01", "north", Decimal("10.00"), 1), ("2026-11-01", "south", Decimal("20.00"), 1),
        ("2026-11-02", "north", Decimal("5.50"), 1), ("2026-11-03", "south", Decimal("7.25"), 1),
        ("2026-11-04", "north", Decimal("1.00"), 1),
    ]
    assert (tmp_path / "daily" / ".dataflow" / "dataflow.db").is_file()
