"""Acceptance (issue 30, item 3): a wheel built from this checkout carries everything a user's install needs
(the migrations a fresh database is built from, the pages' templates and static files), so `dataflow version`
and a real run work from it in a clean virtual environment, never reaching back into the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from support.cli import REPO_ROOT, REVENUE_EXAMPLE, SCRUBBED_ENV

pytestmark = pytest.mark.timeout(240)

BUILD_TIMEOUT_S = 180
RUN_TIMEOUT_S = 120
DAY = "2026-11-02"


def _checkout_copy(into: Path) -> Path:
    """What a source distribution holds: the build never writes into the real checkout (build/, egg-info)."""
    copy = into / "checkout"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, copy / name)
    shutil.copytree(REPO_ROOT / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return copy


def _build_wheel(checkout: Path, out: Path) -> Path:
    # No build isolation: the build backend (setuptools >= 77, the dev extra) is already here, so the test
    # needs no network.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out),
         str(checkout)],
        check=True, timeout=BUILD_TIMEOUT_S, capture_output=True,
    )  # fmt: skip
    [wheel] = out.glob("durable_dataflow-*.whl")
    return wheel


def _clean_venv(at: Path, wheel: Path) -> Path:
    """A venv holding only the wheel; its dependencies come from this environment's site-packages through a
    plain path (.pth lines naming a directory add it without running its .pth files, so the checkout's
    editable finder stays out)."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(at)], check=True, timeout=60)
    python = at / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index",
         str(wheel)],
        check=True, timeout=BUILD_TIMEOUT_S, capture_output=True,
    )  # fmt: skip
    return at / "bin"


def test_a_built_wheel_runs_a_dataflow_in_a_clean_venv(tmp_path: Path) -> None:
    """Builds the wheel, installs it alone into a new venv, then: the package is imported from the venv (not
    src/), `dataflow version` answers, the templates and static files are in the package, and `dataflow run`
    builds a fresh SQLite platform from the wheel's migrations and succeeds, verified."""
    wheel = _build_wheel(_checkout_copy(tmp_path), tmp_path / "dist")
    bin_dir = _clean_venv(tmp_path / "venv", wheel)
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV and k != "PYTHONPATH"}
    where = subprocess.run(
        [str(bin_dir / "python"), "-c",
         "import durable_dataflow, importlib.resources as r; api = r.files('durable_dataflow.api'); "
         "print(durable_dataflow.__file__); print(api.joinpath('templates/ops.html').is_file(), "
         "api.joinpath('static/style.css').is_file())"],
        check=True, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env,
    ).stdout.splitlines()  # fmt: skip
    assert where[0].startswith(str(tmp_path / "venv")), where
    assert where[1] == "True True", where
    version = subprocess.run([str(bin_dir / "dataflow"), "version"], capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S, env=env)  # fmt: skip
    assert version.returncode == 0 and version.stdout.strip(), version.stderr
    example = tmp_path / "example"
    shutil.copytree(REVENUE_EXAMPLE.parent, example)
    ran = subprocess.run(
        [str(bin_dir / "dataflow"), "--db", f"sqlite:///{tmp_path / 'platform.db'}", "run",
         str(example / "dataflow.yaml"), "--param", f"day={DAY}", "--json"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    run = json.loads(ran.stdout)
    assert (run["status"], run["recovery_status"]) == ("succeeded", "verified")
    assert run["row_count"] > 0
