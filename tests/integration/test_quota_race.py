"""Two concurrent submits cannot both take a tenant's last queued slot, nor two concurrent applies its last
schedule slot (issue 29, item 1): on PostgreSQL the quota check and the insert are one step per tenant
(quotas.take_tenant_turn), proved with two real concurrent connections whose inserts are held at the same
moment."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml

from durable_dataflow.core.errors import DataflowError, QuotaExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.protocol import quotas
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.platform import Platform
from support import flows

pytestmark = pytest.mark.postgres
TENANT = "acme"
WAIT_S = 30.0


@pytest.fixture
def platform(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Platform]:
    """A platform on PostgreSQL where tenant acme may hold one queued run and one applied schedule."""
    path = tmp_path / "quotas.yaml"
    path.write_text(yaml.safe_dump({"tenants": {TENANT: {"queued_runs": 1, "applied_schedules": 1}}}))
    monkeypatch.setenv(quotas.QUOTAS_ENV, str(path))
    with Platform(pg_url) as opened:
        yield opened


def _request(tmp_path: Path, key: str) -> RunRequest:
    return RunRequest(
        definition=Definition.model_validate(flows.daily_flow()), base_dir=tmp_path, parameters={"day": "2026-03-01"},
        access=AccessContext(tenant=TENANT, principal="p", roles=("submitter",)),
        provenance=Provenance(actor="p", trigger="api"), idempotency_key=key,
    )  # fmt: skip


def _waiting(admin: psycopg.Connection[tuple[object, ...]], count: int) -> None:
    """Wait (bounded) until ``count`` backends of the test's database wait for a lock (any kind: a relation,
    an advisory lock, another transaction's row)."""
    deadline = time.monotonic() + WAIT_S
    query = (
        "select count(*) from pg_locks l join pg_stat_activity a on a.pid = l.pid "
        "where not l.granted and a.datname = current_database()"
    )
    while (row := admin.execute(query).fetchone()) is None or int(str(row[0])) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {count} lock requests waited within {WAIT_S}s")
        time.sleep(0.01)  # polling pg_locks: waits on the condition, with a deadline


def test_two_concurrent_submits_cannot_both_take_the_last_queued_slot(
    platform: Platform, pg_url: str, tmp_path: Path
) -> None:
    """Proves that with a queued_runs quota of 1, two submits whose transactions overlap record one run and
    refuse the other with QuotaExceeded. A third connection holds a SHARE lock on dataflow_runs, so the first
    submit counts, passes and waits at its insert; the second is started only then. Without the tenant's
    turn the second also counts 0 (READ COMMITTED sees no uncommitted row) and both are recorded."""
    outcomes: dict[str, str] = {}

    def submit(key: str) -> None:
        try:
            outcomes[key] = platform.runs.submit(_request(tmp_path, key)).run.status
        except QuotaExceeded as error:
            outcomes[key] = f"refused {error.quota}"
        except DataflowError as error:  # reported, so the assertion below names it
            outcomes[key] = f"error {error.code}"

    libpq = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(libpq, autocommit=True) as admin, psycopg.connect(libpq) as blocker:
        blocker.execute("lock table dataflow_runs in share mode")  # inserts wait, counts do not
        first = threading.Thread(target=submit, args=("first",))
        first.start()
        _waiting(admin, 1)  # the first has counted and waits at its insert
        second = threading.Thread(target=submit, args=("second",))
        second.start()
        _waiting(admin, 2)  # the second waits too: for the tenant's turn (or, unguarded, at its insert)
        blocker.commit()
        first.join(WAIT_S)
        second.join(WAIT_S)
    assert outcomes == {"first": "queued", "second": "refused queued_runs"}


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("first", "second"), {"first": "created", "second": "refused applied_schedules"}),
        (("same", "same"), {"same-0": "created", "same-1": "not created"}),
    ],
    ids=["two-new-names", "one-name-twice"],
)
def test_two_concurrent_applies_cannot_both_take_the_last_schedule_slot(
    platform: Platform, pg_url: str, tmp_path: Path, names: tuple[str, str], expected: dict[str, str]
) -> None:
    """Proves that with an applied_schedules quota of 1, two applies of new names whose transactions overlap
    store one schedule and refuse the other with QuotaExceeded (measured before the fix: 304 schedules under
    a quota of 300), while two overlapping applies of one new name both succeed (the second applies over the
    first: re-applying a name is never refused). A third connection holds a SHARE lock on the schedules
    table, so the first apply passes its check and waits at its insert; the second is started only then and
    must wait for the tenant's turn before it reads or counts."""
    outcomes: dict[str, str] = {}
    access = AccessContext(tenant=TENANT, principal="p", roles=("operator",))

    def apply(name: str, label: str, hour: int) -> None:
        schedule = {"cron": f"0 {hour} * * *", "parameters": {"day": "{{ tick.date }}"}}
        definition = Definition.model_validate(flows.daily_flow(schedule, name=name))
        try:
            created = schedules.apply(platform.runs, definition, workspace.local(tmp_path), access).created
            outcomes[label] = "created" if created else "not created"
        except QuotaExceeded as error:
            outcomes[label] = f"refused {error.quota}"
        except DataflowError as error:  # reported, so the assertion below names it
            outcomes[label] = f"error {error.code}"

    labels = list(names) if names[0] != names[1] else [f"{names[0]}-{i}" for i in range(2)]
    libpq = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(libpq, autocommit=True) as admin, psycopg.connect(libpq) as blocker:
        blocker.execute("lock table schedules in share mode")  # inserts wait, counts do not
        first = threading.Thread(target=apply, args=(names[0], labels[0], 6))
        first.start()
        _waiting(admin, 1)  # the first has counted and waits at its insert
        second = threading.Thread(target=apply, args=(names[1], labels[1], 7))
        second.start()
        _waiting(admin, 2)  # the second waits too: for the tenant's turn (or, unguarded, at its insert)
        blocker.commit()
        first.join(WAIT_S)
        second.join(WAIT_S)
    assert outcomes == expected
    assert [s.name for s in schedules.list_applied(platform.db, TENANT)] == [names[0]]
