"""Messages to a stderr that is not a terminal are never wrapped (issue 30): grep finds them whole."""

from __future__ import annotations

import shutil
from pathlib import Path

from support.cli import REVENUE_EXAMPLE, make_cli

# A cast that fails on every completed order; the text makes the step's error message over 80 columns.
FAILING_FILTER = (
    "where o.order_day = $day and cast(o.status || ' is not a number, and this sentence makes the error"
    " message longer than eighty columns' as integer) = 1 and"
)


def test_run_failed_on_a_piped_stderr_is_one_line(sqlite_url: str, tmp_path: Path) -> None:
    """A failed run's `run failed [code]: message` note on stderr (a pipe here) is not hard-wrapped at 80
    columns: the whole message, over 80 characters, arrives on the one line that starts with `run failed`."""
    folder = tmp_path / "revenue"
    shutil.copytree(REVENUE_EXAMPLE.parent, folder)
    path = folder / "dataflow.yaml"
    path.write_text(path.read_text().replace("where o.order_day = $day and", FAILING_FILTER))
    result = make_cli(sqlite_url, tmp_path)("run", str(path), "--param", "day=2026-11-02", "--json")
    assert result.code == 1, result.output
    [line] = [line for line in result.stderr.splitlines() if line.startswith("run failed")]
    message = result.json()["error_message"]
    assert len(line) > 80 and line.endswith(message), result.stderr
