"""The streamed data path (issue 11): DuckDB reads the declared files itself, confined to exactly them;
fingerprints stay honest when a file changes; every error at any batch ends the run terminally."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from durable_dataflow.core.errors import DataflowError, ExecutionError, InputError, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import compute, sandbox
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from durable_dataflow.dataflow.execution.sources import resolve_sources
from durable_dataflow.dataflow.protocol.runs import RunStatus
from durable_dataflow.platform import Platform
from support import flows

SECRET_TEXT = "top-secret-canary-4411"


_definition = flows.one_step


def _ctx(base: Path, **limits: Any) -> ExecutionContext:
    return ExecutionContext(base_dir=base, allowed_roots=(base,), limits=ExecutionLimits(**limits))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A data folder with a declared Parquet file, an undeclared one beside it and a secret file."""
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"n": pa.array(range(200_000), pa.int64()), "g": [i % 4 for i in range(200_000)]}),
                   data / "facts.parquet")
    pq.write_table(pa.table({"secret": [SECRET_TEXT]}), data / "other.parquet")
    (data / "other.csv").write_text(f"secret\n{SECRET_TEXT}\n")
    (tmp_path / "outside.csv").write_text(f"secret\n{SECRET_TEXT}\n")
    return data


FACTS = {"facts": {"kind": "parquet", "path": "facts.parquet"}}


def test_a_large_source_streams_into_a_small_result(folder: Path) -> None:
    """Proves a 200,000-row Parquet source gives a 4-row aggregate, fingerprinted by its footer, with the
    spill folder removed afterwards: the engine read the file, the result holds only the answer."""
    d = _definition(FACTS, "select g, count(*) as c, sum(n) as s from facts group by g order by g",
                    {"g": "int64", "c": "int64", "s": "decimal(38,0)"})
    spill = folder.parent / "spill"
    spill.mkdir()
    result = execute(d, {}, _ctx(folder, temp_dir=spill))
    assert [row["c"] for row in result.table.to_pylist()] == [50_000] * 4
    assert result.row_count == 4
    [(name, kind, fingerprint)] = result.sources
    assert (name, kind) == ("facts", "parquet") and fingerprint.startswith("sha256:")
    assert sandbox.spill_folders_left(spill) == []


@pytest.mark.parametrize("sql", [
    "select secret from read_parquet('{data}/other.parquet')",
    "select secret from read_csv('{data}/other.csv')",
    "select secret from read_parquet('{data}/*.parquet')",
    "select secret from read_parquet(['{data}/facts.parquet', '{data}/other.parquet'])",
    "select secret from read_csv('{data}/../outside.csv')",
    "select secret from read_csv('{data}/../data/other.csv')",
    "select * from read_parquet('{data}/../data/*.parquet')",
    "select * from glob('{data}/*')",
    "select content as secret from read_text('{data}/other.csv')",
    "select secret from read_csv('file://{data}/other.csv')",
])
def test_a_step_cannot_read_an_undeclared_file_even_beside_a_declared_one(folder: Path, sql: str) -> None:
    """Proves allowed_paths admits exactly the declared files: a second file in the same folder, a glob,
    '..' inside a path or glob, read_text and file:// are all refused, and nothing of the file is shown."""
    d = _definition(FACTS, sql.format(data=folder), {"secret": "string"})
    with pytest.raises(DataflowError) as caught:
        execute(d, {}, _ctx(folder))
    assert SECRET_TEXT not in caught.value.message
    assert isinstance(caught.value, InputError | ExecutionError)


def test_source_paths_with_glob_characters_are_refused(folder: Path) -> None:
    """Proves a source path that DuckDB would expand as a pattern is refused before anything runs."""
    (folder / "a[1].parquet").write_bytes((folder / "facts.parquet").read_bytes())
    for path in ("*.parquet", "a[1].parquet", "../data/*.parquet"):
        d = _definition({"facts": {"kind": "parquet", "path": path}}, "select 1 as n", {"n": "int32"})
        with pytest.raises(InputError, match=r"glob character|does not exist"):
            compute.preflight(d, _ctx(folder))


def test_a_parquet_folder_with_a_symlink_inside_its_root_reads_it_and_one_leading_out_is_refused(
    folder: Path, tmp_path: Path
) -> None:
    """Proves each file of a folder source is confined after resolving symlinks."""
    parts = folder / "parts"
    parts.mkdir()
    pq.write_table(pa.table({"n": [1, 2]}), parts / "a.parquet")
    (parts / "b.parquet").symlink_to(folder / "facts.parquet")
    d = _definition({"p": {"kind": "parquet", "path": "parts"}}, "select count(*) as c from p", {"c": "int64"})
    assert execute(d, {}, _ctx(folder)).table.to_pylist() == [{"c": 200_002}]
    pq.write_table(pa.table({"n": [7]}), tmp_path / "escape.parquet")
    (parts / "c.parquet").symlink_to(tmp_path / "escape.parquet")
    with pytest.raises(InputError, match="outside the run's data roots"):
        execute(d, {}, _ctx(folder))


def test_a_file_swapped_for_a_symlink_after_resolution_is_never_read(folder: Path, tmp_path: Path) -> None:
    """Proves a declared file replaced by a symlink to a secret file between resolution and reading fails
    the attempt without showing the secret (DuckDB refuses the link, the stamp check refuses the change)."""
    d = _definition({"t": {"kind": "csv", "path": "other.csv"}}, "select secret from t", {"secret": "string"})
    ctx = _ctx(folder)
    resolved = resolve_sources(d, ctx)
    (folder / "other.csv").unlink()
    (folder / "other.csv").symlink_to(tmp_path / "outside.csv")
    with pytest.raises(DataflowError) as caught:
        execute(d, {}, ctx, sources=resolved)
    assert SECRET_TEXT not in caught.value.message


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_a_file_changed_between_fingerprint_and_read_fails_the_attempt(folder: Path, kind: str) -> None:
    """Proves the fingerprint never describes other bytes than were read: a rewrite after resolution is
    detected by the stamp check and fails as a recomputable execution error."""
    path = folder / f"changing.{kind}"
    table = pa.table({"n": [1, 2, 3]})
    pq.write_table(table, path) if kind == "parquet" else path.write_text("n\n1\n2\n3\n")
    d = _definition({"t": {"kind": kind, "path": path.name}}, "select sum(n) as n from t", {"n": "int64"})
    ctx = _ctx(folder)
    resolved = resolve_sources(d, ctx)
    replacement = folder / f"replacement.{kind}"
    pq.write_table(pa.table({"n": [100]}), replacement) if kind == "parquet" else replacement.write_text("n\n100\n")
    os.replace(replacement, path)  # an atomic replace, as writers of real tables do
    with pytest.raises(ExecutionError, match="changed while the run read it"):
        execute(d, {}, ctx, sources=resolved)
    assert execute(d, {}, ctx).table.to_pylist() == [{"n": 100}]  # a new attempt reads the new file


def test_the_parquet_fingerprint_changes_with_the_file_and_not_with_its_name_or_time(folder: Path) -> None:
    """Proves the Parquet fingerprint identifies the file version: same bytes, same fingerprint; other rows,
    other fingerprint."""
    d = _definition(FACTS, "select count(*) as c from facts", {"c": "int64"})
    first = execute(d, {}, _ctx(folder)).sources[0][2]
    os.utime(folder / "facts.parquet", ns=(1, 1))
    assert execute(d, {}, _ctx(folder)).sources[0][2] == first
    pq.write_table(pa.table({"n": [1], "g": [1]}), folder / "facts.parquet")
    assert execute(d, {}, _ctx(folder)).sources[0][2] != first


def test_csv_errors_name_the_problem_without_quoting_the_file(folder: Path) -> None:
    """Proves a non-UTF-8 CSV is a clear execution error that does not echo the file's line."""
    (folder / "latin1.csv").write_bytes(b"name,n\n" + f"caf\xe9 {SECRET_TEXT},1\n".encode("latin-1"))
    d = _definition({"t": {"kind": "csv", "path": "latin1.csv"}}, "select name from t", {"name": "string"})
    with pytest.raises(ExecutionError, match="utf-8") as caught:
        execute(d, {}, _ctx(folder))
    assert SECRET_TEXT not in caught.value.message and "Original Line" not in caught.value.message


def test_an_error_on_a_later_batch_is_an_execution_error_naming_the_step(folder: Path) -> None:
    """Proves a conversion error raised while DuckDB streams a later batch (pyarrow's OSError) becomes
    execution_failed with the engine's reason, not an unexpected internal error."""
    sql = "select case when a < 70000 then 'x' else ('y' || a::varchar)::int::varchar end as v from range(80000) r(a)"
    d = _definition({}, sql, {"v": "string"}, max_rows=100_000)
    with pytest.raises(ExecutionError, match="step 'result' failed: Conversion Error") as caught:
        execute(d, {}, _ctx(folder))
    assert type(caught.value) is ExecutionError


def test_the_time_limit_on_a_later_batch_is_limit_exceeded(folder: Path) -> None:
    """Proves the time limit interrupting a result that is already streaming gives limit_exceeded."""
    d = _definition(FACTS, "select md5(a::varchar) as v from range(10000000000) r(a)", {"v": "string"},
                    max_rows=10**12, max_bytes="1GiB")
    with pytest.raises(LimitExceeded, match="exceeded the time limit of 1 s"):
        execute(d, {}, _ctx(folder, time_limit_s=1))


def test_max_bytes_is_enforced_while_batches_arrive(folder: Path) -> None:
    """Proves max_bytes stops a result that would be 10 GB after the first batches, naming the bound."""
    d = _definition(FACTS, "select repeat('x', 1000) as s from range(10000000)", {"s": "string"},
                    max_rows=10**9, max_bytes="1MiB")
    with pytest.raises(LimitExceeded, match=r"more than output.max_bytes = 1MiB"):
        execute(d, {}, _ctx(folder))


# VmHWM, not ru_maxrss: across fork and exec Linux carries the parent's peak into the child's ru_maxrss.
MEMORY_PROBE = """
import json, sys
from pathlib import Path
from durable_dataflow.core.errors import LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
d = Definition.model_validate(json.loads(sys.argv[1]))
base = Path(sys.argv[2])
try:
    execute(d, {}, ExecutionContext(base, (base,), ExecutionLimits()))
    outcome = "finished"
except LimitExceeded as error:
    outcome = error.message
peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"outcome": outcome, "peak_kib": peak_kib}))
"""
PEAK_RSS_BOUND_KIB = 500 * 1024  # generous (imports alone are ~110 MiB): the query would produce 20 GB


def test_memory_stays_bounded_when_a_query_produces_far_more_than_max_bytes(tmp_path: Path) -> None:
    """Proves, in a subprocess that measures its own peak RSS, that a query producing ~20 GB of result
    with max_bytes 1 MiB stops early with a bounded peak (the old path held every batch first)."""
    document = {
        "name": "flow", "version": 1, "sources": {},
        "steps": [{"name": "result", "sql": "select repeat('x', 2000) as s from range(10000000)"}],
        "output": {"schema": {"s": "string"}, "max_rows": 10**9, "max_bytes": "1MiB"},
    }
    done = subprocess.run([sys.executable, "-c", MEMORY_PROBE, json.dumps(document), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(done.stdout)
    assert "output.max_bytes" in report["outcome"]
    assert report["peak_kib"] < PEAK_RSS_BOUND_KIB


def test_an_unexpected_error_during_execution_ends_the_run_failed(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves no in-process error leaves a run running: an unexpected OSError from the engine becomes a
    terminal failed run (execution_failed, no external output) naming only the error's type."""
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError(f"driver detail {SECRET_TEXT}")

    monkeypatch.setattr(compute, "execute", broken)
    with Platform(db_url) as platform:
        run = platform.runs.run_inline(flows.request(flows.definition(), tmp_path)).run
        assert flows.kinds(platform, run.run_id)[-1] == "run.failed"
    assert (run.status, run.error_code) == (RunStatus.FAILED, "execution_failed")
    assert "unexpected OSError" in (run.error_message or "") and SECRET_TEXT not in (run.error_message or "")


@pytest.mark.parametrize("sql, max_bytes, code, cause", [
    ("select case when a < 70000 then 'x' else ('y' || a::varchar)::int::varchar end as v from range(80000) r(a)",
     "1MiB", "execution_failed", "Conversion Error"),
    ("select repeat('x', 1000) as v from range(10000000)", "1MiB", "limit_exceeded", "output.max_bytes = 1MiB"),
    ("select md5(a::varchar) as v from range(10000000000) r(a)", "1GiB", "limit_exceeded", "time limit of 1 s"),
])
def test_a_mid_stream_failure_is_a_terminal_failed_run(
    db_url: str, tmp_path: Path, sql: str, max_bytes: str, code: str, cause: str
) -> None:
    """Proves a mid-stream error, max_bytes reached on a later batch and the time limit on a later batch
    each end the run failed with its real cause and a run.failed ledger entry, on both ledger engines."""
    defn = flows.definition(sql=sql)
    document = defn.model_dump(mode="json", by_alias=True)
    document["output"] = {"schema": {"v": "string"}, "max_rows": 10**12, "max_bytes": max_bytes}
    with Platform(db_url, limits=ExecutionLimits(time_limit_s=1)) as platform:
        run = platform.runs.run_inline(flows.request(Definition.model_validate(document), tmp_path)).run
        assert (run.status, run.error_code) == (RunStatus.FAILED, code)
        assert cause in (run.error_message or "")
        assert flows.kinds(platform, run.run_id)[-1] == "run.failed"


def test_a_decompression_bomb_is_streamed_within_the_limits_or_stopped_by_them(folder: Path) -> None:
    """Proves a small Parquet file that decodes to far more than its size is no danger: an aggregate
    streams it in bounded memory, and a step that must hold it all hits the memory/spill limit cleanly."""
    bomb = pa.table({"s": pa.array(["x" * 100] * 2_000_000)})
    pq.write_table(bomb, folder / "bomb.parquet", compression="zstd", row_group_size=2_000_000)
    assert (folder / "bomb.parquet").stat().st_size < 1024 * 1024  # ~200 MB of values in well under 1 MiB
    sources = {"b": {"kind": "parquet", "path": "bomb.parquet"}}
    counted = _definition(sources, "select count(*) as c from b", {"c": "int64"})
    tight = {"memory_bytes_max": 64 * 1024**2, "temp_bytes_max": 1024**2}
    assert execute(counted, {}, _ctx(folder, **tight)).table.to_pylist() == [{"c": 2_000_000}]
    hoarding = _definition(sources, "select count(*) as c from (select s || n::varchar as k from b, "
                           "range(20) r(n) order by k)", {"c": "int64"})
    with pytest.raises(LimitExceeded, match=r"exceeded the spill limit of 1 MiB"):
        execute(hoarding, {}, _ctx(folder, **tight))


def test_a_file_that_is_not_parquet_is_a_clear_error(folder: Path) -> None:
    """Proves a .parquet file with other contents fails resolution with a message naming the file only."""
    (folder / "fake.parquet").write_text(f"not parquet {SECRET_TEXT}")
    d = _definition({"f": {"kind": "parquet", "path": "fake.parquet"}}, "select 1 as n", {"n": "int32"})
    with pytest.raises(ExecutionError, match=r"'fake\.parquet' is not a Parquet file") as caught:
        execute(d, {}, _ctx(folder))
    assert SECRET_TEXT not in caught.value.message


@pytest.mark.parametrize("sql, code", [
    ("select secret from read_csv('{data}/other.csv')", "invalid_input"),
    ("select case when a < 70000 then 'x' else ('y' || a::varchar)::int::varchar end as secret "
     "from range(80000) r(a)", "execution_failed"),
])
def test_a_worker_ends_a_hostile_or_failing_queued_run_once_without_retrying_it(
    db_url: str, folder: Path, sql: str, code: str
) -> None:
    """Proves the same data-path refusals through a worker: a queued run whose step reaches an undeclared
    file, or fails on a later batch, is claimed once and ends failed with its cause (no canary shown),
    never left running for the sweeper to retry."""
    from durable_dataflow.dataflow.worker import Worker, WorkerOptions

    document = _definition(FACTS, sql.format(data=folder), {"secret": "string"}, max_rows=10**6)
    with Platform(db_url, lease_ttl_s=10) as platform:
        run_id = platform.runs.submit(flows.request(document, folder)).run.run_id
        options = WorkerOptions(until_idle=True, sweep_interval_s=0.05, poll_interval_s=0.02)
        summary = Worker(platform.runs, options).run()
        run = platform.runs.get(run_id)
        assert summary.claimed == 1
        assert (run.status, run.error_code, run.attempt) == (RunStatus.FAILED, code, 1)
        assert SECRET_TEXT not in (run.error_message or "")
        assert flows.kinds(platform, run_id)[-1] == "run.failed"


def test_fingerprinting_a_large_csv_counts_against_the_time_limit(folder: Path) -> None:
    """Proves resolution is inside the time limit: hashing a 64 MiB CSV under a 1 ms budget stops with
    limit_exceeded naming the fingerprinting, instead of hashing first and timing only the engine."""
    (folder / "big.csv").write_bytes(b"n\n" + b"1\n" * (32 * 1024 * 1024))
    d = _definition({"t": {"kind": "csv", "path": "big.csv"}}, "select count(*) as n from t", {"n": "int64"})
    with pytest.raises(LimitExceeded, match=r"time limit of 0\.001 s while its file was being fingerprinted"):
        execute(d, {}, _ctx(folder, time_limit_s=0.001))
