"""`dataflow partitions DATASOURCE` and `dataflow backfill … --only-missing [--stale]` as real processes,
on SQLite and PostgreSQL platform databases, publishing to a partitioned Delta table (issue 27, item 4).

One line per day with its current publication and what is after it, the missing days of the range, the
JSON form; one tenant's partitions unknown to another (exit 4); bad bounds refused naming the option
(exit 2); a backfill that submits only the unpublished days, and with --stale the days another
definition published, under keys that cannot collide with the old definition's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from durable_dataflow.dataflow.definitions.definitions import load_definition
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.platform import Platform
from support.cli import Cli, make_cli

DATASOURCE = "analytics.daily_totals"
FLOW = """\
name: daily_totals
version: {version}
parameters:
  day: {{type: date}}
sources:
  nums: {{kind: inline, rows: [{{n: 1}}, {{n: 2}}], schema: {{n: int64}}}}
steps:
  - {{name: result, sql: "select $day::DATE as day, n * {version} as total from nums"}}
output:
  schema: {{day: date, total: int64}}
  max_rows: 10
  max_bytes: 64KiB
target:
  type: datasources.publication
  provider: delta
  datasource: analytics.daily_totals
  location: daily
  mode: replace_partition
  partition: {{day: $day}}
"""


@pytest.fixture
def cli(db_url: str, tmp_path: Path) -> Cli:
    return make_cli(db_url, tmp_path)


def _flow(tmp_path: Path, version: int = 1) -> Path:
    path = tmp_path / f"daily_v{version}.yaml"
    path.write_text(FLOW.format(version=version), encoding="utf-8")
    return path


def _publish(cli: Cli, flow: Path, day: str, key: str) -> str:
    done = cli("run", str(flow), "--param", f"day={day}", "--idempotency-key", key, "--json")
    assert done.code == 0, done.output
    run_id: str = done.json()["run_id"]
    return run_id


def test_partitions_shows_each_days_current_publication_and_the_missing_days(
    cli: Cli, db_url: str, tmp_path: Path
) -> None:
    """Days 1 and 3 published, day 1 twice: the table has one line per day of the range, day 1 with the
    re-run's run, day 2 and 4 missing; the JSON form carries the full publication; another tenant's run of
    the same datasource is not shown, and that tenant sees only its own (--tenant)."""
    flow = _flow(tmp_path)
    _publish(cli, flow, "2024-03-01", "d1-a")
    third = _publish(cli, flow, "2024-03-03", "d3")
    again = _publish(cli, flow, "2024-03-01", "d1-b")
    with Platform(db_url) as platform:
        access = AccessContext("acme", "someone", ("operator",), (), "test")
        loaded = load_definition(flow)
        request = RunRequest(loaded.definition, tmp_path / "acme", {"day": "2024-03-02"}, access,
                             Provenance("someone", "cli"), "acme-d2")  # fmt: skip
        theirs = platform.runs.run_inline(request).run
        assert theirs.status == "succeeded", theirs.error_message
    shown = cli("partitions", DATASOURCE, "--from", "2024-03-01", "--to", "2024-03-04")
    assert shown.code == 0, shown.output
    lines = {line.split()[1]: line for line in shown.stdout.splitlines() if line.startswith("│ 2024-03-0")}
    assert sorted(lines) == ["2024-03-01", "2024-03-02", "2024-03-03", "2024-03-04"], shown.stdout
    assert again[-8:] in lines["2024-03-01"] and "d1-b" in lines["2024-03-01"] and "published" in lines["2024-03-01"]
    assert third[-8:] in lines["2024-03-03"]
    assert "missing" in lines["2024-03-02"] and "missing" in lines["2024-03-04"]
    assert theirs.run_id[-8:] not in shown.stdout
    assert "4 partition(s): 2 published, 2 missing" in shown.stdout
    found = cli("partitions", DATASOURCE, "--json").json()
    assert (found["datasource"], found["tenant"], found["columns"]) == (DATASOURCE, "default", ["day"])
    assert [p["partition"] for p in found["partitions"]] == [{"day": f"2024-03-0{d}"} for d in (1, 2, 3)]
    first = found["partitions"][0]
    assert first["state"] == "published" and first["after"] == []
    assert first["current"]["run_id"] == again and first["current"]["idempotency_key"] == "d1-b"
    assert first["current"]["partition_token"] == 2 and first["current"]["row_count"] == 2
    assert first["current"]["output_digest"].startswith("sha256:")
    acme = cli("partitions", DATASOURCE, "--tenant", "acme", "--json").json()
    assert [p["current"]["run_id"] for p in acme["partitions"]] == [theirs.run_id]
    nobody = cli("partitions", DATASOURCE, "--tenant", "nobody")
    assert nobody.code == 4 and "no partitioned runs" in nobody.stderr, nobody.output


def test_partitions_refuses_bad_input_by_name(cli: Cli, tmp_path: Path) -> None:
    """A --from that is no date for a date column (exit 2, naming the option, not echoing the value), an
    unknown datasource (exit 4), a bad tenant (exit 2)."""
    _publish(cli, _flow(tmp_path), "2024-03-01", "d1")
    bad = cli("partitions", DATASOURCE, "--from", "hunter2-secret")
    assert bad.code == 2 and "--from must be a date" in bad.stderr, bad.output
    assert "hunter2" not in bad.output
    assert cli("partitions", "analytics.nothing").code == 4
    assert cli("partitions", DATASOURCE, "--tenant", "../x").code == 2


def test_backfill_only_missing_submits_only_unpublished_days_and_stale_the_other_definitions(
    cli: Cli, tmp_path: Path
) -> None:
    """Day 2 published: --only-missing over days 1-3 submits days 1 and 3 and reports day 2 skipped with its
    run; run again, it submits nothing new. A changed definition with --only-missing --stale submits all
    three under keys ending with its hash (day 2's plain key names the old run); --stale alone is refused."""
    flow = _flow(tmp_path)
    published = _publish(cli, flow, "2024-03-02", "d2")
    done = cli("backfill", str(flow), "--from", "2024-03-01", "--to", "2024-03-03", "--only-missing", "--json")
    assert done.code == 0, done.output
    report = {r["tick"]: r for r in done.json()}
    assert [(t, r["created"], r["skipped"]) for t, r in report.items()] == [
        ("2024-03-01", True, False), ("2024-03-02", False, True), ("2024-03-03", True, False)
    ]
    assert report["2024-03-02"]["run_id"] == published and report["2024-03-02"]["status"] == "succeeded"
    again = cli("backfill", str(flow), "--from", "2024-03-01", "--to", "2024-03-03", "--only-missing")
    assert again.code == 0 and "0 run(s) submitted, 2 existed already, 1 skipped" in again.stdout, again.output
    changed = _flow(tmp_path, version=2)
    stale = cli("backfill", str(changed), "--from", "2024-03-01", "--to", "2024-03-03", "--only-missing", "--stale",
                "--json")  # fmt: skip
    assert stale.code == 0, stale.output
    assert [(r["created"], r["skipped"]) for r in stale.json()] == [(True, False)] * 3
    assert all(r["idempotency_key"].startswith(f"backfill:default:daily_totals:{r['tick']}:") for r in stale.json())
    not_stale = cli("backfill", str(changed), "--from", "2024-03-02", "--to", "2024-03-02", "--only-missing",
                    "--json")  # fmt: skip
    assert not_stale.json()[0]["skipped"] is True  # without --stale, another definition's publication counts
    alone = cli("backfill", str(flow), "--from", "2024-03-01", "--to", "2024-03-01", "--stale")
    assert alone.code == 2 and "--only-missing" in alone.stderr
    plain = tmp_path / "plain.yaml"
    plain.write_text(FLOW.format(version=1).split("target:")[0], encoding="utf-8")
    refused = cli("backfill", str(plain), "--from", "2024-03-01", "--to", "2024-03-01", "--only-missing")
    assert refused.code == 2 and "replace_partition" in refused.stderr, refused.output


def test_stale_backfill_replays_the_days_already_queued_by_the_same_definition(cli: Cli, tmp_path: Path) -> None:
    """A backfill queues days 1-3; `--only-missing --stale` of the same definition right after submits nothing
    new: the days have no publication yet, but their runs of this definition hold the plain keys and are
    replayed (before, each day was queued a second time under the hash-suffixed key). Day 4 is new."""
    flow = _flow(tmp_path)
    first = cli("backfill", str(flow), "--from", "2024-03-01", "--to", "2024-03-03", "--json")
    assert first.code == 0 and [r["created"] for r in first.json()] == [True] * 3, first.output
    again = cli("backfill", str(flow), "--from", "2024-03-01", "--to", "2024-03-04", "--only-missing", "--stale",
                "--json")  # fmt: skip
    assert again.code == 0, again.output
    report = again.json()
    assert [r["created"] for r in report] == [False, False, False, True]
    assert [r["run_id"] for r in report[:3]] == [r["run_id"] for r in first.json()]
    assert [r["idempotency_key"] for r in report] == [f"backfill:default:daily_totals:{r['tick']}" for r in report]
    runs_listed = cli("runs", "--json", "--limit", "50").json()
    assert len(runs_listed) == 4

