"""Where an execution spills and how much (issue 29, item 4): under the platform's data directory, in a
private folder removed afterwards, with a default cap sized from the free disk space."""

from __future__ import annotations

import contextlib
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import limits, sandbox
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits, GiB, MiB
from durable_dataflow.platform import Platform


def _csv_definition() -> Definition:
    return Definition.model_validate({
        "name": "spills", "version": 1, "sources": {"t": {"kind": "csv", "path": "t.csv"}},
        "steps": [{"name": "s0", "sql": "select n from t"}],
        "output": {"schema": {"n": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
    })  # fmt: skip


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_sqlite_platform_spills_in_a_private_folder_of_its_data_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a platform on a SQLite file, without --temp-dir, spills under spill/ beside its database
    file, made with mode 0700 (today: the system temporary directory): its limits name that folder."""
    monkeypatch.delenv("DATAFLOW_TEMP_DIR", raising=False)
    data = tmp_path / "data"
    data.mkdir()
    with Platform(f"sqlite:///{data / 'dataflow.db'}") as platform:
        spill_root = platform.config.limits.temp_dir
    assert spill_root == data / limits.SPILL_FOLDER_NAME
    assert spill_root.is_dir() and _mode(spill_root) == 0o700


def test_an_operators_temp_dir_and_a_platform_without_files_keep_their_spill_folder(tmp_path: Path) -> None:
    """Proves with_data_dir leaves --temp-dir as given, and a platform whose database has no file on this
    host (PostgreSQL) spills in the system temporary directory as before (temp_dir None)."""
    chosen = ExecutionLimits(temp_dir=tmp_path)
    assert limits.with_data_dir(chosen, (tmp_path / "x" / "dataflow.db",)).temp_dir == tmp_path
    assert not (tmp_path / "x").exists()
    assert limits.with_data_dir(ExecutionLimits(), ()).temp_dir is None


@pytest.mark.parametrize(
    ("temp_bytes_max", "free_bytes", "expected"),
    [
        (None, 40 * MiB, 10 * MiB),  # a quarter of the free space
        (None, 4 * 1024 * GiB, limits.TEMP_BYTES_MAX_DEFAULT),  # at most 100 GiB
        (None, 0, limits.TEMP_BYTES_MIN),  # at least the engine's 1 MiB granularity
        (30 * MiB, 40 * MiB, 30 * MiB),  # --temp-max wins, even above the share of free space
    ],
)
def test_the_default_spill_cap_is_a_quarter_of_the_free_space(
    temp_bytes_max: int | None, free_bytes: int, expected: int
) -> None:
    """Proves spill_bytes_max: without --temp-max a quarter of the free bytes, within 1 MiB and
    100 GiB; with --temp-max exactly that (the operator's setting overrides the sized default)."""
    assert limits.spill_bytes_max(ExecutionLimits(temp_bytes_max=temp_bytes_max), free_bytes) == expected


def test_an_execution_spills_in_its_own_private_folder_capped_by_the_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves an execution reading a file runs with DuckDB's temp_directory in a new folder under the
    platform's spill/ folder, mode 0700 while it runs and gone afterwards, and max_temp_directory_size a
    quarter of the free space: free_disk_bytes is patched to report 40 MiB, so the cap must be 10 MiB
    (today it is 100 GiB, in the system temporary directory). The settings are read from DuckDB itself."""
    (tmp_path / "t.csv").write_text("n\n1\n")
    bounds = limits.with_data_dir(ExecutionLimits(), (tmp_path / "dataflow.db",))
    monkeypatch.setattr(sandbox, "free_disk_bytes", lambda folder: 40 * MiB)
    seen: dict[str, Any] = {}
    original = sandbox.open_confined

    @contextlib.contextmanager
    def watched(*args: Any, **kwargs: Any) -> Iterator[sandbox.Confined]:
        with original(*args, **kwargs) as confined:
            folder = Path(confined.spill_folder)
            seen["folder"], seen["mode"], seen["cap"] = folder, _mode(folder), confined.spill_bytes_max
            seen["duckdb"] = confined.database.execute(
                "select current_setting('temp_directory'), current_setting('max_temp_directory_size')"
            ).fetchone()
            yield confined

    monkeypatch.setattr(sandbox, "open_confined", watched)
    ctx = ExecutionContext(base_dir=tmp_path, allowed_roots=(tmp_path,), limits=bounds)
    assert execute(_csv_definition(), {}, ctx).table.column("n").to_pylist() == [1]
    folder = seen["folder"]
    assert folder.parent == tmp_path / limits.SPILL_FOLDER_NAME and seen["mode"] == 0o700
    assert seen["cap"] == 10 * MiB
    assert seen["duckdb"][0] == str(folder) and seen["duckdb"][1].replace(" ", "") in ("10.0MiB", "10MiB")
    assert not folder.exists() and sandbox.spill_folders_left(folder.parent) == []


def test_no_source_may_read_the_spill_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves a source path into the platform's spill folder (where every tenant's executions spill) is
    refused before anything is recorded, even when the definition's folder contains it: the spill folder
    is among the files no source may read, like the database file beside it."""
    from durable_dataflow.core.errors import InputError
    from durable_dataflow.dataflow.protocol import runs
    from support import flows

    monkeypatch.delenv("DATAFLOW_TEMP_DIR", raising=False)
    with Platform(f"sqlite:///{tmp_path / 'dataflow.db'}") as platform:
        spill_root = platform.config.limits.temp_dir
        assert spill_root is not None and spill_root.parent == tmp_path
        (spill_root / "leak.csv").write_text("n\n1\n")
        defn = Definition.model_validate({
            "name": "peek", "version": 1, "sources": {"t": {"kind": "csv", "path": "spill/leak.csv"}},
            "steps": [{"name": "s0", "sql": "select n from t"}],
            "output": {"schema": {"n": "int64"}, "max_rows": 10, "max_bytes": "1MiB"},
        })  # fmt: skip
        with pytest.raises(InputError):
            platform.runs.run_inline(flows.request(defn, tmp_path))
        with platform.db.read() as conn:
            assert runs.list_page(conn) == []
