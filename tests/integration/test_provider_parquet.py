"""Parquet-folder specifics: the manifest is the commit point, orphans are cleaned, locations are confined."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from durable_dataflow.core.errors import InputError
from durable_dataflow.core.hashing import sha256_bytes
from durable_dataflow.datasources import parquet_folder
from durable_dataflow.datasources.contract import Absent, Inconclusive, Published, PublishTarget, Rejected
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider, key_hash


def rows(n: int) -> pa.Table:
    return pa.table({"id": pa.array(range(n), pa.int64())})


def test_data_file_without_manifest_is_not_published_and_is_replaced(tmp_path: Path) -> None:
    """A crash left data/<h>.parquet and a temp file but no manifest: Absent, and the next publish replaces them."""
    target = PublishTarget("d", str(tmp_path / "f"), "append", {})
    provider = ParquetFolderProvider()
    provider.inspect("k", target, fence=1)  # creates the folder layout
    stem = key_hash("k")
    pq.write_table(rows(99), tmp_path / "f" / "data" / f"{stem}.parquet")
    (tmp_path / "f" / "data" / f".{stem}.dead.tmp").write_bytes(b"partial")
    assert provider.inspect("k", target) == Absent(1)
    assert isinstance(provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target), Published)
    assert pq.read_table(tmp_path / "f" / "data" / f"{stem}.parquet").num_rows == 2
    assert not list((tmp_path / "f" / "data").glob("*.tmp"))
    assert provider.read(target).num_rows == 2


def test_manifest_write_failure_is_inconclusive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If writing the manifest (the commit point) fails, publish raises Inconclusive rather than guessing."""
    target = PublishTarget("d", str(tmp_path / "f"), "append", {})
    provider = ParquetFolderProvider()

    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(provider, "_write_manifest", fail)
    with pytest.raises(Inconclusive, match="manifest"):
        provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target)


def test_data_write_failure_before_the_commit_point_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure while writing the data file (before the manifest) is a conclusive Rejected; the key stays absent."""
    target = PublishTarget("d", str(tmp_path / "f"), "append", {})
    provider = ParquetFolderProvider()

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(parquet_folder.pq, "write_table", fail)
    assert isinstance(provider.publish("k", 1, rows(2), sha256_bytes(b"k"), target), Rejected)
    assert provider.inspect("k", target) == Absent(None)


def test_manifest_records_key_digest_token_rows_and_file(tmp_path: Path) -> None:
    """The manifest holds the key itself (names are hashes), the digest, the token, the row count and the file."""
    target = PublishTarget("d", "f", "append", {"base_dir": str(tmp_path)})
    ParquetFolderProvider().publish("tenant/run 1", 3, rows(4), sha256_bytes(b"x"), target)
    manifest = json.loads((tmp_path / "f" / "_manifests" / f"{key_hash('tenant/run 1')}.json").read_text())
    assert {k: manifest[k] for k in ("kind", "key", "digest", "token", "rows")} == {
        "kind": "publication",
        "key": "tenant/run 1",
        "digest": sha256_bytes(b"x"),
        "token": 3,
        "rows": 4,
    }
    assert (tmp_path / "f" / manifest["file"]).is_file()


def test_location_traversal_is_refused(tmp_path: Path) -> None:
    """A relative location that climbs out of base_dir is InputError for publish and inspect alike."""
    target = PublishTarget("d", "../../etc", "append", {"base_dir": str(tmp_path)})
    with pytest.raises(InputError):
        ParquetFolderProvider().publish("k", 1, rows(1), sha256_bytes(b"k"), target)
    with pytest.raises(InputError):
        ParquetFolderProvider().inspect("k", target, fence=2)
