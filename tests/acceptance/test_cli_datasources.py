"""`dataflow datasources declare|list`: the platform operator's way to name a datasource, such as one whose
target a submitter may overwrite (registry.register_datasource had no caller outside the tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from durable_dataflow.core.errors import PermissionDenied
from durable_dataflow.dataflow.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.platform import Platform
from support import flows
from support.cli import make_cli


def _overwrite(platform: Platform, tmp_path: Path, datasource: str, key: str) -> None:
    target = {**flows.parquet_target(location="t"), "datasource": datasource, "mode": "overwrite"}
    submitter = AccessContext("acme", "someone", ("submitter",), (), "test")
    request = RunRequest(flows.definition(target), tmp_path, {}, submitter, Provenance("someone", "cli"), key)
    platform.runs.submit(request)


def test_a_declared_datasource_is_listed_and_lets_a_submitter_overwrite_exactly_it(db_url: str, tmp_path: Path) -> None:
    """Proves the CLI declaration is the record the overwrite check reads: before it a submitter's overwrite is
    refused, after it the same target is accepted; the declaration is listed, and declaring it again is a
    conflict (exit 5) that changes nothing."""
    cli = make_cli(db_url, tmp_path)
    with Platform(db_url) as platform:
        with pytest.raises(PermissionDenied):
            _overwrite(platform, tmp_path, "analytics.replaceable", "before")
        declared = cli("datasources", "declare", "analytics.replaceable", "--provider", "parquet",
                       "--location", "t", "--allow-overwrite", "--json")  # fmt: skip
        assert declared.code == 0, declared.output
        assert declared.json()["options"] == {"allow_overwrite": True} and declared.json()["tenant"] == "*"
        _overwrite(platform, tmp_path, "analytics.replaceable", "after")
    again = cli("datasources", "declare", "analytics.replaceable", "--provider", "parquet", "--location", "t")
    assert again.code == 5, again.output
    listed = cli("datasources", "list", "--json")
    assert listed.code == 0 and [d["name"] for d in listed.json()] == ["analytics.replaceable"]
    assert "analytics.replaceable" in cli("datasources", "list").stdout


def test_a_bad_declaration_is_refused_and_records_nothing(db_url: str, tmp_path: Path) -> None:
    """Proves an empty tenant is not "every tenant" (it was declared platform-wide), a tenant that is no
    tenant name, an unknown provider and a location with a control character are refused (exit 2), and
    that nothing is listed afterwards."""
    cli = make_cli(db_url, tmp_path)
    for args in (("--tenant", ""), ("--tenant", "../x"), ("--tenant", "*"), ("--provider", "nosuch"),
                 ("--location", "w\x1b[31m"), ("--location", "w\nx")):  # fmt: skip
        given = {"--provider": "parquet", "--location": "w", **dict([args])}
        refused = cli("datasources", "declare", "j", *[part for pair in given.items() for part in pair])
        assert refused.code == 2, (args, refused.output)
    assert cli("datasources", "list", "--json").json() == []
