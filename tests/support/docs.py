"""The fenced code blocks of README.md and docs/*.md: the one reading of them that the docs tests share.

tests/acceptance/test_tutorial.py runs docs/tutorial.md's `sh` blocks; tests/acceptance/test_docs_commands.py
checks every shell block's commands against the CLI and runs the blocks fenced ```` ```sh runnable ````.
A fence is CommonMark's: three or more backticks or tildes, indented by at most three spaces more than
its list item (so blocks inside list items count), closed by a fence of the same character at least as
long; an unclosed fence runs to the end of the document.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from support.cli import REPO_ROOT

_OPENING = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a document."""

    path: Path
    line: int  # the document's line number (1-based) of the block's first content line
    language: str  # the info string's first word ("sh", "console", ...), "" for none
    flags: tuple[str, ...]  # the info string's other words, e.g. ("runnable",)
    lines: tuple[str, ...]  # the content, the fence's indentation removed

    @property
    def text(self) -> str:
        return "".join(f"{line}\n" for line in self.lines)

    @property
    def runnable(self) -> bool:
        """Marked to be executed (```` ```sh runnable ````): GitHub highlights by the first word only."""
        return "runnable" in self.flags


def fenced_blocks(text: str, path: Path) -> list[Block]:
    """Every fenced code block of ``text`` (the document at ``path``), in order."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _OPENING.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, info = len(opening["indent"]), opening["fence"], opening["info"].split()
        closing = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), len(lines))
        content = tuple(_dedent(line, indent) for line in lines[i + 1 : end])
        blocks.append(Block(path, i + 2, info[0] if info else "", tuple(info[1:]), content))
        i = end + 1
    return blocks


def _dedent(line: str, indent: int) -> str:
    """The line without up to ``indent`` leading spaces (CommonMark: the fence's own indentation)."""
    stripped = len(line) - len(line.lstrip(" "))
    return line[min(stripped, indent) :]


def documents() -> list[Path]:
    """README.md and every docs/*.md, in a stable order."""
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    return fenced_blocks(path.read_text(encoding="utf-8"), path)
