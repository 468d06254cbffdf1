"""Partitioned targets (issue 27, items 1-3): `mode: replace_partition` on the Delta and PostgreSQL sinks.

A re-run of a day replaces that day (the later run's rows, one copy) and leaves the other days alone,
read back by an independent reader (the Delta log replayed by hand and its Parquet files read with
pyarrow; psycopg for PostgreSQL); rows outside the run's partition never leave the platform; of two
overlapping runs of a partition the one authorized later wins (the earlier one's publish is refused
`superseded`), also when the earlier one is resumed after proven absence; a string partition value
cannot inject into the Delta predicate or the PostgreSQL DELETE; the Parquet folder refuses the mode
before anything is recorded; a definition without a partition keeps its hash. On SQLite and PostgreSQL
platform databases.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import psycopg
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from durable_dataflow.core import crashpoints
from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions.definitions import Definition, definition_hash, parse_definition
from durable_dataflow.dataflow.protocol import forward
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import SUPERSEDED
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.postgres_table import PostgresTableProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows

SINK_SECRET = "TEST_PARTITIONED_SINK_DSN"
PG_TABLE = "public.daily_totals"
# A definition without a partition keeps exactly its hash from before partitions existed (computed
# with the code of the commit before them).
UNPARTITIONED_DELTA_HASH = "sha256:58c0b51ba71331665e7119c9f91bb8c221332dbfdb22ee1246dffb22c750d6c5"


def _target(provider: str, *, column: str = "day", options: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "datasources.publication",
        "provider": provider,
        "datasource": "analytics.daily_totals",
        "location": PG_TABLE if provider in ("postgres", "faulty_pg") else "daily",
        "mode": "replace_partition",
        "partition": {column: f"${column}"},
        **({"options": options} if options else {}),
    }


def _definition(target: dict[str, Any], *, sql: str | None = None) -> Definition:
    """Totals per region for one day; `factor` tells one run's rows from another's."""
    document = {
        "name": "daily_totals",
        "version": 1,
        "parameters": {
            "day": {"type": "date"},
            "region": {"type": "string", "default": "-"},
            "factor": {"type": "int", "default": 1},
        },
        "sources": {
            "sales": {"kind": "inline", "rows": flows.ROWS, "schema": {"region": "string", "amount": "decimal(12,2)"}},
        },
        "steps": [
            {
                "name": "totals",
                "sql": sql
                or (
                    "select $day::DATE as day, region, (sum(amount) * $factor)::DECIMAL(18,2) as total, "
                    "count(*)::BIGINT as n from sales group by region order by region"
                ),
            }
        ],
        "output": {
            "schema": {"day": "date", "region": "string", "total": "decimal(18,2)", "n": "int64"},
            "max_rows": 100,
            "max_bytes": "1MiB",
        },
        "target": target,
    }
    return parse_definition(json.dumps(document), "<test>")


def _run(platform: Platform, tmp_path: Path, defn: Definition, key: str, **params: Any) -> Run:
    return platform.runs.run_inline(flows.request(defn, tmp_path, key, params=params)).run


def _delta_rows_independently(table_dir: Path) -> list[dict[str, Any]]:
    """The table's rows read without delta-rs: the log replayed by hand (adds minus removes), each live
    Parquet file read with pyarrow, its partition values taken from its add action."""
    rows: list[dict[str, Any]] = []
    for path, values in flows.delta_live_files(table_dir).items():
        for row in pq.read_table(table_dir / unquote(path)).to_pylist():
            rows.append({**row, **{k: v for k, v in values.items()}})
    return rows


def _day_totals(rows: list[dict[str, Any]]) -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    for row in rows:
        found.setdefault(str(row["day"]), []).append((str(row["region"]), f"{float(row['total']):.2f}"))
    return {day: sorted(values) for day, values in found.items()}


def _sink_rows(kind: str, tmp_path: Path, dsn: str | None) -> dict[str, list[tuple[str, str]]]:
    """The sink's rows per day through independent readers (both for Delta, and they must agree)."""
    if kind == "delta":
        table_dir = tmp_path / "daily"
        by_hand = _day_totals(_delta_rows_independently(table_dir))
        import deltalake

        by_delta_rs = _day_totals(deltalake.DeltaTable(str(table_dir)).to_pyarrow_table().to_pylist())
        assert by_hand == by_delta_rs
        return by_hand
    assert dsn is not None
    with psycopg.connect(dsn) as conn:
        exists = conn.execute("SELECT to_regclass(%s)", (PG_TABLE,)).fetchone()
        if exists is None or exists[0] is None:
            return {}
        rows = conn.execute(f"SELECT day, region, total FROM {PG_TABLE}").fetchall()
    return _day_totals([{"day": d, "region": r, "total": t} for d, r, t in rows])


EXPECTED_1 = [("north", "11.50"), ("south", "4.25")]


def _expected(factor: int) -> list[tuple[str, str]]:
    return [(region, f"{float(total) * factor:.2f}") for region, total in EXPECTED_1]


@pytest.fixture(params=["delta", "postgres"])
def sink(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str | None]:
    """The sink kind and, for PostgreSQL, its DSN (a throwaway database, named by a secret)."""
    if request.param == "delta":
        return "delta", None
    pg_url: str = request.getfixturevalue("pg_url")
    monkeypatch.setenv(SINK_SECRET, pg_url)
    return "postgres", pg_url.replace("postgresql+psycopg://", "postgresql://")


def _provider_target(kind: str, provider: str | None = None, **kwargs: Any) -> dict[str, Any]:
    options = {"dsn": {"secret": SINK_SECRET}} if kind == "postgres" else None
    target = _target(kind, options=options, **kwargs)
    if provider is not None:
        target["provider"] = provider
    return target


def test_a_rerun_of_a_day_replaces_it_and_leaves_the_other_days(
    platform: Platform, tmp_path: Path, sink: tuple[str, str | None]
) -> None:
    """Day 1, day 2, then day 1 again under another key with other totals: the sink holds day 1 once,
    with the later run's rows, and day 2 untouched."""
    kind, dsn = sink
    defn = _definition(_provider_target(kind))
    first = _run(platform, tmp_path, defn, "d1-a", day="2024-03-01")
    second = _run(platform, tmp_path, defn, "d2-a", day="2024-03-02")
    again = _run(platform, tmp_path, defn, "d1-b", day="2024-03-01", factor=3)
    assert [r.status for r in (first, second, again)] == ["succeeded"] * 3
    assert _sink_rows(kind, tmp_path, dsn) == {"2024-03-01": _expected(3), "2024-03-02": _expected(1)}
    if kind == "delta":
        import deltalake

        assert deltalake.DeltaTable(str(tmp_path / "daily")).metadata().partition_columns == ["day"]


def test_rows_outside_the_partition_never_leave_the_platform(
    platform: Platform, tmp_path: Path, sink: tuple[str, str | None]
) -> None:
    """One result row of another day: the run fails with no external output before dispatch (no
    dispatch.authorized), the reason names the column and the count, and the sink has no row."""
    kind, dsn = sink
    sql = (
        "select case when region = 'south' then $day::DATE + 1 else $day::DATE end as day, region, "
        "sum(amount)::DECIMAL(18,2) as total, count(*)::BIGINT as n from sales group by region"
    )
    run = _run(platform, tmp_path, _definition(_provider_target(kind), sql=sql), "bad", day="2024-03-01")
    assert (run.status, run.error_code) == ("failed", "partition_violation")
    assert run.error_message is not None
    assert "1 result rows" in run.error_message and "'day'" in run.error_message
    assert "2024-03" not in run.error_message
    assert "dispatch.authorized" not in flows.kinds(platform, run.run_id)
    assert _sink_rows(kind, tmp_path, dsn) == {}


def test_the_later_authorized_run_of_a_partition_wins_an_overlap(
    platform: Platform, tmp_path: Path, sink: tuple[str, str | None]
) -> None:
    """Run A is authorized (partition token 1) and, before it publishes, run B of the same day is
    authorized (token 2) and publishes; A's publish then carries the lower token: Rejected superseded,
    nothing written. The sink holds B's rows once."""
    kind, dsn = sink
    defn = _definition(_provider_target(kind))
    later: list[Run] = []

    def overlap(point: str) -> None:
        if point == crashpoints.AFTER_PREDISPATCH_COMMIT and not later:
            crashpoints.set_hook(None)
            later.append(_run(platform, tmp_path, defn, "day-b", day="2024-03-01", factor=2))

    crashpoints.set_hook(overlap)
    earlier = _run(platform, tmp_path, defn, "day-a", day="2024-03-01")
    assert later[0].status == "succeeded"
    assert (earlier.status, earlier.error_code) == ("failed", "publication_rejected")
    assert earlier.error_message is not None and SUPERSEDED in earlier.error_message
    assert _sink_rows(kind, tmp_path, dsn) == {"2024-03-01": _expected(2)}


def test_a_resume_never_replaces_a_newer_publication_of_its_partition(
    platform: Platform, tmp_path: Path, sink: tuple[str, str | None]
) -> None:
    """Run A is authorized (token 1) but its publish never reaches the sink (outcome_unknown); run B of
    the same day publishes (token 2); reconcile proves A absent and resumes it under A's own token 1:
    refused superseded, and the sink still holds B's rows once."""
    kind, dsn = sink
    inner = DeltaProvider() if kind == "delta" else PostgresTableProvider()
    faulty = FaultInjectingProvider(inner, "fail_before_send", fail_times=1)
    registry.register_provider("faulty", lambda: faulty)
    defn = _definition(_provider_target(kind, "faulty"))  # its first publish call fails, later ones pass
    earlier = _run(platform, tmp_path, defn, "day-a", day="2024-03-01")
    assert earlier.status == "outcome_unknown"
    later = _run(platform, tmp_path, defn, "day-b", day="2024-03-01", factor=2)
    assert later.status == "succeeded", (later.error_code, later.error_message)
    resumed = flows.reconcile_as_operator(platform, earlier.run_id, resume=True)
    assert resumed.resumed
    assert (resumed.run.status, resumed.run.error_code) == ("failed", "publication_rejected")
    assert resumed.run.error_message is not None and SUPERSEDED in resumed.run.error_message
    assert _sink_rows(kind, tmp_path, dsn) == {"2024-03-01": _expected(2)}


INJECTION = "x' OR '1'='1"


def test_a_string_partition_value_cannot_inject(
    platform: Platform, tmp_path: Path, sink: tuple[str, str | None]
) -> None:
    """A region partition whose value is a quote-laden string: it replaces only its own rows (the
    predicate / DELETE compare it as a value), twice, and the other region's rows stay."""
    kind, dsn = sink
    sql = (
        "select DATE '2024-03-01' as day, $region as region, (sum(amount) * $factor)::DECIMAL(18,2) as total, "
        "count(*)::BIGINT as n from sales"
    )
    defn = _definition(_provider_target(kind, column="region"), sql=sql)
    assert _run(platform, tmp_path, defn, "plain", day="2024-03-01", region="plain").status == "succeeded"
    for key, factor in (("inject-1", 1), ("inject-2", 2)):
        run = _run(platform, tmp_path, defn, key, day="2024-03-01", region=INJECTION, factor=factor)
        assert run.status == "succeeded"
    assert _sink_rows(kind, tmp_path, dsn) == {"2024-03-01": sorted([(INJECTION, "31.50"), ("plain", "15.75")])}


@pytest.mark.parametrize("submit", ["run_inline", "submit"])
def test_the_parquet_folder_refuses_replace_partition_before_anything_is_recorded(
    platform: Platform, tmp_path: Path, submit: str
) -> None:
    before = flows.row_counts(platform)
    call: Callable[..., Any] = getattr(platform.runs, submit)
    with pytest.raises(InputError, match="cannot replace a partition atomically"):
        call(flows.request(_definition(_target("parquet")), tmp_path, "k", params={"day": "2024-03-01"}))
    assert flows.row_counts(platform) == before
    assert not (tmp_path / "daily").exists()


@pytest.mark.parametrize("submit", ["run_inline", "submit"])
def test_delta_refuses_a_decimal_partition_column_before_anything_is_recorded(
    platform: Platform, tmp_path: Path, submit: str
) -> None:
    """Proves a partition column kind the Delta predicate cannot compare exactly (a decimal here; a timestamp
    too) is refused at submission, naming the column and the kinds Delta takes, never the value; nothing is
    recorded and the sink is not created (it used to be refused only at publish, after authorization)."""
    target = _target("delta")
    target["partition"] = {"total": "11.5"}
    before = flows.row_counts(platform)
    call: Callable[..., Any] = getattr(platform.runs, submit)
    with pytest.raises(InputError, match=r"cannot replace a partition by a decimal column \('total'\)") as refused:
        call(flows.request(_definition(target), tmp_path, "k", params={"day": "2024-03-01"}))
    assert "11.5" not in str(refused.value) and "bool, date, int, string" in str(refused.value)
    assert flows.row_counts(platform) == before
    assert not (tmp_path / "daily").exists()


def test_a_definition_without_a_partition_keeps_its_hash() -> None:
    assert definition_hash(flows.definition(flows.parquet_target("delta"))) == UNPARTITIONED_DELTA_HASH


def test_the_resolved_partition_is_in_the_authorization(platform: Platform, tmp_path: Path) -> None:
    """dispatch.authorized records the partition token; the run's target records the partition as written."""
    defn = _definition(_target("delta"))
    run = _run(platform, tmp_path, defn, "k", day="2024-03-01")
    assert run.status == "succeeded" and (run.target or {})["partition"] == {"day": "$day"}
    with platform.runs.db.read() as conn:
        assert forward.authorized_partition_token(conn, run) == 1
    second = _run(platform, tmp_path, defn, "k2", day="2024-03-01")
    with platform.runs.db.read() as conn:
        assert forward.authorized_partition_token(conn, second) == 2


def test_the_api_refuses_replace_partition_on_parquet_with_422(platform: Platform, tmp_path: Path) -> None:
    """POST /v1/runs with an inline definition whose Parquet target asks replace_partition: 422
    invalid_input, the reason names the provider, and no run is recorded."""
    from fastapi.testclient import TestClient

    from durable_dataflow.api.app import create_app
    from support.api_runs import make_tokens

    tokens = make_tokens(platform)
    document = json.loads(json.dumps(_definition(_target("parquet")).model_dump(mode="json", by_alias=True)))
    document = {k: v for k, v in document.items() if v is not None and k not in ("limits", "schedule")}
    before = flows.row_counts(platform)
    (tmp_path / "root" / "acme").mkdir(parents=True)
    with TestClient(create_app(platform, data_root=tmp_path / "root")) as client:
        answer = client.post(
            "/v1/runs",
            json={"definition": document, "parameters": {"day": "2024-03-01"}},
            headers={"Authorization": f"Bearer {tokens.submitter}"},
        )
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_input"
    assert "cannot replace a partition atomically" in answer.json()["error"]["message"]
    assert flows.row_counts(platform) == before


def test_the_delta_predicate_quotes_identifiers_and_values() -> None:
    """Quotes are doubled in identifiers and string literals; a date compares as a date; a type the
    provider cannot compare exactly is refused before the sink is touched (never echoing the value)."""
    import datetime as dt
    from decimal import Decimal

    from durable_dataflow.datasources.delta import partition_predicate

    assert partition_predicate({'we"ird': INJECTION, "day": dt.date(2024, 3, 1), "n": 3, "b": True}) == (
        '"we""ird" = \'x\'\' OR \'\'1\'\'=\'\'1\' AND "day" = CAST(\'2024-03-01\' AS DATE) AND "n" = 3 AND "b" = TRUE'
    )
    with pytest.raises(InputError, match="'amount'") as refused:
        partition_predicate({"amount": Decimal("1.50")})
    assert "1.50" not in str(refused.value)


def test_reconcile_by_key_of_a_partition_publication_whose_answer_was_lost(
    platform: Platform, tmp_path: Path, sink: tuple[str, str | None]
) -> None:
    """The sink commits the partition and the answer is lost (outcome_unknown): reconcile by key finds it
    present with the recorded digest (succeeded), the partition holds that run's rows once, and a resume
    is not needed; a later run of the day still replaces it."""
    kind, dsn = sink
    inner = DeltaProvider() if kind == "delta" else PostgresTableProvider()
    faulty = FaultInjectingProvider(inner, "timeout_after_commit", fail_times=1)
    registry.register_provider("faulty", lambda: faulty)
    defn = _definition(_provider_target(kind, "faulty"))
    lost = _run(platform, tmp_path, defn, "lost", day="2024-03-01", factor=2)
    assert lost.status == "outcome_unknown"
    found = flows.reconcile_as_operator(platform, lost.run_id)
    assert (found.finding, found.run.status) == ("present", "succeeded")
    assert _sink_rows(kind, tmp_path, dsn) == {"2024-03-01": _expected(2)}
    assert _run(platform, tmp_path, defn, "next", day="2024-03-01", factor=3).status == "succeeded"
    assert _sink_rows(kind, tmp_path, dsn) == {"2024-03-01": _expected(3)}
    assert faulty.counters.inner_publish_calls == 2


def test_an_existing_table_filled_by_appends_is_replaced_by_partition(
    platform: Platform, tmp_path: Path, sink: tuple[str, str | None]
) -> None:
    """A table an append target created (for Delta: not partitioned) keeps working: a partitioned run of
    a day replaces that day's appended rows through the predicate and leaves the other day's."""
    kind, dsn = sink
    appending = {**_provider_target(kind), "mode": "append"}
    del appending["partition"]
    for day in ("2024-03-01", "2024-03-02"):
        assert _run(platform, tmp_path, _definition(appending), f"append-{day}", day=day).status == "succeeded"
    replaced = _run(platform, tmp_path, _definition(_provider_target(kind)), "replace", day="2024-03-01", factor=4)
    assert replaced.status == "succeeded", replaced.error_message
    assert _sink_rows(kind, tmp_path, dsn) == {"2024-03-01": _expected(4), "2024-03-02": _expected(1)}
    if kind == "delta":
        import deltalake

        assert deltalake.DeltaTable(str(tmp_path / "daily")).metadata().partition_columns == []


def _day_rows(factor: int) -> Any:
    import datetime as dt
    from decimal import Decimal

    import pyarrow as pa

    return pa.table(
        {
            "day": pa.array([dt.date(2024, 3, 1)] * 2, pa.date32()),
            "region": ["north", "south"],
            "total": pa.array([Decimal("11.50") * factor, Decimal("4.25") * factor], pa.decimal128(18, 2)),
            "n": pa.array([2, 1], pa.int64()),
        }
    )


@pytest.mark.parametrize("rounds", [3])
def test_concurrent_publications_of_one_partition_leave_the_higher_tokens_rows(
    tmp_path: Path, sink: tuple[str, str | None], rounds: int
) -> None:
    """Two threads publish the same partition at once under two keys with partition tokens 2k and 2k+1:
    whichever commits first, the partition ends with the higher token's rows, once; the lower token's
    publish is either replaced or refused superseded, never left on top."""
    import threading

    from durable_dataflow.datasources.contract import Published, PublishTarget, Rejected

    kind, dsn = sink
    options: dict[str, Any] = {"base_dir": str(tmp_path)}
    if kind == "postgres":
        options["dsn"] = {"secret": SINK_SECRET}
    location = PG_TABLE if kind == "postgres" else "daily"
    provider = DeltaProvider() if kind == "delta" else PostgresTableProvider()
    base = PublishTarget("analytics.daily_totals", location, "replace_partition", options)
    provider.prepare(base)
    outcomes: dict[int, Any] = {}

    def publish(token: int) -> None:
        import dataclasses

        target = dataclasses.replace(base, partition={"day": "2024-03-01"}, partition_token=token)
        outcomes[token] = provider.publish(f"k-{token}", 1, _day_rows(token), f"d{token}", target)

    # The first publication creates the PostgreSQL table; two concurrent creators can collide there
    # (SQLSTATE 42P07, a conclusive Rejected: see the report of issue 27), so the table exists first.
    publish(1)
    assert isinstance(outcomes[1], Published)
    for round_ in range(1, rounds + 1):
        outcomes.clear()
        low, high = 2 * round_, 2 * round_ + 1
        threads = [threading.Thread(target=publish, args=(t,)) for t in (low, high)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert isinstance(outcomes[high], Published)
        low_outcome = outcomes[low]
        assert isinstance(low_outcome, Published) or (
            isinstance(low_outcome, Rejected) and SUPERSEDED in low_outcome.reason
        )
        assert _sink_rows(kind, tmp_path, dsn) == {"2024-03-01": _expected(high)}


@pytest.mark.parametrize("one_piece", [True, False], ids=["one-piece", "in-pieces"])
def test_a_result_in_pieces_is_stored_before_the_partition_token_is_taken(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_piece: bool
) -> None:
    """The pre-dispatch commit takes the partition's token with a row lock held to its commit, which
    orders the partition's authorizations: a result in pieces (streamed by COPY or blob writes, the
    longest part of the commit) is stored before it, so runs of the same day do not wait through another's
    upload; a result of one piece is stored after it, by the transition's own statement on PostgreSQL.
    Either way the run publishes its rows and its stored bytes are counted once."""
    from durable_dataflow.dataflow.execution import results
    from durable_dataflow.dataflow.schema import run_results, tenant_result_bytes

    if not one_piece:
        monkeypatch.setattr(results, "WRITE_CHUNK_BYTES", 64)
    stored_at_take: list[int] = []
    take = forward.partition_tokens.take

    def spied(conn: Any, *args: Any) -> int:
        stored_at_take.append(conn.execute(sa.select(sa.func.count()).select_from(run_results)).scalar_one())
        return take(conn, *args)

    monkeypatch.setattr(forward.partition_tokens, "take", spied)
    run = _run(platform, tmp_path, _definition(_target("delta")), "d1", day="2024-03-01")
    assert run.status == "succeeded"
    assert stored_at_take == [0 if one_piece else 1]
    assert _sink_rows("delta", tmp_path, None) == {"2024-03-01": _expected(1)}
    with platform.db.read() as conn:
        counted = conn.execute(sa.select(tenant_result_bytes.c.stored_bytes)).scalar_one()
        stored = conn.execute(sa.select(sa.func.length(run_results.c.bytes))).scalar_one()
    assert counted == stored > 64
