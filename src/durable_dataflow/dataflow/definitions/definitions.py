"""Dataflow definitions: the YAML/JSON document, its pydantic models and its canonical body.

A definition names typed parameters, sources, ordered SQL steps, a declared output schema with
bounds, an optional publication target (DESIGN §8) and optional execution limits that may only
narrow the platform's (``dataflow.execution.limits.effective``). The canonical body is what gets hashed
and pinned: ``Definition.model_validate(canonical_body(d)) == d`` always holds, so a run can
re-execute exactly the body it recorded.

Documents never hold credentials: a DSN or a password is a ``{secret: NAME}`` reference that is
resolved in memory at execution time (``core.secrets``).
"""

from __future__ import annotations

import json
import math
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import pyarrow as pa
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from durable_dataflow.core import hashing, strictjson
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.files import read_capped
from durable_dataflow.core.secrets import SECRET_NAME_PATTERN
from durable_dataflow.core.units import OUTPUT_BYTES_CEILING as OUTPUT_BYTES_CEILING
from durable_dataflow.core.units import THREADS_CEILING as THREADS_CEILING
from durable_dataflow.core.units import TIME_LIMIT_S_CEILING as TIME_LIMIT_S_CEILING
from durable_dataflow.core.units import parse_duration as parse_duration
from durable_dataflow.core.units import parse_size as parse_size
from durable_dataflow.dataflow.definitions import parameters as parameters_mod
from durable_dataflow.dataflow.definitions.schedule_spec import ScheduleSpec
from durable_dataflow.datasources import objectstore
from durable_dataflow.datasources.contract import is_credential_option

IDENTIFIER_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,62}$"
DEFINITION_BYTES_MAX = 1024 * 1024
VERSION_MAX = 2**31 - 1
PARAMETERS_MAX = 64
SOURCES_MAX = 64
STEPS_MAX = 64
STEP_SQL_CHARS_MAX = 100_000
OUTPUT_COLUMNS_MAX = 1024
INLINE_ROWS_MAX = 10_000
JSON_INT_MAX = 2**53 - 1
# Nesting of option and inline values: deep enough for any real document, far below serialisers' limits.
JSON_NESTING_MAX = 32
ERRORS_SHOWN_MAX = 10


# A CSV delimiter: one printable ASCII character or a tab, never the quote character.
_DELIMITER_CHARS = frozenset(chr(code) for code in range(0x20, 0x7F)) - {'"'} | {"\t"}
_DECIMAL_TYPE_PATTERN = re.compile(r"^decimal(?:128)?\(\s*(\d+)\s*,\s*(\d+)\s*\)$")
_TIMESTAMP_TYPE_PATTERN = re.compile(r"^timestamp(?:\[\s*(s|ms|us|ns)\s*(?:,\s*tz\s*=\s*([A-Za-z0-9_/+:-]+)\s*)?\])?$")
_SIMPLE_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(), "utf8": pa.string(), "large_string": pa.large_string(),
    "binary": pa.binary(), "large_binary": pa.large_binary(),
    "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
    "uint8": pa.uint8(), "uint16": pa.uint16(), "uint32": pa.uint32(), "uint64": pa.uint64(),
    "float32": pa.float32(), "float64": pa.float64(), "double": pa.float64(),
    "bool": pa.bool_(), "boolean": pa.bool_(), "date": pa.date32(), "date32": pa.date32(),
}
DECIMAL_PRECISION_MAX = 38


def parse_arrow_type(name: str) -> pa.DataType:
    """The Arrow type for a declared type name; ValueError with the accepted names otherwise."""
    text = name.strip()
    simple = _SIMPLE_TYPES.get(text)
    if simple is not None:
        return simple
    decimal = _DECIMAL_TYPE_PATTERN.match(text)
    if decimal:
        precision, scale = int(decimal.group(1)), int(decimal.group(2))
        if not 1 <= precision <= DECIMAL_PRECISION_MAX or scale > precision:
            raise ValueError("decimal(p,s) needs 1 <= precision p <= 38 and scale s <= precision")
        return pa.decimal128(precision, scale)
    timestamp = _TIMESTAMP_TYPE_PATTERN.match(text)
    if timestamp:
        return pa.timestamp(timestamp.group(1) or "us", tz=timestamp.group(2))
    raise ValueError(
        "unknown type: use string, int8..int64, uint8..uint64, float32, float64, bool, date, "
        "timestamp, timestamp[us], timestamp[us, tz=UTC] or decimal(p,s)"
    )


def _check_json_value(value: Any, where: str) -> None:
    """Refuse values that canonical JSON (RFC 8785) cannot hold exactly, or nested deeper than
    JSON_NESTING_MAX (serialising the definition would fail on them)."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:  # an explicit stack, not recursion (STYLE)
        item, depth = pending.pop()
        if depth > JSON_NESTING_MAX:
            raise ValueError(f"{where}: values are nested more than {JSON_NESTING_MAX} levels deep")
        if isinstance(item, bool) or item is None or isinstance(item, str):
            continue
        if isinstance(item, int):
            if abs(item) > JSON_INT_MAX:
                raise ValueError(f"{where}: an integer is outside +/-(2**53-1); write it as a string")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"{where}: NaN and infinity are not allowed")
        elif isinstance(item, dict):
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
        else:
            raise ValueError(f"{where}: a value of type {type(item).__name__} is not JSON")


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )


Identifier = Annotated[str, Field(pattern=IDENTIFIER_PATTERN)]
ParameterType = Literal["string", "int", "float", "bool", "date", "timestamp", "decimal"]


def ordered_columns(value: Any) -> Any:
    """Accept a column map also as a list of [name, type] pairs: the pinned form keeps the order.

    RFC 8785 sorts object keys, so the canonical body writes ordered column maps as pairs; a
    document may use either form.
    """
    if isinstance(value, list) and all(isinstance(p, list | tuple) and len(p) == 2 for p in value):
        names = [str(p[0]) for p in value]
        if len(set(names)) != len(names):
            raise ValueError("a column name is declared twice")
        return {str(name): type_name for name, type_name in value}
    return value


def _check_type_map(columns: dict[str, str]) -> dict[str, str]:
    for column, type_name in columns.items():
        if not column:
            raise ValueError("a column name must not be empty")
        try:
            parse_arrow_type(type_name)
        except ValueError as exc:
            raise ValueError(f"column {column!r}: {exc}") from None
    return columns


def arrow_schema_of(columns: dict[str, str]) -> pa.Schema:
    """An all-nullable Arrow schema for a validated column -> type-name map, in order."""
    return pa.schema([pa.field(name, parse_arrow_type(t), nullable=True) for name, t in columns.items()])


class ParameterSpec(_Model):
    """A typed parameter. Without a default it is required; a default is stored in canonical form."""

    type: ParameterType
    default: str | int | float | bool | None = None
    description: str = ""

    @model_validator(mode="after")
    def _canonical_default(self) -> ParameterSpec:
        if self.default is None:
            return self
        try:
            canonical = parameters_mod.coerce(self.type, self.default)
        except parameters_mod.ParameterValueError as exc:
            raise ValueError(f"the default is not a valid {self.type}: {exc}") from None
        object.__setattr__(self, "default", canonical)
        return self


class SecretRef(_Model):
    """A reference to a secret by name, resolved in memory only when the value is needed."""

    secret: str = Field(pattern=SECRET_NAME_PATTERN.pattern)



def _optional_type_map(value: dict[str, str] | None) -> dict[str, str] | None:
    """An optional source schema: checked like a required one when given."""
    return None if value is None else _check_type_map(value)


# Glob characters of an s3:// Parquet path: `*` and `[...]` match within one key segment. Braces (an
# alternation) are refused; `?` cannot be in an s3:// URL (objectstore.parse_url).
STORE_GLOB_CHARACTERS = re.compile(r"[*\[\]]")
_STORE_BRACES = re.compile(r"[{}]")


def _check_store_path(path: str, options: dict[str, Any] | None, kind: str, globs: bool) -> None:
    """A file source's path and its store options: an s3:// path is a plain s3 URL (a glob only where
    ``globs``) with valid store options; a local path takes no options. Messages never quote the path or
    an option's value (either may carry what the author did not mean to show)."""
    if not objectstore.is_store_url(path):
        if options is not None:
            raise ValueError("options are object-store options: give them only with an s3:// path")
        return
    try:
        url = objectstore.parse_url(path, "path")
        objectstore.check_options(options or {}, "options")
    except InputError as error:
        raise ValueError(error.message) from None
    if _STORE_BRACES.search(url.key):
        raise ValueError("path: an s3:// path must not contain '{' or '}'")
    if STORE_GLOB_CHARACTERS.search(url.key) and not globs:
        raise ValueError(f"path: a {kind} source on s3:// names one object or table, not a glob")
    for name, value in (options or {}).items():
        if isinstance(value, dict) and set(value) == {"secret"} and not (
            isinstance(value["secret"], str) and SECRET_NAME_PATTERN.fullmatch(value["secret"])
        ):
            raise ValueError(f"options: option {name!r}: the secret name is not valid")

class CsvSource(_Model):
    """A CSV file (or an s3:// object); `schema` fixes column types (others are inferred)."""

    kind: Literal["csv"]
    path: str = Field(min_length=1)
    delimiter: str = Field(default=",", min_length=1, max_length=1)
    header: bool = True
    columns: dict[str, str] | None = Field(default=None, alias="schema")
    options: dict[str, Any] | None = None  # object-store options, with an s3:// path only

    _ordered = field_validator("columns", mode="before")(ordered_columns)

    @model_validator(mode="after")
    def _store(self) -> CsvSource:
        _check_store_path(self.path, self.options, "csv", globs=False)
        if objectstore.is_store_url(self.path) and not self.header and not self.columns:
            raise ValueError("a csv object on s3:// without a header line needs a schema naming its columns")
        return self

    @field_validator("delimiter")
    @classmethod
    def _delimiter(cls, value: str) -> str:
        if value in _DELIMITER_CHARS:
            return value
        raise ValueError("the delimiter is not allowed: use one printable ASCII character other than '\"', or a tab")

    _types = field_validator("columns")(_optional_type_map)


class ParquetSource(_Model):
    """A Parquet file, or a folder whose *.parquet files are read in sorted name order; `schema` fixes
    column types (a declared column whose stored type differs is converted exactly, or the run fails)."""

    kind: Literal["parquet"]
    path: str = Field(min_length=1)
    columns: dict[str, str] | None = Field(default=None, alias="schema")
    options: dict[str, Any] | None = None  # object-store options, with an s3:// path only

    _ordered = field_validator("columns", mode="before")(ordered_columns)

    _types = field_validator("columns")(_optional_type_map)

    @model_validator(mode="after")
    def _store(self) -> ParquetSource:
        _check_store_path(self.path, self.options, "parquet", globs=True)
        return self


class InlineSource(_Model):
    """Rows written in the definition itself, typed by a required schema."""

    kind: Literal["inline"]
    rows: list[dict[str, Any]] = Field(max_length=INLINE_ROWS_MAX)
    columns: dict[str, str] = Field(alias="schema", min_length=1)

    _ordered = field_validator("columns", mode="before")(ordered_columns)

    @field_validator("columns")
    @classmethod
    def _types(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_type_map(value)

    @model_validator(mode="after")
    def _rows_match_schema(self) -> InlineSource:
        for index, row in enumerate(self.rows):
            unknown = sorted(set(row) - set(self.columns))
            if unknown:
                raise ValueError(f"row {index} has columns {unknown} that the schema does not declare")
            _check_json_value(row, f"row {index}")
        return self


class PostgresSource(_Model):
    """The result of one read-only query against PostgreSQL; the DSN is a secret reference."""

    kind: Literal["postgres"]
    dsn: SecretRef
    query: str = Field(min_length=1, max_length=STEP_SQL_CHARS_MAX)
    # Declared result column types: a declared column whose PostgreSQL type differs is converted exactly.
    columns: dict[str, str] | None = Field(default=None, alias="schema")

    _ordered = field_validator("columns", mode="before")(ordered_columns)

    _types = field_validator("columns")(_optional_type_map)

    @field_validator("dsn", mode="before")
    @classmethod
    def _no_plain_dsn(cls, value: Any) -> Any:
        # The message must not echo the value: a plain DSN usually carries a password.
        if isinstance(value, str):
            raise ValueError(
                "a DSN must not be written in the definition; use a secret reference {secret: NAME} "
                "and set NAME in the environment or in DATAFLOW_SECRETS_DIR"
            )
        return value


class DeltaSource(_Model):
    """A Delta table, at a pinned version or at its latest version when `version` is absent."""

    kind: Literal["delta"]
    path: str = Field(min_length=1)
    version: int | None = Field(default=None, ge=0, le=JSON_INT_MAX)
    options: dict[str, Any] | None = None  # object-store options, with an s3:// path only

    @model_validator(mode="after")
    def _store(self) -> DeltaSource:
        _check_store_path(self.path, self.options, "delta", globs=False)
        return self


SOURCE_KINDS = ("csv", "parquet", "inline", "postgres", "delta")
SourceSpec = Annotated[
    CsvSource | ParquetSource | InlineSource | PostgresSource | DeltaSource, Field(discriminator="kind")
]


class StepSpec(_Model):
    """One SQL SELECT; its result is visible to later steps under `name`."""

    name: Identifier
    sql: str = Field(min_length=1, max_length=STEP_SQL_CHARS_MAX)


class OutputSpec(_Model):
    """The declared result: ordered Arrow columns (document key `schema`) and its bounds."""

    columns: dict[str, str] = Field(alias="schema", min_length=1, max_length=OUTPUT_COLUMNS_MAX)
    max_rows: int = Field(ge=1, le=JSON_INT_MAX)
    max_bytes: int | str

    _ordered = field_validator("columns", mode="before")(ordered_columns)

    @field_validator("columns")
    @classmethod
    def _types(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_type_map(value)

    @field_validator("max_bytes")
    @classmethod
    def _size(cls, value: int | str) -> int | str:
        size = parse_size(value)
        if not 1 <= size <= OUTPUT_BYTES_CEILING:
            raise ValueError(
                f"max_bytes must be between 1 byte and {OUTPUT_BYTES_CEILING} bytes (1 GiB), the most any "
                "platform stores (a platform's result_bytes_max may allow less)"
            )
        return value

    @property
    def max_bytes_int(self) -> int:
        """max_bytes in bytes."""
        return parse_size(self.max_bytes)

    def arrow_schema(self) -> pa.Schema:
        """The declared schema; every column is nullable."""
        return arrow_schema_of(self.columns)


# A partition value written "$name" is the run's value of parameter `name`; any other is a literal.
PARAMETER_REFERENCE = "$"
PARTITION_COLUMNS_MAX = 8


def _partition_kind(dtype: pa.DataType) -> str | None:
    """The parameter type whose values a partition column of this Arrow type holds (one canonical JSON
    form per value, so a partition has one digest whoever names it), or None (float: no exact equality)."""
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return "string"
    if pa.types.is_integer(dtype):
        return "int"
    if pa.types.is_boolean(dtype):
        return "bool"
    if pa.types.is_date(dtype):
        return "date"
    if pa.types.is_timestamp(dtype):
        return "timestamp"
    if pa.types.is_decimal(dtype):
        return "decimal"
    return None


def partition_column_kind(d: Definition, column: str) -> str | None:
    """The parameter type (``date``, ``int``, ``string``, …) whose canonical values a partition column of
    ``d``'s output holds, or None when the output has no such column or its type has no exact equality."""
    declared = d.output.columns.get(column)
    return _partition_kind(parse_arrow_type(declared)) if declared is not None else None


def _canonical_literal(kind: str, value: Any) -> bool:
    """Whether a partition literal is a value of `kind` in the canonical form its parameter would have."""
    if isinstance(value, bool) != (kind == "bool"):
        return False
    try:
        canonical = parameters_mod.coerce(kind, value)
    except parameters_mod.ParameterValueError:
        return False
    return bool(canonical == value and type(canonical) is type(value))


class TargetSpec(_Model):
    """Where a published run's result goes (forward-recovery mode)."""

    type: Literal["datasources.publication"]
    provider: str = Field(min_length=1, max_length=200)
    datasource: str = Field(min_length=1, max_length=200)
    location: str = Field(min_length=1, max_length=2000)
    mode: Literal["append", "overwrite", "replace_partition"] = "append"
    # With mode replace_partition (and only then): column -> "$parameter" or a JSON scalar literal.
    partition: dict[str, str | int | float | bool] | None = Field(
        default=None, min_length=1, max_length=PARTITION_COLUMNS_MAX
    )
    options: dict[str, SecretRef | str | int | float | bool | list[Any] | dict[str, Any] | None] = {}

    @model_validator(mode="after")
    def _partition_with_its_mode(self) -> TargetSpec:
        if self.mode == "replace_partition" and self.partition is None:
            raise ValueError("mode replace_partition needs a partition: {column: $parameter or a value}")
        if self.mode != "replace_partition" and self.partition is not None:
            raise ValueError("a partition is given only with mode replace_partition")
        for column, value in (self.partition or {}).items():
            _check_json_value(value, f"partition column {column!r}")
        return self

    def recorded(self) -> dict[str, Any]:
        """The target as a run records it (and its request hash covers): without a partition, exactly
        the dict recorded before partitions existed."""
        body: dict[str, Any] = self.model_dump(mode="json")
        if self.partition is None:
            del body["partition"]
        return body

    def partition_parameters(self) -> dict[str, str]:
        """The partition columns given as a parameter reference, each with the parameter's name."""
        return {
            column: value[1:]
            for column, value in (self.partition or {}).items()
            if isinstance(value, str) and value.startswith(PARAMETER_REFERENCE)
        }

    @field_validator("options", mode="before")
    @classmethod
    def _secret_refs(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        options: dict[Any, Any] = {}
        for key, item in value.items():
            # Option keys that name a credential must hold a secret reference, never the value itself.
            if isinstance(item, str) and is_credential_option(str(key)):
                raise ValueError(f"option {key!r} looks like a credential: use a secret reference {{secret: NAME}}")
            if isinstance(item, dict) and set(item) == {"secret"}:
                # Built here so the union below cannot mistake the reference for a plain mapping.
                try:
                    options[key] = SecretRef.model_validate(item)
                except ValidationError:
                    raise ValueError(f"option {key!r}: the secret name is not valid") from None
            else:
                _check_json_value(item, f"option {key!r}")
                options[key] = item
        return options


def _no_bool(value: Any) -> Any:
    # YAML `true` would pass as the number 1; a limit is never a yes/no answer.
    if isinstance(value, bool):
        raise ValueError("must be a number or a string, not true/false")
    return value


class DefinitionLimits(_Model):
    """Execution limits a definition asks for; each may only be lower than the platform's.

    Values stay as written (like ``output.max_bytes``), so the pinned body reads as its author wrote
    it. ``dataflow.execution.limits.effective`` narrows the platform's limits by ``requested()`` and refuses a
    request above the platform's ceiling.
    """

    time_limit: int | float | str | None = None  # seconds, or a duration such as "90s", "10m", "2h"
    memory: int | str | None = None  # a size such as "2GiB"
    threads: int | None = Field(default=None, ge=1, le=THREADS_CEILING)
    source_bytes_max: int | str | None = None  # a size: the bytes one source may read

    _not_bool = field_validator("time_limit", "memory", "threads", "source_bytes_max", mode="before")(_no_bool)

    @field_validator("time_limit")
    @classmethod
    def _duration(cls, value: int | float | str | None) -> int | float | str | None:
        if value is not None and not 0 < parse_duration(value) <= TIME_LIMIT_S_CEILING:
            raise ValueError(f"time_limit must be more than 0 and at most {TIME_LIMIT_S_CEILING:.0f} seconds (7 days)")
        return value

    @field_validator("memory", "source_bytes_max")
    @classmethod
    def _size(cls, value: int | str | None) -> int | str | None:
        if value is not None and not 1 <= parse_size(value) <= JSON_INT_MAX:
            raise ValueError(f"a size must be between 1 byte and {JSON_INT_MAX} bytes")
        return value

    def requested(self) -> dict[str, int | float]:
        """What is asked, in seconds and bytes, keyed by the ExecutionLimits field it narrows."""
        asked: dict[str, int | float] = {}
        if self.time_limit is not None:
            asked["time_limit_s"] = parse_duration(self.time_limit)
        if self.memory is not None:
            asked["memory_bytes_max"] = parse_size(self.memory)
        if self.threads is not None:
            asked["threads"] = self.threads
        if self.source_bytes_max is not None:
            asked["source_bytes_max"] = parse_size(self.source_bytes_max)
        return asked


class Definition(_Model):
    """A whole dataflow definition document."""

    name: Identifier
    version: int = Field(ge=1, le=VERSION_MAX)
    description: str = ""
    # Where the steps run (docs/engines.md): DuckDB on this machine, or Apache Spark (the spark extra).
    engine: Literal["duckdb", "spark"] = "duckdb"
    parameters: dict[Identifier, ParameterSpec] = Field(default={}, max_length=PARAMETERS_MAX)
    sources: dict[Identifier, SourceSpec] = Field(max_length=SOURCES_MAX)
    steps: list[StepSpec] = Field(min_length=1, max_length=STEPS_MAX)
    output: OutputSpec
    limits: DefinitionLimits | None = None
    target: TargetSpec | None = None
    schedule: ScheduleSpec | None = None  # dataflow.definitions.schedule_spec, docs/schedules.md

    @field_validator("limits")
    @classmethod
    def _empty_limits_ask_nothing(cls, value: DefinitionLimits | None) -> DefinitionLimits | None:
        # `limits: {}` asks for nothing, so it is the same definition (and hash) as no block at all.
        return None if value is None or not value.requested() else value

    @model_validator(mode="after")
    def _unique_names(self) -> Definition:
        seen: set[str] = set()
        for index, step in enumerate(self.steps):
            if step.name in self.sources:
                raise ValueError(f"steps[{index}].name is the same name as a source's")
            if step.name in seen:
                raise ValueError(f"steps[{index}].name is the name of an earlier step")
            seen.add(step.name)
        return self

    @model_validator(mode="after")
    def _partition_fits(self) -> Definition:
        if self.target is None or self.target.partition is None:
            return self
        for column in self.target.partition:
            if column not in self.output.columns:
                raise ValueError(f"target.partition column {column!r} is not in output.schema")
        references = self.target.partition_parameters()
        for column, value in self.target.partition.items():
            kind = _partition_kind(parse_arrow_type(self.output.columns[column]))
            if kind is None:
                raise ValueError(
                    f"target.partition column {column!r}: a partition column is a string, integer, boolean, date, "
                    "timestamp or decimal column"
                )
            if column in references:
                name = references[column]
                if name not in self.parameters:
                    raise ValueError(f"target.partition column {column!r} names an undeclared parameter {name!r}")
                if self.parameters[name].type != kind:
                    raise ValueError(
                        f"target.partition column {column!r} is a {kind} column: parameter {name!r} must be "
                        f"declared {kind}"
                    )
            elif not _canonical_literal(kind, value):
                raise ValueError(
                    f"target.partition column {column!r} is a {kind} column: its literal must be a {kind} "
                    "in canonical form"
                )
        return self

    @model_validator(mode="after")
    def _schedule_fits_parameters(self) -> Definition:
        if self.schedule is not None:
            try:
                self.schedule.check_parameters(self.parameters)
            except ValueError as error:
                raise ValueError(f"schedule: {error}") from None
        return self


@dataclass(frozen=True)
class LoadedDefinition:
    """A definition with the file it came from; relative source paths resolve against base_dir."""

    definition: Definition
    path: Path
    base_dir: Path


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without implicit dates, anchors/aliases or duplicate keys.

    Dates stay strings so the document stays JSON; aliases are refused because they can expand a
    small file into a huge document; duplicate keys are refused because PyYAML keeps the last one
    silently, which hides mistakes such as two sources with one name.
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(None, None, "anchors and aliases are not allowed", event.start_mark)
        return super().compose_node(parent, index)

    def construct_document(self, node: Any) -> Any:
        _refuse_duplicate_keys(self, node)
        return super().construct_document(node)


def _refuse_duplicate_keys(loader: yaml.SafeLoader, root: yaml.Node) -> None:
    """Refuse a mapping holding one key twice, naming the key's path and line (never a value)."""
    pending: list[tuple[yaml.Node, list[str | int]]] = [(root, [])]
    while pending:  # an explicit stack, not recursion (STYLE)
        node, path = pending.pop()
        if isinstance(node, yaml.SequenceNode):
            pending.extend((child, [*path, index]) for index, child in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, value_node in node.value:
                # Keys are compared as constructed (`1` and `0x1` are one key); a mapping as a key is
                # left to the constructor, which refuses it as unhashable.
                key = loader.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else object()
                key_path: list[str | int] = [*path, str(key)]
                if key in seen:
                    where = strictjson.path_text(key_path)
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {where}", key_node.start_mark)
                seen.add(key)
                pending.append((value_node, key_path))


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _parse_document(text: str, origin: str) -> Any:
    try:
        return _parse_text(text, origin)
    except RecursionError:
        raise InputError(f"{origin}: the document nests too deeply") from None
    except ValueError:  # a constructor's refusal: an integer over Python's 4300 digits, a bad YAML date
        raise InputError(f"{origin}: a value cannot be read (a number over 4300 digits, or an invalid date)") from None


def parse_yaml_document(text: str, origin: str) -> Any:
    """Any YAML document (an API request body, say) read with the definitions' strict loader: no anchors or
    aliases, no implicit dates, no duplicate keys, at most DEFINITION_BYTES_MAX bytes. An InputError names
    ``origin`` and the line and column of a syntax error, never a value. ``origin`` must not end in .json
    (that is read as JSON)."""
    return _parse_document(text, origin)


def _parse_text(text: str, origin: str) -> Any:
    if len(text.encode("utf-8")) > DEFINITION_BYTES_MAX:
        raise InputError(f"{origin}: the definition is larger than {DEFINITION_BYTES_MAX} bytes")
    if origin.lower().endswith(".json"):
        try:
            return strictjson.loads(text)
        except strictjson.DuplicateKey as exc:
            raise InputError(f"{origin}: invalid JSON: {exc}") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"{origin}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise InputError(f"{origin}: malformed YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{origin}: malformed YAML: {exc}") from None


def _document_path(loc: tuple[int | str, ...]) -> list[int | str]:
    # Pydantic puts the discriminator tag after the source name: sources.orders.csv.path.
    tag_index = 2 if loc and loc[0] == "sources" and len(loc) > 2 and loc[2] in SOURCE_KINDS else None
    return [item for index, item in enumerate(loc) if index != tag_index]


def _error_path(loc: tuple[int | str, ...]) -> str:
    return strictjson.path_text(_document_path(loc))


def _node_at(root: yaml.Node, path: list[int | str]) -> yaml.Node:
    """The deepest node of the document along ``path``: the field itself, or the mapping that lacks it."""
    node = root
    for item in path:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(item)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(item, int) and 0 <= item < len(node.value):
            child = node.value[item]
        if child is None:
            break
        node = child
    return node


def _where(root: yaml.Node | None, loc: tuple[int | str, ...]) -> str:
    """`` (line L, column C)`` of the field an error names (or of the mapping that lacks it), or "" without
    a document tree."""
    if root is None:
        return ""
    mark = _node_at(root, _document_path(loc)).start_mark
    return f" (line {mark.line + 1}, column {mark.column + 1})"


def _compose(text: str) -> yaml.Node | None:
    """The document's node tree, with each node's line and column, for error messages (None if unreadable:
    the document already parsed once, so this only fails on what a second parse cannot add)."""
    try:
        return yaml.compose(text, Loader=_StrictLoader)
    except (yaml.YAMLError, RecursionError, ValueError):
        return None


def _error_text(error: Any) -> str:
    # Only the location and the message: pydantic's `input` may hold a secret and is never shown.
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind == "union_tag_invalid":  # pydantic's own text quotes the tag that was given
        context = error.get("ctx") or {}
        return f"the {context.get('discriminator', 'tag')} does not match any of the expected tags: " + str(
            context.get("expected_tags", "")
        )
    message = str(error["msg"])
    return message.removeprefix("Value error, ")


def format_validation_error(exc: ValidationError, origin: str, text: str | None = None) -> InputError:
    """An InputError naming the file, each failing field's path (with its line and column when the
    document's ``text`` is given) and the problem."""
    errors = exc.errors(include_input=False, include_url=False)
    root = _compose(text) if text is not None else None
    lines = [
        f"{_error_path(tuple(e['loc']))}: {_error_text(e)}{_where(root, tuple(e['loc']))}"
        for e in errors[:ERRORS_SHOWN_MAX]
    ]
    if len(errors) > ERRORS_SHOWN_MAX:
        lines.append(f"... and {len(errors) - ERRORS_SHOWN_MAX} more")
    return InputError(f"{origin}: invalid definition: " + "; ".join(lines))


def parse_definition(text: str, origin: str) -> Definition:
    """Parse and validate a YAML or JSON definition; errors name origin, field path and problem."""
    document = _parse_document(text, origin)
    if not isinstance(document, dict):
        raise InputError(f"{origin}: a definition must be a mapping with name, version, sources, steps, output")
    try:
        return Definition.model_validate(document)
    except ValidationError as exc:
        # Lines and columns help in a YAML file; a JSON body (the API's, one line) would only gain noise.
        yaml_text = None if origin.lower().endswith(".json") else text
        raise format_validation_error(exc, origin, yaml_text) from None
    except RecursionError:
        raise InputError(f"{origin}: the document nests too deeply") from None


def load_definition(path: Path) -> LoadedDefinition:
    """Read, parse and validate a definition file."""
    data = read_capped(path, DEFINITION_BYTES_MAX, f"{path}: the definition")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: the definition is not UTF-8 text") from None
    definition = parse_definition(text, str(path))
    return LoadedDefinition(definition=definition, path=path, base_dir=path.resolve().parent)


def canonical_body(d: Definition) -> dict[str, Any]:
    """The JSON body that is hashed and pinned; validating it again gives an equal Definition."""
    body: dict[str, Any] = d.model_dump(mode="json", by_alias=True)
    # The limits block is newer than the body format: without it, a definition keeps exactly the body
    # (and so the hash) it had before; with it, only the limits asked for are written.
    if d.limits is None:
        del body["limits"]
    else:
        body["limits"] = d.limits.model_dump(mode="json", exclude_none=True)
    # The schedule block is newer still, and likewise invisible when absent.
    if d.schedule is None:
        del body["schedule"]
    # So is a target's partition (only mode replace_partition has one).
    if body.get("target") is not None and d.target is not None and d.target.partition is None:
        del body["target"]["partition"]
    # So is the engine: the default keeps a definition's hash; another engine is another definition.
    if d.engine == "duckdb":
        del body["engine"]
    # Column order is meaning: write ordered maps as [name, type] pairs, which RFC 8785 keeps in order.
    body["output"]["schema"] = [[name, t] for name, t in d.output.columns.items()]
    for name, spec in d.sources.items():
        columns = getattr(spec, "columns", None)
        if columns is not None:
            body["sources"][name]["schema"] = [[column, t] for column, t in columns.items()]
        elif isinstance(spec, ParquetSource | PostgresSource):
            # Their schema is newer than the body format: absent, the body (and hash) stays as it was.
            del body["sources"][name]["schema"]
        # Store options are newer still: a source without them keeps the body (and hash) it had.
        if "options" in body["sources"][name] and getattr(spec, "options", None) is None:
            del body["sources"][name]["options"]
    return body


# Definitions are immutable, so a definition's hash is computed once per object: canonical JSON of a
# large body (inline rows) is the most expensive step of a submit or replay otherwise. Keyed by
# id(), with a finalizer dropping the entry when the object dies, so a reused id never hits.
_hash_by_id: dict[int, str] = {}


def definition_hash(d: Definition) -> str:
    """sha256 over the RFC 8785 canonical JSON of the canonical body (cached per object)."""
    cached = _hash_by_id.get(id(d))
    if cached is None:
        cached = hashing.digest(canonical_body(d))
        _hash_by_id[id(d)] = cached
        weakref.finalize(d, _hash_by_id.pop, id(d), None)
    return cached


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a definition document (for `dataflow schema`)."""
    schema: dict[str, Any] = Definition.model_json_schema(by_alias=True)
    return schema
