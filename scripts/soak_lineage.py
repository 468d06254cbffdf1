"""The soak's lineage check (`make soak SOAK_ARGS=--lineage`, issue 32 item 3): every process of the soak
(workers crashed and paused at every point, killed submits and reconciles) runs with lineage configured
at a local OpenLineage receiver; at the end the outbox is flushed and the events received must equal the
ledger's transitions one for one: every committed entry that maps to an event arrived (by its stable
event id), nothing arrived that no committed entry explains, and a duplicate (at-least-once delivery)
carries the same event as its first copy."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import sqlalchemy as sa

from durable_dataflow.core.db import Database
from durable_dataflow.core.schema import ledger_entries
from durable_dataflow.dataflow.protocol import runs as runs_module

FLUSH_ROUNDS_MAX = 20  # flushes at the end until nothing is pending (each round delivers a batch)


@dataclass
class Receiver:
    """A local OpenLineage HTTP receiver: every event it accepted, by event id (duplicates counted)."""

    events: dict[str, dict[str, Any]] = field(default_factory=dict)
    duplicates: int = 0
    differing: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, event: dict[str, Any]) -> None:
        event_id = event["run"]["facets"]["durableDataflow_ledgerEntry"]["eventId"]
        with self.lock:
            first = self.events.setdefault(event_id, event)
            if first is not event:
                self.duplicates += 1
                if _comparable(first) != _comparable(event):
                    self.differing.append(event_id)


def _comparable(event: dict[str, Any]) -> str:
    return json.dumps(event, sort_keys=True)


class LineageCheck:
    """Started before the soak's first process (they inherit OPENLINEAGE_URL), checked after it settled."""

    def __init__(self) -> None:
        self.receiver = Receiver()
        receiver = self.receiver

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # the standard library's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.take(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()
        for name in [n for n in os.environ if n.startswith("OPENLINEAGE")]:
            del os.environ[name]
        os.environ["OPENLINEAGE_URL"] = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def check(self, db: Database) -> tuple[str, list[str]]:
        """Flush what is left, then compare: (a report line, violations)."""
        from openlineage.client import OpenLineageClient

        from durable_dataflow.lineage import delivery, events, settings

        client = OpenLineageClient()
        try:
            for _ in range(FLUSH_ROUNDS_MAX):
                delivery.flush(db, client, namespace=settings.namespace())
                if delivery.pending_count(db) == 0:
                    break
        finally:
            client.close()
        pending = delivery.pending_count(db)
        expected = self._expected(db, events)
        with self.receiver.lock:
            received = set(self.receiver.events)
            duplicates, differing = self.receiver.duplicates, list(self.receiver.differing)
        violations = [f"lineage: {pending} outbox entries still pending after {FLUSH_ROUNDS_MAX} flushes"] * (
            pending > 0
        )
        missing, unexplained = expected - received, received - expected
        if missing:
            violations.append(f"lineage: {len(missing)} committed transitions never arrived: {sorted(missing)[:5]}")
        if unexplained:
            violations.append(f"lineage: {len(unexplained)} events no committed entry explains: "
                              f"{sorted(unexplained)[:5]}")  # fmt: skip
        if differing:
            violations.append(f"lineage: {len(differing)} duplicates differ from their first copy: {differing[:5]}")
        report = (f"lineage: {len(received)} events received for {len(expected)} event-bearing ledger entries, "
                  f"{duplicates} duplicate deliveries (same id, same event), {pending} pending")  # fmt: skip
        return report, violations

    @staticmethod
    def _expected(db: Database, events: Any) -> set[str]:
        kinds = sorted(events.EVENT_TYPES)
        query = sa.select(ledger_entries.c.module, ledger_entries.c.subject_id, ledger_entries.c.seq).where(
            ledger_entries.c.module == runs_module.MODULE, ledger_entries.c.kind.in_(kinds)
        )
        with db.read() as conn:
            return {events.event_id(m, s, int(q)) for m, s, q in conn.execute(query)}
