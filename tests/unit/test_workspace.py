"""Workspaces, grants and secret scopes: what a run may read, write and name (dataflow.workspace)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import InputError, PermissionDenied
from durable_dataflow.core.secrets import SecretScope
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.execution.workspace import Tenancy, Workspace
from durable_dataflow.datasources.registry import Datasource

CANARY = "canary-7d1c0e"


def _grants(text: str) -> workspace.Grants:
    return workspace.parse_grants(text, "grants.yaml")


def test_a_tenant_names_only_its_granted_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves grants decide: acme may name CRM_DSN (read from CRM_RO), globex may not, nor may acme name
    an environment variable nobody granted, although it is set."""
    monkeypatch.setenv("CRM_RO", CANARY)
    monkeypatch.setenv("UNGRANTED", CANARY)
    grants = _grants("secrets:\n  CRM_DSN: {env: CRM_RO, tenants: [acme]}\n")
    assert grants.scope("acme").resolve("CRM_DSN").reveal() == CANARY
    for tenant, name in (("globex", "CRM_DSN"), ("acme", "UNGRANTED"), ("acme", "CRM_RO")):
        with pytest.raises(InputError) as refused:
            grants.scope(tenant).resolve(name)
        assert CANARY not in refused.value.message


def test_refusals_do_not_reveal_whether_a_variable_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves an ungranted-but-set, an unset and a reserved name get the very same message."""
    monkeypatch.setenv("SET_BUT_UNGRANTED", CANARY)
    monkeypatch.setenv("DATAFLOW_DB", f"postgresql://u:{CANARY}@h/db")
    monkeypatch.delenv("NEVER_SET", raising=False)
    scope = workspace.Grants().scope("acme")
    messages = set()
    for name in ("SET_BUT_UNGRANTED", "NEVER_SET", "DATAFLOW_DB", "dataflow_db"):
        with pytest.raises(InputError) as refused:
            scope.check(name)
        messages.add(refused.value.message)
    assert len(messages) == 1 and CANARY not in messages.pop()


def test_the_platform_settings_are_never_secrets_not_even_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves the local operator's default resolves ordinary variables but never a DATAFLOW_* setting."""
    monkeypatch.setenv("LOCAL_DSN", CANARY)
    monkeypatch.setenv("DATAFLOW_EVIDENCE_KEY", CANARY)
    local = SecretScope.local()
    assert local.resolve("LOCAL_DSN").reveal() == CANARY
    for name in ("DATAFLOW_EVIDENCE_KEY", "DataFlow_Evidence_Key"):
        with pytest.raises(InputError):
            local.resolve(name)


@pytest.mark.parametrize(
    "text",
    [
        "secrets:\n  DATAFLOW_DB: {tenants: [acme]}\n",
        "secrets:\n  PLATFORM: {env: DATAFLOW_DB, tenants: ['*']}\n",
        "secrets:\n  KEY: {file: DATAFLOW_EVIDENCE_KEY, tenants: [acme]}\n",
        "secrets:\n  ESCAPE: {file: ../../etc/passwd, tenants: [acme]}\n",
        "secrets:\n  NOBODY: {tenants: []}\n",
        "secrets:\n  BOTH: {env: A, file: B, tenants: [acme]}\n",
        "data_roots:\n  - {path: relative/dir, tenants: [acme]}\n",
        "secrets: {X: {tenants: [acme], extra: 1}}\n",
        "secrets: [\n",
    ],
)
def test_a_grants_file_that_hands_out_platform_settings_or_escapes_is_refused(text: str) -> None:
    """Proves the grants file cannot grant a DATAFLOW_* setting (by name, env or file), read outside the
    secrets folder, grant to nobody, or carry unknown keys: loading it fails, so nothing starts."""
    with pytest.raises(InputError, match=r"grants file grants\.yaml"):
        _grants(text)


def test_a_grants_file_naming_a_secret_twice_is_refused() -> None:
    """Proves a secret granted twice is refused, naming it and the line: PyYAML kept the last entry
    silently, with its tenants, so the first grant's tenants lost it or others gained it (red team)."""
    text = "secrets:\n  CRM_DSN: {env: CRM_RO, tenants: [acme]}\n  CRM_DSN: {env: CRM_RW, tenants: ['*']}\n"
    with pytest.raises(InputError) as refused:
        _grants(text)
    assert "duplicate key secrets.CRM_DSN" in refused.value.message and "line 3" in refused.value.message


@pytest.mark.parametrize("tenant", ["acme ", "ac/me", "acme\\n", "ac*"])
def test_a_grants_file_naming_no_tenant_a_request_can_carry_is_refused(tenant: str) -> None:
    """Proves a grant's tenant must be "*" or a tenant's name: "acme " loaded and never applied (review)."""
    for text in (f'secrets:\n  CRM_DSN: {{env: CRM_RO, tenants: ["{tenant}"]}}\n',
                 f'data_roots:\n  - {{path: /srv/reference, tenants: ["{tenant}"]}}\n'):  # fmt: skip
        with pytest.raises(InputError) as refused:
            _grants(text)
        assert "tenants.0: String should match pattern" in refused.value.message
        assert "\n" not in refused.value.message
    assert _grants('data_roots:\n  - {path: /srv/reference, tenants: ["*", acme_2, g-1]}\n').data_roots


def test_a_granted_file_secret_reads_from_the_secrets_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "crm_dsn").write_text(CANARY + "\n")
    monkeypatch.setenv("DATAFLOW_SECRETS_DIR", str(tmp_path))
    grants = _grants("secrets:\n  CRM: {file: crm_dsn, tenants: ['*']}\n")
    assert grants.scope("anyone").resolve("CRM").reveal() == CANARY


def test_each_tenant_gets_its_own_subtree_plus_its_granted_roots(tmp_path: Path) -> None:
    grants = _grants(f"data_roots:\n  - {{path: {tmp_path / 'shared'}, tenants: [acme]}}\n")
    tenancy = Tenancy(tmp_path / "data", tmp_path / "sinks", grants)
    acme, globex = tenancy.workspace("acme"), tenancy.workspace("globex")
    assert acme.data_roots == (tmp_path / "data" / "acme", tmp_path / "shared")
    assert globex.data_roots == (tmp_path / "data" / "globex",)
    assert (acme.sink_root, acme.scope, acme.absolute_locations) == (tmp_path / "sinks" / "acme", "tenant", False)
    assert Workspace.from_json(acme.as_json()) == acme


@pytest.mark.parametrize("location", ["/tmp/x", "../globex/table", "a/../../b", "/etc/../tmp"])
def test_a_tenant_sink_location_stays_under_its_sink_root(tmp_path: Path, location: str) -> None:
    space = Tenancy(tmp_path, tmp_path).workspace("acme")
    with pytest.raises(InputError) as refused:
        workspace.check_location(space, location)
    assert location not in refused.value.message
    workspace.check_location(space, "warehouse/daily")


def test_a_local_run_may_use_absolute_locations_only_when_the_operator_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(workspace.ABSOLUTE_LOCATIONS_ENV, raising=False)
    with pytest.raises(InputError, match=workspace.ABSOLUTE_LOCATIONS_ENV):
        workspace.check_location(workspace.local(tmp_path), "/srv/lake/table")
    monkeypatch.setenv(workspace.ABSOLUTE_LOCATIONS_ENV, "1")
    workspace.check_location(workspace.local(tmp_path), "/srv/lake/table")
    with pytest.raises(InputError):
        workspace.check_location(workspace.local(tmp_path), "/srv/../etc")


def test_overwrite_needs_the_operator_role_or_exactly_a_datasource_that_declares_it(tmp_path: Path) -> None:
    """Proves a submitter may overwrite only a target that IS a registered datasource declaring
    allow_overwrite (same provider and location): naming such a datasource for another location or
    provider is refused, as is a datasource without the flag."""
    target = {"provider": "parquet", "datasource": "d", "location": "t", "mode": "overwrite"}

    def registered(provider: str = "parquet", location: str = "t", **options: object) -> Datasource:
        return Datasource("d", provider, location, options, datetime.now(UTC))

    workspace.check_overwrite(("operator",), target, None)
    workspace.check_overwrite(("submitter",), target, registered(allow_overwrite=True))
    refused = (None, registered(), registered(allow_overwrite="true"), registered(allow_overwrite=False),
               registered("delta", allow_overwrite=True), registered(location="x", allow_overwrite=True))
    for other in refused:
        with pytest.raises(PermissionDenied):
            workspace.check_overwrite(("submitter",), target, other)


def test_the_server_refuses_an_implicit_root_that_exposes_its_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the server does not start when its data root (from the environment) is the working
    directory, contains the platform database, or contains the secrets folder; an explicit root is
    the operator's choice."""
    monkeypatch.chdir(tmp_path)
    database = tmp_path / "platform" / "dataflow.db"
    monkeypatch.delenv("DATAFLOW_SECRETS_DIR", raising=False)
    for root in (tmp_path, tmp_path.parent, tmp_path / "platform"):
        monkeypatch.setenv(workspace.DATA_ROOT_ENV, str(root))
        with pytest.raises(InputError, match="--data-root"):
            workspace.server_tenancy(data_root=None, sink_root=None, platform_files=(database,))
    monkeypatch.setenv("DATAFLOW_SECRETS_DIR", str(tmp_path / "data" / "secrets"))
    monkeypatch.setenv(workspace.DATA_ROOT_ENV, str(tmp_path / "data"))
    with pytest.raises(InputError, match="secrets folder"):
        workspace.server_tenancy(data_root=None, sink_root=None, platform_files=(database,))
    monkeypatch.delenv(workspace.DATA_ROOT_ENV)
    default = workspace.server_tenancy(data_root=None, sink_root=None, platform_files=(database,))
    assert default.data_root == (tmp_path / ".dataflow" / "data").resolve() == default.sink_root
    explicit = workspace.server_tenancy(data_root=tmp_path, sink_root=None, platform_files=(database,))
    assert explicit.data_root == tmp_path.resolve()


def test_a_run_recorded_before_workspaces_keeps_its_rules_but_an_api_run_gets_no_local_secrets(
    tmp_path: Path,
) -> None:
    """Proves a run without a recorded workspace (an older database) keeps its base_dir roots and
    absolute sink locations, while one submitted through the API resolves secrets as a tenant."""
    cli_run = workspace.of_run(None, str(tmp_path), "cli")
    api_run = workspace.of_run(None, str(tmp_path), "api")
    assert (cli_run.scope, api_run.scope) == ("local", "tenant")
    assert cli_run.base_dir == api_run.base_dir == tmp_path and cli_run.absolute_locations


def test_the_platform_database_files_are_known_for_a_uri_filename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the SQLite files no source may read are found for `sqlite:///file:/…?uri=true` too (read
    as a plain path, `file:/…` named nothing, so the guard on the database files silently lapsed)."""
    path = tmp_path / "platform.db"
    monkeypatch.chdir(tmp_path)
    for url in (f"sqlite:///{path}", f"sqlite:///file:{path}?uri=true"):
        database = Database(url)
        try:
            assert database.files()[:2] == (path.resolve(), path.resolve().with_name("platform.db-wal")), url
        finally:
            database.dispose()
    assert not (tmp_path / "file:").exists(), "a URI filename was created as a folder relative to the working directory"


def test_a_root_that_is_a_symlink_loop_is_refused_naming_its_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a symlink loop given as DATAFLOW_DATA_ROOTS, --data-root or --sink-root is an InputError
    naming the setting (Path.resolve raised RuntimeError: an internal error, for run and for serve)."""
    (tmp_path / "l1").symlink_to(tmp_path / "l2")
    (tmp_path / "l2").symlink_to(tmp_path / "l1")
    loop = tmp_path / "l1" / "x"
    monkeypatch.setenv(workspace.DATA_ROOTS_ENV, str(loop))
    with pytest.raises(InputError, match=r"^DATAFLOW_DATA_ROOTS: a root cannot be resolved"):
        workspace.data_roots_from_env()
    monkeypatch.delenv(workspace.DATA_ROOTS_ENV)
    with pytest.raises(InputError, match=r"^--data-root: a root cannot be resolved"):
        workspace.server_tenancy(data_root=loop, sink_root=None, platform_files=())
    with pytest.raises(InputError, match=r"^--sink-root / DATAFLOW_SINK_ROOT: a root cannot be resolved"):
        workspace.server_tenancy(data_root=tmp_path, sink_root=loop, platform_files=())
