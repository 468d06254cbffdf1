"""Reading a small file a person named (a definition, the grants file) without trusting what it is.

``/dev/zero`` reports a size of 0 and never ends; a FIFO blocks the reader until someone writes;
a file may grow between ``stat`` and ``read``. So the file is opened without blocking, must be a
regular file by ``fstat`` of what was opened, and is read up to one byte past its cap.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from durable_dataflow.core.errors import InputError


def read_capped(path: Path, bytes_max: int, what: str) -> bytes:
    """The bytes of the regular file at ``path``; an InputError starting with ``what`` when it cannot
    be opened, is not a regular file (a folder, a device, a FIFO) or holds more than ``bytes_max``."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as error:
        raise InputError(f"{what} cannot be read: {error.strerror or error}") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # before fdopen, which refuses a folder itself
        os.close(descriptor)
        raise InputError(f"{what} is not a regular file")
    with os.fdopen(descriptor, "rb") as file:
        try:
            data = file.read(bytes_max + 1)
        except OSError as error:
            raise InputError(f"{what} cannot be read: {error.strerror or error}") from None
    if len(data) > bytes_max:
        raise InputError(f"{what} is larger than {bytes_max} bytes")
    return data
