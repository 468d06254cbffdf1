"""Runs filtered by parameter value (`runs.list_page(parameters=...)`, behind `dataflow runs --param`,
`GET /v1/runs?param=` and the run history page), on SQLite and PostgreSQL: exact matches on the canonical
form, every filter must match, and bad filters refused alike on both engines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions.definitions import load_definition
from durable_dataflow.dataflow.protocol import runs
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.platform import Platform

DEFINITION = """\
name: typed_parameters
version: 1
parameters:
  day: {type: date}
  note: {type: string}
  n: {type: int}
  flag: {type: bool}
sources:
  numbers: {kind: csv, path: numbers.csv, schema: {n: int64}}
steps:
  - name: out
    sql: select n from numbers where n = $n
output: {schema: {n: int64}, max_rows: 10, max_bytes: 1MiB}
"""
# B's note holds the text a naive substring search for n=7 would find; C differs from B's note in case.
RUNS = {
    "A": {"day": "2026-11-02", "note": "plain", "n": "7", "flag": "true"},
    "B": {"day": "2026-11-03", "note": 'x,"n":7}', "n": "12", "flag": "false"},
    "C": {"day": "2026-11-03", "note": "Plain", "n": "7", "flag": "no"},
}


@pytest.fixture
def found(db_url: str, tmp_path: Path) -> Iterator[tuple[Platform, dict[str, str]]]:
    (tmp_path / "numbers.csv").write_text("n\n7\n")
    (tmp_path / "dataflow.yaml").write_text(DEFINITION)
    loaded = load_definition(tmp_path / "dataflow.yaml")
    platform = Platform(db_url)
    ids: dict[str, str] = {}
    for label, params in RUNS.items():
        request = RunRequest(
            definition=loaded.definition,
            base_dir=loaded.base_dir,
            parameters=params,
            access=AccessContext(tenant="acme", principal="test", roles=("operator",), auth_method="test"),
            provenance=Provenance(actor="test", trigger="cli"),
            idempotency_key=f"key-{label}",
        )
        ids[platform.runs.submit(request).run.run_id] = label
    yield platform, ids
    platform.close()


def matching(found: tuple[Platform, dict[str, str]], **filters: Any) -> list[str]:
    platform, ids = found
    with platform.db.read() as conn:
        listed = runs.list_page(conn, tenant="acme", parameters=filters)
    return sorted(ids[run.run_id] for run in listed)


def test_parameter_filters_match_the_canonical_value_exactly(found: tuple[Platform, dict[str, str]]) -> None:
    """Each filter compares one parameter's canonical value (a date's ISO text, an int's digits, a bool's
    true/false) exactly and case-sensitively; several filters must all match; text inside another value,
    a LIKE wildcard or a non-canonical spelling matches nothing."""
    assert matching(found, day="2026-11-03") == ["B", "C"]
    assert matching(found, day="2026-11-03", n="7") == ["C"]
    assert matching(found, n="7") == ["A", "C"]  # not B, whose note holds the text "n":7}
    assert matching(found, flag="false") == ["B", "C"]
    assert matching(found, note="plain") == ["A"]
    assert matching(found, note='x,"n":7}') == ["B"]
    assert matching(found, note="pl%") == [] and matching(found, note="%") == []
    assert matching(found, n="07") == [] and matching(found, flag="no") == [] and matching(found, day="2026-11") == []
    assert matching(found, missing="7") == []
    assert matching(found) == ["A", "B", "C"]
    platform, _ = found
    with platform.db.read() as conn:
        text = runs.parameters_text(runs.list_page(conn, parameters={"n": "12"})[0].parameters)
    assert text == 'day=2026-11-03 flag=false n=12 note=x,"n":7}'


@pytest.mark.parametrize("filters", [{"day": "2026\x00-11-03"}, {"note": "a\nb"}, {"no\x1bte": "x"}, {"": "x"}])
def test_bad_parameter_filters_are_refused_by_position(
    found: tuple[Platform, dict[str, str]], filters: dict[str, str]
) -> None:
    """A NUL or control character, or an empty name, is an InputError naming the filter's position and
    never its text, on both engines (PostgreSQL would otherwise fail on the NUL)."""
    with pytest.raises(InputError) as raised:
        matching(found, **filters)
    assert "parameter filter number 1" in raised.value.message
    assert all(value not in raised.value.message for value in filters.values())
