"""Real processes racing on PostgreSQL: the fence admits only the current attempt, grants never repeat."""

from __future__ import annotations

import multiprocessing
from collections import Counter
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from durable_dataflow.core import leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.schema import leases as leases_table
from support import core_race

REPETITIONS = 100
RACERS = 4
GRANTS_PER_RACER = 25
JOIN_TIMEOUT_S = 240


def _run(target: Callable[..., None], argsets: list[tuple[Any, ...]]) -> None:
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=target, args=args) for args in argsets]
    for process in processes:
        process.start()
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        assert process.exitcode == 0, f"racer exited with {process.exitcode}"


def _drain(queue: Any, count: int) -> list[Any]:
    return [queue.get(timeout=30) for _ in range(count)]


def test_only_the_current_attempt_commits(pg_db: Database, pg_url: str) -> None:
    """Over 100 rounds, a process holding an expired attempt 1 and one holding the live attempt 2 commit
    at the same instant: attempt 2 always commits, attempt 1 never does, and the ledger shows it."""
    subjects = [f"subject-{n}" for n in range(REPETITIONS)]
    with pg_db.begin() as conn:
        for subject in subjects:
            leases.acquire(conn, pg_db, core_race.MODULE, subject, "old", 30)
        # Make every attempt 1 expire on the database clock, as if its holder had paused.
        conn.execute(leases_table.update().values(expires_at_us=leases_table.c.expires_at_us - 60_000_000))
        for subject in subjects:
            assert leases.acquire(conn, pg_db, core_race.MODULE, subject, "new", 60).attempt == 2
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    _run(
        core_race.commit_as,
        [(pg_url, 1, subjects, barrier, results), (pg_url, 2, subjects, barrier, results)],
    )
    outcomes = Counter((attempt, outcome) for _, attempt, outcome in _drain(results, 2 * REPETITIONS))
    assert outcomes == {(2, "committed"): REPETITIONS, (1, "stale"): REPETITIONS}
    with pg_db.read() as conn:
        for subject in subjects:
            assert [e.kind for e in ledger.read(conn, core_race.MODULE, subject)] == ["write.by.2"]


def test_concurrent_grants_never_share_an_attempt(pg_db: Database, pg_url: str) -> None:
    """Four processes take and release 25 leases each on one subject: the 100 attempts are exactly 1..100."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    _run(core_race.acquire_release, [(pg_url, "shared", GRANTS_PER_RACER, results)] * RACERS)
    attempts = _drain(results, RACERS * GRANTS_PER_RACER)
    assert sorted(attempts) == list(range(1, RACERS * GRANTS_PER_RACER + 1))


def test_first_grant_race_has_one_winner(pg_db: Database, pg_url: str) -> None:
    """Four processes race for the first lease of 50 new subjects: each subject has exactly one winner."""
    subjects = [f"fresh-{n}" for n in range(50)]
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(RACERS), context.Queue()
    _run(core_race.acquire_fresh, [(pg_url, subjects, barrier, results)] * RACERS)
    winners = Counter(subject for subject, attempt in _drain(results, RACERS * len(subjects)) if attempt == 1)
    assert winners == dict.fromkeys(subjects, 1)
    with pg_db.read() as conn:
        count = conn.execute(sa.select(sa.func.count()).select_from(leases_table)).scalar_one()
    assert count == len(subjects)
