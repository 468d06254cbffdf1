"""The peer: the same trivial work as a DBOS Transact workflow with one step.

The step builds the same 1,000-row Arrow table from the same Python rows our inline source holds,
runs the same GROUP BY on a cursor of one shared in-process DuckDB database (as our sandbox does),
and returns the result as Arrow IPC bytes, which DBOS checkpoints in its system database (as we
store the result). Only the orchestration differs.

DBOS is a process-wide singleton, so every DBOS measurement runs in a child process of its own
(``configure`` + ``DBOS.launch()`` there); the parent never launches it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from common import duckdb_group_by_on_shared, inline_rows
from dbos import DBOS, DBOSConfig, Queue, SetWorkflowID

APP_NAME = "dataflow_bench_peer"
QUEUE_NAME = "bench_queue"
WORKFLOW_NAME = "trivial_workflow"
_ROWS = inline_rows()
_queue: Queue | None = None


@DBOS.step()
def group_step(tag: str) -> bytes:
    table = pa.Table.from_pylist(_ROWS, schema=pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    result = duckdb_group_by_on_shared(table)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, result.schema) as writer:
        writer.write_table(result)
    return bytes(sink.getvalue().to_pybytes())


@DBOS.workflow(name=WORKFLOW_NAME)
def trivial_workflow(tag: str) -> int:
    return len(group_step(tag))


def plain_url(url: str) -> str:
    """DBOS takes a libpq-style URL; our throwaway server's URLs name the psycopg driver."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def launch(url: str, executor_id: str, *, queue_poll_s: float | None = None) -> None:
    """Configure and launch DBOS in this process; with ``queue_poll_s`` also serve the bench queue."""
    global _queue
    config: DBOSConfig = {
        "name": APP_NAME,
        "system_database_url": plain_url(url),
        "executor_id": executor_id,
        "run_admin_server": False,
        "log_level": "WARNING",
    }
    DBOS(config=config)
    DBOS.launch()
    if queue_poll_s is not None:  # queues are registered (persisted) after launch in DBOS 3
        _queue = DBOS.register_queue(QUEUE_NAME, worker_concurrency=1, polling_interval_sec=queue_poll_s)


def run_once(workflow_id: str, tag: str) -> int:
    with SetWorkflowID(workflow_id):
        return trivial_workflow(tag)


def shutdown() -> None:
    DBOS.destroy()


def enqueue_many(url: str, ids: list[str]) -> None:
    """Enqueue workflows from outside the workers, as a client submits runs."""
    from dbos import DBOSClient

    client = DBOSClient(system_database_url=plain_url(url))
    try:
        for workflow_id in ids:
            options: Any = {
                "queue_name": QUEUE_NAME,
                "workflow_name": WORKFLOW_NAME,
                "workflow_id": workflow_id,
                "application_name": APP_NAME,
            }
            client.enqueue(options, workflow_id)
    finally:
        client.destroy()


def count_succeeded(conn: Any, prefix: str) -> int:
    row = conn.execute(
        "select count(*) from dbos.workflow_status where status = 'SUCCESS' and workflow_uuid like %s",
        (prefix + "%",),
    ).fetchone()
    return int(row[0]) if row else 0
