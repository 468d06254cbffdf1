"""Definitions parse, validate with located errors, canonicalize stably; parameters are typed."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions import definitions, parameters
from durable_dataflow.dataflow.definitions.definitions import Definition, SecretRef
from support import flows

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

MINIMAL = flows.MINIMAL_YAML


def _doc(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(MINIMAL)
    document.update(changes)
    return document


def _parse(document: dict[str, Any], origin: str = "flow.yaml") -> Definition:
    return definitions.parse_definition(yaml.safe_dump(document, sort_keys=False), origin)


def test_examples_load_and_canonical_body_round_trips() -> None:
    """Proves both examples load, their canonical body re-validates to an equal model and hashes stably."""
    for name in ("revenue_by_region", "daily_orders_publish"):
        loaded = definitions.load_definition(EXAMPLES / name / "dataflow.yaml")
        body = definitions.canonical_body(loaded.definition)
        assert Definition.model_validate(body) == loaded.definition
        assert Definition.model_validate(json.loads(json.dumps(body))) == loaded.definition
        assert definitions.definition_hash(loaded.definition) == hashing.digest(body)
        assert loaded.base_dir == (EXAMPLES / name).resolve()
    publish = definitions.load_definition(EXAMPLES / "daily_orders_publish" / "dataflow.yaml").definition
    assert publish.target is not None and publish.target.provider == "parquet"
    assert publish.target.datasource == "analytics.daily_revenue"


def test_yaml_and_json_spellings_hash_alike() -> None:
    """Proves the hash covers the document's meaning: JSON and YAML with reordered keys give one hash."""
    document = _doc()
    from_yaml = definitions.parse_definition(MINIMAL, "a.yaml")
    reordered = dict(reversed(list(document.items())))
    from_json = definitions.parse_definition(json.dumps(reordered), "a.json")
    assert definitions.definition_hash(from_yaml) == definitions.definition_hash(from_json)
    changed = _parse(_doc(version=2))
    assert definitions.definition_hash(changed) != definitions.definition_hash(from_yaml)


def test_column_order_survives_canonical_json_and_changes_the_hash() -> None:
    """Proves declared column order is kept through RFC 8785 (which sorts keys) and is part of the hash."""
    document = _doc(output={"schema": {"z": "int64", "a": "string"}, "max_rows": 1, "max_bytes": 100})
    document["sources"]["nums"]["schema"] = {"n": "int64", "m": "string"}
    d = _parse(document)
    pinned = json.loads(hashing.canonical_json(definitions.canonical_body(d)))
    again = Definition.model_validate(pinned)
    assert again == d
    assert list(again.output.columns) == ["z", "a"]
    assert list(again.sources["nums"].columns) == ["n", "m"]  # type: ignore[union-attr]
    swapped = _parse(_doc(output={"schema": {"a": "string", "z": "int64"}, "max_rows": 1, "max_bytes": 100}))
    assert definitions.definition_hash(swapped) != definitions.definition_hash(_parse(_doc(
        output={"schema": {"z": "int64", "a": "string"}, "max_rows": 1, "max_bytes": 100})))


def test_malformed_yaml_names_file_line_and_column() -> None:
    """Proves malformed YAML gives an InputError naming the file and the line/column of the problem."""
    text = MINIMAL.replace("version: 1", "version: [1")
    with pytest.raises(InputError, match=r"bad\.yaml: malformed YAML at line \d+, column \d+"):
        definitions.parse_definition(text, "bad.yaml")
    with pytest.raises(InputError, match=r"bad\.json: malformed JSON at line 1, column \d+"):
        definitions.parse_definition('{"name": ', "bad.json")


def test_duplicate_keys_and_aliases_are_refused() -> None:
    """Proves a duplicated key and a YAML alias are refused rather than silently resolved."""
    duplicated = MINIMAL.replace("version: 1", "version: 1\nversion: 2")
    with pytest.raises(InputError, match=r"dup\.yaml: malformed YAML at line \d+, column 1: duplicate key version"):
        definitions.parse_definition(duplicated, "dup.yaml")
    aliased = MINIMAL.replace("description", "x") + "description: &a hello\nx: *a\n"
    with pytest.raises(InputError, match="aliases are not allowed"):
        definitions.parse_definition(aliased, "alias.yaml")


def test_unknown_field_names_its_path() -> None:
    """Proves an unknown field is refused with the file, the dotted path and 'unknown field'."""
    document = _doc()
    document["sources"]["nums"]["colour"] = "red"
    with pytest.raises(InputError, match=r"flow\.yaml: invalid definition: sources\.nums\.colour: unknown field"):
        _parse(document)
    with pytest.raises(InputError, match=r"output\.max_rowz: unknown field"):
        _parse(_doc(output={"schema": {"t": "int64"}, "max_rows": 1, "max_bytes": 10, "max_rowz": 3}))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"name": "has space"}, r"name: String should match pattern"),
        ({"version": 0}, r"version: Input should be greater than or equal to 1"),
        ({"steps": []}, r"steps: List should have at least 1 item"),
        ({"steps": [{"name": "x"}]}, r"steps\[0\]\.sql: required field is missing"),
        ({"sources": {"a": {"kind": "excel", "path": "x"}}}, r"sources\.a: .*does not match any of the expected tags"),
        ({"sources": {"a": {"kind": "csv"}}}, r"sources\.a\.path: required field is missing"),
        ({"output": {"schema": {"t": "money"}, "max_rows": 1, "max_bytes": 1}},
         r"output\.schema: column 't': unknown type: use string"),
        ({"output": {"schema": {"t": "int64"}, "max_rows": 1, "max_bytes": "lots"}},
         r"output\.max_bytes: the size is not valid"),
        ({"parameters": {"day": {"type": "date", "default": "tomorrow"}}}, r"parameters\.day: .*not a valid date"),
        ({"steps": [{"name": "nums", "sql": "select 1"}]}, r"steps\[0\]\.name is the same name as a source's"),
    ],
)
def test_invalid_fields_name_path_and_problem(change: dict[str, Any], expected: str) -> None:
    """Proves each class of invalid field gives an InputError with its path and the problem."""
    with pytest.raises(InputError, match=expected):
        _parse(_doc(**change))


def test_plain_postgres_dsn_is_refused_without_echoing_it() -> None:
    """Proves a plain-string DSN is refused, the error says to use {secret: NAME} and never shows the DSN."""
    dsn = "postgresql://app:hunter2-canary@db.example/crm"
    document = _doc(sources={"crm": {"kind": "postgres", "dsn": dsn, "query": "select 1"}})
    with pytest.raises(InputError) as caught:
        _parse(document)
    assert "sources.crm.dsn" in caught.value.message
    assert "{secret: NAME}" in caught.value.message
    assert "hunter2" not in caught.value.message and "db.example" not in caught.value.message
    ok = _parse(_doc(sources={"crm": {"kind": "postgres", "dsn": {"secret": "CRM_DSN"}, "query": "select 1"}}))
    assert ok.sources["crm"].dsn == SecretRef(secret="CRM_DSN")  # type: ignore[union-attr]


def test_target_options_keep_secret_refs_and_refuse_plain_credentials() -> None:
    """Proves target options hold {secret: NAME} references and refuse a plain password."""
    target = {"type": "datasources.publication", "provider": "postgres", "datasource": "a.b", "location": "t",
              "options": {"password": {"secret": "PG_PW"}, "batch": 500}}
    parsed = _parse(_doc(target=target))
    assert parsed.target is not None and parsed.target.options["password"] == SecretRef(secret="PG_PW")
    assert Definition.model_validate(definitions.canonical_body(parsed)) == parsed
    target["options"] = {"password": "hunter2"}
    with pytest.raises(InputError, match=r"target\.options: .*looks like a credential") as caught:
        _parse(_doc(target=target))
    assert "hunter2" not in caught.value.message


def test_output_schema_maps_to_arrow_and_sizes_parse() -> None:
    """Proves declared type names map to the intended Arrow types and sizes parse in both unit systems."""
    output = definitions.OutputSpec.model_validate(
        {"schema": {"s": "string", "i": "int64", "u": "uint8", "f": "float32", "b": "bool", "d": "date",
                    "t": "timestamp", "tz": "timestamp[us, tz=UTC]", "m": "decimal(18,2)"},
         "max_rows": 5, "max_bytes": "64MiB"}
    )
    assert output.arrow_schema() == pa.schema([
        ("s", pa.string()), ("i", pa.int64()), ("u", pa.uint8()), ("f", pa.float32()), ("b", pa.bool_()),
        ("d", pa.date32()), ("t", pa.timestamp("us")), ("tz", pa.timestamp("us", tz="UTC")),
        ("m", pa.decimal128(18, 2)),
    ])
    assert output.max_bytes_int == 64 * 1024 * 1024
    assert definitions.parse_size("10MB") == 10_000_000 and definitions.parse_size("512KiB") == 524_288


def test_load_definition_errors_name_the_file(tmp_path: Path) -> None:
    """Proves a missing file and a non-mapping document give InputErrors naming the file."""
    with pytest.raises(InputError, match=r"nothere\.yaml: the definition cannot be read"):
        definitions.load_definition(tmp_path / "nothere.yaml")
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(InputError, match=r"list\.yaml: a definition must be a mapping"):
        definitions.load_definition(listy)


def test_json_schema_describes_the_document() -> None:
    """Proves json_schema() is a JSON document listing the top-level fields and the source kinds."""
    schema = definitions.json_schema()
    json.dumps(schema)
    assert {"name", "version", "sources", "steps", "output", "target"} <= set(schema["properties"])
    assert "postgres" in json.dumps(schema) and "schema" in json.dumps(schema["$defs"]["OutputSpec"])


# --- parameters ---------------------------------------------------------------------------------

TYPED = _doc(parameters={
    "day": {"type": "date"}, "n": {"type": "int", "default": 3}, "ratio": {"type": "float", "default": 0.5},
    "flag": {"type": "bool", "default": False}, "at": {"type": "timestamp", "default": "2026-11-02T00:00:00Z"},
    "price": {"type": "decimal", "default": "1.50"}, "who": {"type": "string", "default": "ops"},
})


def test_cli_strings_and_api_values_give_the_same_canonical_parameters() -> None:
    """Proves CLI strings and typed API values canonicalize identically and defaults are filled."""
    d = _parse(TYPED)
    from_cli = parameters.check_parameters(d, {"day": "2026-11-02", "n": "42", "flag": "true", "price": "12.500",
                                              "at": "2026-11-02T01:00:00+01:00", "ratio": "0.25"})
    from_api = parameters.check_parameters(d, {"day": "2026-11-02", "n": 42, "flag": True, "price": "12.5",
                                              "at": "2026-11-02T00:00:00Z", "ratio": 0.25})
    assert from_cli == from_api == {"day": "2026-11-02", "n": 42, "ratio": 0.25, "flag": True,
                                    "at": "2026-11-02T00:00:00+00:00", "price": "12.5", "who": "ops"}
    hashing.digest(from_cli)  # canonical JSON accepts every value
    bound = parameters.bind_values(d, from_cli)
    assert bound["day"] == dt.date(2026, 11, 2) and str(bound["price"]) == "12.5"
    assert bound["at"] == dt.datetime(2026, 11, 2, tzinfo=dt.UTC)
    assert d.parameters["price"].default == "1.5"  # defaults are stored canonically


def test_decimals_at_the_edge_of_38_digits_keep_their_canonical_form() -> None:
    """Proves the values a DECIMAL(38, s) holds are accepted in the same canonical form as before the
    written-out check, and that a default with an exponent past the decimal context is an InputError."""
    d = _parse(TYPED)
    for given, canonical in (("1e37", "1" + "0" * 37), ("1e-38", "0." + "0" * 37 + "1"), ("0e1000000", "0"),
                             ("-12.50", "-12.5"), ("0.00123", "0.00123"), ("9" * 38, "9" * 38)):  # fmt: skip
        assert parameters.check_parameters(d, {"day": "2026-11-02", "price": given})["price"] == canonical
    doc = _doc(parameters={"day": {"type": "date"}, "price": {"type": "decimal", "default": "1e1000000"}})
    with pytest.raises(InputError, match="more than 38 digits"):
        _parse(doc)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"day": "2026-13-40"}, r"parameter 'day' is declared date; the value given does not fit: not a date"),
        ({"day": "2026-11-02", "n": "forty"}, r"parameter 'n' is declared int; .*: not an integer$"),
        ({"day": "2026-11-02", "n": 2**60}, r"parameter 'n' is declared int; .*2\*\*53"),
        ({"day": "2026-11-02", "n": True}, r"parameter 'n' is declared int; .*: a boolean is not an integer$"),
        ({"day": "2026-11-02", "flag": "maybe"}, r"parameter 'flag' is declared bool; .*: not a boolean"),
        ({"day": "2026-11-02", "price": 1.1}, r"parameter 'price' is declared decimal; .*as a string"),
        ({"day": "2026-11-02", "ratio": "nan"}, r"parameter 'ratio' is declared float; .*NaN"),
        ({"day": "2026-11-02", "who": 7}, r"parameter 'who' is declared string; .*: not a string$"),
        ({"day": "2026-11-02", "at": "yesterday"}, r"parameter 'at' is declared timestamp; .*: not a timestamp"),
        ({"day": "2026-11-02", "price": "1e38"}, r"'price' is declared decimal; .*more than 38 digits when written"),
        ({"day": "2026-11-02", "price": "1e1000000"}, r"'price' is declared decimal; .*more than 38 digits"),
        ({"day": "2026-11-02", "price": "1e999999"}, r"'price' is declared decimal; .*more than 38 digits"),
        ({"day": "2026-11-02", "price": "1.5e-38"}, r"'price' is declared decimal; .*more than 38 digits"),
        ({"day": "2026-11-02", "at": "0001-01-01T00:00:00+01:00"}, r"'at' is declared timestamp; .*out of range"),
        ({"day": "2026-11-02", "at": "9999-12-31T23:59:59-01:00"}, r"'at' is declared timestamp; .*out of range"),
        ({}, r"parameter 'day' \(date\) is required"),
        ({"day": "2026-11-02", "dya": "x"}, r"unknown parameter 'dya': the definition declares at, day"),
    ],
)
def test_bad_parameters_name_parameter_and_type_never_the_value(raw: dict[str, Any], expected: str) -> None:
    """Proves wrong types, missing and unknown parameters raise InputError naming what is wrong, and
    that no value given (longer than a few characters) is echoed in the message."""
    with pytest.raises(InputError, match=expected) as caught:
        parameters.check_parameters(_parse(TYPED), raw)
    wrong = [str(value) for value in raw.values() if value != "2026-11-02"]  # the good day is the rule's example too
    assert [value for value in wrong if len(value) > 3 and value in caught.value.message] == []


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_huge_integer_or_a_deep_nesting_is_an_input_error(suffix: str) -> None:
    """Proves a 5000-digit integer and a 5000-deep nesting, in YAML or JSON, are InputErrors naming the
    origin (Python's int-digit limit and its recursion limit surfaced as internal errors)."""
    huge = "9" * 5000
    deep = "[" * 5000 + "1" + "]" * 5000
    texts = {
        ".yaml": (f"name: x\nversion: {huge}\n", f"name: x\ndescription: {deep}\n"),
        ".json": (f'{{"name": "x", "version": {huge}}}', f'{{"name": "x", "description": {deep}}}'),
    }[suffix]
    for text, expected in zip(texts, ("a number over 4300 digits", "nests too deeply"), strict=True):
        with pytest.raises(InputError, match=rf"^doc{suffix}: .*{expected}"):
            definitions.parse_definition(text, f"doc{suffix}")


def test_a_yaml_mistake_names_its_line_and_column() -> None:
    """Proves issue 33 finding 6: a value of the wrong type inside a YAML flow map is reported with its path and
    the line and column where it stands; a missing field with the line of the mapping that lacks it."""
    flow_map = (
        "name: t\nversion: 1\nsources:\n"
        "  orders: {kind: csv, path: o.csv, schema: {id: int64, amount: [1, 2]}}\n"
        "steps:\n  - name: s\n    sql: select 1 as n\n"
        "output:\n  schema: {n: int64}\n  max_rows: 10\n  max_bytes: 1MiB\n"
    )
    with pytest.raises(InputError, match=r"sources\.orders\.schema\.amount: .* \(line 4, column 64\)"):
        definitions.parse_definition(flow_map, "flow.yaml")
    missing = flow_map.replace("  max_rows: 10\n", "")
    with pytest.raises(InputError, match=r"output\.max_rows: required field is missing \(line 9, column 3\)"):
        definitions.parse_definition(missing, "flow.yaml")
