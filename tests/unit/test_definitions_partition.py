"""A target's partition (issue 27): `mode: replace_partition` needs one, nothing else may have one, its
columns are in output.schema and of a type with exact equality, its "$name" references name declared
parameters of the column's kind and its literals are canonical values of that kind; absent, the target is
recorded and hashed exactly as before."""

from __future__ import annotations

import json
from typing import Any

import pytest

from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions.definitions import parse_definition
from durable_dataflow.dataflow.definitions.parameters import resolve_partition
from support import flows


def _parse(target_extra: dict[str, Any]) -> Any:
    document = {
        "name": "daily",
        "version": 1,
        "parameters": {"day": {"type": "date"}},
        "sources": {
            "sales": {"kind": "inline", "rows": flows.ROWS, "schema": {"region": "string", "amount": "float64"}}
        },
        "steps": [{"name": "out", "sql": "select $day::DATE as day, region, amount as score from sales"}],
        "output": {
            "schema": {"day": "date", "region": "string", "score": "float64"},
            "max_rows": 10,
            "max_bytes": "1MiB",
        },
        "target": {
            "type": "datasources.publication",
            "provider": "delta",
            "datasource": "analytics.daily",
            "location": "daily",
            **target_extra,
        },
    }
    return parse_definition(json.dumps(document), "<test>")


def test_a_partitioned_target_parses() -> None:
    defn = _parse({"mode": "replace_partition", "partition": {"day": "$day", "region": "north"}})
    assert defn.target.partition == {"day": "$day", "region": "north"}
    assert defn.target.partition_parameters() == {"day": "day"}
    assert defn.target.recorded()["partition"] == {"day": "$day", "region": "north"}


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"mode": "replace_partition"}, "needs a partition"),
        ({"mode": "append", "partition": {"day": "$day"}}, "only with mode replace_partition"),
        ({"mode": "replace_partition", "partition": {"other": "$day"}}, "not in output.schema"),
        ({"mode": "replace_partition", "partition": {"day": "$nope"}}, "undeclared parameter"),
        ({"mode": "replace_partition", "partition": {}}, "partition"),
        ({"mode": "replace_partition", "partition": {"region": "$day"}}, "must be declared string"),
        ({"mode": "replace_partition", "partition": {"region": 5}}, "literal must be a string"),
        ({"mode": "replace_partition", "partition": {"day": "2024-3-1"}}, "literal must be a date"),
        ({"mode": "replace_partition", "partition": {"score": 1.5}}, "a partition column is a string"),
    ],
)
def test_a_wrong_partition_is_refused(extra: dict[str, Any], words: str) -> None:
    with pytest.raises(InputError, match=words):
        _parse(extra)


def test_without_a_partition_the_recorded_target_is_unchanged() -> None:
    defn = _parse({"mode": "append"})
    assert "partition" not in defn.target.recorded()


def test_references_resolve_with_the_runs_values() -> None:
    assert resolve_partition({"day": "$day", "k": 3}, {"day": "2024-03-01"}) == {"day": "2024-03-01", "k": 3}
    with pytest.raises(InputError, match="'day'"):
        resolve_partition({"day": "$day"}, {})
