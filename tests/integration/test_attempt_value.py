"""Proves a forward attempt runs on its Attempt value alone: with every RunService method made to raise
once the attempt is built, a publishing run to a Parquet-folder sink still succeeds with verified evidence;
and, read with ``ast``, that protocol/forward.py imports nothing of protocol/service.py and no function
of it takes a service."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.core import crashpoints
from durable_dataflow.dataflow.protocol import derivation, forward
from durable_dataflow.dataflow.protocol.runs import RunStatus
from durable_dataflow.dataflow.protocol.service import RunService
from durable_dataflow.platform import Platform
from support import flows

FORWARD_SOURCE = Path(forward.__file__)


class CalledBack(AssertionError):
    """A step of the attempt reached into the run service."""


def _forbid_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every method and property RunService defines raises CalledBack from now on."""

    def refuse(name: str) -> Any:
        def refused(*args: object, **kwargs: object) -> None:
            raise CalledBack(f"RunService.{name} was called during the forward attempt")

        return refused

    for name, member in list(vars(RunService).items()):
        if name.startswith("__"):
            continue
        if isinstance(member, property):
            monkeypatch.setattr(RunService, name, property(refuse(name)))
        elif callable(member):
            monkeypatch.setattr(RunService, name, refuse(name))


@pytest.fixture
def platform(sqlite_url: str) -> Iterator[Platform]:
    with Platform(sqlite_url, lease_ttl_s=30) as opened:
        yield opened
    crashpoints.set_hook(None)


def test_a_forward_attempt_publishes_without_calling_back_into_the_service(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attempt is claimed and built through the service; then the service is made unusable, and
    forward.execute_forward alone prepares, computes, authorizes, publishes and commits success."""
    defn = flows.definition(flows.parquet_target("parquet"))
    platform.runs.submit(flows.request(defn, tmp_path, "k1"))
    claim = platform.runs.claim_next()
    assert claim is not None
    attempt = platform.runs.attempt_of(claim.run, claim.attempt)
    with monkeypatch.context() as patched:
        _forbid_the_service(patched)
        with pytest.raises(CalledBack):
            platform.runs.get(claim.run.run_id)  # the trap is armed
        forward.execute_forward(attempt)
    run = platform.runs.get(claim.run.run_id)
    assert (run.status, run.recovery_status, run.attempt) == (RunStatus.SUCCEEDED, "verified", 1)
    assert len(flows.manifests(tmp_path / "sink")) == 1
    assert flows.verify(platform, run.run_id).ok
    with platform.db.read() as conn:
        assert derivation.verify_run(conn, run, None).ok


def test_a_worker_style_execution_calls_the_service_only_before_and_after_the_forward_steps(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through RunService.execute: from the prepared target (crash point after_prepare) to the committed
    success (after_terminal_commit) every RunService method raises, and the run still succeeds."""
    defn = flows.definition(flows.parquet_target("parquet"))
    platform.runs.submit(flows.request(defn, tmp_path, "k1"))
    claim = platform.runs.claim_next()
    assert claim is not None
    seen: list[str] = []
    with monkeypatch.context() as patched:

        def hook(point: str) -> None:
            seen.append(point)
            if point == crashpoints.AFTER_PREPARE:
                _forbid_the_service(patched)
            elif point == crashpoints.AFTER_TERMINAL_COMMIT:
                patched.undo()

        crashpoints.set_hook(hook)
        run = platform.runs.execute(claim)
    crashpoints.set_hook(None)
    assert crashpoints.AFTER_PREPARE in seen and crashpoints.AFTER_TERMINAL_COMMIT in seen
    assert (run.status, run.recovery_status) == (RunStatus.SUCCEEDED, "verified")
    assert flows.kinds(platform, run.run_id) == [
        "run.recorded", "attempt.started", "dispatch.authorized", "publication.confirmed", "run.succeeded",
    ]  # fmt: skip


def _service_names(tree: ast.Module) -> list[str]:
    """Each import of protocol/service.py, and each parameter named or typed as a service."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module.endswith("protocol.service") or any(a.name == "service" for a in node.names):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.endswith("protocol.service")]
        elif isinstance(node, ast.FunctionDef):
            for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
                typed = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg == "service" or "RunService" in typed or "Attempts" in typed:
                    found.append(f"line {node.lineno}: {node.name}({arg.arg}: {typed})")
    return found


def test_forward_imports_no_service_and_takes_none() -> None:
    """protocol/forward.py, read with ast: no import of protocol/service.py, no parameter that is a service."""
    assert _service_names(ast.parse(FORWARD_SOURCE.read_text(encoding="utf-8"))) == []


def test_the_source_check_finds_a_service() -> None:
    """The check is not vacuous: an import of the service and a parameter taking it are both found."""
    source = (
        "from durable_dataflow.dataflow.protocol.service import RunService\n"
        "def step(service: RunService, run: object) -> None: ...\n"
    )
    assert len(_service_names(ast.parse(source))) == 2
