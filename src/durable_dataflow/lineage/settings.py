"""Whether lineage is configured, read from the OpenLineage client's own configuration sources without
importing the client: ``OPENLINEAGE_URL``, ``OPENLINEAGE__TRANSPORT__TYPE`` (with the other
``OPENLINEAGE__TRANSPORT__*`` variables), the file named by
``OPENLINEAGE_CONFIG``, ``./openlineage.yml`` or ``~/.openlineage/openlineage.yml``. ``OPENLINEAGE_DISABLED=true``
turns it off whatever else is set, as it does in the client. The job namespace is ``DATAFLOW_LINEAGE_NAMESPACE``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

NAMESPACE_NAME = "DATAFLOW_LINEAGE_NAMESPACE"
NAMESPACE_DEFAULT = "durable-dataflow"
NAMESPACE_CHARS_MAX = 200
# The variable that makes the client build its transport from OPENLINEAGE__TRANSPORT__* variables: without a
# type the client finds no transport there and prints events to the console (on stdout) instead. The client
# itself writes OPENLINEAGE__TRANSPORT__TRANSPORTS__* variables into its process's environment when it reads
# OPENLINEAGE_URL, so those alone say nothing about what an operator configured.
TRANSPORT_TYPE = "OPENLINEAGE__TRANSPORT__TYPE"
CONFIG_FILE = "openlineage.yml"


def configured(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> bool:
    """True when the OpenLineage client would find a transport configuration here."""
    env = os.environ if environ is None else environ
    if env.get("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OPENLINEAGE_URL") or env.get(TRANSPORT_TYPE, "").strip():
        return True
    return any(_readable(path) for path in _config_files(env, cwd))


def _config_files(env: Mapping[str, str], cwd: Path | None) -> list[Path]:
    files = [Path(env["OPENLINEAGE_CONFIG"])] if env.get("OPENLINEAGE_CONFIG") else []
    # A removed working directory holds no file, and opening the platform must not fail on it.
    with contextlib.suppress(OSError):
        files.append((cwd or Path.cwd()) / CONFIG_FILE)
    home = env.get("HOME")
    if home:
        files.append(Path(home) / ".openlineage" / CONFIG_FILE)
    return files


def _readable(path: Path) -> bool:
    try:
        return path.is_file() and os.access(path, os.R_OK)
    except OSError:
        return False


def namespace(environ: Mapping[str, str] | None = None) -> str:
    """The job namespace of every event (``DATAFLOW_LINEAGE_NAMESPACE``, default ``durable-dataflow``)."""
    env = os.environ if environ is None else environ
    value = env.get(NAMESPACE_NAME, "").strip() or NAMESPACE_DEFAULT
    return value[:NAMESPACE_CHARS_MAX]
