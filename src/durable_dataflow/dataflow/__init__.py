"""Dataflow: definitions, run requests, source resolution, sandboxed typed execution and runs.

Imports core and datasources only (DESIGN §2).
"""
