"""A process that exits while its first Spark session is still starting kills the JVM being launched
(issue 29, finding 6: a JVM not yet watching its stdin outlived a SIGTERMed server by seconds).

pyspark's launcher is stood in for by shell processes carrying the environment mark pyspark gives its
launcher only; the end-to-end proof with a real JVM is tests/integration/test_spark_sigterm.py."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_dataflow.dataflow.execution import spark_engine
from support.procs import alive

GONE_WAIT_S = 10.0
MARK = spark_engine._LAUNCH_MARK.decode().rstrip("=")


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether the process ends within ``seconds``: its pidfd turns readable when it exits."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([pidfd], [], [], seconds)[0])
    finally:
        os.close(pidfd)


def _start(marked: bool) -> tuple[subprocess.Popen[str], int]:
    """A shell (the launcher) that started a sleep (the JVM it would exec or fork): both pids."""
    env = dict(os.environ)
    env.pop(MARK, None)
    if marked:
        env[MARK] = "/tmp/conn-info"
    shell = subprocess.Popen(
        ["sh", "-c", "sleep 120 & echo $!; wait"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert shell.stdout is not None
    return shell, int(shell.stdout.readline())


@pytest.fixture
def launches() -> Iterator[list[tuple[subprocess.Popen[str], int]]]:
    started: list[tuple[subprocess.Popen[str], int]] = []
    yield started
    for shell, grandchild in started:
        for pid in (shell.pid, grandchild):
            if alive(pid):
                os.kill(pid, 9)
        shell.wait(timeout=GONE_WAIT_S)
        for pipe in (shell.stdin, shell.stdout):
            if pipe is not None:
                pipe.close()


# Run in a fresh process: the test's own process may hold a real Spark JVM (another test's session, under
# xdist), which the hook would rightly count as launched and kill.
_EXITING_DURING_A_LAUNCH = """
import json, os, subprocess, sys
from durable_dataflow.dataflow.execution import spark_engine
mark = sys.argv[1]
def start(marked):
    env = {k: v for k, v in os.environ.items() if k != mark}
    if marked:
        env[mark] = "/tmp/conn-info"
    # the launcher's child drops the mark (as one caught in the middle of its exec reads no environment
    # at all) and starts the JVM's stand-in: every descendant of a launcher is the launch's
    inner = f"env -u {mark} sh -c 'sleep 120 & echo $!; wait'"
    shell = subprocess.Popen(["sh", "-c", inner + " & wait"], env=env, stdout=subprocess.PIPE, text=True)
    return shell, int(shell.stdout.readline())
(launcher, jvm), (other, others_child) = start(True), start(False)
found = sorted(spark_engine._launched_processes())
spark_engine._launching = True
spark_engine.end_launch()
launcher.wait(timeout=10)
print(json.dumps({"found": found, "launcher": launcher.pid, "jvm": jvm,
                  "other_alive": other.poll() is None, "others_child": others_child}), flush=True)
other.kill()
os.kill(others_child, 9)
other.wait(timeout=10)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="the launcher is found through /proc")
def test_an_exit_during_the_launch_kills_the_launcher_and_what_it_started() -> None:
    """Proves the exit hook kills the marked launcher and every descendant of it, whatever their own
    environment (fails when only marked processes count: a child in the middle of its exec reads none),
    while a launch is under way, and leaves the process's other children alone (the DuckDB executors)."""
    env = {k: v for k, v in os.environ.items() if k != MARK}
    done = subprocess.run([sys.executable, "-c", _EXITING_DURING_A_LAUNCH, MARK], env=env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    found = report["found"]
    assert report["launcher"] in found and report["jvm"] in found, "the launcher or its grandchild was not found"
    assert len(found) == 3, "more or fewer than the launcher and its two descendants were found"
    assert _gone_within(report["jvm"], GONE_WAIT_S), "the launcher's grandchild outlived the exit"
    assert report["other_alive"], "a child that pyspark did not launch was killed"


def test_no_launch_under_way_kills_nothing(
    launches: list[tuple[subprocess.Popen[str], int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the hook kills nothing once the session is up (the JVM then exits on its stdin's end, after
    stop_session), nor when this process itself carries the mark (every child would)."""
    monkeypatch.delenv(MARK, raising=False)
    launches.append(_start(marked=True))
    (launcher, jvm), = launches
    spark_engine.end_launch()  # _launching is False outside session()
    assert launcher.poll() is None and alive(jvm)
    monkeypatch.setenv(MARK, "/tmp/own")
    assert spark_engine._launched_processes() == []


_FORCED_EXIT_DURING_A_LAUNCH = """
import os, subprocess, sys, threading
from durable_dataflow.cli import interrupts
from durable_dataflow.dataflow.execution import interruption, spark_engine
env = dict(os.environ, **{sys.argv[1]: "/tmp/conn-info"})
launcher = subprocess.Popen(["sh", "-c", "sleep 120 & echo $!; wait"], env=env, stdout=subprocess.PIPE, text=True)
jvm = int(launcher.stdout.readline())
spark_engine._launching = True  # as while session() starts the JVM in the run's thread

def run():
    main = threading.main_thread().ident
    while True:  # until the main thread waits in call_in_thread's join: a second signal is handled there
        frame, names = sys._current_frames().get(main), set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        if "join" in names:
            break
        threading.Event().wait(0.001)
    print(jvm, flush=True)  # the handlers are installed: the test may signal
    threading.Event().wait(120)

with interrupts.handled(interruption.Interruption()):
    interrupts.call_in_thread(run, lambda: None)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="the launcher is found through /proc")
def test_dataflow_runs_forced_exit_also_kills_a_launching_jvm() -> None:
    """Proves `dataflow run`'s forced exit on a second signal (os._exit, which skips atexit) kills a JVM
    still starting, as a normal exit does (fails when only atexit runs the hook)."""
    env = {k: v for k, v in os.environ.items() if k != MARK}
    child = subprocess.Popen([sys.executable, "-c", _FORCED_EXIT_DURING_A_LAUNCH, MARK], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None
        jvm = int(child.stdout.readline())
        child.send_signal(signal.SIGINT)
        child.send_signal(signal.SIGTERM)  # a second signal (of another kind: two alike may merge)
        code = child.wait(timeout=30)
        assert code == 130, (code, child.stderr.read()[-2000:] if child.stderr is not None else "")
        gone = _gone_within(jvm, GONE_WAIT_S)
        if not gone:
            os.kill(jvm, signal.SIGKILL)
        assert gone, "the launching JVM outlived dataflow run's forced exit"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pipe in (child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()
