"""Provider discovery and the registry of named datasources.

Providers are found through the entry-point group `durable_dataflow.providers`, so another
package can add one; tests may register factories in-process. A provider whose optional package
is not installed is a *missing capability*, reported with the extra to install, never an import
crash. Named datasources live in the platform database (`schema.datasources`), per tenant: the
platform's declarations (`register_datasource`, tenant `PLATFORM_DECLARED`) and the registrations
that a tenant's first publication to a datasource records before its dispatch can be authorized
(`register_target`), which let an inspection that finds the location missing say whether the
platform created it (`explain_undecided`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from typing import Any

from sqlalchemy import Connection, delete, func, insert, or_, select, update

from durable_dataflow.core import hashing, ledger
from durable_dataflow.core.db import Database, insert_if_absent
from durable_dataflow.core.errors import Conflict, InputError, NotFound
from durable_dataflow.core.hashing import canonical_json
from durable_dataflow.core.names import check_tenant
from durable_dataflow.core.secrets import Secret
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    Capability,
    InspectOutcome,
    Location,
    MissingCapability,
    Provider,
    Undecided,
    is_credential_option,
)
from durable_dataflow.datasources.schema import (
    DATASOURCE_NAME_CHARS_MAX,
    LOCATION_CHARS_MAX,
    LOCATION_IDENTITY_CHARS_MAX,
    PLATFORM_DECLARED,
    PROVIDER_NAME_CHARS_MAX,
    RUN_ID_CHARS_MAX,
    TENANT_CHARS_MAX,
    datasource_locations,
    datasources,
)

ENTRY_POINT_GROUP = "durable_dataflow.providers"
# The optional extra that brings each built-in provider's package, for the error message.
PROVIDER_EXTRAS: Mapping[str, str] = {"delta": "delta", "postgres": "postgres"}
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
LIST_DATASOURCES_MAX = 10_000
OPTIONS_NESTING_MAX = 8

ProviderFactory = Callable[[], Provider]

_registered: dict[str, ProviderFactory] = {}
_registered_lock = threading.Lock()


def register_provider(name: str, factory: ProviderFactory) -> None:
    """Register a provider factory in this process; it shadows an entry point of the same name."""
    with _registered_lock:
        _registered[name] = factory


def unregister_provider(name: str) -> None:
    """Remove an in-process registration (tests clean up with this)."""
    with _registered_lock:
        _registered.pop(name, None)


def _missing(name: str, exc: BaseException) -> MissingCapability:
    extra = PROVIDER_EXTRAS.get(name)
    hint = f": pip install 'durable-dataflow[{extra}]'" if extra else ""
    missing_module = getattr(exc, "name", None) or str(exc)
    return MissingCapability(
        f"provider {name!r} is not available: its package {missing_module!r} is not installed{hint}"
    )


def load_provider(name: str) -> Provider:
    """Construct the provider registered under `name` (in-process first, then entry points)."""
    with _registered_lock:
        factory = _registered.get(name)
    if factory is None:
        matches = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
        if not matches:
            known = ", ".join(available_providers()) or "none"
            raise MissingCapability(f"the target's provider is not registered (registered providers: {known})")
        try:
            factory = next(iter(matches)).load()
        except ImportError as exc:
            raise _missing(name, exc) from exc
    try:
        provider = factory()
    except ImportError as exc:
        raise _missing(name, exc) from exc
    return provider


def available_providers() -> list[str]:
    """Names of every provider registered in-process or through entry points."""
    names = {ep.name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)}
    with _registered_lock:
        names.update(_registered)
    return sorted(names)


def require_capabilities(provider: Provider, needed: Iterable[Capability]) -> None:
    """Raise MissingCapability naming every capability in `needed` the provider does not declare."""
    missing = sorted(set(needed) - set(provider.capabilities))
    if missing:
        raise MissingCapability(f"provider {provider.name!r} lacks the capabilities {', '.join(missing)}")


# What explain_undecided adds to a provider's LOCATION_MISSING reason; fixed texts, never a path.
LOCATION_REGISTERED = (
    "the datasource is registered: run {run} recorded it when the platform created this location, "
    "before its dispatch could be authorized, so the location existed and cannot be seen now "
    "(restore or mount it; see docs/operations.md)"
)
LOCATION_NOT_REGISTERED = (
    "the datasource has no registration for this location: it may never have existed, but a run "
    "from before registrations were recorded may have created it, so nothing is concluded "
    "(see docs/operations.md)"
)


@dataclass(frozen=True)
class Datasource:
    """A named datasource: which provider, where, and options (secrets only by reference).

    `tenant` is PLATFORM_DECLARED for a datasource the platform declared for every tenant, else the
    tenant whose run `created_by_run` registered it with its first publication."""

    name: str
    provider: str
    location: str
    options: Mapping[str, Any]
    registered_at: datetime
    tenant: str = PLATFORM_DECLARED
    created_by_run: str | None = None
    # Registered by a publication before locations were recorded (migration 0010), until forgotten.
    locations_unrecorded: bool = False


@dataclass(frozen=True)
class Registration:
    """The answer of `register_target`: the registered datasource, and whether this call recorded it."""

    datasource: Datasource
    created: bool


def _check_options(options: Mapping[str, Any], depth: int = 0) -> None:
    """Refuse a plain value under a credential-like key anywhere in the options."""
    if depth > OPTIONS_NESTING_MAX:
        raise InputError(f"datasource options nest deeper than {OPTIONS_NESTING_MAX} levels")
    for key, value in options.items():
        if not isinstance(key, str):
            raise InputError("datasource option names must be strings")
        if isinstance(value, Mapping) and set(value) == {"secret"}:
            if not isinstance(value["secret"], str):
                raise InputError(f"option {key!r}: a secret reference names the secret as a string")
            continue
        if is_credential_option(key):
            raise InputError(
                f"option {key!r} looks like a credential: give it as {{'secret': NAME}}, not a plain value"
            )
        if isinstance(value, Mapping):
            _check_options(value, depth + 1)


def _check_text(what: str, value: object, chars_max: int) -> str:
    if not isinstance(value, str) or not value or len(value) > chars_max:
        raise InputError(f"datasource {what} must have 1..{chars_max} characters")
    if "\x00" in value:  # PostgreSQL cannot store it; no name or location needs it
        raise InputError(f"datasource {what} must not contain NUL")
    return value


def register_datasource(
    conn: Connection,
    name: str,
    provider: str,
    location: str,
    options: Mapping[str, Any],
    *,
    tenant: str = PLATFORM_DECLARED,
) -> Datasource:
    """Declare a named datasource, for every tenant (PLATFORM_DECLARED) or for one; the same name
    again for that tenant is a Conflict. Runs in the caller's transaction."""
    if tenant != PLATFORM_DECLARED:
        check_tenant(tenant)
    _check_text("name", name, DATASOURCE_NAME_CHARS_MAX)
    if not NAME_PATTERN.match(name):
        raise InputError(f"datasource name {name!r} may use letters, digits, '_', '.', '-' only")
    _check_text("provider", provider, PROVIDER_NAME_CHARS_MAX)
    if provider not in available_providers():
        raise InputError(f"datasource provider must be one of: {', '.join(available_providers())}")
    _check_text("location", location, LOCATION_CHARS_MAX)
    if not location.isprintable():  # shown to operators and tenants; no path or URL needs a control
        raise InputError("datasource location must not contain control characters")
    _check_options(options)
    options_json = canonical_json(dict(options)).decode("utf-8")
    if get_datasource_or_none(conn, name, tenant=tenant) is not None:
        raise Conflict(f"datasource {name!r} is already registered")
    registered_at = datetime.now(UTC)
    conn.execute(
        insert(datasources).values(
            tenant=tenant,
            name=name,
            provider=provider,
            location=location,
            options_json=options_json,
            registered_at=registered_at,
        )
    )
    return Datasource(name, provider, location, json.loads(options_json), registered_at, tenant)


def _insert_if_absent(conn: Connection, values: Mapping[str, Any]) -> bool:
    """INSERT ... ON CONFLICT (tenant, name) DO NOTHING; True when this statement inserted the row."""
    statement = insert_if_absent(conn.dialect.name, datasources, ["tenant", "name"]).values(**values)
    # RETURNING, not rowcount: the row comes back only when this statement inserted it, on both engines.
    return conn.execute(statement.returning(datasources.c.name)).first() is not None


def register_target(conn: Connection, tenant: str, target: Mapping[str, Any], run_id: str) -> Registration:
    """Record the registration of the target's datasource for ``tenant``: the explicit step by which a
    run's first publication to a datasource creates it, recorded (with the run) before the run's
    dispatch can be authorized. Runs in the caller's transaction.

    The same name, provider and location again (another run, a retry, a concurrent worker) is a no-op
    that returns the stored registration. The name registered for this tenant with another provider or
    location is an InputError naming the conflict; another tenant's datasources are never consulted
    (names are per tenant), so nothing here tells one tenant about another's.
    """
    _check_text("tenant", tenant, TENANT_CHARS_MAX)
    if tenant == PLATFORM_DECLARED:
        raise InputError("a run's datasource is registered for its tenant, never for the platform")
    name = _check_text("name", target.get("datasource"), DATASOURCE_NAME_CHARS_MAX)
    provider = _check_text("provider", target.get("provider"), PROVIDER_NAME_CHARS_MAX)
    location = _check_text("location", target.get("location"), LOCATION_CHARS_MAX)
    _check_text("run", run_id, RUN_ID_CHARS_MAX)
    created = _insert_if_absent(
        conn,
        {
            "tenant": tenant,
            "name": name,
            "provider": provider,
            "location": location,
            "options_json": "{}",  # never the run's options: they could declare allow_overwrite
            "registered_at": datetime.now(UTC),
            "created_by_run": run_id,
        },
    )
    stored = get_datasource_or_none(conn, name, tenant=tenant)
    if stored is None:  # the row inserted or found above is gone: a concurrent delete, never ours
        raise Conflict("the datasource registration could not be read back; nothing was published")
    _refuse_conflict(stored, name, provider, location)
    return Registration(stored, created)


def _refuse_conflict(stored: Datasource, name: str, provider: str, location: str) -> None:
    if (stored.provider, stored.location) != (provider, location):
        by = f" by run {stored.created_by_run}" if stored.created_by_run else ""
        raise InputError(
            f"the datasource {name!r} is already registered{by} with provider {stored.provider!r} and location "
            f"{stored.location!r}, not {provider!r} at {location!r}: publish to it there, or name another datasource"
        )



def _target_of(target: Mapping[str, Any] | None) -> tuple[str, str, str] | None:
    if target is None:
        return None
    fields = (target.get("datasource"), target.get("provider"), target.get("location"))
    if not all(isinstance(value, str) and value for value in fields):
        return None
    return str(fields[0]), str(fields[1]), str(fields[2])


def registration_of(conn: Connection, tenant: str, target: Mapping[str, Any] | None) -> Datasource | None:
    """The tenant's registration of exactly this target's datasource (name, provider and location),
    or None: never registered, registered with another provider or location, or only declared by
    the platform (a declaration does not create a location)."""
    named = _target_of(target)
    if named is None or tenant == PLATFORM_DECLARED:
        return None
    stored = get_datasource_or_none(conn, named[0], tenant=tenant)
    if stored is None or (stored.provider, stored.location) != named[1:]:
        return None
    return stored


def explain_undecided(
    conn: Connection, tenant: str, target: Mapping[str, Any] | None, finding: InspectOutcome
) -> InspectOutcome:
    """The inspection's answer, with a missing location's reason saying whether the datasource was
    registered: registered, the platform created the location, so it exists and cannot be seen now;
    not registered, it may never have existed. Either way it stays Undecided (a run from before
    registrations may have created the location without one); any other answer is returned as is."""
    if not isinstance(finding, Undecided) or LOCATION_MISSING not in finding.reason:
        return finding
    registered = registration_of(conn, tenant, target)
    if registered is None:
        return Undecided(f"{finding.reason}; {LOCATION_NOT_REGISTERED}")
    return Undecided(f"{finding.reason}; {LOCATION_REGISTERED.format(run=registered.created_by_run)}")


# The ledger module of the operator's decisions about datasources (`forget_locations`).
LEDGER_MODULE = "datasources"
LOCATIONS_FORGOTTEN = "datasource.locations_forgotten"
# Why a run fails before dispatch, and reconcile stays Undecided, at a recorded location that is no
# longer the one recorded; fixed texts naming the datasource, never the place.
LOCATION_GONE = (
    "the datasource {name!r} {since}, and now "
    + LOCATION_MISSING
    + "; it is not created again, because an earlier publication may be in it: restore or mount it, or, "
    "if it is really gone, a platform operator runs `dataflow datasources forget`"
)
LOCATION_REPLACED = (
    "the datasource {name!r} {since}, and another {what} is there now: nothing is published into it or "
    "concluded from it, because an earlier publication may be in the one that was replaced; restore it, or, "
    "if it is really gone, a platform operator runs `dataflow datasources forget`"
)
LOCATION_UNRECORDED_GONE = (
    "the datasource {name!r} was registered by run {run} before this platform recorded where it created "
    "locations, and "
    + LOCATION_MISSING
    + "; it is not created here, because an earlier publication may be in it: restore or mount it, or, if it "
    "is really gone or was never created here, a platform operator runs `dataflow datasources forget`"
)
LOCATION_RECORDED_LATER = (
    "the datasource {name!r} was recorded at this location by run {run}, after this run's dispatch was authorized "
    "by a version that did not record locations: it may have been created again since, so nothing found there can "
    "prove whether this run published; if it is the location this run was authorized to publish to, a platform "
    "operator runs `dataflow datasources forget` and reconciles again"
)
CREATED_BY = "was created at this location by run {run}"
AUTHORIZED_HERE = "was at this location when this run's dispatch was authorized"
AUTHORIZED_ELSEWHERE = (
    "the datasource {name!r}: this run's target now resolves to another place than the one its dispatch was "
    "authorized at (the sink root, the DSN secret or a symlink changed), so nothing found there can prove "
    "whether it published: point the target back (see docs/operations.md)"
)


@dataclass(frozen=True)
class RecordedLocation:
    """Where a datasource was created (`record_location`): the provider's identity of what was created
    there, and the run whose prepare created or first found it."""

    identity: str
    created_by_run: str


def place_digest(place: str) -> str:
    """The digest a place is kept as: the resolved location itself (a path, a host) is never stored."""
    return hashing.sha256_bytes(place.encode("utf-8", "surrogateescape"))


def _location_key(tenant: str, name: str, place: str) -> Any:
    return (
        (datasource_locations.c.tenant == tenant)
        & (datasource_locations.c.name == name)
        & (datasource_locations.c.place_digest == place_digest(place))
    )


def recorded_location(conn: Connection, tenant: str, name: str, place: str) -> RecordedLocation | None:
    """What was recorded when the tenant's datasource was first prepared at ``place``, or None."""
    row = conn.execute(
        select(datasource_locations.c.identity, datasource_locations.c.created_by_run).where(
            _location_key(tenant, name, place)
        )
    ).first()
    return None if row is None else RecordedLocation(row.identity, row.created_by_run)


def record_location(
    conn: Connection, tenant: str, name: str, place: str, identity: str, run_id: str
) -> RecordedLocation:
    """Record that the datasource was prepared at ``place`` with ``identity`` (a no-op when it already
    was: the first record stays, so a concurrent preparer that saw another identity finds out by
    `location_problem`). Runs in the caller's transaction; returns the stored record."""
    _check_text("location identity", identity, LOCATION_IDENTITY_CHARS_MAX)
    statement = insert_if_absent(conn.dialect.name, datasource_locations, ["tenant", "name", "place_digest"])
    conn.execute(
        statement.values(
            tenant=tenant, name=name, place_digest=place_digest(place), identity=identity,
            created_by_run=run_id, recorded_at=datetime.now(UTC),
        )
    )  # fmt: skip
    stored = recorded_location(conn, tenant, name, place)
    if stored is None:  # deleted by a concurrent forget between the insert and this read
        raise Conflict("the datasource's location record could not be read back; nothing was published")
    return stored


def unrecorded_location_problem(conn: Connection, tenant: str, name: str, found: Location) -> str | None:
    """Why a place where the tenant's datasource has no recorded location cannot be prepared or inspected:
    nothing is there and the datasource was registered before locations were recorded, so the platform
    may have created it there and lost it (`LOCATION_UNRECORDED_GONE`); None otherwise (something is
    there: the run records it as found)."""
    if found.identity is not None or found.occupied:
        return None
    stored = get_datasource_or_none(conn, name, tenant=tenant)
    if stored is None or not stored.locations_unrecorded:
        return None
    return LOCATION_UNRECORDED_GONE.format(name=name, run=stored.created_by_run)


def location_problem(name: str, recorded: RecordedLocation | None, identity: str | None, what: str) -> str | None:
    """Why a datasource recorded at a place cannot be prepared or inspected there now (missing, or
    another ``what`` in its place), or None: never recorded there, or still the one recorded."""
    if recorded is None:
        return None
    return _identity_problem(name, CREATED_BY.format(run=recorded.created_by_run), recorded.identity, identity, what)


def authorized_location_problem(
    name: str, authorized: Mapping[str, Any], place: str, identity: str | None, what: str
) -> str | None:
    """Why a run's target cannot be inspected where it resolves now, judged against the location its
    ``dispatch.authorized`` entry recorded (``{place_digest, identity}``): another place, nothing there,
    or another ``what`` there; None when it is the one the run was authorized to publish to."""
    if authorized.get("place_digest") != place_digest(place):
        return AUTHORIZED_ELSEWHERE.format(name=name)
    return _identity_problem(name, AUTHORIZED_HERE, str(authorized.get("identity")), identity, what)


def _identity_problem(name: str, since: str, expected: str, identity: str | None, what: str) -> str | None:
    if identity == expected:
        return None
    if identity is None:
        return LOCATION_GONE.format(name=name, since=since)
    return LOCATION_REPLACED.format(name=name, since=since, what=what)


def check_name_text(name: object) -> str:
    """A datasource name as `forget_locations` takes it: 1..200 characters of text that encodes as UTF-8
    (a command-line argument that was not UTF-8 arrives with lone surrogates) and no NUL; InputError
    otherwise, never quoting it."""
    text = _check_text("name", name, DATASOURCE_NAME_CHARS_MAX)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError("datasource name must be valid UTF-8 text") from None
    return text


def ledger_subject(tenant: str, name: str) -> str:
    """The ledger subject of a tenant's datasource: 64 hex digits, as a subject id holds at most 64."""
    return hashing.sha256_bytes(f"{tenant}\x00{name}".encode()).removeprefix(hashing.PREFIX)


def forget_locations(
    conn: Connection,
    db: Database,
    tenant: str,
    name: str,
    asked_by: Mapping[str, Any],
    *,
    evidence_key: Secret | None = None,
) -> int:
    """The platform operator's declaration that the tenant's datasource's created locations are really
    gone: their records are deleted (and a registration from before locations were recorded is no
    longer held to them), so the next run creates the location afresh (and a reconcile may then find
    a key absent there). Recorded in the ledger with who asked, in the caller's transaction.
    NotFound when the tenant has no such datasource; returns how many places were forgotten."""
    check_tenant(tenant)
    check_name_text(name)
    if get_datasource_or_none(conn, name, tenant=tenant) is None:
        raise NotFound(f"datasource {name!r} is not registered for tenant {tenant!r}")
    where = (datasource_locations.c.tenant == tenant) & (datasource_locations.c.name == name)
    forgotten = int(conn.execute(select(func.count()).select_from(datasource_locations).where(where)).scalar_one())
    conn.execute(delete(datasource_locations).where(where))
    registered = (datasources.c.tenant == tenant) & (datasources.c.name == name)
    conn.execute(update(datasources).where(registered).values(locations_unrecorded=False))
    ledger.append(
        conn, db, LEDGER_MODULE, ledger_subject(tenant, name), 0, LOCATIONS_FORGOTTEN,
        {"tenant": tenant, "datasource": name, "places_forgotten": forgotten, **asked_by},
        evidence_key=evidence_key,
    )  # fmt: skip
    return forgotten


def _row_to_datasource(row: Any) -> Datasource:
    registered_at = row.registered_at
    if registered_at.tzinfo is None:
        # SQLite returns naive datetimes; the column is stored in UTC.
        registered_at = registered_at.replace(tzinfo=UTC)
    return Datasource(
        row.name,
        row.provider,
        row.location,
        json.loads(row.options_json),
        registered_at,
        row.tenant,
        row.created_by_run,
        bool(row.locations_unrecorded),
    )


def get_datasource_or_none(conn: Connection, name: str, *, tenant: str = PLATFORM_DECLARED) -> Datasource | None:
    """The datasource of that name for ``tenant`` (by default: the platform's declaration), or None."""
    row = conn.execute(
        select(datasources).where(datasources.c.tenant == tenant, datasources.c.name == name)
    ).first()
    return None if row is None else _row_to_datasource(row)


def get_datasource(conn: Connection, name: str, *, tenant: str = PLATFORM_DECLARED) -> Datasource:
    """The datasource of that name for ``tenant`` (by default: the platform's declaration); NotFound
    when there is none."""
    found = get_datasource_or_none(conn, name, tenant=tenant)
    if found is None:
        raise NotFound(f"datasource {name!r} is not registered")
    return found


def list_datasources(conn: Connection, tenant: str | None = None) -> list[Datasource]:
    """What ``tenant`` may see: its own registrations and the platform's declarations; with None,
    every tenant's (the platform operator). By name, at most LIST_DATASOURCES_MAX."""
    query = select(datasources)
    if tenant is not None:
        query = query.where(or_(datasources.c.tenant == tenant, datasources.c.tenant == PLATFORM_DECLARED))
    rows = conn.execute(query.order_by(datasources.c.name, datasources.c.tenant).limit(LIST_DATASOURCES_MAX))
    return [_row_to_datasource(row) for row in rows]
