"""A definition's `limits:` block (forms, bounds, hash) and the CSV delimiter check of the definition."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions import definitions
from durable_dataflow.dataflow.definitions.definitions import Definition, DefinitionLimits
from support import flows

MINIMAL = flows.MINIMAL_YAML
# The hash MINIMAL had before the limits block existed: a definition without the block keeps it.
MINIMAL_HASH = "sha256:701ec53321bb5fff52d4018998f9ae710448e6d84abc365d03ff13e93b65002e"


def _doc(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(MINIMAL)
    document.update(changes)
    return document


def _parse(document: dict[str, Any]) -> Definition:
    return definitions.parse_definition(yaml.safe_dump(document, sort_keys=False), "flow.yaml")


def _csv(delimiter: str) -> dict[str, Any]:
    return _doc(sources={"nums": {"kind": "csv", "path": "nums.csv", "delimiter": delimiter}})


# --- the limits block ----------------------------------------------------------------------------


def test_definition_without_limits_keeps_its_body_and_hash() -> None:
    """Proves the block is invisible when absent (or empty or null): the canonical body has no `limits`
    key and the hash equals the one pinned before the block existed."""
    for document in (_doc(), _doc(limits={}), _doc(limits=None)):
        d = _parse(document)
        assert d.limits is None
        assert "limits" not in definitions.canonical_body(d)
        assert definitions.definition_hash(d) == MINIMAL_HASH


@pytest.mark.parametrize(
    ("block", "requested"),
    [
        ({"time_limit": 90}, {"time_limit_s": 90.0}),
        ({"time_limit": 1.5}, {"time_limit_s": 1.5}),
        ({"time_limit": "90s"}, {"time_limit_s": 90.0}),
        ({"time_limit": "10m"}, {"time_limit_s": 600.0}),
        ({"time_limit": "2h"}, {"time_limit_s": 7200.0}),
        ({"time_limit": "1.5h"}, {"time_limit_s": 5400.0}),
        ({"memory": "2GiB"}, {"memory_bytes_max": 2 * 1024**3}),
        ({"memory": 1048576}, {"memory_bytes_max": 1048576}),
        ({"threads": 4}, {"threads": 4}),
        ({"source_bytes_max": "2TiB"}, {"source_bytes_max": 2 * 1024**4}),
        ({"source_bytes_max": "3TB"}, {"source_bytes_max": 3 * 1000**4}),
        (
            {"time_limit": "5m", "memory": "512MiB", "threads": 2, "source_bytes_max": "10GB"},
            {"time_limit_s": 300.0, "memory_bytes_max": 512 * 1024**2, "threads": 2, "source_bytes_max": 10**10},
        ),
    ],
)
def test_limits_block_forms_parse_to_seconds_and_bytes(block: dict[str, Any], requested: dict[str, Any]) -> None:
    """Proves each accepted spelling parses to the seconds/bytes `requested()` reports, keyed by the
    ExecutionLimits field it narrows, and that the pinned body re-validates to an equal definition."""
    d = _parse(_doc(limits=block))
    assert d.limits is not None and d.limits.requested() == requested
    body = definitions.canonical_body(d)
    assert body["limits"] == block  # kept as written, only the fields given
    assert Definition.model_validate(json.loads(json.dumps(body))) == d


def test_limits_block_is_part_of_the_hash() -> None:
    """Proves adding the block, or changing one of its values, changes the definition hash."""
    with_threads = definitions.definition_hash(_parse(_doc(limits={"threads": 2})))
    assert with_threads != MINIMAL_HASH
    assert definitions.definition_hash(_parse(_doc(limits={"threads": 3}))) != with_threads
    assert definitions.definition_hash(_parse(_doc(limits={"threads": 2}))) == with_threads


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ({"time_limit": 0}, r"limits\.time_limit: time_limit must be more than 0"),
        ({"time_limit": -5}, r"limits\.time_limit: time_limit must be more than 0"),
        ({"time_limit": "8d"}, r"limits\.time_limit: the duration is not valid"),
        ({"time_limit": "soon"}, r"limits\.time_limit: the duration is not valid"),
        ({"time_limit": 10 * 24 * 3600}, r"limits\.time_limit: .*at most 604800 seconds"),
        ({"time_limit": float("nan")}, r"limits\.time_limit: a duration must be a finite number"),
        ({"time_limit": True}, r"limits\.time_limit: must be a number or a string, not true/false"),
        ({"memory": "lots"}, r"limits\.memory: the size is not valid"),
        ({"memory": 0}, r"limits\.memory: a size must be between 1 byte"),
        ({"memory": "2 PiB"}, r"limits\.memory: the size is not valid"),
        ({"threads": 0}, r"limits\.threads: Input should be greater than or equal to 1"),
        ({"threads": 9999}, r"limits\.threads: Input should be less than or equal to 256"),
        ({"threads": "many"}, r"limits\.threads: Input should be a valid integer"),
        ({"source_bytes_max": -1}, r"limits\.source_bytes_max: a size must be between 1 byte"),
        ({"temp_dir": "/tmp"}, r"limits\.temp_dir: unknown field"),
    ],
)
def test_bad_limits_are_refused_naming_the_field(block: dict[str, Any], expected: str) -> None:
    """Proves each bad limit value is an InputError naming `limits.<field>` and the problem."""
    with pytest.raises(InputError, match=expected):
        _parse(_doc(limits=block))


def test_limits_model_defaults_to_asking_nothing() -> None:
    """Proves a DefinitionLimits with no field given requests nothing (so it never narrows)."""
    assert DefinitionLimits().requested() == {}


def test_max_bytes_message_names_the_definition_ceiling_and_the_platform() -> None:
    """Proves an output.max_bytes above 1 GiB is refused with the ceiling and a note that a platform
    may allow less."""
    output = {"schema": {"total": "int64"}, "max_rows": 1, "max_bytes": "2GiB"}
    with pytest.raises(InputError, match=r"output\.max_bytes: .*1073741824 bytes \(1 GiB\).*result_bytes_max"):
        _parse(_doc(output=output))


# --- the CSV delimiter -----------------------------------------------------------------------------


@pytest.mark.parametrize("delimiter", [",", ";", "|", "\t", " ", "'"])
def test_csv_delimiter_accepts_printable_ascii_and_tab(delimiter: str) -> None:
    """Proves the usual delimiters (and a tab) validate and are kept."""
    d = _parse(_csv(delimiter))
    assert d.sources["nums"].delimiter == delimiter  # type: ignore[union-attr]


@pytest.mark.parametrize("delimiter", ["é", '"', "\n", "\r", "\x00", "\x1b"])
def test_csv_delimiter_refuses_non_ascii_quote_and_control_characters(delimiter: str) -> None:
    """Proves a delimiter that is not one printable ASCII character (or is the quote) is an InputError
    naming the field and the rule, never echoing the value given."""
    with pytest.raises(InputError) as caught:
        _parse(_csv(delimiter))
    message = caught.value.message
    assert "sources.nums.delimiter: the delimiter is not allowed" in message and "printable ASCII" in message
    rule = "other than '\"'"  # the rule itself names the quote character
    assert delimiter not in message.replace(rule, "")


def test_csv_delimiter_must_be_one_character() -> None:
    """Proves an empty or two-character delimiter is refused at its path."""
    for delimiter in ("", ";;"):
        with pytest.raises(InputError, match=r"sources\.nums\.delimiter: String should have"):
            _parse(_csv(delimiter))
