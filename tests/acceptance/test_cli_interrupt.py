"""Issue 26, item 4: an interruption of `dataflow run` is an interruption. Ctrl-C on a real terminal and
SIGTERM to the process, while DuckDB executes, stop the query at once; the run ends ``cancelled`` (no
external output, reason ``interrupted``, who and which signal), the CLI exits 130 and says how to run it
again. After the dispatch authorization the signal interrupts nothing: the publication is finished."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_dataflow.core import crashpoints
from durable_dataflow.dataflow.protocol import evidence
from durable_dataflow.platform import Platform
from faults import harness
from support import interrupts
from support.cli import CLI_TIMEOUT_S, make_cli

pytestmark = pytest.mark.timeout(300)

START_WAIT_S = 60.0


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    opened = Platform(db_url)
    try:
        yield opened
    finally:
        opened.close()


def _argv(db_url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "durable_dataflow.cli", "--db", db_url, *args]


def test_ctrl_c_on_a_terminal_cancels_the_run_and_exits_130(db_url: str, platform: Platform, tmp_path: Path) -> None:
    """Proves Ctrl-C typed on a real pty while DuckDB executes a minutes-long query ends the process in
    seconds with exit 130, a cancelled run (reason interrupted, SIGINT, who) and the way to run it again."""
    flow = interrupts.slow_definition(tmp_path / "flow")
    env = {**make_cli(db_url, tmp_path).env, "TERM": "xterm-256color", "COLUMNS": "160"}
    terminal = interrupts.Terminal(
        _argv(db_url, "run", str(flow), "-p", "day=2026-11-03", "-k", "nightly"), tmp_path, env
    )
    try:
        interrupts.wait_until(
            # a percent is shown once DuckDB reports the query's progress: the query is running
            lambda: terminal.matches(r"slow_count: executing \d+%") and interrupts.is_running(platform),
            START_WAIT_S, "the query to run", lambda: terminal.text,
        )  # fmt: skip
        typed_wall_s = time.time()
        terminal.type_ctrl_c()
        typed_at = time.monotonic()
        code = terminal.wait_exit(interrupts.EXIT_AFTER_SIGNAL_S_MAX)
        took_s = time.monotonic() - typed_at
    finally:
        terminal.close()
    shown = terminal.plain
    assert code == 130, f"exit {code} after {took_s:.1f} s:\n{shown}"
    assert "Traceback" not in shown and "unexpected" not in shown, shown
    assert "interrupted" in shown and "cancelled" in shown, shown
    assert "nightly" in shown and "new idempotency key" in shown, shown  # how to run it again
    run = interrupts.only_run(platform)
    assert run is not None
    done = interrupts.ended(platform, run.run_id)
    interrupts.assert_interrupted(done, "SIGINT", "cli")
    # The engine stops within a second and the cancel is one transaction (the database's clock is this
    # host's: SQLite's is the writing process's, the test server runs here).
    cancelled_after_s = done.head.recorded_at_us / 1e6 - typed_wall_s
    print(f"cancelled {cancelled_after_s:.2f} s after Ctrl-C; the process exited after {took_s:.2f} s")
    assert cancelled_after_s <= interrupts.CANCELLED_AFTER_SIGNAL_S_MAX, cancelled_after_s
    assert make_cli(db_url, tmp_path)("verify", run.run_id).code == 0


def test_sigterm_to_a_forward_run_cancels_it_before_dispatch(db_url: str, platform: Platform, tmp_path: Path) -> None:
    """Proves SIGTERM to `dataflow run` of a publishing definition, while its query executes (in a pipe:
    no terminal), cancels the run before dispatch authorization: exit 130, nothing published."""
    flow = interrupts.slow_definition(tmp_path / "flow", "slow_publish", publish_to="warehouse/slow")
    cli = make_cli(db_url, tmp_path)
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            _argv(db_url, "run", str(flow), "-p", "day=2026-11-03", "--json"), cwd=tmp_path, env=cli.env,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        interrupts.wait_until(lambda: interrupts.is_running(platform), START_WAIT_S, "the run to start",
                              log.read_text)  # fmt: skip
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=interrupts.EXIT_AFTER_SIGNAL_S_MAX)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    assert code == 130, output
    assert "Traceback" not in output and "SIGTERM" in output, output
    run = interrupts.only_run(platform)
    assert run is not None
    interrupts.assert_interrupted(interrupts.ended(platform, run.run_id), "SIGTERM", "cli")
    manifests = tmp_path / "flow" / "warehouse" / "slow" / "_manifests"
    assert [p for p in manifests.glob("*.json") if '"publication"' in p.read_text()] == [], output


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_after_dispatch_authorization_does_not_interrupt_the_publication(
    db_url: str, platform: Platform, tmp_path: Path, signum: signal.Signals
) -> None:
    """Proves a signal reaching `dataflow run` paused right after its pre-dispatch commit (a pause point)
    interrupts nothing: the process publishes, the run succeeds, exactly one publication exists."""
    flow = interrupts.slow_definition(tmp_path / "flow", "quick_publish", publish_to="warehouse/quick")
    flow.write_text(flow.read_text().replace("range(100000)", "range(2)"), encoding="utf-8")
    cli = make_cli(db_url, tmp_path)
    env = {**cli.env, "DATAFLOW_PAUSE_AT": crashpoints.AFTER_PREDISPATCH_COMMIT}
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            _argv(db_url, "run", str(flow), "-p", "day=2026-11-03", "--json"), cwd=tmp_path, env=env,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        interrupts.wait_until(lambda: interrupts.is_stopped(process.pid) or process.poll() is not None,
                              START_WAIT_S, "the pause after the pre-dispatch commit", log.read_text)  # fmt: skip
        assert process.poll() is None, log.read_text()
        process.send_signal(signum)  # pending until the process continues
        process.send_signal(signal.SIGCONT)
        code = process.wait(timeout=CLI_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    run = interrupts.only_run(platform)
    assert run is not None
    done = interrupts.ended(platform, run.run_id)
    assert (done.run.status, code) == ("succeeded", 0), output
    assert [e.kind for e in done.entries].count(evidence.PUBLICATION_CONFIRMED) == 1, output
    assert "after its dispatch was authorized" in output, output
    manifests = tmp_path / "flow" / "warehouse" / "quick" / "_manifests"
    assert len([p for p in manifests.glob("*.json") if '"publication"' in p.read_text()]) == 1


def _wait_for_pause(process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    def paused_or_ended() -> bool:
        return interrupts.is_stopped(process.pid) or process.poll() is not None

    interrupts.wait_until(paused_or_ended, START_WAIT_S, what, lambda: harness.tail(log))


# ---- a worker told to stop ---------------------------------------------------------------------------

WORKER_CASES = [
    pytest.param(signal.SIGINT, False, False, id="SIGINT-atomic"),
    pytest.param(signal.SIGTERM, True, False, id="SIGTERM-forward"),
    pytest.param(signal.SIGTERM, False, True, id="SIGTERM-atomic-once"),
]


@pytest.mark.parametrize(("signum", "forward", "once"), WORKER_CASES)
def test_a_worker_told_to_stop_mid_execution_cancels_its_run_and_exits_cleanly(
    db_url: str, platform: Platform, tmp_path: Path, signum: signal.Signals, forward: bool, once: bool
) -> None:
    """Proves a `dataflow worker` signalled while its engine runs a minutes-long query (paused inside the
    engine, then continued with the signal pending) stops the query, cancels the run (reason interrupted,
    the signal, trigger worker), releases the lease, publishes nothing and exits 0 within seconds."""
    flow = interrupts.slow_definition(tmp_path / "flow", publish_to="warehouse/slow" if forward else None)
    run_id = platform.runs.submit(harness.request_for(flow, {"day": "2026-11-03"}, "worker-stop")).run.run_id
    env = harness.worker_env(db_url, lease_ttl_s=60.0, pause_at=crashpoints.DURING_EXECUTION)
    log = tmp_path / "worker.log"
    worker = harness.start(harness.worker_args(once=once), env, log)
    try:
        _wait_for_pause(worker, log, "the worker's pause inside the engine")
        assert worker.poll() is None and interrupts.is_running(platform), harness.tail(log)
        worker.send_signal(signum)  # pending until the worker continues
        worker.send_signal(signal.SIGCONT)
        code = harness.wait_exit(worker, log, interrupts.EXIT_AFTER_SIGNAL_S_MAX)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    output = log.read_text()
    assert code == 0, output
    assert '"outcome": "cancelled"' in output and "worker.stopped" in output and "Traceback" not in output, output
    interrupts.assert_interrupted(interrupts.ended(platform, run_id), signum.name, "worker")
    assert harness.parquet_publications(tmp_path / "flow" / "warehouse" / "slow") == []


def test_a_worker_told_to_stop_after_dispatch_authorization_finishes_the_publication(
    db_url: str, platform: Platform, tmp_path: Path
) -> None:
    """Proves SIGTERM to a `dataflow worker` paused right after its pre-dispatch commit interrupts nothing:
    the worker publishes once, the run succeeds, and the worker exits 0."""
    flow = interrupts.slow_definition(tmp_path / "flow", "quick_publish", publish_to="warehouse/quick")
    flow.write_text(flow.read_text().replace("range(100000)", "range(2)"), encoding="utf-8")
    run_id = platform.runs.submit(harness.request_for(flow, {"day": "2026-11-03"}, "worker-late")).run.run_id
    env = harness.worker_env(db_url, lease_ttl_s=60.0, pause_at=crashpoints.AFTER_PREDISPATCH_COMMIT)
    log = tmp_path / "worker.log"
    worker = harness.start(harness.worker_args(), env, log)
    try:
        _wait_for_pause(worker, log, "the worker's pause after authorization")
        assert worker.poll() is None, harness.tail(log)
        worker.send_signal(signal.SIGTERM)
        worker.send_signal(signal.SIGCONT)
        code = harness.wait_exit(worker, log)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    output = log.read_text()
    done = interrupts.ended(platform, run_id)
    assert (code, done.run.status) == (0, "succeeded"), output
    assert done.lease_released, output
    assert len(harness.parquet_publications(tmp_path / "flow" / "warehouse" / "quick")) == 1, output


def test_a_second_signal_stops_waiting_and_leaves_no_run_running(
    db_url: str, platform: Platform, tmp_path: Path
) -> None:
    """Proves two signals to `dataflow run` (SIGINT then SIGTERM, delivered together when the process,
    paused inside the engine, continues) end it with exit 130 at once and its run cancelled, not running:
    the second one cancels the attempt from the waiting thread if its own thread has not yet."""
    flow = interrupts.slow_definition(tmp_path / "flow")
    env = {**make_cli(db_url, tmp_path).env, "DATAFLOW_PAUSE_AT": crashpoints.DURING_EXECUTION}
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            _argv(db_url, "run", str(flow), "-p", "day=2026-11-03"), cwd=tmp_path, env=env,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait_for_pause(process, log, "the pause inside the engine")
        assert process.poll() is None, log.read_text()
        process.send_signal(signal.SIGINT)  # both pending until the process continues
        process.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGCONT)
        code = process.wait(timeout=interrupts.EXIT_AFTER_SIGNAL_S_MAX)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    assert code == 130, output
    assert "interrupted" in output and "Traceback" not in output, output
    run = interrupts.only_run(platform)
    assert run is not None
    done = interrupts.ended(platform, run.run_id)
    assert (done.run.status, done.head.kind) == ("cancelled", evidence.RUN_CANCELLED), output
    assert done.head.payload["reason"] == "interrupted" and done.lease_released, output
