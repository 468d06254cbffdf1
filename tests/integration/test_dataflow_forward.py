"""Forward-recovery runs on both engines against real sinks, driven through every provider outcome."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durable_dataflow.core import checkpoints, crashpoints, ledger
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.schema import ledger_entries
from durable_dataflow.dataflow.protocol import derivation, forward, reconcile, sweeper
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import contract, registry
from durable_dataflow.datasources.contract import PublicationRefs, PublishTarget
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows


def _faulty(fault: str, inspect_fault: str = "none", inner: Any = None) -> FaultInjectingProvider:
    provider = FaultInjectingProvider(inner or DeltaProvider(), fault, inspect_fault)  # type: ignore[arg-type]
    registry.register_provider("faulty", lambda: provider)
    return provider


def _run(platform: Platform, tmp_path: Path, provider: str = "delta", key: str = "k1") -> Run:
    defn = flows.definition(flows.parquet_target(provider))
    return platform.runs.run_inline(flows.request(defn, tmp_path, key)).run


def _sink(tmp_path: Path) -> Path:
    return tmp_path / "sink"


def _reconcile(platform: Platform, run_id: str, *, resume: bool = False) -> reconcile.Reconciliation:
    """Reconcile as the tenant's operator who submitted the test runs."""
    access = AccessContext("acme", "tester", ("operator",), (), "test")
    provenance = Provenance("tester", "cli")
    return reconcile.reconcile(platform.runs, run_id, access=access, provenance=provenance, resume=resume)


def test_publishes_once_and_replays_add_nothing(platform: Platform, tmp_path: Path) -> None:
    """A forward run publishes to Delta with refs and verified success; a replay publishes nothing more
    (invariants 6, 11), read from the Delta log directly."""
    run = _run(platform, tmp_path)
    assert (run.status, run.recovery_status) == ("succeeded", "verified")
    assert run.publication_ref and run.materialization_ref and run.datasource_ref
    again = platform.runs.run_inline(flows.request(flows.definition(flows.parquet_target("delta")), tmp_path, "k1"))
    assert not again.created
    assert len(flows.delta_publications(_sink(tmp_path), run.publication_idempotency_key)) == 1
    assert flows.kinds(platform, run.run_id) == [
        "run.recorded",
        "attempt.started",
        "dispatch.authorized",
        "publication.confirmed",
        "run.succeeded",
    ]


def test_predispatch_commit_precedes_the_provider_call(platform: Platform, tmp_path: Path) -> None:
    """Invariant 5: when the provider is called, dispatch.authorized is committed (seen from another connection)."""
    seen: list[list[str]] = []
    inner = DeltaProvider()

    class Probe(FaultInjectingProvider):
        def publish(self, key: str, token: int, table: Any, digest: str, target: PublishTarget) -> Any:
            with platform.db.read() as conn:
                run_id = conn.execute(sa.text("SELECT run_id FROM dataflow_runs")).scalar_one()
                seen.append([e.kind for e in ledger.read(conn, "dataflow", run_id)])
            return super().publish(key, token, table, digest, target)

    probe = Probe(inner)
    registry.register_provider("faulty", lambda: probe)
    assert _run(platform, tmp_path, "faulty").status == "succeeded"
    assert seen == [["run.recorded", "attempt.started", "dispatch.authorized"]]


@pytest.mark.parametrize("provider", ["no_such_provider", "faulty"])
def test_missing_capability_fails_before_dispatch(platform: Platform, tmp_path: Path, provider: str) -> None:
    """Invariant 12: an unknown provider, or one without inspect, fails the run before dispatch and records that
    no external output was created; nothing reaches a sink."""
    fake = _faulty("none")
    fake.capabilities = frozenset({"read", "publish"})
    run = _run(platform, tmp_path, provider)
    assert (run.status, run.recovery_status, run.error_code) == ("failed", "no_external_output", "missing_capability")
    with platform.db.read() as conn:
        failed = [e for e in ledger.read(conn, "dataflow", run.run_id) if e.kind == "run.failed"]
    assert failed and failed[0].payload["no_external_output"] is True
    assert "dispatch.authorized" not in flows.kinds(platform, run.run_id)
    assert fake.counters.publish_calls == 0
    assert not _sink(tmp_path).exists()


@pytest.mark.parametrize("fault", ["fail_before_send", "timeout_after_commit", "drop_response"])
def test_inconclusive_dispatch_is_outcome_unknown_and_never_retried(
    platform: Platform, tmp_path: Path, fault: str
) -> None:
    """Invariant 8: no conclusive answer -> outcome_unknown with a warning; sweeping and claiming never retry it."""
    provider = _faulty(fault)
    run = _run(platform, tmp_path, "faulty")
    assert (run.status, run.recovery_status) == ("outcome_unknown", "outcome_unknown")
    assert run.warning and str(run.publication_idempotency_key) in run.warning and "reconcile" in run.warning
    assert "failed" not in run.warning.lower()
    flows.expire_leases(platform)
    assert sweeper.sweep(platform.db) == []
    assert platform.runs.claim_next() is None
    assert platform.runs.get(run.run_id).attempt == 1
    assert provider.counters.publish_calls == 1
    expected = 0 if fault == "fail_before_send" else 1
    assert len(flows.delta_publications(_sink(tmp_path))) == expected


def test_mismatched_digest_stays_unresolved(platform: Platform, tmp_path: Path) -> None:
    """Invariant 7: AlreadyPublished with another digest is never success; the warning says what was found."""
    _faulty("mismatched_digest")
    run = _run(platform, tmp_path, "faulty")
    assert (run.status, run.recovery_status) == ("outcome_unknown", "outcome_unknown")
    assert run.warning and "differs" in run.warning
    assert "run.succeeded" not in flows.kinds(platform, run.run_id)


def test_conclusive_rejection_fails_with_evidence(platform: Platform, tmp_path: Path) -> None:
    """A Rejected answer fails the run, records the sink's reason, and leaves nothing at the sink."""
    _faulty("reject")
    run = _run(platform, tmp_path, "faulty")
    assert (run.status, run.recovery_status, run.error_code) == ("failed", "no_external_output", "publication_rejected")
    assert "publication.rejected" in flows.kinds(platform, run.run_id)
    assert flows.delta_publications(_sink(tmp_path)) == []


def test_reconcile_present_commits_refs_and_success(platform: Platform, tmp_path: Path) -> None:
    """The sink committed but the answer was lost: reconciliation finds the key with the recorded digest and commits
    reconciled_present with refs and a verified checkpoint; the sink still holds one publication."""
    _faulty("timeout_after_commit")
    run = _run(platform, tmp_path, "faulty")
    result = _reconcile(platform, run.run_id)
    assert result.finding == "present"
    assert (result.run.status, result.run.recovery_status) == ("succeeded", "reconciled_present")
    assert result.run.publication_ref and result.run.attempt == 2
    with platform.db.read() as conn:
        checkpoint = checkpoints.latest(conn, "dataflow", run.run_id)
    assert checkpoint is not None and checkpoint.status == "succeeded"
    assert len(flows.delta_publications(_sink(tmp_path))) == 1


def test_reconcile_absent_fences_and_resume_publishes_once(platform: Platform, tmp_path: Path) -> None:
    """Invariant 14: absence is fenced at the reconcile attempt; the stale attempt 1 is then refused by the sink;
    resume publishes the stored bytes once under a newer attempt with the same key."""
    _faulty("fail_before_send")
    run = _run(platform, tmp_path, "faulty")
    result = _reconcile(platform, run.run_id)
    assert result.finding == "absent"
    assert (result.run.status, result.run.recovery_status) == ("failed", "reconciled_absent")
    stored = platform.runs.result_bytes(run.run_id)
    from durable_dataflow.dataflow.execution import results

    late = DeltaProvider().publish(
        forward.publication_key(run), 1, results.decode_ipc(stored), str(run.output_digest), forward.publish_target(run)
    )
    assert type(late).__name__ == "Fenced"
    assert flows.delta_publications(_sink(tmp_path)) == []
    registry.register_provider("faulty", DeltaProvider)  # the sink is reachable again
    resumed = _reconcile(platform, run.run_id, resume=True)
    assert resumed.resumed and resumed.run.status == "succeeded"
    publications = flows.delta_publications(_sink(tmp_path))
    assert len(publications) == 1 and publications[0]["dataflow_token"] == 3
    assert publications[0]["dataflow_digest"] == run.output_digest


def test_reconcile_mismatch_and_undecided_leave_the_run_unresolved(platform: Platform, tmp_path: Path) -> None:
    """A mismatching digest keeps the run unresolved with its warning; an undecided inspection changes nothing."""
    provider = _faulty("fail_before_send", inspect_fault="undecided")
    run = _run(platform, tmp_path, "faulty")
    undecided = _reconcile(platform, run.run_id)
    assert undecided.finding == "undecided"
    assert undecided.run.status == "outcome_unknown"
    provider.inspect_fault = "none"
    other = flows.definition(
        flows.parquet_target("delta"), sql="select 'x' as region, 1::DECIMAL(18,2) as total, 1::BIGINT as n"
    )
    from durable_dataflow.dataflow.execution import compute, context

    foreign = compute.execute(other, {"factor": 1}, context.ExecutionContext(tmp_path, (tmp_path,)))
    DeltaProvider().publish(
        forward.publication_key(run), 9, foreign.table, foreign.output_digest, forward.publish_target(run)
    )
    mismatch = _reconcile(platform, run.run_id)
    assert mismatch.finding == "mismatch"
    assert mismatch.run.status == "outcome_unknown" and mismatch.run.warning and "differs" in mismatch.run.warning
    assert "run.succeeded" not in flows.kinds(platform, run.run_id)


def test_expired_authorized_attempt_becomes_outcome_unknown(platform: Platform, tmp_path: Path) -> None:
    """Invariant 8 via the sweeper: an attempt that expires after dispatch.authorized is outcome_unknown."""

    def stall(point: str) -> None:
        if point == crashpoints.AFTER_PREDISPATCH_COMMIT:
            raise KeyboardInterrupt  # the worker dies right after authorization

    crashpoints.set_hook(stall)
    with pytest.raises(KeyboardInterrupt):
        _run(platform, tmp_path)
    crashpoints.set_hook(None)
    flows.expire_leases(platform)
    decisions = sweeper.sweep(platform.db)
    assert [d.decision for d in decisions] == ["outcome_unknown"]
    run = platform.runs.get(decisions[0].run_id)
    assert (run.status, run.recovery_status) == ("outcome_unknown", "outcome_unknown")
    assert run.warning and "reconcile" in run.warning
    assert platform.runs.claim_next() is None
    assert flows.delta_publications(_sink(tmp_path)) == []


def test_tampered_ledger_blocks_forward_success(platform: Platform, tmp_path: Path) -> None:
    """Invariant 10: tampering between dispatch and the terminal commit yields evidence_failed, not success,
    although the sink holds the publication."""

    def tamper(point: str) -> None:
        if point == crashpoints.BEFORE_TERMINAL_COMMIT:
            with platform.db.begin() as conn:
                conn.execute(ledger_entries.update().where(ledger_entries.c.seq == 3).values(kind="tampered"))

    crashpoints.set_hook(tamper)
    run = _run(platform, tmp_path)
    assert (run.status, run.recovery_status) == ("evidence_failed", "evidence_failed")
    assert run.warning and "UNRESOLVED" in run.warning
    assert "run.succeeded" not in flows.kinds(platform, run.run_id)
    assert run.publication_ref is None


def test_parquet_folder_example_publishes_once(platform: Platform, tmp_path: Path) -> None:
    """The Parquet-folder provider: one manifest and one data file for the key after a run and a replay."""
    run = _run(platform, tmp_path, "parquet")
    platform.runs.run_inline(flows.request(flows.definition(flows.parquet_target("parquet")), tmp_path, "k1"))
    assert run.status == "succeeded"
    assert len(flows.manifests(_sink(tmp_path))) == 1
    assert len(list((_sink(tmp_path) / "data").glob("*.parquet"))) == 1


def test_terminal_commit_after_lease_expiry_is_refused(platform: Platform, tmp_path: Path) -> None:
    """Invariant 3: the sink answered, but the lease expired (database clock) before the terminal commit and no
    sweeper has run yet: the success commit is refused; the sweeper then records outcome_unknown and a
    reconciliation finds the publication, so success is committed by a live attempt only."""

    def expire(point: str) -> None:
        if point == crashpoints.BEFORE_TERMINAL_COMMIT:
            flows.expire_leases(platform)

    crashpoints.set_hook(expire)
    run = _run(platform, tmp_path)
    crashpoints.set_hook(None)
    assert run.status == "running" and run.recovery_status == "dispatch_authorized"
    assert "run.succeeded" not in flows.kinds(platform, run.run_id)
    assert [d.decision for d in sweeper.sweep(platform.db)] == ["outcome_unknown"]
    settled = _reconcile(platform, run.run_id)
    assert settled.finding == "present" and settled.run.status == "succeeded" and settled.run.attempt == 2
    assert len(flows.delta_publications(_sink(tmp_path))) == 1


def test_runs_recorded_with_absolute_refs_still_verify_and_reconcile(platform: Platform, tmp_path: Path) -> None:
    """Refs are recorded facts, never re-derived or compared: a run that succeeded with the absolute refs of
    earlier versions (delta:///abs/…) still verifies, and a run left unresolved by that version reconciles
    with today's provider, which records refs relative to the sink root."""
    sink = _sink(tmp_path).resolve()

    class AbsoluteRefs(DeltaProvider):
        def _refs(self, where: str, key: str, version: int) -> PublicationRefs:
            assert where == "sink"
            return super()._refs(str(sink), key, version)  # the form refs had before they were relative

    registry.register_provider("faulty", AbsoluteRefs)
    old = _run(platform, tmp_path, "faulty", key="old")
    assert old.status == "succeeded" and old.publication_ref == f"delta://{sink}#txn={old.publication_idempotency_key}"
    _faulty("timeout_after_commit", inner=AbsoluteRefs())
    unknown = _run(platform, tmp_path, "faulty", key="unknown")
    assert unknown.status == "outcome_unknown"
    registry.register_provider("faulty", DeltaProvider)
    settled = _reconcile(platform, unknown.run_id)
    assert (settled.finding, settled.run.status) == ("present", "succeeded")
    assert settled.run.publication_ref == f"delta://sink#txn={unknown.publication_idempotency_key}"
    assert platform.runs.get(old.run_id).publication_ref == old.publication_ref
    with platform.db.read() as conn:
        for run in (platform.runs.get(old.run_id), settled.run):
            key = platform.runs.config.evidence_key
            verification = derivation.verify_run(conn, run, key)
            assert verification.ok, verification.reason


def test_an_inspection_that_raises_is_undecided_without_its_text(platform: Platform, tmp_path: Path) -> None:
    """Reconcile records an exception escaping inspect by its type and a fixed description only: its text may
    quote the server's paths. Nothing changes at the run."""
    secret_path = str(tmp_path / "sink" / "_delta_log")

    class Raising(DeltaProvider):
        def inspect(self, key: str, target: PublishTarget, fence: int | None = None) -> Any:
            raise PermissionError(13, "Permission denied", secret_path)

    _faulty("fail_before_send")
    run = _run(platform, tmp_path, "faulty")
    registry.register_provider("faulty", Raising)
    result = _reconcile(platform, run.run_id)
    assert (result.finding, result.run.status) == ("undecided", "outcome_unknown")
    assert result.detail == (
        "preparing the run's target or inspecting the sink failed (PermissionError): nothing was proven"
    )
    with platform.db.read() as conn:
        entries = ledger.read(conn, "dataflow", run.run_id)
    assert entries[-1].kind == "reconcile.undecided" and secret_path not in str(entries[-1].payload)


SINK_SECRET = "TEST_FORWARD_SINK_DSN"
SINK_PASSWORD = "hunter2-preflight"


def test_unset_target_secret_fails_before_dispatch(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A postgres target whose DSN secret was set at submit but is unset when the attempt runs (a worker without it)
    fails in the provider's preflight, before the pre-dispatch commit: failed / no_external_output with the reason,
    no dispatch.authorized, and the secret's value nowhere in the run (issue 13, item 3)."""
    monkeypatch.setenv(SINK_SECRET, f"postgresql://nobody:{SINK_PASSWORD}@127.0.0.1:1/none")
    target = {**flows.parquet_target("postgres", "public.totals"), "options": {"dsn": {"secret": SINK_SECRET}}}
    recorded = platform.runs.submit(flows.request(flows.definition(target), tmp_path, "k1")).run
    monkeypatch.delenv(SINK_SECRET)
    claim = platform.runs.claim_next()
    assert claim is not None and claim.run.run_id == recorded.run_id
    run = platform.runs.execute(claim)
    assert (run.status, run.recovery_status, run.error_code) == ("failed", "no_external_output", "invalid_input")
    assert run.error_message and run.error_message.startswith("the target cannot be published to: ")
    assert "secret is not set" in run.error_message
    assert "dispatch.authorized" not in flows.kinds(platform, run.run_id)
    with platform.db.read() as conn:
        entries = ledger.read(conn, "dataflow", run.run_id)
    assert entries[-1].kind == "run.failed" and entries[-1].payload["no_external_output"] is True
    assert SINK_PASSWORD not in str([e.payload for e in entries]) + run.model_dump_json()


def test_location_escaping_its_root_at_dispatch_is_rejected_not_unknown(platform: Platform, tmp_path: Path) -> None:
    """The sink folder passes the preflight, then is swapped for a symlink out of the sink root before dispatch: the
    real parquet provider's publish raises InputError before touching the sink, which is recorded as a conclusive
    rejection (failed / no_external_output), never outcome_unknown; nothing is written outside (issue 13, item 3)."""
    base, outside = tmp_path / "base", tmp_path / "outside"
    base.mkdir()
    outside.mkdir()

    def swap(point: str) -> None:
        if point == crashpoints.BEFORE_PREDISPATCH_COMMIT:  # after the sink folder was prepared
            shutil.rmtree(base / "sink")
            (base / "sink").symlink_to(outside, target_is_directory=True)

    crashpoints.set_hook(swap)
    run = platform.runs.run_inline(flows.request(flows.definition(flows.parquet_target("parquet")), base, "k1")).run
    assert (run.status, run.recovery_status, run.error_code) == ("failed", "no_external_output", "publication_rejected")
    assert run.error_message and "escapes its base directory" in run.error_message
    assert str(tmp_path) not in run.error_message
    kinds = flows.kinds(platform, run.run_id)
    assert "dispatch.authorized" in kinds and "publication.rejected" in kinds
    assert "publication.unknown" not in kinds
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize(
    ("provider", "location", "options"),
    [
        ("parquet", "../escape", {}),
        ("delta", "../escape", {}),
        ("postgres", "public.totals", {"dsn": {"secret": "NEVER_SET_PREFLIGHT_7Q"}}),
        ("postgres", "a.b.c", {"dsn": {"secret": SINK_SECRET}}),
    ],
)
def test_builtin_preflight_refuses_without_touching_the_sink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, provider: str, location: str, options: dict[str, Any]
) -> None:
    """Each built-in provider's preflight raises InputError for a location outside its root, an unset secret or a
    table name that does not parse, and creates nothing (no folder, no connection)."""
    monkeypatch.setenv(SINK_SECRET, f"postgresql://nobody:{SINK_PASSWORD}@127.0.0.1:1/none")
    base = tmp_path / "base"
    base.mkdir()
    target = PublishTarget("analytics.totals", location, "append", {**options, "base_dir": str(base)})
    with pytest.raises(InputError) as refused:
        contract.preflight(registry.load_provider(provider), target)
    assert SINK_PASSWORD not in refused.value.message
    assert sorted(tmp_path.iterdir()) == [base] and list(base.iterdir()) == []
