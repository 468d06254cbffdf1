"""The engine a definition asks for: part of its hash, and refused before anything is recorded when
it is not installed here (docs/engines.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from durable_dataflow.dataflow.definitions import definitions
from support.cli import REVENUE_EXAMPLE, make_cli

# A package named pyspark that cannot be imported: how a machine without the spark extra looks.
NO_PYSPARK = "raise ImportError('pyspark is not installed here (test shadow)')\n"


def _body(engine: str | None) -> dict[str, object]:
    body = yaml.safe_load(REVENUE_EXAMPLE.read_text())
    if engine is not None:
        body["engine"] = engine
    return body


def test_the_default_engine_keeps_the_hash_and_another_engine_changes_it() -> None:
    plain = definitions.Definition.model_validate(_body(None))
    duckdb = definitions.Definition.model_validate(_body("duckdb"))
    spark = definitions.Definition.model_validate(_body("spark"))
    assert plain.engine == "duckdb"
    assert definitions.definition_hash(plain) == definitions.definition_hash(duckdb)
    assert "engine" not in definitions.canonical_body(plain)
    assert definitions.canonical_body(spark)["engine"] == "spark"
    assert definitions.definition_hash(spark) != definitions.definition_hash(plain)
    again = definitions.Definition.model_validate(definitions.canonical_body(spark))
    assert definitions.definition_hash(again) == definitions.definition_hash(spark)


def test_an_unknown_engine_is_refused_naming_the_field(tmp_path: Path, sqlite_url: str) -> None:
    path = tmp_path / "dataflow.yaml"
    path.write_text(yaml.safe_dump(_body("flink"), sort_keys=False))
    shutil.copytree(REVENUE_EXAMPLE.parent / "data", tmp_path / "data")
    cli = make_cli(sqlite_url, tmp_path)
    done = cli("run", str(path), "--param", "day=2026-11-02")
    assert done.code == 2, done.output
    assert "engine" in done.stderr and "duckdb" in done.stderr and "spark" in done.stderr
    assert cli("runs", "--json").json() == []


def test_spark_where_pyspark_is_absent_is_refused_before_anything_is_recorded(tmp_path: Path, sqlite_url: str) -> None:
    shadow = tmp_path / "shadow" / "pyspark"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(NO_PYSPARK)
    path = tmp_path / "dataflow.yaml"
    path.write_text(yaml.safe_dump(_body("spark"), sort_keys=False))
    shutil.copytree(REVENUE_EXAMPLE.parent / "data", tmp_path / "data")
    cli = make_cli(sqlite_url, tmp_path)
    env = {"PYTHONPATH": str(tmp_path / "shadow")}
    done = cli("run", str(path), "--param", "day=2026-11-02", "--idempotency-key", "k", extra_env=env)
    assert done.code == 2, done.output
    assert "engine 'spark'" in done.stderr and "durable-dataflow[spark]" in done.stderr
    assert cli("runs", "--json").json() == []
    # The same definition on the default engine runs there.
    path.write_text(yaml.safe_dump(_body(None), sort_keys=False))
    done = cli("run", str(path), "--param", "day=2026-11-02", extra_env=env)
    assert done.code == 0, done.output
