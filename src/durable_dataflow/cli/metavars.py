"""Plain metavars in every command's help: ``FILE``, ``RUN``, ``N``, none for a flag (issue 30).

Typer (0.29) shows a parameter's Python type in the help (``--json <bool>``, ``--param <list[str]>``)
and writes a required argument as ``{file}`` in the usage line, beside ``{RUN}`` where a metavar was
given. ``install`` replaces those three renderings once, for every command of the app (the plugins'
too), with the shape Click always had: an argument is its metavar or its name in capitals, written
``FILE`` when required and ``[FILE]`` when not; an option that takes a value shows its metavar, else
``N`` for an integer, ``NUMBER`` for a float, ``a|b`` for choices and its name in capitals otherwise;
a flag shows nothing. An explicit ``metavar=`` always wins, so a command says ``NAME=VALUE`` or
``DATE`` where the name alone would not.
"""

from __future__ import annotations

from typing import Any, get_args

from typer import core

_NUMBER_METAVARS = {int: "N", float: "NUMBER"}


def _argument_name(self: core.TyperArgument) -> str:
    return self.metavar if self.metavar is not None else (self.name or "").upper()


def _argument_type(self: core.TyperArgument, ctx: Any) -> str | None:
    return None  # the argument's name column already says what it takes


def _argument_usage(self: core.TyperArgument) -> str:
    name = _argument_name(self) if self.required else f"[{_argument_name(self)}]"
    return name + ("..." if self.nargs != 1 else "")


def _option_type(self: core.TyperOption, ctx: Any) -> str | None:
    if self.metavar is not None:
        return self.metavar
    if self.is_flag:
        return None
    descriptor = self.type_descriptor
    if descriptor.choices is not None:
        return "|".join(str(getattr(choice, "value", choice)) for choice in descriptor.choices)
    annotation = descriptor.annotation
    element = get_args(annotation)[0] if descriptor.is_list else annotation
    return _NUMBER_METAVARS.get(element, (self.name or "").upper())


def install() -> None:
    """Replace Typer's type-revealing help renderings; idempotent (plain attribute assignment)."""
    core.TyperArgument.display_name_raw = property(_argument_name)  # type: ignore[assignment,method-assign]
    core.TyperArgument.display_type_rich = _argument_type  # type: ignore[method-assign,assignment]
    core.TyperArgument._usage_display_name = _argument_usage  # type: ignore[method-assign]
    core.TyperOption.display_type_rich = _option_type  # type: ignore[method-assign]
