"""When PostgreSQL cannot start, its tests skip on a laptop but fail in CI (never a silent green)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
# The child session only starts (and fails to start) a cluster; it must not take long.
CHILD_TIMEOUT_S = 120
CHILD_INI = """[pytest]
addopts = -ra --strict-markers
filterwarnings = error
markers =
    postgres: needs the throwaway PostgreSQL cluster
"""
CHILD_TEST = """
def test_needs_postgres(pg_url):
    '''Uses pg_url, so it needs the cluster.'''
    assert pg_url.startswith("postgresql")
"""


def _fake_bindir(tmp_path: Path) -> Path:
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    for tool in ("initdb", "pg_ctl", "postgres"):
        script = bindir / tool
        script.write_text("#!/bin/sh\nexit 1\n")
        script.chmod(0o755)
    return bindir


def _run_child(tmp_path: Path, **env_extra: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text((TESTS_DIR / "conftest.py").read_text())
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    (tmp_path / "pytest.ini").write_text(CHILD_INI)
    # The child must not see CI switches or this session's --junitxml (it would overwrite the report).
    dropped = {"CI", "DATAFLOW_REQUIRE_POSTGRES", "PYTEST_ADDOPTS"}
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(env_extra, DATAFLOW_PG_BINDIR=str(_fake_bindir(tmp_path)), PYTHONPATH=str(TESTS_DIR))
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
            "test_child.py"]  # fmt: skip
    return subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
    )


@pytest.mark.parametrize(
    "env_extra", [{"CI": "true"}, {"DATAFLOW_REQUIRE_POSTGRES": "1"}], ids=["CI", "require"]
)
def test_postgres_failure_fails_when_required(tmp_path: Path, env_extra: dict[str, str]) -> None:
    """A child pytest with broken PostgreSQL binaries and CI set exits 1 and names the reason."""
    done = _run_child(tmp_path, **env_extra)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "PostgreSQL unavailable" in done.stdout
    assert "ERROR at setup of test_needs_postgres" in done.stdout
    assert "initdb" in done.stdout, "the failure message must say which step failed"


def test_postgres_failure_skips_locally(tmp_path: Path) -> None:
    """The same child without CI skips the test with the reason instead of failing."""
    done = _run_child(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout
    assert "PostgreSQL unavailable" in done.stdout
