"""Docs drift check (issue 30, item 6): the commands README.md and docs/*.md show are commands the CLI has,
and the blocks marked runnable run as written, so the quick start and the guides cannot silently break.

Static check (in-process, no subprocess). In every shell block (a fence whose info string starts with
`sh`, `bash`, `shell` or `console`) each command is found the way bash would split it: after a `$ `
prompt (in a `console` block only prompted lines and their continuations are commands, the rest is
output), after `&&`, `||`, `;`, `|`, `&`, `(` and inside `$(...)`, with backslash continuations joined,
comments and heredoc bodies left out. Then:

- a `dataflow ...` (also `.venv/bin/dataflow`, `venv/bin/dataflow`, `python -m durable_dataflow.cli`)
  is parsed by the real click command tree (`typer.main.get_command(durable_dataflow.cli.app)`), with
  click's own parser in resilient mode: each (sub)command must exist, and every option must be one of
  the command it is given to: a global option (`--db`, `--api`, `--token-file`, `--debug`,
  `--lease-ttl`) before the command, the command's own after it, as the CLI itself parses them.
  Placeholders pass: `RUN`, `FILE`, `"$RUN"` are just arguments, `<run id from the warning>` is one
  argument, and `[--tenant acme]` (a usage line's optional part) is checked as `--tenant acme`.
  Values are not type-checked (`--from D` is fine).
- a `make TARGET` must name a target of the Makefile;
- every `examples/...` path a block names must exist in the repository.

A failure names the document, the line and what is wrong.

Runnable blocks. A block fenced ```` ```sh runnable ```` (GitHub highlights by the info string's first
word, so it still renders as `sh`) is executed: a document's runnable blocks, in order, are one
`bash -euo pipefail` script, run in a fresh folder holding a copy of `examples/` and a
`.venv/bin/dataflow` (this checkout's entry point, first on PATH), with the environment scrubbed as
`support.cli.SCRUBBED_ENV` says, so the embedded default (a SQLite file in `.dataflow/`, local sinks)
is what they use. Mark a block runnable only when it runs as written in such an empty folder: no
server, no PostgreSQL, no made-up run or token id. docs/tutorial.md is left to
tests/acceptance/test_tutorial.py, which runs every one of its `sh` blocks and checks what they print.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer

from durable_dataflow.cli import app
from support.cli import EXAMPLES, REPO_ROOT, SCRUBBED_ENV
from support.docs import Block, blocks_of, documents, fenced_blocks

pytestmark = pytest.mark.timeout(120)

SHELL_LANGUAGES = frozenset({"sh", "bash", "shell", "console"})
TUTORIAL = REPO_ROOT / "docs" / "tutorial.md"
# The documents that must keep runnable blocks: losing a marker would silently drop their run.
RUNNABLE_AT_LEAST = frozenset({"README.md", "docs/daily-tables.md", "docs/operations.md"})
SCRIPT_TIMEOUT_S = 90
OUTPUT_TAIL_CHARS = 3000

# Words that may stand before a command's name (bash keywords and wrappers that run what follows).
_COMMAND_PREFIXES = frozenset({"!", "{", "}", "if", "then", "else", "elif", "do", "while", "until", "time", "exec"})
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_OPERATOR_CHARS = frozenset("();<>|&")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
# `<run id from the warning>`: one argument; `<<EOF` and `2>` are no placeholders.
_PLACEHOLDER = re.compile(r"(?<!<)<(?!<)([A-Za-z][^<>\n]*)>")
_EXAMPLES_PATH = re.compile(r"(?<![\w./-])examples/[^\s'\"`()<>|;&,]*")


@dataclass(frozen=True)
class Command:
    """One simple command of a shell block: its words, and the document line it starts on."""

    path: Path
    line: int
    words: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _rel(path: Path) -> str:
    """The path as a failure names it: relative to the repository when it is inside it."""
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


# --- finding the commands of a block -------------------------------------------------------------------------


def logical_lines(block: Block) -> Iterator[tuple[int, str]]:
    """The block's command lines with their document line numbers: prompts removed, continuations and
    quotes spanning lines joined, heredoc bodies and (in a console block) output lines left out."""
    prompted = block.language == "console"
    lines = list(block.lines)
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        i += 1
        if prompted and not text.lstrip().startswith("$ "):
            continue  # output
        text = re.sub(r"^\s*\$ ", "", text)
        while i < len(lines) and (text.rstrip().endswith("\\") or not _quotes_closed(text)):
            text = text.rstrip()[:-1] if text.rstrip().endswith("\\") else f"{text}\n"
            text, i = text + lines[i], i + 1
        text = strip_comment(text)
        for heredoc in _HEREDOC.finditer(text):  # its body is a file's content, not commands
            while i < len(lines) and lines[i].strip() != heredoc[2]:
                i += 1
            i += 1
        yield block.line + start, text


def _quotes_closed(text: str) -> bool:
    try:
        _split(strip_comment(text))
    except ValueError:
        return False
    return True


def strip_comment(line: str) -> str:
    """The line without its comment: a `#` outside quotes that starts a word."""
    quote, escaped = "", False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace() or line[i - 1] in _OPERATOR_CHARS):
            return line[:i]
    return line


def _split(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    return list(lexer)


def simple_commands(text: str) -> Iterator[list[str]]:
    """The simple commands of one logical line, as their words, `$(...)` substitutions included."""
    words: list[str] = []
    tokens = _split(_PLACEHOLDER.sub(lambda m: "_".join(m[1].upper().split()), text))
    skip_next = False
    for n, token in enumerate(tokens):
        if skip_next:  # a redirection's target
            skip_next = False
        elif set(token) <= _OPERATOR_CHARS:
            if "<" in token or ">" in token:
                skip_next = True
            else:
                yield from _with_substitutions(words)
                words = []
        elif not (token.isdigit() and n + 1 < len(tokens) and tokens[n + 1][:1] in "<>"):  # the 2 of 2>
            words.append(token)
    yield from _with_substitutions(words)


def _with_substitutions(words: list[str]) -> Iterator[list[str]]:
    for word in words:  # "$(dataflow ...)" stays one word when quoted
        for inner in _substitutions(word):
            yield from simple_commands(inner)
    if words:
        yield words


def _substitutions(word: str) -> Iterator[str]:
    start = word.find("$(")
    while start >= 0:
        depth, end = 0, start + 1
        for end in range(start + 1, len(word)):
            depth += {"(": 1, ")": -1}.get(word[end], 0)
            if depth == 0:
                break
        yield word[start + 2 : end]
        start = word.find("$(", end)


def block_commands(block: Block) -> Iterator[Command]:
    """Every simple command of a shell block, with leading assignments and keywords removed."""
    for line, text in logical_lines(block):
        for words in simple_commands(text):
            while words and (words[0] in _COMMAND_PREFIXES or _ASSIGNMENT.match(words[0])):
                words = words[1:]
            if words:
                yield Command(block.path, line, tuple(words))


def dataflow_arguments(words: tuple[str, ...]) -> list[str] | None:
    """The CLI's arguments when the command runs `dataflow`, else None. Optional brackets of a usage
    line (`[--tenant acme]`) are dropped so what they hold is checked."""
    if Path(words[0]).name == "dataflow":
        args = list(words[1:])
    elif Path(words[0]).name.startswith("python") and words[1:3] == ("-m", "durable_dataflow.cli"):
        args = list(words[3:])
    else:
        return None
    bare = (arg.lstrip("[").rstrip("]") for arg in args)  # [--only-missing [--stale]] too
    return [arg for arg in bare if arg not in ("", "...", "…")]


# --- checking them --------------------------------------------------------------------------------------------


@cache
def root_command() -> Any:  # Any: typer vendors click, whose Command has no stable public import
    return typer.main.get_command(app)


@cache
def _global_options() -> frozenset[str]:
    root = root_command()
    return frozenset(_options(root, root.context_class(root, info_name="dataflow")))


def _options(command: Any, ctx: Any) -> list[str]:
    return sorted(o for p in command.get_params(ctx) for o in (*p.opts, *p.secondary_opts) if o.startswith("-"))


def dataflow_problem(args: list[str]) -> str | None:
    """What is wrong with `dataflow ARGS` as the CLI would parse it, or None. At each level, click's own
    option parser (strict) checks the options given to that command; then the command's resilient parse
    (a placeholder's value is neither typed nor required) says which subcommand comes next, the way a
    group with its own parse_args (`backfill FILE`, `backfill cancel FILE`) splits it."""
    command, name, path = root_command(), "dataflow", "dataflow"
    ctx: Any = None
    while True:
        strict = command.context_class(command, info_name=name, parent=ctx)
        try:
            command.make_parser(strict).parse_args(args=list(args))
        except Exception as error:  # click's UsageError family (vendored by typer): it formats itself
            message = getattr(error, "format_message", None)
            if not callable(message):
                raise
            option = getattr(error, "option_name", None)
            hint = f"{option} is a global option: it goes before the command; " if option in _global_options() else ""
            return f"`{path}`: {message()} ({hint}its options: {', '.join(_options(command, strict))})"
        commands = getattr(command, "commands", None)
        if commands is None:
            return None
        ctx = command.make_context(name, list(args), parent=ctx, resilient_parsing=True)
        # A group leaves its subcommand's name in _protected_args (click's own invoke reads it there).
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest:
            return None
        name, args = rest[0], rest[1:]
        if name not in commands:
            return f"`{path}` has no command {name!r} (its commands: {', '.join(sorted(commands))})"
        command, path = commands[name], f"{path} {name}"


def makefile_targets() -> frozenset[str]:
    text = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    rules = re.findall(r"^([A-Za-z0-9_.\- ]+?)\s*:(?!=)", text, flags=re.MULTILINE)
    return frozenset(target for rule in rules for target in rule.split())


def command_problems(command: Command) -> Iterator[str]:
    args = dataflow_arguments(command.words)
    if args is not None:
        problem = dataflow_problem(args)
        if problem is not None:
            yield f"{command.where}: {problem}"
    elif command.words[0] == "make":
        for target in command.words[1:]:
            if not target.startswith("-") and "=" not in target and target not in makefile_targets():
                yield f"{command.where}: `make {target}`: the Makefile has no target {target!r}"


def example_problems(block: Block) -> Iterator[str]:
    for offset, line in enumerate(block.lines):
        for named in _EXAMPLES_PATH.findall(line):
            named = named.rstrip(".:")
            if not any(REPO_ROOT.glob(named)) and not (REPO_ROOT / named).exists():
                yield f"{Command(block.path, block.line + offset, ()).where}: {named} does not exist in the repository"


def shell_blocks(blocks: list[Block]) -> list[Block]:
    return [block for block in blocks if block.language in SHELL_LANGUAGES]


def doc_problems(blocks: list[Block]) -> list[str]:
    """Everything the static check finds wrong in a document's shell blocks."""
    problems: list[str] = []
    for block in shell_blocks(blocks):
        for command in block_commands(block):
            problems.extend(command_problems(command))
        problems.extend(example_problems(block))
    return problems


@pytest.mark.parametrize("doc", documents(), ids=_rel)
def test_every_command_a_document_shows_exists(doc: Path) -> None:
    """Each `dataflow` command line of the document's shell blocks parses in the real CLI (command and
    options), each `make` target is the Makefile's, each `examples/` path exists."""
    problems = doc_problems(blocks_of(doc))
    assert not problems, "the docs drifted from the code:\n" + "\n".join(problems)


# --- the check's own tests: it finds the commands, and it fails on drift --------------------------------------

SYNTHETIC = """\
# A page

```sh
$ dataflow runs --status failed   # a prompt, and a comment naming dataflow nonexistent
dataflow verify RUN && dataflow show RUN; make demo | cat
RUN=$(.venv/bin/dataflow runs --json | jq -r '.[0].run_id')
export T="$(dataflow tokens create --tenant acme --role viewer)"
dataflow run examples/revenue_by_region/dataflow.yaml \\
  --param day=2026-11-02 --idempotency-key k
cat > x.yaml <<'EOF'
dataflow heredoc-body
EOF
python3 -m durable_dataflow.cli version
```

```console
$ dataflow submit FILE -p day=2026-11-02 --wait \\
    | jq -r .status
succeeded
dataflow output-line
```

```yaml
dataflow: not-a-shell-block
```
"""


def _found(markdown: str) -> list[tuple[int, tuple[str, ...]]]:
    blocks = shell_blocks(fenced_blocks(markdown, Path("page.md")))
    return [(c.line, c.words) for b in blocks for c in block_commands(b) if dataflow_arguments(c.words) is not None]


def test_the_parser_finds_each_invocation_as_bash_would() -> None:
    """On a synthetic page: after a prompt, `&&`, `;`, `|`, in `$(...)` quoted or not, across a backslash
    continuation; never in a comment, a heredoc body, console output or a yaml block."""
    assert _found(SYNTHETIC) == [
        (4, ("dataflow", "runs", "--status", "failed")),
        (5, ("dataflow", "verify", "RUN")),
        (5, ("dataflow", "show", "RUN")),
        (6, (".venv/bin/dataflow", "runs", "--json")),
        (7, ("dataflow", "tokens", "create", "--tenant", "acme", "--role", "viewer")),
        (8, ("dataflow", "run", "examples/revenue_by_region/dataflow.yaml", "--param", "day=2026-11-02",
             "--idempotency-key", "k")),
        (13, ("python3", "-m", "durable_dataflow.cli", "version")),
        (17, ("dataflow", "submit", "FILE", "-p", "day=2026-11-02", "--wait")),
    ]  # fmt: skip
    assert doc_problems(fenced_blocks(SYNTHETIC, Path("page.md"))) == []


def test_the_check_names_a_missing_command_an_unknown_option_and_tolerates_placeholders() -> None:
    """A missing command, a misspelt option, an option given at the wrong level, an unknown make target and
    a missing example are each reported with file and line; placeholders and optional brackets pass."""
    page = """\
```sh
dataflow tokens list [--tenant acme] [--json]
.venv/bin/dataflow reconcile <run id from the warning> --resume
dataflow --api https://HOST:8080 cancel RUN
dataflow backfill cancel FILE --from D --to D
dataflow backfill FILE --from D --to D [--only-missing [--stale]] [--json] ...
python -m durable_dataflow.cli --lease-ttl SECONDS worker --until-idle
dataflow runz
dataflow schedules lst
dataflow runs --statuss failed
dataflow --json runs
dataflow runs --db sqlite:///x.db
make tset
dataflow run examples/nowhere/dataflow.yaml
```
"""
    problems = doc_problems(fenced_blocks(page, Path("page.md")))
    assert len(problems) == 7, problems
    runz, lst, statuss, json_first, db_last, tset, nowhere = problems
    assert runz.startswith("page.md:8: `dataflow` has no command 'runz' (its commands: backfill, cancel,")
    assert lst.startswith("page.md:9: `dataflow schedules` has no command 'lst' (its commands: apply, list,")
    assert statuss.startswith("page.md:10: `dataflow runs`: No such option: --statuss") and "--status," in statuss
    assert json_first.startswith("page.md:11: `dataflow`: No such option: --json (its options: --api, --db,")
    assert db_last.startswith("page.md:12: `dataflow runs`: No such option: --db (--db is a global option: it goes")
    assert tset == "page.md:13: `make tset`: the Makefile has no target 'tset'"
    assert nowhere == "page.md:14: examples/nowhere/dataflow.yaml does not exist in the repository"


def test_drift_in_a_copy_of_the_readme_fails_the_check() -> None:
    """The README as it is passes; the same text with an option misspelt and a command renamed fails,
    naming both lines."""
    readme = REPO_ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert doc_problems(fenced_blocks(text, readme)) == []
    drifted = text.replace("worker --until-idle", "worker --until-idel").replace("schedules list", "schedules lst")
    assert drifted != text
    line = {word: n for n, text in enumerate(drifted.splitlines(), 1) for word in ("lst", "idel") if word in text}
    lst, idel = doc_problems(fenced_blocks(drifted, readme))
    assert lst.startswith(f"README.md:{line['lst']}: `dataflow schedules` has no command 'lst'")
    assert idel.startswith(f"README.md:{line['idel']}: `dataflow worker`: No such option: --until-idel")
    assert "--until-idle" in idel


# --- the runnable blocks --------------------------------------------------------------------------------------


def runnable_script(doc: Path) -> str:
    """The document's runnable blocks, in order, as one script ('' when it has none)."""
    return "".join(block.text for block in blocks_of(doc) if block.runnable)


RUNNABLE_DOCS = [doc for doc in documents() if doc != TUTORIAL and runnable_script(doc)]


def test_runnable_blocks_are_where_expected() -> None:
    """The documents that must have runnable blocks still do, every runnable block is `sh`, and the
    tutorial (run whole by test_tutorial.py) is not run twice."""
    assert {_rel(doc) for doc in RUNNABLE_DOCS} >= RUNNABLE_AT_LEAST
    marked = [block for doc in documents() for block in blocks_of(doc) if block.runnable]
    assert all(block.language == "sh" for block in marked), [f"{_rel(b.path)}:{b.line}" for b in marked]
    assert TUTORIAL not in RUNNABLE_DOCS


def sandbox(tmp_path: Path) -> dict[str, str]:
    """A fresh folder with a copy of examples/ and .venv/bin/dataflow (this checkout's); its environment."""
    shutil.copytree(EXAMPLES, tmp_path / "examples", ignore=shutil.ignore_patterns("warehouse", "__pycache__"))
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "dataflow").symlink_to(Path(sys.executable).parent / "dataflow")
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.parametrize("doc", RUNNABLE_DOCS, ids=_rel)
def test_runnable_blocks_run_as_written(doc: Path, tmp_path: Path) -> None:
    """The document's `sh runnable` blocks, one `bash -euo pipefail` script in an empty sandbox on the
    embedded default, exit 0."""
    env = sandbox(tmp_path)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", runnable_script(doc)], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=SCRIPT_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (
        f"{_rel(doc)}'s runnable blocks exited {done.returncode}\n--- stdout (tail)\n"
        f"{done.stdout[-OUTPUT_TAIL_CHARS:]}\n--- stderr (tail)\n{done.stderr[-OUTPUT_TAIL_CHARS:]}"
    )
