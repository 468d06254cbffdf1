"""Delivery of the lineage outbox in the background of a long-lived process (``dataflow serve``): a daemon
thread that flushes the outbox, then waits ``interval_s``, until stopped.

It never raises: a receiver outage is logged by the delivery (``lineage.undelivered``), a database outage
or a bug here as ``lineage.delivery_failed`` with the error's type, and the next round tries again. Several
processes may deliver at once (docs/lineage.md, "Delivery guarantees").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from durable_dataflow.core.db import Database
from durable_dataflow.lineage import delivery
from durable_dataflow.lineage.delivery import Delivery

if TYPE_CHECKING:
    from openlineage.client import OpenLineageClient

DELIVERY_INTERVAL_S = 5.0  # between two rounds that found nothing more to deliver (or failed)
STOP_WAIT_S = 30.0  # how long stop() waits for a round in progress (an HTTP emit times out sooner)

_log = structlog.get_logger("dataflow.lineage")


class BackgroundDelivery:
    """Flushes the outbox every ``interval_s`` in a thread of its own; ``deliver_once`` is one round."""

    def __init__(
        self,
        db: Database,
        client: OpenLineageClient,
        namespace: str,
        interval_s: float = DELIVERY_INTERVAL_S,
        *,
        wait: Callable[[float], object] | None = None,
        observe: Callable[[int, bool], None] | None = None,
    ) -> None:
        self.db = db
        self._observe = observe  # (events delivered, whether an emit failed) after each round: the metrics
        self.client = client
        self.namespace = namespace
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wait = wait if wait is not None else self._stop.wait
        self._thread = threading.Thread(target=self._loop, name="dataflow-lineage-delivery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = STOP_WAIT_S, *, final_round: bool = False) -> None:
        """Stop the thread (waiting up to ``timeout_s`` for a round in progress); with ``final_round``, one
        more flush after it stopped (a worker's last runs committed after the last round)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        try:
            if final_round and not self._thread.is_alive():
                self.deliver_once()
        finally:
            self.client.close()

    def deliver_once(self) -> Delivery:
        """One flush; never raises (what failed is logged and the next round tries again)."""
        try:
            done = delivery.flush(self.db, self.client, namespace=self.namespace)
        except Exception as error:  # a database outage or a bug: the keys stay, the next round retries
            _log.warning("lineage.delivery_failed", error_type=type(error).__name__)
            done = Delivery(failed=True, error_type=type(error).__name__)
        if self._observe is not None:
            self._observe(done.delivered, done.failed)
        return done

    def _loop(self) -> None:
        """Runs until stopped: this loop is meant to run for the process's whole life."""
        while not self._stop.is_set():
            self.deliver_once()
            self._wait(self.interval_s)


def start_if_configured(
    db: Database, configured: bool, namespace: str, observe: Callable[[int, bool], None] | None = None
) -> BackgroundDelivery | None:
    """A started BackgroundDelivery when lineage is configured and the client is installed, else None
    (lineage configured without ``openlineage-python`` is logged once: the outbox keeps the events)."""
    if not configured:
        return None
    try:
        from openlineage.client import OpenLineageClient
    except ImportError:
        _log.warning("lineage.unavailable", note="install durable-dataflow[lineage]; events wait in the outbox")
        return None
    started = BackgroundDelivery(db, OpenLineageClient(), namespace, observe=observe)
    started.start()
    return started


def deliver_now(db: Database, namespace: str) -> Delivery | None:
    """One flush from a short-lived process (``dataflow run``, before it exits): what the receiver takes is
    delivered, the rest waits in the outbox for a worker, ``serve`` or ``dataflow lineage flush``. Never
    raises; None when ``openlineage-python`` is not installed (logged: the events wait)."""
    try:
        from openlineage.client import OpenLineageClient
    except ImportError:
        _log.warning("lineage.unavailable", note="install durable-dataflow[lineage]; events wait in the outbox")
        return None
    client = OpenLineageClient()
    try:
        return BackgroundDelivery(db, client, namespace).deliver_once()
    finally:
        client.close()
