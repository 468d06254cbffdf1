"""Declared source types, enforced: every declared column reaches the steps as its declared type.

A step cannot choose another type for a declared column, whatever it does with it (docs/engines.md):

* a CSV is parsed by the reader with the declared types. DuckDB's ``type_pushdown`` optimizer, which
  would let a step's cast (``n::varchar``) or a set operation replace the reader's type, is disabled
  in every confined database (``sandbox.open_confined``); Spark's CSV reader reads declared columns as
  text, converted by a checked cast below;
* a Parquet source (both engines) and a CSV on Spark are bound through a projection that converts
  each declared column whose stored type differs with a *checked cast*: text must parse as the
  declared type, a typed value must convert exactly (it casts back to the value it was). A value that
  does not raises an engine error carrying a marker, which the engine maps to ``InputError`` naming
  the source and the column, never the value;
* a PostgreSQL source's batches are cast with Arrow's safe casts as they stream (``postgres_source``).

A column the step never reads is not parsed (the readers skip it), so it cannot reach a result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from durable_dataflow.core.errors import InputError

# The text of the engine error a failed checked cast raises: MARKER followed by the check's number.
MARKER = "dataflow-declared-type-check-"
_MARKED = re.compile(re.escape(MARKER) + r"(\d+)")
# DuckDB's CSV reader names the declared column it could not convert, and the file, on lines of their own.
_CSV_COLUMN = re.compile(r'Error when converting column "(?P<column>.*)"\. Could not convert')
_CSV_FILE = re.compile(r"^\s*file = (?P<path>.+?)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class TypeCheck:
    """One declared column of one source, converted by a checked cast or parsed by a reader."""

    source: str
    column: str
    declared: str  # the declared type name, as written in the definition

    def error(self) -> InputError:
        return InputError(
            f"source {self.source!r}: column {self.column!r} holds a value that is not of its declared type "
            f"{self.declared} (it does not parse, or does not convert exactly); nothing was published"
        )


@dataclass
class TypeChecks:
    """The checks of one execution: numbered checked casts, and the CSV files read with declared types."""

    casts: list[TypeCheck] = field(default_factory=list)
    csv_files: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)  # path: (source, declared)

    def add(self, source: str, column: str, declared: str) -> str:
        """The marker text of a new check."""
        self.casts.append(TypeCheck(source, column, declared))
        return f"{MARKER}{len(self.casts) - 1}"

    def failure(self, raw: str) -> InputError | None:
        """The InputError for an engine message that reports a declared column's value, else None."""
        marked = _MARKED.search(raw)
        if marked is not None and int(marked.group(1)) < len(self.casts):
            return self.casts[int(marked.group(1))].error()
        converting = _CSV_COLUMN.search(raw)
        if converting is None:
            return None
        column = converting.group("column")
        named = _CSV_FILE.search(raw)
        candidates = [self.csv_files[named.group("path")]] if named and named.group("path") in self.csv_files \
            else list(self.csv_files.values())
        found = [(source, declared) for source, declared in candidates if column in declared]
        if len(found) != 1:
            return None  # an undeclared (sniffed) column, or one no file can be told apart by
        source, declared = found[0]
        return TypeCheck(source, column, declared[column]).error()


def duckdb_checked_cast(column_sql: str, stored: str, declared: str, marker: str) -> str:
    """A DuckDB expression: column_sql (of DuckDB type ``stored``) as ``declared``, or the marked error.

    Text must parse; any other type must convert exactly: the converted value cast back to the stored
    type must be the value it was (a double 1.5 is no bigint, a timestamp with a time of day no date)."""
    fail = f"error('{marker}')"
    value = f"TRY_CAST({column_sql} AS {declared})"
    exact = "" if stored == "VARCHAR" else f" WHEN CAST({value} AS {stored}) IS DISTINCT FROM {column_sql} THEN {fail}"
    return f"CASE WHEN {column_sql} IS NULL THEN NULL WHEN {value} IS NULL THEN {fail}{exact} ELSE {value} END"


def spark_checked_cast(column_sql: str, stored: str, declared: str, marker: str) -> str:
    """The same checked cast in Spark SQL (``stored`` and ``declared`` as Spark's simpleString)."""
    fail = f"raise_error('{marker}')"
    value = f"try_cast({column_sql} AS {declared})"
    exact = "" if stored == "string" else f" WHEN NOT (CAST({value} AS {stored}) <=> {column_sql}) THEN {fail}"
    return f"CASE WHEN {column_sql} IS NULL THEN NULL WHEN {value} IS NULL THEN {fail}{exact} ELSE {value} END"
