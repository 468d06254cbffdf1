"""The remote CLI's schedules, backfills, partitions and results (issue 33 item 5): `dataflow --api URL
schedules list|apply|pause|resume`, `backfill [cancel]`, `partitions` and `result` against a real HTTP server
(uvicorn in a thread, over a socket, as tests/integration/test_cli_remote.py serves it), each compared with
the local command on the same database: the same output and exit status. A viewer token cannot apply or
pause (the API's 403 exits 1 as a permission error does), another tenant's schedule, datasource and run
are not found (exit 4), and the options that have no meaning over the API exit 2.

SQLite only but for `result`, whose bytes are read in pieces differently on each engine (SQLite's blob I/O,
PostgreSQL's substring): it runs on both.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from test_cli_remote import Said, Served, dataflow, remote_dataflow, serving

from durable_dataflow.api import tokens, v1
from durable_dataflow.dataflow.execution import results
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import make_atomic_run, make_queued_run

SCHEDULE = """\
schedule:
  cron: "30 2 * * *"
  timezone: Europe/Berlin
  parameters: {day: "{{ tick.date - 1 day }}"}
  overlap: allow
  catchup_window: 7d
"""
DATASOURCE = "analytics.daily_totals"
RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
SHORT_ID = re.compile(r"\b[0-9a-f]{12}\b")
BOX_DRAWING = re.compile(r"[\u2500-\u257f]")
UNKNOWN_RUN = "01a00000-0000-7000-8000-000000000000"


@pytest.fixture
def served(sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with serving(sqlite_url, tmp_path, monkeypatch, ("acme", "globex")) as found:
        yield found


def token_of(served: Served, tenant: str, role: str) -> str:
    return tokens.create_token(served.platform.db, tenant, role, f"{tenant}-{role}-more")[0]


def local(served: Served, capsys: pytest.CaptureFixture[str], *args: str) -> Said:
    return dataflow(capsys, "--db", served.db_url, *args)


def over_api(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str, token: str = ""
) -> Said:
    return remote_dataflow(served, capsys, monkeypatch, *args, token=token)


def normalized(served: Served, text: str) -> str:
    """``text`` with what differs between a local command for tenant globex and the same command over the API
    for acme taken out: run ids, tenants, the pasteable option (--db URL or --api URL) and, as widths follow
    the cells, table borders and runs of spaces."""
    text = text.replace(f"--api {served.url} ", "").replace(f"--db {served.db_url} ", "")
    text = SHORT_ID.sub("ID", RUN_ID.sub("RUN", text)).replace("globex", "TENANT").replace("acme", "TENANT")
    return "\n".join(" ".join(BOX_DRAWING.sub(" ", line).split()) for line in text.splitlines())


def without_hint(served: Served, text: str) -> str:
    return text.replace(f"--api {served.url} ", "").replace(f"--db {served.db_url} ", "")


def make_unresolved(platform: Platform, run_id: str) -> None:
    """The projection of a run whose publication may exist (what a sweeper writes after a lost dispatch)."""
    with platform.db.begin() as conn:
        conn.execute(
            sa.text("UPDATE dataflow_runs SET status='outcome_unknown', recovery_status='outcome_unknown', "
                    "warning='the publication may exist' WHERE run_id=:r"),
            {"r": run_id},
        )  # fmt: skip


def write(tmp_path: Path, text: str, name: str = "daily.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---- schedules -----------------------------------------------------------------------------------------


def test_schedules_apply_list_pause_and_resume_print_as_locally(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`schedules apply FILE` over --api sends the file and prints what the local apply prints (for another
    tenant: its tenant only differs), `--json` too; applying again is "unchanged" both ways; `list` (human,
    with an UNRESOLVED last run and its warning block, and --json) equals the local list of the tenant;
    `pause` and `resume` print and exit as locally."""
    flow = write(tmp_path, flows.DAILY_YAML + SCHEDULE)
    applied = over_api(served, capsys, monkeypatch, "schedules", "apply", str(flow))
    local_applied = local(served, capsys, "schedules", "apply", str(flow), "--tenant", "globex")
    assert applied.code == local_applied.code == 0, applied.output
    assert applied.stdout.startswith("schedule acme/daily applied (30 2 * * *, Europe/Berlin, sha256:")
    assert applied.stdout.replace("acme", "globex") == local_applied.stdout
    again = over_api(served, capsys, monkeypatch, "schedules", "apply", str(flow), "--json")
    local_again = local(served, capsys, "schedules", "apply", str(flow), "--tenant", "globex", "--json")
    assert again.code == local_again.code == 0
    api_doc, local_doc = json.loads(again.stdout), json.loads(local_again.stdout)
    assert (api_doc["created"], api_doc["changed"]) == (local_doc["created"], local_doc["changed"]) == (False, False)
    assert api_doc["schedule"]["applied_by"] == "token:acme-operator"
    differing = ("tenant", "applied_by", "applied_at")
    assert {k: v for k, v in api_doc["schedule"].items() if k not in differing} == {
        k: v for k, v in local_doc["schedule"].items() if k not in differing
    }

    at = schedules.parse_now(api_doc["schedule"]["applied_at"])
    assert at is not None
    decided = schedules.evaluate(served.platform.db, served.platform.runs, at + dt.timedelta(days=2), tenant="acme")
    make_unresolved(served.platform, decided.decisions[-1].run_id or "")
    for args in (("schedules", "list"), ("schedules", "list", "--json")):
        listed = over_api(served, capsys, monkeypatch, *args)
        local_listed = local(served, capsys, *args, "--tenant", "acme")
        assert listed.code == local_listed.code == 0, listed.output
        assert without_hint(served, listed.stdout) == without_hint(served, local_listed.stdout)
    assert "UNRESOLVED" in listed.stdout or json.loads(listed.stdout)[0]["unresolved"]
    human = over_api(served, capsys, monkeypatch, "schedules", "list")
    assert "UNRESOLVED" in human.stdout and f"dataflow --api {served.url} reconcile" in human.stdout

    for action, state in (("pause", "paused"), ("pause", "paused"), ("resume", "active")):
        said = over_api(served, capsys, monkeypatch, "schedules", action, "daily")
        assert said.code == 0 and said.stdout == f"schedule acme/daily {state}\n", said.output
        local_said = local(served, capsys, "schedules", action, "daily", "--tenant", "acme", "--json")
        api_json = over_api(served, capsys, monkeypatch, "schedules", action, "daily", "--json")
        assert json.loads(api_json.stdout) == json.loads(local_said.stdout)


def test_schedules_list_pages_over_the_api_as_locally(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With more schedules than --limit, the hint names the next page (`--after acme/NAME`) as locally, and
    `--after` over --api gives the next page."""
    for name in ("alpha", "beta", "gamma"):
        flow = write(tmp_path, flows.DAILY_YAML.replace("name: daily", f"name: {name}") + SCHEDULE, f"{name}.yaml")
        assert over_api(served, capsys, monkeypatch, "schedules", "apply", str(flow)).code == 0
    first = over_api(served, capsys, monkeypatch, "schedules", "list", "--limit", "2", "--json")
    local_first = local(served, capsys, "schedules", "list", "--tenant", "acme", "--limit", "2", "--json")
    assert (first.stdout, first.stderr) == (local_first.stdout, local_first.stderr)
    assert "--after acme/beta" in first.stderr
    rest = over_api(served, capsys, monkeypatch, "schedules", "list", "--after", "acme/beta")
    local_rest = local(served, capsys, "schedules", "list", "--tenant", "acme", "--after", "acme/beta")
    assert rest.code == local_rest.code == 0 and rest.stdout == local_rest.stdout and "acme/gamma" in rest.stdout
    bad = over_api(served, capsys, monkeypatch, "schedules", "list", "--limit", "0")
    assert bad.code == 2 and "page size" in bad.stderr


def test_schedules_refusals_over_the_api(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A viewer token (and a platform token) cannot apply or pause: the API's 403 exits 1 as
    `error [permission_denied]`, and nothing is applied; another tenant's schedule is not found (exit 4, as
    locally for a name the tenant has none of); `tick`, --tenant and --now exit 2 naming why; a definition
    that does not parse exits 2 with the local message before anything is sent."""
    flow = write(tmp_path, flows.DAILY_YAML + SCHEDULE)
    viewer = token_of(served, "acme", "viewer")
    for token in (viewer, served.platform_token):
        refused = over_api(served, capsys, monkeypatch, "schedules", "apply", str(flow), token=token)
        assert refused.code == 1 and refused.stderr.startswith("error [permission_denied]:"), refused.output
    assert over_api(served, capsys, monkeypatch, "schedules", "list", "--json").stdout == "[]\n"
    assert over_api(served, capsys, monkeypatch, "schedules", "apply", str(flow)).code == 0
    paused_by_viewer = over_api(served, capsys, monkeypatch, "schedules", "pause", "daily", token=viewer)
    assert paused_by_viewer.code == 1 and paused_by_viewer.stderr.startswith("error [permission_denied]:")
    assert json.loads(over_api(served, capsys, monkeypatch, "schedules", "list", "--json").stdout)[0]["paused"] is False

    globex = token_of(served, "globex", "operator")
    theirs = over_api(served, capsys, monkeypatch, "schedules", "pause", "daily", token=globex)
    local_missing = local(served, capsys, "schedules", "pause", "daily", "--tenant", "globex")
    assert theirs.code == local_missing.code == 4 and theirs.stderr.startswith("error [not_found]:"), theirs.output
    assert over_api(served, capsys, monkeypatch, "schedules", "list", "--json", token=globex).stdout == "[]\n"

    tick = over_api(served, capsys, monkeypatch, "schedules", "tick")
    assert tick.code == 2 and "schedules tick is not available over --api" in tick.stderr
    for args in (("apply", str(flow), "--tenant", "acme"), ("pause", "daily", "--now", "2026-03-01T00:00:00Z"),
                 ("list", "--tenant", "acme")):  # fmt: skip
        said = over_api(served, capsys, monkeypatch, "schedules", *args)
        assert said.code == 2 and "not apply under --api" in said.stderr, said.output
    broken = write(tmp_path, flows.DAILY_YAML + SCHEDULE + "  cron: twice\n", "broken.yaml")
    api_broken = over_api(served, capsys, monkeypatch, "schedules", "apply", str(broken))
    local_broken = local(served, capsys, "schedules", "apply", str(broken))
    assert api_broken.code == local_broken.code == 2 and api_broken.stderr == local_broken.stderr


# ---- backfills -----------------------------------------------------------------------------------------


def test_backfill_and_its_cancel_print_and_exit_as_locally(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A backfill over --api (acme) and the same backfill locally (globex) print the same table and totals,
    the same --json (but run ids and keys), and run again report every day as existing; an unresolved day
    makes both exit 3 with its warning block; `backfill cancel` cancels the queued days, refuses the
    unresolved one (exit 5) as locally; a viewer's backfill is refused 403 (exit 1) and a bad day exits 2
    with the local message before anything is sent."""
    flow = write(tmp_path, flows.DAILY_YAML)
    days = ("--from", "2026-03-01", "--to", "2026-03-03")
    first = over_api(served, capsys, monkeypatch, "backfill", str(flow), *days)
    local_first = local(served, capsys, "backfill", str(flow), *days, "--tenant", "globex")
    assert first.code == local_first.code == 0, first.output
    assert normalized(served, first.stdout) == normalized(served, local_first.stdout)
    assert "3 run(s) submitted, 0 existed already" in first.stdout
    again = over_api(served, capsys, monkeypatch, "backfill", str(flow), *days, "--json")
    local_again = local(served, capsys, "backfill", str(flow), *days, "--tenant", "globex", "--json")
    api_days, local_days = json.loads(again.stdout), json.loads(local_again.stdout)
    keyed = ("run_id", "idempotency_key")
    assert [{k: v for k, v in d.items() if k not in keyed} for d in api_days] == [
        {k: v for k, v in d.items() if k not in keyed} for d in local_days
    ]
    assert [d["created"] for d in api_days] == [False] * 3
    assert api_days[0]["idempotency_key"] == "backfill:acme:daily:2026-03-01"

    make_unresolved(served.platform, api_days[1]["run_id"])
    make_unresolved(served.platform, local_days[1]["run_id"])
    unresolved = over_api(served, capsys, monkeypatch, "backfill", str(flow), *days)
    local_unresolved = local(served, capsys, "backfill", str(flow), *days, "--tenant", "globex")
    assert unresolved.code == local_unresolved.code == 3, unresolved.output
    assert normalized(served, unresolved.stdout) == normalized(served, local_unresolved.stdout)
    assert "UNRESOLVED" in unresolved.stdout and f"dataflow --api {served.url} reconcile" in unresolved.stdout

    window = ("--from", "2026-03-01", "--to", "2026-03-04")
    cancelled = over_api(served, capsys, monkeypatch, "backfill", "cancel", str(flow), *window)
    local_cancelled = local(served, capsys, "backfill", "cancel", str(flow), *window, "--tenant", "globex")
    assert cancelled.code == local_cancelled.code == 5, cancelled.output
    assert normalized(served, cancelled.stdout) == normalized(served, local_cancelled.stdout)
    assert "2 cancelled, 1 refused, 1 no_run" in cancelled.stdout
    again_json = over_api(served, capsys, monkeypatch, "backfill", "cancel", str(flow), *window, "--json")
    local_json = local(served, capsys, "backfill", "cancel", str(flow), *window, "--tenant", "globex", "--json")
    assert again_json.code == local_json.code == 5
    assert [(d["outcome"], d["status"]) for d in json.loads(again_json.stdout)] == [
        (d["outcome"], d["status"]) for d in json.loads(local_json.stdout)
    ] == [("already_cancelled", "cancelled"), ("refused", "outcome_unknown"), ("already_cancelled", "cancelled"),
          ("no_run", None)]  # fmt: skip

    viewer = token_of(served, "acme", "viewer")
    refused = over_api(served, capsys, monkeypatch, "backfill", str(flow), "--from", "2026-04-01", "--to",
                       "2026-04-01", token=viewer)  # fmt: skip
    assert refused.code == 1 and refused.stderr.startswith("error [permission_denied]:"), refused.output
    bad = ("--from", "2026-02-30", "--to", "2026-03-01")
    api_bad = over_api(served, capsys, monkeypatch, "backfill", str(flow), *bad)
    local_bad = local(served, capsys, "backfill", str(flow), *bad)
    assert api_bad.code == local_bad.code == 2 and api_bad.stderr == local_bad.stderr
    with served.platform.db.read() as conn:
        assert int(conn.execute(sa.text("SELECT count(*) FROM dataflow_runs")).scalar_one()) == 6
    tenant = over_api(served, capsys, monkeypatch, "backfill", str(flow), *days, "--tenant", "acme")
    assert tenant.code == 2 and "--tenant does not apply under --api" in tenant.stderr


# ---- partitions ----------------------------------------------------------------------------------------


def _partition_run(served: Served, tmp_path: Path, tenant: str, key: str, day: str, *, queued: bool = False) -> str:
    request = flows.request(flows.daily_partition_definition(DATASOURCE, "delta"), tmp_path / tenant, key,
                            tenant=tenant, params={"day": day})  # fmt: skip
    if queued:
        return served.platform.runs.submit(request).run.run_id
    run = served.platform.runs.run_inline(request).run
    assert run.status == "succeeded", run.error_message
    return run.run_id


def test_partitions_print_and_exit_as_locally(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`partitions DATASOURCE --from --to` over --api prints the local table, summary and --json for the
    tenant; a run after a publication that is unresolved makes both exit 3 with its warning; another tenant
    (which has no partitioned run of it) is not found, exit 4, as locally."""
    _partition_run(served, tmp_path, "acme", "d1", "2024-03-01")
    _partition_run(served, tmp_path, "acme", "d3", "2024-03-03")
    _partition_run(served, tmp_path, "acme", "d3-again", "2024-03-03", queued=True)
    bounds = ("--from", "2024-03-01", "--to", "2024-03-04")
    for extra in ((), ("--json",)):
        said = over_api(served, capsys, monkeypatch, "partitions", DATASOURCE, *bounds, *extra)
        local_said = local(served, capsys, "partitions", DATASOURCE, *bounds, "--tenant", "acme", *extra)
        assert said.code == local_said.code == 0, said.output
        assert said.stdout == local_said.stdout
    assert "4 partition(s): 2 published, 2 missing, 0 unresolved run(s)" in said.stdout or json.loads(said.stdout)

    unknown = _partition_run(served, tmp_path, "acme", "d1-again", "2024-03-01", queued=True)
    make_unresolved(served.platform, unknown)
    said = over_api(served, capsys, monkeypatch, "partitions", DATASOURCE, *bounds)
    local_said = local(served, capsys, "partitions", DATASOURCE, *bounds, "--tenant", "acme")
    assert said.code == local_said.code == 3, said.output
    assert without_hint(served, said.stdout) == without_hint(served, local_said.stdout)
    assert "1 unresolved run(s)" in said.stdout and f"dataflow --api {served.url} reconcile {unknown}" in said.stdout

    globex = token_of(served, "globex", "viewer")
    theirs = over_api(served, capsys, monkeypatch, "partitions", DATASOURCE, token=globex)
    local_theirs = local(served, capsys, "partitions", DATASOURCE, "--tenant", "globex")
    assert theirs.code == local_theirs.code == 4 and theirs.stderr.startswith("error [not_found]:"), theirs.output
    assert unknown not in theirs.output
    tenant = over_api(served, capsys, monkeypatch, "partitions", DATASOURCE, "--tenant", "acme")
    assert tenant.code == 2 and "--tenant does not apply under --api" in tenant.stderr


# ---- results -------------------------------------------------------------------------------------------


@pytest.fixture
def served_both(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with serving(db_url, tmp_path, monkeypatch, ("acme", "globex")) as found:
        yield found


def test_result_writes_what_the_local_result_writes(
    served_both: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`result RUN` over --api writes the local command's CSV and JSON to stdout and its Parquet to --output
    (the same table), read from GET /v1/runs/{id}/result in pieces of READ_CHUNK_BYTES (made small here: the
    server reads the stored bytes a piece at a time, each in its own read transaction); a run without a
    stored result exits 4 with the local
    message, another tenant's run 4 (not found), an unknown run 4."""
    served = served_both
    run = make_atomic_run(served.platform, served.examples, "acme")
    readers: list[results.StoredReader] = []
    opened = results.open_stored

    def counted(conn: Any, run_id: str) -> Any:
        manager = opened(conn, run_id)
        found = manager.__enter__()
        if found is not None:
            readers.append(found[1])
        return _Entered(manager, found)

    monkeypatch.setattr(results, "READ_CHUNK_BYTES", 64)
    monkeypatch.setattr(results, "open_stored", counted)
    for fmt in ("csv", "json"):
        readers.clear()
        said = over_api(served, capsys, monkeypatch, "result", run.run_id, "--format", fmt)
        local_said = local(served, capsys, "result", run.run_id, "--format", fmt)
        assert said.code == local_said.code == 0, said.output
        assert said.stdout == local_said.stdout and said.stdout
        # One reader to check the result exists, then one per piece: each in its own read transaction.
        size = readers[0].size
        assert size > 4 * 64 and len(readers) == 1 + -(-size // 64), (size, len(readers))
        assert [r.chunks_read for r in readers] == [0] + [1] * (len(readers) - 1)
    api_file, local_file = tmp_path / "api.parquet", tmp_path / "local.parquet"
    written = over_api(served, capsys, monkeypatch, "result", run.run_id, "-f", "parquet", "-o", str(api_file))
    local_written = local(served, capsys, "result", run.run_id, "-f", "parquet", "-o", str(local_file))
    assert written.code == local_written.code == 0, written.output
    assert pq.read_table(api_file).equals(pq.read_table(local_file))
    assert written.stderr.replace(str(api_file), "FILE") == local_written.stderr.replace(str(local_file), "FILE")

    queued = make_queued_run(served.platform, served.examples, "acme", key="no-result")
    said = over_api(served, capsys, monkeypatch, "result", queued.run_id)
    local_said = local(served, capsys, "result", queued.run_id)
    assert said.code == local_said.code == 4 and said.stderr == local_said.stderr, said.output
    globex = token_of(served, "globex", "operator")
    for token, run_id in ((globex, run.run_id), ("", UNKNOWN_RUN)):
        missing = over_api(served, capsys, monkeypatch, "result", run_id, token=token)
        assert missing.code == 4 and missing.stderr.startswith("error [not_found]:"), missing.output
        assert missing.stdout == ""


class _Entered:
    """The context manager ``results.open_stored`` returned, already entered (the test counts its reader)."""

    def __init__(self, manager: Any, found: Any) -> None:
        self.manager, self.found = manager, found

    def __enter__(self) -> Any:
        return self.found

    def __exit__(self, *exc: Any) -> Any:
        return self.manager.__exit__(*exc)


def test_the_result_route_streams_arrow_and_answers_404_and_409(served: Served) -> None:
    """GET /v1/runs/{id}/result answers the stored bytes exactly (Arrow IPC stream media type, Content-Length
    its size) to a viewer; 404 to another tenant, as for an unknown run; 409 `conflict` for a run that
    stored no result."""
    run = make_atomic_run(served.platform, served.examples, "acme")
    queued = make_queued_run(served.platform, served.examples, "acme", key="queued")
    viewer, globex = token_of(served, "acme", "viewer"), token_of(served, "globex", "viewer")

    def get(run_id: str, token: str) -> tuple[int, str, bytes]:
        request = urllib.request.Request(f"{served.url}/v1/runs/{run_id}/result",
                                         headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, answer.headers["Content-Type"], answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers["Content-Type"], error.read()

    status, media_type, body = get(run.run_id, viewer)
    with served.platform.db.read() as conn:
        stored = results.stored_bytes(conn, run.run_id)
    assert (status, media_type, body) == (200, v1.ARROW_STREAM_MEDIA_TYPE, stored)
    assert results.decode_ipc(body).num_rows == run.row_count
    for run_id, token in ((run.run_id, globex), (UNKNOWN_RUN, viewer)):
        status, _, body = get(run_id, token)
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    status, _, body = get(queued.run_id, viewer)
    assert status == 409 and json.loads(body)["error"] == {
        "code": "conflict", "message": f"run {queued.run_id} has no stored result"
    }  # fmt: skip


def test_a_result_stream_cut_short_exits_7(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the server stops sending before the whole result (its database lost half way), `result` exits 7
    (storage_unavailable) saying so, and writes nothing to stdout."""
    run = make_atomic_run(served.platform, served.examples, "acme")
    whole = v1._stored_pieces

    def cut_short(db: Any, run_id: str) -> Iterator[bytes]:
        piece = next(whole(db, run_id))
        yield piece[: len(piece) // 2]
        raise RuntimeError("the database went away")

    monkeypatch.setattr(v1, "_stored_pieces", cut_short)
    said = over_api(served, capsys, monkeypatch, "result", run.run_id)
    assert said.code == 7 and said.stdout == "" and "stopped sending its answer" in said.stderr, said.output
    assert io.StringIO(said.stderr).read().count("\n") == 1
