"""The DuckDB sandbox for user SQL (reference §3).

One in-memory DuckDB database per process and per (memory_limit, threads) pair, opened lazily:
opening one costs ~17 ms, a cursor on it ~1.3 ms. It is configured with external access,
extension loading and Python replacement scans off and then locked, so no user statement can
change a setting. Settings are global to a database and cannot change once locked; that is why
limits are per database rather than per execution, and a process that needs other limits gets
another database (at most SANDBOX_DATABASES_MAX of them; each has its own memory limit).

Each execution works in its own cursor. A DuckDB cursor is a separate connection: views that
`register()` creates and TEMP tables are private to it (verified by
tests/unit/test_sandbox.py), so concurrent executions in worker threads cannot see each other's
sources or step results even when they use the same names.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import duckdb

from durable_dataflow.core.errors import InputError

if TYPE_CHECKING:
    from durable_dataflow.dataflow.execution import ExecutionLimits

SANDBOX_DATABASES_MAX = 8

_BASE_CONFIG: dict[str, str | bool] = {
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "allow_community_extensions": False,
    "allow_unsigned_extensions": False,
    "python_enable_replacements": False,  # no implicit scans of the caller's Python variables
    # The default '.tmp' would be silently allow-listed once external access is off (reference §3);
    # with no temp directory nothing spills to disk and memory_limit is a hard bound.
    "temp_directory": "",
}

_databases: dict[tuple[str, int], duckdb.DuckDBPyConnection] = {}
_databases_lock = threading.Lock()


@dataclass(frozen=True)
class GatedStep:
    """A step whose SQL passed the gate, with the named parameters it uses."""

    name: str
    sql: str
    parameter_names: frozenset[str]


def _open_database(memory_limit: str, threads: int) -> duckdb.DuckDBPyConnection:
    config: dict[str, str | bool | int | float | list[str]] = {
        **_BASE_CONFIG, "memory_limit": memory_limit, "threads": threads
    }
    database = duckdb.connect(":memory:", config=config)
    # Order matters: external access off first, then freeze every setting including that one.
    database.execute("SET enable_external_access = false")
    database.execute("SET lock_configuration = true")
    return database


def open_cursor(limits: ExecutionLimits) -> duckdb.DuckDBPyConnection:
    """A private connection on the shared sandbox database for these limits; close it when done."""
    key = (limits.memory_limit, limits.threads)
    with _databases_lock:
        database = _databases.get(key)
        if database is None:
            if len(_databases) >= SANDBOX_DATABASES_MAX:
                raise InputError(
                    f"more than {SANDBOX_DATABASES_MAX} different sandbox limits in one process: "
                    "use one memory_limit and thread count per worker"
                )
            database = _open_database(limits.memory_limit, limits.threads)
            _databases[key] = database
        # cursor() on the parent is not safe to call concurrently, so it stays under the lock.
        return database.cursor()


def gate_step(cursor: duckdb.DuckDBPyConnection, step_name: str, sql: str) -> GatedStep:
    """Admit exactly one SELECT (which includes WITH … SELECT); refuse everything else before it runs."""
    try:
        statements = cursor.extract_statements(sql)
    except duckdb.Error as exc:
        raise InputError(f"step {step_name!r}: the SQL does not parse: {_first_line(exc)}") from None
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


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
