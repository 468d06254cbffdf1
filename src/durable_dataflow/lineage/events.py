"""OpenLineage run events from committed ledger entries: pure functions, one entry in, one event or none out.

An event is built from one run (its projection row) and that run's own chain, so it names only that run's
tenant: its job, its sources and its target. Which entry kind becomes which event is ``EVENT_TYPES``
(docs/lineage.md has the table). Identities are stable, so a redelivered event is the same event:
``runId`` is uuid5 of the run id, and the event id (carried in the ``durableDataflow_ledgerEntry`` run
facet) is uuid5 of the entry's key ``(module, subject_id, seq)``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attr
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    DatasetFacet,
    JobFacet,
    RunFacet,
    dataset_version_dataset,
    error_message_run,
    job_type_job,
    parent_run,
)

from durable_dataflow import __version__
from durable_dataflow.core.ledger import Entry
from durable_dataflow.dataflow.protocol import evidence
from durable_dataflow.dataflow.protocol.runs import MODULE as DATAFLOW_MODULE
from durable_dataflow.dataflow.protocol.runs import Run as DataflowRun

# The project has no public site: the docs' address is a reserved .invalid name (RFC 2606), which the
# spec's "uri" format accepts and no one can take over. Custom facets point at their section of
# docs/lineage.md under it.
DOCS_URL = "https://durable-dataflow.invalid/docs/lineage.md"
PRODUCER = f"https://durable-dataflow.invalid/releases/{__version__}"
FACET_PREFIX = "durableDataflow_"
# The uuid5 namespaces of the stable identities (fixed forever: changing one changes every id).
RUN_ID_NAMESPACE = uuid.UUID("6f0c2a9e-3f4d-5b7e-9a51-1d2c3b4a5f60")
EVENT_ID_NAMESPACE = uuid.UUID("0b8d7e51-92c4-5f3a-8e16-7c5d4b3a2e10")
MESSAGE_CHARS_MAX = 1000  # an error message or a finding's reason, cut to this in a facet

# The entry kinds that become events, and their event type; every other kind becomes none.
EVENT_TYPES: Mapping[str, RunState] = {
    evidence.ATTEMPT_STARTED: RunState.START,
    evidence.RESUME_STARTED: RunState.START,
    evidence.RUN_SUCCEEDED: RunState.COMPLETE,
    evidence.RUN_FAILED: RunState.FAIL,
    evidence.RECONCILE_ABSENT: RunState.FAIL,
    evidence.EVIDENCE_FAILED: RunState.FAIL,
    evidence.RUN_CANCELLED: RunState.ABORT,
    evidence.ATTEMPT_OUTCOME_UNKNOWN: RunState.OTHER,
    evidence.PUBLICATION_UNKNOWN: RunState.OTHER,
    evidence.PUBLICATION_MISMATCH: RunState.OTHER,
    evidence.RECONCILE_PRESENT: RunState.OTHER,
    evidence.RECONCILE_MISMATCH: RunState.OTHER,
    evidence.RECONCILE_UNDECIDED: RunState.OTHER,
    evidence.RECONCILE_INVALID_TARGET: RunState.OTHER,
}
# The entry kinds that become no event: they feed the events above (sources, key, references) or record a
# step a catalog has no state for. Every kind the transition table appends is in exactly one of the two
# (tests/unit/test_lineage_events.py): a new kind must be given its event, or none, here.
NO_EVENT_KINDS = frozenset({
    evidence.RUN_RECORDED, evidence.RESULT_COMMITTED, evidence.DISPATCH_AUTHORIZED, evidence.PUBLICATION_CONFIRMED,
    evidence.PUBLICATION_REJECTED, evidence.RECONCILE_STARTED, evidence.ATTEMPT_RECOVERED,
})  # fmt: skip
# Entries after which the run may have published, and no one knows whether it did.
OUTCOME_UNKNOWN_KINDS = frozenset({
    evidence.ATTEMPT_OUTCOME_UNKNOWN, evidence.PUBLICATION_UNKNOWN, evidence.PUBLICATION_MISMATCH,
    evidence.RECONCILE_MISMATCH,
})  # fmt: skip
RECONCILE_FINDINGS: Mapping[str, str] = {
    evidence.RECONCILE_PRESENT: "present",
    evidence.RECONCILE_ABSENT: "absent",
    evidence.RECONCILE_MISMATCH: "mismatch",
    evidence.RECONCILE_UNDECIDED: "undecided",
    evidence.RECONCILE_INVALID_TARGET: "invalid_target",
}
# The error code of a failing entry whose payload names none.
FAIL_CODES: Mapping[str, str] = {
    evidence.RECONCILE_ABSENT: "reconciled_absent",
    evidence.EVIDENCE_FAILED: "evidence_failed",
}
SOURCES_KINDS = (evidence.RESULT_COMMITTED, evidence.DISPATCH_AUTHORIZED)  # entries that list the sources
REFERENCE_KINDS = (evidence.PUBLICATION_CONFIRMED, evidence.RECONCILE_PRESENT)  # entries with the refs


def _schema(anchor: str) -> str:
    return f"{DOCS_URL}#{anchor}"


@attr.define
class LedgerEntryRunFacet(RunFacet):
    """The ledger entry an event was derived from, and the event's stable id (for de-duplication)."""

    eventId: str
    module: str
    subjectId: str
    seq: int
    kind: str
    attempt: int
    entryHash: str

    @staticmethod
    def _get_schema() -> str:
        return _schema("ledgerentry-run-facet")


@attr.define
class ErrorRunFacet(RunFacet):
    """A failure's stable error code (docs/cli.md lists them) and its message."""

    code: str
    message: str

    @staticmethod
    def _get_schema() -> str:
        return _schema("error-run-facet")


@attr.define
class OutcomeRunFacet(RunFacet):
    """The run may have published and no one knows yet: reconcile decides (docs/recovery)."""

    outcome: str
    mayHavePublished: bool
    kind: str
    reason: str

    @staticmethod
    def _get_schema() -> str:
        return _schema("outcome-run-facet")


@attr.define
class ReconcileRunFacet(RunFacet):
    """What a reconcile found at the sink: present, absent, mismatch, undecided or invalid_target."""

    finding: str
    reason: str

    @staticmethod
    def _get_schema() -> str:
        return _schema("reconcile-run-facet")


@attr.define
class DefinitionJobFacet(JobFacet):
    """The pinned definition the run executes: its name, content hash, mode and tenant."""

    tenant: str
    name: str
    definitionHash: str
    mode: str

    @staticmethod
    def _get_schema() -> str:
        return _schema("definition-job-facet")


@attr.define
class SourceDatasetFacet(DatasetFacet):
    """A source as the run read it: its kind and the fingerprint of what it read."""

    source: str
    kind: str
    fingerprint: str

    @staticmethod
    def _get_schema() -> str:
        return _schema("source-dataset-facet")


@attr.define
class PublicationDatasetFacet(DatasetFacet):
    """Where and under which idempotency key the run publishes, and what the provider reported."""

    provider: str
    location: str
    mode: str
    publicationKey: str
    publicationRef: str | None = None
    datasourceRef: str | None = None
    materializationRef: str | None = None
    outputDigest: str | None = None

    @staticmethod
    def _get_schema() -> str:
        return _schema("publication-dataset-facet")


def run_uuid(run_id: str) -> str:
    """The OpenLineage runId of a run: stable, so every event of the run names the same run."""
    return str(uuid.uuid5(RUN_ID_NAMESPACE, run_id))


def event_id(module: str, subject_id: str, seq: int) -> str:
    """The stable id of the event derived from one entry: a redelivery carries the same id."""
    return str(uuid.uuid5(EVENT_ID_NAMESPACE, f"{module}\x00{subject_id}\x00{seq}"))


def event_time(recorded_at_us: int) -> str:
    """The entry's database-clock time as an ISO 8601 instant in UTC."""
    instant = dt.datetime.fromtimestamp(recorded_at_us / 1_000_000, tz=dt.UTC)
    return instant.isoformat(timespec="microseconds").replace("+00:00", "Z")


def dataset_namespace(namespace: str, tenant: str) -> str:
    """A tenant's datasets live under the configured namespace and the tenant's name."""
    return f"{namespace}/{tenant}"


def job_name(run: DataflowRun) -> str:
    return f"{run.tenant}.{run.definition_name}"


def event_for(run: DataflowRun, entry: Entry, chain: Sequence[Entry], namespace: str) -> RunEvent | None:
    """The event one entry of ``run``'s chain becomes, or None. ``chain`` is the run's chain (entries after
    ``entry`` are ignored: an event says what was known when its entry committed)."""
    state = EVENT_TYPES.get(entry.kind)
    if entry.module != DATAFLOW_MODULE or entry.subject_id != run.run_id or state is None:
        return None
    earlier = [e for e in chain if e.seq <= entry.seq]
    return RunEvent(
        eventType=state,
        eventTime=event_time(entry.recorded_at_us),
        producer=PRODUCER,
        run=Run(runId=run_uuid(run.run_id), facets={**_run_facets(entry), **_parent(run, namespace)}),
        job=_job(run, namespace),
        inputs=[] if state == RunState.START else _inputs(run, earlier, namespace),
        outputs=_outputs(run, entry, earlier, namespace),
    )


def _run_facets(entry: Entry) -> dict[str, RunFacet]:
    facets: dict[str, RunFacet] = {
        f"{FACET_PREFIX}ledgerEntry": LedgerEntryRunFacet(
            eventId=event_id(entry.module, entry.subject_id, entry.seq), module=entry.module,
            subjectId=entry.subject_id, seq=entry.seq, kind=entry.kind, attempt=entry.attempt,
            entryHash=entry.entry_hash, producer=PRODUCER,
        ),
    }  # fmt: skip
    reason = _text(entry.payload.get("reason") or entry.payload.get("message"))
    if EVENT_TYPES[entry.kind] == RunState.FAIL:
        code = _text(entry.payload.get("code")) or FAIL_CODES.get(entry.kind, "failed")
        facets[f"{FACET_PREFIX}error"] = ErrorRunFacet(code=code, message=reason, producer=PRODUCER)
        facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
            message=reason or code, programmingLanguage="python", producer=PRODUCER
        )
    if entry.kind in OUTCOME_UNKNOWN_KINDS:
        facets[f"{FACET_PREFIX}outcome"] = OutcomeRunFacet(
            outcome="outcome_unknown", mayHavePublished=True, kind=entry.kind, reason=reason, producer=PRODUCER
        )
    if entry.kind in RECONCILE_FINDINGS:
        facets[f"{FACET_PREFIX}reconcile"] = ReconcileRunFacet(
            finding=RECONCILE_FINDINGS[entry.kind], reason=reason, producer=PRODUCER
        )
    return facets


# Idempotency-key prefixes of the runs a schedule tick or a backfill day submits (schedules.schedule_key,
# backfill): ``<prefix>:<tenant>:<schedule or definition name>:<tick or day>``.
PARENT_PREFIXES = ("schedule", "backfill")


def _parent(run: DataflowRun, namespace: str) -> dict[str, RunFacet]:
    """The parent run facet of a scheduled or backfilled run: the schedule (or the definition's backfill)
    as the parent job, its tick (or day) as the parent run. The key starts with the run's own tenant, so
    the parent names nothing of another tenant."""
    parts = run.idempotency_key.split(":", 3)
    if len(parts) != 4 or parts[0] not in PARENT_PREFIXES or parts[1] != run.tenant or not parts[2]:
        return {}
    kind, tenant, name, _ = parts
    facet = parent_run.ParentRunFacet(
        run=parent_run.Run(runId=run_uuid(f"parent:{run.idempotency_key}")),
        job=parent_run.Job(namespace=namespace, name=f"{tenant}.{kind}.{name}"),
        producer=PRODUCER,
    )
    return {"parent": facet}


def _job(run: DataflowRun, namespace: str) -> Job:
    facets: dict[str, JobFacet] = {
        "jobType": job_type_job.JobTypeJobFacet(
            processingType="BATCH", integration="DURABLE_DATAFLOW", jobType="DATAFLOW", producer=PRODUCER
        ),
        f"{FACET_PREFIX}definition": DefinitionJobFacet(
            tenant=run.tenant, name=run.definition_name, definitionHash=run.definition_hash,
            mode=str(run.mode), producer=PRODUCER,
        ),
    }  # fmt: skip
    return Job(namespace=namespace, name=job_name(run), facets=facets)


def _latest_payload(entries: Sequence[Entry], kinds: Sequence[str]) -> Mapping[str, Any] | None:
    for entry in reversed(entries):
        if entry.kind in kinds:
            return entry.payload
    return None


def _inputs(run: DataflowRun, earlier: Sequence[Entry], namespace: str) -> list[InputDataset]:
    payload = _latest_payload(earlier, SOURCES_KINDS)
    listed = payload.get("sources") if payload is not None else None
    if not isinstance(listed, list):
        return []
    inputs: list[InputDataset] = []
    for source in listed:
        if not isinstance(source, Mapping):
            continue
        name, kind, fingerprint = (_text(source.get(field)) for field in ("source", "kind", "fingerprint"))
        facet = SourceDatasetFacet(source=name, kind=kind, fingerprint=fingerprint, producer=PRODUCER)
        inputs.append(InputDataset(
            namespace=dataset_namespace(namespace, run.tenant), name=f"{run.definition_name}.{name}",
            facets={f"{FACET_PREFIX}source": facet},
        ))  # fmt: skip
    return inputs


def _outputs(run: DataflowRun, entry: Entry, earlier: Sequence[Entry], namespace: str) -> list[OutputDataset]:
    """The target's datasource on the events that say it was (or may have been) published to."""
    state = EVENT_TYPES[entry.kind]
    may_have = state == RunState.COMPLETE or entry.kind in OUTCOME_UNKNOWN_KINDS or entry.kind in RECONCILE_FINDINGS
    authorized = _latest_payload(earlier, (evidence.DISPATCH_AUTHORIZED,))
    target = run.target
    if not may_have or target is None or authorized is None:
        return []
    refs = _latest_payload(earlier, REFERENCE_KINDS) if state == RunState.COMPLETE else None
    publication = PublicationDatasetFacet(
        provider=_text(target.get("provider")), location=_text(target.get("location")),
        mode=_text(target.get("mode")), publicationKey=_text(authorized.get("publication_idempotency_key")),
        publicationRef=_optional(refs, "publication_ref"), datasourceRef=_optional(refs, "datasource_ref"),
        materializationRef=_optional(refs, "materialization_ref"),
        outputDigest=_optional(authorized, "output_digest"), producer=PRODUCER,
    )  # fmt: skip
    facets: dict[str, DatasetFacet] = {f"{FACET_PREFIX}publication": publication}
    if publication.publicationRef:
        facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(
            datasetVersion=publication.publicationRef, producer=PRODUCER
        )
    name = _text(target.get("datasource"))
    return [OutputDataset(namespace=dataset_namespace(namespace, run.tenant), name=name, facets=facets)]


def _optional(payload: Mapping[str, Any] | None, field: str) -> str | None:
    value = None if payload is None else payload.get(field)
    return value if isinstance(value, str) and value else None


def _text(value: Any) -> str:
    return value[:MESSAGE_CHARS_MAX] if isinstance(value, str) else ""
