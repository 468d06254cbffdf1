"""The DuckDB sandbox for user SQL (reference §3 and §6, docs/engines.md).

Two shapes, both configured with external access, extension loading and Python replacement scans
off and then locked, so no user statement can change a setting:

* **Confined** (``open_confined``): one database per execution that reads files. Its
  ``allowed_paths`` are exactly the resolved source files, set *before* ``enable_external_access =
  false`` and ``lock_configuration = true`` (the only order DuckDB accepts: the setting cannot be
  passed to ``connect()``). DuckDB then streams those files itself (projection and filter pushdown,
  out-of-core execution) and refuses every other file, a glob, a second file in the same folder, a
  symlink leading out, a URL. It spills to a private folder of its own (DuckDB allow-lists its temp
  directory, so the folder is per execution, mode 0700, and removed afterwards) in ``limits.temp_dir``
  (a platform's is ``spill/`` in its data directory, ``limits.with_data_dir``), bounded by
  ``max_temp_directory_size``: the operator's ``--temp-max``, else a quarter of that file system's free
  space as the execution starts (``limits.spill_bytes_max``).
  Settings are global to a database, so each execution's limits are
  its own.
* **Shared** (``open_cursor``): executions whose sources are all inline use a cursor on one
  database per process and per (memory limit, threads) pair, opened lazily, because opening a
  database costs ~17 ms and a cursor ~1.3 ms. It never spills (no temp directory). A DuckDB cursor
  is a separate connection: its registered views and TEMP tables are private to it
  (tests/unit/test_sandbox.py).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import duckdb

from durable_dataflow.core.errors import InputError
from durable_dataflow.core.invariants import invariant
from durable_dataflow.dataflow.execution import limits as limits_mod

if TYPE_CHECKING:
    from durable_dataflow.dataflow.execution.limits import ExecutionLimits

SANDBOX_DATABASES_MAX = 8
ALLOWED_PATHS_MAX = 100_000
SPILL_FOLDER_PREFIX = "dataflow-spill-"

_BASE_CONFIG: dict[str, str | bool] = {
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "allow_community_extensions": False,
    "allow_unsigned_extensions": False,
    "python_enable_replacements": False,  # no implicit scans of the caller's Python variables
    # A step's cast (or a set operation) must not replace the type a source column is read as: the
    # optimizer would push it into the CSV reader, and `007`/`abc` declared int64 would pass as text.
    "disabled_optimizers": "type_pushdown",
    # No persistent secrets, and a secrets folder that names nothing: by default DuckDB points it at
    # the service user's home (~/.duckdb/stored_secrets), which duckdb_secrets() errors and
    # duckdb_settings() would show to a step.
    "allow_persistent_secrets": False,
    "secret_directory": "/nonexistent/durable-dataflow/no-secrets",
    # The same for extensions: an error of duckdb_extensions() would name ~/.duckdb/extensions.
    "extension_directory": "/nonexistent/durable-dataflow/no-extensions",
}
# The default '.tmp' would be silently allow-listed once external access is off (reference §3);
# the shared database has no temp directory, so nothing of it spills and memory_limit is a hard bound.
_NO_SPILL = {"temp_directory": ""}

_databases: dict[tuple[str, int], duckdb.DuckDBPyConnection] = {}
_databases_lock = threading.Lock()


@dataclass(frozen=True)
class GatedStep:
    """A step whose SQL passed the gate, with the named parameters it uses."""

    name: str
    sql: str
    parameter_names: frozenset[str]


def _lock(database: duckdb.DuckDBPyConnection) -> None:
    # Order matters: external access off first, then freeze every setting including that one.
    database.execute("SET enable_external_access = false")
    database.execute("SET lock_configuration = true")


def _open_shared(memory_limit: str, threads: int) -> duckdb.DuckDBPyConnection:
    config: dict[str, str | bool | int | float | list[str]] = {
        **_BASE_CONFIG, **_NO_SPILL, "memory_limit": memory_limit, "threads": threads
    }
    database = duckdb.connect(":memory:", config=config)
    _lock(database)
    return database


def open_cursor(limits: ExecutionLimits) -> duckdb.DuckDBPyConnection:
    """A private connection on the shared (file-less) sandbox database for these limits; close it when done."""
    key = (limits.memory_limit, limits.threads)
    with _databases_lock:
        database = _databases.get(key)
        if database is None:
            if len(_databases) >= SANDBOX_DATABASES_MAX:
                raise InputError(
                    f"more than {SANDBOX_DATABASES_MAX} different sandbox limits in one process: "
                    "use one memory_limit and thread count per worker"
                )
            database = _open_shared(limits.memory_limit, limits.threads)
            _databases[key] = database
        # cursor() on the parent is not safe to call concurrently, so it stays under the lock.
        return database.cursor()


@dataclass(frozen=True)
class Confined:
    """An execution's own database, its private spill folder and the bytes it may spill there."""

    database: duckdb.DuckDBPyConnection
    spill_folder: str
    spill_bytes_max: int


@contextlib.contextmanager
def open_confined(limits: ExecutionLimits, allowed_paths: Sequence[str]) -> Iterator[Confined]:
    """A database of its own that may read exactly ``allowed_paths`` (absolute, resolved file paths).

    The connection reports query progress (``query_progress()``) and is closed, and its spill
    folder removed, when the block ends.
    """
    if len(allowed_paths) > ALLOWED_PATHS_MAX:
        raise InputError(f"the sources name more than {ALLOWED_PATHS_MAX} files")
    spill = _make_spill_folder(limits)
    try:
        spill_bytes_max = limits_mod.spill_bytes_max(limits, free_disk_bytes(spill))
        config: dict[str, str | bool | int | float | list[str]] = {
            **_BASE_CONFIG,
            "memory_limit": limits.memory_limit,
            "threads": limits.threads,
            "temp_directory": spill,
            "max_temp_directory_size": f"{max(1, spill_bytes_max // 1024**2)}MiB",
        }
        database = duckdb.connect(":memory:", config=config)
        try:
            if allowed_paths:
                database.execute("SET allowed_paths = ?", [list(allowed_paths)])
            # Local (per-connection) settings: progress is computed but never printed by DuckDB.
            database.execute("SET enable_progress_bar = true")
            database.execute("SET enable_progress_bar_print = false")
            _lock(database)
            yield Confined(database, spill, spill_bytes_max)
        finally:
            database.close()
    finally:
        shutil.rmtree(spill, ignore_errors=True)


def _make_spill_folder(limits: ExecutionLimits) -> str:
    """A new private folder (mode 0700) for one execution's spill files, in ``limits.temp_dir`` (None:
    the system temporary directory)."""
    spill = tempfile.mkdtemp(prefix=SPILL_FOLDER_PREFIX, dir=limits.temp_dir)  # mode 0700
    invariant(os.stat(spill).st_mode & 0o077 == 0, "a spill folder is private to the service user")
    return spill


def free_disk_bytes(folder: str) -> int:
    """The bytes free on the file system that holds ``folder`` (for the service user)."""
    return shutil.disk_usage(folder).free


def spill_folders_left(temp_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Spill folders that still exist (tests: every execution removes its own)."""
    root = temp_dir or tempfile.gettempdir()
    return sorted(name for name in os.listdir(root) if name.startswith(SPILL_FOLDER_PREFIX))


def gate_step(cursor: duckdb.DuckDBPyConnection, step_name: str, sql: str) -> GatedStep:
    """Admit exactly one SELECT (which includes WITH … SELECT); refuse everything else before it runs."""
    try:
        statements = cursor.extract_statements(sql)
    except duckdb.Error as exc:
        raise InputError(f"step {step_name!r}: the SQL does not parse: {first_line(exc)}") from None
    if len(statements) != 1:
        raise InputError(
            f"step {step_name!r} must be exactly one SELECT statement, found {len(statements)} statements"
        )
    statement = statements[0]
    if statement.type != duckdb.StatementType.SELECT:
        raise InputError(
            f"step {step_name!r} must be a SELECT (or WITH … SELECT) statement, found a statement of type "
            f"{statement.type.name}"
        )
    return GatedStep(step_name, sql, frozenset(statement.named_parameters))


# Table functions that read files by path (or run SQL given as text, which could), and relation names
# that DuckDB would read as a file (a replacement scan): the sandbox admits the declared files, so a
# step reading one itself would get the raw file, around its source's declared types.
_FILE_READING_FUNCTION = re.compile(
    r"read_.*|parquet_.*|.*_scan|sniff_csv|glob|query|query_table|json_execute_serialized_sql|iceberg_.*|delta_.*"
)
_FILE_LIKE_NAME = re.compile(r"[./\\:~]")
# Functions and catalog views that show the server's configuration to a step: its settings (the spill
# folder, the allowed paths, the memory limit), secrets, extensions, databases, temporary files and
# logs. Settings are locked, so a step can read them but never change them; reading them still hands
# the server's folders to a tenant, so a step may not name them at all (docs/security.md).
_SERVER_CONFIG_FUNCTION = re.compile(r"current_setting|duckdb_.*|pragma_.*|which_secret")
_SERVER_CONFIG_VIEW = re.compile(r"duckdb_.*|pragma_.*|pg_settings")
STEP_TREE_NODES_MAX = 1_000_000  # nodes of a step's parse tree walked (the SQL text is bounded too)


def refuse_server_reads(cursor: duckdb.DuckDBPyConnection, step: GatedStep) -> None:
    """A step reads its sources by name: refuse a table function that reads a file, a relation named
    like a file, and a function or view that shows the server's configuration, anywhere in its parse
    tree (DuckDB's own, as json_serialize_sql gives it). Checked as the execution starts, before any
    source is bound, so such a run ends failed with invalid_input like any file the sandbox refuses.

    The tree depends on the SQL text alone (DuckDB parses, it does not bind), so a text that passed is
    remembered by its digest (``_PASSED``, the newest ``PASSED_SQL_KEPT``) and not parsed again by this
    process; a refusal is never remembered."""
    key = hashlib.blake2b(step.sql.encode("utf-8"), digest_size=32).digest()
    with _PASSED_LOCK:
        if key in _PASSED:
            _PASSED.move_to_end(key)
            return
    _walk_for_server_reads(cursor, step)
    with _PASSED_LOCK:
        _PASSED[key] = None
        while len(_PASSED) > PASSED_SQL_KEPT:
            _PASSED.popitem(last=False)


PASSED_SQL_KEPT = 4096  # step texts this process remembers as checked (32 bytes of digest each)
_PASSED: collections.OrderedDict[bytes, None] = collections.OrderedDict()
_PASSED_LOCK = threading.Lock()  # inline executions run in threads of one process


def _walk_for_server_reads(cursor: duckdb.DuckDBPyConnection, step: GatedStep) -> None:
    step_name = step.name
    tree = json.loads(str(cursor.execute("SELECT json_serialize_sql(?)", [step.sql]).fetchall()[0][0]))
    if tree.get("error"):
        raise InputError(f"step {step_name!r}: the SQL cannot be checked ({tree.get('error_type', 'unknown')})")
    pending: list[object] = [tree]
    walked = 0
    while pending:  # an explicit stack (no recursion); ends when the tree is walked or at the cap
        node = pending.pop()
        walked += 1
        if walked > STEP_TREE_NODES_MAX:
            raise InputError(f"step {step_name!r}: the SQL is too large to check")
        if isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, dict):
            _refuse_node(step_name, node)
            pending.extend(node.values())


def _refuse_node(step_name: str, node: dict[str, object]) -> None:
    refused = _file_read(node)
    if refused is not None:
        raise InputError(
            f"step {step_name!r} tried to reach files, the network or extensions, which the sandbox "
            f"forbids: it reads files itself ({refused}); a step reads its sources and earlier steps by name"
        )
    shown = _server_config_read(node)
    if shown is not None:
        raise InputError(
            f"step {step_name!r} uses {shown}, which shows the server's configuration; the sandbox forbids it: "
            "a step reads its sources and earlier steps by name"
        )


def _file_read(node: dict[str, object]) -> str | None:
    kind, function = node.get("type"), node.get("function")
    if kind == "TABLE_FUNCTION" and isinstance(function, dict):
        name = str(function.get("function_name", "")).lower()
        return f"table function {name}" if _FILE_READING_FUNCTION.fullmatch(name) else None
    if kind == "BASE_TABLE" and _FILE_LIKE_NAME.search(str(node.get("table_name", ""))):
        return "a relation named like a file"
    return None


def _server_config_read(node: dict[str, object]) -> str | None:
    """The function (scalar or table: both are FUNCTION nodes) or catalog view a node names that shows
    the server's configuration, or None."""
    if node.get("class") == "FUNCTION":
        name = str(node.get("function_name", "")).lower()
        return f"the function {name}()" if _SERVER_CONFIG_FUNCTION.fullmatch(name) else None
    if node.get("type") == "BASE_TABLE":
        name = str(node.get("table_name", "")).lower()
        return f"the catalog view {name}" if _SERVER_CONFIG_VIEW.fullmatch(name) else None
    return None


def materialize_statement(cursor: duckdb.DuckDBPyConnection, step: GatedStep) -> str:
    """The statement that stores a gated step's result as a private TEMP table named after the step.

    The wrapper adds only a prefix and a newline, so a trailing comment in the user SQL cannot
    swallow anything; the result is parsed again to prove it is still one CREATE statement.
    """
    wrapped = f'CREATE TEMP TABLE "{step.name}" AS\n{step.sql}\n'
    statements = cursor.extract_statements(wrapped)
    if len(statements) != 1 or statements[0].type != duckdb.StatementType.CREATE:
        raise InputError(f"step {step.name!r}: the SQL cannot be used as a step result")
    return wrapped


def string_literal(text: str) -> str:
    """text as a DuckDB string literal (single quotes doubled; NUL refused)."""
    if "\x00" in text:
        raise InputError("a source path or option contains a NUL character")
    return "'" + text.replace("'", "''") + "'"


# Lines of DuckDB messages that quote input (a CSV line, the SQL, the file and its sniffed
# options) or only give advice; an error shown to a user keeps the reason and drops these.
_QUOTING_LINE = re.compile(r"^\s*(Original Line|LINE \d+|Possible Solution|file\s*=|\^)")


# Errors raised by data values (not by the SQL): their quoted spans are values, withheld unless they
# name a column or a type, and only their first line is kept (later lines echo the input).
_DATA_ERRORS = ("Conversion Error", "Invalid Input Error", "Out of Range Error")
_QUOTED = re.compile(r"""(?P<before>\b(?:column|to)\s+)?(?P<quote>["'])(?P<text>[^"']*)(?P=quote)""")
WITHHELD = "(value withheld)"


def _withhold(match: re.Match[str]) -> str:
    return match.group(0) if match.group("before") else WITHHELD


# An absolute path in a message (a spill folder, a home folder): the server's, never shown.
_ABSOLUTE_PATH = re.compile(r"""(?<![\w.:/])/[A-Za-z0-9_.~-][^\s"',;)]*""")
PATH_WITHHELD = "(path withheld)"


def _data_error_message(first: str, lines: list[str]) -> str:
    """The first line (and a CSV error's column line) with values withheld; a message that is not
    quoted at all (``error(x)``, a regex that does not compile) keeps only its class."""
    kind, _, detail = first.partition(": ")
    if detail.startswith("CSV Error"):  # the reason follows on its own lines; the input lines are dropped
        return " ".join(_QUOTED.sub(_withhold, line) for line in _reason_lines(lines))
    if not _QUOTED.search(detail):
        return f"{kind}: (detail withheld: it may quote a value)"
    return _QUOTED.sub(_withhold, first)


def _reason_lines(lines: list[str]) -> list[str]:
    """The lines before the first blank one, without those that quote input or give advice."""
    kept: list[str] = []
    for line in lines:
        if not line:
            if kept:
                break  # DuckDB puts the quoted context after the first blank line
            continue
        if not _QUOTING_LINE.match(line):
            kept.append(line)
    return kept


def engine_message(exc: BaseException, chars_max: int = 300, own_text: str = "") -> str:
    """The reason of an engine error in one line, without the lines that quote file contents or SQL.

    A data error's quoted values are withheld (``Could not convert string (value withheld) to
    'INTEGER'``): a conversion error would otherwise put a value into the run's stored message. In
    other errors (binder, catalog) a quoted name is kept only when it is part of ``own_text`` (the
    definition's SQL and names, which its author wrote): a source's column names, read from a file
    header, are file contents. Absolute paths are always withheld."""
    lines = [line.strip() for line in str(exc).splitlines()]
    first = next((line for line in lines if line), "")
    if first.startswith(_DATA_ERRORS):
        return _ABSOLUTE_PATH.sub(PATH_WITHHELD, _data_error_message(first, lines))[:chars_max]
    kept = [_QUOTED.sub(lambda m: m.group(0) if m.group("text") in own_text else WITHHELD, line)
            for line in _reason_lines(lines)]  # fmt: skip
    return _ABSOLUTE_PATH.sub(PATH_WITHHELD, " ".join(kept) or type(exc).__name__)[:chars_max]


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
