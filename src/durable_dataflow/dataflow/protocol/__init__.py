"""The protocol wing: the run's recorded life, from submission to its proven end.

Submission and the service facade (``service``), the atomic and the forward attempt (``forward``),
reconciliation (``reconcile``), the lease sweeper (``sweeper``), cancellation (``cancel``), the one
table of transitions (``transitions``), the ledger evidence rules (``evidence``), the runs projection
(``runs``, its table's one owner), partition tokens and status (``partition_tokens``, ``partitions``)
and the read module every front end calls (``views``).
May import: ``core``, ``datasources``, ``dataflow.schema``, the definitions and execution wings.
Nothing of schedules.
"""
