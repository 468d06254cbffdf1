"""Parquet folder on an S3-compatible object store: one state object per key, moved by conditional puts.

The `parquet` provider (`parquet_folder.ParquetFolderProvider`) hands a target whose location is an
``s3://bucket/prefix`` URL to this module. A store has no folders, no rename and no lock, but it has
**conditional writes**: a PutObject with ``If-None-Match: *`` succeeds only when the object does not
exist, one with ``If-Match: <etag>`` only when the object is exactly that version, and of concurrent
conditional puts on one object the store lets exactly one through (the others get ``412
PreconditionFailed``, or ``409 ConditionalRequestConflict`` while one is in flight). Every decision
below is one conditional put on one object, so check and write are one atomic step at the store.

Layout under the prefix (``h`` is the sha256 of the key: names are injective and a key never names an
object):

- ``_dataflow/location.json``   the location's marker ``{"v": 1, "id": <uuid4 hex>}``, created once by
                                `prepare` with ``If-None-Match: *`` (never replaced): `locate` names the
                                location by it, and a prefix without it is missing, never empty;
- ``_dataflow/keys/<h>.json``   the key's **state object**, the only record of the key:
                                ``{"state": "fenced", "key", "fence", "nonce"}`` or
                                ``{"state": "published", "key", "digest", "token", "rows", "file",
                                "fence"}``;
- ``data/<h>-t<token>-<uuid>.parquet``  the rows of one publication attempt (a name no other attempt
                                uses); only the file a published state object names is published.

Transitions of a key's state object (each one conditional put; the state only moves forward):

- absent → fenced(m): `inspect(fence=m)`, with ``If-None-Match: *``;
- fenced(c) → fenced(m), m > c: `inspect(fence=m)`, with ``If-Match`` on the ETag it read;
- absent → published(t): `publish`, with ``If-None-Match: *``;
- fenced(c) → published(t), t ≥ c: `publish`, with ``If-Match`` on the ETag it read (t < c: `Fenced`);
- published: final; never replaced.

`publish` reads the state object, writes its data file, then puts the published state conditioned on
what it read. 412/409: it reads again and decides again (someone else's publication wins:
`AlreadyPublished` with the stored digest; a fence above its token: `Fenced`; its own file named in the
stored state: its own put landed though the answer was lost, and the client retried: `Published`).
A fence written between the read and the put changes the ETag, so the put fails: a publisher that
checked before a fence never commits after it. Every state put carries a fresh nonce, so no two
writes share an ETag. Any other failure of the state put is `Inconclusive`; a failure before it
writing the data file, after the state was read and found unpublished, is `Rejected`: nothing was
published. A failure to read the state is `Inconclusive`: the key may be published already (by a run
recorded under the same idempotency key before a restore of the platform database), unseen.

A data file without a published state naming it is an orphan (a crashed or losing attempt): readers
read the files the published state objects name (`read`), never the ``data/`` prefix by itself. A
publish that loses to another deletes its own file; a publish that commits over a fence (a recovery
after an unknown outcome) removes the key's other files, which no state can name any more.

`prepare` requires the bucket to exist (it never creates one), **probes the store's conditional
writes** (a second ``If-None-Match: *`` put of a probe object must be refused with 412, a put with a
wrong ``If-Match`` too, and one with the right ETag accepted) and refuses a store that ignores them:
publishing there could publish a key twice. It then creates the marker. `inspect` and `publish` never
create anything but the key's own objects: a missing marker or a missing bucket is `Undecided` /
`Inconclusive` with `contract.LOCATION_MISSING` (a prefix moved or deleted may have held the key).
Proof horizon: as long as nobody deletes the state objects (they are the only record).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from durable_dataflow.core.errors import ExecutionError, InputError
from durable_dataflow.datasources import objectstore
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    Absent,
    AlreadyPublished,
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
)
from durable_dataflow.datasources.objectstore import StoreUrl

STATE_BYTES_MAX = 64 * 1024
MARKER_BYTES_MAX = 4096
STATE_VERSION = 1
# Each round of a decision is a read and a conditional put; a round repeats only when the state moved
# in between (a fence grew, or a publication landed), so a key settles within a few rounds.
DECISION_ROUNDS_MAX = 16
READ_FILES_MAX = 100_000
CLEANUP_FILES_MAX = 1_000
MARKER = "_dataflow/location.json"
KEYS = "_dataflow/keys"
PROBES = "_dataflow/probes"
DATA = "data"
NO_CONDITIONAL_WRITES = (
    "the store does not honour conditional writes (If-None-Match / If-Match): "
    "publishing there could publish a key twice"
)
# A wrong ETag for the If-Match probe (a quoted MD5-sized hex string no object has).
_WRONG_ETAG = '"00000000000000000000000000000000"'


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class StateError(ValueError):
    """A state object that is not the key's record; the message names it by its stem, never its URL."""


class BucketMissing(Exception):
    """The bucket does not exist (NoSuchBucket)."""


@dataclass(frozen=True)
class _State:
    """What a key's state object holds, and its ETag (None: the object does not exist)."""

    body: dict[str, Any] | None
    etag: str | None

    @property
    def published(self) -> bool:
        return self.body is not None and self.body["state"] == "published"

    @property
    def fence(self) -> int | None:
        if self.body is None:
            return None
        value = self.body.get("fence")
        return None if value is None else int(value)


def _error_code(exc: BaseException) -> tuple[str, int | None]:
    response = getattr(exc, "response", None)
    if not isinstance(response, Mapping):
        return "", None
    code = str((response.get("Error") or {}).get("Code") or "")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code, int(status) if isinstance(status, int) else None


def _is_client_error(exc: BaseException) -> bool:
    return isinstance(getattr(exc, "response", None), Mapping)


def _missing_object(exc: BaseException) -> bool:
    code, status = _error_code(exc)
    return code in ("NoSuchKey", "404") or (status == 404 and code not in ("NoSuchBucket",))


def _missing_bucket(exc: BaseException) -> bool:
    return _error_code(exc)[0] == "NoSuchBucket"


def _precondition_failed(exc: BaseException) -> bool:
    """412 (the condition was false) or 409 (a conditional write on the object was in flight)."""
    code, status = _error_code(exc)
    return status in (412, 409) or code in ("PreconditionFailed", "ConditionalRequestConflict")


@dataclass(frozen=True)
class _Place:
    """A target's location on its store: the prefix, the client, and how refs name it."""

    url: StoreUrl
    store: objectstore.StoreOptions
    client: Any

    @classmethod
    def of(cls, target: PublishTarget) -> _Place:
        url, store = _resolve(target)
        return cls(url, store, _client(store))

    def key(self, name: str) -> str:
        return self.url.child(name).key

    @property
    def where(self) -> str:
        return self.url.url

    @property
    def place(self) -> str:
        return f"parquet:{self.store.endpoint or 'aws'}/{self.url.url}"

    def refs(self, state: dict[str, Any]) -> PublicationRefs:
        return PublicationRefs(
            publication_ref=f"parquet+{self.where}/{KEYS}/{key_hash(state['key'])}.json",
            datasource_ref=f"parquet+{self.where}",
            materialization_ref=f"parquet+{self.where}/{state['file']}",
        )

    # ---- the objects ----------------------------------------------------------------------------

    def get(self, name: str, limit: int) -> tuple[bytes, str] | None:
        """An object's first bytes and its ETag; None when it does not exist; BucketMissing when the
        bucket does not; anything else raises."""
        try:
            answer = self.client.get_object(Bucket=self.url.bucket, Key=self.key(name))
        except Exception as exc:
            if _missing_bucket(exc):
                raise BucketMissing from None
            if _missing_object(exc):
                return None
            raise
        body = answer["Body"]
        try:
            data: bytes = body.read(limit + 1)
        finally:
            body.close()
        return data, str(answer.get("ETag") or "")

    def put(self, name: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Put an object (conditionally); its new ETag."""
        kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Key": self.key(name), "Body": data}
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        answer = self.client.put_object(**kwargs)
        return str(answer.get("ETag") or "")

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.url.bucket, Key=self.key(name))

    def marker(self) -> str | None:
        """The marker's id; None when there is no marker; BucketMissing; ValueError for an object that
        is not a marker this provider wrote."""
        found = self.get(MARKER, MARKER_BYTES_MAX)
        if found is None:
            return None
        raw = found[0]
        try:
            marker = json.loads(raw) if len(raw) <= MARKER_BYTES_MAX else None
        except ValueError:
            marker = None
        marker_id = marker.get("id") if isinstance(marker, dict) else None
        if not isinstance(marker_id, str) or not marker_id.isalnum() or len(marker_id) != 32:
            raise ValueError(f"the location's {MARKER} is not a marker this provider wrote")
        return marker_id

    def state(self, key: str) -> _State:
        stem = key_hash(key)
        found = self.get(f"{KEYS}/{stem}.json", STATE_BYTES_MAX)
        if found is None:
            return _State(None, None)
        raw, etag = found
        if len(raw) > STATE_BYTES_MAX:
            raise StateError(f"state object {stem}.json is larger than {STATE_BYTES_MAX} bytes")
        try:
            body = json.loads(raw)
        except ValueError:
            raise StateError(f"state object {stem}.json is not valid JSON") from None
        if not isinstance(body, dict) or body.get("key") != key or body.get("state") not in ("fenced", "published"):
            raise StateError(f"state object {stem}.json does not record key {key!r}")
        try:
            if body["state"] == "published":
                int(body["token"])
                if not isinstance(body.get("digest"), str) or not isinstance(body.get("file"), str):
                    raise TypeError
            else:
                int(body["fence"])
        except (KeyError, TypeError, ValueError):
            raise StateError(f"state object {stem}.json does not record key {key!r}") from None
        return _State(body, etag)

    def put_state(self, key: str, body: dict[str, Any], read: _State) -> None:
        """Put the key's state conditioned on the version read; raises on a failed condition."""
        data = json.dumps(body, sort_keys=True).encode("utf-8")
        name = f"{KEYS}/{key_hash(key)}.json"
        if read.etag is None:
            self.put(name, data, if_none_match=True)
        else:
            self.put(name, data, if_match=read.etag)

    def list_names(self, prefix: str, limit: int) -> list[str]:
        """Names (relative to the location) of objects under ``prefix``, at most ``limit``."""
        names: list[str] = []
        base = self.url.key
        paginator = self.client.get_paginator("list_objects_v2")
        full = f"{base}/{prefix}" if base else prefix
        for page in paginator.paginate(Bucket=self.url.bucket, Prefix=full):
            for item in page.get("Contents") or ():
                name = str(item["Key"])
                names.append(name[len(base) + 1 :] if base else name)
                if len(names) >= limit:
                    return names
        return names


# Making a boto3 client costs ~0.1 s (it loads the S3 service model): 60% of a publication on a store on
# loopback (benchmarks/bench_s3.py). Clients are thread-safe, so one is kept per process and resolved store
# options (endpoint, region, credentials), the most recent few; a forked child makes its own.
_CLIENTS_MAX = 16
_clients: OrderedDict[tuple[int, objectstore.StoreOptions], Any] = OrderedDict()
_clients_lock = threading.Lock()


def _client(store: objectstore.StoreOptions) -> Any:
    """The process's boto3 client for these store options (made on first use, then reused)."""
    cache_key = (os.getpid(), store)
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is not None:
            _clients.move_to_end(cache_key)
            return client
    client = store.client()
    with _clients_lock:
        client = _clients.setdefault(cache_key, client)
        _clients.move_to_end(cache_key)
        while len(_clients) > _CLIENTS_MAX:
            _clients.popitem(last=False)
    return client


def _resolve(target: PublishTarget) -> tuple[StoreUrl, objectstore.StoreOptions]:
    """The URL and store options of an s3:// target, confined to the run's granted prefixes, secrets
    resolved in its scope; InputError before the store is touched."""
    url = objectstore.parse_url(target.location, "target location")
    options = objectstore.confine(url, target.options, target.store_grants, "write", "target")
    return url, objectstore.store_options(options, target.secrets, "target")


def _append_only(target: PublishTarget) -> str | None:
    if target.mode != "append":
        return "a parquet folder publishes each key as its own file: only mode 'append'"
    return None


# ---- the provider's operations on a store location ----------------------------------------------------


def preflight(target: PublishTarget) -> None:
    """Without touching the store: the mode is append, the URL parses, lies in a granted prefix, and its
    credentials resolve."""
    refusal = _append_only(target)
    if refusal is not None:
        raise InputError(refusal)
    _resolve(target)


def prepare(target: PublishTarget) -> None:
    """Probe the store's conditional writes, then create the location's marker (once, never replaced).
    The bucket must exist: it is never created here."""
    place = _Place.of(target)
    try:
        _probe_conditional_writes(place)
        if place.marker() is None:
            body = json.dumps({"v": 1, "id": uuid.uuid4().hex}).encode("utf-8")
            try:
                place.put(MARKER, body, if_none_match=True)
            except Exception as exc:
                if not _precondition_failed(exc):
                    raise
            if place.marker() is None:  # created by us or a concurrent preparer: it must be there now
                raise ExecutionError("the sink location's marker could not be created on the store")
    except BucketMissing:
        raise ExecutionError("the sink location cannot be created: the bucket does not exist") from None
    except (InputError, ExecutionError):
        raise
    except ValueError as exc:
        raise ExecutionError(f"the sink location cannot be prepared: {exc}") from None
    except Exception as exc:
        why = objectstore.describe_error(exc)
        raise ExecutionError(f"the sink location cannot be created on the store ({why})") from None


def _probe_conditional_writes(place: _Place) -> None:
    """A probe object put with If-None-Match twice (the second must be refused with 412), then with a
    wrong If-Match (refused) and the right one (accepted); removed after. InputError when the store
    ignores a condition: it would let a key be published twice."""
    name = f"{PROBES}/{uuid.uuid4().hex}"
    try:
        place.put(name, b"probe", if_none_match=True)
    except Exception as exc:
        if _missing_bucket(exc):
            raise BucketMissing from None
        code, status = _error_code(exc)
        if status == 501 or code == "NotImplemented":
            raise InputError(NO_CONDITIONAL_WRITES) from None
        raise
    try:
        for wrong_etag in (None, _WRONG_ETAG):
            try:
                place.put(name, b"probe", if_none_match=wrong_etag is None, if_match=wrong_etag)
            except Exception as exc:
                if _error_code(exc)[1] == 412:
                    continue
                code, status = _error_code(exc)
                if status in (400, 501) or code == "NotImplemented":
                    raise InputError(NO_CONDITIONAL_WRITES) from None
                raise
            raise InputError(NO_CONDITIONAL_WRITES)
        found = place.get(name, 16)
        if found is None:
            raise InputError(NO_CONDITIONAL_WRITES)
        try:
            place.put(name, b"probe", if_match=found[1])
        except Exception as exc:
            if _error_code(exc)[1] in (412, 501):
                raise InputError(NO_CONDITIONAL_WRITES) from None
            raise
    finally:
        with contextlib.suppress(Exception):  # a leftover probe object is harmless (it names nothing)
            place.delete(name)


def locate(target: PublishTarget) -> Location:
    """Where the location is (endpoint and URL) and its marker's id; None when there is no marker or no
    bucket (occupied: key state objects without a marker)."""
    place = _Place.of(target)
    try:
        marker_id = place.marker()
        if marker_id is not None:
            return Location(place.place, f"parquet-store:{marker_id}")
        occupied = bool(place.list_names(f"{KEYS}/", 1))
    except BucketMissing:
        return Location(place.place, None)
    except ValueError:
        raise
    except Exception as exc:
        why = objectstore.describe_error(exc)
        raise ExecutionError(f"the sink location cannot be looked at on the store ({why})") from None
    return Location(place.place, None, occupied=occupied)


def _location_missing(place: _Place) -> str | None:
    """Why the location cannot be seen (its bucket or marker is missing), or None when it is there."""
    try:
        marker_id = place.marker()
    except BucketMissing:
        return f"the bucket does not exist: {LOCATION_MISSING}"
    return None if marker_id is not None else LOCATION_MISSING


def publish(key: str, token: int, table: pa.Table, digest: str, target: PublishTarget) -> PublishOutcome:
    """Write the data file, then put the key's published state conditioned on what was read (see the
    module docstring). Key and token are checked by the caller; InputError only before the store is
    touched."""
    refusal = _append_only(target)
    if refusal is not None:
        return Rejected(refusal)
    place = _Place.of(target)
    failed = f"parquet publish of key {key!r}"
    try:
        missing = _location_missing(place)
        if missing is not None:
            raise Inconclusive(f"{failed}: {missing}")
        read = place.state(key)
    except Inconclusive:
        raise
    except ValueError as exc:  # a state object (StateError) or marker that is not this provider's
        raise Inconclusive(f"{failed}: {exc}") from exc
    except Exception as exc:
        # No write was sent, but the key's state was not seen either: it may hold a publication this call
        # cannot see (an earlier run's under the same key, after a restore behind the sinks), so
        # "nothing was created" is not proven: only an inspection can tell.
        raise Inconclusive(f"{failed}: the store could not be read ({objectstore.describe_error(exc)})") from exc
    decided = _decide(place, key, token, read)
    if decided is not None:
        return decided
    stem = key_hash(key)
    file = f"{DATA}/{stem}-t{token}-{uuid.uuid4().hex}.parquet"
    try:
        sink = io.BytesIO()
        pq.write_table(table, sink)
        place.put(file, sink.getvalue())
    except Exception as exc:
        _forget(place, file)
        why = objectstore.describe_error(exc) if _is_client_error(exc) else type(exc).__name__
        return Rejected(f"writing the data file failed before the commit point: {why}")
    return _commit(place, key, token, digest, table.num_rows, file, read)


def _decide(place: _Place, key: str, token: int, read: _State) -> PublishOutcome | None:
    """The outcome the state read settles (published: AlreadyPublished; a fence above the token:
    Fenced), or None: this token may publish over it."""
    if read.published:
        assert read.body is not None
        return AlreadyPublished(place.refs(read.body), str(read.body["digest"]))
    fence = read.fence
    if fence is not None and token < fence:
        return Fenced(fence)
    return None


def _commit(
    place: _Place, key: str, token: int, digest: str, rows: int, file: str, read: _State
) -> PublishOutcome:
    failed = f"writing the state of key {key!r} failed"
    for _ in range(DECISION_ROUNDS_MAX):
        body = {
            "v": STATE_VERSION,
            "state": "published",
            "key": key,
            "digest": digest,
            "token": token,
            "rows": rows,
            "file": file,
            "fence": read.fence,
        }
        try:
            place.put_state(key, body, read)
        except Exception as exc:
            if not _precondition_failed(exc):
                # The put may have landed with its answer lost: only an inspection can tell.
                raise Inconclusive(f"{failed}: {objectstore.describe_error(exc)}") from exc
        else:
            if read.fence is not None:
                _remove_orphans(place, key, file)
            return Published(place.refs(body), digest)
        try:
            read = place.state(key)
        except Exception as exc:
            why = str(exc) if isinstance(exc, StateError) else objectstore.describe_error(exc)
            raise Inconclusive(f"{failed}: the state could not be read again ({why})") from exc
        if read.published and read.body is not None and read.body.get("file") == file:
            # Our put landed; its answer was lost and the client's retry was refused (412).
            return Published(place.refs(read.body), str(read.body["digest"]))
        decided = _decide(place, key, token, read)
        if decided is not None:
            _forget(place, file)
            return decided
    raise Inconclusive(f"{failed}: the state kept changing ({DECISION_ROUNDS_MAX} rounds)")


def _forget(place: _Place, file: str) -> None:
    """Remove a data file no state names (best effort: an orphan is never read)."""
    with contextlib.suppress(Exception):
        place.delete(file)


def _remove_orphans(place: _Place, key: str, published: str) -> None:
    """After a publication over a fence (a recovery), remove the key's other data files: the state is
    final, so no state can ever name them (best effort)."""
    try:
        names = place.list_names(f"{DATA}/{key_hash(key)}-", CLEANUP_FILES_MAX)
    except Exception:
        return
    for name in names:
        if name != published:
            _forget(place, name)


def inspect(key: str, target: PublishTarget, fence: int | None) -> InspectOutcome:
    """Read the key's state; with a fence, raise the fence by a conditional put before Absent."""
    failed = f"parquet inspection of key {key!r} failed"
    place = _Place.of(target)
    try:
        missing = _location_missing(place)
        if missing is not None:
            return Undecided(f"{failed}: {missing}")
        for _ in range(DECISION_ROUNDS_MAX):
            read = place.state(key)
            if read.published:
                assert read.body is not None
                body = read.body
                return Present(place.refs(body), str(body["digest"]), int(body["token"]))
            current = read.fence
            if fence is None or (current is not None and current >= fence):
                return Absent(current)
            state = {"v": STATE_VERSION, "state": "fenced", "key": key, "fence": fence, "nonce": uuid.uuid4().hex}
            try:
                place.put_state(key, state, read)
            except Exception as exc:
                if _precondition_failed(exc):
                    continue
                raise
            return Absent(fence)
        return Undecided(f"{failed}: the state kept changing ({DECISION_ROUNDS_MAX} rounds)")
    except StateError as exc:
        return Undecided(f"{failed}: {exc}")
    except ValueError as exc:
        return Undecided(f"{failed}: {exc}")
    except Exception as exc:
        why = objectstore.describe_error(exc)
        return Undecided(f"{failed}: the store could not be read or written ({why})")


def read(target: PublishTarget) -> pa.Table:
    """Every published key's rows: the files the published state objects name (orphans and fences
    ignored). Not part of the contract; tests and operators read the sink with it."""
    place = _Place.of(target)
    tables = []
    for name in sorted(place.list_names(f"{KEYS}/", READ_FILES_MAX)):
        found = place.get(name, STATE_BYTES_MAX)
        if found is None:
            continue
        state = json.loads(found[0])
        if state.get("state") == "published":
            data = place.get(str(state["file"]), 2**40)
            if data is None:
                raise ValueError(f"a published data file of state object {name.rsplit('/', 1)[-1]} is missing")
            tables.append(pq.read_table(io.BytesIO(data[0])))
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables)
