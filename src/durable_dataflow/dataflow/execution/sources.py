"""Source resolution: what each source is, where its bytes are, and a fingerprint of what was read.

Resolution reads no data. Files are confined to the allowed roots (after resolving symlinks and
``..``), stamped (device, inode, size, modification and change times) and fingerprinted cheaply;
the engine then reads the files itself, and ``check_unchanged`` stamps them again once it is done,
so a file replaced, rewritten or swapped for a symlink between fingerprint and read fails the
attempt (recomputable) instead of recording a fingerprint of other bytes. What each fingerprint
proves (docs/engines.md):

* ``csv``: the SHA-256 of the file's bytes, streamed in blocks (a CSV has no cheaper summary).
* ``parquet``: per file, the SHA-256 of its footer (schema, row groups, column chunk offsets, sizes
  and statistics) with the file size; a folder adds the relative name of every file. It identifies
  the file version by its structure, not by hashing every data page.
* ``delta``: the table id and the version of the pinned snapshot (a Delta version is immutable),
  and every data file of that snapshot is confined and stamped like a file source.
* ``s3://`` parquet, csv and delta (``store_sources``): per object its ETag, size and version id (a
  Delta table: its id and version); the objects are asked again after the read.
* ``inline``: the output digest of its typed table.
* ``postgres``: the output digest of the result rows, computed while they stream (known only
  once the engine has read them: ``PostgresStream.fingerprint``).
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import os
import re
import stat
import time
import urllib.parse
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import ExecutionError, InputError, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import (
    CsvSource,
    DeltaSource,
    InlineSource,
    ParquetSource,
    PostgresSource,
    arrow_schema_of,
)
from durable_dataflow.dataflow.execution import arrowdigest, store_sources
from durable_dataflow.dataflow.execution.postgres_source import PostgresStream
from durable_dataflow.dataflow.execution.store_sources import ObjectStamp, StoreRead

if TYPE_CHECKING:
    from durable_dataflow.dataflow.definitions.definitions import Definition, SourceSpec
    from durable_dataflow.dataflow.execution.context import ExecutionContext
    from durable_dataflow.datasources.objectstore import StoreOptions

PARQUET_FOLDER_FILES_MAX = 10_000
DELTA_FILES_MAX = 100_000
ERROR_LINE_CHARS_MAX = 300
HASH_BLOCK_BYTES = 1024 * 1024
PARQUET_MAGIC = b"PAR1"
PARQUET_TAIL_BYTES = 8  # footer length (4 bytes, little endian) + magic
PARQUET_FOOTER_BYTES_MAX = 256 * 1024 * 1024
# DuckDB expands these in a file name; a source names files and folders, never patterns.
_GLOB_CHARACTERS = re.compile(r"[*?\[\]{}]")



@dataclass(frozen=True)
class FileStamp:
    """What the file system says about one confined file; equal stamps mean the same unchanged file."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, source: str, path: Path) -> FileStamp:
        try:
            info = os.lstat(path)  # lstat: a file swapped for a symlink gets another stamp
        except OSError as exc:
            raise ExecutionError(f"source {source!r}: cannot stat {path.name!r}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"source {source!r}: {path.name!r} is not a regular file")
        return cls(str(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


@dataclass(frozen=True)
class DirStamp:
    """The identity of a folder on a source file's path: a folder swapped for another (or for a
    symlink) between resolution and reading gets another stamp. Times are not compared, since a
    folder's change time moves whenever any file in it is added or removed."""

    path: str
    device: int
    inode: int
    is_link: bool

    @classmethod
    def of(cls, path: Path) -> DirStamp | None:
        try:
            info = os.lstat(path)
        except OSError:
            return None
        return cls(str(path), info.st_dev, info.st_ino, stat.S_ISLNK(info.st_mode))


def _dir_stamps(files: tuple[FileStamp, ...], roots: tuple[Path, ...]) -> tuple[DirStamp, ...]:
    """The folders from each file's parent up to the allowed root that holds it."""
    resolved_roots = [root.resolve() for root in roots]
    folders: set[Path] = set()
    for stamp in files:
        folder = Path(stamp.path).parent
        root = next((r for r in resolved_roots if folder.is_relative_to(r)), None)
        while root is not None and folder.is_relative_to(root) and folder not in folders:
            folders.add(folder)  # ends at the root, or at a folder already stamped for another file
            folder = folder.parent
    return tuple(d for d in (DirStamp.of(f) for f in sorted(folders)) if d is not None)


@dataclass(frozen=True)
class FileScan:
    """Files the engine reads itself: ``reader`` is ``read_parquet`` or ``read_csv``, ``options`` its
    named options as SQL text (built by the platform from the definition, never user SQL)."""

    reader: str
    stamps: tuple[FileStamp, ...]
    options: tuple[tuple[str, str], ...] = ()
    declared: dict[str, str] | None = None  # declared column types (Arrow type names)


@dataclass(frozen=True)
class ArrowTable:
    """A table built in memory by the platform (inline rows)."""

    table: pa.Table


@dataclass(frozen=True)
class ArrowDataset:
    """A pyarrow dataset the engine scans with pushdown (a pinned Delta snapshot, or objects on a store).

    A store's dataset carries its stamped ``objects`` and the ``store`` options to ask about them again
    (``check_unchanged``), and the ``declared`` column types the engine converts to by checked casts. It
    crosses to an executor process pickled (pyarrow pickles the dataset with its filesystem)."""

    dataset: Any
    stamps: tuple[FileStamp, ...]
    declared: dict[str, str] | None = None
    objects: tuple[ObjectStamp, ...] = ()
    store: StoreOptions | None = None


Binding = FileScan | ArrowTable | ArrowDataset | PostgresStream


@dataclass(frozen=True)
class ResolvedSource:
    """A source ready for the engine: how to bind it, and the fingerprint of what it reads."""

    name: str
    kind: str
    binding: Binding
    fingerprint_known: str | None = field(default=None)
    dir_stamps: tuple[DirStamp, ...] = ()

    @property
    def fingerprint(self) -> str:
        """The fingerprint; for a streamed query, only after the engine has read it."""
        if isinstance(self.binding, PostgresStream):
            if self.binding.fingerprint is None:
                raise ExecutionError(f"source {self.name!r} has not been read yet")
            return self.binding.fingerprint
        if self.fingerprint_known is None:  # every other kind is fingerprinted when resolved
            raise ExecutionError(f"source {self.name!r} has no fingerprint")
        return self.fingerprint_known

    @property
    def stamps(self) -> tuple[FileStamp, ...]:
        binding = self.binding
        return binding.stamps if isinstance(binding, FileScan | ArrowDataset) else ()

    @property
    def objects(self) -> tuple[ObjectStamp, ...]:
        return self.binding.objects if isinstance(self.binding, ArrowDataset) else ()


def confine_path(source: str, raw_path: str, ctx: ExecutionContext) -> Path:
    """The resolved path of a source, which must exist and lie inside one of ctx.allowed_roots.

    The roots are checked first, on the path as it resolves whether or not it exists, and every
    path outside them gets one message: a refusal never tells whether a file exists elsewhere, or
    what it is (the platform's database, its secrets). Messages never quote the path."""
    if "\x00" in raw_path:  # no file name holds one (other characters are quoted as literals)
        raise InputError(f"source {source!r}: the path contains a NUL character")
    candidate = Path(raw_path)
    if not candidate.is_absolute():
        candidate = ctx.base_dir / candidate
    try:
        lexical = candidate.resolve(strict=False)
    except (OSError, RuntimeError, ValueError):  # RuntimeError: a symlink loop
        raise InputError(f"source {source!r}: the path cannot be resolved (a symlink loop, or unreadable)") from None
    roots = [root.resolve() for root in ctx.allowed_roots]
    outside = InputError(
        f"source {source!r}: the path resolves outside the run's data roots (a tenant's own folder and its "
        "granted roots; for the CLI the definition's folder and DATAFLOW_DATA_ROOTS); symlinks and '..' "
        "cannot leave them"
    )
    if not any(lexical.is_relative_to(root) for root in roots):
        raise outside
    try:
        resolved = candidate.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"source {source!r}: the path does not exist") from None
    except (OSError, RuntimeError, ValueError):
        raise InputError(f"source {source!r}: the path cannot be resolved (a symlink loop, or unreadable)") from None
    if not any(resolved.is_relative_to(root) for root in roots):
        raise outside  # it changed between the two resolutions
    if any(resolved == f or resolved.is_relative_to(f) for f in ctx.forbidden):
        raise InputError(
            f"source {source!r}: the path is one of the platform's own files (its database or "
            "its secrets directory), which no source may read"
        )
    if _GLOB_CHARACTERS.search(str(resolved)):
        raise InputError(
            f"source {source!r}: the path contains a glob character (* ? [ ] {{ }}); "
            "name a file or a folder, and rename files whose names contain these characters"
        )
    return resolved


def _check_size(source: str, stamps: tuple[FileStamp, ...], bytes_max: int) -> None:
    total = sum(s.size for s in stamps)
    if total > bytes_max:
        what = repr(Path(stamps[0].path).name) if len(stamps) == 1 else f"its {len(stamps)} files"
        raise LimitExceeded(f"source {source!r}: {what} is larger than the source limit of {bytes_max} bytes")


def _open_nofollow(source: str, path: Path) -> int:
    try:
        # O_NOFOLLOW: a file swapped for a symlink after confine_path() is refused, not followed.
        return os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise InputError(f"source {source!r}: cannot read {path.name!r}: {reason}") from None


def _sha256_of_file(source: str, stamp: FileStamp, ctx: ExecutionContext) -> str:
    """The file's SHA-256, read in blocks; hashing counts against the execution's time limit."""
    h = hashlib.sha256()
    descriptor = _open_nofollow(source, Path(stamp.path))
    with os.fdopen(descriptor, "rb", buffering=0) as handle:
        while chunk := handle.read(HASH_BLOCK_BYTES):  # ends at end of file, or when time runs out
            h.update(chunk)
            if ctx.deadline_at is not None and time.monotonic() > ctx.deadline_at:
                raise LimitExceeded(
                    f"source {source!r} exceeded the time limit of {ctx.limits.time_limit_s:g} s "
                    "while its file was being fingerprinted"
                )
    return hashing.PREFIX + h.hexdigest()


def _parquet_footer_fingerprint(source: str, stamp: FileStamp) -> str:
    name = Path(stamp.path).name
    descriptor = _open_nofollow(source, Path(stamp.path))
    with os.fdopen(descriptor, "rb", buffering=0) as handle:
        if stamp.size < 2 * len(PARQUET_MAGIC) + PARQUET_TAIL_BYTES - len(PARQUET_MAGIC):
            raise ExecutionError(f"source {source!r}: {name!r} is too short to be a Parquet file")
        handle.seek(stamp.size - PARQUET_TAIL_BYTES)
        tail = handle.read(PARQUET_TAIL_BYTES)
        footer_bytes = int.from_bytes(tail[:4], "little")
        if tail[4:] != PARQUET_MAGIC or not 0 < footer_bytes <= min(PARQUET_FOOTER_BYTES_MAX, stamp.size):
            raise ExecutionError(f"source {source!r}: {name!r} is not a Parquet file (no valid footer)")
        handle.seek(stamp.size - PARQUET_TAIL_BYTES - footer_bytes)
        footer = handle.read(footer_bytes)
    return hashing.digest({"size": str(stamp.size), "footer": hashing.sha256_bytes(footer)})


def _resolve_csv(name: str, spec: CsvSource, ctx: ExecutionContext, fingerprinted: bool = True) -> ResolvedSource:
    path = confine_path(name, spec.path, ctx)
    stamp = FileStamp.of(name, path)
    _check_size(name, (stamp,), ctx.limits.source_bytes_max)
    from durable_dataflow.dataflow.execution import sandbox  # the literal quoting rule lives with the engine

    options = [("header", "true" if spec.header else "false"), ("delim", sandbox.string_literal(spec.delimiter))]
    scan = FileScan("read_csv", (stamp,), tuple(options), dict(spec.columns) if spec.columns else None)
    folders = _dir_stamps(scan.stamps, ctx.allowed_roots)
    return ResolvedSource(name, "csv", scan, _sha256_of_file(name, stamp, ctx) if fingerprinted else None, folders)


def _parquet_files(name: str, root: Path, ctx: ExecutionContext) -> list[tuple[str, Path]]:
    """(relative name, confined path) of the *.parquet files of a file or folder, sorted by name.

    Files and folders whose names start with '.' or '_' are skipped at any depth (writers' temporary
    and metadata files, as pyarrow and Spark skip them); a symlinked folder is refused rather than
    silently skipped, and every file is confined again (a symlinked file inside may point anywhere).
    """
    if root.is_file():
        return [(root.name, root)]
    found: list[Path] = []
    for folder, subfolders, files in os.walk(root):  # ends when the tree is walked, or at the cap
        here = Path(folder)
        for sub in subfolders:
            if (here / sub).is_symlink() and not sub.startswith((".", "_")):
                linked = (here / sub).relative_to(root).as_posix()
                raise InputError(
                    f"source {name!r}: the folder holds a symlinked folder {linked!r}; name it as a source of its own"
                )
        subfolders[:] = sorted(d for d in subfolders if not d.startswith((".", "_")))
        found.extend(here / f for f in files if f.endswith(".parquet") and not f.startswith((".", "_")))
        if len(found) > PARQUET_FOLDER_FILES_MAX:
            raise InputError(f"source {name!r}: more than {PARQUET_FOLDER_FILES_MAX} parquet files")
    if not found:
        raise InputError(f"source {name!r}: the folder holds no .parquet files")
    return [(p.relative_to(root).as_posix(), confine_path(name, str(p), ctx)) for p in sorted(found)]


def _resolve_parquet(name: str, spec: ParquetSource, ctx: ExecutionContext) -> ResolvedSource:
    root = confine_path(name, spec.path, ctx)
    files = _parquet_files(name, root, ctx)
    stamps = tuple(FileStamp.of(name, path) for _, path in files)
    _check_size(name, stamps, ctx.limits.source_bytes_max)
    parts = [[relative, _parquet_footer_fingerprint(name, s)] for (relative, _), s in zip(files, stamps, strict=True)]
    fingerprint = parts[0][1] if root.is_file() else hashing.digest({"files": parts})
    folders = _dir_stamps(stamps, ctx.allowed_roots)
    declared = dict(spec.columns) if spec.columns else None
    return ResolvedSource(name, "parquet", FileScan("read_parquet", stamps, (), declared), fingerprint, folders)


def _inline_value(value: Any, t: pa.DataType) -> Any:
    """A YAML/JSON scalar in the Python form pyarrow expects for t (dates and decimals come as text)."""
    if isinstance(value, str):
        if pa.types.is_date(t):
            return dt.date.fromisoformat(value)
        if pa.types.is_timestamp(t):
            return dt.datetime.fromisoformat(value)
    if pa.types.is_decimal(t) and isinstance(value, str | int) and not isinstance(value, bool):
        return decimal.Decimal(str(value))
    return value


def _rows_to_table(name: str, rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    arrays = []
    for field_ in schema:
        try:
            values = [_inline_value(row.get(field_.name), field_.type) for row in rows]
            arrays.append(pa.array(values, type=field_.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError, decimal.InvalidOperation) as exc:
            raise InputError(
                f"source {name!r}: column {field_.name!r} does not hold {field_.type} values ({type(exc).__name__})"
            ) from None
    return pa.Table.from_arrays(arrays, schema=schema)


# An inline source is part of an immutable definition: its typed table and fingerprint are computed
# once per spec object (keyed by id(), dropped by a finalizer when the spec dies).
_inline_by_id: dict[int, ResolvedSource] = {}


def _resolve_inline(name: str, spec: InlineSource) -> ResolvedSource:
    cached = _inline_by_id.get(id(spec))
    if cached is not None and cached.name == name:
        return cached
    table = _rows_to_table(name, spec.rows, arrow_schema_of(spec.columns))
    # The typed table's digest covers the schema (names, order, types) and every value.
    resolved = ResolvedSource(name, "inline", ArrowTable(table), arrowdigest.output_digest(table))
    _inline_by_id[id(spec)] = resolved
    weakref.finalize(spec, _inline_by_id.pop, id(spec), None)
    return resolved


def _confine_delta_log(name: str, root: Path) -> None:
    """The table's log must be a real folder of the table holding no symlinks: a log borrowed from
    elsewhere would make the platform read (and quote) another table."""
    log = root / "_delta_log"
    if log.is_symlink() or not log.resolve().is_relative_to(root):
        raise InputError(f"source {name!r}: the delta table's _delta_log leaves the table's folder")
    with os.scandir(log) as entries:
        if any(entry.is_symlink() for entry in entries):
            raise InputError(f"source {name!r}: the delta table's _delta_log holds a symlink")


def _delta_file(name: str, relative: str, root: Path, ctx: ExecutionContext) -> Path:
    """A data file of the snapshot, from the log's (URI-encoded, relative) add path, confined to the
    table's own folder: a log may name any path or URL."""
    path = urllib.parse.unquote(relative)
    if "://" in relative or path.startswith("/") or Path(path).is_absolute():
        raise InputError(f"source {name!r}: the delta log names a data file outside the table's folder")
    confined = confine_path(name, str(root / path), ctx)
    if not confined.is_relative_to(root):
        raise InputError(f"source {name!r}: the delta log names a data file outside the table's folder")
    return confined


def _resolve_delta(name: str, spec: DeltaSource, ctx: ExecutionContext) -> ResolvedSource:
    deltalake = store_sources.deltalake_for(name)
    root = confine_path(name, spec.path, ctx)
    if not (root / "_delta_log").is_dir():
        raise ExecutionError(f"source {name!r}: the path is not a delta table (no _delta_log folder)")
    _confine_delta_log(name, root)
    try:
        table = deltalake.DeltaTable(str(root), version=spec.version)
        relative_paths = [str(p) for p in table.get_add_actions(flatten=True).column("path").to_pylist()]
        version, table_id = int(table.version()), str(table.metadata().id)
    except Exception as exc:  # deltalake raises many unrelated types; all mean "cannot read it"
        # The library's text names absolute paths: the type only (docs/security.md).
        raise ExecutionError(f"source {name!r}: cannot read the delta table ({type(exc).__name__})") from None
    if len(relative_paths) > DELTA_FILES_MAX:
        raise InputError(f"source {name!r}: the delta snapshot has more than {DELTA_FILES_MAX} files")
    stamps = tuple(FileStamp.of(name, _delta_file(name, p, root, ctx)) for p in relative_paths)
    _check_size(name, stamps, ctx.limits.source_bytes_max)
    try:
        dataset = table.to_pyarrow_dataset()
    except Exception as exc:  # e.g. a reader feature (deletion vectors, column mapping) it cannot apply
        raise ExecutionError(f"source {name!r}: cannot scan the delta table ({type(exc).__name__})") from None
    fingerprint = hashing.digest({"uri": root.as_uri(), "table_id": table_id, "version": version})
    folders = _dir_stamps(stamps, ctx.allowed_roots)
    return ResolvedSource(name, "delta", ArrowDataset(dataset, stamps), fingerprint, folders)


def _resolve_store(name: str, spec: CsvSource | ParquetSource | DeltaSource, ctx: ExecutionContext) -> ResolvedSource:
    """An s3:// source (store_sources): a dataset over the store's objects, stamped and fingerprinted by
    what the store says of them (never by hashing their bytes, so also when only schemas are read)."""
    read: StoreRead
    if isinstance(spec, CsvSource):
        read = store_sources.resolve_csv(name, spec, ctx)
    elif isinstance(spec, ParquetSource):
        read = store_sources.resolve_parquet(name, spec, ctx)
    else:
        read = store_sources.resolve_delta(name, spec, ctx)
    declared = dict(spec.columns) if not isinstance(spec, DeltaSource) and spec.columns else None
    binding = ArrowDataset(read.dataset, (), declared, read.objects, read.store)
    return ResolvedSource(name, spec.kind, binding, read.fingerprint)


def _resolve_one(name: str, spec: SourceSpec, ctx: ExecutionContext, fingerprinted: bool = True) -> ResolvedSource:
    if store_sources.is_store_source(spec):
        return _resolve_store(name, spec, ctx)
    if isinstance(spec, CsvSource):
        return _resolve_csv(name, spec, ctx, fingerprinted)
    if isinstance(spec, ParquetSource):
        return _resolve_parquet(name, spec, ctx)
    if isinstance(spec, InlineSource):
        return _resolve_inline(name, spec)
    if isinstance(spec, PostgresSource):
        stream = PostgresStream(spec, name, ctx.limits.source_bytes_max, ctx.limits.time_limit_s, ctx.secrets)
        return ResolvedSource(name, "postgres", stream)
    return _resolve_delta(name, spec, ctx)


def resolve_sources(d: Definition, ctx: ExecutionContext) -> list[ResolvedSource]:
    """Every source of d, confined, stamped and (but for streamed queries) fingerprinted, in order."""
    return [_resolve_one(name, spec, ctx) for name, spec in d.sources.items()]


def resolve_for_schemas(name: str, spec: SourceSpec, ctx: ExecutionContext) -> ResolvedSource:
    """One source resolved as a run resolves it (confined, stamped), except that a CSV is not hashed:
    ``dataflow validate`` reads only schemas, and a CSV's fingerprint is a hash of all its bytes. A
    postgres source's stream is never started here."""
    return _resolve_one(name, spec, ctx, fingerprinted=False)


def check_unchanged(resolved: list[ResolvedSource]) -> None:
    """Refuse the attempt when a file or an object changed since it was stamped (the fingerprint would
    describe other bytes than the engine read). Recomputable: a new attempt fingerprints the new file."""
    for source in resolved:
        store = source.binding.store if isinstance(source.binding, ArrowDataset) else None
        if source.objects and store is not None:
            changed = store_sources.first_changed(store, source.objects)
            if changed is not None:
                raise _changed(source.name, changed)
        for before in source.stamps:
            try:
                after = FileStamp.of(source.name, Path(before.path))
            except (InputError, ExecutionError):
                after = None
            if after != before:
                raise _changed(source.name, Path(before.path).name)
        for folder in source.dir_stamps:
            if DirStamp.of(Path(folder.path)) != folder:
                raise _changed(source.name, Path(folder.path).name)


def _changed(source: str, name: str) -> ExecutionError:
    return ExecutionError(
        f"source {source!r}: {name!r} changed while the run read it; "
        "the attempt recorded nothing and can be run again"
    )


def source_fingerprint_digest(sources: list[ResolvedSource] | tuple[Any, ...]) -> str:
    """Digest over the sorted list of {source, kind, fingerprint}.

    Accepts ResolvedSource objects or (name, kind, fingerprint) tuples, so the digest can be
    recomputed from what a run recorded.
    """
    entries = []
    for item in sources:
        name, kind, fingerprint = (
            (item.name, item.kind, item.fingerprint) if isinstance(item, ResolvedSource) else item
        )
        entries.append({"source": name, "kind": kind, "fingerprint": fingerprint})
    entries.sort(key=lambda e: (e["source"], e["kind"], e["fingerprint"]))
    return hashing.digest(entries)
