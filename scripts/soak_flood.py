"""The soak's flood mode (`make soak SOAK_ARGS=--flood`, issue 29 item 7): a hostile tenant floods the
platform while the soak's own runs go on, and the soak measures how long its own runs wait in the queue.

Before the fleet starts, tenant ``flood`` applies SCHEDULES schedules (half of them disabled, all due
once a year) and queues QUEUED slow runs, ahead of every run of the soak's own tenant. While the fleet
works, INLINE_AT_ONCE threads of the soak process submit its inline runs, one after another, until
INLINE_RUNS have been asked for. Every refusal must be ``quota_exceeded`` (counted per quota); any other
error is a violation. The flood's runs are under the same faults, invariants and final checks as the
soak's own; its inline runs are left out of the fault rate (no worker runs them).

The soak's own runs must not wait behind the flood: of the first claims (``attempt.started``) made
while both tenants had runs queued, the soak's own must get at least OWN_SHARE_MIN (the fair claim
shares the slots, so its claims follow the runs' lengths: about 30% here; one global FIFO would give
none, the flood being queued first). The time from each own run's record to its first claim is reported
too (p50, p95, max); it includes waiting behind the soak's own earlier runs, so it is no test of
fairness by itself.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
import yaml

from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import DataflowError, QuotaExceeded
from durable_dataflow.core.schema import ledger_entries
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.protocol import evidence, quotas
from durable_dataflow.dataflow.protocol import runs as runs_module
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.platform import Platform

FLOOD_TENANT = "flood"
OWN_TENANT = "default"  # the soak's own runs (AccessContext.local())
SCHEDULES = 1_000  # schedules the flood applies before the fleet starts
QUEUED = 150  # slow runs it queues before the fleet starts, ahead of the soak's own
INLINE_AT_ONCE = 4  # its inline runs executing at once in the soak process
INLINE_RUNS = 40  # its inline runs asked for in all
INLINE_NAME = "flood_inline"  # the definition of its inline runs
FLOOD_RUNS = QUEUED + INLINE_RUNS  # the runs it may record, at most
FLOOD_ROWS = 20_000_000  # rows a flood run counts: a fraction of a second of one core
OVER_QUOTA = 50  # the flood's quotas (a quotas file) are this much below what it asks for: each refused
# Of the claims made while both tenants had runs queued, the least share the soak's own must get. The fair
# claim (the tenant with the fewest running runs first) shares the slots, not the claims: the flood's short
# runs free their slots sooner and are claimed more often (measured: about 30%). One global FIFO gives none.
OWN_SHARE_MIN = 0.15


@dataclass
class FloodStats:
    schedules_applied: int = 0
    queued: int = 0
    inline_runs: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # quota -> refusals
    violations: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _definition(name: str, *, schedule: dict[str, object] | None = None) -> Definition:
    body: dict[str, object] = {
        "name": name, "version": 1, "sources": {},
        "steps": [{"name": "r", "sql": f"select count(*)::bigint as n from range({FLOOD_ROWS})"}],
        "output": {"schema": {"n": "int64"}, "max_rows": 1, "max_bytes": "1MiB"},
    }  # fmt: skip
    if schedule is not None:
        body["schedule"] = schedule
    return Definition.model_validate(body)


class Flood:
    """The hostile tenant, on its own Platform in the soak process."""

    @classmethod
    def open(cls, url: str, work: Path) -> Flood:
        """The flood's quotas written to a quotas file that every platform of the soak reads (the
        environment is inherited by the workers), then its Platform opened."""
        path = work / "quotas.yaml"
        limits = {"applied_schedules": SCHEDULES - OVER_QUOTA, "queued_runs": QUEUED - OVER_QUOTA}
        path.write_text(yaml.safe_dump({"tenants": {FLOOD_TENANT: limits}}))
        os.environ[quotas.QUOTAS_ENV] = str(path)
        return cls(Platform(url), work)

    def __init__(self, platform: Platform, work: Path) -> None:
        self.platform, self.work = platform, work
        self.access = AccessContext.local(FLOOD_TENANT)
        self.stats = FloodStats()
        self._threads: list[threading.Thread] = []
        self._asked = 0

    def _request(self, definition: Definition, key: str) -> RunRequest:
        return RunRequest(
            definition=definition, base_dir=self.work, parameters={}, access=self.access,
            provenance=Provenance(actor="soak-flood", trigger="api"), idempotency_key=key,
        )  # fmt: skip

    def _refused(self, error: DataflowError) -> None:
        with self.stats.lock:
            if isinstance(error, QuotaExceeded):
                self.stats.refused[str(error.quota)] += 1
            else:
                self.stats.violations.append(f"flood: refused with {error.code}, not quota_exceeded: {error.message}")

    def before_fleet(self) -> None:
        """Apply the schedules and queue the slow runs (the soak's own are queued after them)."""
        space = workspace.local(self.work)
        for i in range(SCHEDULES):
            cron = {"cron": f"{i % 60} {i % 24} 1 1 *", "timezone": "UTC", "enabled": i % 2 == 0}
            try:
                schedules.apply(self.platform.runs, _definition(f"flood_{i}", schedule=cron), space, self.access)
                self.stats.schedules_applied += 1
            except DataflowError as error:
                self._refused(error)
        slow = _definition("flood_slow")
        for i in range(QUEUED):
            try:
                self.platform.runs.submit(self._request(slow, f"flood-q-{i}"))
                self.stats.queued += 1
            except DataflowError as error:
                self._refused(error)

    def start_inline(self) -> None:
        """INLINE_AT_ONCE threads submitting inline runs until INLINE_RUNS were asked for."""
        for _ in range(INLINE_AT_ONCE):
            thread = threading.Thread(target=self._inline_loop, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _next_key(self) -> str | None:
        with self.stats.lock:
            if self._asked >= INLINE_RUNS:
                return None
            self._asked += 1
            return f"flood-i-{self._asked}"

    def _inline_loop(self) -> None:
        slow = _definition(INLINE_NAME)
        while (key := self._next_key()) is not None:  # bounded: INLINE_RUNS keys in all
            try:
                self.platform.runs.run_inline(self._request(slow, key))
                with self.stats.lock:
                    self.stats.inline_runs += 1
            except DataflowError as error:
                self._refused(error)

    def stop(self) -> None:
        for thread in self._threads:
            thread.join()
        self.platform.close()

    def violations(self) -> list[str]:
        """Its errors other than quota_exceeded, and each quota refused other than OVER_QUOTA times."""
        found = list(self.stats.violations)
        for quota in ("applied_schedules", "queued_runs"):
            if self.stats.refused[quota] != OVER_QUOTA:
                found.append(f"flood: {quota} refused {self.stats.refused[quota]} requests, not {OVER_QUOTA}")
        return found

    def report(self) -> str:
        s = self.stats
        return (f"flood: tenant {FLOOD_TENANT!r} applied {s.schedules_applied} schedules, queued {s.queued} runs, "
                f"ran {s.inline_runs} inline; refused {dict(sorted(s.refused.items()))}")  # fmt: skip


def flood_runs(db: Database) -> tuple[int, int]:
    """The flood's recorded runs, and how many of them ran inline."""
    inline = sa.func.sum(sa.case((dataflow_runs.c.definition_name == INLINE_NAME, 1), else_=0))
    query = sa.select(sa.func.count(), sa.func.coalesce(inline, 0)).where(dataflow_runs.c.tenant == FLOOD_TENANT)
    with db.read() as conn:
        total, inline_count = conn.execute(query).one()
    return int(total), int(inline_count)


def first_claims(db: Database) -> list[tuple[str, int, int | None]]:
    """Every queued run's tenant, record instant and first ``attempt.started`` instant (None: never claimed),
    in µs; the flood's inline runs are left out (they start in their recording commit, no worker claims them)."""
    started = (
        sa.select(ledger_entries.c.subject_id, sa.func.min(ledger_entries.c.recorded_at_us).label("at"))
        .where(ledger_entries.c.module == runs_module.MODULE, ledger_entries.c.kind == evidence.ATTEMPT_STARTED)
        .group_by(ledger_entries.c.subject_id)
        .subquery()
    )
    query = (
        sa.select(dataflow_runs.c.tenant, dataflow_runs.c.created_at_us, started.c.at)
        .select_from(dataflow_runs.outerjoin(started, started.c.subject_id == dataflow_runs.c.run_id))
        .where(dataflow_runs.c.definition_name != INLINE_NAME)
    )
    with db.read() as conn:
        return [(str(t), int(c), None if a is None else int(a)) for t, c, a in conn.execute(query)]


def _queued_at(runs: list[tuple[int, int | None]], moment: int) -> bool:
    return any(created <= moment and (claimed is None or claimed > moment) for created, claimed in runs)


def fairness_summary(claims: list[tuple[str, int, int | None]]) -> tuple[str, list[str]]:
    """The printed lines and the violations: the soak's own runs' waits from record to claim (which include
    waiting behind its own earlier runs), and its share of the first claims made while both it and the
    flood had runs queued, which the fair claim keeps near one half and a global FIFO would make zero."""
    own = [(c, a) for t, c, a in claims if t == OWN_TENANT]
    flood = [(c, a) for t, c, a in claims if t == FLOOD_TENANT]
    waits = sorted((a - c) / 1e6 for c, a in own if a is not None)
    if not waits:
        return "flood: no run of the soak's own was claimed", ["flood: no run of the soak's own was claimed"]
    contested = [(t, a) for t, _, a in claims if a is not None and _queued_at(own, a - 1) and _queued_at(flood, a - 1)]
    share = sum(1 for t, _ in contested if t == OWN_TENANT) / max(len(contested), 1)
    p95 = waits[min(len(waits) - 1, round(0.95 * (len(waits) - 1)))]
    line = (f"flood: the soak's own runs waited from record to claim p50 {waits[len(waits) // 2]:.2f}s, p95 "
            f"{p95:.2f}s, max {waits[-1]:.2f}s ({len(waits)} runs, their own backlog included); of the "
            f"{len(contested)} claims made while both tenants had runs queued, {share:.0%} went to the soak's own "
            f"(required: at least {OWN_SHARE_MIN:.0%})")  # fmt: skip
    problems = [f"flood: the soak's own runs took {share:.0%} of the contested claims, below {OWN_SHARE_MIN:.0%}"]
    return line, problems if contested and share < OWN_SHARE_MIN else []
