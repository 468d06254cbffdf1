"""Options more than one command takes, declared once so their flags and help never drift apart.

Imports Typer only: every command module imports this one, `version` included (see ``common``).
"""

from __future__ import annotations

from typing import Annotated

import typer

# `run` and `submit`: a replay of the key (in its tenant) returns the run recorded first.
IdempotencyKey = Annotated[
    str | None,
    typer.Option(
        "--idempotency-key",
        "-k",
        metavar="KEY",
        help="Replays of this key (in the tenant) return the existing run; nothing is executed or recorded again.",
    ),
]

# `run` and `submit`: one parameter of the run, typed by the definition's declaration.
Params = Annotated[
    list[str] | None,
    typer.Option(
        "--param",
        "-p",
        metavar="NAME=VALUE",
        help="A parameter of the run, NAME=VALUE, typed by the definition (repeatable).",
    ),
]
