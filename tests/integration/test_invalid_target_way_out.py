"""A way out for runs stuck ``outcome_unknown`` on a target no publish could ever write to (issue 13,
item 3): before preflight existed, an ``InputError`` from publish became ``outcome_unknown``, and
reconcile stayed undecided for ever. Reconcile now asks the provider's preflight first: a refusal that
is an ``InvalidTarget`` (judged from the target's recorded text alone) proves nothing can exist at the
sink, so the run fails with no external output; any other refusal proves nothing and changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from durable_dataflow.dataflow.protocol import derivation, evidence, reconcile, runs
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import (
    Capability,
    Inconclusive,
    InspectOutcome,
    InvalidTarget,
    PublishOutcome,
    PublishTarget,
    Undecided,
    structural_refusal,
)
from durable_dataflow.datasources.postgres_table import PostgresTableProvider
from durable_dataflow.platform import Platform
from support import flows

OPERATOR = AccessContext("acme", "tester", ("operator",), (), "test")


class LegacyProvider:
    """A provider as the platform called them before preflight: no preflight, and a publish whose refusal
    the platform of that time recorded as an unknown outcome (here: Inconclusive, without touching anything)."""

    name = "faulty"
    capabilities: frozenset[Capability] = frozenset({"publish", "inspect"})

    def publish(self, key: str, token: int, table: pa.Table, digest: str, target: PublishTarget) -> PublishOutcome:
        raise Inconclusive("the target was refused, and this platform version could not tell")

    def inspect(self, key: str, target: PublishTarget, fence: int | None = None) -> InspectOutcome:
        return Undecided("this sink cannot be inspected")


def _stuck(platform: Platform, tmp_path: Path, location: str, options: dict[str, Any] | None = None) -> Run:
    registry.register_provider("faulty", LegacyProvider)
    target = {**flows.parquet_target("faulty", location), "options": options or {}}
    run = platform.runs.run_inline(flows.request(flows.definition(target), tmp_path, location)).run
    assert (run.status, run.recovery_status) == ("outcome_unknown", "outcome_unknown")
    return run


def _reconcile(platform: Platform, run_id: str) -> reconcile.Reconciliation:
    return reconcile.reconcile(platform.runs, run_id, access=OPERATOR, provenance=Provenance("tester", "cli"))


def test_a_run_stuck_on_an_invalid_table_name_fails_with_no_external_output(platform: Platform, tmp_path: Path) -> None:
    """The table name is no identifier, so every publish of it was refused before connecting: reconcile
    proves that from the recorded target and ends the run failed / no_external_output, checkpointed."""
    stuck = _stuck(platform, tmp_path, "not a table!")
    for _ in range(2):  # the old way: each reconcile undecided, the run stuck
        assert _reconcile(platform, stuck.run_id).finding == "undecided"
    registry.register_provider("faulty", PostgresTableProvider)  # the provider that knows its targets
    settled = _reconcile(platform, stuck.run_id)
    assert settled.finding == "invalid_target"
    run = platform.runs.get(stuck.run_id)
    assert (run.status, run.recovery_status, run.error_code) == ("failed", "no_external_output", "invalid_target")
    assert run.warning is None and not run.unresolved
    kinds = flows.kinds(platform, stuck.run_id)
    assert kinds[-2:] == [evidence.RECONCILE_INVALID_TARGET, evidence.RUN_FAILED]
    with platform.db.read() as conn:
        assert derivation.verify_run(conn, runs.get(conn, stuck.run_id), None).ok


def test_a_refusal_that_is_not_structural_proves_nothing(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid table name whose DSN secret is not available now is refused by preflight too, but the secret
    existed when the earlier attempt published: the run stays outcome_unknown, undecided."""
    monkeypatch.setenv("WAY_OUT_SINK_DSN", "postgresql://nobody@127.0.0.1:1/none")
    stuck = _stuck(platform, tmp_path, "public.orders", {"dsn": {"secret": "WAY_OUT_SINK_DSN"}})
    monkeypatch.delenv("WAY_OUT_SINK_DSN")
    registry.register_provider("faulty", PostgresTableProvider)
    assert _reconcile(platform, stuck.run_id).finding == "undecided"
    run = platform.runs.get(stuck.run_id)
    assert (run.status, run.recovery_status) == ("outcome_unknown", "outcome_unknown") and run.unresolved


def test_only_text_invariant_refusals_are_invalid_targets(tmp_path: Path) -> None:
    """What the built-ins call InvalidTarget depends on the target's text alone; a location that leaves its
    root (which a symlink could once have kept inside) is a plain InputError, so it is never taken as proof."""
    base = {"base_dir": str(tmp_path)}

    def target(location: str, absolute: bool = False) -> PublishTarget:
        return PublishTarget("d", location, "append", base, absolute_locations=absolute)

    postgres = PostgresTableProvider()
    assert structural_refusal(postgres, target("a b")) is not None
    assert structural_refusal(postgres, target("orders")) is None  # refused for its missing DSN, not its text
    parquet = registry.load_provider("parquet")
    assert structural_refusal(parquet, target("/abs/out")) is not None  # absolute where the run allows none
    assert structural_refusal(parquet, target("../../escape")) is None
    assert structural_refusal(parquet, target("out")) is None
    try:
        parquet.preflight(target("../../escape"))  # type: ignore[attr-defined]
    except InvalidTarget:
        raise AssertionError("an escaping location must not be an InvalidTarget") from None
    except Exception:
        pass
