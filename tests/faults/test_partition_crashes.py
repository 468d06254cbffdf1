"""Crashes at every crash point during a partition publication (issue 27, item 6): after sweep and
reconcile (``--resume`` where absent) each partition holds exactly the rows of exactly one run — the run
recorded as its current publication (succeeded, with the highest partition token) — and no other day
is touched.

Each scenario has a day of its own. Run 1 publishes the day; run 2 of the same day (another key, other
rows) is SIGKILLed at the scenario's point in a real process (`dataflow run`, `dataflow submit` for
``after_record``; for ``after_inspect``, run 2 dies after dispatch authorization and then `dataflow
reconcile` dies once the sink answered its inspection). In an *overtaken* scenario, run 3 of the day
publishes while run 2 lies dead: run 2's retry (never authorized before) must then win, a resume of run 2
under its original, lower token must be refused ``superseded``, and a publication of run 2 found by
reconcile must stay replaced by run 3's. Then a sweep (the test's view of the database clock moved past the
leases), a drain of the recovered runs and a reconcile of every ``outcome_unknown`` run, in this process.

One platform database and one sink per combination of platform database (SQLite, PostgreSQL) and sink
(Delta, PostgreSQL table): SQLite + Delta and PostgreSQL + PostgreSQL meet every crash point, the two
other pairs the overtaken scenarios, so each database and each sink meets every scenario. The four run
side by side, each one's scenarios in turn (one process at a time writes to a sink). With the sinks'
partition-token check removed, the overtaken resumes replace the newer run's rows and these tests fail.
The sinks are read back without the platform: the Delta log replayed by hand and its live Parquet files
read with pyarrow (cross-checked with delta-rs), psycopg for PostgreSQL. Control days published once by
run 1 must keep their very rows (the same Delta files, the same PostgreSQL row versions).
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import psycopg
import pyarrow.parquet as pq
import pytest
import yaml

from durable_dataflow.core import crashpoints as cp
from durable_dataflow.core import ledger
from durable_dataflow.dataflow.protocol import evidence, forward, reconcile, runs, sweeper
from durable_dataflow.dataflow.protocol.forward import publication_key
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import MODULE, Run
from durable_dataflow.datasources.contract import SUPERSEDED
from durable_dataflow.platform import Platform
from faults import harness
from support.flows import delta_live_files
from support.pg import PostgresServer

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(600)]

LEASE_TTL_S = 30.0  # every process's lease: never lapses by itself during the test
PAST_LEASE_S = LEASE_TTL_S + 5.0  # how far a sweep moves this platform's view of the database clock
PG_TABLE = "public.daily_rows"
FIRST_DAY = dt.date(2024, 1, 1)
OPERATOR = AccessContext.local()
PROVENANCE = Provenance(actor="fault-test", trigger="cli")

# How run 2 recovers from a crash at each point of a forward run.
QUEUED = (cp.AFTER_RECORD,)  # recorded, never claimed: a worker runs it
RETRIED = (cp.AFTER_CLAIM, cp.AFTER_PREPARE, cp.DURING_EXECUTION, cp.BEFORE_PREDISPATCH_COMMIT)  # proven absent
ABSENT = (cp.AFTER_PREDISPATCH_COMMIT, cp.AFTER_INSPECT)  # authorized, the sink never saw it: resumed
PRESENT = (cp.AFTER_PROVIDER_CALL, cp.BEFORE_TERMINAL_COMMIT)  # the sink committed, the answer was lost
FINISHED = (cp.AFTER_TERMINAL_COMMIT,)  # everything was recorded


@dataclass(frozen=True)
class Scenario:
    point: str
    overtaken: bool  # run 3 of the day publishes while run 2 lies dead

    @property
    def id(self) -> str:
        return f"{self.point}-{'overtaken' if self.overtaken else 'alone'}"

    @property
    def kill_at(self) -> str:
        """Where run 2's own process dies (for after_inspect it is the reconcile that dies there)."""
        return cp.AFTER_PREDISPATCH_COMMIT if self.point == cp.AFTER_INSPECT else self.point

    @property
    def swept(self) -> str | None:
        """The first sweep's decision on run 2's dead attempt (None: nothing left to sweep)."""
        if self.point in RETRIED:
            return str(sweeper.Decision.RECOVERED)
        if self.point in ABSENT or self.point in PRESENT:
            return str(sweeper.Decision.OUTCOME_UNKNOWN)
        return None

    @property
    def winner(self) -> int:
        """The run whose rows the day ends with: the one authorized last. Run 2 is authorized after run 3
        only when it died before its authorization."""
        if not self.overtaken or self.point in QUEUED or self.point in RETRIED:
            return 2
        return 3

    @property
    def superseded(self) -> bool:
        """Run 2's resume under its original token comes after run 3's higher one: refused."""
        return self.overtaken and self.point in ABSENT


# Overtaken: one point of each way a crash ends where the partition token decides the winner.
OVERTAKEN = tuple(
    Scenario(point, True)
    for point in (cp.BEFORE_PREDISPATCH_COMMIT, cp.AFTER_PREDISPATCH_COMMIT, cp.AFTER_PROVIDER_CALL, cp.AFTER_INSPECT)
)
ALONE = tuple(Scenario(point, False) for point in cp.POINTS)
SCENARIOS = ALONE + OVERTAKEN
# Every platform database and every sink meets every scenario, each scenario on two of the four pairs:
# a crash is a process (a second or more of CPU, on a shared machine), and the full product would double
# the time for little more proof.
COMBOS: dict[tuple[str, str], tuple[Scenario, ...]] = {
    ("sqlite", "delta"): ALONE,
    ("postgres", "postgres"): ALONE,
    ("sqlite", "postgres"): OVERTAKEN,
    ("postgres", "delta"): OVERTAKEN,
}
CASES = [(combo, scenario) for combo, scenarios in COMBOS.items() for scenario in scenarios]
# The scenario days, and two control days around them that only run 1 ever publishes.
DAYS = {scenario: FIRST_DAY + dt.timedelta(days=i + 1) for i, scenario in enumerate(SCENARIOS)}
CONTROL_DAYS = (FIRST_DAY, FIRST_DAY + dt.timedelta(days=len(SCENARIOS) + 1))

# Each run of a day makes rows of its own: its tag in every row, its own factor and row count.
ITEMS: list[dict[str, Any]] = [{"item": item, "qty": qty} for item, qty in (("a", 1), ("b", 2), ("c", 3), ("d", 4))]
RUN_SHAPE = {1: (1, 4), 2: (10, 2), 3: (100, 3)}  # run number -> (factor, rows)

Row = tuple[str, str, int, str]  # day, item, qty, tag


def params(day: dt.date, number: int) -> dict[str, str]:
    factor, n = RUN_SHAPE[number]
    return {"day": day.isoformat(), "tag": f"run{number}-{day.isoformat()}", "factor": str(factor), "n": str(n)}


def expected_rows(run: Run) -> list[Row]:
    """What a run of the definition publishes, from its recorded parameters alone."""
    p = run.parameters or {}
    n, factor = int(p["n"]), int(p["factor"])
    rows = [(str(p["day"]), i["item"], int(i["qty"]) * factor, str(p["tag"])) for i in ITEMS if int(i["qty"]) <= n]
    return sorted(rows)


def key_of(day: dt.date, number: int) -> str:
    return f"partition-{day.isoformat()}-run{number}"


def write_definition(folder: Path, sink: str, secret: str) -> Path:
    folder.mkdir(parents=True)
    target: dict[str, Any] = {
        "type": "datasources.publication", "provider": sink, "datasource": "faults.daily_rows",
        "location": PG_TABLE if sink == "postgres" else "warehouse/daily_rows",
        "mode": "replace_partition", "partition": {"day": "$day"},
    }  # fmt: skip
    if sink == "postgres":
        target["options"] = {"dsn": {"secret": secret}}
    body = {
        "name": "daily_rows",
        "version": 1,
        "parameters": {
            "day": {"type": "date"},
            "tag": {"type": "string"},
            "factor": {"type": "int"},
            "n": {"type": "int"},
        },
        "sources": {"items": {"kind": "inline", "schema": {"item": "string", "qty": "int64"}, "rows": ITEMS}},
        "steps": [
            {
                "name": "rows",
                "sql": "select $day::DATE as day, item, qty * $factor as qty, $tag as tag from items "
                "where qty <= $n order by item",
            }
        ],
        "output": {
            "schema": {"day": "date", "item": "string", "qty": "int64", "tag": "string"},
            "max_rows": 100,
            "max_bytes": "64KiB",
        },
        "target": target,
    }
    path = folder / "dataflow.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


# ---- independent readers ------------------------------------------------------------------------


def _row(record: dict[str, Any]) -> Row:
    return (str(record["day"]), str(record["item"]), int(record["qty"]), str(record["tag"]))


def delta_rows(table: Path) -> list[Row]:
    """Every row of the table through the hand-replayed log and pyarrow, checked against delta-rs."""
    rows = []
    for path, values in delta_live_files(table).items():
        for record in pq.read_table(table / unquote(path)).to_pylist():
            rows.append(_row({**record, **values}))
    import deltalake

    by_delta_rs = [_row(r) for r in deltalake.DeltaTable(str(table)).to_pyarrow_table().to_pylist()]
    assert sorted(rows) == sorted(by_delta_rs), "the hand-replayed log and delta-rs disagree"
    return sorted(rows)


def postgres_rows(dsn: str) -> list[tuple[Row, str, str]]:
    """Every row of the sink table with its publication key and its row version (xmin, ctid)."""
    with psycopg.connect(dsn) as conn:
        found = conn.execute(
            f"select day, item, qty, tag, _publication_key, xmin::text || '/' || ctid::text from {PG_TABLE}"
        ).fetchall()
    return sorted((_row({"day": d, "item": i, "qty": q, "tag": t}), str(k), str(v)) for d, i, q, t, k, v in found)


# ---- one combination: a platform database and a sink, its scenarios one after the other ---------


@dataclass
class Outcome:
    """What a combination left behind, read once every run is terminal."""

    runs: dict[tuple[dt.date, int], Run] = field(default_factory=dict)
    entries: dict[str, list[ledger.Entry]] = field(default_factory=dict)
    tokens: dict[str, int | None] = field(default_factory=dict)  # run id -> authorized partition token
    swept: dict[str, list[str]] = field(default_factory=dict)  # run id -> the sweeps' decisions on it
    findings: dict[str, list[str]] = field(default_factory=dict)  # run id -> the reconciles' findings
    rows: dict[str, list[Row]] = field(default_factory=dict)  # day -> rows in the sink
    keys: dict[str, set[str]] = field(default_factory=dict)  # day -> publication keys on its rows (PostgreSQL)
    control_before: dict[str, Any] = field(default_factory=dict)
    control_after: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    log: Path | None = None


@dataclass
class Combo:
    engine: str
    sink: str
    platform: Platform
    url: str
    definition: Path
    dsn: str | None
    secret: str
    log: Path
    scenarios: tuple[Scenario, ...]
    outcome: Outcome = field(default_factory=Outcome)

    @property
    def days(self) -> tuple[dt.date, ...]:
        return (*CONTROL_DAYS, *(DAYS[s] for s in self.scenarios))

    @property
    def table(self) -> Path:
        return self.definition.parent / "warehouse" / "daily_rows"

    def env(self, crash_at: str | None = None) -> dict[str, str]:
        extra = {self.secret: self.dsn} if self.dsn else {}
        return harness.worker_env(self.url, lease_ttl_s=LEASE_TTL_S, crash_at=crash_at, extra=extra)

    def inline(self, day: dt.date, number: int) -> Run:
        request = harness.request_for(self.definition, params(day, number), key_of(day, number))
        run = self.platform.runs.run_inline(request).run
        assert run.status == "succeeded", (day, number, run.error_code, run.error_message)
        return run

    def killed(self, args: list[str], crash_at: str) -> None:
        """Run the `dataflow` command in its own process until it SIGKILLs itself at ``crash_at``."""
        code = harness.wait_exit(harness.start(args, self.env(crash_at), self.log), self.log)
        assert code == -signal.SIGKILL, f"not killed at {crash_at} (exit {code}):\n{harness.tail(self.log)}"

    def crash_run(self, day: dt.date, point: str) -> Run:
        """Run 2 of the day, killed at ``point``: `dataflow submit` (after_record) or `dataflow run`."""
        command = "submit" if point == cp.AFTER_RECORD else "run"
        args = [command, str(self.definition), "--idempotency-key", key_of(day, 2), "--json"]
        for name, value in params(day, 2).items():
            args += ["--param", f"{name}={value}"]
        self.killed(args, point)
        with self.platform.db.read() as conn:
            run = runs.find_by_key(conn, "default", key_of(day, 2))
        assert run is not None, "the killed run was lost"
        return run

    def sweep(self) -> None:
        self.platform.db.advance_clock(PAST_LEASE_S)
        try:
            decisions = sweeper.sweep(self.platform.db)
        finally:
            self.platform.db.advance_clock(-PAST_LEASE_S)
        for decision in decisions:
            self.outcome.swept.setdefault(decision.run_id, []).append(str(decision.decision))

    def drain(self) -> None:
        """Run every queued run in this process (the recovered attempts and the one only submitted)."""
        while (claim := self.platform.runs.claim_next()) is not None:
            self.platform.runs.execute(claim)

    def reconcile(self, run_id: str) -> None:
        """Reconcile as an operator would: inspect, and `--resume` when the key is proven absent."""
        found = reconcile.reconcile(self.platform.runs, run_id, access=OPERATOR, provenance=PROVENANCE)
        self.outcome.findings.setdefault(run_id, []).append(str(found.finding))
        if found.finding == reconcile.Finding.ABSENT:
            resumed = reconcile.reconcile(
                self.platform.runs, run_id, access=OPERATOR, provenance=PROVENANCE, resume=True
            )
            self.outcome.findings[run_id].append("resumed" if resumed.resumed else f"not resumed: {resumed.detail}")

    def control(self) -> dict[str, Any]:
        """The control days' rows, and what identifies them physically: the live Delta files holding them,
        or their PostgreSQL row versions."""
        days = {d.isoformat() for d in CONTROL_DAYS}
        rows = {day: found for day, found in self.read_rows().items() if day in days}
        if self.sink == "delta":
            files = sorted(path for path, values in delta_live_files(self.table).items() if values.get("day") in days)
            return {"rows": rows, "files": files}
        assert self.dsn is not None
        return {"rows": rows, "versions": sorted((r, v) for r, _, v in postgres_rows(self.dsn) if r[0] in days)}

    def play(self) -> Outcome:
        out = self.outcome
        out.log = self.log
        for day in self.days:
            self.inline(day, 1)
        out.control_before = self.control()
        second: dict[Scenario, Run] = {}
        for scenario in self.scenarios:
            day = DAYS[scenario]
            second[scenario] = self.crash_run(day, scenario.kill_at)
            if scenario.overtaken and scenario.point != cp.AFTER_INSPECT:
                self.inline(day, 3)
        self.sweep()
        for scenario, run in second.items():  # a reconcile dies once the sink answered its inspection
            if scenario.point == cp.AFTER_INSPECT:
                self.killed(["reconcile", run.run_id, "--json"], cp.AFTER_INSPECT)
        self.sweep()
        for scenario in self.scenarios:
            if scenario.overtaken and scenario.point == cp.AFTER_INSPECT:
                self.inline(DAYS[scenario], 3)
        self.drain()
        for run in second.values():
            if self.platform.runs.get(run.run_id).status == "outcome_unknown":
                self.reconcile(run.run_id)
        self.collect()
        return out

    def read_rows(self) -> dict[str, list[Row]]:
        by_day: dict[str, list[Row]] = {}
        if self.sink == "delta":
            rows = delta_rows(self.table)
        else:
            assert self.dsn is not None
            found = postgres_rows(self.dsn)
            rows = [row for row, _, _ in found]
            for row, key, _ in found:
                self.outcome.keys.setdefault(row[0], set()).add(key)
        for row in rows:
            by_day.setdefault(row[0], []).append(row)
        return by_day

    def collect(self) -> None:
        out = self.outcome
        with self.platform.db.read() as conn:
            for day in self.days:
                for number in (1, 2, 3):
                    run = runs.find_by_key(conn, "default", key_of(day, number))
                    if run is not None:
                        out.runs[(day, number)] = run
                        out.entries[run.run_id] = ledger.read(conn, MODULE, run.run_id)
                        out.tokens[run.run_id] = forward.authorized_partition_token(conn, run)
        out.control_after = self.control()
        out.keys.clear()
        out.rows = self.read_rows()
        publications = harness.delta_publications(self.table) if self.sink == "delta" else (
            harness.postgres_publications(self.dsn or "")
        )  # fmt: skip
        out.violations = harness.check(self.platform.db, publications).violations


def current_publication(outcome: Outcome, day: dt.date) -> Run | None:
    """The day's current publication as the platform records it: of its succeeded runs, the one whose
    dispatch authorization took the highest partition token."""
    succeeded = [r for (d, _), r in outcome.runs.items() if d == day and r.status == "succeeded"]
    if not succeeded:
        return None
    return max(succeeded, key=lambda r: outcome.tokens[r.run_id] or 0)


def _combo_id(combo: tuple[str, str]) -> str:
    return f"{combo[0]}-{combo[1]}"


def play_combo(engine: str, sink: str, server: PostgresServer, root: Path) -> Outcome:
    root.mkdir(parents=True)
    secret = f"PARTITION_CRASH_SINK_{engine}_{sink}".upper()
    dsn = None
    if sink == "postgres":
        dsn = harness.fresh_database(server, "psink").replace("postgresql+psycopg://", "postgresql://")
        os.environ[secret] = dsn  # the in-process platform resolves the target's DSN secret from here
    url = harness.fresh_database(server, "pcrash") if engine == "postgres" else f"sqlite:///{root}/dataflow.db"
    definition = write_definition(root / "definition", sink, secret)
    with harness.open_platform(url) as platform:
        log = root / "processes.log"
        combo = Combo(engine, sink, platform, url, definition, dsn, secret, log, COMBOS[(engine, sink)])
        return combo.play()


@pytest.fixture(scope="module")
def outcomes(postgres_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Any, Any]]:
    """Every combination played once, side by side (each with its own databases and folders)."""
    root = tmp_path_factory.mktemp("partition_crashes")
    saved = dict(os.environ)
    try:
        plays: dict[Any, Callable[[], Outcome]] = {
            combo: functools.partial(play_combo, *combo, postgres_server, root / _combo_id(combo)) for combo in COMBOS
        }
        yield harness.run_concurrently(plays)
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]


def _outcome(outcomes: dict[Any, Any], combo: tuple[str, str]) -> Outcome:
    outcome = outcomes[combo]
    if isinstance(outcome, BaseException):
        raise outcome
    assert isinstance(outcome, Outcome)
    return outcome


def test_every_crash_point_has_a_scenario() -> None:
    """A new crash point is never left out of the matrix, nor judged by a rule it was not meant for."""
    assert sorted([*QUEUED, *RETRIED, *ABSENT, *PRESENT, *FINISHED]) == sorted(cp.POINTS)
    assert sorted(s.point for s in SCENARIOS if not s.overtaken) == sorted(cp.POINTS)


@pytest.mark.parametrize(("combo", "scenario"), CASES, ids=[f"{_combo_id(c)}-{s.id}" for c, s in CASES])
def test_the_partition_holds_exactly_its_current_publications_rows(
    combo: tuple[str, str], scenario: Scenario, outcomes: dict[Any, Any]
) -> None:
    """Run 2 killed at the point, then sweep and reconcile: every run of the day is terminal, the day's
    current publication (highest partition token among its succeeded runs) is the run authorized last, and
    the partition holds exactly that run's rows — no copy of another run's, no mix."""
    outcome = _outcome(outcomes, combo)
    day = DAYS[scenario]
    first, second = outcome.runs[(day, 1)], outcome.runs[(day, 2)]
    third = outcome.runs.get((day, 3))
    context = (
        f"{scenario.id} on {day}: run 2 {second.status}/{second.recovery_status} attempt {second.attempt}, "
        f"swept {outcome.swept.get(second.run_id)}, reconciled {outcome.findings.get(second.run_id)}, "
        f"tokens {[outcome.tokens[r.run_id] for r in (first, second, third) if r is not None]}; ledger "
        f"{[(e.attempt, e.kind) for e in outcome.entries[second.run_id]]}\n{harness.tail(outcome.log or Path())}"
    )
    assert (third is not None) == scenario.overtaken, context
    assert all(str(r.status) in harness.TERMINAL for r in (first, second, third) if r is not None), context
    # The partition: exactly the rows of the day's current publication, read without the platform.
    current = current_publication(outcome, day)
    assert current is not None, context
    held = outcome.rows.get(day.isoformat())
    assert held == expected_rows(current), f"holds {held}; current: {current.idempotency_key}; {context}"
    if combo[1] == "postgres":
        assert outcome.keys.get(day.isoformat()) == {publication_key(current)}, context
    # The current publication is the run authorized last; the other runs ended as the protocol says.
    winner = {2: second, 3: third}[scenario.winner]
    assert winner is not None and current.run_id == winner.run_id, context
    if scenario.superseded:
        assert (second.status, second.error_code) == ("failed", "publication_rejected"), context
        assert second.error_message is not None and SUPERSEDED in second.error_message, context
        assert (outcome.tokens[second.run_id] or 0) < (outcome.tokens[winner.run_id] or 0), context
    else:
        assert second.status == "succeeded", context
    # Run 2 was recovered the way the protocol says for a crash at this point.
    swept = outcome.swept.get(second.run_id, [])
    assert swept[:1] == ([scenario.swept] if scenario.swept else []), context
    if scenario.point == cp.AFTER_INSPECT:
        assert swept == [str(sweeper.Decision.OUTCOME_UNKNOWN)] * 2, context
        assert (2, evidence.RECONCILE_STARTED) in [(e.attempt, e.kind) for e in outcome.entries[second.run_id]]
    findings = outcome.findings.get(second.run_id, [])
    if scenario.point in ABSENT:
        assert findings == ["absent", "resumed"], context
    elif scenario.point in PRESENT:
        assert findings == ["present"], context
    else:
        assert findings == [], context


@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_every_day_holds_one_runs_rows_and_the_control_days_are_untouched(
    combo: tuple[str, str], outcomes: dict[Any, Any]
) -> None:
    """The sink has rows of exactly the published days, each day exactly its current publication's; the
    control days keep their very rows (the same live Delta files, the same PostgreSQL row versions); no
    run is lost and the invariant checker finds nothing."""
    outcome = _outcome(outcomes, combo)
    days = (*CONTROL_DAYS, *(DAYS[s] for s in COMBOS[combo]))
    assert sorted(outcome.rows) == sorted(d.isoformat() for d in days)
    for day in days:
        current = current_publication(outcome, day)
        assert current is not None and outcome.rows[day.isoformat()] == expected_rows(current), day
    for day in CONTROL_DAYS:
        assert current_publication(outcome, day) == outcome.runs[(day, 1)]
    assert outcome.control_after == outcome.control_before
    assert outcome.violations == []
