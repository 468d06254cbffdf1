"""The execution wing: a run's result computed from its sources, with nothing committed.

``compute`` runs one execution (``compute.execute``); ``context`` says where it reads and within which
limits (``limits``, ``workspace``); ``sources``, ``postgres_source`` and ``pgquery`` resolve, confine
and fingerprint the sources; ``engine`` is the interface the engines (``duckdb_engine``,
``spark_engine``) implement; ``resultstream``, ``arrowdigest`` and ``results`` bound, digest, encode
and store the result; ``progress`` and ``interruption`` report and stop long work.
May import: ``core``, ``datasources``, ``dataflow.schema`` and the definitions wing. Nothing of
protocol or schedules. This ``__init__`` imports nothing, so loading one module loads only that module.
"""
