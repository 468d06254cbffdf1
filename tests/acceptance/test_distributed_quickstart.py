"""docs/deployment.md's distributed quick start works as written (issue 33, item 3).

The test extracts the block the doc marks for it (so doc and test cannot drift) and runs it with bash
against the session's throw-away PostgreSQL cluster: roles and databases by psql, `dataflow db upgrade`,
the grants file and tenant roots, `dataflow serve` and two `dataflow worker`s in the background, a run
submitted through the API with a tenant token, then `dataflow show` and `dataflow verify`. It then
reads the sink database back by SQL, independently of the platform, and stops the processes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from durable_dataflow.core.db import Database
from durable_dataflow.dataflow.protocol import fleet
from support.cli import REPO_ROOT
from support.pg import PostgresServer, free_port

pytestmark = pytest.mark.postgres

DOC = REPO_ROOT / "docs" / "deployment.md"
# The variables the doc's settings block exports and the quick start reads; the test gives its own.
SETTINGS = ("PGHOST", "PGPORT", "PGUSER", "SRV", "PORT")
# What step 1 creates in the cluster; dropped afterwards (the cluster is shared by the session).
DATABASES = ("dataflow", "acme_sink")
ROLES = ("dataflow", "acme_sink")
QUICKSTART_TIMEOUT_S = 90
STOP_TIMEOUT_S = 20
STOP_POLL_S = 0.1
WORKERS_WAIT_S = 20
# What the quick start starts in the background, by role in the workers table.
PROCESSES = ("sweeper", "worker", "worker")
EXPECTED_REVENUE = {"north": "11.50", "south": "4.25"}


def _block(marker: str) -> str:
    """The fenced bash block right after the HTML comment that starts with ``marker``."""
    found = re.search(rf"<!-- {marker}[:\s][^>]*-->\n```bash\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    assert found is not None, f"docs/deployment.md has no ```bash block after <!-- {marker} -->"
    return found.group(1)


def test_the_settings_block_names_what_the_test_sets() -> None:
    """The doc's settings block exports exactly the variables the test provides, so neither can drift."""
    exported = re.findall(r"\b([A-Z]+)=", _block("quickstart-settings"))
    assert sorted(exported) == sorted(SETTINGS)
    referenced = set(re.findall(r"\$\{?([A-Z]+)", _block("quickstart")))
    assert set(SETTINGS) - referenced == {"PGUSER"}, "each setting is used (PGUSER by psql itself)"


@pytest.fixture
def cluster(postgres_server: PostgresServer) -> Iterator[PostgresServer]:
    """The session's cluster; what the quick start creates in it is dropped afterwards."""
    try:
        yield postgres_server
    finally:
        with psycopg.connect(postgres_server.admin_url.replace("+psycopg", ""), autocommit=True) as conn:
            for name in DATABASES:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            for role in ROLES:
                conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def _environment(server: PostgresServer, srv: Path) -> dict[str, str]:
    """The caller's environment without any DATAFLOW_* setting, the venv's `dataflow` and the cluster's psql
    first on PATH, and the quick start's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATAFLOW_", "PG"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), str(server.bindir), env.get("PATH", "")])
    env.update(PGHOST="127.0.0.1", PGPORT=str(server.port), PGUSER="postgres", SRV=str(srv), PORT=str(free_port()))
    return env


def _stop(group: int) -> None:
    """SIGTERM the quick start's background processes (its process group), as `kill %1 %2 %3` would, and wait
    until they are gone (SIGKILL after STOP_TIMEOUT_S), so none outlives the databases dropped after the test."""
    deadline_s = time.monotonic() + STOP_TIMEOUT_S
    sent = signal.SIGTERM
    while True:
        try:
            os.killpg(group, sent if sent is not None else 0)
        except ProcessLookupError:
            return
        sent = None
        if time.monotonic() > deadline_s:
            os.killpg(group, signal.SIGKILL)
            return
        time.sleep(STOP_POLL_S)  # polling for the processes' exit: a condition with a deadline, not an order


def _wait_for_workers(url: str, state: str) -> dict[str, int]:
    """The processes per role in ``state`` (fleet.list_workers), once the three the quick start starts are in it
    or after WORKERS_WAIT_S (then what is there): a worker registers as its loop starts, after the script's run."""
    database = Database(url)
    try:
        deadline_s = time.monotonic() + WORKERS_WAIT_S
        while True:
            counted = Counter(w.role for w in fleet.list_workers(database) if str(w.state) == state)
            if sum(counted.values()) >= len(PROCESSES) or time.monotonic() > deadline_s:
                return dict(counted)
            time.sleep(STOP_POLL_S)  # polling a condition with a deadline
    finally:
        database.dispose()


def test_the_distributed_quick_start_publishes_and_verifies_a_run(cluster: PostgresServer, tmp_path: Path) -> None:
    """The doc's quick start, run by bash as written, ends with `dataflow verify` green; the sink database holds
    the run's rows once under its key, read by SQL; both workers started and one of them published it."""
    srv, work = tmp_path / "srv", tmp_path / "work"
    platform_url = f"postgresql://postgres@127.0.0.1:{cluster.port}/dataflow"
    work.mkdir()
    # Each command traced with its time on stderr, so a failure or a slow run shows which step.
    script = "set -euo pipefail\nPS4='+ $EPOCHREALTIME '\nset -x\n" + _block("quickstart")
    # Files, not pipes: the background processes inherit the script's output and outlive it.
    with (tmp_path / "stdout").open("w") as out, (tmp_path / "stderr").open("w") as err:
        process = subprocess.Popen(
            ["bash", "-c", script], cwd=work, env=_environment(cluster, srv), start_new_session=True,
            stdout=out, stderr=err,
        )  # fmt: skip
        try:
            process.wait(timeout=QUICKSTART_TIMEOUT_S)
            alive = _wait_for_workers(platform_url, "alive") if process.returncode == 0 else {}
        finally:
            _stop(process.pid)
            process.kill()
            process.wait()
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    logs = {log.name: log.read_text() for log in srv.glob("*.log")}
    assert process.returncode == 0, f"{stdout}\n{stderr}\n{logs}"
    assert "evidence verified" in stdout, stdout

    with psycopg.connect(f"postgresql://postgres@127.0.0.1:{cluster.port}/dataflow") as conn:
        runs = conn.execute(
            "SELECT run_id, status, recovery_status, tenant, publication_idempotency_key FROM dataflow_runs"
        ).fetchall()
    assert len(runs) == 1 and runs[0][1:4] == ("succeeded", "verified", "acme"), runs
    run_id, key = runs[0][0], runs[0][4]
    assert key.startswith("dataflow/acme/key/"), key
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:{cluster.port}/acme_sink") as conn:
        keys = conn.execute("SELECT idempotency_key, row_count FROM sink_publications").fetchall()
        rows = conn.execute("SELECT region, revenue::text, _publication_key FROM public.revenue").fetchall()
    assert keys == [(key, len(EXPECTED_REVENUE))]
    assert {region: revenue for region, revenue, _ in rows} == EXPECTED_REVENUE and len(rows) == 2
    assert {published for _, _, published in rows} == {key}
    assert alive == {"worker": 2, "sweeper": 1}, "both workers and serve's sweeper registered alive"
    assert _wait_for_workers(platform_url, "stopped") == {"worker": 2, "sweeper": 1}, "each stopped gracefully"
    started = [name for name, text in logs.items() if name.startswith("worker-") and "worker.started" in text]
    assert sorted(started) == ["worker-1.log", "worker-2.log"]
    assert sum(f'"run_id": "{run_id}"' in logs[name] for name in started) == 1, "one worker claimed the run"
