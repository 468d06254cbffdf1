"""docs/cli.md matches the code: every JSON field, every command and every error exit status is documented."""

from __future__ import annotations

import re

from durable_dataflow.cli import app, common
from durable_dataflow.dataflow.runs import LOCAL_FIELDS, Run
from support.cli import REPO_ROOT

DOC = (REPO_ROOT / "docs" / "cli.md").read_text()
CORE_COMMANDS = ("run", "runs", "show", "verify", "result", "reconcile", "schema", "version")
GROUP_COMMANDS = ("definitions list", "definitions show", "db upgrade", "db current")


def documented_fields() -> set[str]:
    section = DOC.split("## The run as JSON", 1)[1]
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE))


def test_every_run_json_field_is_documented() -> None:
    """Each key of Run.public() plus `replayed` has a row in the JSON field table, and no row names a
    field the code does not produce (the table is parsed, so a rename on either side fails)."""
    produced = set(Run.model_fields) - LOCAL_FIELDS | {"unresolved", "replayed"}
    assert documented_fields() == produced


def test_every_command_is_documented_and_registered() -> None:
    """Each command this part registers has a `### dataflow <command>` heading, and the app really has it."""
    registered = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    for command in CORE_COMMANDS:
        assert command in registered
        assert re.search(rf"^### `dataflow {command}[ `]", DOC, flags=re.MULTILINE), command
    for command in GROUP_COMMANDS:
        assert f"`dataflow {command}" in DOC, command


def test_exit_status_table_matches_the_error_table() -> None:
    """Every code in common.EXIT_CODES appears in the exit-status table with its status."""
    for code, status in common.EXIT_CODES.items():
        assert re.search(rf"^\| {status} \| `{code}`", DOC, flags=re.MULTILINE), code
    for status in (common.EXIT_UNRESOLVED, common.EXIT_NOT_FINISHED, common.EXIT_INTERRUPTED):
        assert re.search(rf"^\| {status} \|", DOC, flags=re.MULTILINE), status
