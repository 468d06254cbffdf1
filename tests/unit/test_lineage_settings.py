"""Whether lineage is configured is read from the OpenLineage client's own sources (docs/lineage.md),
without importing the client: each source alone turns it on, OPENLINEAGE_DISABLED turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest

from durable_dataflow.lineage import settings


def test_nothing_set_is_off(tmp_path: Path) -> None:
    """No variable and no file anywhere: off."""
    assert settings.configured({"HOME": str(tmp_path)}, cwd=tmp_path) is False


def test_each_source_alone_turns_it_on(tmp_path: Path) -> None:
    """OPENLINEAGE_URL, OPENLINEAGE__TRANSPORT__TYPE, the file OPENLINEAGE_CONFIG names,
    ./openlineage.yml and ~/.openlineage/openlineage.yml each turn lineage on."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    assert settings.configured({"HOME": str(home), "OPENLINEAGE_URL": "http://m:5000"}, cwd=cwd)
    assert settings.configured({"HOME": str(home), "OPENLINEAGE__TRANSPORT__TYPE": "console"}, cwd=cwd)
    named = tmp_path / "ol.yml"
    assert not settings.configured({"HOME": str(home), "OPENLINEAGE_CONFIG": str(named)}, cwd=cwd)
    named.write_text("transport: {type: console}\n")
    assert settings.configured({"HOME": str(home), "OPENLINEAGE_CONFIG": str(named)}, cwd=cwd)
    (cwd / "openlineage.yml").write_text("transport: {type: console}\n")
    assert settings.configured({"HOME": str(home)}, cwd=cwd)
    (cwd / "openlineage.yml").unlink()
    (home / ".openlineage").mkdir(parents=True)
    (home / ".openlineage" / "openlineage.yml").write_text("transport: {type: console}\n")
    assert settings.configured({"HOME": str(home)}, cwd=cwd)


def test_disabled_wins(tmp_path: Path) -> None:
    """OPENLINEAGE_DISABLED=true turns lineage off whatever else is set, as it does in the client."""
    env = {"HOME": str(tmp_path), "OPENLINEAGE_URL": "http://m:5000", "OPENLINEAGE_DISABLED": "True"}
    assert settings.configured(env, cwd=tmp_path) is False


def test_namespace_default_and_setting() -> None:
    """The job namespace defaults to durable-dataflow; DATAFLOW_LINEAGE_NAMESPACE sets it."""
    assert settings.namespace({}) == "durable-dataflow"
    assert settings.namespace({"DATAFLOW_LINEAGE_NAMESPACE": " prod "}) == "prod"



def test_a_removed_working_directory_is_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose working directory was removed still opens its platform: no ./openlineage.yml."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert settings.configured({"HOME": str(tmp_path)}) is False


def test_transport_variables_without_a_type_are_not_a_configuration(tmp_path: Path) -> None:
    """Proves OPENLINEAGE__TRANSPORT__* variables without OPENLINEAGE__TRANSPORT__TYPE do not turn lineage on:
    the client finds no transport in them and prints events to the console (stdout) instead. It also writes
    OPENLINEAGE__TRANSPORT__TRANSPORTS__DEFAULT_HTTP__* into its own process's environment when it reads
    OPENLINEAGE_URL: left behind in a test process, they turned lineage on in every later `dataflow run`
    there (CI: events printed on stderr of an unrelated test)."""
    env = {"HOME": str(tmp_path), "OPENLINEAGE__TRANSPORT__TRANSPORTS__DEFAULT_HTTP__TYPE": "http",
           "OPENLINEAGE__TRANSPORT__TRANSPORTS__DEFAULT_HTTP__URL": "http://127.0.0.1:9"}  # fmt: skip
    assert settings.configured(env, cwd=tmp_path) is False
    assert settings.configured({**env, "OPENLINEAGE__TRANSPORT__TYPE": " "}, cwd=tmp_path) is False
