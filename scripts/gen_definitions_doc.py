"""Regenerate the field tables of docs/definitions.md from the definition's JSON Schema.

Each table sits between ``<!-- fields:MODEL -->`` and ``<!-- /fields -->`` in the document; the prose and
examples around them are written by hand. A table lists every property the schema gives MODEL (the
definition itself is ``Definition``): its type, whether it is required, its default, its constraints and
its meaning (``MEANINGS`` below). A property without a meaning, or a meaning for a property the schema
lacks, is an error: the doc cannot drift from the schema (tests/unit/test_definitions_doc.py).

    python scripts/gen_definitions_doc.py          # rewrite the tables in place
    python scripts/gen_definitions_doc.py --check  # exit 1 when the document is out of date
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from durable_dataflow.dataflow.definitions.definitions import json_schema

DOC = Path(__file__).resolve().parents[1] / "docs" / "definitions.md"
ROOT = "Definition"
_BLOCK = re.compile(r"(<!-- fields:(?P<model>\w+) -->\n)(?P<body>.*?)(<!-- /fields -->)", re.DOTALL)
_CONSTRAINTS = (
    ("minLength", "at least {} characters"), ("maxLength", "at most {} characters"),
    ("minimum", "≥ {}"), ("maximum", "≤ {}"), ("minItems", "at least {} items"), ("maxItems", "at most {} items"),
    ("minProperties", "at least {} entries"), ("maxProperties", "at most {} entries"), ("pattern", "matches `{}`"),
)  # fmt: skip
TYPE_NAMES = "a column type name (see [Column types](#column-types))"
STORE_OPTIONS = ("With an `s3://` path only: `endpoint`, `region`, `allow_http` and the credentials "
                 "`access_key_id`, `secret_access_key`, `session_token` as secret references "
                 "([Object stores](#object-stores)).")

MEANINGS: dict[str, dict[str, str]] = {
    "Definition": {
        "name": "The definition's name; runs, pages and `dataflow definitions` show it.",
        "version": "Your version number; a changed body with the same name and version is still another "
                   "definition (its hash differs).",
        "description": "Free text shown with the definition.",
        "engine": "Where the steps run: `duckdb` in the worker's process, or `spark` (the `spark` extra; "
                  "docs/engines.md).",
        "parameters": "Typed parameters, by name; a step reads one as `$name`.",
        "sources": "The inputs, by name; a step reads one as a table of that name.",
        "steps": "SQL SELECT statements, run in order; each result is a table later steps read by the "
                 "step's name; the last one's result is the output.",
        "output": "The declared result: its columns and bounds.",
        "limits": "Execution limits this definition asks for, each at most the platform's.",
        "target": "Where a run publishes its result (forward recovery); without it, the result is stored "
                  "with the run (atomic mode).",
        "schedule": "When the definition runs by itself (docs/schedules.md).",
    },
    "ParameterSpec": {
        "type": "The parameter's type; a value given as text (`--param day=2026-11-02`) is parsed as it.",
        "default": "The value when none is given; without a default the parameter is required.",
        "description": "Free text for people.",
    },
    "CsvSource": {
        "kind": "`csv`.",
        "path": "The file, relative to the definition's folder (CLI) or the tenant's data root (API); or one "
                "object `s3://bucket/key`.",
        "delimiter": "One printable ASCII character other than `\"`, or a tab.",
        "header": "Whether the first line names the columns; without it `schema` names them, in order.",
        "schema": "Declared column types (column → " + TYPE_NAMES + "); undeclared columns are inferred. "
                  "A value that does not parse as its declared type fails the run.",
        "options": STORE_OPTIONS,
    },
    "ParquetSource": {
        "kind": "`parquet`.",
        "path": "A file, or a folder whose `*.parquet` files are read in sorted name order (names starting "
                "with `.` or `_` skipped); on a store `s3://bucket/key`: an object, a prefix or a glob "
                "(`*` and `[…]` within one key segment).",
        "schema": "Declared column types (column → " + TYPE_NAMES + "); a stored column of another type is "
                  "converted exactly, or the run fails.",
        "options": STORE_OPTIONS,
    },
    "InlineSource": {
        "kind": "`inline`.",
        "rows": "The rows, each a mapping of column → value (dates and decimals as text).",
        "schema": "The column types (column → " + TYPE_NAMES + "), required.",
    },
    "PostgresSource": {
        "kind": "`postgres`.",
        "dsn": "A secret reference `{secret: NAME}` holding the DSN; a plain DSN is refused.",
        "query": "Exactly one read statement (SELECT, WITH … SELECT, VALUES or TABLE), run on a read-only "
                 "session.",
        "schema": "Declared result column types (column → " + TYPE_NAMES + "); converted exactly, or the run fails.",
    },
    "DeltaSource": {
        "kind": "`delta`.",
        "path": "The Delta table's folder (with its `_delta_log`), or its prefix `s3://bucket/key`.",
        "version": "The table version to read; absent, the latest version when the run starts.",
        "options": STORE_OPTIONS,
    },
    "SecretRef": {
        "secret": "The secret's name: an environment variable or a file in `DATAFLOW_SECRETS_DIR` "
                  "(docs/security.md); for a tenant, a secret granted to it.",
    },
    "StepSpec": {
        "name": "The step's name; later steps read its result under it. Unique, and not a source's name.",
        "sql": "One SELECT (or WITH … SELECT) statement in DuckDB SQL (Spark SQL for `engine: spark`).",
    },
    "OutputSpec": {
        "schema": "The result's columns, in order (column → " + TYPE_NAMES + "); the last step must "
                  "produce exactly these names in this order.",
        "max_rows": "The most rows the result may have; more fails the run.",
        "max_bytes": "The most bytes the result may take as Arrow IPC: bytes, or a size such as `64MiB` "
                     "(at most 1 GiB).",
    },
    "DefinitionLimits": {
        "time_limit": "Seconds, or a duration such as `90s`, `10m`, `2h` (at most 7 days).",
        "memory": "The engine's memory, a size such as `2GiB`.",
        "threads": "The engine's threads.",
        "source_bytes_max": "The most bytes one source may read, a size.",
    },
    "TargetSpec": {
        "type": "`datasources.publication`.",
        "provider": "The sink: `parquet` (a Parquet folder), `delta` (a Delta table), `postgres` (a table), "
                    "or a plugin's name (docs/providers.md).",
        "datasource": "The datasource's name, e.g. `analytics.daily_revenue`; registered for the tenant at "
                      "its first publication, with this provider and location.",
        "location": "A folder relative to the sink root (`parquet`, `delta`), or a table name (`postgres`).",
        "mode": "`append` adds the result; `overwrite` replaces the whole datasource (the operator role, or "
                "a datasource declared `allow_overwrite`); `replace_partition` replaces the rows of one "
                "partition (`delta`, `postgres`).",
        "partition": "With `replace_partition` only: output column → `$parameter` or a literal value.",
        "options": "Provider options; a credential (e.g. `dsn`) must be a secret reference.",
    },
    "ScheduleSpec": {
        "cron": "A 5-field cron expression, matched against the wall clock of `timezone`.",
        "timezone": "An IANA time zone, e.g. `Europe/Paris`.",
        "parameters": "Each run's parameters: literals, or text with `{{ tick.date }}`, "
                      "`{{ tick.date - 1 day }}` or `{{ tick.iso }}`.",
        "overlap": "When the previous run is unfinished: `skip` the tick, `buffer_one` (run the newest "
                   "waiting tick afterwards) or `allow` it to run at once.",
        "catchup_window": "How old a missed tick may be and still run, `1m` to `366d` (written Ns, Nm, Nh, Nd).",
        "enabled": "`false` keeps the schedule but submits nothing.",
    },
}


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def type_text(spec: dict[str, Any]) -> str:
    """A property's type in words, linking to the section of a model it refers to."""
    if "$ref" in spec:
        name = _ref_name(spec["$ref"])
        return f"[{name}](#{name.lower()})"
    if "const" in spec:
        return f"`{json.dumps(spec['const'])}`"
    if "enum" in spec:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in spec["enum"])
    if "anyOf" in spec or "oneOf" in spec:
        return " or ".join(type_text(s) for s in spec.get("anyOf", spec.get("oneOf", [])))
    kind = spec.get("type")
    if kind == "array":
        return f"list of {type_text(spec.get('items') or {})}" if spec.get("items") else "list"
    if kind == "object":
        values = spec.get("additionalProperties")
        for value in (spec.get("patternProperties") or {}).values():
            values = value
        return f"map of name → {type_text(values)}" if isinstance(values, dict) and values else "mapping"
    return {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean",
            "null": "null"}.get(str(kind), "any")  # fmt: skip


def constraints_text(spec: dict[str, Any]) -> str:
    found: list[str] = []
    for part in [spec, *spec.get("anyOf", [])]:
        found.extend(text.format(part[key]) for key, text in _CONSTRAINTS if key in part)
    return "; ".join(found)


def table(model: str, schema: dict[str, Any]) -> str:
    """The Markdown table of one model's properties; KeyError when the meanings drift from the schema."""
    node = schema if model == ROOT else schema["$defs"][model]
    properties: dict[str, Any] = node["properties"]
    meanings = MEANINGS[model]
    if set(properties) != set(meanings):
        raise KeyError(f"{model}: schema properties {sorted(properties)} but meanings for {sorted(meanings)}")
    required = set(node.get("required", []))
    lines = ["| Field | Type | Required | Default | Constraints | Meaning |", "|---|---|---|---|---|---|"]
    for name, spec in properties.items():
        default = "—" if name in required or "default" not in spec else f"`{json.dumps(spec['default'])}`"
        row = [f"`{name}`", type_text(spec), "yes" if name in required else "no", default,
               constraints_text(spec), meanings[name]]  # fmt: skip
        lines.append("| " + " | ".join(cell.replace("|", "\\|") if i > 1 else cell for i, cell in enumerate(row))
                     + " |")
    return "\n".join(lines) + "\n"


def models(schema: dict[str, Any]) -> list[str]:
    """Every model the schema defines, the definition itself first."""
    return [ROOT, *schema["$defs"]]


def render(doc: str, schema: dict[str, Any]) -> str:
    """The document with every field table regenerated; KeyError naming a model without a table."""
    shown = {m.group("model") for m in _BLOCK.finditer(doc)}
    missing = [m for m in models(schema) if m not in shown]
    unknown = sorted(shown - set(models(schema)))
    if missing or unknown:
        raise KeyError(f"field tables missing for {missing}; tables for models the schema lacks: {unknown}")
    return _BLOCK.sub(lambda m: m.group(1) + table(m.group("model"), schema) + m.group(4), doc)


def main(argv: list[str]) -> int:
    current = DOC.read_text(encoding="utf-8")
    fresh = render(current, json_schema())
    if "--check" in argv:
        if fresh != current:
            sys.stderr.write("docs/definitions.md is out of date: run python scripts/gen_definitions_doc.py\n")
            return 1
        return 0
    DOC.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
