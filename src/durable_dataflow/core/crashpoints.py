"""Named crash and pause points for fault tests (DBOS-style debug triggers).

With ``DATAFLOW_CRASH_AT=<point>`` the process SIGKILLs itself when it reaches that point; with
``DATAFLOW_PAUSE_AT=<point>`` it SIGSTOPs itself there (a test resumes it with SIGCONT). Unset,
:func:`reach` is one dictionary lookup. In-process tests may install a hook instead.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

AFTER_RECORD = "after_record"  # run.recorded committed (queued submit), before any claim
AFTER_CLAIM = "after_claim"  # attempt.started committed, before any source is read
AFTER_PREPARE = "after_prepare"  # forward: target preflighted and sink location prepared, nothing authorized
# Sources resolved, steps not yet finished, reached by the engine exactly once per execution and always
# before the result exists: DuckDB as its run begins; Spark from its watch thread once a Spark job of the
# execution is seen running, else just before the last step's result reaches the collector (or as the
# execution fails), whichever comes first.
DURING_EXECUTION = "during_execution"
BEFORE_PREDISPATCH_COMMIT = "before_predispatch_commit"  # result computed, dispatch not authorized
AFTER_PREDISPATCH_COMMIT = "after_predispatch_commit"  # dispatch.authorized durable, provider not called
AFTER_PROVIDER_CALL = "after_provider_call"  # the sink answered; the answer is not recorded yet
BEFORE_TERMINAL_COMMIT = "before_terminal_commit"  # terminal transaction about to start
AFTER_TERMINAL_COMMIT = "after_terminal_commit"  # terminal transaction committed
AFTER_INSPECT = "after_inspect"  # reconcile: the sink answered the (fenced) inspection, nothing recorded yet

POINTS = (
    AFTER_RECORD,
    AFTER_CLAIM,
    AFTER_PREPARE,
    DURING_EXECUTION,
    BEFORE_PREDISPATCH_COMMIT,
    AFTER_PREDISPATCH_COMMIT,
    AFTER_PROVIDER_CALL,
    BEFORE_TERMINAL_COMMIT,
    AFTER_TERMINAL_COMMIT,
    AFTER_INSPECT,
)

Hook = Callable[[str], None]
_hook: Hook | None = None


def _actions_from_env() -> dict[str, signal.Signals]:
    actions: dict[str, signal.Signals] = {}
    pause_at = os.environ.get("DATAFLOW_PAUSE_AT")
    crash_at = os.environ.get("DATAFLOW_CRASH_AT")
    if pause_at:
        actions[pause_at] = signal.SIGSTOP
    if crash_at:
        actions[crash_at] = signal.SIGKILL
    return actions


_actions = _actions_from_env()


def reach(point: str) -> None:
    """Called by the run service (and the engines, for DURING_EXECUTION) at each named point."""
    if _hook is not None:
        _hook(point)
    action = _actions.get(point)
    if action is not None:
        os.kill(os.getpid(), action)


def armed(point: str) -> bool:
    """Whether reaching ``point`` may do anything (a hook, or an action from the environment): lets a
    caller skip work it would do only to reach the point at the right moment."""
    return _hook is not None or point in _actions


def set_hook(hook: Hook | None) -> None:
    """Install (or remove, with None) an in-process hook called at every point."""
    global _hook
    _hook = hook
