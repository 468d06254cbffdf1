"""YAML request bodies on SQLite and PostgreSQL (issue 33 item 5): POST /v1/runs, /v1/schedules and
/v1/backfills take the JSON body's document as YAML under application/yaml, application/x-yaml or
text/yaml, read with the definitions' strict loader; syntax errors are 422 naming line and column and
never the content; the OpenAPI document lists both media types."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from durable_dataflow.api.app import create_app
from durable_dataflow.api.bodies import YAML_MEDIA_TYPES
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import EXAMPLES, Tokens, copy_examples, make_tokens, tenant_data_root

REVENUE_YAML = (EXAMPLES / "revenue_by_region" / "dataflow.yaml").read_text()
SECRET_VALUE = "hunter2-do-not-echo"


def run_body(definition_text: str, day: str = "2026-11-02") -> str:
    """The POST /v1/runs document as YAML text, the definition file indented under ``definition:``."""
    indented = "".join(f"  {line}\n" for line in definition_text.splitlines())
    return f"definition:\n{indented}parameters:\n  day: '{day}'\n"


@dataclass(frozen=True)
class Served:
    platform: Platform
    client: TestClient
    tokens: Tokens

    def post(self, path: str, token: str, text: str, media: str = "application/yaml") -> Any:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": media}
        return self.client.post(path, content=text.encode(), headers=headers)


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    platform = Platform(db_url)
    examples = copy_examples(tmp_path)
    app = create_app(platform, data_root=tenant_data_root(tmp_path, examples), sink_root=tmp_path / "sinks")
    with TestClient(app) as client:
        yield Served(platform, client, make_tokens(platform))
    platform.close()


@pytest.mark.parametrize("media", YAML_MEDIA_TYPES)
def test_a_run_is_submitted_with_its_definition_as_yaml(served: Served, media: str) -> None:
    """The revenue example's file text under each YAML media type runs and succeeds, and pins the same
    definition hash as the same document sent as JSON (one parse, one definition)."""
    answer = served.post("/v1/runs", served.tokens.submitter, run_body(REVENUE_YAML), media + "; charset=utf-8")
    assert answer.status_code == 201, answer.text
    run = answer.json()["run"]
    assert run["status"] == "succeeded" and run["parameters"] == {"day": "2026-11-02"}
    as_json = {"definition": yaml.safe_load(REVENUE_YAML), "parameters": {"day": "2026-11-03"}}
    headers = {"Authorization": f"Bearer {served.tokens.submitter}"}
    json_answer = served.client.post("/v1/runs", json=as_json, headers=headers)
    assert json_answer.status_code == 201, json_answer.text
    assert json_answer.json()["run"]["definition_hash"] == run["definition_hash"]


def test_a_schedule_and_a_backfill_take_yaml(served: Served) -> None:
    """POST /v1/schedules applies a YAML definition with its schedule block; POST /v1/backfills queues a
    day per date from a YAML body (dates stay strings: the strict loader has no implicit timestamps)."""
    document = flows.daily_flow({"cron": "0 3 * * *", "timezone": "UTC", "parameters": {"day": "{{ tick.date }}"}})
    text = yaml.safe_dump({"definition": document}, sort_keys=False)
    applied = served.post("/v1/schedules", served.tokens.operator, text)
    assert applied.status_code == 201, applied.text
    assert applied.json()["schedule"]["name"] == "daily"
    backfill = (
        yaml.safe_dump({"definition": flows.daily_flow()}, sort_keys=False) + "from: 2026-03-01\nto: 2026-03-02\n"
    )
    queued = served.post("/v1/backfills", served.tokens.operator, backfill, "text/yaml")
    assert queued.status_code == 201, queued.text
    assert queued.json()["submitted_total"] == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"definition:\n  name: x\n  password: [{SECRET_VALUE}\n", "line 4, column 1"),  # an unclosed flow sequence
        (f"definition: &a {{name: {SECRET_VALUE}}}\nother: *a\n", "anchors and aliases are not allowed"),
        (f"definition: {{}}\ndefinition: {SECRET_VALUE}\n", "duplicate key definition"),
        ("definition:\n\tname: x\n", "line 2, column 1"),
    ],
)
def test_bad_yaml_is_422_with_line_and_column_and_no_content(served: Served, text: str, expected: str) -> None:
    """Malformed YAML, an alias and a duplicate key are each 422 invalid_input naming where (line and
    column, or the key's path), never the secret-looking value, and nothing is recorded."""
    answer = served.post("/v1/runs", served.tokens.submitter, text)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_input" and expected in error["message"], error
    assert SECRET_VALUE not in answer.text
    assert (
        served.client.get("/v1/runs", headers={"Authorization": f"Bearer {served.tokens.viewer}"}).json()["runs"] == []
    )


def test_a_yaml_body_is_validated_as_the_json_one(served: Served) -> None:
    """An unknown field, a non-mapping body and bytes that are not UTF-8 are 422 as their JSON twins are."""
    unknown = served.post("/v1/runs", served.tokens.submitter, run_body(REVENUE_YAML) + "colour: red\n")
    assert unknown.status_code == 422 and "body.colour" in unknown.json()["error"]["message"], unknown.text
    listed = served.post("/v1/runs", served.tokens.submitter, "- a\n- b\n")
    assert listed.status_code == 422, listed.text
    binary = served.client.post(
        "/v1/runs",
        content=b"definition: \xff\xfe\n",
        headers={"Authorization": f"Bearer {served.tokens.submitter}", "Content-Type": "application/yaml"},
    )
    assert binary.status_code == 422 and "not UTF-8" in binary.json()["error"]["message"], binary.text


def test_openapi_documents_the_yaml_media_types(served: Served) -> None:
    """Every route that takes a body documents application/json and the three YAML media types."""
    paths = served.client.app.openapi()["paths"]  # type: ignore[attr-defined]
    for path in ("/v1/runs", "/v1/schedules", "/v1/backfills", "/v1/backfills/cancel"):
        content = paths[path]["post"]["requestBody"]["content"]
        assert set(content) == {"application/json", *YAML_MEDIA_TYPES}, path
