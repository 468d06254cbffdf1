"""Dataflow tables (DESIGN §4): pinned definitions, the DataflowRun projection and stored results.

The projection is what run histories read; the ledger (core) is the evidence. Every column that
could identify a secret holds a digest or a reference, never a value.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

HASH = 71
KEY_LENGTH = 255
TENANT_LENGTH = 128
STATUS_LENGTH = 32
REF_LENGTH = 1000

definitions = sa.Table(
    "definitions",
    metadata,
    sa.Column("definition_hash", sa.String(HASH), primary_key=True),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("body_json", sa.Text, nullable=False),
    sa.Column("registered_at_us", sa.BigInteger, nullable=False),
    sa.Index("ix_definitions_name_version", "name", "version"),
)

dataflow_runs = sa.Table(
    "dataflow_runs",
    metadata,
    sa.Column("run_id", sa.String(36), primary_key=True),
    sa.Column("tenant", sa.String(TENANT_LENGTH), nullable=False),
    sa.Column("idempotency_key", sa.String(KEY_LENGTH), nullable=False),
    sa.Column("definition_hash", sa.String(HASH), nullable=False),
    sa.Column("definition_name", sa.String(200), nullable=False),
    sa.Column("request_hash", sa.String(HASH), nullable=False),
    sa.Column("mode", sa.String(STATUS_LENGTH), nullable=False),
    sa.Column("status", sa.String(STATUS_LENGTH), nullable=False),
    sa.Column("recovery_status", sa.String(STATUS_LENGTH), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("parameters_json", sa.Text, nullable=False),
    sa.Column("provenance_json", sa.Text, nullable=False),
    sa.Column("principal", sa.String(200), nullable=False),
    sa.Column("access_context_digest", sa.String(HASH), nullable=False),
    sa.Column("target_json", sa.Text, nullable=True),
    sa.Column("base_dir", sa.String(2000), nullable=False),
    # The run's workspace (dataflow.execution.workspace): roots, sink root, scope; NULL for older runs.
    sa.Column("workspace_json", sa.Text, nullable=True),
    sa.Column("row_count", sa.BigInteger, nullable=True),
    sa.Column("output_digest", sa.String(HASH), nullable=True),
    sa.Column("source_fingerprint_digest", sa.String(HASH), nullable=True),
    sa.Column("publication_idempotency_key", sa.String(KEY_LENGTH), nullable=True),
    sa.Column("publication_idempotency_digest", sa.String(HASH), nullable=True),
    sa.Column("publication_ref", sa.String(REF_LENGTH), nullable=True),
    sa.Column("datasource_ref", sa.String(REF_LENGTH), nullable=True),
    sa.Column("materialization_ref", sa.String(REF_LENGTH), nullable=True),
    sa.Column("warning", sa.Text, nullable=True),
    sa.Column("error_code", sa.String(64), nullable=True),
    sa.Column("error_message", sa.Text, nullable=True),
    sa.Column("created_at_us", sa.BigInteger, nullable=False),
    sa.Column("updated_at_us", sa.BigInteger, nullable=False),
    # A run whose target has a partition (mode replace_partition): the target's datasource and the
    # partition's values, {column: canonical value} as RFC 8785 JSON; NULL for every other run. They are
    # the run's target and parameters, resolved once at submit, so partition status reads a datasource's
    # partitioned runs by the index below instead of parsing every run's target (dataflow.protocol.partitions).
    sa.Column("partition_datasource", sa.String(200), nullable=True),
    sa.Column("partition_json", sa.Text, nullable=True),
    sa.UniqueConstraint("tenant", "idempotency_key", name="uq_dataflow_runs_tenant_key"),
    sa.Index("ix_dataflow_runs_tenant_created", "tenant", "created_at_us", "run_id"),
    sa.Index("ix_dataflow_runs_status", "status", "created_at_us"),
    # The fair claim (dataflow.protocol.runs.fairest_queued): the tenants with queued runs, and each
    # one's oldest queued run.
    sa.Index("ix_dataflow_runs_status_tenant_created", "status", "tenant", "created_at_us"),
    sa.Index("ix_dataflow_runs_recovery_status", "recovery_status"),
    # The history page: newest first overall, and newest first per definition (benchmarks/ledger_scale).
    sa.Index("ix_dataflow_runs_created", "created_at_us", "run_id"),
    sa.Index("ix_dataflow_runs_definition_created", "definition_name", "created_at_us", "run_id"),
    # One tenant's runs of one definition (the history's definition filter and its charts): without it a
    # planner may read every tenant's runs of the name by the index above, in time that tells a tenant
    # about the others' runs (migration 0016).
    sa.Index("ix_dataflow_runs_tenant_definition_created", "tenant", "definition_name", "created_at_us", "run_id"),
    # Ops counts runs by status and recovery status, platform-wide and per tenant, from these alone.
    sa.Index("ix_dataflow_runs_status_pair", "status", "recovery_status"),
    sa.Index("ix_dataflow_runs_tenant_status_pair", "tenant", "status", "recovery_status"),
    # Partition status: one tenant's runs of one partitioned datasource.
    sa.Index("ix_dataflow_runs_partition", "tenant", "partition_datasource", "created_at_us"),
)

run_results = sa.Table(
    "run_results",
    metadata,
    sa.Column("run_id", sa.String(36), primary_key=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("output_digest", sa.String(HASH), nullable=False),
    sa.Column("format", sa.String(32), nullable=False),
    sa.Column("row_count", sa.BigInteger, nullable=False),
    sa.Column("bytes", sa.LargeBinary, nullable=False),
)

# The bytes of every result a tenant's runs stored (``run_results``, whose owner keeps it: results.store adds
# each result's size in the transaction that stores it). The result_bytes quota reads this one row per
# tenant instead of summing the tenant's results; no row means nothing stored.
tenant_result_bytes = sa.Table(
    "tenant_result_bytes",
    metadata,
    sa.Column("tenant", sa.String(TENANT_LENGTH), primary_key=True),
    sa.Column("stored_bytes", sa.BigInteger, nullable=False),
)

# The monotonic partition token per tenant, datasource and partition (dataflow.protocol.partition_tokens): taken
# in each pre-dispatch commit of a replace_partition run, so the later authorized run of a partition wins.
partition_tokens = sa.Table(
    "partition_tokens",
    metadata,
    sa.Column("tenant", sa.String(TENANT_LENGTH), nullable=False),
    sa.Column("datasource", sa.String(200), nullable=False),
    # sha256 over the RFC 8785 JSON of {column: value}: never the values themselves.
    sa.Column("partition_digest", sa.String(HASH), nullable=False),
    sa.Column("token", sa.BigInteger, nullable=False),
    sa.PrimaryKeyConstraint("tenant", "datasource", "partition_digest", name="pk_partition_tokens"),
)

# One row per worker process and per `dataflow serve` sweeper: its heartbeat (dataflow.protocol.fleet, the
# table's one owner). A process upserts its row at start, beats it on its loop and marks it stopped on a
# graceful stop; rows of processes gone longer than the retention are pruned.
workers = sa.Table(
    "workers",
    metadata,
    sa.Column("holder", sa.String(200), primary_key=True),  # the process's holder id (its liveness lock's key)
    sa.Column("role", sa.String(STATUS_LENGTH), nullable=False),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("version", sa.String(64), nullable=False),
    sa.Column("status", sa.String(STATUS_LENGTH), nullable=False),
    sa.Column("started_at_us", sa.BigInteger, nullable=False),
    sa.Column("beat_at_us", sa.BigInteger, nullable=False),
    sa.Column("stopped_at_us", sa.BigInteger, nullable=True),
    sa.Column("inflight", sa.Integer, nullable=False),
    sa.Column("concurrency", sa.Integer, nullable=False),
    sa.Column("ttl_us", sa.BigInteger, nullable=False),  # the process's own TTL: a reader decides by it
    # Whether the process held its holder lock (core/holders.py) at its last beat: only then does a free
    # lock mean that the process is gone (PostgreSQL).
    sa.Column("holder_locked", sa.Boolean, nullable=False),
    sa.Index("ix_workers_beat", "beat_at_us"),
)
