"""The output checks of `dataflow validate` (execution/validate.py, issue 30 item 2), on schemas alone:
which declared types a bound result column always converts to, which depend on its values (a note), and
which the run would refuse whatever its values (a problem naming the step and the column)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import validate


def _definition(output: dict[str, str]) -> Definition:
    return Definition.model_validate({
        "name": "d", "version": 1, "sources": {"s": {"kind": "inline", "rows": [], "schema": {"a": "string"}}},
        "steps": [{"name": "last", "sql": "select a from s"}],
        "output": {"schema": output, "max_rows": 10, "max_bytes": "1MiB"},
    })  # fmt: skip


@pytest.mark.parametrize(("actual", "declared", "fits"), [
    (pa.int32(), pa.int64(), True), (pa.int64(), pa.int32(), False), (pa.uint32(), pa.int64(), True),
    (pa.uint64(), pa.int64(), False), (pa.int32(), pa.float64(), True), (pa.int64(), pa.float64(), False),
    (pa.float32(), pa.float64(), True), (pa.float64(), pa.int64(), False), (pa.int64(), pa.string(), True),
    (pa.decimal128(10, 2), pa.decimal128(18, 2), True), (pa.decimal128(18, 2), pa.decimal128(10, 2), False),
    (pa.decimal128(10, 2), pa.decimal128(12, 1), False), (pa.int64(), pa.decimal128(20, 0), True),
    (pa.int64(), pa.decimal128(18, 2), False), (pa.date32(), pa.timestamp("us"), True),
    (pa.timestamp("us"), pa.date32(), False), (pa.null(), pa.int64(), True),
])  # fmt: skip
def test_always_fits_is_a_widening(actual: pa.DataType, declared: pa.DataType, fits: bool) -> None:
    """A widening (every value converts) fits; a narrowing, whose conversion depends on the values, does not."""
    assert validate.always_fits(actual, declared) is fits


def test_check_output_names_the_step_and_the_column() -> None:
    """Text declared int64 and a float declared decimal are problems; int64 declared int32 is only a note;
    a declared column the result lacks and an undeclared one are problems naming them; right types pass."""
    d = _definition({"segment": "int64", "total": "decimal(18,2)", "n": "int32", "gone": "string"})
    report = validate.new_report(d)
    result = pa.schema([("segment", pa.string()), ("total", pa.float64()), ("n", pa.int64()), ("extra", pa.int8())])
    validate.check_output(d, "last", result, report)
    found = {(p.step, p.column) for p in report.problems}
    assert found == {("last", "segment"), ("last", "total"), ("last", "gone"), ("last", "extra")}, report.problems
    assert len(report.notes) == 1 and "'n'" in report.notes[0]
    fine = _definition({"segment": "string", "n": "int64"})
    clean = validate.new_report(fine)
    validate.check_output(fine, "last", pa.schema([("segment", pa.string()), ("n", pa.int32())]), clean)
    assert clean.valid and not clean.notes


def test_check_output_reports_the_order() -> None:
    """The declared columns in another order are one problem naming the declared order."""
    d = _definition({"a": "string", "b": "string"})
    report = validate.new_report(d)
    validate.check_output(d, "last", pa.schema([("b", pa.string()), ("a", pa.string())]), report)
    assert [p.message for p in report.problems] == [
        "the result of step 'last' has the declared columns in another order: output.schema declares ['a', 'b']"
    ]
