"""Processes as /proc shows them: whether one still runs, and its direct children."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Running, sleeping or stopped; a zombie (exited, not reaped) or a vanished process is not alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def children(pid: int) -> set[int]:
    """The direct children of pid, from every thread's children list. A thread that ends while the
    list is read (its /proc entry gone) had none left to give; a process that ended has none."""
    found: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found.update(int(child) for child in (task / "children").read_text().split())
        except OSError:
            continue
    return found
