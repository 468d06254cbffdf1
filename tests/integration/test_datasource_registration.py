"""Honest absence, second half (issue 13, item 4): a datasource's first publication registers it (tenant,
name, provider, location, the run, when) in the platform database before the run's dispatch can be
authorized, so an inspection that finds the location missing says whether the platform created it.
On SQLite and PostgreSQL; the sinks are real folders. Also item 10's cleanups: one credential-word list."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from fastapi.testclient import TestClient

from durable_dataflow import migrations
from durable_dataflow.api import tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.core import crashpoints
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions import definitions
from durable_dataflow.dataflow.protocol import forward
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import contract, registry
from durable_dataflow.datasources.contract import LOCATION_MISSING, Absent, Undecided
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider
from durable_dataflow.platform import Platform
from support import flows

CANARY_LOCATION = "globex-private-canary-7f3a"


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=5) as opened:
        yield opened
    crashpoints.set_hook(None)


def _run(
    platform: Platform, base: Path, *, location: str = "sink", tenant: str = "acme", key: str = "k1", name: str = "t"
) -> Run:
    defn = flows.definition(flows.parquet_target(location=location), name=name)
    return platform.runs.run_inline(flows.request(defn, base, key, tenant=tenant)).run


def _rows(platform: Platform) -> list[dict[str, Any]]:
    with platform.db.read() as conn:
        found = conn.execute(sa.text("SELECT * FROM datasources ORDER BY tenant, name")).mappings()
        return [dict(row) for row in found]


def test_the_first_publication_registers_its_datasource_before_dispatch_is_authorized(
    platform: Platform, tmp_path: Path
) -> None:
    """Proves the registration is an explicit, recorded step of the first publication: at the moment before
    the pre-dispatch commit it is already in the platform database with the run's tenant, the target's name,
    provider and location, and the run that created it; no options are copied from the run."""
    seen: list[list[dict[str, Any]]] = []

    def look(point: str) -> None:
        if point == crashpoints.BEFORE_PREDISPATCH_COMMIT:
            seen.append(_rows(platform))

    crashpoints.set_hook(look)
    run = _run(platform, tmp_path)
    assert run.status == "succeeded", run.error_message
    [[row]] = seen
    assert (row["tenant"], row["name"], row["provider"], row["location"]) == (
        "acme", "analytics.totals", "parquet", "sink",
    )  # fmt: skip
    assert row["created_by_run"] == run.run_id and row["options_json"] == "{}"
    with platform.db.read() as conn:
        stored = registry.get_datasource(conn, "analytics.totals", tenant="acme")
    assert stored.created_by_run == run.run_id and stored.registered_at.tzinfo is not None
    assert _rows(platform) == [row]


def test_registering_the_same_target_again_is_a_no_op(platform: Platform, tmp_path: Path) -> None:
    """Proves a second run (another definition, same datasource, provider and location) publishes normally and
    leaves the first registration as it was; register_target itself answers created once, then not."""
    first = _run(platform, tmp_path, key="k1", name="first")
    second = _run(platform, tmp_path, key="k2", name="second")
    assert (first.status, second.status) == ("succeeded", "succeeded")
    [row] = _rows(platform)
    assert row["created_by_run"] == first.run_id
    target = {"datasource": "lake.orders", "provider": "delta", "location": "orders"}
    with platform.db.begin() as conn:
        made = registry.register_target(conn, "acme", target, "run-a")
        again = registry.register_target(conn, "acme", target, "run-b")
    assert (made.created, again.created) == (True, False)
    assert again.datasource == made.datasource and again.datasource.created_by_run == "run-a"


def test_concurrent_registrations_of_one_target_record_it_once(db: Database) -> None:
    """Proves two workers registering the same target at the same time both succeed and exactly one of them
    recorded it (INSERT ... ON CONFLICT DO NOTHING, then compare), on both engines."""
    target = {"datasource": "analytics.totals", "provider": "parquet", "location": "sink"}
    barrier = threading.Barrier(2)
    answers: list[Any] = []

    def register(run_id: str) -> None:
        barrier.wait()
        try:
            with db.begin() as conn:
                answers.append(registry.register_target(conn, "acme", target, run_id))
        except Exception as error:
            answers.append(error)

    threads = [threading.Thread(target=register, args=(f"run-{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(isinstance(a, registry.Registration) for a in answers), answers
    assert sorted(a.created for a in answers) == [False, True]
    with db.read() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM datasources")).scalar_one() == 1


def test_a_name_registered_at_another_location_fails_the_run_before_dispatch(
    platform: Platform, tmp_path: Path
) -> None:
    """Proves the name registered for the tenant with another location is a conclusive failure before anything is
    created: failed / no_external_output, no dispatch.authorized, no folder at the new location, and the error
    names the conflict (the tenant's own registration, its run and location)."""
    first = _run(platform, tmp_path, location="sink")
    assert first.status == "succeeded"
    moved = _run(platform, tmp_path, location="elsewhere", key="k2", name="other")
    assert (moved.status, moved.recovery_status) == ("failed", "no_external_output")
    assert moved.error_message is not None
    assert moved.error_message.startswith("the target cannot be published to: the datasource 'analytics.totals'")
    assert first.run_id in moved.error_message and "'sink'" in moved.error_message
    assert "dispatch.authorized" not in flows.kinds(platform, moved.run_id)
    assert not (tmp_path / "elsewhere").exists()
    with platform.db.begin() as conn, pytest.raises(InputError, match="already registered"):
        registry.register_target(
            conn, "acme", {"datasource": "analytics.totals", "provider": "delta", "location": "sink"}, "r"
        )
    assert [r["location"] for r in _rows(platform)] == ["sink"]


def test_another_tenants_datasource_of_the_same_name_neither_conflicts_nor_shows(
    platform: Platform, tmp_path: Path
) -> None:
    """Proves names are per tenant: globex publishing `analytics.totals` at its own location succeeds beside
    acme's, acme's conflicting run names only acme's registration (never globex's run or location), and each
    tenant's listing holds its own registration and the platform's declarations, never the other tenant's."""
    acme = _run(platform, tmp_path / "acme", location="sink")
    globex = _run(platform, tmp_path / "globex", location=CANARY_LOCATION, tenant="globex")
    assert (acme.status, globex.status) == ("succeeded", "succeeded"), globex.error_message
    conflicting = _run(platform, tmp_path / "acme", location="third", key="k3", name="third")
    assert conflicting.status == "failed" and conflicting.error_message is not None
    assert CANARY_LOCATION not in conflicting.error_message and globex.run_id not in conflicting.error_message
    with platform.db.begin() as conn:
        registry.register_datasource(conn, "platform.scratch", "parquet", "scratch", {"allow_overwrite": True})
        listed = {tenant: registry.list_datasources(conn, tenant) for tenant in ("acme", "globex")}
        everything = registry.list_datasources(conn)
    assert [(d.tenant, d.name, d.location) for d in listed["acme"]] == [
        ("acme", "analytics.totals", "sink"), ("*", "platform.scratch", "scratch"),
    ]  # fmt: skip
    assert [(d.tenant, d.location) for d in listed["globex"]] == [("globex", CANARY_LOCATION), ("*", "scratch")]
    assert len(everything) == 3


def test_a_run_registration_never_grants_overwrite(platform: Platform, tmp_path: Path) -> None:
    """Proves the registration stores no options: a run whose target options say allow_overwrite registers a
    datasource whose options are empty, and the platform's declaration of that name is a separate row."""
    defn = flows.definition({**flows.parquet_target(location="sink"), "options": {"allow_overwrite": True}})
    run = platform.runs.run_inline(flows.request(defn, tmp_path, "k1")).run
    assert run.status == "succeeded", run.error_message
    with platform.db.read() as conn:
        mine = registry.get_datasource(conn, "analytics.totals", tenant="acme")
        assert registry.get_datasource_or_none(conn, "analytics.totals") is None  # no platform declaration
    assert mine.options == {}


@pytest.mark.parametrize("registered", [True, False], ids=["registered", "never-registered"])
def test_a_missing_location_says_whether_the_datasource_was_registered(
    platform: Platform, tmp_path: Path, registered: bool
) -> None:
    """Proves a missing location stays Undecided either way, and its reason now tells the two cases apart:
    registered (the platform created it before dispatch: it existed and cannot be seen now) or never registered
    (it may never have existed: a run from before registrations may have created it); nothing is created."""
    if registered:
        run = _run(platform, tmp_path)
        assert run.status == "succeeded"
        (tmp_path / "sink").rename(tmp_path / "unmounted")
        target = run.target
        tenant = run.tenant
    else:
        run = None
        target = flows.parquet_target(location="sink")
        tenant = "acme"
    assert target is not None
    provider = ParquetFolderProvider()
    found = provider.inspect(
        "k", contract.PublishTarget("analytics.totals", "sink", "append", {"base_dir": str(tmp_path)}), fence=7
    )
    assert isinstance(found, Undecided) and found.reason.endswith(LOCATION_MISSING)
    with platform.db.read() as conn:
        explained = registry.explain_undecided(conn, tenant, target, found)
    assert isinstance(explained, Undecided) and explained.reason.startswith(found.reason)
    if run is not None:
        assert explained.reason.endswith(registry.LOCATION_REGISTERED.format(run=run.run_id))
    else:
        assert explained.reason.endswith(registry.LOCATION_NOT_REGISTERED)
    assert str(tmp_path) not in explained.reason
    assert not (tmp_path / "sink").exists()


def test_only_a_missing_location_is_explained(platform: Platform, tmp_path: Path) -> None:
    """Proves explain_undecided leaves every other answer as it is (Absent, another Undecided), and that another
    tenant's registration, or one at another location, does not count as this target's."""
    run = _run(platform, tmp_path)
    assert run.target is not None
    missing = Undecided(f"parquet inspection of key 'k' failed: {LOCATION_MISSING}")
    with platform.db.read() as conn:
        assert registry.explain_undecided(conn, "acme", run.target, Absent(3)) == Absent(3)
        other = Undecided("injected fault: the sink could not be inspected")
        assert registry.explain_undecided(conn, "acme", run.target, other) == other
        for tenant, target in (
            ("globex", run.target),
            ("acme", {**run.target, "location": "elsewhere"}),
            ("acme", {**run.target, "provider": "delta"}),
            ("acme", None),
        ):
            explained = registry.explain_undecided(conn, tenant, target, missing)
            assert isinstance(explained, Undecided)
            assert explained.reason.endswith(registry.LOCATION_NOT_REGISTERED), (tenant, target)


def test_the_registration_refuses_what_cannot_be_stored(db: Database) -> None:
    """Proves register_target refuses a NUL, an empty or an oversized field, and the platform's tenant '*', with
    InputError, storing nothing (PostgreSQL cannot store NUL; a name may hold any other character a definition
    allows)."""
    good = {"datasource": "x\x1b[31m\u202e", "provider": "parquet", "location": "sink"}
    bad = [
        {**good, "datasource": "a\x00b"},
        {**good, "location": ""},
        {**good, "provider": "p" * 101},
        {**good, "location": None},
    ]
    with db.begin() as conn:
        for target in bad:
            with pytest.raises(InputError):
                registry.register_target(conn, "acme", target, "run-1")
        with pytest.raises(InputError, match="never for the platform"):
            registry.register_target(conn, "*", good, "run-1")
        assert registry.register_target(conn, "acme", good, "run-1").created
    with db.read() as conn:
        assert [d.name for d in registry.list_datasources(conn, "acme")] == [good["datasource"]]


def _alembic(db: Database, action: str, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    with db.begin() as conn:
        config.attributes["connection"] = conn
        getattr(command, action)(config, revision)


def test_migration_0006_gives_existing_datasources_the_platform_tenant(db_url: str) -> None:
    """Proves upgrading a 0005 database keeps each declared datasource, now as the platform's (tenant '*', no
    run), still found by name; registrations then coexist per tenant; a downgrade keeps the declarations."""
    db = Database(db_url)
    try:
        migrations.upgrade(db, "0005_run_workspace")
        with db.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO datasources (name, provider, location, options_json, registered_at) "
                    "VALUES ('globex.scratch', 'parquet', 'scratch', '{\"allow_overwrite\": true}', :at)"
                ),
                {"at": "2026-01-02 03:04:05+00:00"},
            )
        migrations.upgrade(db)
        assert migrations.current_revision(db) == migrations.HEAD_REVISION
        with db.begin() as conn:
            declared = registry.get_datasource(conn, "globex.scratch")
            assert (declared.tenant, declared.created_by_run) == ("*", None)
            assert declared.options == {"allow_overwrite": True}
            target = {"datasource": "globex.scratch", "provider": "delta", "location": "elsewhere"}
            assert registry.register_target(conn, "acme", target, "run-1").created
        _alembic(db, "downgrade", "0005_run_workspace")
        with db.read() as conn:
            rows = conn.execute(sa.text("SELECT name, location FROM datasources")).all()
        assert [tuple(r) for r in rows] == [("globex.scratch", "scratch")]
        migrations.upgrade(db)
        with db.read() as conn:
            assert registry.get_datasource(conn, "globex.scratch").tenant == "*"
    finally:
        db.dispose()


def test_v1_datasources_lists_the_callers_tenant_only(platform: Platform, tmp_path: Path) -> None:
    """Proves GET /v1/datasources shows a tenant its own registrations and the platform's declarations, with
    their tenant: never another tenant's registration (its name, location or run)."""
    acme = _run(platform, tmp_path / "acme", location="sink")
    globex = _run(platform, tmp_path / "globex", location=CANARY_LOCATION, tenant="globex", name="g")
    assert (acme.status, globex.status) == ("succeeded", "succeeded")
    with platform.db.begin() as conn:
        registry.register_datasource(conn, "platform.scratch", "parquet", "scratch", {})
    viewer = tokens.create_token(platform.db, "acme", "viewer", "acme-viewer")[0]
    with TestClient(create_app(platform, data_root=tmp_path / "data")) as client:
        answer = client.get("/v1/datasources", headers={"Authorization": f"Bearer {viewer}"})
    assert answer.status_code == 200, answer.text
    listed = answer.json()["datasources"]
    assert [(d["tenant"], d["name"], d["location"]) for d in listed] == [
        ("acme", "analytics.totals", "sink"), ("*", "platform.scratch", "scratch"),
    ]  # fmt: skip
    assert listed[0]["created_by_run"] == acme.run_id
    assert CANARY_LOCATION not in answer.text and globex.run_id not in answer.text


@pytest.mark.parametrize("option", ["apikey", "ApiKey", "api_key", "db_password", "passwd", "DSN", "auth_token"])
def test_one_credential_word_list_for_definitions_and_datasources(db: Database, option: str) -> None:
    """Proves a definition's target options and a declared datasource's options refuse a plain value under the same
    credential-like names, from the one list in datasources.contract (`apikey` was refused by one, not the other)."""
    assert contract.is_credential_option(option)
    assert not hasattr(definitions, "CREDENTIAL_OPTION_WORDS")
    with pytest.raises(pydantic.ValidationError, match="looks like a credential"):
        definitions.TargetSpec.model_validate(
            {"type": "datasources.publication", "provider": "postgres", "datasource": "d", "location": "t",
             "options": {option: "plain-value"}}
        )  # fmt: skip
    with db.begin() as conn, pytest.raises(InputError, match="credential"):
        registry.register_datasource(conn, "x", "postgres", "t", {option: "plain-value"})
    assert not contract.is_credential_option("batch_size")


def test_forward_prepare_target_registers_through_the_service(platform: Platform, tmp_path: Path) -> None:
    """Proves forward.prepare_target (the step every forward attempt takes before execution) records the
    registration through the run's service, and that it also creates the location."""
    defn = flows.definition(flows.parquet_target(location="prepared"))
    submitted = platform.runs.submit(flows.request(defn, tmp_path, "queued"))
    run = submitted.run
    forward.prepare_target(platform.runs.attempt_of(run, run.attempt), ParquetFolderProvider())
    assert (tmp_path / "prepared" / "_manifests").is_dir()
    [row] = _rows(platform)
    assert (row["tenant"], row["location"], row["created_by_run"]) == ("acme", "prepared", run.run_id)


def test_migration_0010_marks_the_registrations_made_before_locations_were_recorded(db_url: str) -> None:
    """Proves upgrading a 0009 database marks a datasource a run registered with no recorded place
    (`locations_unrecorded`), and neither a declaration nor a registration whose place was recorded; a downgrade
    drops the mark and keeps the rows."""
    db = Database(db_url)
    try:
        migrations.upgrade(db, "0009_partition_tokens")
        insert = (
            "INSERT INTO datasources (tenant, name, provider, location, options_json, registered_at, created_by_run) "
            "VALUES (:tenant, :name, 'parquet', 'sink', '{}', :at, :run)"
        )
        at = "2026-01-02 03:04:05+00:00"
        with db.begin() as conn:
            for tenant, name, run in (("acme", "old", "r-old"), ("acme", "recorded", "r-rec"), ("*", "declared", None)):
                conn.execute(sa.text(insert), {"tenant": tenant, "name": name, "at": at, "run": run})
            conn.execute(
                sa.text(
                    "INSERT INTO datasource_locations (tenant, name, place_digest, identity, created_by_run, "
                    "recorded_at) VALUES ('acme', 'recorded', 'sha256:00', 'id', 'r-rec', :at)"
                ),
                {"at": at},
            )
        migrations.upgrade(db)
        with db.read() as conn:
            marked = {
                name: registry.get_datasource(conn, name, tenant=tenant).locations_unrecorded
                for tenant, name in (("acme", "old"), ("acme", "recorded"), ("*", "declared"))
            }
        assert marked == {"old": True, "recorded": False, "declared": False}
        _alembic(db, "downgrade", "0009_partition_tokens")
        with db.read() as conn:
            assert len(conn.execute(sa.text("SELECT name FROM datasources")).all()) == 3
        migrations.upgrade(db)
    finally:
        db.dispose()
