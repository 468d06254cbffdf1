"""Server memory of storing and of verifying one stored result (docs/performance.md, "Result memory").

Each phase runs in a fresh process so its peak RSS (``ru_maxrss``) is its own: ``store`` runs one
inline atomic run whose result is about ``--mb`` MB of Arrow IPC (rows of 1 MB strings, the shape of
issue 29's finding) and reports the peak RSS above the process's RSS before the run, pyarrow's peak
allocation (``default_memory_pool().max_memory()``) and tracemalloc's peak (Python objects, bytes
included); ``verify`` verifies that stored run (``views.verification``) and reports the same three.

    .venv/bin/python benchmarks/bench_result_memory.py --mb 50 [--url sqlite:///PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

ROW_MB = 1


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # KiB on Linux


def _definition(mb: int) -> Any:
    from durable_dataflow.dataflow.definitions.definitions import Definition

    sql = (
        f"select repeat(chr((65 + (range % 26))::INTEGER), {ROW_MB * 1_000_000}) || range::varchar as v "
        f"from range({mb})"
    )
    return Definition.model_validate({
        "name": "memory", "version": 1, "sources": {},
        "steps": [{"name": "result", "sql": sql}],
        "output": {"schema": {"v": "string"}, "max_rows": mb, "max_bytes": f"{2 * mb}MiB"},
    })  # fmt: skip


def _store(url: str, mb: int, workdir: Path) -> dict[str, Any]:
    import pyarrow as pa

    from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
    from durable_dataflow.platform import Platform

    with Platform(url) as platform:
        _ = platform.runs  # the engines imported before the baseline is read
        request = RunRequest(_definition(mb), workdir, {}, AccessContext("acme", "bench", ("operator",), (), "bench"),
                             Provenance("bench", "cli"))  # fmt: skip
        before = _rss_mb()
        tracemalloc.start()
        run = platform.runs.run_inline(request).run
        traced = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
        assert run.status == "succeeded", run
        return {"run_id": run.run_id, "rss_before_mb": before, "rss_peak_above_mb": _peak_mb() - before,
                "arrow_peak_mb": pa.default_memory_pool().max_memory() / 1e6, "traced_peak_mb": traced}  # fmt: skip


def _verify(url: str, run_id: str) -> dict[str, Any]:
    import pyarrow as pa

    from durable_dataflow.dataflow.execution import arrowdigest  # noqa: F401  (imported before the baseline)
    from durable_dataflow.dataflow.protocol import views
    from durable_dataflow.platform import Platform

    with Platform(url) as platform:
        before = _rss_mb()
        arrow_before = pa.default_memory_pool().max_memory()
        tracemalloc.start()
        with platform.db.read() as conn:
            found = views.verification(conn, run_id, None)
        traced = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
        assert found.result.ok, found
        arrow_peak_mb = (pa.default_memory_pool().max_memory() - arrow_before) / 1e6
        return {"rss_before_mb": before, "rss_peak_above_mb": _peak_mb() - before,
                "arrow_peak_mb": arrow_peak_mb, "traced_peak_mb": traced}  # fmt: skip


def _phase(command: list[str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr}")
    return dict(json.loads(done.stdout))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--url")
    parser.add_argument("--phase", choices=["store", "verify"])
    parser.add_argument("--run-id")
    args = parser.parse_args()
    if args.phase == "store":
        print(json.dumps(_store(args.url, args.mb, Path(tempfile.mkdtemp()))))
        return
    if args.phase == "verify":
        print(json.dumps(_verify(args.url, args.run_id)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or f"sqlite:///{tmp}/dataflow.db"
        me = [sys.executable, __file__, "--url", url, "--mb", str(args.mb)]
        stored = _phase([*me, "--phase", "store"])
        verified = _phase([*me, "--phase", "verify", "--run-id", stored["run_id"]])
    print(f"result ≈ {args.mb} MB on {url.split(':')[0]}")
    for name, found in (("store", stored), ("verify", verified)):
        rss, arrow, traced = found["rss_peak_above_mb"], found["arrow_peak_mb"], found["traced_peak_mb"]
        print(f"  {name:6}  RSS peak +{rss:7.1f} MB   Arrow peak {arrow:7.1f} MB   tracemalloc peak {traced:7.1f} MB")


if __name__ == "__main__":
    main()
