"""The soak's reader of the object-store sink can fail: `harness.delta_store_table` reads a Delta table on
a real S3 API server (moto_server) without delta-rs, and a doubled publication commit, a commit whose
txn publishes a key without naming it, and a log with a missing commit are each reported, as are
rows that are not exactly the stored results of the publications (`harness.published_rows_problems`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from durable_dataflow.dataflow.protocol.forward import publication_key
from durable_dataflow.platform import Platform
from faults import harness
from support.s3 import S3Place

TABLE = "tables/checked"
COLUMNS = ("item", "qty")


def _commits(s3: S3Place) -> dict[int, str]:
    listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=f"{TABLE}/_delta_log/")
    found = {}
    for item in listed.get("Contents", []):
        matched = re.search(r"/(\d{20})\.json$", item["Key"])
        if matched:
            found[int(matched.group(1))] = item["Key"]
    return found


def _put_commit(s3: S3Place, version: int, body: str) -> None:
    s3.client().put_object(Bucket=s3.bucket, Key=f"{TABLE}/_delta_log/{version:020d}.json", Body=body.encode())


def test_the_store_reader_sees_each_publication_and_catches_a_doubled_or_hidden_one(
    s3: S3Place, tmp_path: Path
) -> None:
    definition = harness.inline_definition(
        tmp_path / "defs", "checked", publish_to=s3.url(TABLE), provider="delta", options=s3.options()
    )
    with Platform(f"sqlite:///{tmp_path}/p.db") as platform:
        run = platform.runs.run_inline(harness.request_for(definition, {"n": "2"}, "k")).run
        assert run.status == "succeeded"
        key = publication_key(run)

        table = harness.delta_store_table(s3.client(), s3.bucket, TABLE)
        assert [(p.key, p.digest) for p in table.publications] == [(key, run.output_digest)]
        assert table.problems == []
        assert sorted(harness.row_of(r, COLUMNS) for r in table.rows) == [("a", "2"), ("b", "4"), ("c", "6")]
        assert (
            harness.published_rows_problems(platform.db, "s3", table.rows, table.publications, ["checked"], COLUMNS)
            == []
        )
        assert harness.check(platform.db, table.publications).violations == []

        # The publication commit written again as the next version: the key is published twice, and
        # its rows are not there twice (the same data file).
        commits = _commits(s3)
        published = s3.client().get_object(Bucket=s3.bucket, Key=commits[max(commits)])["Body"].read().decode()
        _put_commit(s3, max(commits) + 1, published)
        doubled = harness.delta_store_table(s3.client(), s3.bucket, TABLE)
        assert len(doubled.publications) == 2
        assert any(
            v.startswith(f"run {run.run_id}: inv6") for v in harness.check(platform.db, doubled.publications).violations
        )
        assert harness.published_rows_problems(
            platform.db, "s3", doubled.rows, doubled.publications, ["checked"], COLUMNS
        )

        # A commit whose txn publishes the key but whose commit info does not say so.
        hidden = "\n".join(
            line for line in published.splitlines() if line.strip() and "commitInfo" not in json.loads(line)
        )
        _put_commit(s3, max(commits) + 1, hidden)
        assert any("without its publication record" in p for p in harness.delta_store_table(
            s3.client(), s3.bucket, TABLE
        ).problems)  # fmt: skip

        # A commit missing from the log: the reader cannot replay it and says so.
        s3.client().delete_object(Bucket=s3.bucket, Key=commits[0])
        assert any("not versions 0.." in p for p in harness.delta_store_table(s3.client(), s3.bucket, TABLE).problems)
