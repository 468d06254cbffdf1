"""The schedules wing: runs submitted by time rather than by hand.

Applied schedules and their exactly-once ticks (``schedules``, owner of the ``schedules`` and
``schedule_ticks`` tables of ``schedule_schema``) and backfills over a range of days (``backfill``).
May import: ``core``, ``datasources``, ``dataflow.schema`` and every other wing (definitions,
execution, protocol). Only the worker, the CLI and the API import it.
"""
