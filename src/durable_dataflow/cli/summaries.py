"""The one-line summary of every top-level command and group, in the order ``dataflow --help`` lists them.

``dataflow --help`` (and ``dataflow`` alone) is answered from this table without importing any command
module: importing them all (SQLAlchemy, pyarrow, the worker) costs over a second, and the help lists
only names and summaries. When every module is registered, each command's short help is set from
this table too, so both paths print the same text (tests/integration/test_cli_imports.py compares
them, and fails when a command has no summary here or a summary names no command).
"""

from __future__ import annotations

# name -> summary; commands first, then groups, each in registration order (as Typer lists them).
COMMANDS: dict[str, str] = {
    "run": "Register, submit and execute a dataflow in this process (under --api: on the server), then print the run.",
    "runs": "The run history, newest first, with parameters, recovery status and a warning on every unresolved run.",
    "reconcile": "Settle an outcome_unknown run by inspecting the sink with its idempotency key.",
    "cancel": "Cancel a queued run, or a running one before its dispatch authorization; after it, refused (exit 5).",
    "show": "A run's fields, its ledger entries and latest checkpoint, and the warning if unresolved.",
    "verify": "Recompute the run's evidence chain and check its facts: exit 0 when it verifies, 1 when not.",
    "result": "The run's stored result (the committed bytes), exported as CSV, Parquet or JSON.",
    "schema": "Print the JSON Schema of a definition document.",
    "validate": "Check a definition without reading its data or recording anything; exit 0 when valid, 2 when not.",
    "version": "Print the installed version.",
    "submit": "Record a run and queue it for a worker; nothing is executed here. A replay returns the run.",
    "worker": "Sweep expired leases, claim queued runs and execute them, until SIGTERM (or --once, --until-idle).",
    "serve": "Serve the JSON API (/v1), the web operator view (/ui), /metrics and /healthz; sweep expired leases.",
    "partitions": "One line per partition value: its current publication and the runs after it; missing days.",
    "workers": "One line per worker and serve sweeper: alive, dead or stopped, with its last beat and runs in flight.",
}
GROUPS: dict[str, str] = {
    "definitions": "Stored (pinned, content-addressed) definitions.",
    "db": "The platform database's schema migrations.",
    "tokens": "Create, list and revoke API tokens (stored as hashes only).",
    "ops": "Ops: the read-only, platform-wide ledger projection.",
    "schedules": "Apply, list, pause and resume schedules; evaluate due ticks.",
    "backfill": "Queue one run per day of a range (`dataflow backfill FILE --from D --to D`), or cancel them.",
    "datasources": "Named datasources: declared by the platform, or registered by runs.",
    "lineage": "The lineage outbox: its backlog, and its delivery as OpenLineage events.",
}
