"""Invariant 2: planted canary secrets appear nowhere persisted, logged or raised, on both engines."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_dataflow.core.db import Database
from durable_dataflow.platform import Platform
from support import flows
from support.pg import PostgresServer

CANARY_PASSWORD = "canary-pw-5d1e0c"
CANARY_KEY = "canary-evidence-key-77aa"


def _dump(db_url: str, tmp_path: Path, server: PostgresServer) -> bytes:
    """Everything the platform database holds, as bytes: the files for SQLite, pg_dump for PostgreSQL."""
    if db_url.startswith("sqlite"):
        return b"".join(p.read_bytes() for p in tmp_path.glob("dataflow.db*"))
    dbname = sa.engine.make_url(db_url).database
    dump = subprocess.run(
        [str(server.bindir / "pg_dump"), "-h", "127.0.0.1", "-p", str(server.port), "-U", "postgres", str(dbname)],
        capture_output=True, check=True,
    )  # fmt: skip
    return dump.stdout


@pytest.mark.parametrize("reachable", [True, False], ids=["source-ok", "source-down"])
def test_canary_secrets_never_persist_or_leak(
    db_url: str,
    tmp_path: Path,
    postgres_server: PostgresServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    reachable: bool,
) -> None:
    """A postgres source's DSN (with a canary password) and a canary evidence key are used for a whole run,
    successful or failing; neither value appears in the database, the ledger, the run, errors or logs."""
    port = postgres_server.port if reachable else 1
    monkeypatch.setenv("CANARY_DSN", f"postgresql://postgres:{CANARY_PASSWORD}@127.0.0.1:{port}/postgres")
    monkeypatch.setenv("DATAFLOW_EVIDENCE_KEY", CANARY_KEY)
    caplog.set_level(logging.DEBUG)
    extra = {"crm": {"kind": "postgres", "dsn": {"secret": "CANARY_DSN"}, "query": "select 1 as one"}}
    sql = (
        "select region, sum(amount)::DECIMAL(18,2) as total, count(*)::BIGINT as n "
        "from sales, crm group by region order by region"
    )
    with Platform(db_url, lease_ttl_s=5) as platform:
        run = platform.runs.run_inline(
            flows.request(flows.definition(extra_sources=extra, sql=sql), tmp_path, "k1")
        ).run
        assert run.status == ("succeeded" if reachable else "failed")
        shown = run.model_dump_json() + str(run.public())
        platform.db.dispose()
    persisted = _dump(db_url, tmp_path, postgres_server)
    assert len(persisted) > 1000, "the dump must hold the platform's tables"
    out = capsys.readouterr()
    for canary in (CANARY_PASSWORD, CANARY_KEY):
        assert canary.encode() not in persisted
        assert canary not in shown
        assert canary not in caplog.text and canary not in out.out and canary not in out.err
    database = Database(db_url)
    with database.read() as conn:
        unkeyed = conn.execute(sa.text("SELECT count(*) FROM ledger_entries WHERE entry_mac IS NULL")).scalar_one()
    database.dispose()
    assert unkeyed == 0, "the evidence key was in use: every entry carries a MAC"
