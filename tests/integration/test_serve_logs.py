"""`dataflow serve` logs as a worker does (issue 33, finding 5): JSON lines, uvicorn's own included,
and a database outage logged with back-off between tries and a `storage.recovered` at its end."""

from __future__ import annotations

import json
import logging
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from durable_dataflow.cli import server_cmd
from durable_dataflow.core.errors import StorageUnavailable
from durable_dataflow.dataflow.protocol import sweeper
from durable_dataflow.platform import Platform
from support.cli import make_cli

SERVE_WAIT_S = 90.0
OUTAGE_TRIES = 6  # failed sweeps before the database answers again


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=10) as opened:
        yield opened


class FakeTime:
    """A clock that moves only when the sweeper waits; the waits are recorded, and the loop is
    stopped after ``waits_max`` of them."""

    def __init__(self, sweeping: list[server_cmd.ServeSweeper], waits_max: int) -> None:
        self.now_s = 0.0
        self.waits: list[float] = []
        self._sweeping = sweeping
        self._waits_max = waits_max

    def clock(self) -> float:
        return self.now_s

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now_s += seconds
        if len(self.waits) >= self._waits_max:
            self._sweeping[0].stop()
        return False


def test_a_database_outage_is_retried_with_back_off_and_its_end_is_logged(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep raises StorageUnavailable (a wrapper we control) six times, then works: the loop,
    driven by a fake clock and wait, retries after 1, 2, 4, 8, 10, 10 s (the named maximum), logs
    each failed try with the outage's age, then `storage.recovered` once with its 35 s duration."""
    real_sweep = sweeper.sweep
    failures = iter(range(OUTAGE_TRIES))

    def down_then_up(*args: Any, **kwargs: Any) -> Any:
        if next(failures, None) is not None:
            raise StorageUnavailable("the platform database is unavailable: connection refused")
        return real_sweep(*args, **kwargs)

    monkeypatch.setattr(sweeper, "sweep", down_then_up)
    holder: list[server_cmd.ServeSweeper] = []
    fake = FakeTime(holder, waits_max=OUTAGE_TRIES + 2)
    holder.append(server_cmd.ServeSweeper(platform, 1.0, wait=fake.wait, clock=fake.clock))
    with capture_logs() as logs:
        holder[0]._loop()
    assert server_cmd.SWEEP_RETRY_S_MAX == 10.0
    assert fake.waits == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 1.0, 1.0]  # back-off, then the sweep interval
    down = [e for e in logs if e["event"] == "storage.unavailable"]
    assert [e["retry_in_s"] for e in down] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert [e["outage_s"] for e in down] == [0.0, 1.0, 3.0, 7.0, 15.0, 25.0]
    [recovered] = [e for e in logs if e["event"] == "storage.recovered"]
    assert (recovered["outage_s"], recovered["failures"], recovered["operation"]) == (35.0, OUTAGE_TRIES, "sweep")


def test_stdlib_records_and_structlog_events_are_the_same_json_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With serve's logging set up, a uvicorn record and a structlog event both reach stderr as one
    JSON object per line, with `event`, `level` and `timestamp` (today uvicorn writes plain text)."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    # uvicorn's level as `serve --log-level info` sets it (an in-process uvicorn of another test in this
    # process may have left it at warning, which would drop the record below).
    monkeypatch.setattr(logging.getLogger("uvicorn.error"), "level", logging.INFO)
    try:
        server_cmd.worker_cmd.configure_logging()
        server_cmd.worker_cmd.route_stdlib_logging()
        logging.getLogger("uvicorn.error").info("Uvicorn running on %s://%s:%d", "http", "127.0.0.1", 8080)
        server_cmd.log.warning("sweep.decided", run_id="r1", attempt=1, outcome="outcome_unknown")
    finally:
        root.handlers = saved[0]
        root.setLevel(saved[1])
        structlog.reset_defaults()
    lines = capsys.readouterr().err.splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["event"] for r in records] == ["Uvicorn running on http://127.0.0.1:8080", "sweep.decided"]
    assert all({"level", "timestamp"} <= set(r) for r in records)
    assert records[0]["logger"] == "uvicorn.error" and records[1]["run_id"] == "r1"


def _lines(stream: Any, into: queue.Queue[str | None]) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_serve_writes_only_json_lines_on_stderr(db_url: str, tmp_path: Path) -> None:
    """`dataflow serve` in a subprocess, until uvicorn says it listens and then SIGTERM: every line
    it wrote on stderr is one JSON object with an `event` (it wrote uvicorn's plain text before)."""
    cli = make_cli(db_url, tmp_path)
    argv = [sys.executable, "-m", "durable_dataflow.cli", "--db", db_url, "serve", "--port", "0",
            "--data-root", str(tmp_path / "data"), "--sink-root", str(tmp_path / "sinks")]  # fmt: skip
    server = subprocess.Popen(
        argv, cwd=tmp_path, env=cli.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    assert server.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_lines, args=(server.stderr, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        while not any("Uvicorn running on" in line for line in seen):
            line = lines.get(timeout=SERVE_WAIT_S)
            assert line is not None, "".join(seen)
            seen.append(line)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=SERVE_WAIT_S) == 0, "".join(seen)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        reader.join(SERVE_WAIT_S)
        server.stderr.close()
    while (line := lines.get(timeout=SERVE_WAIT_S)) is not None:
        seen.append(line)
    assert seen and all("event" in json.loads(line) for line in seen), "".join(seen)
