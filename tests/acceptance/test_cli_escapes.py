"""Acceptance, on SQLite and PostgreSQL: a submitter's text reaches an operator's terminal neutralised.

A parameter value, a definition's description, and stored run
fields carrying an OSC title sequence, a clear-screen sequence, a C1 control, bidirectional overrides
and Rich markup are shown by `dataflow run`, `show`, `runs`, `ops ledger` and `definitions show` (as
subprocesses, like a person at a terminal) with no ESC, C1 or bidi character and with the markup as
literal text; `--json` keeps the exact value.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durable_dataflow.core import ledger
from durable_dataflow.dataflow.protocol.runs import MODULE
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.platform import Platform
from support.api_runs import copy_examples, make_outcome_unknown_run
from support.cli import Cli, CliResult, make_cli

ATTACK = "x\x1b]0;pwned\x07\x1b[2J\u202eevil\u2066\x9b[2Jy"
MARKUP = "[reverse]k[/reverse]"  # printable, so a valid idempotency key; Rich would style it away
# What no human rendering may hold: C0 controls but newline, DEL, C1, and the bidi controls.
FORBIDDEN = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# Rich styles a terminal's output only when these say so: the renderings are read as a pipe sees them.
COLOR_ENV = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
NOTES_FLOW = r"""
name: notes
version: 1
description: "\u202egnp.exe \e[2J \x9b"
parameters:
  note: {type: string}
sources:
  one: {kind: inline, rows: [{n: 1}], schema: {n: int64}}
steps:
  - {name: result, sql: "select n, cast($note as int) as bad from one"}
output:
  schema: {n: int64, bad: int32}
  max_rows: 10
  max_bytes: 64KiB
"""


@pytest.fixture
def cli(db_url: str, tmp_path: Path) -> Cli:
    made = make_cli(db_url, tmp_path)
    return Cli(made.db_url, made.cwd, {k: v for k, v in made.env.items() if k not in COLOR_ENV})


def assert_neutral(result: CliResult, *visible: str) -> None:
    """No forbidden character anywhere in the output, and each ``visible`` text shown as such."""
    found = FORBIDDEN.findall(result.output)
    assert not found, (found, result.output)
    for text in visible:
        assert text in result.output, (text, result.output)


def test_run_show_and_definitions_neutralise_a_submitters_text(cli: Cli, tmp_path: Path) -> None:
    """The parameter is shown by `run` and `show` (the run panel) with visible escapes, the description by
    `definitions show`; `show --json` returns the exact value."""
    flow = tmp_path / "notes.yaml"
    flow.write_text(NOTES_FLOW)
    ran = cli("run", str(flow), "--param", f"note={ATTACK}")
    assert ran.code == 1, ran.output  # the cast fails, so the error message may quote the parameter too
    assert_neutral(ran, "\\u202eevil\\u2066\\x9b[2Jy")
    [run] = cli("runs", "--json").json()
    assert run["parameters"] == {"note": ATTACK}

    shown = cli("show", run["run_id"])
    assert shown.code == 0, shown.output
    assert_neutral(shown, "\\u202eevil\\u2066\\x9b[2Jy")
    assert cli("show", run["run_id"], "--json").json()["parameters"] == {"note": ATTACK}
    definition = cli("definitions", "show", "notes")
    assert definition.code == 0, definition.output
    assert_neutral(definition, "\\u202egnp.exe \\u001b[2J \\x9b")


def _stored_attack(db_url: str, tmp_path: Path) -> dict[str, Any]:
    """An unresolved run whose key is Rich markup, whose stored name and warning hold markup and the
    attack, and whose ledger ends with an entry carrying it, as rows written by an older version or by
    hand would: the renderings must not trust the database."""
    with Platform(db_url) as platform:
        run = make_outcome_unknown_run(platform, copy_examples(tmp_path), "acme", key=MARKUP)
        values = {"definition_name": f"{MARKUP}\x1b[2J\u202e", "warning": f"UNRESOLVED: {ATTACK} {MARKUP}"}
        with platform.db.begin() as conn:
            conn.execute(sa.update(dataflow_runs).where(dataflow_runs.c.run_id == run.run_id).values(**values))
            ledger.append(conn, platform.db, MODULE, run.run_id, run.attempt, "test.note", {"note": ATTACK})
    return {"run_id": run.run_id, **values}


def test_runs_and_ops_ledger_neutralise_stored_values_and_markup(cli: Cli, db_url: str, tmp_path: Path) -> None:
    """`runs` (definition, warning) and `ops ledger` (definition, key) show the stored attack escaped and
    the markup key literally; their `--json` outputs hold the exact stored values."""
    stored = _stored_attack(db_url, tmp_path)
    listed = cli("runs")
    assert listed.code == 0, listed.output
    assert_neutral(listed, f"{MARKUP}\\x1b[2J\\u202e", "UNRESOLVED: x\\x1b]0;pwned")
    [exact] = cli("runs", "--json").json()
    assert exact["definition_name"] == stored["definition_name"] and exact["warning"] == stored["warning"]

    ledger = cli("ops", "ledger")
    assert ledger.code == 0, ledger.output
    assert_neutral(ledger, "Unresolved runs: 1", f"{MARKUP}\\x1b[2J\\u202e")
    projection = cli("ops", "ledger", "--json").json()
    assert projection["unresolved"][0]["definition_name"] == stored["definition_name"]

    shown = cli("show", stored["run_id"])
    assert shown.code == 0, shown.output
    assert_neutral(shown, MARKUP, "WARNING: UNRESOLVED: x\\x1b]0;pwned", '{"note":"x\\u001b]0;pwned')
