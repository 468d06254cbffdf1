"""Red-team findings on registered sink locations (issue 26, finding 1), each a way the first fix left open.

- A `_location.json` that is a FIFO (anyone with write access to the sink folder can make one) blocked `locate`
  in `open()` forever: every later run of the datasource and every reconcile of its runs hung.
- A Delta `_delta_log` without a first commit (what a concurrent first run of the datasource leaves between
  creating the folder and committing version 0, or a crash there) failed `locate` with an unexpected
  TableNotFoundError before `prepare` (which creates the table there) could run: the first run of a
  datasource failed `execution_failed`, and after such a crash every run did.
- A run authorized before locations were recorded (its `dispatch.authorized` has no `sink_location`: an upgrade
  while it was outcome_unknown) whose folder then went missing: the first run after the upgrade found no record,
  created the folder afresh and recorded it, and the old run's reconcile, holding it to that record, proved its
  key absent in the new folder and published it a second time (finding 1 again, across the upgrade).
- `dataflow datasources forget NAME --yes` with a NAME that is not UTF-8 (a shell argument with a byte such as
  0xff) crashed with `error [internal]: unexpected UnicodeEncodeError` (the ledger subject encoded the name).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.dataflow.protocol import reconcile
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, asked_by
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import PublishTarget
from durable_dataflow.datasources.parquet_folder import MARKER, ParquetFolderProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows
from support.cli import make_cli

WAIT_S = 20.0
OPERATOR = AccessContext("acme", "ops-alice", ("operator",), (), "test")


def _run(platform: Platform, base_dir: Path, provider: str, key: str, location: str = "sink") -> Run:
    defn = flows.definition(flows.parquet_target(provider, location))
    return platform.runs.run_inline(flows.request(defn, base_dir, key)).run


def test_a_marker_that_is_a_fifo_fails_the_run_instead_of_hanging_it(platform: Platform, tmp_path: Path) -> None:
    assert _run(platform, tmp_path, "parquet", "k1").status == "succeeded"
    marker = tmp_path / "sink" / MARKER
    marker.unlink()
    os.mkfifo(marker)

    done: list[Run] = []
    worker = threading.Thread(target=lambda: done.append(_run(platform, tmp_path, "parquet", "k2")), daemon=True)
    worker.start()
    worker.join(WAIT_S)
    if worker.is_alive():  # unblock the reader so the thread ends, then fail
        fd = os.open(marker, os.O_WRONLY)
        os.close(fd)
        worker.join(WAIT_S)
        pytest.fail("the run hung opening a FIFO marker")
    run = done[0]
    assert (run.status, run.recovery_status) == ("failed", "no_external_output")
    assert run.error_message is not None and str(tmp_path) not in run.error_message
    assert len(flows.manifests(tmp_path / "sink")) == 1


def test_a_delta_log_without_a_first_commit_is_no_table_yet(platform: Platform, tmp_path: Path) -> None:
    (tmp_path / "sink" / "_delta_log").mkdir(parents=True)
    run = _run(platform, tmp_path, "delta", "k1")
    assert (run.status, run.error_code) == ("succeeded", None), run.error_message
    assert len(flows.delta_publications(tmp_path / "sink")) == 1
    (tmp_path / "sink").rename(tmp_path / "away")  # and the location it created is recorded
    (tmp_path / "sink" / "_delta_log").mkdir(parents=True)
    refused = _run(platform, tmp_path, "delta", "k2")
    assert (refused.status, refused.recovery_status, refused.error_code) == (
        "failed", "no_external_output", "location_missing",
    )  # fmt: skip
    assert not list((tmp_path / "sink" / "_delta_log").iterdir()), "the registered table was created again"


def test_forget_with_a_name_that_is_no_text_is_invalid_input_not_an_internal_error(db_url: str, tmp_path: Path) -> None:
    result = make_cli(db_url, tmp_path)("datasources", "forget", "a\udcffb", "--yes")
    assert result.code == 2, result.output
    assert "invalid_input" in result.output and "internal" not in result.output


class _BeforeLocate:
    """The provider as this platform called it before `locate` existed (no location recorded at dispatch)."""

    name = "parquet"
    capabilities = ParquetFolderProvider.capabilities

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def prepare(self, target: PublishTarget) -> None:
        self.inner.prepare(target)

    def publish(self, *args: Any) -> Any:
        return self.inner.publish(*args)

    def inspect(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.inspect(*args, **kwargs)


def test_a_run_authorized_before_locations_were_recorded_is_not_proven_absent_in_a_recreated_folder(
    platform: Platform, tmp_path: Path
) -> None:
    faulty = FaultInjectingProvider(ParquetFolderProvider(), "timeout_after_commit", fail_times=1)
    registry.register_provider("faulty", lambda: _BeforeLocate(faulty))
    defn = flows.definition(flows.parquet_target("faulty"))
    run_a = platform.runs.run_inline(flows.request(defn, tmp_path, "A")).run
    assert run_a.status == "outcome_unknown"
    (tmp_path / "sink").rename(tmp_path / "moved")
    registry.register_provider("faulty", lambda: faulty)  # the upgrade
    assert platform.runs.run_inline(flows.request(defn, tmp_path, "B")).run.status == "succeeded"

    asked = Provenance("ops-alice", "cli")
    held = reconcile.reconcile(platform.runs, run_a.run_id, access=OPERATOR, provenance=asked, resume=True)
    assert (held.finding, held.resumed, held.run.status) == ("undecided", False, "outcome_unknown")
    assert str(tmp_path) not in held.detail
    assert len(flows.manifests(tmp_path / "sink")) == 1 and faulty.counters.inner_publish_calls == 2

    (tmp_path / "sink").rename(tmp_path / "b")  # the operator puts A's folder back and says so
    (tmp_path / "moved").rename(tmp_path / "sink")
    with platform.db.begin() as conn:
        registry.forget_locations(
            conn, platform.db, "acme", "analytics.totals", asked_by(OPERATOR, asked),
            evidence_key=platform.runs.config.evidence_key,
        )  # fmt: skip
    present = reconcile.reconcile(platform.runs, run_a.run_id, access=OPERATOR, provenance=asked)
    assert (present.finding, present.run.status) == ("present", "succeeded")
