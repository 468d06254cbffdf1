"""File sinks never invent absence (issue 13, item 4): the platform prepares the sink location before it
authorizes dispatch, and an inspection of a missing location is Undecided and creates nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.dataflow import crashpoints, reconcile, sweeper
from durable_dataflow.dataflow.requests import AccessContext, Provenance
from durable_dataflow.dataflow.runs import Run
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import LOCATION_MISSING, PublishTarget, Undecided
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows

FILE_PROVIDERS: dict[str, type[ParquetFolderProvider | DeltaProvider]] = {
    "parquet": ParquetFolderProvider,
    "delta": DeltaProvider,
}


def _run(platform: Platform, tmp_path: Path, provider: str) -> Run:
    defn = flows.definition(flows.parquet_target(provider))
    return platform.runs.run_inline(flows.request(defn, tmp_path, "k1")).run


def _reconcile(platform: Platform, run_id: str, *, resume: bool = False) -> reconcile.Reconciliation:
    access = AccessContext("acme", "tester", ("operator",), (), "test")
    return reconcile.reconcile(
        platform.runs, run_id, access=access, provenance=Provenance("tester", "cli"), resume=resume
    )


def _publications(name: str, sink: Path) -> int:
    return len(flows.manifests(sink)) if name == "parquet" else len(flows.delta_publications(sink))


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
@pytest.mark.parametrize("fence", [None, 3])
def test_inspecting_a_missing_location_is_undecided_and_creates_nothing(
    tmp_path: Path, name: str, fence: int | None
) -> None:
    """A file sink's inspection of a location that does not exist (never prepared, or moved away after it was)
    answers Undecided with the fixed reason, with or without a fence, and the location is still missing after."""
    provider = FILE_PROVIDERS[name]()
    target = PublishTarget("ds", "sink", "append", {"base_dir": str(tmp_path)})
    found = provider.inspect("k", target, fence=fence)
    assert isinstance(found, Undecided) and found.reason.endswith(LOCATION_MISSING)
    assert list(tmp_path.iterdir()) == []
    provider.prepare(target)
    assert provider.inspect("k", target, fence=fence).__class__.__name__ == "Absent"
    (tmp_path / "sink").rename(tmp_path / "moved")
    found = provider.inspect("k", target, fence=fence)
    assert isinstance(found, Undecided) and found.reason.endswith(LOCATION_MISSING)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moved"]


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_a_moved_sink_folder_is_undecided_and_never_published_twice(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """The issue's experiment: the sink commits, the answer is lost (outcome_unknown), the sink folder is moved away.
    Reconcile is undecided (not absent), resume re-dispatches nothing and creates no folder; with the folder back,
    reconcile finds the publication present: the sink holds exactly one publication of the key."""
    faulty = FaultInjectingProvider(FILE_PROVIDERS[name](), "timeout_after_commit")
    registry.register_provider("faulty", lambda: faulty)
    run = _run(platform, tmp_path, "faulty")
    assert run.status == "outcome_unknown"
    sink, moved = tmp_path / "sink", tmp_path / "moved"
    sink.rename(moved)
    undecided = _reconcile(platform, run.run_id)
    assert undecided.finding == "undecided" and LOCATION_MISSING in undecided.detail
    assert (undecided.run.status, undecided.run.recovery_status) == ("outcome_unknown", "outcome_unknown")
    resumed = _reconcile(platform, run.run_id, resume=True)
    assert resumed.finding == "undecided" and not resumed.resumed
    assert not sink.exists() and faulty.counters.inner_publish_calls == 1
    moved.rename(sink)
    present = _reconcile(platform, run.run_id)
    assert present.finding == "present"
    assert (present.run.status, present.run.recovery_status) == ("succeeded", "reconciled_present")
    assert _publications(name, sink) == 1 and faulty.counters.inner_publish_calls == 1


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_a_crash_before_the_provider_call_still_reconciles_absent(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """The worker dies right after the pre-dispatch commit: the sink folder was prepared before it and holds no
    publication, so reconcile proves the key absent and a resume publishes it exactly once."""

    def die(point: str) -> None:
        if point == crashpoints.AFTER_PREDISPATCH_COMMIT:
            raise KeyboardInterrupt  # the worker dies right after authorization

    crashpoints.set_hook(die)
    with pytest.raises(KeyboardInterrupt):
        _run(platform, tmp_path, name)
    crashpoints.set_hook(None)
    sink = tmp_path / "sink"
    assert sink.is_dir() and _publications(name, sink) == 0
    platform.db.advance_clock(6)
    decisions: list[Any] = sweeper.sweep(platform.db)
    assert [d.decision for d in decisions] == ["outcome_unknown"]
    absent = _reconcile(platform, decisions[0].run_id)
    assert (absent.finding, absent.run.recovery_status) == ("absent", "reconciled_absent")
    resumed = _reconcile(platform, decisions[0].run_id, resume=True)
    assert resumed.resumed and resumed.run.status == "succeeded"
    assert _publications(name, sink) == 1


@pytest.mark.parametrize("name", sorted(FILE_PROVIDERS))
def test_a_location_that_cannot_be_prepared_fails_before_dispatch(
    platform: Platform, tmp_path: Path, name: str
) -> None:
    """A file where the sink folder should be: prepare cannot create the location, so the run fails with no
    external output before the pre-dispatch commit, with the OS's errno text and no path in the reason."""
    (tmp_path / "sink").write_bytes(b"not a folder")
    run = _run(platform, tmp_path, name)
    assert (run.status, run.recovery_status) == ("failed", "no_external_output")
    assert run.error_message and run.error_message.startswith("the sink location cannot be created: ")
    assert str(tmp_path) not in run.error_message
    assert "dispatch.authorized" not in flows.kinds(platform, run.run_id)
    assert (tmp_path / "sink").read_bytes() == b"not a folder"
