"""Every field the ledger records about a run, against a value computed independently (issue 13, item 8).

Removing ``definition_hash``, ``request_hash`` and ``access_context_digest`` from ``run.recorded`` once left the
whole suite green. These tests fail when any recorded field is dropped or wrong:

* ``run.recorded``: each of its fields, for an atomic and a forward-recovery run, recorded inline (record+claim
  in one commit) and queued (submit, then a worker's claim);
* ``result.committed`` (atomic) and ``dispatch.authorized`` (forward): the output digest against the stored
  result bytes and against a table built here, the row count, each source's fingerprint recomputed from the
  files (CSV bytes, Parquet footers) and the inline rows, their digest, and for forward runs the publication
  key, its digest and the target;
* the run projection (``RunService.get``) carries the same values as the ledger;
* fingerprints are stable across a second run (a new key, not a replay) on unchanged data, and change when a
  source file changes.

Expected values follow the documented formulas (docs/cli.md "run --json", docs/engines.md "What each source
fingerprint proves"), computed from the inputs of the test, never read back from the code under test.
"""

from __future__ import annotations

import decimal
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import rfc8785

from durable_dataflow.core import hashing, ledger
from durable_dataflow.dataflow.definitions.definitions import (
    Definition,
    canonical_body,
    definition_hash,
    parse_definition,
)
from durable_dataflow.dataflow.execution import arrowdigest, results
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest, request_hash
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.platform import Platform
from support import flows

TENANT = "acme-rf"
PRINCIPAL = "rf-tester"
ROLES = ("operator", "analyst")
SCOPES = ("runs:write", "runs:read")
AUTH_METHOD = "test-token"
MAX_ATTEMPTS = 4  # not the default (3): a field filled with the default is caught
FACTOR = 3  # not the parameter's default (1): parameters missing from the request hash are caught
PROVENANCE = Provenance(
    actor="rf-actor",
    trigger="api",
    host="rf-host.example",
    client_version="9.8.7-rf",
    parent_run="01890000-0000-7000-8000-000000000001",
    requested_at="2026-01-02T03:04:05.678+00:00",
)
EXPECTED_PROVENANCE = {
    "actor": "rf-actor",
    "trigger": "api",
    "host": "rf-host.example",
    "client_version": "9.8.7-rf",
    "parent_run": "01890000-0000-7000-8000-000000000001",
    "requested_at": "2026-01-02T03:04:05.678+00:00",
}
TARGET_GIVEN = {
    "type": "datasources.publication",
    "provider": "parquet",
    "datasource": "analytics.rf_totals",
    "location": "sink",
}
# The target as the definition normalizes it (defaults filled), which is what the run records.
TARGET_RECORDED = {**TARGET_GIVEN, "mode": "append", "options": {}}
RECORDED_FIELDS = (
    "run_id", "tenant", "idempotency_key", "definition_hash", "request_hash",
    "mode", "provenance", "access_context_digest", "max_attempts",
)  # fmt: skip
RESULT_FORMAT = "arrow-ipc-stream+digest-v3"

ORDERS_CSV = "region,amount\nnorth,10.50\nsouth,4.25\nnorth,1.00\nwest,7.00\n"
REGION_FILES = {"part-0.parquet": ["north"], "part-1.parquet": ["south", "west"]}
EXCLUDED_ROWS = [{"region": "west"}]
# Source names in definition order are NOT in sorted order, so a digest that skips the sort is caught.
SOURCE_ORDER = ("orders", "regions", "excluded")
SQL = (
    "select o.region, (sum(o.amount) * $factor)::DECIMAL(18,2) as total, count(*)::BIGINT as n "
    "from orders o join regions r on o.region = r.region "
    "where o.region not in (select region from excluded) group by o.region order by o.region"
)
OUTPUT_SCHEMA = pa.schema(
    [pa.field("region", pa.string()), pa.field("total", pa.decimal128(18, 2)), pa.field("n", pa.int64())]
)


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=30) as opened:
        yield opened


# ---- inputs and independent expectations ------------------------------------------------------------------


def _document(forward: bool) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "rf_totals_forward" if forward else "rf_totals",
        "version": 1,
        "parameters": {"factor": {"type": "int", "default": 1}},
        "sources": {
            "orders": {"kind": "csv", "path": "orders.csv", "schema": {"region": "string", "amount": "decimal(12,2)"}},
            "regions": {"kind": "parquet", "path": "regions"},
            "excluded": {"kind": "inline", "rows": EXCLUDED_ROWS, "schema": {"region": "string"}},
        },
        "steps": [{"name": "totals", "sql": SQL}],
        "output": {"schema": {"region": "string", "total": "decimal(18,2)", "n": "int64"}, "max_rows": 100,
                   "max_bytes": "1MiB"},
    }  # fmt: skip
    if forward:
        document["target"] = dict(TARGET_GIVEN)
    return document


def _definition(forward: bool) -> Definition:
    return parse_definition(json.dumps(_document(forward)), "<test_recorded_fields>")


def _write_sources(base: Path, orders: str = ORDERS_CSV, regions: Mapping[str, list[str]] = REGION_FILES) -> None:
    (base / "orders.csv").write_text(orders)
    folder = base / "regions"
    folder.mkdir(exist_ok=True)
    for name, values in regions.items():
        pq.write_table(pa.table({"region": pa.array(values, pa.string())}), folder / name)


def _access() -> AccessContext:
    return AccessContext(TENANT, PRINCIPAL, ROLES, SCOPES, AUTH_METHOD)


def _request(defn: Definition, base: Path, key: str | None) -> RunRequest:
    return RunRequest(
        defn, base, {"factor": str(FACTOR)}, _access(), PROVENANCE, idempotency_key=key, max_attempts=MAX_ATTEMPTS
    )


def _sha256_prefixed(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _canonical_digest(value: Any) -> str:
    """sha256 over RFC 8785 canonical JSON, computed here without core.hashing."""
    return _sha256_prefixed(bytes(rfc8785.dumps(value)))


def _expected_access_digest() -> str:
    """docs/cli.md: digest of {tenant, principal, roles, scopes, auth_method} (lists sorted)."""
    return _canonical_digest({
        "tenant": TENANT, "principal": PRINCIPAL, "roles": sorted(ROLES), "scopes": sorted(SCOPES),
        "auth_method": AUTH_METHOD,
    })  # fmt: skip


def _expected_definition_hash(forward: bool) -> str:
    """The digest of the canonical body of a freshly parsed copy of the document (no per-object cache)."""
    return _canonical_digest(canonical_body(_definition(forward)))


def _expected_request_hash(forward: bool) -> str:
    """docs/cli.md: digest of {definition_hash, parameters, target} (typed parameters, not provenance/key)."""
    target = TARGET_RECORDED if forward else None
    return _canonical_digest(
        {"definition_hash": _expected_definition_hash(forward), "parameters": {"factor": FACTOR}, "target": target}
    )


def _csv_fingerprint(base: Path) -> str:
    return _sha256_prefixed((base / "orders.csv").read_bytes())


def _parquet_file_fingerprint(path: Path) -> str:
    """docs/engines.md: sha256({size, sha256(footer)}), the footer read here from the file's tail."""
    data = path.read_bytes()
    assert data[-4:] == b"PAR1"
    footer_length = int.from_bytes(data[-8:-4], "little")
    footer = data[-8 - footer_length : -8]
    return _canonical_digest({"size": str(len(data)), "footer": _sha256_prefixed(footer)})


def _parquet_folder_fingerprint(folder: Path) -> str:
    """A folder: the digest of [relative name, file fingerprint] pairs in name order."""
    files = sorted(folder.glob("*.parquet"))
    assert files
    return _canonical_digest({"files": [[p.name, _parquet_file_fingerprint(p)] for p in files]})


def _inline_fingerprint() -> str:
    """docs/engines.md: the output digest of the typed inline rows (a table built here)."""
    typed = pa.table({"region": pa.array([row["region"] for row in EXCLUDED_ROWS], pa.string())})
    return arrowdigest.output_digest(typed)


def _expected_sources(base: Path) -> list[dict[str, str]]:
    """Per source {source, kind, fingerprint}, in definition order."""
    return [
        {"source": "orders", "kind": "csv", "fingerprint": _csv_fingerprint(base)},
        {"source": "regions", "kind": "parquet", "fingerprint": _parquet_folder_fingerprint(base / "regions")},
        {"source": "excluded", "kind": "inline", "fingerprint": _inline_fingerprint()},
    ]


def _expected_source_digest(sources: list[dict[str, str]]) -> str:
    """docs/cli.md: digest of the sorted {source, kind, fingerprint} list."""
    ordered = sorted(sources, key=lambda e: (e["source"], e["kind"], e["fingerprint"]))
    return _canonical_digest(ordered)


def _expected_table() -> pa.Table:
    """The result the SQL must produce from the files written by _write_sources."""
    return pa.Table.from_pydict(
        {
            "region": ["north", "south"],
            "total": [decimal.Decimal("11.50") * FACTOR, decimal.Decimal("4.25") * FACTOR],
            "n": [2, 1],
        },
        schema=OUTPUT_SCHEMA,
    )


def _expected_idempotency_digest(key: str, output_digest: str) -> str:
    """docs/cli.md: digest of {publication_idempotency_key, output_digest, target}."""
    return hashing.digest({"publication_idempotency_key": key, "output_digest": output_digest,
                           "target": TARGET_RECORDED})  # fmt: skip


# ---- driving runs through the public service -------------------------------------------------------------


@dataclass(frozen=True)
class Done:
    run: Run
    entries: list[ledger.Entry]

    def one(self, kind: str) -> Mapping[str, Any]:
        found = [e for e in self.entries if e.kind == kind]
        assert len(found) == 1, f"expected one {kind} entry, got {[e.kind for e in self.entries]}"
        return found[0].payload


def _drive(platform: Platform, request: RunRequest, path: str) -> Done:
    """Run the request to its end: inline (``run_inline``) or queued (``submit``, then a worker's claim)."""
    if path == "inline":
        submission = platform.runs.run_inline(request)
    else:
        submission = platform.runs.submit(request)
        assert submission.created
        claim = platform.runs.claim_next()
        assert claim is not None and claim.run.run_id == submission.run.run_id
        platform.runs.execute(claim)
    assert submission.created
    run = platform.runs.get(submission.run.run_id)
    assert (run.status, run.recovery_status) == ("succeeded", "verified"), (run.error_code, run.error_message)
    with platform.db.read() as conn:
        entries = ledger.read(conn, "dataflow", run.run_id)
    return Done(run, entries)


def _stored_digest(platform: Platform, run_id: str) -> tuple[str, int]:
    """The output digest recomputed from the stored result bytes, and their row count."""
    table = results.decode_ipc(platform.runs.result_bytes(run_id))
    return arrowdigest.output_digest(table), table.num_rows


def _assert_fields(what: str, payload: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    missing = sorted(set(expected) - set(payload))
    assert not missing, f"{what} lacks {missing}; it holds {sorted(payload)}"
    wrong = {k: (payload[k], v) for k, v in expected.items() if payload[k] != v}
    assert not wrong, f"{what}: field -> (recorded, expected): {wrong}"


# ---- run.recorded -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["inline", "queued"])
@pytest.mark.parametrize("mode", ["atomic", "forward_recovery"])
def test_run_recorded_fields_equal_independent_values(platform: Platform, tmp_path: Path, mode: str, path: str) -> None:
    """Each field of run.recorded equals a value computed here, and so does the projection's copy of it."""
    forward = mode == "forward_recovery"
    _write_sources(tmp_path)
    defn = _definition(forward)
    key = f"rf-{mode}-{path}" if path == "inline" else None  # without a key the run gets run:<run_id>
    done = _drive(platform, _request(defn, tmp_path, key), path)
    run_id = done.run.run_id
    assert done.entries[0].kind == "run.recorded" and done.entries[0].attempt == 0
    recorded = done.one("run.recorded")

    d_hash = _expected_definition_hash(forward)
    assert definition_hash(defn) == d_hash  # the module's function agrees with the documented formula
    assert definition_hash(platform.runs.definition_of(done.run)) == d_hash  # and the pinned, stored body
    r_hash = _expected_request_hash(forward)
    assert request_hash(definition_hash(defn), {"factor": FACTOR}, TARGET_RECORDED if forward else None) == r_hash
    access_digest = _expected_access_digest()
    assert _access().digest() == access_digest
    expected: dict[str, Any] = {
        "run_id": run_id,
        "tenant": TENANT,
        "idempotency_key": key if key is not None else f"run:{run_id}",
        "definition_hash": d_hash,
        "request_hash": r_hash,
        "mode": mode,
        "provenance": EXPECTED_PROVENANCE,
        "access_context_digest": access_digest,
        "max_attempts": MAX_ATTEMPTS,
    }
    assert tuple(expected) == RECORDED_FIELDS
    _assert_fields("run.recorded", recorded, expected)
    assert all(hashing.is_digest(recorded[k]) for k in ("definition_hash", "request_hash", "access_context_digest"))

    projection = done.run.model_dump()
    _assert_fields("the run projection", projection, expected)
    assert projection["principal"] == PRINCIPAL
    assert projection["parameters"] == {"factor": FACTOR}
    assert projection["target"] == (TARGET_RECORDED if forward else None)
    assert projection["definition_name"] == defn.name


def test_recorded_digests_tell_requests_apart(platform: Platform, tmp_path: Path) -> None:
    """The recorded digests cover what they claim: another parameter value changes request_hash only; another
    role or scope changes access_context_digest only; another definition changes both hashes."""
    _write_sources(tmp_path)
    defn = _definition(False)
    base = _drive(platform, _request(defn, tmp_path, "rf-base"), "inline").one("run.recorded")

    other_param = RunRequest(
        defn, tmp_path, {"factor": "5"}, _access(), PROVENANCE, idempotency_key="rf-param", max_attempts=MAX_ATTEMPTS
    )
    by_param = _drive(platform, other_param, "inline").one("run.recorded")
    assert by_param["definition_hash"] == base["definition_hash"]
    assert by_param["request_hash"] != base["request_hash"]
    assert by_param["request_hash"] == _canonical_digest(
        {"definition_hash": base["definition_hash"], "parameters": {"factor": 5}, "target": None}
    )

    for field, access in {
        "roles": AccessContext(TENANT, PRINCIPAL, ("operator",), SCOPES, AUTH_METHOD),
        "scopes": AccessContext(TENANT, PRINCIPAL, ROLES, ("runs:read",), AUTH_METHOD),
        "principal": AccessContext(TENANT, "someone-else", ROLES, SCOPES, AUTH_METHOD),
        "auth_method": AccessContext(TENANT, PRINCIPAL, ROLES, SCOPES, "other-method"),
    }.items():
        request = RunRequest(
            defn, tmp_path, {"factor": str(FACTOR)}, access, PROVENANCE,
            idempotency_key=f"rf-access-{field}", max_attempts=MAX_ATTEMPTS,
        )  # fmt: skip
        by_access = _drive(platform, request, "inline").one("run.recorded")
        assert by_access["access_context_digest"] != base["access_context_digest"], field
        assert by_access["access_context_digest"] == access.digest(), field
        assert by_access["request_hash"] == base["request_hash"], field  # who asks is not what is asked

    renamed = Definition.model_validate({**_document(False), "name": "rf_totals_renamed"})
    by_defn = _drive(platform, _request(renamed, tmp_path, "rf-defn"), "inline").one("run.recorded")
    assert by_defn["definition_hash"] == _canonical_digest(canonical_body(renamed)) != base["definition_hash"]
    assert by_defn["request_hash"] != base["request_hash"]


# ---- result.committed and dispatch.authorized --------------------------------------------------------------


def _assert_result_facts(platform: Platform, done: Done, facts: Mapping[str, Any], base: Path) -> None:
    stored_digest, stored_rows = _stored_digest(platform, done.run.run_id)
    expected_table = _expected_table()
    assert stored_digest == arrowdigest.output_digest(expected_table), "the stored result is not the expected table"
    sources = _expected_sources(base)
    expected = {
        "output_digest": stored_digest,
        "row_count": str(expected_table.num_rows),
        "source_fingerprint_digest": _expected_source_digest(sources),
        "sources": sources,
        "format": RESULT_FORMAT,
    }
    _assert_fields(done.entries[2].kind, facts, expected)
    assert int(facts["row_count"]) == stored_rows == expected_table.num_rows == 2
    assert [s["source"] for s in facts["sources"]] == list(SOURCE_ORDER)


@pytest.mark.parametrize("path", ["inline", "queued"])
def test_result_committed_facts_atomic(platform: Platform, tmp_path: Path, path: str) -> None:
    """result.committed: output digest = the digest of the stored bytes (and of the expected table), row count,
    every source fingerprint and their digest recomputed here; run.succeeded and the projection agree."""
    _write_sources(tmp_path)
    done = _drive(platform, _request(_definition(False), tmp_path, "rf-atomic" if path == "inline" else None), path)
    assert [e.kind for e in done.entries] == ["run.recorded", "attempt.started", "result.committed", "run.succeeded"]
    facts = done.one("result.committed")
    _assert_result_facts(platform, done, facts, tmp_path)
    assert done.entries[2].attempt == 1
    assert done.one("run.succeeded")["output_digest"] == facts["output_digest"]
    assert "dispatch.authorized" not in [e.kind for e in done.entries]

    run = done.run
    assert run.output_digest == facts["output_digest"]
    assert run.row_count == int(facts["row_count"]) == 2
    assert run.source_fingerprint_digest == facts["source_fingerprint_digest"]
    assert run.publication_idempotency_key is None and run.publication_idempotency_digest is None
    assert run.target is None


@pytest.mark.parametrize("path", ["inline", "queued"])
def test_dispatch_authorized_facts_forward(platform: Platform, tmp_path: Path, path: str) -> None:
    """dispatch.authorized: the result facts as in atomic mode, plus the publication key dataflow/<tenant>/<run>,
    its digest over {key, output_digest, target} and the definition's target; the sink, the confirmation and the
    projection carry the same values."""
    _write_sources(tmp_path)
    defn = _definition(True)
    done = _drive(platform, _request(defn, tmp_path, "rf-forward" if path == "inline" else None), path)
    assert [e.kind for e in done.entries] == [
        "run.recorded", "attempt.started", "dispatch.authorized", "publication.confirmed", "run.succeeded",
    ]  # fmt: skip
    facts = done.one("dispatch.authorized")
    _assert_result_facts(platform, done, facts, tmp_path)
    assert done.entries[2].attempt == 1

    run = done.run
    # The sink key derives from the tenant and the idempotency key (forward.publication_key), written out here.
    key = f"dataflow/{TENANT}/key/{hashlib.sha256(run.idempotency_key.encode('utf-8')).hexdigest()}"
    assert defn.target is not None and defn.target.recorded() == TARGET_RECORDED
    expected = {
        "publication_idempotency_key": key,
        "publication_idempotency_digest": _expected_idempotency_digest(key, facts["output_digest"]),
        "target": TARGET_RECORDED,
    }
    _assert_fields("dispatch.authorized", facts, expected)
    assert expected["publication_idempotency_digest"] == _canonical_digest(
        {"publication_idempotency_key": key, "output_digest": _stored_digest(platform, run.run_id)[0],
         "target": TARGET_RECORDED}
    )  # fmt: skip

    assert done.one("publication.confirmed")["digest"] == facts["output_digest"]
    assert done.one("run.succeeded")["output_digest"] == facts["output_digest"]
    manifests = flows.manifests(tmp_path / "sink")
    assert len(manifests) == 1
    assert key in json.dumps(manifests[0]) and facts["output_digest"] in json.dumps(manifests[0])

    assert run.output_digest == facts["output_digest"]
    assert run.row_count == int(facts["row_count"]) == 2
    assert run.source_fingerprint_digest == facts["source_fingerprint_digest"]
    assert run.publication_idempotency_key == key
    assert run.publication_idempotency_digest == facts["publication_idempotency_digest"]
    assert run.target == facts["target"] == TARGET_RECORDED


# ---- fingerprints over re-runs ------------------------------------------------------------------------------


def _facts_kind(mode: str) -> str:
    return "dispatch.authorized" if mode == "forward_recovery" else "result.committed"


@pytest.mark.parametrize("mode", ["atomic", "forward_recovery"])
def test_fingerprints_are_stable_on_unchanged_data_and_follow_changed_files(
    platform: Platform, tmp_path: Path, mode: str
) -> None:
    """A second run (a new key, not a replay) over unchanged files records the same fingerprints and digests; after
    the CSV and one Parquet file change, their fingerprints and the digest change and match the new files, while
    the inline source's fingerprint stays."""
    forward = mode == "forward_recovery"
    kind = _facts_kind(mode)
    _write_sources(tmp_path)
    defn = _definition(forward)
    first = _drive(platform, _request(defn, tmp_path, f"rf-{mode}-1"), "inline")
    second = _drive(platform, _request(defn, tmp_path, f"rf-{mode}-2"), "inline")
    assert first.run.run_id != second.run.run_id
    one, two = first.one(kind), second.one(kind)
    for field in ("sources", "source_fingerprint_digest", "output_digest", "row_count"):
        assert one[field] == two[field], field
    assert one["sources"] == _expected_sources(tmp_path)
    assert (
        first.run.source_fingerprint_digest == second.run.source_fingerprint_digest == one["source_fingerprint_digest"]
    )
    if forward:  # the key and its digest name the run: never shared between two runs
        assert one["publication_idempotency_key"] != two["publication_idempotency_key"]
        assert one["publication_idempotency_digest"] != two["publication_idempotency_digest"]

    # Same rows, other bytes: the CSV's amounts are written differently and a Parquet file is rewritten with a
    # second row group, so the output (and the row count) stay while both files' fingerprints must change.
    _write_sources(tmp_path, orders=ORDERS_CSV.replace("10.50", "10.5").replace("1.00", "1.0"))
    pq.write_table(pa.table({"region": pa.array(["south", "west"], pa.string())}),
                   tmp_path / "regions" / "part-1.parquet", row_group_size=1)  # fmt: skip
    third = _drive(platform, _request(defn, tmp_path, f"rf-{mode}-3"), "inline")
    three = third.one(kind)
    by_source = {s["source"]: s["fingerprint"] for s in three["sources"]}
    before = {s["source"]: s["fingerprint"] for s in one["sources"]}
    assert by_source["orders"] != before["orders"]
    assert by_source["regions"] != before["regions"]
    assert by_source["excluded"] == before["excluded"]
    assert three["sources"] == _expected_sources(tmp_path)
    assert three["source_fingerprint_digest"] == _expected_source_digest(_expected_sources(tmp_path))
    assert three["source_fingerprint_digest"] != one["source_fingerprint_digest"]
    assert three["output_digest"] == one["output_digest"] and three["row_count"] == one["row_count"]
    assert third.run.source_fingerprint_digest == three["source_fingerprint_digest"]

    # Other rows: the output digest and row count follow the data.
    _write_sources(tmp_path, orders=ORDERS_CSV + "east,2.00\n", regions={"part-2.parquet": ["east"]})
    fourth = _drive(platform, _request(defn, tmp_path, f"rf-{mode}-4"), "inline")
    four = fourth.one(kind)
    assert four["row_count"] == "3" and fourth.run.row_count == 3
    assert four["output_digest"] == _stored_digest(platform, fourth.run.run_id)[0] != one["output_digest"]
    assert four["sources"] == _expected_sources(tmp_path)
    assert four["sources"][1]["fingerprint"] not in {by_source["regions"], before["regions"]}
