"""Ops: the platform-wide, read-only ledger projection. Ops never reconciles and never changes a run."""
