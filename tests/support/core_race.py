"""Child-process bodies for the core race tests (importable, so multiprocessing's spawn can run them)."""

from __future__ import annotations

from multiprocessing.synchronize import Barrier
from typing import Any

from durable_dataflow.core import fencing, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import LeaseUnavailable, StaleAttempt

MODULE = "race"
ACQUIRE_TRIES_MAX = 20_000


def commit_as(url: str, attempt: int, subjects: list[str], barrier: Barrier, results: Any) -> None:
    """For each subject, wait for the other racer, then try a fenced write as ``attempt``."""
    db = Database(url)
    try:
        for subject in subjects:
            barrier.wait(timeout=60)
            try:
                with fencing.fenced(db, MODULE, subject, attempt) as conn:
                    ledger.append(conn, db, MODULE, subject, attempt, f"write.by.{attempt}", {})
                results.put((subject, attempt, "committed"))
            except StaleAttempt:
                results.put((subject, attempt, "stale"))
    finally:
        db.dispose()


def acquire_release(url: str, subject: str, grants: int, results: Any) -> None:
    """Take ``grants`` leases on one shared subject, releasing each, and report every attempt granted."""
    db = Database(url)
    try:
        granted = 0
        for _ in range(ACQUIRE_TRIES_MAX):
            if granted == grants:
                break
            try:
                with db.begin() as conn:
                    lease = leases.acquire(conn, db, MODULE, subject, "racer", 30)
            except LeaseUnavailable:
                continue
            with fencing.fenced(db, MODULE, subject, lease.attempt) as conn:
                leases.release(conn, db, MODULE, subject, lease.attempt)
            results.put(lease.attempt)
            granted += 1
    finally:
        db.dispose()


def acquire_fresh(url: str, subjects: list[str], barrier: Barrier, results: Any) -> None:
    """For each new subject, all racers try the very first grant at once; report who got what."""
    db = Database(url)
    try:
        for subject in subjects:
            barrier.wait(timeout=60)
            try:
                with db.begin() as conn:
                    lease = leases.acquire(conn, db, MODULE, subject, "racer", 30)
                results.put((subject, lease.attempt))
            except LeaseUnavailable:
                results.put((subject, None))
    finally:
        db.dispose()
