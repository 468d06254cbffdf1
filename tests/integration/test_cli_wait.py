"""`dataflow submit --wait` and `dataflow run --wait` (issue 30, item 5): the command reads its run again
until it ends (or needs a person), prints it as the command always does and exits with the run's status.

Each command runs as a real subprocess on a SQLite platform database in the test's folder. The test never
sleeps to hope for an order: it reads the command's stderr until the command says it is waiting (printed
only under --wait, once its run was read queued), checks the run is still queued in the database, and only
then lets a worker (in this process) execute it. A command that ignored --wait would print the queued run
at once and never say it waits, so every test here fails without the option.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from durable_dataflow.api import tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.cli import common, remote
from durable_dataflow.dataflow.protocol import runs
from durable_dataflow.dataflow.protocol.runs import Run, RunStatus
from durable_dataflow.dataflow.worker import Worker, WorkerOptions
from durable_dataflow.platform import Platform
from support.api_runs import copy_examples, make_queued_run, tenant_data_root
from support.cli import SCRUBBED_ENV
from support.flows import MINIMAL_YAML

WAITING_NOTE = "waiting for run "
NOTE_WITHIN_S = 60.0  # a fresh interpreter imports the CLI, opens the platform and records the run
EXIT_WITHIN_S = 60.0
READ_POLL_S = 0.02
SERVER_START_S = 30.0
# A definition that binds (on empty relations) but fails on its rows: a text that is no number cast to bigint.
FAILING_YAML = MINIMAL_YAML.replace("sum(n) as total", "cast('x' || n as bigint) as total")


@dataclass
class Waiter:
    """A `dataflow` subprocess whose stderr is read as it comes, so the test sees when it starts waiting."""

    process: subprocess.Popen[str]
    stderr_lines: list[str] = field(default_factory=list)
    waiting: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    def read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr_lines.append(line)
            if line.startswith(WAITING_NOTE):
                self.waiting.set()

    def wait_for_note(self) -> str:
        """The run id the command says it waits for (bounded: fails if the note never comes)."""
        deadline = time.monotonic() + NOTE_WITHIN_S
        while not self.waiting.wait(READ_POLL_S):  # bounded polling of a condition, not a wait for an order
            ended = self.reader is not None and not self.reader.is_alive()  # stderr closed: the command ended
            assert not ended and time.monotonic() < deadline, (
                f"the command never said it waits (exit {self.process.poll()}): {''.join(self.stderr_lines)}"
            )
        note = next(line for line in self.stderr_lines if line.startswith(WAITING_NOTE))
        return note.removeprefix(WAITING_NOTE).split()[0]

    def finish(self) -> tuple[int, str, str]:
        code = self.process.wait(EXIT_WITHIN_S)
        assert self.reader is not None and self.process.stdout is not None
        self.reader.join(EXIT_WITHIN_S)
        out = self.process.stdout.read()
        self.close()
        return code, out, "".join(self.stderr_lines)

    def close(self) -> None:
        """Kill the command if it still runs (a failed test) and close its pipes."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(EXIT_WITHIN_S)
        if self.reader is not None:
            self.reader.join(EXIT_WITHIN_S)
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}, **(extra or {})}


_started: list[Waiter] = []


def start(cwd: Path, *args: str, env: dict[str, str] | None = None) -> Waiter:
    process = subprocess.Popen(
        [sys.executable, "-m", "durable_dataflow.cli", *args],
        cwd=cwd, env=env or environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    waiter = Waiter(process)
    _started.append(waiter)
    waiter.reader = threading.Thread(target=waiter.read_stderr, daemon=True)
    waiter.reader.start()
    return waiter


@pytest.fixture(autouse=True)
def no_command_left() -> Iterator[None]:
    """Every command a test started ends with it (killed if the test failed first), its pipes closed."""
    yield
    while _started:
        _started.pop().close()


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "durable_dataflow.cli", *args],
        cwd=cwd, env=environment(), capture_output=True, text=True, timeout=EXIT_WITHIN_S, check=False,
    )  # fmt: skip


def drain(platform: Platform) -> None:
    """A worker in this process executes every queued run, then returns."""
    Worker(platform.runs, WorkerOptions(until_idle=True, poll_interval_s=0.05)).run()


def recorded(platform: Platform) -> list[Run]:
    with platform.db.read() as conn:
        return runs.list_page(conn, limit=10)


def only_run(platform: Platform) -> Run:
    listed = recorded(platform)
    assert len(listed) == 1, listed
    return listed[0]


@pytest.fixture
def flows(tmp_path: Path) -> Path:
    folder = tmp_path / "flows"
    folder.mkdir()
    (folder / "tiny.yaml").write_text(MINIMAL_YAML)
    (folder / "failing.yaml").write_text(FAILING_YAML)
    return folder


@pytest.fixture
def platform(sqlite_url: str) -> Iterator[Platform]:
    with Platform(sqlite_url) as opened:
        yield opened


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_submit_wait_prints_the_run_a_worker_executed(
    platform: Platform, sqlite_url: str, flows: Path, as_json: bool
) -> None:
    """`submit --wait` records the run queued, says on stderr that it waits, and once a worker executed the
    run prints it succeeded and exits 0; with --json stdout is exactly one JSON document."""
    waiter = start(flows, "--db", sqlite_url, "submit", "tiny.yaml", "--wait", "--poll-interval", "0.05",
                   *(["--json"] if as_json else []))  # fmt: skip
    run_id = waiter.wait_for_note()
    assert platform.runs.get(run_id).status == RunStatus.QUEUED  # nobody executed it yet
    assert waiter.process.poll() is None  # still waiting for it
    drain(platform)
    code, out, err = waiter.finish()
    assert code == common.EXIT_OK, err
    if as_json:
        document = json.loads(out)  # the whole of stdout: one document
        assert (document["run_id"], document["status"], document["replayed"]) == (run_id, "succeeded", False)
    else:
        assert out.startswith(f"run {run_id} (tiny, atomic) queued; status succeeded, attempt 1"), out
    assert platform.runs.get(run_id).status == RunStatus.SUCCEEDED


def test_submit_wait_timeout_prints_the_queued_run_and_exits_9(
    platform: Platform, sqlite_url: str, flows: Path
) -> None:
    """With no worker, `--wait-timeout 0.5` stops waiting: the run as it stands (queued), exit 9, a note on
    stderr that the run goes on; the run is still queued (waiting never cancels it)."""
    started = time.monotonic()
    done = cli(flows, "--db", sqlite_url, "submit", "tiny.yaml", "--wait", "--poll-interval", "0.1",
               "--wait-timeout", "0.5", "--json")  # fmt: skip
    assert done.returncode == common.EXIT_NOT_FINISHED == 9, done.stderr
    document = json.loads(done.stdout)
    assert document["status"] == "queued"
    assert "stopped waiting after" in done.stderr and "(--wait-timeout)" in done.stderr
    assert f"show {document['run_id']}" in done.stderr
    assert time.monotonic() - started >= 0.5
    assert only_run(platform).status == RunStatus.QUEUED


def test_submit_wait_of_a_failing_run_exits_1(platform: Platform, sqlite_url: str, flows: Path) -> None:
    """A run that fails on its rows: `submit --wait` prints it failed and exits 1, as `run` would."""
    waiter = start(flows, "--db", sqlite_url, "submit", "failing.yaml", "--max-attempts", "1", "--wait",
                   "--poll-interval", "0.05")  # fmt: skip
    run_id = waiter.wait_for_note()
    assert platform.runs.get(run_id).status == RunStatus.QUEUED
    drain(platform)
    code, out, err = waiter.finish()
    assert code == common.EXIT_RUN_FAILED == 1, err
    assert f"run {run_id} (tiny, atomic) queued; status failed" in out
    assert platform.runs.get(run_id).status == RunStatus.FAILED


def test_ctrl_c_stops_waiting_only(platform: Platform, sqlite_url: str, flows: Path) -> None:
    """SIGINT while `submit --wait` waits: exit 130, stderr says the run goes on with the `show` command;
    the run is still queued, and a worker still executes it."""
    waiter = start(flows, "--db", sqlite_url, "submit", "tiny.yaml", "--wait", "--poll-interval", "0.05")
    run_id = waiter.wait_for_note()
    waiter.process.send_signal(signal.SIGINT)
    code, out, err = waiter.finish()
    assert code == common.EXIT_INTERRUPTED == 130, err
    assert "stopped waiting" in err and "goes on" in err and f"show {run_id}" in err
    assert out == ""
    assert platform.runs.get(run_id).status == RunStatus.QUEUED
    drain(platform)
    assert platform.runs.get(run_id).status == RunStatus.SUCCEEDED


def test_run_wait_replaying_a_queued_run_waits_for_the_worker(platform: Platform, sqlite_url: str, flows: Path) -> None:
    """`run --wait -k K` replaying a run submitted queued with K executes nothing itself: it waits until a
    worker executed the run, then announces the replay (succeeded) and exits 0. Without --wait the same
    replay exits 9 at once (unchanged)."""
    submitted = cli(flows, "--db", sqlite_url, "submit", "tiny.yaml", "-k", "nightly", "--json")
    assert submitted.returncode == 0, submitted.stderr
    run_id = json.loads(submitted.stdout)["run_id"]
    at_once = cli(flows, "--db", sqlite_url, "run", "tiny.yaml", "-k", "nightly", "--json")
    assert at_once.returncode == common.EXIT_NOT_FINISHED, at_once.stderr
    waiter = start(flows, "--db", sqlite_url, "run", "tiny.yaml", "-k", "nightly", "--wait", "--poll-interval",
                   "0.05", "--json")  # fmt: skip
    assert waiter.wait_for_note() == run_id
    assert platform.runs.get(run_id).status == RunStatus.QUEUED
    drain(platform)
    code, out, err = waiter.finish()
    assert code == common.EXIT_OK, err
    document = json.loads(out)
    assert (document["run_id"], document["status"], document["replayed"]) == (run_id, "succeeded", True)
    assert "replayed: existing run returned, nothing executed" in err
    assert document["attempt"] == 1  # the worker's attempt: this command executed nothing


def test_wait_options_are_checked_before_anything_is_recorded(platform: Platform, sqlite_url: str, flows: Path) -> None:
    """`--poll-interval`/`--wait-timeout` without `--wait`, or out of range, exit 2 and record nothing."""
    for args, message in (
        (("--wait-timeout", "1"), "--wait-timeout applies only with --wait"),
        (("--poll-interval", "1"), "--poll-interval applies only with --wait"),
        (("--wait", "--poll-interval", "0"), "--poll-interval must be between"),
        (("--wait", "--poll-interval", "nan"), "--poll-interval must be between"),
        (("--wait", "--wait-timeout", "-1"), "--wait-timeout must be"),
    ):
        for command in ("submit", "run"):
            done = cli(flows, "--db", sqlite_url, command, "tiny.yaml", *args)
            assert done.returncode == 2 and message in done.stderr, (command, args, done.stderr)
    assert recorded(platform) == []


# ---- under --api: the replayed run is read with GET /v1/runs/{id} ------------------------------------


@pytest.fixture
def served(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[Platform, str, str, Path]]:
    """A real API server over a socket (uvicorn in a thread) for tenant acme: (platform, URL, operator
    token, the examples' copy)."""
    platform = Platform(sqlite_url)
    examples = copy_examples(tmp_path)
    app = create_app(platform, data_root=tenant_data_root(tmp_path, examples, ("acme",)), sink_root=tmp_path / "sinks")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the API server did not start"
        time.sleep(READ_POLL_S)  # polling a condition with a deadline, not waiting for an order
    token = tokens.create_token(platform.db, "acme", "operator", "acme-operator")[0]
    try:
        yield platform, f"http://127.0.0.1:{listener.getsockname()[1]}", token, examples
    finally:
        server.should_exit = True
        thread.join(SERVER_START_S)
        listener.close()
        platform.close()


def test_run_wait_over_the_api_polls_the_run(served: tuple[Platform, str, str, Path], tmp_path: Path) -> None:
    """`--api URL run --wait -k K` replaying a queued run waits (reading GET /v1/runs/{id}) until a worker
    executed it, then prints it succeeded and exits 0."""
    platform, url, token, examples = served
    queued = make_queued_run(platform, examples, "acme", key="remote-nightly")
    definition = str(examples / "revenue_by_region" / "dataflow.yaml")
    env = environment({remote.TOKEN_VARIABLE: token})
    waiter = start(tmp_path, "--api", url, "run", definition, "-p", "day=2026-11-02", "-k", "remote-nightly",
                   "--wait", "--poll-interval", "0.05", "--json", env=env)  # fmt: skip
    assert waiter.wait_for_note() == queued.run_id
    assert platform.runs.get(queued.run_id).status == RunStatus.QUEUED
    drain(platform)
    code, out, err = waiter.finish()
    assert code == common.EXIT_OK, err
    document: dict[str, Any] = json.loads(out)
    assert (document["run_id"], document["status"], document["replayed"]) == (queued.run_id, "succeeded", True)
