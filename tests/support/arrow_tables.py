"""A pinned Arrow table and its output digests, for the digest tests of tests/unit and tests/integration."""

from __future__ import annotations

import datetime as dt
import decimal

import pyarrow as pa

ROWS = 1_000
# The digests of base_table(), pinned: a stored digest is a fact, so a format may change only as a new version.
BASE_DIGEST_V2 = "sha256:bbf609ff3a87e746e43f681fdaedf03e3b88e6064539b51be33593f24fc98d5c"
BASE_DIGEST_V3 = "sha256:2dbb3d1e1a2160b48f1264f137f5d3b5de255ff098e700cdd42896f763a040a6"


def base_table() -> pa.Table:
    """A thousand rows of every common type, with nulls: its digests are pinned above."""
    return pa.table(
        {
            "id": pa.array([None if i % 7 == 0 else i * 1_000_003 for i in range(ROWS)], pa.int64()),
            "name": pa.array([None if i % 11 == 0 else f"customer-{i}-{'x' * (i % 5)}" for i in range(ROWS)]),
            "big": pa.array([f"v{i}" for i in range(ROWS)], pa.large_string()),
            "score": pa.array([i / 3 for i in range(ROWS)], pa.float64()),
            "flag": pa.array([None if i % 13 == 0 else i % 2 == 0 for i in range(ROWS)], pa.bool_()),
            "day": pa.array([dt.date(2026, 11, 1) + dt.timedelta(days=i % 30) for i in range(ROWS)]),
            "at": pa.array([dt.datetime(2026, 11, 2, 8, 0) + dt.timedelta(seconds=i) for i in range(ROWS)],
                           pa.timestamp("us", tz="UTC")),
            "amount": pa.array([None if i % 17 == 0 else decimal.Decimal(i) / 100 for i in range(ROWS)],
                               pa.decimal128(18, 2)),
            "raw": pa.array([bytes([i % 256]) * (i % 3) for i in range(ROWS)], pa.binary()),
        }
    )
