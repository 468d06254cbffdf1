"""The deployment pack in deploy/ agrees with the code it deploys (issue 33, item 3).

Pure checks, no process: the systemd units parse, start commands and options the CLI has and give
the graceful stop the time the code takes; deploy/env.example lists exactly the DATAFLOW_* settings
the source reads, each with a meaning and a default; the Dockerfile is multi-stage, installs the
extras of a build argument and runs as a user that is not root. hadolint lints the Dockerfile in
tests/integration/test_deploy_lint.py.
"""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from durable_dataflow.cli import app, server_cmd

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SRC = ROOT / "src" / "durable_dataflow"
UNITS = {
    "serve": DEPLOY / "systemd" / "dataflow-serve.service",
    "worker": DEPLOY / "systemd" / "dataflow-worker@.service",
}
ENV_EXAMPLE = DEPLOY / "env.example"
DOCKERFILE = DEPLOY / "Dockerfile"
# A setting the code reads is named by a string literal (a module constant such as
# GRANTS_ENV = "DATAFLOW_GRANTS", or the name given to a helper such as resolve_platform_setting).
SETTING_LITERAL = re.compile(r"""["'](DATAFLOW_[A-Z0-9_]*[A-Z0-9])["']""")
# A setting line of env.example: set (`DATAFLOW_X=v`) or shown with its default (`# DATAFLOW_X=v`).
ENV_LINE = re.compile(r"^#?\s*(DATAFLOW_[A-Z0-9_]+)=(.*)$")
# A worker's publications authorized before SIGTERM are finished, never cut short by the worker;
# the unit must leave them at least this long before systemd's SIGKILL makes them outcome_unknown.
WORKER_PUBLICATION_FINISH_S_MIN = 120
ROOT_USERS = ("root", "0", "0:0", "root:root")


def _unit(path: Path) -> configparser.ConfigParser:
    """A unit file read the way systemd reads its sections: keys case-sensitive, no interpolation."""
    parser = configparser.ConfigParser(interpolation=None, strict=True, empty_lines_in_values=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string(path.read_text(encoding="utf-8"), source=str(path))
    return parser


def _settings_read_by_code() -> dict[str, set[str]]:
    """Every DATAFLOW_* setting named by a string literal in the package, with the files naming it."""
    found: dict[str, set[str]] = {}
    for module in SRC.rglob("*.py"):
        for name in SETTING_LITERAL.findall(module.read_text(encoding="utf-8")):
            found.setdefault(name, set()).add(str(module.relative_to(ROOT)))
    return found


def _env_example() -> dict[str, tuple[str, list[str]]]:
    """Each setting of env.example: its value or default, and the comment lines just above it."""
    listed: dict[str, tuple[str, list[str]]] = {}
    comments: list[str] = []
    for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines():
        match = ENV_LINE.match(line)
        if match is not None:
            assert match.group(1) not in listed, f"{match.group(1)} is listed twice in env.example"
            listed[match.group(1)] = (match.group(2), comments)
            comments = []
        elif line.startswith("#") and not line.startswith("# ----"):
            comments.append(line.lstrip("# "))
        else:
            comments = []
    return listed


def _cli_command(argv: list[str]) -> Any:
    """The click command an ExecStart line runs, after checking each --option it passes exists."""
    assert Path(argv[0]).name == "dataflow", f"{argv[0]} is not the dataflow command"
    group = typer.main.get_command(app)  # a click group (Typer may vendor click: read it by shape)
    command = getattr(group, "commands", {}).get(argv[1])
    assert command is not None, f"`dataflow {argv[1]}` is not a command"
    known = {opt for param in command.params for opt in param.opts}
    for word in argv[2:]:
        if word.startswith("--"):
            assert word.split("=", 1)[0] in known, f"`dataflow {argv[1]}` has no option {word}"
    return command


@pytest.mark.parametrize("role", sorted(UNITS))
def test_unit_starts_a_real_command_and_stops_gracefully(role: str) -> None:
    """Each unit parses, runs `dataflow <command>` with options it has, stops by SIGTERM, restarts on failure."""
    unit = _unit(UNITS[role])
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[1] == role
    _cli_command(argv)
    assert service["KillSignal"] == "SIGTERM"
    assert service["KillMode"] == "mixed", "SIGTERM to the main process only: it interrupts its own engines"
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "2", "exit 2 (a refusal) would repeat on every restart"
    assert service["OOMPolicy"] == "continue", "one OOM-killed executor must not stop every run in the service"
    assert service["EnvironmentFile"] == "/etc/dataflow/env"
    assert service["User"] not in ROOT_USERS and service["Group"] not in ROOT_USERS
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    assert service["CapabilityBoundingSet"] == "", "the platform needs no capability"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_serve_stop_timeout_covers_its_graceful_stop() -> None:
    """serve's TimeoutStopSec covers its requests' grace plus the sweeper's last batch (cli/server_cmd.py)."""
    timeout_s = int(_unit(UNITS["serve"])["Service"]["TimeoutStopSec"])
    assert timeout_s >= server_cmd.SHUTDOWN_GRACE_S + server_cmd.SWEEPER_STOP_WAIT_S


def test_worker_stop_timeout_lets_authorized_publications_finish() -> None:
    """The worker's TimeoutStopSec leaves authorized publications time to finish and covers a sweep batch."""
    timeout_s = int(_unit(UNITS["worker"])["Service"]["TimeoutStopSec"])
    assert timeout_s >= WORKER_PUBLICATION_FINISH_S_MIN
    assert timeout_s >= server_cmd.SWEEPER_STOP_WAIT_S


def test_env_example_lists_every_setting_the_code_reads() -> None:
    """Every DATAFLOW_* name the source reads (a string literal) is in env.example: a new one fails until listed."""
    read = _settings_read_by_code()
    assert len(read) >= 30, "the source scan found too few settings: has the way settings are named changed?"
    missing = {name: sorted(files) for name, files in read.items() if name not in _env_example()}
    assert not missing, f"settings the code reads that deploy/env.example does not list: {missing}"


def test_env_example_lists_nothing_the_code_does_not_read() -> None:
    """Every setting env.example lists is read by the source: a removed or misspelt setting fails here."""
    unread = sorted(set(_env_example()) - set(_settings_read_by_code()))
    assert not unread, f"deploy/env.example lists settings nothing reads: {unread}"


def test_env_example_says_what_each_setting_means_and_its_default() -> None:
    """Each listed setting has a comment above it that explains it and names its default (or says there is none)."""
    for name, (_, comments) in _env_example().items():
        text = " ".join(comments)
        assert len(text) >= 20, f"{name}: no explanation above it in env.example"
        assert re.search(r"\bdefault\b|\bunset\b|\bnever set\b", text, re.IGNORECASE), f"{name}: no default named"


def test_env_example_holds_no_secret_value() -> None:
    """Only the database URL is set, and without a password: the example never teaches writing a secret into it."""
    listed = _env_example()
    assert listed["DATAFLOW_EVIDENCE_KEY"][0] == ""
    assert "@" in listed["DATAFLOW_DB"][0] and ":" not in listed["DATAFLOW_DB"][0].split("//", 1)[1].split("@")[0]


def _stages(dockerfile: str) -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), split into stages at each FROM."""
    joined = re.sub(r"\\\n\s*", " ", dockerfile)
    stages: list[list[str]] = []
    for line in joined.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.upper().startswith("FROM "):
            stages.append([])
        elif stages:
            stages[-1].append(stripped)
    return stages


def test_dockerfile_is_multi_stage_non_root_with_extras_as_a_build_argument() -> None:
    """deploy/Dockerfile builds in one stage, installs $EXTRAS in the last, runs as uid 10001, ADDs no URL."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    stages = _stages(text)
    assert len(stages) >= 2, "the image is built in one stage and run from another"
    runtime = stages[-1]
    users = [line.split(None, 1)[1] for line in runtime if line.upper().startswith("USER ")]
    assert users and users[-1] not in ROOT_USERS, "the runtime stage ends as a user that is not root"
    assert any(line == "ARG EXTRAS=server,delta,postgres" for line in runtime)
    assert any("durable-dataflow[${EXTRAS}]" in line for line in runtime), "the extras argument picks what is installed"
    assert not re.search(r"^\s*ADD\s+\S*https?://", text, re.IGNORECASE | re.MULTILINE), "no ADD of a URL"
    assert 'ENTRYPOINT ["dataflow"]' in runtime and "STOPSIGNAL SIGTERM" in runtime


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    """.dockerignore excludes everything but what the build copies, so no local database or secret reaches the image."""
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    assert lines[next(i for i, line in enumerate(lines) if not line.startswith("#"))] == "*"
    assert {"!pyproject.toml", "!README.md", "!src/"} <= set(lines)
