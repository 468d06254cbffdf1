"""The definitions wing: what a dataflow is, before anything runs.

The definition document and its models (``definitions``), typed parameters (``parameters``), the
schedule block of a definition (``schedule_spec``) and the content-addressed catalogue of pinned
definitions (``catalog``, the ``definitions`` table's one owner).
May import: ``core``, ``datasources``, ``dataflow.schema``. Nothing of execution, protocol or schedules.
"""
