"""A client process for the fault tests and the soak: submits keyed runs, reports what it got.

    python tests/faults/submitter.py URL ATOMIC_DEF FORWARD_DEF COUNT SEED OUT

Submits keys ``k-0`` .. ``k-{COUNT-1}`` in an order shuffled by SEED: even keys run the atomic
definition, odd ones the forward one, each with parameter ``n`` = the key's number. Several
clients with the same COUNT submit the same keys (replays) at the same time. Each submission
writes one JSON line to OUT: key, run_id, created.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from durable_dataflow.core.errors import StorageUnavailable
from durable_dataflow.dataflow.definitions.definitions import load_definition
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.platform import Platform

SUBMIT_TRIES_MAX = 20  # a submit is safe to repeat: its key makes a repeat a replay


def main(argv: list[str]) -> int:
    url, atomic_def, forward_def, count, seed, out = argv
    definitions = [load_definition(Path(atomic_def)), load_definition(Path(forward_def))]
    order = list(range(int(count)))
    random.Random(int(seed)).shuffle(order)
    access = AccessContext.local()
    provenance = Provenance(actor=f"client-{seed}", trigger="api")
    with Platform(url) as platform, Path(out).open("w") as sink:
        for number in order:
            loaded = definitions[number % 2]
            request = RunRequest(
                definition=loaded.definition, base_dir=loaded.base_dir, parameters={"n": str(number)},
                access=access, provenance=provenance, idempotency_key=f"k-{number}",
            )  # fmt: skip
            for _ in range(SUBMIT_TRIES_MAX):
                try:
                    submission = platform.runs.submit(request)
                    break
                except StorageUnavailable:
                    continue
            else:
                raise SystemExit(f"k-{number}: the database stayed unavailable")
            line = {"key": f"k-{number}", "run_id": submission.run.run_id, "created": submission.created}
            sink.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
