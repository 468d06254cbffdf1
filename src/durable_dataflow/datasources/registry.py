"""Provider discovery and the registry of named datasources.

Providers are found through the entry-point group `durable_dataflow.providers`, so another
package can add one; tests may register factories in-process. A provider whose optional package
is not installed is a *missing capability*, reported with the extra to install, never an import
crash. Named datasources live in the platform database (`schema.datasources`).
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

from sqlalchemy import Connection, insert, select

from durable_dataflow.core.errors import Conflict, InputError, NotFound
from durable_dataflow.core.hashing import canonical_json
from durable_dataflow.datasources.contract import Capability, MissingCapability, Provider
from durable_dataflow.datasources.schema import (
    DATASOURCE_NAME_CHARS_MAX,
    LOCATION_CHARS_MAX,
    PROVIDER_NAME_CHARS_MAX,
    datasources,
)

ENTRY_POINT_GROUP = "durable_dataflow.providers"
# The optional extra that brings each built-in provider's package, for the error message.
PROVIDER_EXTRAS: Mapping[str, str] = {"delta": "delta", "postgres": "postgres"}
# Option keys that name a credential: their value must be a {"secret": NAME} reference.
SENSITIVE_OPTION = re.compile(r"password|passwd|dsn|token|secret|credential|api_?key", re.IGNORECASE)
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


@dataclass(frozen=True)
class Datasource:
    """A named datasource: which provider, where, and options (secrets only by reference)."""

    name: str
    provider: str
    location: str
    options: Mapping[str, Any]
    registered_at: datetime


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
        if SENSITIVE_OPTION.search(key):
            raise InputError(
                f"option {key!r} looks like a credential: give it as {{'secret': NAME}}, not a plain value"
            )
        if isinstance(value, Mapping):
            _check_options(value, depth + 1)


def _check_text(what: str, value: str, chars_max: int) -> None:
    if not value or len(value) > chars_max:
        raise InputError(f"datasource {what} must have 1..{chars_max} characters")


def register_datasource(
    conn: Connection, name: str, provider: str, location: str, options: Mapping[str, Any]
) -> Datasource:
    """Insert a named datasource; the same name again is a Conflict. Runs in the caller's transaction."""
    _check_text("name", name, DATASOURCE_NAME_CHARS_MAX)
    if not NAME_PATTERN.match(name):
        raise InputError(f"datasource name {name!r} may use letters, digits, '_', '.', '-' only")
    _check_text("provider", provider, PROVIDER_NAME_CHARS_MAX)
    _check_text("location", location, LOCATION_CHARS_MAX)
    _check_options(options)
    options_json = canonical_json(dict(options)).decode("utf-8")
    if get_datasource_or_none(conn, name) is not None:
        raise Conflict(f"datasource {name!r} is already registered")
    registered_at = datetime.now(UTC)
    conn.execute(
        insert(datasources).values(
            name=name,
            provider=provider,
            location=location,
            options_json=options_json,
            registered_at=registered_at,
        )
    )
    return Datasource(name, provider, location, json.loads(options_json), registered_at)


def _row_to_datasource(row: Any) -> Datasource:
    registered_at = row.registered_at
    if registered_at.tzinfo is None:
        # SQLite returns naive datetimes; the column is stored in UTC.
        registered_at = registered_at.replace(tzinfo=UTC)
    return Datasource(row.name, row.provider, row.location, json.loads(row.options_json), registered_at)


def get_datasource_or_none(conn: Connection, name: str) -> Datasource | None:
    """The named datasource, or None."""
    row = conn.execute(select(datasources).where(datasources.c.name == name)).first()
    return None if row is None else _row_to_datasource(row)


def get_datasource(conn: Connection, name: str) -> Datasource:
    """The named datasource; NotFound when it is not registered."""
    found = get_datasource_or_none(conn, name)
    if found is None:
        raise NotFound(f"datasource {name!r} is not registered")
    return found


def list_datasources(conn: Connection) -> list[Datasource]:
    """Every registered datasource by name, at most LIST_DATASOURCES_MAX."""
    rows = conn.execute(select(datasources).order_by(datasources.c.name).limit(LIST_DATASOURCES_MAX))
    return [_row_to_datasource(row) for row in rows]
