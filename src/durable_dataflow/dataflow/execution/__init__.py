"""Typed execution: resolve sources, run the SQL steps on the definition's engine, stream the bounded result.

``compute`` runs one execution (``compute.execute``); ``context`` says where it reads and within which
limits; ``engine`` is the interface the engines (``duckdb_engine``, ``spark_engine``) implement.
This package's ``__init__`` imports nothing, so importing one of its modules loads only that module.
"""
