"""Digesting stored result bytes, in a fresh interpreter: what `dataflow verify` imports.

Split from tests/unit/test_arrowdigest.py (issue 28, item 6): the unit tier starts no process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from durable_dataflow.dataflow.execution import results
from support.arrow_tables import BASE_DIGEST_V2, BASE_DIGEST_V3, base_table


def test_digesting_stored_bytes_does_not_import_pandas(tmp_path: Path) -> None:
    """Proves `dataflow verify`'s digest of stored bytes leaves pandas unloaded where it is installed
    (pyarrow looks for it on ``pa.scalar`` of a Python value, ≈ 0.2 s): a fresh interpreter decodes
    the pinned table's IPC bytes, digests them in both formats and reports whether pandas came in."""
    pytest.importorskip("pandas")  # the test environment has it (the spark-connect extra)
    stored = tmp_path / "base.arrows"
    stored.write_bytes(results.encode_ipc(base_table()))
    probe = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from durable_dataflow.dataflow.execution import arrowdigest, results\n"
        f"table = results.decode_ipc(Path({str(stored)!r}).read_bytes())\n"
        "digests = [arrowdigest.output_digest(table), arrowdigest.output_digest_v2(table)]\n"
        "before = 'pandas' in sys.modules\n"
        "import pyarrow as pa\n"
        "pa.scalar('')  # the probe can see pandas come in\n"
        "print(json.dumps([digests, before, 'pandas' in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    digests, pandas_before, pandas_after = json.loads(done.stdout)
    assert digests == [BASE_DIGEST_V3, BASE_DIGEST_V2]
    assert not pandas_before and pandas_after
