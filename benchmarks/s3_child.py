"""One bench_s3 TPC-H measurement in a fresh process, so its peak RSS is that measurement's alone.

    python benchmarks/s3_child.py SPEC.json

The kinds of tpch_child.py (``platform``: ``runs.run_inline`` on a fresh SQLite platform database),
plus ``arrow``: the reference without the platform, the way the platform itself reads a store: a
fresh in-memory DuckDB (same memory limit, threads and spill folder) scanning one pyarrow dataset per
table, over ``pyarrow.fs.S3FileSystem`` (``"store"`` in the spec: endpoint, region; the credentials
from the environment variables it names) or over the local filesystem, then the query to an Arrow
table. Timed: from building the filesystem to the Arrow table. The result is written as Arrow IPC
for the parent to check against the platform's digest. Only the standard library is imported at the
top, as in tpch_child.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tpch_child  # standard library only at its top


def measure_arrow(spec: dict[str, Any]) -> dict[str, Any]:
    began = time.perf_counter()
    import duckdb
    import pyarrow.dataset as ds
    from pyarrow import fs

    setup_s = time.perf_counter() - began
    rss_before_kib = tpch_child._rss_peak_kib()
    started = time.perf_counter()
    store = spec.get("store")
    filesystem: Any
    if store is not None:
        filesystem = fs.S3FileSystem(
            access_key=os.environ[store["access_key_env"]],
            secret_key=os.environ[store["secret_key_env"]],
            endpoint_override=store["endpoint"].split("://", 1)[1],
            scheme=store["endpoint"].split("://", 1)[0],
            region=store["region"],
        )
    else:
        filesystem = fs.LocalFileSystem()
    config = {"memory_limit": spec["memory_limit"], "threads": spec["threads"], "temp_directory": spec["temp_dir"]}
    connection = duckdb.connect(":memory:", config=config)
    for table, path in spec["tables"].items():
        connection.register(table, ds.dataset(path, filesystem=filesystem, format="parquet"))
    return tpch_child.query_and_report(connection, spec, started, setup_s, rss_before_kib)


MEASURES = {**tpch_child.MEASURES, "arrow": measure_arrow}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    result = MEASURES[spec["kind"]](spec)
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
