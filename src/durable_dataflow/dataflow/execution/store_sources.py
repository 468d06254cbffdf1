"""Sources on S3-compatible object stores: ``parquet``, ``csv`` and ``delta`` with an ``s3://`` path.

Resolution reads no data, as for local files. The location is confined first (``objectstore.confine``: a
tenant reads only inside a prefix granted to it for reading, at the grant's endpoint, with credentials
named as its granted secrets), then the options are resolved in the run's secret scope and the objects
are found and stamped with what the store says of them (``ObjectStamp``: ETag, size and, in a versioned
bucket, version id), one HEAD request per object. The engine then scans a pyarrow dataset over the
store's API (``pyarrow.fs.S3FileSystem``: DuckDB's own S3 reader, the httpfs extension, is not available),
with projection and filter pushdown, and ``first_changed`` asks the store again once the engine is done:
an object rewritten or removed meanwhile fails the attempt (recomputable), as a local file does.

* ``parquet``: one object, every ``*.parquet`` object under a prefix (``s3://b/p/`` or a key that names
  no object), or the objects matching a glob whose ``*`` and ``[...]`` match within one key segment
  (``s3://b/p/*.parquet``); names starting with ``.`` or ``_`` are skipped at any depth below the prefix.
  The fingerprint is a digest over the sorted (relative key, ETag, size, version id) of the objects.
* ``csv``: one object, fingerprinted the same way (its bytes are not hashed: the ETag stands for them).
* ``delta``: the table at the URL read by delta-rs at the pinned (or latest) version; the fingerprint is the
  table id and the version, and every data file of the snapshot must lie under the table's prefix.

Messages name the source and the rule, never the URL, a key, a credential or the store's own text.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import pyarrow as pa

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import ExecutionError, InputError, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import (
    STORE_GLOB_CHARACTERS,
    CsvSource,
    DeltaSource,
    ParquetSource,
)
from durable_dataflow.datasources import objectstore
from durable_dataflow.datasources.objectstore import StoreOptions, StoreUrl

if TYPE_CHECKING:
    from durable_dataflow.dataflow.execution.context import ExecutionContext

# At most this many keys are listed under one prefix (matching or not), so a prefix holding millions of
# unrelated objects fails fast instead of listing for the whole time limit.
LISTED_KEYS_MAX = 100_000
HEAD_THREADS = 8
# The caps of a local Parquet folder and Delta snapshot (sources.PARQUET_FOLDER_FILES_MAX and DELTA_FILES_MAX,
# equal by test), written here since sources imports this module.
PARQUET_OBJECTS_MAX = 10_000
DELTA_OBJECTS_MAX = 100_000
_MISSING = ("404", "NoSuchKey", "NotFound")


@dataclass(frozen=True)
class ObjectStamp:
    """What the store says about one object; equal stamps mean the same unchanged object (an ETag
    names the object's bytes, a version id the write that made them)."""

    bucket: str
    key: str
    etag: str
    size: int
    version_id: str | None = None

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class StoreRead:
    """A resolved store source: the dataset the engine scans, what was stamped, and the fingerprint."""

    dataset: Any
    objects: tuple[ObjectStamp, ...]
    store: StoreOptions
    fingerprint: str


def is_store_source(spec: object) -> TypeGuard[CsvSource | ParquetSource | DeltaSource]:
    """Whether a source reads an object store: a csv, parquet or delta source whose path is ``s3://``."""
    return isinstance(spec, CsvSource | ParquetSource | DeltaSource) and objectstore.is_store_url(spec.path)


def _listing_root(url: StoreUrl) -> StoreUrl:
    """The literal part of a glob URL (the segments before the first one holding a glob character)."""
    segments = url.key.split("/") if url.key else []
    literal = []
    for segment in segments:
        if STORE_GLOB_CHARACTERS.search(segment):
            break
        literal.append(segment)
    return StoreUrl(url.bucket, "/".join(literal))


StoreSpec = CsvSource | ParquetSource | DeltaSource


def _confined_options(name: str, spec: StoreSpec, ctx: ExecutionContext) -> Mapping[str, Any]:
    what = f"source {name!r}"
    url = objectstore.parse_url(spec.path, what)
    confined = objectstore.confine(_listing_root(url), spec.options or {}, ctx.store_grants, "read", what)
    objectstore.check_options(confined, what)
    return confined


def preflight(name: str, spec: StoreSpec, ctx: ExecutionContext) -> None:
    """What can be refused without the network or a secret's value, before a run is recorded: the URL, the
    tenant's grants (prefix, endpoint, credentials named) and the options' shapes."""
    _confined_options(name, spec, ctx)


def _open(name: str, spec: StoreSpec, ctx: ExecutionContext) -> tuple[StoreUrl, StoreOptions]:
    what = f"source {name!r}"
    confined = _confined_options(name, spec, ctx)
    store = objectstore.store_options(confined, ctx.secrets, what, extra=frozenset())
    return objectstore.parse_url(spec.path, what), store


# ---- talking to the store ----------------------------------------------------------------------


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        error = response.get("Error") or {}
        return str(error.get("Code") or (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or "")
    return ""


def _store_error(name: str, exc: BaseException, doing: str) -> InputError | ExecutionError:
    """A store's refusal as a message naming the source and the rule (never the store's text)."""
    code = _code(exc)
    what = f"source {name!r}"
    if code == "NoSuchBucket":
        return InputError(f"{what}: the bucket does not exist")
    if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return InputError(f"{what}: the object store refused access while {doing} (check the credentials)")
    if code in _MISSING:
        return InputError(f"{what}: the object does not exist")
    return ExecutionError(f"{what}: the object store failed while {doing} ({objectstore.describe_error(exc)})")


def _head(client: Any, bucket: str, key: str) -> ObjectStamp | None:
    """The object's stamp, None when it does not exist; other errors are raised."""
    from botocore.exceptions import ClientError

    try:
        answer = client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if _code(exc) in _MISSING:
            return None
        raise
    etag = str(answer.get("ETag") or "").strip('"')
    version = answer.get("VersionId")
    return ObjectStamp(bucket, key, etag, int(answer.get("ContentLength") or 0), str(version) if version else None)


def _stamps(name: str, client: Any, bucket: str, keys: list[str]) -> tuple[ObjectStamp, ...]:
    """Every key's stamp, asked in parallel; an object gone since it was listed fails the attempt."""
    with concurrent.futures.ThreadPoolExecutor(HEAD_THREADS) as pool:
        try:
            found = list(pool.map(lambda key: _head(client, bucket, key), keys))
        except Exception as exc:  # botocore raises many types; each means the store did not answer as asked
            raise _store_error(name, exc, "reading the objects' metadata") from None
    if any(stamp is None for stamp in found):
        raise ExecutionError(
            f"source {name!r}: an object was removed while the run listed it; the attempt recorded nothing "
            "and can be run again"
        )
    return tuple(stamp for stamp in found if stamp is not None)


def _check_deadline(name: str, ctx: ExecutionContext) -> None:
    if ctx.deadline_at is not None and time.monotonic() > ctx.deadline_at:
        raise LimitExceeded(
            f"source {name!r} exceeded the time limit of {ctx.limits.time_limit_s:g} s while its objects were listed"
        )


def _list(name: str, client: Any, root: StoreUrl, ctx: ExecutionContext) -> list[str]:
    """Every key under the prefix ``root`` (segment-wise: ``p`` lists ``p/…``, never ``pq``)."""
    prefix = f"{root.key}/" if root.key else ""
    keys: list[str] = []
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=root.bucket, Prefix=prefix)
        for page in pages:  # ends with the listing, at the cap or when time runs out
            keys.extend(str(item["Key"]) for item in page.get("Contents") or ())
            if len(keys) > LISTED_KEYS_MAX:
                raise InputError(f"source {name!r}: the prefix holds more than {LISTED_KEYS_MAX} objects")
            _check_deadline(name, ctx)
    except (InputError, LimitExceeded):
        raise
    except Exception as exc:
        raise _store_error(name, exc, "listing the prefix") from None
    return keys


def _segments_match(pattern: list[str], relative: list[str]) -> bool:
    return len(pattern) == len(relative) and all(
        fnmatch.fnmatchcase(segment, p) for segment, p in zip(relative, pattern, strict=True)
    )


def _parquet_keys(
    name: str, client: Any, url: StoreUrl, path: str, ctx: ExecutionContext
) -> tuple[StoreUrl, list[str]]:
    """(the prefix the keys are relative to, the matching keys sorted) for an s3:// parquet path."""
    glob = STORE_GLOB_CHARACTERS.search(url.key) is not None
    root = _listing_root(url) if glob else url
    if not glob and url.key and not path.endswith("/"):
        try:
            single = _head(client, url.bucket, url.key)
        except Exception as exc:
            raise _store_error(name, exc, "reading the object's metadata") from None
        if single is not None:
            return StoreUrl(url.bucket, url.key.rpartition("/")[0]), [url.key]
    pattern = url.key[len(root.key) :].lstrip("/").split("/") if glob else None
    found = []
    for key in _list(name, client, root, ctx):
        relative = key[len(root.key) :].lstrip("/") if root.key else key
        parts = relative.split("/")
        if key.endswith("/") or any(part.startswith((".", "_")) for part in parts):
            continue  # a folder marker, or writers' temporary and metadata objects
        if any(part in ("", ".", "..") for part in parts):
            raise InputError(f"source {name!r}: an object key under the prefix has an empty, '.' or '..' segment")
        if pattern is not None and not _segments_match(pattern, parts):
            continue
        if pattern is None and not relative.endswith(".parquet"):
            continue
        found.append(key)
        if len(found) > PARQUET_OBJECTS_MAX:
            raise InputError(f"source {name!r}: more than {PARQUET_OBJECTS_MAX} parquet objects")
    if not found:
        raise InputError(
            f"source {name!r}: no parquet object at the path (no such object, and no .parquet objects under it)"
            if pattern is None
            else f"source {name!r}: no object matches the glob"
        )
    return root, sorted(found)


def _check_size(name: str, objects: tuple[ObjectStamp, ...], bytes_max: int) -> None:
    if sum(o.size for o in objects) > bytes_max:
        what = "its object is" if len(objects) == 1 else f"its {len(objects)} objects are"
        raise LimitExceeded(f"source {name!r}: {what} larger than the source limit of {bytes_max} bytes")


def _fingerprint(root: StoreUrl, objects: tuple[ObjectStamp, ...]) -> str:
    parts = sorted(
        [o.key[len(root.key) :].lstrip("/") if root.key else o.key, o.etag, str(o.size), o.version_id or ""]
        for o in objects
    )
    return hashing.digest({"store": "s3", "objects": parts})


# ---- the kinds --------------------------------------------------------------------------------------


def resolve_parquet(name: str, spec: ParquetSource, ctx: ExecutionContext) -> StoreRead:
    url, store = _open(name, spec, ctx)
    client = store.client()
    root, keys = _parquet_keys(name, client, url, spec.path, ctx)
    objects = _stamps(name, client, url.bucket, keys)
    _check_size(name, objects, ctx.limits.source_bytes_max)
    import pyarrow.dataset as ds

    try:  # reads the first object's footer for the schema, no data page
        dataset = ds.dataset([f"{o.bucket}/{o.key}" for o in objects], filesystem=store.filesystem(), format="parquet")
    except (pa.ArrowException, OSError) as exc:  # pyarrow's text quotes the URL: its type only
        raise ExecutionError(f"source {name!r}: cannot read the parquet objects ({type(exc).__name__})") from None
    return StoreRead(dataset, objects, store, _fingerprint(root, objects))


def resolve_csv(name: str, spec: CsvSource, ctx: ExecutionContext) -> StoreRead:
    url, store = _open(name, spec, ctx)
    client = store.client()
    if not url.key:
        raise InputError(f"source {name!r}: a csv source on s3:// names one object")
    try:
        single = _head(client, url.bucket, url.key)
    except Exception as exc:
        raise _store_error(name, exc, "reading the object's metadata") from None
    if single is None:
        raise InputError(f"source {name!r}: the object does not exist")
    objects = (single,)
    _check_size(name, objects, ctx.limits.source_bytes_max)
    import pyarrow.csv as pcsv
    import pyarrow.dataset as ds

    declared = list(spec.columns or {})
    file_format = ds.CsvFileFormat(
        read_options=pcsv.ReadOptions(column_names=None if spec.header else declared),
        parse_options=pcsv.ParseOptions(delimiter=spec.delimiter, newlines_in_values=True),
        # Declared columns are read as text and converted by the engine's checked casts, as a local
        # CSV's are parsed by DuckDB's reader: a value that is not of its declared type fails the run.
        convert_options=pcsv.ConvertOptions(
            column_types=dict.fromkeys(declared, pa.string()), strings_can_be_null=True
        ),
    )
    try:  # reads the object's first block for the header and the inferred types
        dataset = ds.dataset([f"{single.bucket}/{single.key}"], filesystem=store.filesystem(), format=file_format)
    except (pa.ArrowException, OSError) as exc:
        raise ExecutionError(f"source {name!r}: cannot read the csv object ({type(exc).__name__})") from None
    root = StoreUrl(url.bucket, url.key.rpartition("/")[0])
    return StoreRead(dataset, objects, store, _fingerprint(root, objects))


def _delta_file_inside(name: str, relative: str, table: StoreUrl) -> None:
    """A data file of the snapshot, named by the log's add action, must lie under the table's prefix: a
    log may name any path or URL (another bucket, another tenant's prefix)."""
    if "://" in relative:
        try:
            inside = objectstore.parse_url(relative, f"source {name!r}").within(table)
        except InputError:
            inside = False
    else:
        path = urllib.parse.unquote(relative)
        segments = path.split("/")
        inside = not path.startswith("/") and not any(s in ("", ".", "..") for s in segments)
    if not inside:
        raise InputError(f"source {name!r}: the delta log names a data file outside the table's prefix")


def deltalake_for(name: str) -> Any:
    """The deltalake module (the optional extra, imported only when a delta source is used); InputError
    naming the source when it is not installed. Local and s3:// delta sources alike."""
    try:
        import deltalake
    except ImportError:
        raise InputError(
            f"source {name!r} is a delta table but the deltalake package is not installed: "
            "install durable-dataflow[delta]"
        ) from None
    return deltalake


def resolve_delta(name: str, spec: DeltaSource, ctx: ExecutionContext) -> StoreRead:
    deltalake = deltalake_for(name)
    url, store = _open(name, spec, ctx)
    try:
        table = deltalake.DeltaTable(url.url, storage_options=store.delta_storage_options(), version=spec.version)
        actions = table.get_add_actions(flatten=True)
        relative_paths = [str(p) for p in actions.column("path").to_pylist()]
        sizes = [int(s or 0) for s in actions.column("size_bytes").to_pylist()]
        version, table_id = int(table.version()), str(table.metadata().id)
    except Exception as exc:  # deltalake raises many unrelated types; its text quotes URLs and requests
        raise _delta_error(name, store, url, exc) from None
    if len(relative_paths) > DELTA_OBJECTS_MAX:
        raise InputError(f"source {name!r}: the delta snapshot has more than {DELTA_OBJECTS_MAX} files")
    for relative in relative_paths:
        _delta_file_inside(name, relative, url)
    if sum(sizes) > ctx.limits.source_bytes_max:
        raise LimitExceeded(
            f"source {name!r}: its {len(sizes)} data files are larger than the source limit of "
            f"{ctx.limits.source_bytes_max} bytes"
        )
    try:
        dataset = table.to_pyarrow_dataset()
    except Exception as exc:  # e.g. a reader feature (deletion vectors, column mapping) it cannot apply
        raise ExecutionError(f"source {name!r}: cannot scan the delta table ({type(exc).__name__})") from None
    fingerprint = hashing.digest({"uri": url.url, "table_id": table_id, "version": version})
    return StoreRead(dataset, (), store, fingerprint)


def _delta_error(name: str, store: StoreOptions, url: StoreUrl, exc: BaseException) -> InputError | ExecutionError:
    """Why delta-rs could not open the table, told by the store itself (one listing of the log), since
    delta-rs's own text quotes URLs and requests."""
    kind = type(exc).__name__
    try:
        listed = store.client().list_objects_v2(Bucket=url.bucket, Prefix=url.child("_delta_log").key + "/", MaxKeys=1)
    except Exception as listing:
        return _store_error(name, listing, "opening the delta table")
    if not listed.get("Contents"):
        return InputError(f"source {name!r}: the path is not a delta table (no _delta_log under it)")
    return ExecutionError(f"source {name!r}: cannot read the delta table ({kind})")


def first_changed(store: StoreOptions, objects: tuple[ObjectStamp, ...]) -> str | None:
    """The name of the first object whose stamp the store no longer gives (rewritten, removed, or the
    store cannot tell), else None."""
    if not objects:
        return None
    client = store.client()

    def again(before: ObjectStamp) -> bool:
        try:
            return _head(client, before.bucket, before.key) == before
        except Exception:  # the store cannot confirm it: not proven unchanged
            return False

    with concurrent.futures.ThreadPoolExecutor(HEAD_THREADS) as pool:
        unchanged = list(pool.map(again, objects))
    return next((o.name for o, same in zip(objects, unchanged, strict=True) if not same), None)
