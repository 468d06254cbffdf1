"""The provider-adapter contract of DESIGN §9: capabilities, publish and inspect outcomes.

A provider publishes a bounded Arrow table to an external sink under a stable idempotency key,
with the run's attempt number as fencing token, and can later say whether the publication under
that key exists. Every outcome returned here is *conclusive*: the sink itself proved it. Whatever
the provider cannot prove is raised as `Inconclusive` (publish) or returned as `Undecided`
(inspect); the caller never guesses.

The rule every provider implements:
- a key is published at most once, whoever calls and how often (check and write are one atomic
  step at the sink);
- a publish whose token is below the key's fence is refused (`Fenced`), an equal or higher token
  is accepted (the same holder may retry);
- when the key is already published, `AlreadyPublished` wins over `Fenced`;
- `inspect(key, target, fence=m)` on an absent key records the fence at m (the fence only grows)
  atomically with the check, before `Absent(fenced_at=...)` is returned;
- `publish` raises `InputError` only before it touches the sink (a bad key or token, a location
  outside its root, a secret that does not resolve, a table name that does not parse): the caller
  records such an error as a conclusive `Rejected`. Anything that fails after the sink was touched
  is `Rejected` (proven nothing written) or `Inconclusive`, never `InputError`.

A provider may also offer `preflight(target) -> None` (see `preflight` below): it raises
`InputError` for what is knowable without writing, and the platform calls it before the
pre-dispatch commit, so such a target fails the run with no external output instead of reaching
dispatch. A provider without it is fine: its publish still raises `InputError` before any write.

A provider of a sink with a location of its own (a folder, a table directory) also offers
`prepare(target) -> None` (see `prepare` below): it creates the location, and the platform calls it
after preflight and before the pre-dispatch commit. So a location that is missing when `inspect`
looks existed before any dispatch was authorized: it was moved away or is not mounted here, and
`inspect` answers `Undecided`, never `Absent`, and creates nothing (absence is never inferred from
a missing location).

Such a provider also offers `locate(target) -> Location` (see `locate` below): where the target
resolves (`place`, a text the platform keeps only as a digest) and the provider's own identity of
what is there now (a Parquet folder's marker id, a Delta table's id, the PostgreSQL record table's
system identifier and oid), or None when nothing it prepared is there. The platform records both
when a datasource's location is first prepared at a place, and from then on never lets `prepare`
create it again there: a registered location that is missing, or holds another table or folder,
fails a new run before dispatch and keeps reconcile `Undecided` (`forward.check_location`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from durable_dataflow.core import credentials
from durable_dataflow.core.errors import DataflowError, InputError
from durable_dataflow.core.secrets import SecretScope
from durable_dataflow.datasources.objectstore import StoreGrant

if TYPE_CHECKING:
    import pyarrow as pa

# What a provider offers the platform; forward recovery needs both (`registry.require_capabilities`).
# "replace_partition": the provider replaces one partition of its table atomically (its publish honours
# `PublishTarget.partition` and `partition_token`); a target with `mode: replace_partition` needs it.
Capability = Literal["publish", "inspect", "replace_partition"]
WriteMode = Literal["append", "overwrite", "replace_partition"]
# Why a partitioned publish carrying a lower partition token than the sink has applied is refused
# (a conclusive Rejected: nothing written). Operators find runs failed for this reason in operations.md.
SUPERSEDED = "superseded by a later run's publication of this partition"

# Idempotency keys are stable run-derived strings; a generous bound keeps them storable as a
# primary key and as a Delta app id everywhere.
KEY_CHARS_MAX = 512
# Attempt numbers start at 1; 0 is reserved (the Delta provider uses it as a fence marker).
TOKEN_MIN = 1
# What `inspect` answers for a missing location (the platform prepares it before authorizing dispatch).
# A provider's Undecided reason for a missing location contains it: the platform recognizes it by it
# and adds whether the datasource was registered (`registry.explain_undecided`).
LOCATION_MISSING = (
    "the sink location is missing: it existed before dispatch was authorized, "
    "so it may have been moved or not be mounted here"
)


class Inconclusive(DataflowError):
    """The provider cannot prove what happened at the sink: the publication may or may not exist."""

    code = "inconclusive"


class InvalidTarget(InputError):
    """A target no call of `publish` could ever have written to, judged from the target's recorded
    text alone — never from the filesystem or the sink's state, which may have changed since. A
    provider raises it only for such targets (an absolute location where the run's workspace allows
    none, a relative one with no root, a table name that is no identifier), always before touching
    the sink; reconcile takes it as proof that nothing can exist there. A target that fails for
    another reason (a missing secret, a location that resolves outside its root through a symlink)
    is a plain InputError: an earlier attempt may have seen it otherwise."""


def structural_refusal(provider: Provider, target: PublishTarget) -> str | None:
    """The provider's preflight refusal of ``target`` when it is an `InvalidTarget`, else None (a
    provider without preflight, a target it accepts, or one it refuses for another reason)."""
    try:
        preflight(provider, target)
    except InvalidTarget as error:
        return error.message
    except Exception:  # anything else proves nothing about what an earlier attempt could write
        return None
    return None


class LocationGone(DataflowError):
    """The target's datasource was created at this location and it is missing now, or another table or
    folder is in its place (`registry.location_problem`): the run fails before dispatch, and reconcile
    stays Undecided, until the location is back or a platform operator forgets it."""

    code = "location_missing"


class MissingCapability(DataflowError):
    """No such provider is registered, its optional package is missing, or it lacks a capability."""

    code = "missing_capability"


@dataclass(frozen=True)
class PublicationRefs:
    """Where a publication lives: the publication itself, its datasource and the materialization."""

    publication_ref: str
    datasource_ref: str
    materialization_ref: str


@dataclass(frozen=True)
class PublishTarget:
    """A publication target. `options` may hold `{"secret": NAME}` references, resolved at call time
    through `secrets` (the run's scope: a tenant's grants, or the local operator's).

    `absolute_locations` False confines a file sink to `options['base_dir']` (a tenant's sink root).

    With `mode` "replace_partition", `partition` maps each partition column to its value (the run's
    parameters resolved) and `partition_token` is the platform's monotonic token for that partition,
    taken in the pre-dispatch commit: the publication replaces exactly the rows whose columns equal
    those values, and is refused (`Rejected`, SUPERSEDED) when the sink already applied a higher token
    to the partition. Both are None for the other modes.
    """

    datasource: str
    location: str
    mode: WriteMode = "append"
    options: Mapping[str, Any] = field(default_factory=dict)
    absolute_locations: bool = True
    secrets: SecretScope = field(default_factory=SecretScope.local)
    partition: Mapping[str, Any] | None = None
    partition_token: int | None = None
    # An s3:// location must lie in one of these prefixes granted for writing (`objectstore.confine`);
    # None: the local operator, who may use any bucket its credentials reach.
    store_grants: tuple[StoreGrant, ...] | None = None


def partition_of(target: PublishTarget) -> tuple[Mapping[str, Any], int]:
    """The partition values and token of a "replace_partition" target; InputError (before the sink is
    touched) when either is missing or the token is no positive integer."""
    if not target.partition or target.partition_token is None:
        raise InputError("a replace_partition publication needs its partition values and partition token")
    check_token(target.partition_token, "partition token")
    return target.partition, target.partition_token


def typed_scalar(value: Any, arrow_type: pa.DataType) -> pa.Scalar:
    """`pa.scalar(value).cast(arrow_type)` without making pyarrow import pandas for a string, integer or
    boolean value (a run's canonical partition values are these): pyarrow looks for pandas on every
    conversion of a Python value, ≈ 0.4 s of CPU and 40 MiB where pandas is installed, once per process
    (a `dataflow run` publishing one partition paid it). The value is put into one row of Arrow buffers
    and cast by Arrow as before, so the same values fit, or raise the same Arrow errors; any other value
    (a date or decimal literal, an integer outside int64, text that is not UTF-8) goes through
    `pa.scalar`."""
    import pyarrow as pa

    source: pa.Array | None = None
    if isinstance(value, bool):
        source = pa.Array.from_buffers(pa.bool_(), 1, [None, pa.py_buffer(b"\x01" if value else b"\x00")])
    elif isinstance(value, int) and -(2**63) <= value < 2**63:
        source = pa.Array.from_buffers(pa.int64(), 1, [None, pa.py_buffer(value.to_bytes(8, "little", signed=True))])
    elif isinstance(value, str):
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError:
            data = None
        if data is not None and len(data) < 2**31:
            offsets = pa.py_buffer((0).to_bytes(4, "little") + len(data).to_bytes(4, "little"))
            source = pa.Array.from_buffers(pa.string(), 1, [None, offsets, pa.py_buffer(data)])
    if source is None:
        return pa.scalar(value).cast(arrow_type)
    return source[0].cast(arrow_type)


def partition_values(partition: Mapping[str, Any], schema: pa.Schema) -> dict[str, Any]:
    """Each partition value as the Python value of its column's Arrow type in `schema` (a date column
    gets a date, not its text); InputError naming the column (never the value) when a column is
    missing or the value does not fit its type."""
    import pyarrow as pa

    typed: dict[str, Any] = {}
    for column, value in partition.items():
        if column not in schema.names:
            raise InputError(f"the rows have no partition column {column!r}")
        try:
            typed[column] = typed_scalar(value, schema.field(column).type).as_py()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            raise InputError(f"the partition value of column {column!r} does not fit the column's type") from None
        if typed[column] is None:
            raise InputError(f"the partition value of column {column!r} is null")
    return typed


def superseded(applied: int) -> Rejected:
    """The refusal of a partitioned publish whose token is below `applied`, the sink's highest."""
    return Rejected(f"{SUPERSEDED} (partition token {applied} was applied)")


@dataclass(frozen=True)
class Published:
    """This call created the publication under the key."""

    refs: PublicationRefs
    digest: str


@dataclass(frozen=True)
class AlreadyPublished:
    """The key was already published: nothing written; the stored refs and stored digest returned."""

    refs: PublicationRefs
    digest: str


@dataclass(frozen=True)
class Fenced:
    """A fence above the caller's token exists for this key: nothing written."""

    token_seen: int


@dataclass(frozen=True)
class Rejected:
    """The sink proved nothing was created (e.g. the schema does not fit the existing table)."""

    reason: str


@dataclass(frozen=True)
class Present:
    """The key is published, with the stored digest and the token it was published under."""

    refs: PublicationRefs
    digest: str
    token: int


@dataclass(frozen=True)
class Absent:
    """The sink proved no publication exists under the key; `fenced_at` is the durable fence, if any."""

    fenced_at: int | None


@dataclass(frozen=True)
class Undecided:
    """The inspection could not prove presence or absence; the reason says why."""

    reason: str


@dataclass(frozen=True)
class Location:
    """Where a target resolves and what is there (`locate`). `place` describes the resolved location
    (an absolute folder, a database and table) and is never shown: the platform keeps its digest.
    `identity` is the provider's id of the location it prepared there, None when there is none.
    `occupied`: with no identity, something this provider could publish into is there all the same
    (a Parquet folder laid out before folders carried a marker), so it is not "nothing there"."""

    place: str
    identity: str | None
    occupied: bool = False


PublishOutcome = Published | AlreadyPublished | Fenced | Rejected
InspectOutcome = Present | Absent | Undecided


@runtime_checkable
class Provider(Protocol):
    """A sink adapter. Constructed with no arguments (entry points) or with keyword options."""

    name: str
    capabilities: frozenset[Capability]

    def publish(
        self, key: str, token: int, table: pa.Table, digest: str, target: PublishTarget
    ) -> PublishOutcome:
        """Publish `table` under `key` at most once; see the module docstring for the rule."""
        ...

    def inspect(self, key: str, target: PublishTarget, fence: int | None = None) -> InspectOutcome:
        """Say whether `key` is published; with a fence, record it atomically with an absence."""
        ...


def preflight(provider: Provider, target: PublishTarget) -> None:
    """Run the provider's optional `preflight(target)`: the checks knowable without writing (the
    location resolves inside its root, the secrets resolve, the table name parses). It never touches
    the sink and raises `InputError` with a fixed reason; a provider without it passes."""
    check = getattr(provider, "preflight", None)
    if check is not None:
        check(target)


def prepare(provider: Provider, target: PublishTarget) -> None:
    """Run the provider's optional `prepare(target)`: create the sink location (a folder and what
    publish needs inside it) before dispatch can be authorized, so that `inspect` can tell a location
    where nothing was published from one it cannot see. It raises `InputError` for a target it
    refuses, and `OSError` (or a `DataflowError` with a fixed reason, as the PostgreSQL sink's
    `ExecutionError` when its database cannot be reached) when the location cannot be created; a
    provider without it passes."""
    create = getattr(provider, "prepare", None)
    if create is not None:
        create(target)


# The kinds of partition column (as definitions.partition_column_kind names them) a provider with the
# replace_partition capability can select exactly, unless it declares fewer in `partition_kinds`.
PARTITION_KINDS = frozenset({"string", "int", "bool", "date", "timestamp", "decimal"})


def partition_kinds(provider: Provider) -> frozenset[str]:
    """The provider's optional `partition_kinds` attribute: the partition column kinds it replaces
    exactly (all of PARTITION_KINDS when it declares none)."""
    declared = getattr(provider, "partition_kinds", None)
    return PARTITION_KINDS if declared is None else frozenset(declared)


def locate(provider: Provider, target: PublishTarget) -> Location | None:
    """Run the provider's optional `locate(target)`: where the target resolves and the identity of
    what the provider prepared there (None: nothing is there). It creates nothing; it raises
    `InputError` as `preflight` does, and `OSError` or a `DataflowError` with a fixed reason when the
    location cannot be looked at. A provider without it answers None: its locations are not tracked."""
    find = getattr(provider, "locate", None)
    if find is None:
        return None
    found = find(target)
    if not isinstance(found, Location):
        raise TypeError("a provider's locate must return a Location")
    return found


def is_credential_option(name: str) -> bool:
    """Whether an option of this name holds a credential, so its value must be a `{"secret": NAME}`
    reference, never the value itself: for datasource options (registry) and a definition's target
    options (dataflow.definitions.definitions). The words are core's one list
    (`core.credentials.CREDENTIAL_WORDS`), the same the database URL scrubber hides."""
    return credentials.is_credential_name(name)


def check_key(key: str) -> None:
    """Refuse an empty, oversized or control-character key before anything touches the sink."""
    if not key or len(key) > KEY_CHARS_MAX:
        raise InputError(f"idempotency key must have 1..{KEY_CHARS_MAX} characters")
    if any(ord(ch) < 32 for ch in key):
        raise InputError("idempotency key must not contain control characters")


def check_token(token: int, what: str = "token") -> None:
    """Refuse a fencing token that is not a positive attempt number."""
    if isinstance(token, bool) or not isinstance(token, int) or token < TOKEN_MIN:
        raise InputError(f"{what} must be an integer >= {TOKEN_MIN}, got {token!r}")


def resolve_location(target: PublishTarget) -> Path:
    """The absolute sink path: `location` itself if absolute (and allowed), else relative to
    options['base_dir'].

    A relative location must stay inside base_dir (no `..` escape, no symlink out); a relative
    location without a base_dir is refused rather than resolved against the process's working
    directory. Messages name the rule, never the location (it may be a tenant's input).
    """
    return resolve_location_named(target)[0]


def resolve_location_named(target: PublishTarget) -> tuple[Path, str]:
    """The absolute sink path (as `resolve_location`) and the name a file sink's refs give it.

    The name of a relative location is the resolved path relative to options['base_dir'] (the
    run's sink root), in POSIX form, '.' for base_dir itself: refs returned to a tenant never
    carry the server's absolute sink path. An absolute location (the local operator only) is
    named by itself.
    """
    location = Path(target.location)
    if location.is_absolute():
        if not target.absolute_locations:
            raise InvalidTarget("the target location must be relative to the sink root")
        if ".." in location.parts:
            raise InvalidTarget("the target location must not contain '..'")
        return location, str(location)
    base_dir = target.options.get("base_dir")
    if not isinstance(base_dir, str | Path):
        raise InvalidTarget("the target location is relative: give an absolute path or base_dir")
    base = Path(base_dir).resolve()
    resolved = (base / location).resolve()
    if resolved != base and base not in resolved.parents:
        raise InputError("the target location escapes its base directory")
    return resolved, resolved.relative_to(base).as_posix()


def describe_exception(exc: BaseException) -> str:
    """An exception as a reason may carry it: its type, and for an OSError the OS's text for its errno.

    Library and OS messages quote absolute sink paths (delta-rs, pyarrow, an OSError's filename)
    and values, so they never reach a Rejected/Inconclusive/Undecided reason: the caller puts a
    fixed description of what failed in front of this.
    """
    name = type(exc).__name__
    if isinstance(exc, OSError) and isinstance(exc.errno, int) and exc.errno > 0:
        return f"{name}: {os.strerror(exc.errno)}"
    return name
