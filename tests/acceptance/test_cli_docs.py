"""docs/cli.md matches the code: every JSON field, every command and every error exit status is documented,
and so are every run status, reconcile finding and ledger entry kind (docs/cli.md, api.md, architecture.md)."""

from __future__ import annotations

import re

from durable_dataflow.cli import app, common
from durable_dataflow.dataflow.protocol import evidence, reconcile
from durable_dataflow.dataflow.protocol.runs import LOCAL_FIELDS, RecoveryStatus, Run, RunStatus
from support.cli import REPO_ROOT

DOC = (REPO_ROOT / "docs" / "cli.md").read_text()
CORE_COMMANDS = ("run", "runs", "show", "verify", "result", "reconcile", "schema", "validate", "version")
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


def _row_values(doc: str, first_cell: str) -> set[str]:
    """The backticked values of the one table row whose first cell is ``first_cell``."""
    [row] = re.findall(rf"^\| {re.escape(first_cell)} \|(.*)$", doc, flags=re.MULTILINE)
    return set(re.findall(r"`([a-z_]+)`", row))


def test_status_lists_name_every_status_of_the_code() -> None:
    """The `runs --status`/`--recovery-status` choices and the run JSON's `status`/`recovery_status` rows
    list exactly the members of RunStatus and RecoveryStatus (issue 26: `cancelled` was missing)."""
    statuses = {s.value for s in RunStatus}
    recoveries = {s.value for s in RecoveryStatus}
    assert _row_values(DOC, "`--status S`") == statuses
    assert _row_values(DOC, "`--recovery-status R`") == recoveries
    assert _row_values(DOC, "`status`") - {"string"} == statuses
    assert _row_values(DOC, "`recovery_status`") - {"string"} == recoveries


def test_reconcile_findings_and_entry_kinds_are_documented() -> None:
    """Every reconcile finding is named by `reconcile --json` (docs/cli.md) and by the API's reconcile
    answer (docs/api.md); every ledger entry kind of dataflow/protocol/evidence.py by docs/architecture.md."""
    findings = {f.value for f in reconcile.Finding}
    [cli_row] = re.findall(r"^\| `--json` \| the run \(below\) plus `finding`.*$", DOC, flags=re.MULTILINE)
    assert findings <= set(re.findall(r"`([a-z_]+)`", cli_row))
    api = (REPO_ROOT / "docs" / "api.md").read_text()
    [answer] = re.findall(r'"finding": ([^,]*(?:\| "[a-z_]+" )*)', api)
    assert set(re.findall(r'"([a-z_]+)"', answer)) == findings
    architecture = (REPO_ROOT / "docs" / "architecture.md").read_text()
    kinds_text = architecture.split("Ledger entry kinds", 1)[1].split("\n\n", 1)[0]
    kinds = {v for k, v in vars(evidence).items() if k.isupper() and isinstance(v, str) and "." in v}
    assert kinds and kinds <= set(re.findall(r"`([a-z_]+\.[a-z_]+)`", kinds_text))
