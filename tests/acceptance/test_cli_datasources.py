"""`dataflow datasources declare|list|forget`: the platform operator's way to name a datasource, such as one
whose target a submitter may overwrite (registry.register_datasource had no caller outside the tests), and to
declare a created location really gone."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.core.errors import PermissionDenied
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.platform import Platform
from support import flows
from support.cli import Cli, make_cli


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


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "daily_orders_publish"
LEASE_EXPIRY_WAIT_S = 30.0


def _run_of_key(cli: Cli, key: str) -> dict[str, Any]:
    return next(r for r in cli("runs", "--json").json() if r["idempotency_key"] == key)


def test_a_missing_sink_folder_is_never_recreated_through_the_cli(db_url: str, tmp_path: Path) -> None:
    """Issue 26's reproduction, command by command: A is killed right after the sink committed; its warehouse
    folder is moved away. Reconcile A is undecided; run B fails before dispatch (exit 1, location_missing) and
    re-creates nothing; reconcile --resume stays undecided; forget needs --yes. With the folder back, A is
    present: its key is in the sink once, in the one folder."""
    shutil.copytree(EXAMPLE, tmp_path / "ex", ignore=shutil.ignore_patterns("warehouse"))
    cli = make_cli(db_url, tmp_path)
    args = ("run", "ex/dataflow.yaml", "-p", "day=2026-11-03", "-k", "A")
    crash = {"DATAFLOW_LEASE_TTL": "1", "DATAFLOW_CRASH_AT": "after_provider_call"}
    assert cli(*args, extra_env=crash).code == -signal.SIGKILL
    deadline = time.monotonic() + LEASE_EXPIRY_WAIT_S
    while not _run_of_key(cli, "A")["lease_expired"]:  # a clock condition, polled with a bound
        assert time.monotonic() < deadline, "the crashed run's 1 s lease did not expire"
        time.sleep(0.1)
    run_a = _run_of_key(cli, "A")["run_id"]
    warehouse = tmp_path / "ex" / "warehouse"
    warehouse.rename(tmp_path / "moved")

    undecided = cli("reconcile", run_a)
    assert undecided.code == 3 and "undecided" in undecided.stdout, undecided.output
    b = cli("run", "ex/dataflow.yaml", "-p", "day=2026-11-04", "-k", "B", "--json")
    assert b.code == 1, b.output
    assert (b.json()["status"], b.json()["recovery_status"], b.json()["error_code"]) == (
        "failed", "no_external_output", "location_missing"
    )  # fmt: skip
    assert str(tmp_path) not in b.json()["error_message"]
    assert not warehouse.exists()
    resumed = cli("reconcile", run_a, "--resume")
    assert resumed.code == 3 and "undecided" in resumed.stdout, resumed.output
    refused = cli("datasources", "forget", "analytics.daily_revenue")
    assert refused.code == 2 and "--yes" in refused.stderr, refused.output

    (tmp_path / "moved").rename(warehouse)
    present = cli("reconcile", run_a)
    assert present.code == 0 and "present" in present.stdout, present.output
    assert len(list((warehouse / "daily_revenue" / "_manifests").glob("*.json"))) == 1


def test_forget_through_the_cli_lets_the_next_run_create_the_location(db_url: str, tmp_path: Path) -> None:
    """The operator's forget (exit 0, counted in --json) ends the refusal: the next run creates the folder."""
    shutil.copytree(EXAMPLE, tmp_path / "ex", ignore=shutil.ignore_patterns("warehouse"))
    cli = make_cli(db_url, tmp_path)
    assert cli("run", "ex/dataflow.yaml", "-p", "day=2026-11-03", "-k", "A").code == 0
    shutil.rmtree(tmp_path / "ex" / "warehouse")
    assert cli("run", "ex/dataflow.yaml", "-p", "day=2026-11-04", "-k", "B").code == 1
    unknown = cli("datasources", "forget", "analytics.nosuch", "--yes")
    assert unknown.code == 4, unknown.output
    forgot = cli("datasources", "forget", "analytics.daily_revenue", "--yes", "--json")
    assert forgot.code == 0 and forgot.json() == {
        "name": "analytics.daily_revenue", "tenant": "default", "places_forgotten": 1
    }, forgot.output  # fmt: skip
    assert cli("run", "ex/dataflow.yaml", "-p", "day=2026-11-04", "-k", "C").code == 0
    assert (tmp_path / "ex" / "warehouse" / "daily_revenue" / "_location.json").is_file()
