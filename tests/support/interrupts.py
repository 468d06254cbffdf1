"""Interrupting real `dataflow` processes: a long query to interrupt, a terminal to press Ctrl-C on,
and what an interrupted run must leave in the ledger (issue 26, item 4)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import subprocess
import termios
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import sqlalchemy as sa

from durable_dataflow.core import ledger
from durable_dataflow.core.schema import leases
from durable_dataflow.dataflow.protocol import evidence, runs
from durable_dataflow.dataflow.protocol.runs import MODULE, Run
from durable_dataflow.platform import Platform

POLL_S = 0.05
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Minutes of DuckDB work unless interrupted: a process that exits soon after the signal was interrupted.
SLOW_STEP_SQL = "select count(distinct md5(f.n::varchar || r.a::varchar)) as c from facts f, range(100000) r(a)"
# From the signal to the process's exit: the engine stops within a second; the rest is the process
# closing its platform (and a loaded test machine).
EXIT_AFTER_SIGNAL_S_MAX = 10.0
# From Ctrl-C to the run.cancelled entry: the engine stops within 1 s (the watch looks every 0.1 s), then
# one transaction; the margin is for a loaded test machine.
CANCELLED_AFTER_SIGNAL_S_MAX = 2.0


def slow_definition(folder: Path, name: str = "slow_count", *, publish_to: str | None = None) -> Path:
    """A definition whose one step runs for minutes over a Parquet source (so DuckDB reports progress);
    with ``publish_to``, it publishes to that Parquet folder (forward recovery)."""
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"n": pa.array(range(200_000), pa.int64())}), folder / "facts.parquet")
    target = ""
    if publish_to is not None:
        target = (
            "target:\n  type: datasources.publication\n  provider: parquet\n"
            f"  datasource: interrupt.{name}\n  location: {publish_to}\n  mode: append\n"
        )
    body = (
        f"name: {name}\nversion: 1\nparameters:\n  day: {{type: date}}\n"
        "sources:\n  facts: {kind: parquet, path: facts.parquet}\n"
        f"steps:\n  - name: counted\n    sql: {SLOW_STEP_SQL}\n"
        "output:\n  schema: {c: int64}\n  max_rows: 1\n  max_bytes: 1MiB\n" + target
    )
    path = folder / f"{name}.yaml"
    path.write_text(body, encoding="utf-8")
    return path


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, log: Callable[[], str] = str) -> None:
    """Poll a condition with a bounded deadline (never sleep hoping for an order)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{log()}")
        time.sleep(POLL_S)


def only_run(platform: Platform) -> Run | None:
    with platform.db.read() as conn:
        found = runs.list_page(conn, limit=2)
    assert len(found) <= 1, found
    return found[0] if found else None


def is_running(platform: Platform) -> bool:
    run = only_run(platform)
    return run is not None and run.status == runs.RunStatus.RUNNING


def is_stopped(pid: int) -> bool:
    """True when the process is stopped by a signal (state T in /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


@dataclass(frozen=True)
class Ended:
    run: Run
    entries: list[ledger.Entry]
    lease_released: bool

    @property
    def head(self) -> ledger.Entry:
        return self.entries[-1]


def ended(platform: Platform, run_id: str) -> Ended:
    with platform.db.read() as conn:
        run = runs.get(conn, run_id)
        entries = ledger.read(conn, MODULE, run_id)
        released = conn.execute(
            sa.select(leases.c.released_at_us).where(leases.c.module == MODULE, leases.c.subject_id == run_id)
        ).scalar_one()
    return Ended(run, entries, released is not None)


def assert_interrupted(done: Ended, signal_name: str, trigger: str) -> None:
    """The run was cancelled by the interruption: no external output, who and which signal, lease closed."""
    run = done.run
    context = f"{run.status}/{run.recovery_status} {run.error_code}: {run.error_message}; " + str(
        [(e.attempt, e.kind) for e in done.entries]
    )
    assert (run.status, run.recovery_status) == ("cancelled", "no_external_output"), context
    assert run.error_code == "cancelled" and run.error_message is not None, context
    assert "interrupted" in run.error_message and signal_name in run.error_message, context
    assert done.head.kind == evidence.RUN_CANCELLED, context
    payload: Mapping[str, Any] = done.head.payload
    assert payload["reason"] == "interrupted" and payload["signal"] == signal_name, payload
    assert payload["principal"] and payload["provenance"]["trigger"] == trigger, payload
    assert payload["no_external_output"] is True and payload["from_status"] == "running", payload
    assert done.lease_released, context
    assert not any(e.kind == evidence.DISPATCH_AUTHORIZED for e in done.entries), context


# ---- a terminal ----------------------------------------------------------------------------------


def _controlling_terminal() -> None:
    """In the child, after setsid(): make its stdin (the pty) the controlling terminal, so that the
    terminal's Ctrl-C (a \\x03 typed on it) sends SIGINT to its foreground process group."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A process whose stdin, stdout and stderr are a pseudo-terminal it controls, as at a shell."""

    def __init__(self, argv: Sequence[str], cwd: Path, env: Mapping[str, str]) -> None:
        self.leader, follower = os.openpty()
        self.process = subprocess.Popen(
            list(argv), cwd=cwd, env=dict(env), stdin=follower, stdout=follower, stderr=follower,
            start_new_session=True, preexec_fn=_controlling_terminal,
        )  # fmt: skip
        os.close(follower)
        self.drawn = bytearray()
        self._closed = False

    @property
    def text(self) -> str:
        return self.drawn.decode("utf-8", "replace")

    @property
    def plain(self) -> str:
        """What was drawn without terminal escapes, its wrapped lines joined again."""
        return _ESCAPE.sub("", self.text).replace("\r\n", "")

    def matches(self, pattern: str) -> bool:
        self.read_available()
        return re.search(pattern, self.plain) is not None

    def read_available(self, wait_s: float = POLL_S) -> None:
        """Read what the process drew so far (returns at once when nothing is pending)."""
        while not self._closed:
            ready, _, _ = select.select([self.leader], [], [], wait_s)
            if not ready:
                return
            try:
                chunk = os.read(self.leader, 65536)
            except OSError:  # EIO: every process closed its end
                chunk = b""
            if not chunk:
                self._closed = True
                return
            self.drawn.extend(chunk)
            wait_s = 0

    def shows(self, text: str) -> bool:
        self.read_available()
        return text in self.text

    def type_ctrl_c(self) -> None:
        os.write(self.leader, b"\x03")

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status, or None when the process is still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.read_available(POLL_S)
            code = self.process.poll()
            if code is not None:
                self.read_available()
                return code
        return None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        os.close(self.leader)
