"""The isolation setting and the memory bound of an executor process (execution/isolation.py)."""

from __future__ import annotations

import pytest

from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.execution import isolation
from durable_dataflow.dataflow.execution.limits import ExecutionLimits, MiB


def test_the_setting_defaults_per_process_and_reads_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves DATAFLOW_ISOLATION unset gives the caller's default (process for worker and serve, none for
    run), 'process' and 'none' (any case, spaces) override it, and another value is refused by name."""
    monkeypatch.delenv(isolation.ISOLATION_ENV, raising=False)
    assert isolation.isolation_from_env(isolation.Isolation.PROCESS) is isolation.Isolation.PROCESS
    assert isolation.isolation_from_env(isolation.Isolation.NONE) is isolation.Isolation.NONE
    monkeypatch.setenv(isolation.ISOLATION_ENV, " None ")
    assert isolation.isolation_from_env(isolation.Isolation.PROCESS) is isolation.Isolation.NONE
    monkeypatch.setenv(isolation.ISOLATION_ENV, "process")
    assert isolation.isolation_from_env(isolation.Isolation.NONE) is isolation.Isolation.PROCESS
    monkeypatch.setenv(isolation.ISOLATION_ENV, "cgroup")
    with pytest.raises(InputError, match=r"DATAFLOW_ISOLATION must be 'process' or 'none', got 'cgroup'"):
        isolation.isolation_from_env(isolation.Isolation.PROCESS)


def test_the_bound_is_the_memory_limit_plus_the_result_limit_plus_the_slack() -> None:
    """Proves an execution's bound over its executor's starting size is memory_bytes_max + output.max_bytes
    + MEMORY_SLACK_BYTES, so the operator can size a host from the two limits (docs/engines.md)."""
    limits = ExecutionLimits(memory_bytes_max=64 * MiB)
    assert isolation.memory_bound_bytes(limits, 1 * MiB) == 65 * MiB + isolation.MEMORY_SLACK_BYTES
    assert 256 * MiB == isolation.MEMORY_SLACK_BYTES
