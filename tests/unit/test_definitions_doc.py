"""docs/definitions.md cannot drift from the definition's JSON Schema (issue 30, item 1): its field tables
are exactly what scripts/gen_definitions_doc.py generates from `dataflow schema`, every schema property
has a meaning and every meaning a property, and every complete example in it parses as a definition."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from durable_dataflow.dataflow.definitions.definitions import json_schema, parse_definition

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "definitions.md").read_text(encoding="utf-8")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_definitions_doc", REPO / "scripts" / "gen_definitions_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_field_tables_are_the_schemas() -> None:
    """Regenerating the tables from the current schema leaves the document unchanged, and each model of
    the schema (the definition and every $defs entry) has its table."""
    generator = _generator()
    schema = json_schema()
    assert generator.render(DOC, schema) == DOC, "run: python scripts/gen_definitions_doc.py"
    for model in generator.models(schema):
        assert f"<!-- fields:{model} -->" in DOC


def test_a_property_or_a_model_the_doc_lacks_is_an_error() -> None:
    """A property added to the schema without a meaning, a meaning left for a removed property and a new
    model without a table each make the generator fail, so the test above cannot pass on a stale doc."""
    generator = _generator()
    added = copy.deepcopy(json_schema())
    added["$defs"]["StepSpec"]["properties"]["retries"] = {"type": "integer"}
    with pytest.raises(KeyError, match="StepSpec"):
        generator.render(DOC, added)
    removed = copy.deepcopy(json_schema())
    del removed["$defs"]["OutputSpec"]["properties"]["max_rows"]
    with pytest.raises(KeyError, match="OutputSpec"):
        generator.render(DOC, removed)
    new_model = copy.deepcopy(json_schema())
    new_model["$defs"]["IcebergSource"] = {"properties": {}}
    with pytest.raises(KeyError, match="IcebergSource"):
        generator.render(DOC, new_model)


def test_every_complete_example_parses() -> None:
    """Each YAML block of the document that is a whole definition (it starts with `name:`) parses and
    validates as one."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC, flags=re.DOTALL)
    complete = [block for block in blocks if block.startswith("name:")]
    assert complete
    for block in complete:
        parse_definition(block, "definitions.md.yaml")
