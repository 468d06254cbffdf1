"""Quotas per tenant (issue 29 item 1) on SQLite and PostgreSQL: each quota refused past its limit through
the API (429, Retry-After, the quota's name and limit, nothing recorded) and the CLI (exit 10); another
tenant is not limited by the first one's quotas; the quotas file refuses bad values without echoing them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from fastapi.testclient import TestClient

from durable_dataflow.api.app import create_app
from durable_dataflow.cli import main as cli_main
from durable_dataflow.cli.common import EXIT_CODES
from durable_dataflow.core import schema as core_schema
from durable_dataflow.core.errors import InputError, QuotaExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.protocol import derivation, quotas
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import Tokens, make_tokens
from support.interrupts import wait_until

DAY = "2026-03-01"


@dataclass(frozen=True)
class Served:
    platform: Platform
    client: TestClient
    tokens: Tokens

    def submit(self, token: str, day: str = DAY, *, queue: bool = True) -> Any:
        body = {"definition": flows.daily_flow(), "parameters": {"day": day}}
        url = "/v1/runs?queue=true" if queue else "/v1/runs"
        return self.client.post(url, json=body, headers={"Authorization": f"Bearer {token}"})

    def runs_of(self, tenant: str) -> int:
        with self.platform.db.read() as conn:
            query = sa.select(sa.func.count()).select_from(dataflow_runs).where(dataflow_runs.c.tenant == tenant)
            return int(conn.execute(query).scalar_one())


def write_quotas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, acme: dict[str, Any]) -> Path:
    """A quotas file giving tenant acme ``acme``'s limits, named by DATAFLOW_QUOTAS (open the Platform after)."""
    path = tmp_path / "quotas.yaml"
    path.write_text(yaml.safe_dump({"tenants": {"acme": acme}}))
    monkeypatch.setenv(quotas.QUOTAS_ENV, str(path))
    return path


@pytest.fixture
def serve(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    opened: list[tuple[Platform, TestClient]] = []

    def start(acme: dict[str, Any]) -> Served:
        write_quotas(tmp_path, monkeypatch, acme)
        platform = Platform(db_url)
        client = TestClient(create_app(platform, data_root=tmp_path / "tenants"))
        client.__enter__()
        opened.append((platform, client))
        return Served(platform, client, make_tokens(platform))

    yield start
    for platform, client in opened:
        client.__exit__(None, None, None)
        platform.close()


def assert_refused(answer: Any, quota: str, limit: int) -> None:
    assert answer.status_code == 429, answer.text
    assert int(answer.headers["Retry-After"]) >= 1
    error = answer.json()["error"]
    assert (error["code"], error["quota"], error["limit"]) == ("quota_exceeded", quota, limit)
    assert quota in error["message"] and "nothing was recorded" in error["message"]


def test_queued_runs_past_the_quota_answer_429_and_record_nothing(serve: Any) -> None:
    """With acme's queued_runs at 2, a third queued submit answers 429 naming the quota and records no run;
    globex, under the default quota, still queues."""
    served = serve({"queued_runs": 2})
    for day in ("2026-03-01", "2026-03-02"):
        assert served.submit(served.tokens.submitter, day).status_code == 201
    assert_refused(served.submit(served.tokens.submitter, "2026-03-03"), "queued_runs", 2)
    assert served.runs_of("acme") == 2
    assert served.submit(served.tokens.other_operator).status_code == 201


def test_a_replay_past_the_quota_is_still_answered(serve: Any) -> None:
    """A replay records nothing, so a full queue does not refuse it: the same key answers 200 with its run."""
    served = serve({"queued_runs": 1})
    headers = {"Authorization": f"Bearer {served.tokens.submitter}", "Idempotency-Key": "k1"}
    body = {"definition": flows.daily_flow(), "parameters": {"day": DAY}}
    first = served.client.post("/v1/runs?queue=true", json=body, headers=headers)
    again = served.client.post("/v1/runs?queue=true", json=body, headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["run"]["run_id"] == first.json()["run"]["run_id"]


def test_running_runs_past_the_quota_refuse_an_inline_submit(serve: Any) -> None:
    """With acme's running_runs at 1 and one run claimed (running, its lease held), an inline submit
    answers 429 running_runs and records nothing: no run, and no lease (on PostgreSQL the quota's read
    granted one in the same statement; the refusal rolled it back)."""
    served = serve({"running_runs": 1})
    definition = Definition.model_validate(flows.daily_flow())
    request = RunRequest(
        definition=definition, base_dir=Path("."), parameters={"day": DAY},
        access=AccessContext(tenant="acme", principal="test", roles=("operator",), auth_method="test"),
        provenance=Provenance(actor="test", trigger="cli"),
    )  # fmt: skip
    assert served.platform.runs.submit(request, claim=True).run.status == "running"
    assert_refused(served.submit(served.tokens.submitter, "2026-03-02", queue=False), "running_runs", 1)
    assert served.runs_of("acme") == 1
    with served.platform.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(core_schema.leases)).scalar_one() == 1


def test_stored_result_bytes_past_the_quota_refuse_the_next_submit(serve: Any) -> None:
    """With acme's result_bytes at 100 bytes, an inline run stores its result (more than 100 bytes of Arrow
    IPC); the next submit, queued or inline, answers 429 result_bytes and records nothing."""
    served = serve({"result_bytes": "100B"})
    first = served.submit(served.tokens.submitter, queue=False)
    assert first.status_code == 201 and first.json()["run"]["status"] == "succeeded", first.text
    assert_refused(served.submit(served.tokens.submitter, "2026-03-02"), "result_bytes", 100)
    assert_refused(served.submit(served.tokens.submitter, "2026-03-03", queue=False), "result_bytes", 100)
    assert served.runs_of("acme") == 1


def test_a_backfill_wider_than_the_quota_answers_429_before_any_day_is_submitted(serve: Any) -> None:
    """With acme's backfill_days at 3, a 4-day backfill answers 429 backfill_days and records no day's run;
    a 3-day one is accepted."""
    served = serve({"backfill_days": 3})
    headers = {"Authorization": f"Bearer {served.tokens.operator}"}
    wide = {"definition": flows.daily_flow(), "from": "2026-03-01", "to": "2026-03-04"}
    assert_refused(served.client.post("/v1/backfills", json=wide, headers=headers), "backfill_days", 3)
    assert served.runs_of("acme") == 0
    narrow = {**wide, "to": "2026-03-03"}
    assert served.client.post("/v1/backfills", json=narrow, headers=headers).status_code == 201
    assert served.runs_of("acme") == 3


def test_a_backfill_refused_part_way_says_which_days_were_queued(serve: Any) -> None:
    """Proves a backfill that queued_runs refuses part-way does not say "nothing was recorded": with
    acme's queued_runs at 3, a 6-day backfill answers 429 queued_runs naming the 3 days queued and the
    first one not; the same backfill again answers 429 naming no new day (nothing more was queued).
    (Before, the answer ended "nothing was recorded" while three days were queued: red team.)"""
    served = serve({"queued_runs": 3})
    headers = {"Authorization": f"Bearer {served.tokens.operator}"}
    wide = {"definition": flows.daily_flow(), "from": "2026-03-01", "to": "2026-03-06"}
    answer = served.client.post("/v1/backfills", json=wide, headers=headers)
    assert answer.status_code == 429 and int(answer.headers["Retry-After"]) >= 1, answer.text
    message = answer.json()["error"]["message"]
    assert "nothing was recorded" not in message, message
    assert "3 day(s) of this backfill were queued before it (2026-03-01 to 2026-03-03), 2026-03-04" in message
    assert served.runs_of("acme") == 3
    again = served.client.post("/v1/backfills", json=wide, headers=headers)
    assert_refused(again, "queued_runs", 3)
    assert served.runs_of("acme") == 3


def test_the_cli_backfill_refused_part_way_exits_10_naming_the_queued_days(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same through `dataflow backfill`: exit 10, the days queued on stderr, and they stay queued."""
    write_quotas(tmp_path, monkeypatch, {"queued_runs": 2})
    definition = tmp_path / "daily.yaml"
    definition.write_text(flows.DAILY_YAML)
    argv = ["--db", db_url, "backfill", str(definition), "--from", "2026-03-01", "--to", "2026-03-04",
            "--tenant", "acme", "--json"]  # fmt: skip
    assert cli_main(argv) == EXIT_CODES["quota_exceeded"]
    stderr = capsys.readouterr().err
    assert "2 day(s) of this backfill were queued before it (2026-03-01 to 2026-03-02), 2026-03-03" in stderr
    assert "nothing was recorded" not in stderr
    with Platform(db_url) as platform, platform.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dataflow_runs)).scalar_one() == 2


def test_a_backfill_refused_part_way_by_result_bytes_says_its_queued_days_will_not_run(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a backfill refused part-way by result_bytes (a run of the tenant stored a result meanwhile)
    does not advise running it again: its queued days fail quota_exceeded at their claim, and it says so.
    (A first fix said "run the same backfill again", as for queued_runs: review.)"""
    import datetime as dt

    from durable_dataflow.dataflow.execution import workspace
    from durable_dataflow.dataflow.schedules import backfill

    write_quotas(tmp_path, monkeypatch, {"result_bytes": 1})
    definition = Definition.model_validate(flows.daily_flow())
    access = AccessContext.local("acme")
    with Platform(db_url) as platform:
        items = backfill.plan(definition, "acme", dt.date(2026, 3, 1), dt.date(2026, 3, 3), {})

        def meanwhile(result: backfill.BackfillResult) -> None:  # another run of acme stores its result
            if result.item.tick == "2026-03-01":
                platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "stores"))

        with pytest.raises(QuotaExceeded) as refused:
            backfill.run(platform.runs, definition, items, access=access, workspace=workspace.local(tmp_path),
                         provenance=Provenance(actor="operator", trigger="cli"), on_item=meanwhile)  # fmt: skip
        message = refused.value.message
        assert refused.value.quota == "result_bytes" and "nothing was recorded" not in message, message
        assert "1 day(s) of this backfill were queued before it (2026-03-01 to 2026-03-01)" in message
        assert "fail quota_exceeded when a worker claims them" in message and "run the same" not in message


def test_applying_more_schedules_than_the_quota_answers_429(serve: Any) -> None:
    """With acme's applied_schedules at 2, a third schedule name answers 429 applied_schedules and writes no
    schedule; re-applying an existing name (a change) is still accepted."""
    served = serve({"applied_schedules": 2})
    headers = {"Authorization": f"Bearer {served.tokens.operator}"}
    cron = {"cron": "0 * * * *", "parameters": {"day": "{{ tick.date }}"}}

    def apply(name: str, **changes: Any) -> Any:
        document = flows.daily_flow({**cron, **changes}, name=name)
        return served.client.post("/v1/schedules", json={"definition": document}, headers=headers)

    assert apply("first").status_code == 201 and apply("second").status_code == 201
    assert_refused(apply("third"), "applied_schedules", 2)
    listed = served.client.get("/v1/schedules", headers=headers).json()["schedules"]
    assert sorted(s["name"] for s in listed) == ["first", "second"]
    assert apply("second", cron="30 * * * *").status_code in (200, 201)


def test_the_cli_exits_10_past_a_quota(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dataflow submit` of tenant acme with queued_runs at 1, in process through the console script's
    ``main`` (which maps errors to statuses): the second exits 10 (quota_exceeded, its own status in the
    error table), says which quota on stderr, and records nothing."""
    write_quotas(tmp_path, monkeypatch, {"queued_runs": 1})
    definition = tmp_path / "daily.yaml"
    definition.write_text(flows.DAILY_YAML)
    argv = ["--db", db_url, "submit", str(definition), "--tenant", "acme", "-p"]
    assert cli_main([*argv, f"day={DAY}"]) == 0
    capsys.readouterr()
    assert cli_main([*argv, "day=2026-03-02"]) == EXIT_CODES["quota_exceeded"] == 10
    stderr = capsys.readouterr().err
    assert "error [quota_exceeded]" in stderr and "queued_runs" in stderr, stderr
    with Platform(db_url) as platform, platform.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dataflow_runs)).scalar_one() == 1


@pytest.mark.parametrize(
    "document",
    [
        "tenants: {acme: {queued_runs: 0}}",
        "tenants: {acme: {result_bytes: hunter2-secret}}",
        "tenants: {acme: {queued_runs: 'hunter2-secret'}}",
        "tenants: {acme: {hunter2: 1}}",
        "tenants: [hunter2-secret]",
        "tenants: {acme: {queued_runs: 1",
    ],
)
def test_a_bad_quotas_file_is_refused_without_echoing_its_values(
    document: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each bad quotas file is an InputError naming the file's variable and never a value from it."""
    path = tmp_path / "quotas.yaml"
    path.write_text(document)
    with pytest.raises(InputError) as refused:
        quotas.from_env({quotas.QUOTAS_ENV: str(path)})
    assert quotas.QUOTAS_ENV in refused.value.message
    assert "hunter2-secret" not in refused.value.message


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ("tenants:\n  acme: {queued_runs: 1}\n  acme: {queued_runs: 100000}\n", "duplicate key tenants.acme"),
        ("tenants:\n  'acme ': {queued_runs: 1}\n", "should match pattern"),
        ("tenants:\n  'ac/me': {queued_runs: 1}\n", "should match pattern"),
        ("tenants:\n  acme: &loose {queued_runs: 1}\n  globex: *loose\n", "anchors and aliases"),
        ('tenants:\n  "acme\\n": {queued_runs: 1}\n', "tenants.acme\\x0a.[key]: String should match pattern"),
    ],
    ids=["a-tenant-twice", "a-trailing-space", "a-slash", "an-alias", "a-newline-shown-escaped"],
)
def test_a_quotas_file_entry_that_could_never_apply_as_written_is_refused(document: str, problem: str) -> None:
    """Proves a careless quotas file is refused at start-up instead of loading entries that never apply as
    meant: a tenant named twice (PyYAML kept the last entry, perhaps the looser, silently), a name no
    request can carry ("acme " loaded and never matched acme), and anchors (red team)."""
    with pytest.raises(InputError) as refused:
        quotas.parse_quotas_file(document, "quotas.yaml", quotas.TenantQuotas())
    assert problem in refused.value.message and "quotas.yaml" in refused.value.message, refused.value.message


def test_the_defaults_come_from_the_environment_and_overrides_keep_them() -> None:
    """DATAFLOW_QUOTA_* sets each default; a tenant's override replaces only the quotas it names."""
    environ = {
        "DATAFLOW_QUOTA_QUEUED_RUNS": "7",
        "DATAFLOW_QUOTA_RESULT_BYTES": "2MiB",
        "DATAFLOW_INLINE_EXECUTIONS_MAX": "3",
    }
    configured = quotas.from_env(environ)
    assert (configured.defaults.queued_runs, configured.defaults.result_bytes) == (7, 2 * 1024 * 1024)
    assert configured.inline_executions_max == 3
    overridden = quotas.parse_quotas_file("tenants: {acme: {running_runs: 5}}", "test", configured.defaults)
    assert (overridden["acme"].running_runs, overridden["acme"].queued_runs) == (5, 7)
    with pytest.raises(InputError, match="DATAFLOW_QUOTA_QUEUED_RUNS"):
        quotas.from_env({"DATAFLOW_QUOTA_QUEUED_RUNS": "many"})


def test_deployment_md_documents_every_quota_with_its_default() -> None:
    """docs/deployment.md's Quotas section names every quota, its variable and its default, and the
    platform-wide inline setting; docs/api.md names every quota a 429 can carry."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    section = (docs / "deployment.md").read_text().split("## Quotas", 1)[1].split("\n## ", 1)[0]
    api = (docs / "api.md").read_text()
    for setting in quotas.SETTINGS:
        assert not setting.is_size or setting.default == 100 * 1024**3  # the one size quota, shown as 100GiB
        default = "`100GiB`" if setting.is_size else str(setting.default)
        row = f"| `{setting.quota.value}` | `{setting.variable}` | {default} |"
        assert row in section, setting.quota
        assert f"| `{setting.quota.value}` |" in api, setting.quota
    assert f"`{quotas.INLINE_EXECUTIONS_MAX_ENV}` | {quotas.INLINE_EXECUTIONS_MAX_DEFAULT} |" in section
    assert "`inline_executions_max`" in api


def _stored_bytes_by_tenant(platform: Platform) -> tuple[dict[str, int], dict[str, int]]:
    """(the counter's rows, the sums of the stored results' sizes by the runs' tenants)."""
    from durable_dataflow.dataflow.schema import run_results, tenant_result_bytes

    with platform.db.read() as conn:
        counted = {row.tenant: int(row.stored_bytes) for row in conn.execute(sa.select(tenant_result_bytes))}
        summed = sa.select(dataflow_runs.c.tenant, sa.func.sum(sa.func.length(run_results.c.bytes)))
        joined = summed.join_from(run_results, dataflow_runs, dataflow_runs.c.run_id == run_results.c.run_id)
        sums = {tenant: int(total) for tenant, total in conn.execute(joined.group_by(dataflow_runs.c.tenant))}
    return counted, sums


@pytest.mark.parametrize("one_piece", [True, False], ids=["one-piece", "in-pieces"])
def test_the_stored_bytes_counter_is_each_tenants_sum_of_its_stored_results(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_piece: bool
) -> None:
    """Proves the result_bytes quota's counter (tenant_result_bytes, kept by results.store in the storing
    transaction) equals, per tenant, the sum of the sizes of the results its runs stored: atomic runs (the
    terminal commit) and a forward run (the pre-dispatch commit), one tenant's results never counted for
    another, and a replay adds nothing. Both ways a transition stores: a result of one piece (on PostgreSQL
    stored and counted by the transition's own statement) and one in pieces (its own statements: COPY or
    blob writes, then the count; for a replace_partition run before its partition token is taken,
    ``stored_ahead``), each run's stored bytes verifying."""
    from durable_dataflow.dataflow.execution import results

    if not one_piece:
        monkeypatch.setattr(results, "WRITE_CHUNK_BYTES", 64)  # every result here is larger
    with Platform(db_url) as platform:
        ran = [
            platform.runs.run_inline(flows.request(flows.definition(), tmp_path, key, params=params or None)).run
            for key, params in (("a1", {}), ("a2", {"factor": 3}))
        ]
        ran.append(flows.forward(platform, tmp_path, "parquet", "a3"))
        partitioned = flows.daily_partition_definition("analytics.daily", "delta")  # stored before its token
        day = {"day": "2026-03-01"}
        ran.append(platform.runs.run_inline(flows.request(partitioned, tmp_path, "a4", params=day)).run)
        ran.append(platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "g1", tenant="globex")).run)
        platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "a1"))  # a replay: nothing stored
        counted, sums = _stored_bytes_by_tenant(platform)
        verified = [(run.status, flows.verify(platform, run.run_id).ok) for run in ran]
    assert verified == [("succeeded", True)] * 5
    assert counted == sums and set(counted) == {"acme", "globex"} and counted["acme"] > counted["globex"] > 0


def test_concurrent_storing_commits_of_one_tenant_are_all_counted(db_url: str) -> None:
    """Proves the counter's upsert loses no concurrent addition: 8 threads each store a result of the same
    tenant in a transaction of their own, released together; the counter is the sum of all 8 sizes."""
    import threading

    from durable_dataflow.dataflow.execution import results

    sizes = [1000 + i for i in range(8)]
    start = threading.Barrier(len(sizes))
    failures: list[BaseException] = []
    with Platform(db_url) as platform:

        def store(i: int) -> None:
            try:
                start.wait()
                with platform.db.begin() as conn:
                    size = results.store(conn, f"r{i}", 1, flows.StoredResult(memoryview(b"x" * sizes[i])))
                    results.count_stored(conn, "acme", size)
            except BaseException as error:  # reported by the assertion below
                failures.append(error)

        threads = [threading.Thread(target=store, args=(i,)) for i in range(len(sizes))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        counted, _ = _stored_bytes_by_tenant(platform)
    assert not failures and counted == {"acme": sum(sizes)}


@pytest.mark.parametrize("one_piece", [True, False], ids=["one-piece", "in-pieces"])
def test_concurrent_inline_runs_of_one_tenant_are_all_counted(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_piece: bool
) -> None:
    """Proves the counter stays the sum of the stored results when one tenant's terminal commits race:
    4 threads each run 3 inline runs (on PostgreSQL a result of one piece is stored and counted by the
    terminal's one statement, whose upsert must not lose a concurrent addition; in pieces by their own
    statements)."""
    import threading

    from durable_dataflow.dataflow.execution import results

    if not one_piece:
        monkeypatch.setattr(results, "WRITE_CHUNK_BYTES", 64)
    start = threading.Barrier(4)
    failures: list[BaseException] = []
    with Platform(db_url) as platform:

        def work(i: int) -> None:
            try:
                start.wait()
                for j in range(3):
                    request = flows.request(flows.definition(), tmp_path, f"k{i}-{j}", params={"factor": i * 3 + j + 1})
                    assert platform.runs.run_inline(request).run.status == "succeeded"
            except BaseException as error:  # reported by the assertion below
                failures.append(error)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        counted, sums = _stored_bytes_by_tenant(platform)
    assert not failures, failures
    assert counted == sums and counted["acme"] > 0


def test_a_lease_already_there_is_refused_after_the_quotas_on_both_databases(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An inline submit whose run's lease already exists (the id pinned to one whose lease another holder
    took): past a quota it is refused by the quota, else LeaseUnavailable, on both databases; nothing is
    recorded either way. On PostgreSQL the quota read that grants the lease then returns no row, and the
    quotas are read again and checked before the grant is refused (SQLite's order)."""
    from durable_dataflow.core import leases
    from durable_dataflow.core.errors import LeaseUnavailable
    from durable_dataflow.dataflow.protocol import runs, submit

    taken = "01a2505a-41b8-75e5-83bd-bc03b366dd00"
    with Platform(db_url) as platform:
        with platform.db.begin() as conn:
            leases.acquire(conn, platform.db, runs.MODULE, taken, "another-holder", 30)
        monkeypatch.setattr(submit.runs, "new_run_id", lambda: taken)
        with pytest.raises(LeaseUnavailable):
            platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "free"))
        monkeypatch.setattr(quotas.Quotas, "of", lambda _self, _tenant: quotas.TenantQuotas(running_runs=0))
        with pytest.raises(QuotaExceeded) as refused:
            platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "full"))
        assert refused.value.quota == "running_runs"
        with platform.db.read() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(dataflow_runs)).scalar_one() == 0
            lease_rows = conn.execute(sa.select(core_schema.leases.c.holder)).all()
    assert [row.holder for row in lease_rows] == ["another-holder"]


@pytest.mark.parametrize("inline", [False, True])
def test_a_quota_at_its_largest_value_counts_on_both_databases(serve: Any, inline: bool) -> None:
    """Proves the largest quota the parser accepts (QUOTA_VALUE_MAX, the natural "off" switch) is counted
    against, not sent as a 32-bit parameter: PostgreSQL refused LIMIT 2**62::INTEGER and the submit failed
    with a storage error (a 500) instead of being recorded."""
    served = serve({"queued_runs": quotas.QUOTA_VALUE_MAX, "running_runs": quotas.QUOTA_VALUE_MAX,
                    "result_bytes": quotas.QUOTA_VALUE_MAX})  # fmt: skip
    answer = served.submit(served.tokens.submitter, queue=not inline)
    assert answer.status_code == 201, answer.text
    assert served.runs_of("acme") == 1


@pytest.mark.parametrize("forward", [False, True])
def test_the_counter_is_the_last_statement_of_the_storing_commit(db_url: str, tmp_path: Path, forward: bool) -> None:
    """Proves the counter's upsert is the last statement before the commit that stores a result (atomic
    terminal, forward pre-dispatch): on PostgreSQL it holds the tenant's counter row until that commit, so
    the tenant's other storing commits wait for it only that long (before, it ran first and held the row
    through the ledger append, the checkpoint's verification and the projection). On PostgreSQL a result of
    one piece is stored and counted by the transition's own statement (its last CTEs); that statement is
    then the last."""
    events: list[str] = []
    with Platform(db_url) as platform:
        sa.event.listen(platform.db.engine, "before_cursor_execute",
                        lambda _c, _cur, statement, *_: events.append(statement))  # fmt: skip
        sa.event.listen(platform.db.engine, "commit", lambda _c: events.append("COMMIT"))
        if forward:
            assert flows.forward(platform, tmp_path, "parquet", "f1").status == "succeeded"
        else:
            platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "a1"))
    upserts = [i for i, sql in enumerate(events) if "INSERT INTO TENANT_RESULT_BYTES" in sql.upper()]
    assert len(upserts) == 1, events
    assert events[upserts[0] + 1] == "COMMIT", events[upserts[0] - 3 : upserts[0] + 3]


def test_db_recount_rebuilds_the_counter_after_results_were_deleted_by_hand(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Proves `dataflow db recount` rebuilds the result_bytes counter from the stored results: with acme's
    result_bytes quota reached, an operator deletes a stored result by hand; the counter still counts it
    (nothing else deletes results, so nothing else lowers it) until the recount, after which the counter
    equals each tenant's sum again and acme's next submit is recorded."""
    from durable_dataflow.dataflow.schema import run_results

    with Platform(db_url) as platform:
        first = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "a1")).run
        platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "g1", tenant="globex"))
        counted, _ = _stored_bytes_by_tenant(platform)
    write_quotas(tmp_path, monkeypatch, {"result_bytes": counted["acme"]})
    with Platform(db_url) as platform:
        with pytest.raises(QuotaExceeded):
            platform.runs.submit(flows.request(flows.definition(), tmp_path, "a2"))
        with platform.db.begin() as conn:
            conn.execute(sa.delete(run_results).where(run_results.c.run_id == first.run_id))
        with pytest.raises(QuotaExceeded):  # the counter does not know of the deletion
            platform.runs.submit(flows.request(flows.definition(), tmp_path, "a2"))
    capsys.readouterr()
    assert cli_main(["--db", db_url, "db", "recount"]) == 0
    assert "recounted for 1 tenant(s)" in capsys.readouterr().out
    with Platform(db_url) as platform:
        counted, sums = _stored_bytes_by_tenant(platform)
        assert counted == sums == {"globex": sums["globex"]}
        assert platform.runs.submit(flows.request(flows.definition(), tmp_path, "a2")).created



WAIT_S = 30.0


def _a_recount_waits(platform: Platform) -> bool:
    """Another session's statement on the counter's table waits for a lock (the recount's)."""
    waiting = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                      "AND wait_event_type = 'Lock' AND query ILIKE '%tenant_result_bytes%'")  # fmt: skip
    with platform.db.read() as conn:
        return int(conn.execute(waiting).scalar_one()) > 0


def test_db_recount_beside_a_storing_commit_counts_every_result(
    pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Proves `dataflow db recount` may run while a worker stores a result (PostgreSQL, where they run at
    once): acme's counter row is gone (deleted by hand, or never written by a pre-0017 process) and a run
    of acme holds its storing commit open, its result stored and counted but not committed. The recount
    waits for that commit, then counts both results. (Before, its INSERT of acme's sum met the run's
    uncommitted counter row, waited for it, then failed on the primary key: the recount failed.)"""
    from durable_dataflow.dataflow.schema import tenant_result_bytes

    with Platform(pg_url) as platform:
        platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "a1"))
        with platform.db.begin() as conn:
            conn.execute(sa.delete(tenant_result_bytes))
        counted: list[str] = []
        held, release = threading.Event(), threading.Event()

        def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if threading.current_thread().name == "storing" and "INSERT INTO TENANT_RESULT_BYTES" in statement.upper():
                counted.append(statement)

        def hold(_conn: Any) -> None:  # the storing commit: after the counter's upsert, before COMMIT
            if counted and not held.is_set():
                held.set()
                release.wait(WAIT_S)

        sa.event.listen(platform.db.engine, "before_cursor_execute", note)
        sa.event.listen(platform.db.engine, "commit", hold)
        stored: list[Any] = []
        storing = threading.Thread(name="storing", daemon=True, target=lambda: stored.append(
            platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "a2")).run))  # fmt: skip
        storing.start()
        assert held.wait(WAIT_S), "the run never reached its storing commit"

        code: list[int] = []
        recounting = threading.Thread(target=lambda: code.append(cli_main(["--db", pg_url, "db", "recount"])),
                                      daemon=True)  # fmt: skip
        try:
            recounting.start()
            wait_until(lambda: _a_recount_waits(platform) or not recounting.is_alive(), WAIT_S,
                       "the recount to wait for the storing commit")  # fmt: skip
            assert recounting.is_alive(), f"the recount never waited: {code}"
        finally:
            release.set()
            storing.join(WAIT_S)
            recounting.join(WAIT_S)
        assert stored and stored[0].status == "succeeded"
        assert code == [0], capsys.readouterr()
        assert "recounted for 1 tenant(s)" in capsys.readouterr().out
        counted_bytes, sums = _stored_bytes_by_tenant(platform)
        assert counted_bytes == sums and len(sums) == 1


def test_a_queued_run_claimed_after_its_tenant_reached_result_bytes_is_not_executed(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves result_bytes bounds what queued runs store, not only what submits find: with acme's quota
    at 1 byte, three runs queued while acme had stored nothing are all accepted; the first one claimed
    stores its result, and the two claimed after it fail quota_exceeded (no_external_output, nothing
    executed or stored), while globex's run still succeeds. (Before, every run queued under the quota
    stored up to its output.max_bytes past it: 8 runs queued under a 1 MiB quota stored 7 MiB; red team.)"""
    write_quotas(tmp_path, monkeypatch, {"result_bytes": 1})
    with Platform(db_url) as platform:
        queued = [platform.runs.submit(flows.request(flows.definition(), tmp_path, f"a{i}")).run for i in range(3)]
        platform.runs.submit(flows.request(flows.definition(), tmp_path, "g1", tenant="globex"))
        ended = []
        while (claim := platform.runs.claim_next()) is not None:
            ended.append(platform.runs.execute(claim))
        by_id = {run.run_id: run for run in ended}
        acme = [by_id[run.run_id] for run in queued]
        assert [(r.status, r.error_code) for r in acme] == [
            ("succeeded", None), ("failed", "quota_exceeded"), ("failed", "quota_exceeded")
        ]
        for refused in acme[1:]:
            assert refused.recovery_status == "no_external_output"
            assert refused.error_message is not None and "result_bytes" in refused.error_message
            assert "not executed" in refused.error_message and "nothing was recorded" not in refused.error_message
            assert platform.runs.get(refused.run_id).row_count is None
        assert [r.status for r in ended if r.tenant == "globex"] == ["succeeded"]
        counted, sums = _stored_bytes_by_tenant(platform)
        assert counted == sums and set(sums) == {"acme", "globex"}
        with platform.db.read() as conn:  # the failure is evidence like any other: the chain verifies
            assert all(derivation.verify_run(conn, platform.runs.get(r.run_id), None).ok for r in acme)
