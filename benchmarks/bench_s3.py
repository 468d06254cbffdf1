"""Benchmark 13: sources and sinks on an S3-compatible object store (issue 31, item 5).

The store is ``moto_server`` (moto[server], the dev extra) on loopback, started here (tests/support/s3.py's
``MotoServer``): a Python S3 API server, so its times are moto's as much as the platform's, and never S3's
latency or bandwidth; the request counts are the store-independent figures (docs/performance.md §13).

1. **TPC-H Q1 and Q3 at SF1** (SF0.1 with ``--quick``): the tables tpchgen-cli wrote
   (``benchmarks/.data/tpch-sf<N>/``, bench_tpch.ensure_data) uploaded once to a bucket, each as the same
   single object; every measurement in a fresh process (s3_child.py) for its own peak RSS:

   - *platform, local* / *platform, store*: ``runs.run_inline`` (atomic) on a fresh SQLite platform
     database, the definition of bench_tpch with each source's path the local file or its
     ``s3://bucket/tpch-sf<N>/<table>.parquet`` (options: endpoint, region, allow_http, credentials as
     secret references resolved from the environment: the local operator's scope);
   - *arrow, local* / *arrow, store*: the reference without the platform, read the way the platform reads
     a store: DuckDB scanning one pyarrow dataset per table, over the local filesystem or
     ``pyarrow.fs.S3FileSystem``. (Bare DuckDB cannot read ``s3://`` here: its ``httpfs`` extension is not
     installable for the pinned DuckDB; see issue 31.)

   The four alternate inside every round (the order flips each round). Reported per query: the median wall
   time and max peak RSS of each, store/local ratios, whether the store run's output digest equals the local
   run's (and the arrow reference's, cast to the declared schema), and the requests the store served to
   each measurement (counted from moto's access log).

2. **Publishing small keys** (3 rows each) through the providers directly (``publish`` with a
   ``PublishTarget``, as the platform's publisher calls it), through tests/support/s3.py's ``FaultProxy``
   (armed with nothing: it forwards and counts requests per method), one key after another:

   - Parquet folder on ``s3://``: 10,000 keys (1,000 with --quick): keys/s, latency, requests per
     publication by method; then, on a sample: a replay of published keys, an inspection (reconcile's
     read), a fence (``inspect(fence=m)``) and a publication over it; the same publications sent to the
     store directly (no proxy); and with a new boto3 client per call (what the provider did before it
     kept one per store options), for comparison.
   - Delta on ``s3://``: 150 keys (50 with --quick), one commit each, requests per publication early and
     late in the table's life (each publish reads the log since the last checkpoint: its cost grows with
     the version, so fewer keys than the Parquet folder's), and a replay sample.

   The proxy is Python on the same 2 cores; its Nagle delay is turned off (``TCP_NODELAY``), or every GET
   answer waits ~40 ms for a delayed ACK (measured: 49 ms against 4.5 ms per GET).

    .venv/bin/python benchmarks/run.py --only s3            # SF1, 3 rounds, 10,000 keys: results/s3.json (~11 min)
    .venv/bin/python benchmarks/run.py --quick --only s3    # SF0.1, 1 round, 1,000 keys: s3.quick.json (~1.5 min)
    BENCH_S3_KEYS=2000 BENCH_S3_ROUNDS=5 .venv/bin/python benchmarks/run.py --only s3

The harness starts its PostgreSQL server for every benchmark; this one does not use it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import bench_tpch
import tpch_queries
from common import BenchContext, console, print_table, summary, write_result
from tpch_queries import Query

from support.s3 import ACCESS_KEY, REGION, SECRET_KEY, FaultProxy, MotoServer

NAME = "s3"
SCALE_FACTOR = {False: 1.0, True: 0.1}
ROUNDS = {False: 3, True: 1}
PARQUET_KEYS = {False: 10_000, True: 1_000}
# Each Delta publication reads the whole log (no checkpoint below version 100): its cost grows with the
# table's version, so the count is smaller than the Parquet folder's (500 keys would take ~1.5 h here).
DELTA_KEYS = {False: 150, True: 50}
SAMPLE_KEYS = {False: 200, True: 50}  # replays, inspections, fences, direct, client per call
DELTA_SAMPLE_KEYS = {False: 50, True: 20}
ROUNDS_ENV = "BENCH_S3_ROUNDS"
KEYS_ENV = "BENCH_S3_KEYS"  # the Parquet-folder publications (overrides PARQUET_KEYS)
DELTA_KEYS_ENV = "BENCH_S3_DELTA_KEYS"
QUERIES = (tpch_queries.Q1, tpch_queries.Q3)
KINDS = ("platform_local", "platform_store", "arrow_local", "arrow_store")
ACCESS_ENV = "BENCH_S3_ACCESS_KEY"  # the credentials reach the runs as secret references to these
SECRET_ENV = "BENCH_S3_SECRET_KEY"
CHILD_SCRIPT = Path(__file__).resolve().parent / "s3_child.py"
CHILD_TIMEOUT_S = 3600.0
STDERR_CHARS_KEPT = 2_000
ROWS_PER_KEY = 3
PROGRESS_EVERY = 1_000
LOG_KEPT_MAX = 10_000  # the proxy logs every request with its headers: emptied between calls past this
_PROXY_ERRORS = open(os.devnull, "w")  # noqa: SIM115  (for the process's life)
# moto's access log (werkzeug): `127.0.0.1 - - [date] "GET /bucket/key HTTP/1.1" 206 -`, colour codes
# around the request line for some statuses.
_ACCESS_LINE = re.compile(r'\] "(?:\x1b\[[0-9;]*m)*(GET|PUT|POST|HEAD|DELETE) (\S+)')


# ---- the store -------------------------------------------------------------------------------------


def store_options(endpoint: str) -> dict[str, Any]:
    """A definition's / target's store options: credentials as secret references (local scope: the environment)."""
    return {
        "endpoint": endpoint,
        "region": REGION,
        "allow_http": True,
        "access_key_id": {"secret": ACCESS_ENV},
        "secret_access_key": {"secret": SECRET_ENV},
    }


def access_log_counts(log_path: Path) -> Counter[str]:
    """Requests moto has served so far, by method (its access log)."""
    counts: Counter[str] = Counter()
    with log_path.open("rb") as log:
        for line in log.read().decode("utf-8", "replace").splitlines():
            found = _ACCESS_LINE.search(line)
            if found:
                counts[request_kind(found.group(1), found.group(2))] += 1
    return counts


def request_kind(method: str, path: str) -> str:
    """The method, but LIST for a GET of the bucket itself (path-style: ``/bucket?list-type=2&…``)."""
    if method == "GET" and "/" not in path.split("?", 1)[0].strip("/"):
        return "LIST"
    return method


def counted_proxy(moto: MotoServer) -> FaultProxy:
    proxy = FaultProxy(moto.endpoint.removeprefix("http://")).start()
    proxy.errors_to(_PROXY_ERRORS)  # a client that closed a kept-alive connection: a broken pipe, not news
    # http.server's handler writes an answer's headers and body in two sends: without TCP_NODELAY the body
    # waits for the client's delayed ACK (~40 ms per GET on loopback). Read per connection in setup().
    proxy._server.RequestHandlerClass.disable_nagle_algorithm = True  # type: ignore[attr-defined]
    return proxy


# ---- 1. TPC-H from the store and from local disk ----------------------------------------------------


def upload_tables(moto: MotoServer, bucket: str, data_dir: Path, prefix: str) -> dict[str, Any]:
    client = moto.client()
    tables = sorted({table for query in QUERIES for table in query.tables})
    began = time.perf_counter()
    sizes = {}
    for table in tables:
        path = data_dir / f"{table}.parquet"
        client.upload_file(str(path), bucket, f"{prefix}/{table}.parquet")
        sizes[table] = path.stat().st_size
    return {"tables": sizes, "upload_s": time.perf_counter() - began, "prefix": f"s3://{bucket}/{prefix}"}


def store_definition(query: Query, data_dir: Path, bucket: str, prefix: str, endpoint: str) -> dict[str, Any]:
    document = tpch_queries.definition(query, data_dir)
    for table, source in document["sources"].items():
        source["path"] = f"s3://{bucket}/{prefix}/{table}.parquet"
        source["options"] = store_options(endpoint)
    return document


def run_child(folder: Path, spec: dict[str, Any], data_dir: Path) -> dict[str, Any]:
    """One measurement in a fresh interpreter (s3_child.py); a crash or timeout is a failed measurement."""
    (folder / "spill").mkdir(parents=True, exist_ok=True)
    spec = {
        "memory_bytes": bench_tpch.MEMORY_BYTES,
        "memory_limit": f"{bench_tpch.MEMORY_BYTES // 1024**2}MiB",
        "threads": bench_tpch.THREADS,
        "time_limit_s": bench_tpch.TIME_LIMIT_S,
        "temp_dir": str(folder / "spill"),
        **spec,
        "result_path": str(folder / "result.json"),
    }
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "DATAFLOW_DATA_ROOTS": str(data_dir)}
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(CHILD_SCRIPT), str(spec_path)], env=env, capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ok": False, "status": "timeout", "error_message": f"no result within {CHILD_TIMEOUT_S:g} s"}
    result_path = Path(spec["result_path"])
    if done.returncode != 0 or not result_path.is_file():
        return {"ok": False, "status": "crashed", "error_message": f"exit {done.returncode}: "
                f"{done.stderr[-STDERR_CHARS_KEPT:]}"}  # fmt: skip
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["process_s"] = time.perf_counter() - began
    return result


def measure(kind: str, query: Query, data_dir: Path, place: dict[str, Any], folder: Path) -> dict[str, Any]:
    bucket, prefix, endpoint = place["bucket"], place["prefix"], place["endpoint"]
    if kind.startswith("platform"):
        if kind == "platform_store":
            definition = store_definition(query, data_dir, bucket, prefix, endpoint)
        else:
            definition = tpch_queries.definition(query, data_dir)
        spec = bench_tpch.platform_spec(definition, folder, f"s3-{folder.name}", {})
        return run_child(folder, spec, data_dir)
    ipc_path = folder / "arrow.arrow"
    spec = {"kind": "arrow", "sql": query.sql.strip(), "ipc_path": str(ipc_path)}
    if kind == "arrow_store":
        spec["tables"] = {t: f"{bucket}/{prefix}/{t}.parquet" for t in query.tables}
        spec["store"] = {"endpoint": endpoint, "region": REGION, "access_key_env": ACCESS_ENV,
                         "secret_key_env": SECRET_ENV}  # fmt: skip
    else:
        spec["tables"] = {t: str(data_dir / f"{t}.parquet") for t in query.tables}
    result = run_child(folder, spec, data_dir)
    if result["ok"]:
        result["digest"] = bench_tpch.check_bare(query, data_dir, ipc_path)["bare_digest"]
    return result


def run_tpch(moto: MotoServer, scale_factor: float, rounds: int, workdir: Path, log_path: Path) -> dict[str, Any]:
    data_dir = bench_tpch.ensure_data(scale_factor).resolve()
    label = bench_tpch.sf_label(scale_factor)
    bucket = moto.new_bucket()
    prefix = f"tpch-sf{label}"
    uploaded = upload_tables(moto, bucket, data_dir, prefix)
    console.print(f"uploaded {len(uploaded['tables'])} tables of SF{label} in {uploaded['upload_s']:.1f} s")
    place = {"bucket": bucket, "prefix": prefix, "endpoint": moto.endpoint}
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in range(rounds):
        for query in QUERIES:
            kinds = KINDS if r % 2 == 0 else KINDS[::-1]
            for kind in kinds:
                folder = workdir / f"sf{label}-r{r}-{query.name}-{kind}"
                before = access_log_counts(log_path)
                result = measure(kind, query, data_dir, place, folder)
                served = access_log_counts(log_path) - before
                result["store_requests"] = dict(served)
                shutil.rmtree(folder, ignore_errors=True)
                samples.setdefault(query.name, {}).setdefault(kind, []).append(result)
                line = (f"{result['wall_s']:.2f} s, peak {result['rss_peak_kib'] / 1024:.0f} MiB, "
                        f"store requests {dict(served)}" if result["ok"] else
                        f"FAILED {result.get('status')}: {str(result.get('error_message'))[:300]}")  # fmt: skip
                console.print(f"  SF{label} r{r} {query.name} {kind}: {line}", markup=False, highlight=False)
    return {"scale_factor": scale_factor, "data": bench_tpch.data_facts(data_dir), "store": uploaded,
            "samples": samples, "summary": summarize_tpch(samples)}  # fmt: skip


def _side(results: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in results if r["ok"]]
    requests: Counter[str] = Counter()
    for r in done:
        requests.update(r.get("store_requests", {}))
    return {
        "measured": len(results),
        "completed": len(done),
        "wall_s": summary([r["wall_s"] for r in done]),
        "wall_s_median": statistics.median([r["wall_s"] for r in done]) if done else None,
        "rss_peak_mib_max": max(r["rss_peak_kib"] for r in done) / 1024 if done else None,
        "rss_before_mib": statistics.median([r["rss_before_kib"] for r in done]) / 1024 if done else None,
        "store_requests_per_run": {m: n / len(done) for m, n in sorted(requests.items())} if done else {},
        "digests": sorted({str(r.get("output_digest") or r.get("digest")) for r in done}),
        "errors": [str(r.get("error_message"))[:300] for r in results if not r["ok"]],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_tpch(samples: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    queries = {}
    for name, kinds in samples.items():
        sides = {kind: _side(results) for kind, results in kinds.items()}
        digests = [sides[k]["digests"] for k in KINDS if sides[k]["completed"]]
        queries[name] = {
            **sides,
            "platform_time_ratio": _ratio(sides["platform_store"]["wall_s_median"],
                                          sides["platform_local"]["wall_s_median"]),
            "platform_rss_ratio": _ratio(sides["platform_store"]["rss_peak_mib_max"],
                                         sides["platform_local"]["rss_peak_mib_max"]),
            "arrow_time_ratio": _ratio(sides["arrow_store"]["wall_s_median"], sides["arrow_local"]["wall_s_median"]),
            "arrow_rss_ratio": _ratio(sides["arrow_store"]["rss_peak_mib_max"],
                                      sides["arrow_local"]["rss_peak_mib_max"]),
            "store_platform_over_arrow": _ratio(sides["platform_store"]["wall_s_median"],
                                                sides["arrow_store"]["wall_s_median"]),
            "same_result": len(digests) == len(KINDS) and all(d == digests[0] and len(d) == 1 for d in digests),
        }  # fmt: skip
    return queries


# ---- 2. publishing small keys ---------------------------------------------------------------------------


def small_table(i: int) -> Any:
    import pyarrow as pa

    start = i * ROWS_PER_KEY
    return pa.table({"id": pa.array(range(start, start + ROWS_PER_KEY), pa.int64()),
                     "v": pa.array([f"key-{i}"] * ROWS_PER_KEY, pa.string())})  # fmt: skip


def digest_of(key: str) -> str:
    from durable_dataflow.core.hashing import sha256_bytes

    return sha256_bytes(key.encode("utf-8"))


def counted(
    proxy: FaultProxy | None, label: str, items: Iterable[Any], call: Callable[[Any], Any], expect: tuple[type, ...]
) -> dict[str, Any]:
    """Call ``call`` on each item one after another; the time of each and the requests the proxy saw for it."""
    latencies: list[float] = []
    per_call: list[Counter[str]] = []
    if proxy is not None:
        del proxy.log[:]
    outcomes: Counter[str] = Counter()
    began = time.perf_counter()
    for index, item in enumerate(items):
        before = len(proxy.log) if proxy is not None else 0
        started = time.perf_counter()
        outcome = call(item)
        latencies.append(time.perf_counter() - started)
        outcomes[type(outcome).__name__] += 1
        if not isinstance(outcome, expect):
            raise RuntimeError(f"{label}: {item!r} gave {outcome!r}")
        if proxy is not None:
            per_call.append(Counter(request_kind(method, path) for method, path, _ in proxy.log[before:]))
            if len(proxy.log) > LOG_KEPT_MAX:
                del proxy.log[:]
        if (index + 1) % PROGRESS_EVERY == 0:
            rate = (index + 1) / (time.perf_counter() - began)
            console.print(f"  {label}: {index + 1} done, {rate:.1f}/s", markup=False, highlight=False)
    seconds = time.perf_counter() - began
    calls = len(latencies)
    result: dict[str, Any] = {
        "calls": calls,
        "seconds": seconds,
        "per_s": calls / seconds if seconds else None,
        "latency_ms": summary([x * 1000 for x in latencies]),
        "outcomes": dict(outcomes),
    }
    if proxy is not None:
        result.update(request_figures(per_call))
    console.print(
        f"  {label}: {calls} in {seconds:.1f} s = {result['per_s']:.1f}/s"
        + (f", requests each {result['requests_mean']}" if proxy else ""),
        markup=False,
        highlight=False,
    )
    return result


def request_figures(per_call: list[Counter[str]]) -> dict[str, Any]:
    methods = sorted({m for c in per_call for m in c})
    shapes = Counter(" ".join(f"{m} {c[m]}" for m in methods if c[m]) for c in per_call)
    totals = [sum(c.values()) for c in per_call]
    return {
        "requests_mean": {m: round(sum(c[m] for c in per_call) / len(per_call), 3) for m in methods},
        "requests_total": summary(totals),
        "request_shapes": dict(shapes.most_common(10)),  # how many calls made exactly these requests
    }


def run_parquet(moto: MotoServer, keys: int, sample: int) -> dict[str, Any]:
    from durable_dataflow.datasources import contract, parquet_store
    from durable_dataflow.datasources.contract import Absent, AlreadyPublished, Present, Published, PublishTarget
    from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider

    bucket = moto.new_bucket()
    proxy = counted_proxy(moto)
    try:
        provider = ParquetFolderProvider()
        location = f"s3://{bucket}/sink/parquet"
        target = PublishTarget("bench.keys", location, "append", store_options(proxy.endpoint))
        direct = PublishTarget("bench.keys", location, "append", store_options(moto.endpoint))
        prepared = counted(proxy, "parquet prepare", [0], lambda _: contract.prepare(provider, target), (type(None),))

        def publish(t: PublishTarget, token: int = 1) -> Callable[[int], Any]:
            return lambda i: provider.publish(f"key-{i}", token, small_table(i), digest_of(f"key-{i}"), t)

        figures: dict[str, Any] = {"prepare": prepared}
        figures["publish"] = counted(proxy, "parquet publish", range(keys), publish(target), (Published,))
        figures["replay"] = counted(proxy, "parquet replay", range(sample), publish(target, 2), (AlreadyPublished,))
        figures["inspect"] = counted(
            proxy, "parquet inspect", range(sample), lambda i: provider.inspect(f"key-{i}", target), (Present,)
        )
        fenced = range(keys, keys + sample)
        figures["fence"] = counted(
            proxy, "parquet fence", fenced, lambda i: provider.inspect(f"key-{i}", target, fence=2), (Absent,)
        )
        figures["publish_over_fence"] = counted(proxy, "parquet publish over a fence", fenced, publish(target, 2),
                                                (Published,))  # fmt: skip
        direct_keys = range(keys + sample, keys + 2 * sample)
        figures["publish_direct"] = counted(None, "parquet publish, no proxy", direct_keys, publish(direct),
                                            (Published,))  # fmt: skip

        def fresh_client(i: int) -> Any:
            clients = getattr(parquet_store, "_clients", None)
            if clients is not None:
                clients.clear()  # the provider's behaviour before it kept a client per store options
            return publish(target)(i)

        figures["publish_client_per_call"] = counted(
            proxy, "parquet publish, a new client per call", range(keys + 2 * sample, keys + 3 * sample), fresh_client,
            (Published,),
        )  # fmt: skip
        states = count_objects(moto, bucket, "sink/parquet/_dataflow/keys/")
        figures["check"] = {"state_objects": states, "expected": keys + 3 * sample}
        if states != keys + 3 * sample:
            raise RuntimeError(f"{states} state objects on the store, expected {keys + 3 * sample}")
        return figures
    finally:
        proxy.stop()


def count_objects(moto: MotoServer, bucket: str, prefix: str) -> int:
    paginator = moto.client().get_paginator("list_objects_v2")
    return sum(len(page.get("Contents") or ()) for page in paginator.paginate(Bucket=bucket, Prefix=prefix))


def run_delta(moto: MotoServer, keys: int, sample: int) -> dict[str, Any]:
    from durable_dataflow.datasources import contract
    from durable_dataflow.datasources.contract import AlreadyPublished, Published, PublishTarget
    from durable_dataflow.datasources.delta import DeltaProvider

    bucket = moto.new_bucket()
    proxy = counted_proxy(moto)
    try:
        provider = DeltaProvider()
        target = PublishTarget("bench.keys", f"s3://{bucket}/sink/delta", "append", store_options(proxy.endpoint))
        prepared = counted(proxy, "delta prepare", [0], lambda _: contract.prepare(provider, target), (type(None),))

        def publish(token: int) -> Callable[[int], Any]:
            return lambda i: provider.publish(f"key-{i}", token, small_table(i), digest_of(f"key-{i}"), target)

        tenth = max(1, keys // 10)
        figures: dict[str, Any] = {"prepare": prepared}
        figures["publish_first_tenth"] = counted(proxy, "delta publish (first tenth)", range(tenth), publish(1),
                                                 (Published,))  # fmt: skip
        figures["publish_middle"] = counted(proxy, "delta publish (middle)", range(tenth, keys - tenth), publish(1),
                                            (Published,))  # fmt: skip
        figures["publish_last_tenth"] = counted(proxy, "delta publish (last tenth)", range(keys - tenth, keys),
                                                publish(1), (Published,))  # fmt: skip
        parts = [figures[p] for p in ("publish_first_tenth", "publish_middle", "publish_last_tenth")]
        seconds = sum(p["seconds"] for p in parts)
        figures["publish"] = {"calls": keys, "seconds": seconds, "per_s": keys / seconds}
        figures["replay"] = counted(proxy, "delta replay", range(sample), publish(2), (AlreadyPublished,))
        commits = count_objects(moto, bucket, "sink/delta/_delta_log/")
        figures["check"] = {"log_objects": commits}
        return figures
    finally:
        proxy.stop()


# ---- report ----------------------------------------------------------------------------------------------


def _num(value: Any) -> Any:
    return float("nan") if value is None else value


def _requests(figure: dict[str, Any]) -> str:
    mean = figure.get("requests_mean") or {}
    return ", ".join(f"{m} {v:g}" for m, v in mean.items()) + f" (= {sum(mean.values()):g})" if mean else "-"


def print_report(tpch: dict[str, Any], parquet: dict[str, Any], delta: dict[str, Any]) -> None:
    label = bench_tpch.sf_label(tpch["scale_factor"])
    rows = []
    for name, e in tpch["summary"].items():
        for kind in KINDS:
            side = e[kind]
            rows.append((
                f"SF{label}", name.upper(), kind.replace("_", ", "), _num(side["wall_s_median"]),
                _num(side["rss_peak_mib_max"]),
                ", ".join(f"{m} {n:g}" for m, n in side["store_requests_per_run"].items()) or "-",
            ))  # fmt: skip
        rows.append((f"SF{label}", name.upper(), "store / local", _num(e["platform_time_ratio"]),
                     _num(e["platform_rss_ratio"]), f"same result: {e['same_result']}"))  # fmt: skip
    print_table(
        "TPC-H from moto_server on loopback vs local disk (median s; max peak RSS MiB; store requests per run)",
        ["SF", "query", "how", "median s", "peak MiB", "store requests / run"],
        rows,
    )
    prow = []
    for name, f in parquet.items():
        if "calls" in f:
            prow.append(("parquet folder", name, f["calls"], _num(f["per_s"]), f["latency_ms"]["median"],
                         f["latency_ms"]["p95"], _requests(f)))  # fmt: skip
    for name, f in delta.items():
        if "latency_ms" in f:
            prow.append(("delta", name, f["calls"], _num(f["per_s"]), f["latency_ms"]["median"],
                         f["latency_ms"]["p95"], _requests(f)))  # fmt: skip
    print_table(
        "Publishing small keys to moto_server through a counting proxy (one after another)",
        ["sink", "operation", "calls", "per s", "median ms", "p95 ms", "requests per call (mean)"],
        prow,
    )


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def run(ctx: BenchContext) -> dict[str, Any]:
    quick = ctx.quick
    rounds = int(os.environ.get(ROUNDS_ENV, "").strip() or ROUNDS[quick])
    keys = int(os.environ.get(KEYS_ENV, "").strip() or PARQUET_KEYS[quick])
    delta_keys = int(os.environ.get(DELTA_KEYS_ENV, "").strip() or DELTA_KEYS[quick])
    workdir = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=ctx.workdir))
    os.environ[ACCESS_ENV], os.environ[SECRET_ENV] = ACCESS_KEY, SECRET_KEY  # the local scope's secrets
    log_path = workdir / "moto.log"
    moto = MotoServer(log_path)
    try:
        began = time.monotonic()
        tpch = run_tpch(moto, SCALE_FACTOR[quick], rounds, workdir, log_path)
        tpch["seconds"] = time.monotonic() - began
        began = time.monotonic()
        parquet = run_parquet(moto, keys, SAMPLE_KEYS[quick])
        parquet_s = time.monotonic() - began
        began = time.monotonic()
        delta = run_delta(moto, delta_keys, DELTA_SAMPLE_KEYS[quick])
        delta_s = time.monotonic() - began
    finally:
        moto.stop()
    print_report(tpch, parquet, delta)
    payload = {
        "settings": {
            "store": "moto_server (moto[server]) on 127.0.0.1, one process, started by the benchmark",
            "tpch_rounds": rounds,
            "tpch_kinds": list(KINDS),
            "tpch_timed": "platform: runs.run_inline (atomic, fresh SQLite); arrow: DuckDB over pyarrow datasets "
            "(local or S3FileSystem), connect to Arrow table; each in a fresh process, imports excluded",
            "tpch_peak_rss": "VmHWM of the measuring process (moto's own memory is not in it)",
            "tpch_store_requests": "counted from moto's access log around each measurement",
            "memory_limit_bytes": bench_tpch.MEMORY_BYTES,
            "threads": bench_tpch.THREADS,
            "parquet_keys": keys,
            "delta_keys": delta_keys,
            "rows_per_key": ROWS_PER_KEY,
            "sample_keys": SAMPLE_KEYS[quick],
            "publications": "provider.publish one key after another through tests/support/s3.py's FaultProxy "
            "(TCP_NODELAY on), which counts requests per method; publish_direct goes to moto without it",
            "versions": {n: _version(n) for n in ("moto", "boto3", "deltalake", "tpchgen-cli")},
        },
        "tpch": tpch,
        "parquet_folder": {**parquet, "seconds": parquet_s},
        "delta": {**delta, "seconds": delta_s},
    }
    write_result(NAME, payload, None, quick)
    return payload
