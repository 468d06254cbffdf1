"""Running the `dataflow` CLI as a real subprocess, the way users and scripts do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
REVENUE_EXAMPLE = EXAMPLES / "revenue_by_region" / "dataflow.yaml"
PUBLISH_EXAMPLE = EXAMPLES / "daily_orders_publish"
CLI_TIMEOUT_S = 120
# Environment that would change what the CLI does; each test sets what it needs explicitly.
SCRUBBED_ENV = (
    "DATAFLOW_DB", "DATAFLOW_LEASE_TTL", "DATAFLOW_CRASH_AT", "DATAFLOW_PAUSE_AT", "DATAFLOW_EVIDENCE_KEY",
    # The platform limits (dataflow/execution/limits.py SETTINGS): a developer's own settings must not leak in.
    "DATAFLOW_TIME_LIMIT", "DATAFLOW_MEMORY_LIMIT", "DATAFLOW_THREADS", "DATAFLOW_TEMP_DIR", "DATAFLOW_TEMP_MAX",
    "DATAFLOW_SOURCE_BYTES_MAX", "DATAFLOW_RESULT_BYTES_MAX",
    # Confinement (dataflow/execution/workspace.py) and secrets.
    "DATAFLOW_GRANTS", "DATAFLOW_DATA_ROOT", "DATAFLOW_SINK_ROOT", "DATAFLOW_DATA_ROOTS",
    "DATAFLOW_ALLOW_ABSOLUTE_LOCATIONS", "DATAFLOW_SECRETS_DIR",
    # Where the Spark engine runs (dataflow/execution/spark_engine.py).
    "DATAFLOW_SPARK_MASTER", "DATAFLOW_SPARK_REMOTE", "DATAFLOW_SPARK_CONF",
    # The remote CLI (cli/remote.py): a developer's API URL would send the commands elsewhere.
    "DATAFLOW_API_URL", "DATAFLOW_TOKEN",
)


@dataclass(frozen=True)
class CliResult:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@dataclass(frozen=True)
class Cli:
    """The CLI bound to one platform database URL and a working directory."""

    db_url: str
    cwd: Path
    env: dict[str, str]

    def __call__(self, *args: str, debug: bool = False, extra_env: dict[str, str] | None = None) -> CliResult:
        argv = [sys.executable, "-m", "durable_dataflow.cli", "--db", self.db_url]
        if debug:
            argv.append("--debug")
        env = {**self.env, **(extra_env or {})}
        done = subprocess.run(
            [*argv, *args], cwd=self.cwd, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
        )
        return CliResult(done.returncode, done.stdout, done.stderr)


def make_cli(db_url: str, cwd: Path) -> Cli:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    return Cli(db_url=db_url, cwd=cwd, env=env)
