"""Provider discovery, capability checks and input guards. The named-datasource registry on both engines
is tested in tests/integration/test_datasource_registry_engines.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from durable_dataflow.core.errors import InputError
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import (
    KEY_CHARS_MAX,
    MissingCapability,
    Provider,
    PublishTarget,
    check_key,
    check_token,
    resolve_location,
)
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.parquet_folder import ParquetFolderProvider
from durable_dataflow.datasources.postgres_table import PostgresTableProvider


@pytest.mark.parametrize(
    ("name", "cls"),
    [("delta", DeltaProvider), ("postgres", PostgresTableProvider), ("parquet", ParquetFolderProvider)],
)
def test_builtin_providers_load_through_entry_points(name: str, cls: type) -> None:
    """Each built-in provider is found by its entry point, satisfies the Provider protocol and declares
    exactly the capabilities forward recovery requires (publish and inspect), plus replace_partition for
    the providers that replace a partition atomically (Delta and PostgreSQL; not the Parquet folder)."""
    provider = registry.load_provider(name)
    assert isinstance(provider, cls)
    assert isinstance(provider, Provider)
    assert provider.name == name
    registry.require_capabilities(provider, {"publish", "inspect"})
    partitions = {"replace_partition"} if name in ("delta", "postgres") else set()
    assert provider.capabilities == frozenset({"publish", "inspect", *partitions})
    assert name in registry.available_providers()


def test_unknown_provider_is_a_missing_capability() -> None:
    """A name no entry point or registration provides raises MissingCapability listing the registered
    providers, without echoing the name it was given (a tenant's input)."""
    with pytest.raises(MissingCapability, match=r"provider is not registered .*parquet") as info:
        registry.load_provider("iceberg-canary")
    assert info.value.code == "missing_capability" and "iceberg-canary" not in info.value.message


def test_missing_optional_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """With deltalake not importable, loading 'delta' is MissingCapability telling which extra to install."""
    monkeypatch.setitem(sys.modules, "deltalake", None)  # makes `import deltalake` raise ImportError
    with pytest.raises(MissingCapability, match=r"durable-dataflow\[delta\]"):
        registry.load_provider("delta")


class _PublishOnly:
    name = "publish-only"
    capabilities = frozenset({"publish"})


def test_require_capabilities_names_what_is_missing() -> None:
    """A provider without inspect fails the publish+inspect requirement, and the message names 'inspect'."""
    with pytest.raises(MissingCapability, match="inspect"):
        registry.require_capabilities(_PublishOnly(), {"publish", "inspect"})  # type: ignore[arg-type]


def test_in_process_registration_shadows_and_unregisters() -> None:
    """register_provider makes a factory loadable; unregister_provider removes it again."""
    registry.register_provider("parquet-custom", ParquetFolderProvider)
    try:
        assert isinstance(registry.load_provider("parquet-custom"), ParquetFolderProvider)
    finally:
        registry.unregister_provider("parquet-custom")
    with pytest.raises(MissingCapability):
        registry.load_provider("parquet-custom")


@pytest.mark.parametrize("key", ["", "a\x00b", "x" * (KEY_CHARS_MAX + 1)])
def test_bad_keys_are_refused(key: str) -> None:
    """Empty, control-character and oversized keys are InputError before the sink is touched."""
    with pytest.raises(InputError):
        check_key(key)


@pytest.mark.parametrize("token", [0, -1, True])
def test_tokens_must_be_positive_attempt_numbers(token: int) -> None:
    """Token 0 (reserved for Delta's fence marker), negatives and booleans are refused."""
    with pytest.raises(InputError):
        check_token(token)


def test_location_may_not_escape_base_dir(tmp_path: Path) -> None:
    """A relative location resolves inside base_dir; '..' escapes and missing base_dir are refused."""
    inside = PublishTarget("d", "sinks/a", "append", {"base_dir": str(tmp_path)})
    assert resolve_location(inside) == tmp_path.resolve() / "sinks" / "a"
    with pytest.raises(InputError, match="escapes"):
        resolve_location(PublishTarget("d", "../outside", "append", {"base_dir": str(tmp_path)}))
    with pytest.raises(InputError, match="base_dir"):
        resolve_location(PublishTarget("d", "relative", "append", {}))
    with pytest.raises(InputError):
        resolve_location(PublishTarget("d", "/abs/../etc", "append", {}))
