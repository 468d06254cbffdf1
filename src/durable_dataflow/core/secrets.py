"""Secrets are referenced by name and resolved in memory only, at the moment they are needed.

A secret named ``CRM_DSN`` resolves, in order, from the environment variable ``CRM_DSN``, then
from the file ``$DATAFLOW_SECRETS_DIR/CRM_DSN``. The resolved value is never returned inside an
error message, never logged and never persisted: callers hold it in a local variable for the
duration of one call and drop it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from durable_dataflow.core.errors import InputError

SECRET_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
SECRET_FILE_BYTES_MAX = 64 * 1024


class Secret:
    """A resolved secret value that refuses to print itself."""

    __slots__ = ("_value", "name")

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self._value = value

    def reveal(self) -> str:
        """The plain value: call at the last moment, pass straight to the driver, never store."""
        return self._value

    def __repr__(self) -> str:
        return f"Secret({self.name!r}, '***')"

    __str__ = __repr__


def secrets_dir() -> Path | None:
    """The configured secrets directory (``DATAFLOW_SECRETS_DIR``), resolved, or None."""
    configured = os.environ.get("DATAFLOW_SECRETS_DIR")
    return Path(configured).resolve() if configured else None


def resolve(name: str) -> Secret:
    """Resolve a secret by name from the environment or the secrets directory."""
    if not SECRET_NAME_PATTERN.match(name):
        raise InputError(f"secret name {name!r} is not valid: use letters, digits and underscores")
    value = os.environ.get(name)
    if value is not None:
        return Secret(name, value)
    secrets_dir = os.environ.get("DATAFLOW_SECRETS_DIR")
    if secrets_dir:
        path = Path(secrets_dir) / name
        if path.is_file():
            data = path.read_bytes()[:SECRET_FILE_BYTES_MAX]
            return Secret(name, data.decode("utf-8").strip())
    raise InputError(
        f"secret {name!r} is not set: define the environment variable {name} "
        "or a file of that name in DATAFLOW_SECRETS_DIR"
    )
