"""Core: module-agnostic storage, recovery ledger, leases with fencing, checkpoints and hashing.

Core imports nothing from the other parts of Durable Dataflow; another module could use it unchanged.
"""
