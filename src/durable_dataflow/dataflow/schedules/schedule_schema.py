"""Schedule tables (docs/schedules.md): the applied schedules and every tick's decision.

``schedules`` pins, per tenant and definition name, the definition body and its schedule as applied
(``dataflow schedules apply``), where its runs read and write, and whether it is paused; its
``next_due_us`` says when an evaluation next has work for it (NULL: paused or ``enabled: false``), so an
evaluation reads only the due schedules, by the index on it.
``schedule_ticks`` holds one row per tick that an evaluation decided (submitted, skipped by the
overlap policy, outside the catch-up window, or while paused); its primary key makes the decision
exactly-once: evaluators insert-or-ignore, and the first decision stays.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

HASH = 71
TENANT_LENGTH = 128
NAME_LENGTH = 200
DECISION_LENGTH = 32

schedules = sa.Table(
    "schedules",
    metadata,
    sa.Column("tenant", sa.String(TENANT_LENGTH), nullable=False),
    sa.Column("name", sa.String(NAME_LENGTH), nullable=False),
    sa.Column("definition_hash", sa.String(HASH), nullable=False),
    sa.Column("definition_json", sa.Text, nullable=False),
    sa.Column("schedule_json", sa.Text, nullable=False),
    # Where the scheduled runs read and write (dataflow.execution.workspace), and who applied the schedule.
    sa.Column("workspace_json", sa.Text, nullable=False),
    sa.Column("applied_by", sa.String(NAME_LENGTH), nullable=False),
    sa.Column("paused", sa.Boolean, nullable=False),
    # Ticks after this instant are the schedule's (integer microseconds, UTC).
    sa.Column("applied_at_us", sa.BigInteger, nullable=False),
    sa.Column("updated_at_us", sa.BigInteger, nullable=False),
    # The instant (integer microseconds, UTC) from which an evaluation has work for this schedule: its
    # next undecided tick, or sooner when a submitted tick still waits for its run; NULL when paused or
    # disabled (no evaluation touches it). Kept current by apply, pause, resume and every evaluation.
    sa.Column("next_due_us", sa.BigInteger, nullable=True),
    sa.PrimaryKeyConstraint("tenant", "name", name="pk_schedules"),
    # Evaluation pages through the due schedules of every tenant in this order (schedules.evaluate).
    sa.Index("ix_schedules_next_due", "next_due_us", "tenant", "name"),
)

schedule_ticks = sa.Table(
    "schedule_ticks",
    metadata,
    sa.Column("tenant", sa.String(TENANT_LENGTH), nullable=False),
    sa.Column("name", sa.String(NAME_LENGTH), nullable=False),
    sa.Column("tick_us", sa.BigInteger, nullable=False),
    sa.Column("decision", sa.String(DECISION_LENGTH), nullable=False),
    sa.Column("run_id", sa.String(36), nullable=True),
    # Why a submitted tick has no run yet: the submit's refusal (retried while inside the catch-up window).
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("decided_at_us", sa.BigInteger, nullable=False),
    sa.PrimaryKeyConstraint("tenant", "name", "tick_us", name="pk_schedule_ticks"),
)
