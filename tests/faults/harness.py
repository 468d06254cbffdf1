"""Shared machinery of the fault tests and of scripts/soak.py: worker processes, definitions,
sink readers and the invariant checker (DESIGN §7 invariants 3, 6, 7, 8, 9).

The checker reads only durable state — the ledger, the run projection, the stored results and
the sinks themselves — so it judges what a crash or a pause really left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml

from durable_dataflow.core import ledger
from durable_dataflow.core.db import Database
from durable_dataflow.dataflow.definitions.definitions import load_definition
from durable_dataflow.dataflow.protocol import evidence, runs
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.protocol.runs import MODULE, Run
from durable_dataflow.platform import Platform

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
WORKER_CMD = (sys.executable, "-m", "durable_dataflow.cli")
POLL_S = 0.05
PROCESS_WAIT_S = 90.0
TERMINAL = frozenset({"succeeded", "failed", "outcome_unknown", "evidence_failed", "cancelled"})
# Entries that close an attempt from outside it: nothing of that attempt may follow them.
SWEEPER_CLOSE = frozenset({evidence.ATTEMPT_RECOVERED, evidence.ATTEMPT_OUTCOME_UNKNOWN, evidence.RUN_CANCELLED})
TERMINAL_KINDS = frozenset({
    evidence.RUN_SUCCEEDED, evidence.RUN_FAILED, evidence.EVIDENCE_FAILED, evidence.RUN_CANCELLED,
})  # fmt: skip
RECONCILE_KINDS = frozenset({evidence.RECONCILE_STARTED, evidence.RESUME_STARTED})


# ---- processes -------------------------------------------------------------------------------


def worker_env(db_url: str, *, lease_ttl_s: float, crash_at: str | None = None, pause_at: str | None = None,
               extra: Mapping[str, str] | None = None) -> dict[str, str]:  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("DATAFLOW_CRASH_AT", "DATAFLOW_PAUSE_AT")}
    env.update({"DATAFLOW_DB": db_url, "DATAFLOW_LEASE_TTL": str(lease_ttl_s), **(extra or {})})
    if crash_at:
        env["DATAFLOW_CRASH_AT"] = crash_at
    if pause_at:
        env["DATAFLOW_PAUSE_AT"] = pause_at
    return env


def start(args: Iterable[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start `python -m durable_dataflow.cli ARGS` (the `dataflow` command), stdout and stderr to ``log_path``."""
    log = log_path.open("ab")
    try:
        return subprocess.Popen([*WORKER_CMD, *args], env=dict(env), stdout=log, stderr=log, cwd=REPO)
    finally:
        log.close()


def worker_args(*, once: bool = False, until_idle: bool = False, concurrency: int = 1,
                sweep_interval_s: float = 0.2, poll_interval_s: float = 0.1) -> list[str]:  # fmt: skip
    args = ["worker", "--concurrency", str(concurrency), "--sweep-interval", str(sweep_interval_s),
            "--poll-interval", str(poll_interval_s)]  # fmt: skip
    if once:
        args.append("--once")
    if until_idle:
        args.append("--until-idle")
    return args


def wait_exit(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = PROCESS_WAIT_S) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"process {proc.args} did not exit in {timeout_s}s; log:\n{tail(log_path)}") from None


def tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return "<no log>"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll a condition with a bounded deadline (never sleep hoping for an order)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(POLL_S)


def is_stopped(pid: int) -> bool:
    """True when the process is stopped by a signal (state T in /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def resume(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGCONT)


# ---- definitions -----------------------------------------------------------------------------


def forward_example(tmp: Path, provider: str = "parquet", *, location: str | None = None,
                    options: Mapping[str, Any] | None = None) -> Path:  # fmt: skip
    """Copy examples/daily_orders_publish to ``tmp`` with its target set to ``provider``."""
    folder = tmp / f"daily_orders_publish_{provider}"
    folder.mkdir(parents=True)
    for name in ("orders.csv", "customers.csv"):
        (folder / "data").mkdir(exist_ok=True)
        (folder / "data" / name).write_bytes((EXAMPLES / "daily_orders_publish" / "data" / name).read_bytes())
    body = yaml.safe_load((EXAMPLES / "daily_orders_publish" / "dataflow.yaml").read_text())
    body["target"]["provider"] = provider
    if location is not None:
        body["target"]["location"] = location
    if options:
        body["target"]["options"] = dict(options)
    path = folder / "dataflow.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def request_for(definition: Path, parameters: Mapping[str, str], key: str | None) -> RunRequest:
    """A CLI-like request for a definition file."""
    loaded = load_definition(definition)
    return RunRequest(
        definition=loaded.definition, base_dir=loaded.base_dir, parameters=dict(parameters),
        access=AccessContext.local(), provenance=Provenance(actor="fault-test", trigger="cli"), idempotency_key=key,
    )  # fmt: skip


def inline_definition(folder: Path, name: str, *, publish_to: str | None = None, provider: str = "parquet",
                      options: Mapping[str, Any] | None = None) -> Path:  # fmt: skip
    """A cheap definition: a few inline rows scaled by an integer parameter ``n``; with ``publish_to``,
    a forward-recovery definition appending to that location of ``provider`` (a folder for
    ``parquet`` and ``delta``, a table name for ``postgres``, whose DSN goes in ``options``)."""
    folder.mkdir(parents=True, exist_ok=True)
    body: dict[str, Any] = {
        "name": name,
        "version": 1,
        "parameters": {"n": {"type": "int"}},
        "sources": {
            "items": {
                "kind": "inline",
                "schema": {"item": "string", "qty": "int64"},
                "rows": [{"item": "a", "qty": 1}, {"item": "b", "qty": 2}, {"item": "c", "qty": 3}],
            }
        },
        "steps": [{"name": "scaled", "sql": "select item, qty * $n as qty from items order by item"}],
        "output": {"schema": {"item": "string", "qty": "int64"}, "max_rows": 10, "max_bytes": "64KiB"},
    }
    if publish_to is not None:
        body["target"] = {
            "type": "datasources.publication", "provider": provider, "datasource": f"soak.{name}",
            "location": publish_to, "mode": "append",
        }  # fmt: skip
        if options:
            body["target"]["options"] = dict(options)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


PARTITION_COLUMN = "day"  # the partition column of partitioned_definition's target
PARTITION_ROW_COLUMNS = ("day", "item", "qty", "run_n")  # its output columns, in order


def partitioned_definition(folder: Path, name: str, *, provider: str, location: str,
                           options: Mapping[str, Any] | None = None) -> Path:  # fmt: skip
    """A cheap forward definition whose target replaces one day (`mode: replace_partition`,
    `partition: {day: $day}`) of ``location`` on ``provider`` (``delta`` or ``postgres``). Its rows
    (``day``, ``item``, ``qty``, ``run_n``) carry the parameter ``n`` as ``run_n``, so two runs with
    different ``n`` never have equal rows and a partition's rows name the run they came from."""
    folder.mkdir(parents=True, exist_ok=True)
    body: dict[str, Any] = {
        "name": name,
        "version": 1,
        "parameters": {"n": {"type": "int"}, PARTITION_COLUMN: {"type": "date"}},
        "sources": {
            "items": {
                "kind": "inline",
                "schema": {"item": "string", "qty": "int64"},
                "rows": [{"item": "a", "qty": 1}, {"item": "b", "qty": 2}, {"item": "c", "qty": 3}],
            }
        },
        "steps": [{
            "name": "daily",
            "sql": "select $day::DATE as day, item, qty * $n as qty, $n::BIGINT as run_n from items order by item",
        }],
        "output": {
            "schema": {"day": "date", "item": "string", "qty": "int64", "run_n": "int64"},
            "max_rows": 10,
            "max_bytes": "64KiB",
        },
        "target": {
            "type": "datasources.publication", "provider": provider, "datasource": f"soak.{name}",
            "location": location, "mode": "replace_partition", "partition": {PARTITION_COLUMN: f"${PARTITION_COLUMN}"},
            **({"options": dict(options)} if options else {}),
        },
    }  # fmt: skip
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


# ---- sinks -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Publication:
    key: str
    digest: str
    token: int
    where: str


def parquet_publications(folder: Path) -> list[Publication]:
    """Every publication manifest in a Parquet-folder sink (fences are not publications)."""
    found = []
    for path in sorted((folder / "_manifests").glob("*.json")):
        manifest = json.loads(path.read_bytes())
        if manifest.get("kind") == "publication":
            found.append(Publication(manifest["key"], manifest["digest"], int(manifest["token"]), str(path)))
    return found


def delta_publications(table: Path) -> list[Publication]:
    """Every commit of the Delta log that carries a publication (read from the raw log)."""
    found = []
    for path in sorted((table / "_delta_log").glob("*.json")):
        for line in path.read_text().splitlines():
            info = json.loads(line).get("commitInfo") if line.strip() else None
            if info and info.get("dataflow_kind") == "publication":
                found.append(
                    Publication(info["dataflow_key"], info["dataflow_digest"], int(info["dataflow_token"]), path.name)
                )
    return found


def parquet_store_publications(client: Any, bucket: str, prefix: str) -> list[Publication]:
    """Every published key of a Parquet folder on an S3-compatible store: its state objects
    (`_dataflow/keys/*.json`, datasources/parquet_store.py) read with boto3; fences are not publications."""
    found = []
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/_dataflow/keys/")
    for name in sorted(o["Key"] for page in pages for o in page.get("Contents", [])):
        state = json.loads(client.get_object(Bucket=bucket, Key=name)["Body"].read())
        if state.get("state") == "published":
            found.append(Publication(state["key"], state["digest"], int(state["token"]), name))
    return found


def postgres_publications(dsn: str) -> list[Publication]:
    """The rows of `sink_publications` in a PostgreSQL sink database (none if never published)."""
    with psycopg.connect(dsn.replace("postgresql+psycopg://", "postgresql://")) as conn:
        exists = conn.execute("select to_regclass('sink_publications') is not null").fetchone()
        if not exists or not exists[0]:
            return []
        rows = conn.execute("select idempotency_key, digest, token, table_name from sink_publications").fetchall()
    return [Publication(str(k), str(d), int(t), str(n)) for k, d, t, n in rows]


def postgres_rows_per_key(dsn: str, table: str) -> dict[str, int]:
    with psycopg.connect(dsn.replace("postgresql+psycopg://", "postgresql://")) as conn:
        rows = conn.execute(f'select _publication_key, count(*) from "{table}" group by 1').fetchall()
    return {str(k): int(c) for k, c in rows}


DELTA_COMMIT = re.compile(r"/(\d{20})\.json$")  # a commit of a Delta log (checkpoints are not read)


@dataclass
class StoreTable:
    """A Delta table on an S3-compatible store as an independent reader sees it (`delta_store_table`)."""

    publications: list[Publication] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # its live rows
    problems: list[str] = field(default_factory=list)  # what the reader found wrong with the log itself


def delta_store_table(client: Any, bucket: str, prefix: str) -> StoreTable:
    """Every publication commit of a Delta table on a store, and its live rows, read without delta-rs
    (`client` is a boto3 S3 client): the JSON commits listed and read with boto3, in version order,
    each publication named by its commit info (as `delta_publications` reads a local log), the live
    data files (add and remove actions replayed) read with pyarrow from the bytes boto3 fetched.
    Every commit from version 0 must be there (delta-rs keeps the JSON commits for 30 days beside
    any checkpoint), and a commit whose transaction (`txn`) publishes a key must name that key's
    publication in its commit info: otherwise a key could be published without the checker seeing it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    found = StoreTable()
    names: dict[int, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/_delta_log/"):
        for item in page.get("Contents", []):
            matched = DELTA_COMMIT.search("/" + item["Key"])
            if matched:
                names[int(matched.group(1))] = item["Key"]
    if sorted(names) != list(range(len(names))):
        found.problems.append(f"s3://{bucket}/{prefix}: the log's commits are not versions 0..{len(names) - 1}")
    live: dict[str, None] = {}
    for version in sorted(names):
        text = client.get_object(Bucket=bucket, Key=names[version])["Body"].read().decode()
        actions = [json.loads(line) for line in text.splitlines() if line.strip()]
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        published = info.get("dataflow_key") if info.get("dataflow_kind") == "publication" else None
        if published is not None:
            where = f"s3://{bucket}/{names[version]}"
            found.publications.append(
                Publication(str(published), str(info["dataflow_digest"]), int(info["dataflow_token"]), where)
            )
        for action in actions:
            txn = action.get("txn")
            if txn and txn["version"] > 0 and not _fence_or_partition_app(txn["appId"]) and txn["appId"] != published:
                found.problems.append(f"commit {version}: a txn of key {txn['appId']} without its publication record")
            if "add" in action:
                live[action["add"]["path"]] = None
            elif "remove" in action:
                live.pop(action["remove"]["path"], None)
    for path in live:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{urllib.parse.unquote(path)}")["Body"].read()
        found.rows.extend(pq.read_table(pa.BufferReader(body)).to_pylist())
    return found


def _fence_or_partition_app(app_id: str) -> bool:
    """A fence's or a partition's transaction id (not a publication's): see datasources/delta.py."""
    from durable_dataflow.datasources import delta

    return app_id.endswith(delta.FENCE_SUFFIX) or app_id.startswith(delta.PARTITION_APP_PREFIX)


# A row of a partitioned sink or of a stored result, each value as text (a date as YYYY-MM-DD), in
# PARTITION_ROW_COLUMNS order: one form for every reader, so rows compare across them.
Row = tuple[str, ...]


def row_of(values: Mapping[str, Any], columns: Iterable[str] = PARTITION_ROW_COLUMNS) -> Row:
    return tuple(str(values[column]) for column in columns)


def rows_by_partition(rows: Iterable[Mapping[str, Any]], column: str = PARTITION_COLUMN) -> dict[str, list[Row]]:
    """Rows grouped by their partition value (as text), each group sorted."""
    found: dict[str, list[Row]] = {}
    for values in rows:
        found.setdefault(str(values[column]), []).append(row_of(values))
    return {partition: sorted(group) for partition, group in found.items()}


def delta_partition_rows(table: Path) -> dict[str, list[Row]]:
    """The live rows of a Delta table per partition, read by delta-rs (`deltalake`), an independent
    reader of the table the sink wrote (none when the table does not exist yet)."""
    if not (table / "_delta_log").is_dir():
        return {}
    import deltalake

    try:
        read = deltalake.DeltaTable(str(table)).to_pyarrow_table()
    except deltalake.exceptions.TableNotFoundError:
        return {}
    if PARTITION_COLUMN not in read.column_names:  # the placeholder of a table never published to
        return {}
    return rows_by_partition(read.to_pylist())


def postgres_partition_rows(dsn: str, table: str) -> dict[str, list[Row]]:
    """The rows of a PostgreSQL sink table per partition, read with plain SQL (none if it does not exist)."""
    with psycopg.connect(dsn.replace("postgresql+psycopg://", "postgresql://")) as conn:
        exists = conn.execute("select to_regclass(%s) is not null", (table,)).fetchone()
        if not exists or not exists[0]:
            return {}
        columns = ", ".join(f'"{c}"' for c in PARTITION_ROW_COLUMNS)
        fetched = conn.execute(f'select {columns} from "{table}"').fetchall()
    return rows_by_partition(dict(zip(PARTITION_ROW_COLUMNS, values, strict=True)) for values in fetched)


# ---- the checker -----------------------------------------------------------------------------


@dataclass
class Report:
    states: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def summary(self) -> str:
        states = ", ".join(f"{k}={v}" for k, v in sorted(self.states.items()))
        return f"runs per final state: {states}; violations: {len(self.violations)}"


def all_runs(db: Database) -> list[Run]:
    found: list[Run] = []
    cursor: tuple[int, str] | None = None
    while True:
        with db.read() as conn:  # one short transaction per page: never idle in one between pages
            page = runs.list_page(conn, before=cursor, limit=runs.PAGE_SIZE_MAX)
        found.extend(page)
        if len(page) < runs.PAGE_SIZE_MAX:
            return found
        cursor = (page[-1].created_at_us, page[-1].run_id)


def check(db: Database, publications: Iterable[Publication]) -> Report:
    """Count the runs per final state and every violation of invariants 3, 6, 7, 8 and 9."""
    report = Report()
    by_key: dict[str, list[Publication]] = {}
    for pub in publications:
        by_key.setdefault(pub.key, []).append(pub)
    from durable_dataflow.dataflow.protocol.forward import publication_key

    known_keys = set()
    for run in all_runs(db):
        with db.read() as conn:  # a short transaction per run: never idle in one while checking
            entries = ledger.read(conn, MODULE, run.run_id)
            stored = evidence.stored_result_digest(conn, run.run_id)
        report.states[str(run.status)] += 1
        key = publication_key(run)
        known_keys.add(key)
        found = run_problems(run, entries, by_key.get(key, []), stored)
        report.violations.extend(f"run {run.run_id}: {problem}" for problem in found)
    for key in set(by_key) - known_keys:
        report.violations.append(f"inv6: sink holds key {key} that no run owns")
    return report


def run_problems(run: Run, entries: list[ledger.Entry], pubs: list[Publication], stored: str | None) -> list[str]:
    problems: list[str] = []
    if str(run.status) not in TERMINAL:
        problems.append(f"lost run: still {run.status} at the end")
    if run.unresolved and not run.warning:
        problems.append("unresolved without a warning")
    problems += _inv3_stale_writes(entries)
    problems += _inv6_publications(run, pubs)
    problems += _inv7_success_evidence(run, entries, pubs, stored)
    problems += _inv8_no_retry_after_dispatch(run, entries)
    problems += _inv9_expired_recovered(run, entries)
    return problems


def _inv3_stale_writes(entries: list[ledger.Entry]) -> list[str]:
    """No entry of attempt n after attempt n+1 began or after a sweeper closed n (except the
    sweeper's own ``run.failed`` when it closed the last allowed attempt)."""
    problems: list[str] = []
    highest, closed = 0, set()
    for entry in entries:
        sweeper_failed = entry.kind == evidence.RUN_FAILED and entry.payload.get("code") == "attempts_exhausted"
        if entry.attempt < highest or (entry.attempt in closed and not sweeper_failed):
            problems.append(f"inv3: {entry.kind} of attempt {entry.attempt} at seq {entry.seq} after it was superseded")
        highest = max(highest, entry.attempt)
        if entry.kind in SWEEPER_CLOSE:
            closed.add(entry.attempt)
    return problems


def _inv6_publications(run: Run, pubs: list[Publication]) -> list[str]:
    problems = []
    if len(pubs) > 1:
        problems.append(f"inv6: {len(pubs)} publications in the sink: {pubs}")
    if pubs and run.mode == "atomic":
        problems.append("inv6: an atomic run has a publication")
    if pubs and str(run.status) in ("failed", "cancelled"):
        problems.append(f"inv6: a {run.status} run (no external output) has a publication")
    return problems


def _digests(entries: list[ledger.Entry], kinds: Iterable[str], field_name: str) -> list[str]:
    wanted = set(kinds)
    return [str(e.payload.get(field_name)) for e in entries if e.kind in wanted]


def _inv7_success_evidence(
    run: Run, entries: list[ledger.Entry], pubs: list[Publication], stored: str | None
) -> list[str]:
    if str(run.status) != "succeeded":
        if any(e.kind == evidence.RUN_SUCCEEDED for e in entries):
            return [f"inv7: run.succeeded in the ledger but the projection says {run.status}"]
        return []
    problems = []
    if not any(e.kind == evidence.RUN_SUCCEEDED and e.attempt == run.attempt for e in entries):
        problems.append("inv7: succeeded without a run.succeeded entry of its attempt")
    if stored != run.output_digest:
        problems.append(f"inv7: stored result hashes to {stored}, recorded {run.output_digest}")
    if run.mode == "atomic":
        if run.output_digest not in _digests(entries, [evidence.RESULT_COMMITTED], "output_digest"):
            problems.append("inv7: atomic success without result.committed of the recorded digest")
        return problems
    if run.output_digest not in _digests(entries, evidence.CONCLUSIVE_PRESENCE, "digest"):
        problems.append("inv7: forward success without a conclusive confirmation of the recorded digest")
    if run.output_digest not in _digests(entries, [evidence.DISPATCH_AUTHORIZED], "output_digest"):
        problems.append("inv7: forward success without dispatch.authorized of the recorded digest")
    if [p.digest for p in pubs] != [run.output_digest]:
        problems.append(f"inv7: the sink does not hold exactly this run's digest: {pubs}")
    return problems


def _inv8_no_retry_after_dispatch(run: Run, entries: list[ledger.Entry]) -> list[str]:
    authorized = [e.attempt for e in entries if e.kind == evidence.DISPATCH_AUTHORIZED]
    if not authorized:
        return []
    first = min(authorized)
    problems = []
    reconciled = any(e.kind in RECONCILE_KINDS for e in entries)
    if not reconciled and any(e.kind == evidence.ATTEMPT_STARTED and e.attempt > first for e in entries):
        problems.append(f"inv8: a retry started after dispatch.authorized of attempt {first}")
    if any(e.kind == evidence.ATTEMPT_RECOVERED and e.attempt >= first for e in entries):
        problems.append("inv8: an authorized attempt was closed as recovered (proven absent)")
    if str(run.status) in ("queued", "running", "cancelled") or (
        str(run.status) == "failed" and not any(e.kind == evidence.PUBLICATION_REJECTED for e in entries)
    ):
        problems.append(f"inv8: authorized run ended {run.status} without a conclusive rejection")
    return problems


def _inv9_expired_recovered(run: Run, entries: list[ledger.Entry]) -> list[str]:
    """Every attempt that ended without authorization or a terminal entry was closed recovered and retried."""
    problems = []
    started = sorted({e.attempt for e in entries if e.kind == evidence.ATTEMPT_STARTED})
    for attempt in started:
        kinds = {e.kind for e in entries if e.attempt == attempt}
        if kinds & (TERMINAL_KINDS | {evidence.DISPATCH_AUTHORIZED}):
            continue
        if evidence.ATTEMPT_RECOVERED not in kinds:
            problems.append(f"inv9: attempt {attempt} ended unauthorized and was not recovered")
        elif attempt < run.max_attempts and attempt + 1 not in started:
            problems.append(f"inv9: attempt {attempt} was recovered but never retried")
    return problems


# ---- the partition invariant (issue 27) ------------------------------------------------------


@dataclass(frozen=True)
class PartitionRun:
    """What the platform recorded of one run of a partitioned target."""

    run_id: str
    partition: str
    status: str
    unresolved: bool
    token: int | None  # the partition token its first dispatch.authorized took (None: never authorized)
    rows: tuple[Row, ...] | None  # its stored result rows, sorted (None: no stored result)


def partition_runs(db: Database, definition_names: Iterable[str]) -> list[PartitionRun]:
    """Every run of the named partitioned definitions, with its partition token and stored rows."""
    from durable_dataflow.dataflow.execution import results
    from durable_dataflow.dataflow.protocol import forward

    wanted = set(definition_names)
    found = []
    for run in all_runs(db):
        if run.definition_name not in wanted:
            continue
        with db.read() as conn:  # a short transaction per run
            token = forward.authorized_partition_token(conn, run)
            stored = results.stored(conn, run.run_id)
        rows = None
        if stored is not None:
            rows = tuple(sorted(row_of(values) for values in results.decode_ipc(stored[1]).to_pylist()))
        found.append(PartitionRun(
            run.run_id, str(run.parameters[PARTITION_COLUMN]), str(run.status), run.unresolved, token, rows,
        ))  # fmt: skip
    return found


def current_publication(runs_of_partition: Iterable[PartitionRun]) -> PartitionRun | None:
    """The partition's current publication as recorded: its succeeded run with the highest partition token."""
    succeeded = [r for r in runs_of_partition if r.status == "succeeded" and r.token is not None]
    return max(succeeded, key=lambda r: r.token or 0, default=None)


def partition_problems(where: str, held: Mapping[str, list[Row]], runs_of: Iterable[PartitionRun]) -> list[str]:
    """Violations of "each partition holds exactly the rows of exactly one run, the one recorded as
    its current publication" for one partitioned sink: ``held`` is what an independent reader found
    there per partition, ``runs_of`` every run of the definitions publishing to it."""
    by_partition: dict[str, list[PartitionRun]] = {}
    for run in runs_of:
        by_partition.setdefault(run.partition, []).append(run)
    problems = []
    for partition in sorted(set(held) | set(by_partition)):
        rows = sorted(held.get(partition, []))
        runs_here = by_partition.get(partition, [])
        name = f"partition {where}[{partition}]"
        tokens = Counter(r.token for r in runs_here if r.token is not None)
        problems += [f"{name}: partition token {t} was taken by {n} runs" for t, n in sorted(tokens.items()) if n > 1]
        problems += [f"{name}: run {r.run_id} succeeded without a partition token"
                     for r in runs_here if r.status == "succeeded" and r.token is None]  # fmt: skip
        owners = [r.run_id for r in runs_here if r.rows is not None and list(r.rows) == rows]
        current = current_publication(runs_here)
        if current is None:
            if rows:
                problems.append(f"{name}: holds {len(rows)} rows but no succeeded run is its current publication "
                                f"(the rows of: {owners or 'no single run'})")  # fmt: skip
            continue
        if current.rows is None or rows != list(current.rows):
            problems.append(
                f"{name}: holds {len(rows)} rows that are not exactly those of its current publication, run "
                f"{current.run_id} (partition token {current.token}); they are the rows of: {owners or 'no single run'}"
            )
    return problems


# ---- a sink's rows against its publications ---------------------------------------------------


def published_rows_problems(
    db: Database,
    where: str,
    held: Iterable[Mapping[str, Any]],
    publications: Iterable[Publication],
    definition_names: Iterable[str],
    columns: tuple[str, ...],
) -> list[str]:
    """An append sink's live rows (``held``, read by an independent reader) must be exactly the stored
    result rows of the runs whose publications it holds, each once: a publication whose rows are
    missing, doubled, or rows no publication accounts for are violations (the ledger says what
    each run published, the stored result what those rows were)."""
    from durable_dataflow.dataflow.execution import results
    from durable_dataflow.dataflow.protocol.forward import publication_key

    wanted, published = set(definition_names), Counter(p.key for p in publications)
    expected: Counter[Row] = Counter()
    for run in all_runs(db):
        if run.definition_name not in wanted or not published[publication_key(run)]:
            continue
        with db.read() as conn:
            stored = results.stored(conn, run.run_id)
        if stored is None:
            return [f"{where}: run {run.run_id} has a publication but no stored result"]
        for values in results.decode_ipc(stored[1]).to_pylist():
            expected[row_of(values, columns)] += published[publication_key(run)]
    found = Counter(row_of(values, columns) for values in held)
    if found == expected:
        return []
    extra, missing = found - expected, expected - found
    return [f"{where}: holds {sum(found.values())} rows, its publications' stored results "
            f"{sum(expected.values())}; rows no publication accounts for {sorted(extra)[:5]}, rows of a "
            f"publication missing {sorted(missing)[:5]}"]  # fmt: skip


# ---- running cases side by side ------------------------------------------------------------

CASES_AT_ONCE = 4  # cases mostly wait (process start, lease expiry): overlap them on 2 cores


_MIGRATION_LOCK = threading.Lock()


def open_platform(url: str) -> Platform:
    """A Platform on ``url``; Alembic keeps global state, so migrations in threads take turns."""
    with _MIGRATION_LOCK:
        return Platform(url)


# Long enough for a migration or a checker's read to go on under a loaded machine (two xdist processes
# and a fleet: 3 s was seen to end them), short enough to free a stopped process's row locks in a test.
IDLE_IN_TRANSACTION_TIMEOUT = "15s"


def fresh_database(server: Any, prefix: str) -> str:
    """A new database on the throwaway server (dropped with the cluster at the session's end).

    A process stopped (SIGSTOP) inside a transaction would hold its row locks forever and block
    the sweeper; `idle_in_transaction_session_timeout` ends such a transaction, as docs/deployment.md
    recommends for production.
    """
    import uuid

    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    url = str(server.create_database(name))
    with server.connect("postgres") as conn:
        conn.execute(f"ALTER DATABASE {name} SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION_TIMEOUT}'")
    return url


def run_concurrently(cases: Mapping[Any, Callable[[], Any]]) -> dict[Any, Any]:
    """Run each case's function in a thread pool; a case maps to its result or to its exception."""
    from concurrent import futures

    with futures.ThreadPoolExecutor(CASES_AT_ONCE) as pool:
        running = {case: pool.submit(fn) for case, fn in cases.items()}
        results: dict[Any, Any] = {}
        for case, future in running.items():
            try:
                results[case] = future.result()
            except Exception as error:  # reported by that case's test, not by the fixture
                results[case] = error
        return results


# ---- fleets of workers -----------------------------------------------------------------------

FLEET_POLL_S = 0.25


def status_counts(db: Database) -> Counter[str]:
    """Runs per status, straight from the projection."""
    import sqlalchemy as sa

    from durable_dataflow.dataflow.schema import dataflow_runs

    with db.read() as conn:
        rows = conn.execute(sa.select(dataflow_runs.c.status, sa.func.count()).group_by(dataflow_runs.c.status)).all()
    return Counter({str(status): int(n) for status, n in rows})


def wait_all_terminal(db: Database, expected_runs: int, timeout_s: float, what: str,
                      alive: Callable[[], bool] = lambda: True) -> None:  # fmt: skip
    """Poll until ``expected_runs`` runs exist and none is queued or running."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = status_counts(db)
        if sum(counts.values()) >= expected_runs and not (counts["queued"] or counts["running"]):
            return
        if time.monotonic() > deadline or not alive():
            raise AssertionError(f"{what}: runs not all terminal after {timeout_s}s: {dict(counts)}")
        time.sleep(FLEET_POLL_S)


def stop_fleet(procs: list[subprocess.Popen[bytes]], log_path: Path, timeout_s: float = PROCESS_WAIT_S) -> list[int]:
    """SIGTERM every worker (they stop claiming and drain), then collect their exit codes.

    A worker with a pause point stops itself each time it reaches it, draining included: every
    stopped worker is resumed until all have exited, so none waits for a SIGCONT that never comes.
    """
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            raise AssertionError(f"the fleet did not exit in {timeout_s}s after SIGTERM; log:\n{tail(log_path)}")
        for proc in procs:
            if proc.poll() is None and is_stopped(proc.pid):
                resume(proc)
        waiting = next((proc for proc in procs if proc.poll() is None), None)
        if waiting is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                waiting.wait(timeout=POLL_S)  # returns as soon as it exits; else look for stopped ones again
    return [int(proc.returncode) for proc in procs]


def log_events(log_path: Path) -> Counter[str]:
    """Count the structured log events (JSON lines) in a process log."""
    events: Counter[str] = Counter()
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events[str(json.loads(line).get("event"))] += 1
            except json.JSONDecodeError:
                continue
    return events
