"""The worker's log lines: one JSON event per line, each written whole in one call."""

from __future__ import annotations

import io
import json
import sys

import pytest
import structlog

from durable_dataflow.cli import worker_cmd


class _Recorder(io.StringIO):
    """A text stream that remembers each `write` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_each_event_is_one_whole_line_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several workers append to one shared log file: a line written in two calls (the event, then
    the newline) lets another process's event land between them, breaking both lines."""
    recorder = _Recorder()
    monkeypatch.setattr(sys, "stderr", recorder)
    try:
        worker_cmd.configure_logging()
        log = structlog.get_logger()
        log.info("worker.stopping", inflight=0)
        log.info("worker.stopped", claimed=3)
    finally:
        structlog.reset_defaults()
    assert len(recorder.calls) == 2, recorder.calls
    for call in recorder.calls:
        assert call.endswith("\n") and call.count("\n") == 1
        json.loads(call)
    assert [json.loads(c)["event"] for c in recorder.calls] == ["worker.stopping", "worker.stopped"]
