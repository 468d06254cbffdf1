"""A run's workspace: which folders its sources may read, where its sinks may write, which
secrets it may name — decided when the run is recorded, stored with it, obeyed by every attempt.

Two scopes (docs/security.md):

- ``tenant`` — a run submitted with an API token. Sources resolve under ``<data-root>/<tenant>``
  plus the roots the grants file grants to that tenant; file sinks under ``<sink-root>/<tenant>``;
  absolute and ``..`` locations are refused; secrets only by grant; ``mode: overwrite`` only for an
  operator token or a registered datasource that declares ``allow_overwrite: true``.
- ``local`` — the platform's own operator at a terminal (``dataflow run`` / ``submit``): sources
  under the definition's folder and ``$DATAFLOW_DATA_ROOTS``; sinks relative to the definition's
  folder (absolute locations only with ``DATAFLOW_ALLOW_ABSOLUTE_LOCATIONS=1``); secrets by grant
  or the local default (``core.secrets``).

The workspace is recorded as JSON in the run row, so a worker executes a run with the confinement
it was submitted under, whatever that worker's own environment says. Runs recorded before
workspaces existed read as ``local`` over their ``base_dir`` with absolute sink locations allowed,
exactly as they were accepted.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from durable_dataflow.core import secrets
from durable_dataflow.core.errors import InputError, PermissionDenied
from durable_dataflow.core.files import read_capped
from durable_dataflow.core.names import TENANT_PATTERN
from durable_dataflow.core.secrets import SecretGrant, SecretScope
from durable_dataflow.core.text import validation_problems
from durable_dataflow.datasources import objectstore
from durable_dataflow.datasources.objectstore import StoreGrant

GRANTS_ENV = "DATAFLOW_GRANTS"
DATA_ROOT_ENV = "DATAFLOW_DATA_ROOT"
SINK_ROOT_ENV = "DATAFLOW_SINK_ROOT"
DATA_ROOTS_ENV = "DATAFLOW_DATA_ROOTS"
ABSOLUTE_LOCATIONS_ENV = "DATAFLOW_ALLOW_ABSOLUTE_LOCATIONS"
# The server's default data root (and sink root), relative to its working directory: a folder of
# its own, beside the embedded database, never the working directory itself.
DEFAULT_SERVER_ROOT = Path(".dataflow") / "data"
GRANTS_FILE_BYTES_MAX = 1024 * 1024
OVERWRITE_OPTION = "allow_overwrite"
OVERWRITE_ROLE = "operator"

Scope = Literal["local", "tenant"]


def data_roots_from_env() -> tuple[Path, ...]:
    """The extra directories a local run's sources may read: every entry of ``$DATAFLOW_DATA_ROOTS``,
    each of which must resolve (a symlink loop is refused here, not in the middle of a run)."""
    entries = [Path(p) for p in os.environ.get(DATA_ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    for entry in entries:
        resolved_root(entry, DATA_ROOTS_ENV)
    return tuple(entries)


def resolved_root(path: Path, what: str) -> Path:
    """``path`` resolved; an InputError naming ``what`` when it cannot be (a symlink loop)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (before Python 3.13)
        raise InputError(f"{what}: a root cannot be resolved (a symlink loop, or unreadable)") from None


@dataclass(frozen=True)
class Workspace:
    """Where one run reads and writes."""

    scope: Scope
    base_dir: Path  # relative source paths start here
    data_roots: tuple[Path, ...]  # every source must resolve inside one of these
    sink_root: Path  # relative sink locations start here
    absolute_locations: bool = False  # may a sink location be an absolute path?
    # The object-store prefixes the run may read and write (`objectstore.confine`); None: any bucket its
    # credentials reach (the local operator). A tenant's are its grants, recorded with the run.
    object_stores: tuple[StoreGrant, ...] | None = None

    def as_json(self) -> dict[str, Any]:
        recorded: dict[str, Any] = {
            "scope": self.scope,
            "base_dir": str(self.base_dir),
            "data_roots": [str(p) for p in self.data_roots],
            "sink_root": str(self.sink_root),
            "absolute_locations": self.absolute_locations,
        }
        if self.object_stores is not None:
            recorded["object_stores"] = [grant.as_json() for grant in self.object_stores]
        return recorded

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Workspace:
        scope: Scope = "tenant" if data.get("scope") == "tenant" else "local"
        stores = data.get("object_stores")
        return cls(
            scope=scope,
            base_dir=Path(str(data["base_dir"])),
            data_roots=tuple(Path(str(p)) for p in data.get("data_roots") or ()),
            sink_root=Path(str(data["sink_root"])),
            absolute_locations=bool(data.get("absolute_locations", False)),
            # A tenant run recorded before object stores existed may use none; a local one any.
            object_stores=(
                tuple(StoreGrant.from_json(g) for g in stores) if stores is not None
                else (() if scope == "tenant" else None)
            ),
        )


def local(base_dir: Path) -> Workspace:
    """The platform operator's workspace for a definition in ``base_dir``."""
    flag = os.environ.get(ABSOLUTE_LOCATIONS_ENV, "").strip().lower() in ("1", "true", "yes")
    return Workspace("local", base_dir, (base_dir, *data_roots_from_env()), base_dir, absolute_locations=flag)


def of_run(workspace_json: Mapping[str, Any] | None, base_dir: str, trigger: object = None) -> Workspace:
    """A recorded run's workspace. A run recorded before workspaces existed keeps the roots and sink
    rules it was accepted under, but one submitted through the API gets a tenant's secret scope."""
    if workspace_json is None:
        base = Path(base_dir)
        scope: Scope = "tenant" if trigger == "api" else "local"
        stores = () if scope == "tenant" else None
        roots = (base, *data_roots_from_env())
        return Workspace(scope, base, roots, base, absolute_locations=True, object_stores=stores)
    return Workspace.from_json(workspace_json)


# ---- the grants file -------------------------------------------------------------------------


# A grant's tenant: "*" (every tenant) or a tenant's name as every request names it (core.names): a name
# no request can carry ("acme ", say) would load and never apply.
GrantTenant = Annotated[str, StringConstraints(pattern=rf"^(\*|{TENANT_PATTERN.pattern[1:-1]})$")]


class _SecretGrantModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    env: str | None = Field(default=None, max_length=128)
    file: str | None = Field(default=None, max_length=128)
    tenants: list[GrantTenant] = Field(min_length=1)


class _RootGrantModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, max_length=2000)
    tenants: list[GrantTenant] = Field(min_length=1)


class _StoreGrantModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: str = Field(min_length=6, max_length=1100)
    tenants: list[GrantTenant] = Field(min_length=1)
    access: list[Literal["read", "write"]] = Field(min_length=1)
    endpoint: str | None = Field(default=None, max_length=300)
    region: str | None = Field(default=None, max_length=64)
    allow_http: bool = False


class _GrantsModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    secrets: dict[str, _SecretGrantModel] = {}
    data_roots: list[_RootGrantModel] = []
    object_stores: list[_StoreGrantModel] = []


@dataclass(frozen=True)
class Grants:
    """What the platform operator granted to tenants (``$DATAFLOW_GRANTS``): secrets and extra roots."""

    secrets: Mapping[str, SecretGrant] = field(default_factory=dict)
    data_roots: tuple[tuple[Path, frozenset[str]], ...] = ()
    object_stores: tuple[tuple[StoreGrant, frozenset[str]], ...] = ()

    def roots_for(self, tenant: str) -> tuple[Path, ...]:
        return tuple(p for p, tenants in self.data_roots if secrets.EVERY_TENANT in tenants or tenant in tenants)

    def stores_for(self, tenant: str) -> tuple[StoreGrant, ...]:
        return tuple(g for g, tenants in self.object_stores if secrets.EVERY_TENANT in tenants or tenant in tenants)

    def scope(self, tenant: str | None) -> SecretScope:
        """The secrets a run may name: a tenant's grants, or (``None``) the local operator's scope."""
        return SecretScope(tenant=tenant, grants=dict(self.secrets))


def parse_grants(text: str, origin: str) -> Grants:
    """Parse a grants document (YAML); InputError naming the problem (never a value) otherwise."""
    from durable_dataflow.dataflow.definitions.definitions import parse_yaml_document

    # The definitions' strict reader: a secret named twice is refused (PyYAML keeps the last one
    # silently, with its tenants), and so are anchors and aliases.
    document = parse_yaml_document(text, f"grants file {origin}")
    try:
        model = _GrantsModel.model_validate(document or {})
    except ValidationError as error:
        where = validation_problems(error)
        raise InputError(f"grants file {origin}: {where}") from None
    granted: dict[str, SecretGrant] = {}
    for name, item in model.secrets.items():
        if item.env is not None and item.file is not None:
            raise InputError(f"grants file {origin}: secret {name}: give env or file, not both")
        source: Literal["env", "file"] = "file" if item.file is not None else "env"
        grant = SecretGrant(name, source, item.file or item.env or name, frozenset(item.tenants))
        try:
            secrets.check_grant(grant)
        except InputError as error:
            raise InputError(f"grants file {origin}: secret {name}: {error.message}") from None
        granted[name] = grant
    roots = []
    for root in model.data_roots:
        path = Path(root.path)
        if not path.is_absolute():
            raise InputError(f"grants file {origin}: data_roots: every path must be absolute")
        roots.append((path, frozenset(root.tenants)))
    stores = []
    for index, store in enumerate(model.object_stores):
        where = f"grants file {origin}: object_stores[{index}]"
        prefix = objectstore.parse_url(store.prefix, where)
        endpoint = None
        if store.endpoint is not None:
            endpoint = objectstore.check_endpoint(store.endpoint, store.allow_http, where)
        store_grant = StoreGrant(prefix, frozenset(store.access), endpoint, store.region, store.allow_http)
        stores.append((store_grant, frozenset(store.tenants)))
    return Grants(granted, tuple(roots), tuple(stores))


def grants_from_env() -> Grants:
    """The grants file named by ``$DATAFLOW_GRANTS``, or no grants at all."""
    configured = os.environ.get(GRANTS_ENV)
    if not configured:
        return Grants()
    data = read_capped(Path(configured), GRANTS_FILE_BYTES_MAX, f"{GRANTS_ENV}: the grants file")
    return parse_grants(data.decode("utf-8", errors="replace"), GRANTS_ENV)


# ---- the server's tenancy ----------------------------------------------------------------------


@dataclass(frozen=True)
class Tenancy:
    """The server's confinement: one data root and one sink root, a subtree per tenant, the grants."""

    data_root: Path
    sink_root: Path
    grants: Grants = field(default_factory=Grants)

    def workspace(self, tenant: str) -> Workspace:
        base = self.data_root / tenant
        roots = (base, *self.grants.roots_for(tenant))
        return Workspace("tenant", base, roots, self.sink_root / tenant, object_stores=self.grants.stores_for(tenant))


def _contains(root: Path, path: Path) -> bool:
    return path == root or path.is_relative_to(root)


def server_tenancy(
    *,
    data_root: Path | None,
    sink_root: Path | None,
    platform_files: tuple[Path, ...],
    grants: Grants | None = None,
) -> Tenancy:
    """The server's tenancy from explicit roots, else ``$DATAFLOW_DATA_ROOT`` / ``$DATAFLOW_SINK_ROOT``,
    else ``./.dataflow/data``. An implicit root that is or contains the working directory, the
    platform database or the secrets folder is refused: the server does not start."""
    explicit = data_root is not None
    chosen = data_root or _env_path(DATA_ROOT_ENV) or DEFAULT_SERVER_ROOT
    resolved = resolved_root(chosen, "--data-root" if explicit else DATA_ROOT_ENV)
    if not explicit:
        _refuse_dangerous_root(resolved, platform_files, DATA_ROOT_ENV)
    sinks = resolved_root(sink_root or _env_path(SINK_ROOT_ENV) or resolved, "--sink-root / " + SINK_ROOT_ENV)
    if sink_root is None and sinks != resolved:
        _refuse_dangerous_root(sinks, platform_files, SINK_ROOT_ENV)
    return Tenancy(resolved, sinks, grants if grants is not None else grants_from_env())


def _env_path(name: str) -> Path | None:
    configured = os.environ.get(name, "").strip()
    return Path(configured) if configured else None


def _refuse_dangerous_root(root: Path, platform_files: tuple[Path, ...], setting: str) -> None:
    guarded = [("the working directory", Path.cwd().resolve())]
    guarded += [("the platform database", f.resolve()) for f in platform_files]
    folder = secrets.secrets_dir()
    if folder is not None:
        guarded.append(("the secrets folder", folder))
    for what, path in guarded:
        if _contains(root, path):
            raise InputError(
                f"the server's data root ({setting} or its default) is or contains {what}: every tenant could "
                "read it. Give --data-root DIR (a folder holding only tenant data, one subfolder per tenant)"
            )


# ---- what a definition may ask for, checked before recording --------------------------------------


def secret_names(target: Mapping[str, Any] | None, source_specs: Iterator[Any]) -> list[tuple[str, str]]:
    """(where, secret name) for every secret reference in the sources and the target options."""
    found: list[tuple[str, str]] = []
    for name, spec in source_specs:
        dsn = getattr(spec, "dsn", None)
        secret = getattr(dsn, "secret", None)
        if isinstance(secret, str):
            found.append((f"source {name!r}", secret))
        options = getattr(spec, "options", None)  # an s3:// source's credentials
        if isinstance(options, Mapping):
            references = objectstore.secret_references(options)
            found.extend((f"source {name!r} option {key!r}", ref) for key, ref in references)
    for key, value in ((target or {}).get("options") or {}).items():
        if isinstance(value, Mapping) and isinstance(value.get("secret"), str):
            found.append((f"target option {key!r}", str(value["secret"])))
    return found


def check_secrets(scope: SecretScope, references: list[tuple[str, str]]) -> None:
    """Every referenced secret must be available in ``scope``; the refusal names where, not what."""
    for where, name in references:
        try:
            scope.check(name)
        except InputError as error:
            raise InputError(f"{where}: {error.message}") from None


def check_location(workspace: Workspace, location: str, options: Mapping[str, Any] | None = None) -> None:
    """A sink location must stay inside the workspace's sink root (absolute only when allowed); an s3://
    location inside a prefix granted for writing, with the store options a tenant may give
    (`objectstore.confine`: credentials as secrets, the grant's endpoint)."""
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in location):
        raise InputError("target location must not contain control characters")
    if objectstore.is_store_url(location):
        url = objectstore.parse_url(location, "target location")
        given = dict(options or {})
        confined = objectstore.confine(url, given, workspace.object_stores, "write", "target")
        objectstore.check_options(confined, "target", objectstore.PLATFORM_OPTIONS)
        return
    path = Path(location)
    if ".." in path.parts:
        raise InputError("target location must not contain '..'")
    if path.is_absolute() and not workspace.absolute_locations:
        raise InputError(
            "target location must be relative: it resolves under the sink root "
            f"(a local operator may allow absolute paths with {ABSOLUTE_LOCATIONS_ENV}=1)"
        )


def check_overwrite(roles: tuple[str, ...], target: Mapping[str, Any], registered: Any | None) -> None:
    """``mode: overwrite`` replaces what is there: an operator may, or the target is exactly a
    registered datasource (same name, provider and location) that declares ``allow_overwrite``."""
    if OVERWRITE_ROLE in roles:
        return
    declared = (
        registered is not None
        and registered.options.get(OVERWRITE_OPTION) is True
        and registered.provider == target.get("provider")
        and registered.location == target.get("location")
    )
    if declared:
        return
    raise PermissionDenied(
        "target mode 'overwrite' needs the operator role, or a registered datasource of that name, "
        f"provider and location whose options declare {OVERWRITE_OPTION}: true"
    )
