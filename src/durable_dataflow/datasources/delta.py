"""Delta Lake provider (delta-rs `deltalake`, imported lazily: it is the optional extra `[delta]`).

Encoding (decidable from any one snapshot, see reference/sinks-and-libs.md §1):
- a **publication** of key K under token t is one commit carrying the app transaction
  `Transaction(K, t)` (t >= 1), the rows, and commit metadata `dataflow_kind=publication`,
  `dataflow_key`, `dataflow_digest`, `dataflow_token`, `dataflow_rows`;
- a **fence** of K at m is one commit without rows carrying `Transaction(K, 0)` *and*
  `Transaction(K + "#fence", m)`, with `dataflow_kind=fence`. Restating K (at the reserved version
  0, which no attempt number uses) makes every fence commit conflict with every concurrent commit
  on K, publication or fence, because delta-rs fails a commit when a concurrent commit carries a
  txn with the same app id.
So in a snapshot: `transaction_version(K) >= 1` <=> K is published (under that token);
otherwise `transaction_version(K + "#fence")` is the fence (None: no fence). The provider keeps
the fence monotone and never writes a fence once K is published, so the "last written" value that
delta-rs returns is also the maximum.

Check and commit always use the same `DeltaTable` object: passing a path to `write_deltalake`
reloads the snapshot and reopens the race (probe p1b). On `CommitFailedError` the provider reloads
and decides again, at most COMMIT_ATTEMPTS_MAX times.

An empty append (`write_deltalake(dt, <0-row table of the table's schema>, mode="append")`) makes a
commit with no add actions but with the app transactions and the metadata (probed with deltalake
1.6.6): that is how a fence is written. `prepare` creates the table before dispatch is authorized:
its folder and, when no table is there yet, a table without rows with the one-column placeholder
schema PLACEHOLDER_COLUMN (Delta refuses a table without columns; a creation race is harmless
because no data or txn is involved). A fence on the placeholder table keeps that schema, and the
first publication on it overwrites the schema with the result's. `publish` and `inspect` never
create anything: a location without a `_delta_log` folder (missing, moved away, or an unmounted
mount point, which is an empty folder) holds no table this provider prepared, so it cannot be seen:
`publish` raises `Inconclusive` and `inspect` answers `Undecided` (LOCATION_MISSING), never `Absent`.

Partitions (`mode: replace_partition`, issue 27): the publication is one commit made by
`write_deltalake(dt, rows, mode="overwrite", predicate=P)` on the checked snapshot, where P selects the
partition (`"col" = literal AND ...`, identifiers and string literals quoted with their quote doubled,
a date compared as `CAST('YYYY-MM-DD' AS DATE)`): it removes the partition's files (or rewrites the
files that hold its rows, in a table not partitioned by those columns) and adds the new ones; other
partitions' rows are untouched and readers see the old partition or the new one. It carries, besides
`Transaction(K, t)`, the partition's app transaction `Transaction(PARTITION_APP_PREFIX + digest of the
partition values, partition token)`: its version is the highest partition token applied (the provider
never writes a lower one), and a publish with a lower token is `Rejected` (`contract.SUPERSEDED`).
Two concurrent publications of one partition carry the same app id, so one of them conflicts and is
decided again on the new snapshot. A table the first partitioned publication makes out of the
placeholder is created partitioned by the partition columns (`partition_by`).

Proof horizon: txn entries survive log cleanup through checkpoints (never pass `last_updated`,
so `delta.setTransactionRetentionDuration` cannot expire them). The digest lives in the commit
info, which log cleanup (`delta.logRetentionDuration`, 30 days by default) deletes: after that a
published key is reported `Undecided` / `Inconclusive` with that reason, never guessed.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import ExecutionError, InputError
from durable_dataflow.datasources import objectstore
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    Absent,
    AlreadyPublished,
    Capability,
    Fenced,
    Inconclusive,
    InspectOutcome,
    Location,
    Present,
    PublicationRefs,
    Published,
    PublishOutcome,
    PublishTarget,
    Rejected,
    Undecided,
    check_key,
    check_token,
    describe_exception,
    partition_of,
    partition_values,
    resolve_location_named,
    superseded,
)

COMMIT_ATTEMPTS_MAX = 32
LOG_SCAN_COMMITS_MAX = 100_000
COMMIT_FILE_BYTES_MAX = 64 * 1024 * 1024
FENCE_SUFFIX = "#fence"
FENCE_MARKER_VERSION = 0
PLACEHOLDER_COLUMN = "__durable_dataflow_fence_only__"
COMMIT_FILE = re.compile(r"^(\d{20})\.json$")
# The app id of a partition's transaction: this prefix and the digest of its values.
PARTITION_APP_PREFIX = "dataflow-partition/"


def _quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(column: str, value: Any) -> str:
    """A SQL literal of a typed partition value for the predicate; never built from unchecked text."""
    import datetime as dt

    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return f"CAST('{value.isoformat()}' AS DATE)"
    raise InputError(
        f"partition column {column!r}: the delta provider replaces partitions of string, integer, "
        "boolean and date columns only"
    )


def partition_predicate(values: dict[str, Any]) -> str:
    """The predicate selecting the partition: `"col" = literal` for each column, joined by AND."""
    return " AND ".join(f"{_quote_identifier(c)} = {_literal(c, v)}" for c, v in values.items())


def partition_app_id(partition: Any) -> str:
    """The app id whose version is the highest partition token applied to this partition."""
    return PARTITION_APP_PREFIX + hashing.digest(dict(partition))


def _deltalake() -> Any:
    """The deltalake module; ImportError (reported as a missing capability) when not installed."""
    import deltalake

    return deltalake


class DigestUnprovable(LookupError):
    """The key's txn is recorded but its commit info is gone; the message names the key, never a path."""


def describe_failure(exc: BaseException) -> str:
    """What failed, in fixed words plus the exception's type: delta-rs and the OS quote the table's
    absolute path (and object-store URLs), so their text never reaches a reason."""
    if isinstance(exc, DigestUnprovable):
        return str(exc)
    errors = _deltalake().exceptions
    described: tuple[tuple[type[BaseException], str], ...] = (
        (errors.TableNotFoundError, "no Delta table could be loaded at the location"),
        (errors.SchemaMismatchError, "the rows do not fit the table's schema"),
        (errors.DeltaProtocolError, "the table needs a Delta protocol feature delta-rs does not support"),
        (errors.CommitFailedError, "the commit failed"),
        (errors.DeltaError, "delta-rs could not load, read or write the table at the location"),
        (OSError, "the table's files could not be read or written"),
        (ValueError, "the table's log holds a commit that cannot be read"),
        (KeyError, "the table's log holds a commit that cannot be read"),
    )
    for kind, words in described:
        if isinstance(exc, kind):
            return f"{words} ({describe_exception(exc)})"
    return f"an unexpected error ({describe_exception(exc)})"


@dataclass(frozen=True)
class _Place:
    """Where a table lives: a local folder, or a prefix of an S3-compatible store (issue 31).

    `uri` is what delta-rs opens, `storage` its storage options (None for a folder), `where` the name
    the refs give the table (relative to the sink root for a folder, the s3:// URL for a store), and
    `place` what `locate` reports (for a store it names the endpoint too: one bucket name at two
    endpoints is two places). On a store there are no folders: the table "has a log" when an object
    lies under `<prefix>/_delta_log/`; a bucket that cannot be listed is an error, never "no log"."""

    uri: str
    where: str
    place: str
    folder: Path | None = None
    storage: dict[str, str] | None = None
    filesystem: Any = None
    log_prefix: str = ""
    store: objectstore.StoreOptions | None = None
    url: objectstore.StoreUrl | None = None

    @classmethod
    def local_folder(cls, path: Path, where: str) -> _Place:
        return cls(str(path), where, f"delta:{path}", folder=path)

    @classmethod
    def of(cls, target: PublishTarget) -> _Place:
        """The target's place; for an s3:// location, confined to the run's granted prefixes and with its
        credentials resolved in the run's secret scope (InputError before the store is touched)."""
        if not objectstore.is_store_url(target.location):
            path, where = resolve_location_named(target)
            return cls.local_folder(path, where)
        url = objectstore.parse_url(target.location, "target location")
        options = objectstore.confine(url, target.options, target.store_grants, "write", "target")
        store = objectstore.store_options(options, target.secrets, "target")
        return cls(
            uri=url.url,
            where=url.url,
            place=f"delta:{store.endpoint or 'aws'}/{url.url}",
            storage=store.delta_storage_options(),
            filesystem=store.filesystem(),
            log_prefix=url.child("_delta_log").path,
            store=store,
            url=url,
        )

    @property
    def on_store(self) -> bool:
        return self.folder is None

    def has_log(self) -> bool:
        """Whether the table's log is there: a `_delta_log` folder, or objects under the log's prefix.
        A store that cannot be listed (a missing bucket, no access) raises: it proves nothing."""
        if self.folder is not None:
            return (self.folder / "_delta_log").is_dir()
        from pyarrow import fs

        found = self.filesystem.get_file_info(fs.FileSelector(self.log_prefix, allow_not_found=True))
        return bool(found)

    def log_entries(self) -> list[tuple[str, int]]:
        """(name, size) of each entry of the log."""
        if self.folder is not None:
            log_dir = self.folder / "_delta_log"
            return [(p.name, p.stat().st_size) for p in log_dir.iterdir()]
        from pyarrow import fs

        infos = self.filesystem.get_file_info(fs.FileSelector(self.log_prefix, allow_not_found=True))
        return [(info.base_name, int(info.size or 0)) for info in infos if info.type == fs.FileType.File]

    def read_log_entry(self, name: str) -> str:
        if self.folder is not None:
            return (self.folder / "_delta_log" / name).read_text("utf-8")
        with self.filesystem.open_input_stream(f"{self.log_prefix}/{name}") as stream:
            data: bytes = stream.read()
        return data.decode("utf-8")

    def make(self) -> None:
        """Create the table's folder. A store has none: its bucket must exist (`has_log` raises when it
        cannot be listed), and it must honour ``If-None-Match: *``, which delta-rs relies on to create each
        log entry once (`objectstore.require_create_once`: InputError, the run fails before dispatch)."""
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            return
        self.has_log()
        assert self.store is not None and self.url is not None
        try:
            objectstore.require_create_once(self.store, self.url)
        except InputError:
            raise
        except Exception as exc:  # a missing bucket, no access, the store down: the type and code only
            raise ExecutionError(
                f"the sink location cannot be created: the store refused a write ({objectstore.describe_error(exc)})"
            ) from None


@dataclass(frozen=True)
class _Commit:
    """A publication commit found in the log."""

    version: int
    digest: str
    token: int


def find_publication_commit(table_path: Path | _Place, key: str) -> _Commit | None:
    """Scan the JSON commits newest first for K's publication (commit info and txn both match)."""
    place = table_path if isinstance(table_path, _Place) else _Place.local_folder(table_path, str(table_path))
    names = sorted(((n, size) for n, size in place.log_entries() if COMMIT_FILE.match(n)), reverse=True)
    for name, size in names[:LOG_SCAN_COMMITS_MAX]:
        if size > COMMIT_FILE_BYTES_MAX:
            continue  # a huge commit is a data commit of another writer, never one of our markers
        found = _publication_in_commit(place.read_log_entry(name), key)
        if found is not None:
            return _Commit(int(name[:20]), found[0], found[1])
    return None


def _publication_in_commit(text: str, key: str) -> tuple[str, int] | None:
    info: dict[str, Any] | None = None
    txn_version: int | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        if "commitInfo" in action:
            info = action["commitInfo"]
        elif "txn" in action and action["txn"].get("appId") == key:
            txn_version = int(action["txn"]["version"])
    if info is None or info.get("dataflow_kind") != "publication" or info.get("dataflow_key") != key:
        return None
    if txn_version is None or txn_version != int(info["dataflow_token"]):
        return None
    return str(info["dataflow_digest"]), txn_version


def _same_columns(dt: Any, table: pa.Table) -> str | None:
    """None when the table's columns (names and Delta types) fit the Delta table, else why not."""
    deltalake = _deltalake()
    incoming = {f.name: f.type for f in deltalake.Schema.from_arrow(table.schema).fields}
    existing = {f.name: f.type for f in dt.schema().fields}
    if set(incoming) != set(existing):
        return f"columns {sorted(incoming)} do not match the table's columns {sorted(existing)}"
    for name, dtype in existing.items():
        if incoming[name] != dtype:
            return f"column {name!r} has type {incoming[name]} but the table has {dtype}"
    return None


def _is_placeholder(dt: Any) -> bool:
    return [f.name for f in dt.schema().fields] == [PLACEHOLDER_COLUMN]


class DeltaProvider:
    """Publishes to a Delta table; the key is an app-transaction id, the token its version."""

    name = "delta"
    capabilities: frozenset[Capability] = frozenset({"publish", "inspect", "replace_partition"})
    # The predicate compares these exactly (`_literal`); a timestamp's or decimal's literal is not.
    partition_kinds = frozenset({"string", "int", "bool", "date"})

    def __init__(self) -> None:
        # Fail at construction, so the registry reports the missing extra as a capability.
        self._dl = _deltalake()

    def _refs(self, where: str, key: str, version: int) -> PublicationRefs:
        """`where` names the table as `_Place.where` does: relative to the sink root, or its s3:// URL."""
        scheme = "delta+" if objectstore.is_store_url(where) else "delta://"
        return PublicationRefs(
            publication_ref=f"{scheme}{where}#txn={key}",
            datasource_ref=f"{scheme}{where}",
            materialization_ref=f"{scheme}{where}@v{version}",
        )

    def _load(self, place: _Place) -> Any:
        """Load the table; never create it (only `prepare` does)."""
        return self._dl.DeltaTable(place.uri, storage_options=place.storage)

    def _open(self, place: _Place, schema: pa.Schema | None) -> Any:
        """Load the table; create it without rows first when missing (schema None: placeholder).
        Only `prepare` creates a table: `publish` and `inspect` load it with `_load`."""
        try:
            return self._load(place)
        except self._dl.exceptions.TableNotFoundError:
            pass
        create_schema = schema if schema is not None else pa.schema([(PLACEHOLDER_COLUMN, pa.int8())])
        # A concurrent creator may win the race for version 0; loading below settles it.
        with contextlib.suppress(self._dl.exceptions.DeltaError):
            self._dl.DeltaTable.create(place.uri, schema=create_schema, mode="ignore", storage_options=place.storage)
        return self._load(place)

    def _stored(self, place: _Place, key: str) -> tuple[PublicationRefs, _Commit]:
        commit = find_publication_commit(place, key)
        if commit is None:
            raise DigestUnprovable(
                f"key {key!r} is published (txn recorded) but its commit info is no longer in the log "
                "(log retention): the digest cannot be proven"
            )
        return self._refs(place.where, key, commit.version), commit

    def preflight(self, target: PublishTarget) -> None:
        """What is knowable without writing: the table's location resolves inside its root (a folder), or
        inside the run's granted prefixes with its credentials resolving (a store)."""
        _Place.of(target)

    def prepare(self, target: PublishTarget) -> None:
        """Create the table before dispatch is authorized (`contract.prepare`): its folder and, when
        there is no table yet, the placeholder-schema table without rows; an existing table is only
        loaded. From then on a location without `_delta_log` is missing, never "nothing published"."""
        place = _Place.of(target)
        place.make()
        self._open(place, None)

    def locate(self, target: PublishTarget) -> Location:
        """The resolved table folder and the table's id (`contract.locate`: Delta's metadata id, kept
        for the life of the table); None when there is no `_delta_log` there."""
        place = _Place.of(target)
        if not place.has_log():
            return Location(place.place, None)
        try:
            table = self._load(place)
        except self._dl.exceptions.TableNotFoundError:
            # A log without a first commit (a concurrent first preparer between creating the folder and
            # committing version 0, or one that crashed there): no table is there yet.
            return Location(place.place, None)
        return Location(place.place, f"delta-table:{table.metadata().id}")

    def publish(
        self, key: str, token: int, table: pa.Table, digest: str, target: PublishTarget
    ) -> PublishOutcome:
        """Check the txn and fence on one snapshot and commit on that snapshot (DESIGN §9)."""
        check_key(key)
        check_token(token)
        place = _Place.of(target)
        predicate: str | None = None
        if target.mode == "replace_partition":
            partition, _ = partition_of(target)
            predicate = partition_predicate(partition_values(partition, table.schema))
        try:
            present = place.has_log()
        except Exception as exc:  # a store that cannot be listed proves nothing either way
            reason = f"the table's location cannot be listed ({describe_failure(exc)})"
            raise Inconclusive(f"delta publish of key {key!r}: {reason}") from exc
        if not present:
            # The table was prepared before dispatch was authorized and is never created here: without
            # its log now (moved, not mounted: an empty mount point), an earlier publication may be in it.
            raise Inconclusive(f"delta publish of key {key!r}: {LOCATION_MISSING}")
        try:
            for _ in range(COMMIT_ATTEMPTS_MAX):
                dt = self._load(place)
                outcome = self._publish_on(dt, place, key, token, table, digest, target, predicate)
                if outcome is not None:
                    return outcome
        except Exception as exc:
            # The write may have started (or even committed, e.g. a failing post-commit hook):
            # only an inspection can tell. InputError was raised above, before the sink was touched.
            raise Inconclusive(f"delta publish of key {key!r} failed: {describe_failure(exc)}") from exc
        raise Inconclusive(
            f"delta publish of key {key!r}: {COMMIT_ATTEMPTS_MAX} commit conflicts in a row; "
            "none of them committed, inspect before deciding"
        )

    def _publish_on(
        self,
        dt: Any,
        place: _Place,
        key: str,
        token: int,
        table: pa.Table,
        digest: str,
        target: PublishTarget,
        predicate: str | None = None,
    ) -> PublishOutcome | None:
        """One decision on one snapshot; None when the commit conflicted and must be decided again.
        With a predicate (replace_partition) the commit replaces that partition only."""
        published = dt.transaction_version(key)
        if published is not None and published > FENCE_MARKER_VERSION:
            refs, commit = self._stored(place, key)
            return AlreadyPublished(refs, commit.digest)
        fence = dt.transaction_version(key + FENCE_SUFFIX)
        if fence is not None and token < fence:
            return Fenced(int(fence))
        placeholder = _is_placeholder(dt)
        if not placeholder:
            mismatch = _same_columns(dt, table)
            if mismatch is not None:
                return Rejected(f"schema incompatible with the Delta table: {mismatch}")
            table = table.select([f.name for f in dt.schema().fields])
        transactions = [self._dl.Transaction(key, token)]
        if predicate is not None:
            partition, partition_token = partition_of(target)
            app_id = partition_app_id(partition)
            applied = dt.transaction_version(app_id)
            if applied is not None and partition_token < applied:
                return superseded(int(applied))
            transactions.append(self._dl.Transaction(app_id, partition_token))
        props = self._dl.CommitProperties(
            app_transactions=transactions,
            custom_metadata={
                "dataflow_kind": "publication",
                "dataflow_key": key,
                "dataflow_digest": digest,
                "dataflow_token": token,
                "dataflow_rows": table.num_rows,
            },
        )
        partitioned = predicate is not None
        try:
            self._dl.write_deltalake(
                dt,  # the checked object, never the path: same snapshot for check and commit
                table,
                mode="overwrite" if placeholder or partitioned else target.mode,
                schema_mode="overwrite" if placeholder else None,
                # A table made out of the placeholder is partitioned by the partition's columns.
                partition_by=list(partition_of(target)[0]) if placeholder and partitioned else None,
                # The placeholder holds no rows: the first publication replaces it whole.
                predicate=None if placeholder else predicate,
                commit_properties=props,
            )
        except self._dl.exceptions.CommitFailedError:
            return None
        return Published(self._refs(place.where, key, int(dt.version())), digest)

    def inspect(self, key: str, target: PublishTarget, fence: int | None = None) -> InspectOutcome:
        """Decide from the table's txn state; with a fence, commit it on the checked snapshot.

        A location without a `_delta_log` folder (missing, or an empty folder such as an unmounted
        mount point) is `Undecided`, with or without a fence, and nothing is created."""
        check_key(key)
        if fence is not None:
            check_token(fence, "fence")
        place = _Place.of(target)
        try:
            if not place.has_log():
                # The table was prepared before dispatch was authorized, so no log now means unseen, never absent.
                return Undecided(f"delta inspection of key {key!r}: {LOCATION_MISSING}")
            for _ in range(COMMIT_ATTEMPTS_MAX):
                dt = self._load(place)
                outcome = self._inspect_on(dt, place, key, fence)
                if outcome is not None:
                    return outcome
        except Exception as exc:
            # Whatever went wrong, nothing was proven: the caller changes nothing on Undecided.
            return Undecided(f"delta inspection of key {key!r} failed: {describe_failure(exc)}")
        return Undecided(f"delta inspection of key {key!r}: {COMMIT_ATTEMPTS_MAX} fence commits conflicted")

    def _inspect_on(self, dt: Any, place: _Place, key: str, fence: int | None) -> InspectOutcome | None:
        published = dt.transaction_version(key)
        if published is not None and published > FENCE_MARKER_VERSION:
            refs, commit = self._stored(place, key)
            return Present(refs, commit.digest, int(published))
        current = dt.transaction_version(key + FENCE_SUFFIX)
        if fence is None or (current is not None and current >= fence):
            return Absent(None if current is None else int(current))
        empty = pa.schema(dt.schema().to_arrow()).empty_table()
        props = self._dl.CommitProperties(
            app_transactions=[
                self._dl.Transaction(key, FENCE_MARKER_VERSION),
                self._dl.Transaction(key + FENCE_SUFFIX, fence),
            ],
            custom_metadata={"dataflow_kind": "fence", "dataflow_key": key, "dataflow_token": fence},
        )
        try:
            self._dl.write_deltalake(dt, empty, mode="append", commit_properties=props)
        except self._dl.exceptions.CommitFailedError:
            return None
        return Absent(fence)

    def read(self, target: PublishTarget) -> pa.Table:
        """The table's current rows (all publications).

        Not part of the contract (no capability; the platform never reads a sink): the tests read
        the sink with it."""
        table: pa.Table = self._load(_Place.of(target)).to_pyarrow_table()
        return table
