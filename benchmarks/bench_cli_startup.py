"""Benchmark 8: how long the CLI's read-only commands take from exec to exit (issue 15, item 5).

Each command is started as a fresh process (``python -m durable_dataflow.cli --db URL …``, the
``dataflow`` console script's code path) against an embedded SQLite database at the current schema
holding one succeeded run: ``runs --limit 1``, ``show RUN``, ``verify RUN``, ``version`` and ``--help``
(answered from ``cli/summaries.py`` without importing a command module). The
figures are wall-clock times, each the median of ``ROUNDS`` processes; the commands rotate inside
each round so load on a shared machine spreads over all of them. Start-up is almost all importing,
so each command is compared with its floor: a bare interpreter loading only the libraries the
command cannot do without (a bare Typer app parsing one option, Rich and pydantic's BaseModel for
every command; SQLAlchemy for the three that read the database; pyarrow with its IPC reader and compute
functions for ``verify``, which re-digests the stored result bytes), measured the same way in the same
rounds. The floor without SQLAlchemy is reported too: it is what a command would cost with a read path
that did not import it, so a command whose floor without SQLAlchemy is over the target cannot meet it
with these libraries at all.
``python -c "import sqlalchemy"`` and an empty interpreter are shown for context. CPU time (user +
system of the child) is recorded beside the wall time: it is steadier than wall time on a busy machine.

    .venv/bin/python benchmarks/bench_cli_startup.py           # standalone: no PostgreSQL needed
    .venv/bin/python benchmarks/run.py --only cli_startup      # as part of make bench
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, BenchContext, print_table, summary, write_result

NAME = "cli_startup"
ROUNDS = 9  # fresh processes per command (the issue asks for at least 7)
QUICK_ROUNDS = 3
TARGET_S = 0.3  # each read-only command starts, answers and exits within 0.3 s (wall, median)
EXAMPLE = ROOT / "examples" / "revenue_by_region" / "dataflow.yaml"
EXAMPLE_PARAMS = ("--param", "day=2026-11-02")
COMMANDS = ("runs", "show", "verify", "version", "help")
# The floor every command stands on: a bare Typer app (one command, one option; Typer 0.29 coerces
# each parameter through a pydantic TypeAdapter, so parsing one option loads pydantic) with Rich's
# console and tables, and pydantic's BaseModel for the run model.
CLI_LIBRARIES = (
    "import typer, rich.console, rich.table\n"
    "from pydantic import BaseModel\n"
    "app = typer.Typer()\n"
    "app.command()(lambda db='': None)\n"
    "app(['--db', 'x'], standalone_mode=False)\n"
)
SQLALCHEMY = "import sqlalchemy\n"
PYARROW = "import pyarrow, pyarrow.ipc, pyarrow.compute\n"  # the digest of the stored result bytes
LIBRARIES = {
    "libs_cli": CLI_LIBRARIES,
    "libs_cli_pyarrow": CLI_LIBRARIES + PYARROW,
    "libs_cli_sqlalchemy": CLI_LIBRARIES + SQLALCHEMY,
    "libs_cli_sqlalchemy_pyarrow": CLI_LIBRARIES + SQLALCHEMY + PYARROW,
}
# Each command's floor as built, and without SQLAlchemy.
FLOORS = {
    "runs": ("libs_cli_sqlalchemy", "libs_cli"),
    "show": ("libs_cli_sqlalchemy", "libs_cli"),
    "verify": ("libs_cli_sqlalchemy_pyarrow", "libs_cli_pyarrow"),
    "version": ("libs_cli", "libs_cli"),
    "help": ("libs_cli", "libs_cli"),
}
REFERENCES = ("import_sqlalchemy", "empty_python", *LIBRARIES)


def _cli(url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "durable_dataflow.cli", "--db", url, *args]


def _argv(name: str, url: str, run_id: str) -> list[str]:
    return {
        "runs": _cli(url, "runs", "--limit", "1"),
        "show": _cli(url, "show", run_id),
        "verify": _cli(url, "verify", run_id),
        "version": _cli(url, "version"),
        "help": [sys.executable, "-m", "durable_dataflow.cli", "--help"],  # the top-level help takes no --db
        "import_sqlalchemy": [sys.executable, "-c", "import sqlalchemy"],
        "empty_python": [sys.executable, "-c", "pass"],
        **{key: [sys.executable, "-c", code] for key, code in LIBRARIES.items()},
    }[name]


def _environment(workdir: Path) -> dict[str, str]:
    # No DATAFLOW_* setting of the caller's leaks in (a limit, a key, a default database).
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAFLOW_")}
    env["COLUMNS"] = "200"
    # An installed package runs from bytecode; a checkout with PYTHONDONTWRITEBYTECODE (the test
    # setup) would compile every module of the platform in every process (~0.15 s here). The
    # bytecode goes to a private folder, warmed by the unmeasured first round, not into src/.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(workdir / "pycache")
    return env


def _one(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one fresh process that must exit 0."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, check=False)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[3:]} exited {done.returncode}: {done.stderr.decode(errors='replace')[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _prepare(workdir: Path, env: dict[str, str]) -> tuple[str, str]:
    """A fresh SQLite platform database holding one succeeded run of the example; its URL and run id."""
    url = f"sqlite:///{workdir / 'cli-startup.db'}"
    done = subprocess.run(
        [*_cli(url, "run", str(EXAMPLE), *EXAMPLE_PARAMS, "--json")],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return url, str(json.loads(done.stdout)["run_id"])


def measure(workdir: Path, rounds: int) -> dict[str, Any]:
    env = _environment(workdir)
    url, run_id = _prepare(workdir, env)
    names = COMMANDS + REFERENCES
    for name in names:  # warm the page cache and the bytecode caches once, unmeasured
        _one(_argv(name, url, run_id), env)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)  # rotate the order: no command always runs first or last
        for name in names[shift:] + names[:shift]:
            seconds, cpu_seconds = _one(_argv(name, url, run_id), env)
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
    medians = {name: statistics.median(values) for name, values in wall.items()}
    floor = medians["import_sqlalchemy"]
    return {
        "rounds": rounds,
        "database": "sqlite (embedded, at the current schema, one succeeded run)",
        "bytecode": "compiled once into a private PYTHONPYCACHEPREFIX, as an installed package runs",
        "target_s": TARGET_S,
        "commands": {
            name: {
                "argv": ["dataflow", *_argv(name, "URL", "RUN")[3:]],
                "wall_s": summary(wall[name]),
                "cpu_s": summary(cpu[name]),
                "over_import_sqlalchemy_s": medians[name] - floor,
                "floor": FLOORS[name][0],
                "over_floor_s": medians[name] - medians[FLOORS[name][0]],
                "floor_without_sqlalchemy": FLOORS[name][1],
                "floor_without_sqlalchemy_s": medians[FLOORS[name][1]],
                "target_met": medians[name] <= TARGET_S,
                "target_reachable_without_sqlalchemy": medians[FLOORS[name][1]] <= TARGET_S,
            }
            for name in COMMANDS
        },
        "references": {
            name: {"argv": _argv(name, "URL", "RUN")[1:], "wall_s": summary(wall[name]), "cpu_s": summary(cpu[name])}
            for name in REFERENCES
        },
    }


def report(payload: dict[str, Any]) -> None:
    rows: list[tuple[Any, ...]] = []
    for item in payload["commands"].values():
        rows.append((
            " ".join(item["argv"]), item["wall_s"]["median"], item["wall_s"]["p95"], item["cpu_s"]["median"],
            item["over_floor_s"], item["floor_without_sqlalchemy_s"], item["target_met"],
        ))  # fmt: skip
    for name, item in payload["references"].items():
        rows.append((name, item["wall_s"]["median"], item["wall_s"]["p95"],
                     item["cpu_s"]["median"], "", "", ""))  # fmt: skip
    print_table(
        f"CLI start-up, fresh process each (median of {payload['rounds']}), seconds",
        [
            "command",
            "wall",
            "wall p95",
            "cpu",
            "over its libraries",
            "libraries w/o SQLAlchemy",
            f"target <= {TARGET_S}s",
        ],
        rows,
    )


def run(ctx: BenchContext) -> dict[str, Any]:
    payload = measure(ctx.workdir, QUICK_ROUNDS if ctx.quick else ROUNDS)
    report(payload)
    write_result(NAME, payload, None, ctx.quick)
    return payload


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds, results in *.quick.json")
    parser.add_argument("--rounds", type=int, default=None, help=f"processes per command (default {ROUNDS})")
    parser.add_argument("--output", type=Path, default=None, help="write the JSON here instead of results/")
    args = parser.parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    with tempfile.TemporaryDirectory(prefix="dataflow-bench-") as workdir:
        payload = measure(Path(workdir), rounds)
    report(payload)
    if args.output is not None:
        args.output.write_text(json.dumps(payload, indent=2) + "\n")
    else:
        write_result(NAME, payload, None, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
