"""Hypothesis profiles for the state-machine test: ``ci`` (the default) and ``long`` (``make soak``).

``--hypothesis-profile=long`` is applied by hypothesis' pytest plugin at configure time, before
test modules are imported, so the profiles must be registered by then: ``tests/conftest.py``
imports this module. :func:`machine_settings` gives the state machine the ``ci`` profile unless
``long`` (or another profile registered here) was selected, so loading a profile never changes the
settings of unrelated hypothesis tests. ``DATAFLOW_HYPOTHESIS_PROFILE`` selects one too (for runs
where the option cannot be passed).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

CI_PROFILE = "ci"
LONG_PROFILE = "long"
PROFILE_ENV = "DATAFLOW_HYPOTHESIS_PROFILE"

# ci: each engine gets about a minute on the 2-core machine (every terminal step verifies a checkpoint,
# so a step costs more than it once did); enough steps per example to reach "authorize, lose the
# response, expire, sweep, reconcile, stale publish" (7 steps) many times, and hypothesis' database
# replays every failing example first. `make soak` runs the long profile (200 x 50) on both engines.
CI_EXAMPLES = 40
CI_STEPS = 40
# long: the soak budget — more and longer interleavings, sized so `make soak` with its defaults stays
# under 15 minutes: it runs both engines side by side (`-n 2`), and PostgreSQL, the slower, spends about
# 0.06 s per step here (ci: 176 s for 75 x 40); 200 x 50 steps took 6 min 40 s (make soak in all: 7 min 40 s).
LONG_EXAMPLES = 200
LONG_STEPS = 50

_COMMON = {
    "deadline": None,  # a step talks to a real database and a real sink: its time is not the point
    # filter_too_much: a rule whose precondition does not hold is filtered out, by design of a state
    # machine (seen failing the ci profile on PostgreSQL once: 9 steps drawn, 50 filtered).
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    "print_blob": True,
}

settings.register_profile(CI_PROFILE, max_examples=CI_EXAMPLES, stateful_step_count=CI_STEPS, **_COMMON)
settings.register_profile(LONG_PROFILE, max_examples=LONG_EXAMPLES, stateful_step_count=LONG_STEPS, **_COMMON)
MACHINE_PROFILES = frozenset({CI_PROFILE, LONG_PROFILE})


def machine_settings() -> settings:
    """The profile the state machine runs under: the selected one if it is ours, else ``ci``."""
    chosen = os.environ.get(PROFILE_ENV) or settings.get_current_profile_name()
    return settings.get_profile(chosen if chosen in MACHINE_PROFILES else CI_PROFILE)
