"""Parquet folder provider: one data file and one manifest per idempotency key.

Layout of a sink folder:
- `_locks/<h>.lock`      the per-key lock (`fcntl.flock`), held for every check-and-write;
- `data/<h>.parquet`     the published rows of one key;
- `_manifests/<h>.json`  the key's record: `{kind: publication|fence, key, digest, token, rows,
                         file, fence}`; `h` is the sha256 of the key, so file names are injective
                         and a key can never name a path.

The manifest is the commit point: data is written to a temp file, fsynced and renamed into
`data/`, then the manifest is written the same way. A data file without a publication manifest
is not published (an orphan of a crash) and is removed by the next publish of that key. A fence
is a manifest of kind `fence`; only a publication manifest ever replaces it. `prepare` creates the
layout before dispatch is authorized, and the folder's marker `_location.json` (a random id, written
once, never replaced): `locate` names the folder by it, so a folder re-created by anyone else (or an
empty mount point) is never taken for the one the platform prepared. `inspect` creates nothing, and a
missing folder is `Undecided`.
Proof horizon: as long as nobody deletes the manifests (they are the only record).

A location that is an ``s3://bucket/prefix`` URL is a folder on an object store: there the key's record
is one state object moved by conditional puts (`parquet_store`, which documents that encoding).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from durable_dataflow.core.errors import InputError
from durable_dataflow.datasources import parquet_store
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
    resolve_location,
    resolve_location_named,
)
from durable_dataflow.datasources.objectstore import is_store_url

LOCK_WAIT_S = 30.0
LOCK_POLL_S = 0.01
MANIFEST_BYTES_MAX = 64 * 1024
READ_FILES_MAX = 100_000
ORPHANS_MAX = 1_000
MANIFEST_VERSION = 1
SUBFOLDERS = ("_locks", "data", "_manifests")
# The folder's marker: {"v": 1, "id": <uuid4 hex>}, created once by `prepare`.
MARKER = "_location.json"
MARKER_BYTES_MAX = 4096


def key_hash(key: str) -> str:
    """The injective, path-safe file stem of a key."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ManifestError(ValueError):
    """A manifest that is not the key's record; the message names the file by its stem, never its path."""


class LockTimeout(TimeoutError):
    """The per-key lock was not acquired within LOCK_WAIT_S."""


@contextlib.contextmanager
def _key_lock(folder: Path, stem: str) -> Iterator[None]:
    """Hold the exclusive per-key lock, waiting at most LOCK_WAIT_S."""
    lock_path = folder / "_locks" / f"{stem}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeout(f"key lock not acquired within {LOCK_WAIT_S}s") from None
                time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_durably(tmp: Path, final: Path) -> None:
    """fsync the temp file, rename it over `final` atomically, then fsync the directory."""
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _read_marker(path: Path) -> bytes:
    """The marker's first bytes. Opened without blocking and without following a symlink, and read only
    when it is a regular file: a FIFO (or a symlink to a device) in its place would block or never end,
    and is not a marker this provider wrote (ValueError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"the folder's {MARKER} is not a marker this provider wrote") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"the folder's {MARKER} is not a marker this provider wrote")
        return handle.read(MARKER_BYTES_MAX + 1)


class ParquetFolderProvider:
    """Publishes each key's rows as one Parquet file in a folder, committed by a manifest."""

    name = "parquet"
    capabilities: frozenset[Capability] = frozenset({"publish", "inspect"})

    def _prepare(self, folder: Path) -> None:
        """The marker first, then the subfolders: a folder caught half prepared (a concurrent first run of
        the datasource, a crash) has no subfolders yet, so ``locate`` reads nothing there and the next
        preparer completes it. Subfolders first made it read as a folder laid out before markers
        (``occupied``), and a concurrent run failed ``location_missing``."""
        folder.mkdir(parents=True, exist_ok=True)
        self._mark(folder)
        missing = [folder / sub for sub in SUBFOLDERS if not (folder / sub).is_dir()]
        for sub_folder in missing:
            sub_folder.mkdir(exist_ok=True)
        if missing:  # a prepared folder (every later run's) costs no directory fsync, as before
            _fsync_dir(folder)

    def _mark(self, folder: Path) -> None:
        if (folder / MARKER).exists():
            return
        tmp = folder / f".{MARKER}.{uuid.uuid4().hex}.tmp"
        tmp.write_bytes(json.dumps({"v": 1, "id": uuid.uuid4().hex}).encode("utf-8"))
        try:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            # A hard link never replaces: of two concurrent preparers one marker wins, and both read it.
            with contextlib.suppress(FileExistsError):
                os.link(tmp, folder / MARKER)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(folder)

    def prepare(self, target: PublishTarget) -> None:
        """Create the folder, its subfolders and its marker before dispatch is authorized (`contract.prepare`);
        on an object store, probe its conditional writes and create the location's marker."""
        if is_store_url(target.location):
            parquet_store.prepare(target)
            return
        self._prepare(resolve_location(target))

    def locate(self, target: PublishTarget) -> Location:
        """The resolved folder and its marker's id (`contract.locate`); None when the folder, a subfolder
        or the marker is missing (occupied: a folder laid out before folders carried a marker). A marker
        that is not one this provider wrote raises ValueError."""
        if is_store_url(target.location):
            return parquet_store.locate(target)
        folder = resolve_location(target)
        place = f"parquet:{folder}"
        if not all((folder / sub).is_dir() for sub in SUBFOLDERS):
            return Location(place, None)
        try:
            raw = _read_marker(folder / MARKER)
        except FileNotFoundError:
            return Location(place, None, occupied=True)
        try:
            marker = json.loads(raw) if len(raw) <= MARKER_BYTES_MAX else None
        except ValueError:
            marker = None
        marker_id = marker.get("id") if isinstance(marker, dict) else None
        if not isinstance(marker_id, str) or not marker_id.isalnum() or len(marker_id) != 32:
            raise ValueError(f"the folder's {MARKER} is not a marker this provider wrote")
        return Location(place, f"parquet-folder:{marker_id}")

    def _refs(self, where: str, manifest: dict[str, Any]) -> PublicationRefs:
        """`where` names the folder as `resolve_location_named` does: relative to the sink root."""
        return PublicationRefs(
            publication_ref=f"parquet://{where}/_manifests/{key_hash(manifest['key'])}.json",
            datasource_ref=f"parquet://{where}",
            materialization_ref=f"parquet://{where}/{manifest['file']}",
        )

    def _read_manifest(self, folder: Path, key: str) -> dict[str, Any] | None:
        path = folder / "_manifests" / f"{key_hash(key)}.json"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(raw) > MANIFEST_BYTES_MAX:
            raise ManifestError(f"manifest {path.name} is larger than {MANIFEST_BYTES_MAX} bytes")
        try:
            manifest: dict[str, Any] = json.loads(raw)
        except ValueError:
            raise ManifestError(f"manifest {path.name} is not valid JSON") from None
        kind = manifest.get("kind") if isinstance(manifest, dict) else None
        if kind not in ("publication", "fence") or manifest.get("key") != key:
            raise ManifestError(f"manifest {path.name} does not record key {key!r}")
        return manifest

    def _write_manifest(self, folder: Path, manifest: dict[str, Any]) -> None:
        stem = key_hash(manifest["key"])
        tmp = folder / "_manifests" / f".{stem}.{uuid.uuid4().hex}.tmp"
        tmp.write_bytes(json.dumps(manifest, sort_keys=True).encode("utf-8"))
        _replace_durably(tmp, folder / "_manifests" / f"{stem}.json")

    def preflight(self, target: PublishTarget) -> None:
        """What is knowable without writing: the mode is 'append' and the folder resolves inside its root."""
        if is_store_url(target.location):
            parquet_store.preflight(target)
            return
        if target.mode != "append":
            raise InputError("a parquet folder publishes each key as its own file: only mode 'append'")
        resolve_location(target)

    def publish(
        self, key: str, token: int, table: pa.Table, digest: str, target: PublishTarget
    ) -> PublishOutcome:
        """Check the manifest and write data + manifest under the key's lock (DESIGN §9).

        `InputError` (key, token, location) is raised before the folder is touched. The folder was
        prepared before dispatch was authorized and is never created here: missing now, it may have
        been moved or not be mounted, and an earlier publication may be in it (Inconclusive)."""
        check_key(key)
        check_token(token)
        if is_store_url(target.location):
            return parquet_store.publish(key, token, table, digest, target)
        if target.mode != "append":
            return Rejected("a parquet folder publishes each key as its own file: only mode 'append'")
        folder, where = resolve_location_named(target)
        if not all((folder / sub).is_dir() for sub in SUBFOLDERS):
            raise Inconclusive(f"parquet publish of key {key!r}: {LOCATION_MISSING}")
        stem = key_hash(key)
        try:
            with _key_lock(folder, stem):
                return self._publish_locked(folder, where, key, token, table, digest)
        except LockTimeout as exc:
            raise Inconclusive(
                f"parquet publish of key {key!r}: the key lock was not acquired within {LOCK_WAIT_S}s"
            ) from exc

    def _publish_locked(
        self, folder: Path, where: str, key: str, token: int, table: pa.Table, digest: str
    ) -> PublishOutcome:
        try:
            existing = self._read_manifest(folder, key)
        except ManifestError as exc:
            raise Inconclusive(f"cannot read the manifest of key {key!r}: {exc}") from exc
        except OSError as exc:
            raise Inconclusive(f"cannot read the manifest of key {key!r}: {describe_exception(exc)}") from exc
        if existing is not None and existing["kind"] == "publication":
            return AlreadyPublished(self._refs(where, existing), existing["digest"])
        fence = None if existing is None else int(existing["token"])
        if fence is not None and token < fence:
            return Fenced(fence)
        stem = key_hash(key)
        data_rel = f"data/{stem}.parquet"
        tmp = folder / "data" / f".{stem}.{uuid.uuid4().hex}.tmp"
        try:
            # A data or temp file here has no publication manifest: an orphan of an earlier crash.
            (folder / data_rel).unlink(missing_ok=True)
            for orphan in list((folder / "data").glob(f".{stem}.*.tmp"))[:ORPHANS_MAX]:
                orphan.unlink(missing_ok=True)
            pq.write_table(table, tmp)
            _replace_durably(tmp, folder / data_rel)
        except Exception as exc:
            # Before the manifest is written nothing is published, whatever the data file's state.
            tmp.unlink(missing_ok=True)
            return Rejected(f"writing the data file failed before the commit point: {describe_exception(exc)}")
        manifest = {
            "v": MANIFEST_VERSION,
            "kind": "publication",
            "key": key,
            "digest": digest,
            "token": token,
            "rows": table.num_rows,
            "file": data_rel,
            "fence": fence,
        }
        try:
            self._write_manifest(folder, manifest)
        except OSError as exc:
            # The rename may or may not have reached the disk: only an inspection can tell.
            raise Inconclusive(f"writing the manifest of key {key!r} failed: {describe_exception(exc)}") from exc
        return Published(self._refs(where, manifest), digest)

    def inspect(self, key: str, target: PublishTarget, fence: int | None = None) -> InspectOutcome:
        """Read the key's manifest under its lock; with a fence, raise the fence before Absent.

        A folder (or its `_locks`/`_manifests`) that is missing is `Undecided` and is not created."""
        check_key(key)
        if fence is not None:
            check_token(fence, "fence")
        if is_store_url(target.location):
            return parquet_store.inspect(key, target, fence)
        failed = f"parquet inspection of key {key!r} failed"
        try:
            folder, where = resolve_location_named(target)
            if not all((folder / sub).is_dir() for sub in ("_locks", "_manifests")):
                # Prepared before dispatch was authorized, so missing now means unseen, never absent.
                return Undecided(f"{failed}: {LOCATION_MISSING}")
            with _key_lock(folder, key_hash(key)):
                return self._inspect_locked(folder, where, key, fence)
        except ManifestError as exc:
            return Undecided(f"{failed}: {exc}")
        except LockTimeout:
            return Undecided(f"{failed}: the key lock was not acquired within {LOCK_WAIT_S}s")
        except (OSError, ValueError) as exc:
            why = describe_exception(exc)
            return Undecided(f"{failed}: the sink folder could not be resolved, read or written ({why})")

    def _inspect_locked(self, folder: Path, where: str, key: str, fence: int | None) -> InspectOutcome:
        manifest = self._read_manifest(folder, key)
        if manifest is not None and manifest["kind"] == "publication":
            return Present(self._refs(where, manifest), manifest["digest"], int(manifest["token"]))
        current = None if manifest is None else int(manifest["token"])
        if fence is None:
            return Absent(current)
        if current is not None and current >= fence:
            return Absent(current)
        self._write_manifest(folder, {"v": MANIFEST_VERSION, "kind": "fence", "key": key, "token": fence})
        return Absent(fence)

    def read(self, target: PublishTarget) -> pa.Table:
        """Every published key's rows (publication manifests only; orphans and fences ignored).

        Not part of the contract (no capability; the platform never reads a sink): the tests read
        the sink with it."""
        if is_store_url(target.location):
            return parquet_store.read(target)
        folder = resolve_location(target)
        manifests = sorted((folder / "_manifests").glob("*.json"))[:READ_FILES_MAX]
        tables = []
        for path in manifests:
            manifest = json.loads(path.read_bytes())
            if manifest.get("kind") == "publication":
                tables.append(pq.read_table(folder / manifest["file"]))
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables)
