"""Lineage: OpenLineage run events derived from committed ledger entries, delivered through the ledger
outbox (docs/lineage.md). Reads core and the dataflow projection; writes only the outbox's deletions.

``settings`` imports nothing of OpenLineage, so the Platform can tell whether lineage is configured
without loading the client; ``events`` and ``delivery`` import ``openlineage-python`` (the ``lineage``
extra) and are loaded only by a command that delivers."""
