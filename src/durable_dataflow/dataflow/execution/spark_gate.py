"""The SQL gate of the Spark engine: an allow-list over sqlglot's tree, and the only way SQL reaches Spark.

Spark SQL's default surface reads files (``text.`/etc/hostname```), runs programs (``TRANSFORM … USING``),
calls Java (``reflect``), changes the session (``SET``, ``ADD JAR``) and substitutes ``${env:…}`` and
``${system:…}`` into the SQL text before parsing it (even inside string literals). So a step is parsed
with sqlglot (dialect ``spark``) and every node of the tree must be on the lists below; anything else is
refused with the node's name. Spark never sees the user's text: :func:`render` prints the checked tree
with each ``$name`` replaced by a literal the platform builds, parses that text again and re-checks it.

Rules, in brief:

- exactly one query: SELECT, WITH … SELECT, UNION/INTERSECT/EXCEPT, a parenthesised query or VALUES;
  VALUES only where Spark reads it as a relation too (not ``x IN (VALUES …)``, a call of ``values`` there);
- relations are unqualified names that are a declared relation (case-insensitive, like Spark) or a
  CTE in scope; ``db.t``, ``catalog.db.t``, ``parquet.`path``` and table functions other than
  ``range(…)`` are refused, and so are TABLESAMPLE and time travel;
- functions: the typed sqlglot classes in ``_FUNCTIONS`` and the names in ``_ANONYMOUS_FUNCTIONS``.
  Steps must be deterministic so that digests reproduce: clock, session and random functions, and
  aggregates whose result depends on row order (``first``, ``any_value``, ``collect_list`` unless
  sorted by ``array_sort``, ``percentile_approx``, ``mode``) are refused;
- bare names Spark resolves to session or clock values when no column has that name (``user``,
  ``current_date``, …) must be qualified (``t.user``);
- parameters are ``$name`` only (not ``${name}``, ``$1``, ``?`` or ``:name``);
- optimizer hints (``/*+ … */``) and comments are dropped from the tree: they never reach Spark;
- no ``${`` anywhere in the rendered text, and the rendering must be a fixed point of
  parse-and-print (sqlglot reads back exactly what it printed) that keeps every identifier and holds
  no comment; every identifier and alias is printed quoted (LATERAL VIEW's too, see _GateGenerator).
"""

from __future__ import annotations

import datetime as dt
import decimal
import itertools
import logging
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from sqlglot import exp
from sqlglot.dialects.spark import Spark
from sqlglot.errors import ErrorLevel, SqlglotError
from sqlglot.generators.spark import SparkGenerator
from sqlglot.tokenizer_core import TokenType

from durable_dataflow.core.errors import InputError
from durable_dataflow.core.invariants import invariant

# sqlglot logs a WARNING quoting the statement when it falls back to a raw Command (``ADD JAR …``):
# the gate refuses such statements itself, and a step's SQL never goes to a log or a terminal.
logging.getLogger("sqlglot").setLevel(logging.ERROR)

STEP_NODES_MAX = 20_000  # syntax nodes per step; a larger tree is refused
QUOTED_CHARS_MAX = 80  # an identifier quoted in a message is cut to this length
DECIMAL_PRECISION_MAX = 38  # Spark's widest decimal
RENDER_PASSES_MAX = 2  # print/parse passes until the rendered text is a fixed point


class _GateGenerator(SparkGenerator):
    """Spark's generator with LATERAL VIEW's aliases printed through identifier_sql, so quoted:
    sqlglot prints the table alias by its bare name, and `x--` came out as x plus a comment."""

    def lateral_sql(self, expression: exp.Lateral) -> str:
        alias = expression.args.get("alias")
        if not expression.args.get("view") or not isinstance(alias, exp.TableAlias):
            return super().lateral_sql(expression)
        table = f" {self.sql(alias, 'this')}" if alias.this else ""
        columns = self.expressions(alias, key="columns", flat=True)
        columns = f" AS {columns}" if columns else ""
        op_sql = self.seg(f"LATERAL VIEW{' OUTER' if expression.args.get('outer') else ''}")
        return f"{op_sql}{self.sep()}{self.sql(expression, 'this')}{table}{columns}"


class _GateSpark(Spark):
    """The Spark dialect, printing with _GateGenerator."""

    Generator = _GateGenerator


_DIALECT = _GateSpark()
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNIT = re.compile(r"^[A-Za-z_]{1,24}$")
_TOKEN = re.compile(r"<Token token_type: [^,]*, text: (.{0,40}?), line: [^>]*>")  # sqlglot's token repr

_STRING_TOKENS = {TokenType.STRING, TokenType.RAW_STRING}
_QUERIES = (exp.Select, exp.Union, exp.Intersect, exp.Except, exp.Subquery, exp.Values)

# Syntax that cannot read, write or call anything by itself.
_SYNTAX: frozenset[type[exp.Expr]] = frozenset({
    exp.Select, exp.From, exp.Join, exp.Where, exp.Group, exp.Having, exp.Order, exp.Ordered, exp.Limit, exp.Offset,
    exp.Distinct, exp.CTE, exp.TableAlias, exp.Subquery, exp.Union, exp.Intersect, exp.Except, exp.Values,
    exp.Tuple, exp.Lateral, exp.Alias, exp.Identifier, exp.Star, exp.Paren, exp.Window, exp.WindowSpec, exp.Lambda,
    exp.Bracket, exp.PropertyEQ, exp.Filter, exp.Interval, exp.IntervalSpan, exp.Literal, exp.Null, exp.Boolean,
    exp.HexString, exp.Cast, exp.TryCast, exp.Case, exp.If, exp.Exists, exp.Any, exp.All, exp.In, exp.Between,
    exp.Is, exp.Like, exp.ILike, exp.RegexpLike, exp.Escape, exp.Not, exp.And, exp.Or, exp.Neg, exp.Add, exp.Sub,
    exp.Mul, exp.Div, exp.IntDiv, exp.Mod, exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.NullSafeEQ,
    exp.NullSafeNEQ, exp.BitwiseAnd, exp.BitwiseOr, exp.BitwiseXor, exp.BitwiseNot, exp.BitwiseLeftShift,
    exp.BitwiseRightShift, exp.DPipe, exp.JSONPath, exp.JSONPathKey, exp.JSONPathRoot, exp.JSONPathSubscript,
    exp.Rollup, exp.Cube, exp.GroupingSets, exp.Grouping, exp.GroupingId, exp.DataTypeParam,
})  # fmt: skip
# Typed functions: deterministic, reading nothing but their arguments.
_FUNCTIONS: frozenset[type[exp.Expr]] = frozenset({
    # aggregates
    exp.Sum, exp.Count, exp.Avg, exp.Min, exp.Max, exp.Stddev, exp.StddevPop, exp.StddevSamp, exp.Variance,
    exp.VariancePop, exp.CountIf, exp.ApproxDistinct, exp.Quantile, exp.Median, exp.Corr, exp.CovarPop,
    exp.CovarSamp, exp.LogicalAnd, exp.LogicalOr, exp.Skewness, exp.Kurtosis,
    # window
    exp.RowNumber, exp.Rank, exp.DenseRank, exp.Lag, exp.Lead, exp.Ntile, exp.PercentRank, exp.CumeDist,
    exp.FirstValue, exp.LastValue, exp.NthValue,
    # conditional and math
    exp.Coalesce, exp.Nvl2, exp.Nullif, exp.Greatest, exp.Least, exp.IsNan, exp.Nanvl, exp.Abs, exp.Ceil, exp.Floor,
    exp.Round, exp.Sqrt, exp.Cbrt, exp.Exp, exp.Ln, exp.Log, exp.Pow, exp.Sign, exp.Sin, exp.Cos, exp.Tan, exp.Asin,
    exp.Acos, exp.Atan, exp.Atan2, exp.Degrees, exp.Radians, exp.Pi, exp.WidthBucket, exp.SafeAdd, exp.SafeSubtract,
    exp.SafeMultiply, exp.SafeDivide,
    # strings
    exp.Upper, exp.Lower, exp.Length, exp.BitLength, exp.Trim, exp.Pad, exp.Substring, exp.Left, exp.Right,
    exp.Concat, exp.ConcatWs, exp.Replace, exp.Translate, exp.StrPosition, exp.RegexpSplit, exp.SplitPart,
    exp.RegexpExtract, exp.RegexpExtractAll, exp.RegexpReplace, exp.Initcap, exp.Reverse, exp.Repeat, exp.Chr,
    exp.StartsWith, exp.EndsWith, exp.Contains, exp.Format, exp.MD5, exp.SHA, exp.SHA2, exp.Hex, exp.Unhex,
    exp.Levenshtein, exp.Soundex, exp.Ascii, exp.ToBase64, exp.FromBase64,
    # dates and times
    exp.TsOrDsAdd, exp.DateDiff, exp.AddMonths, exp.MonthsBetween, exp.TimestampTrunc, exp.DateTrunc, exp.TimeToStr,
    exp.TsOrDsToDate, exp.StrToTime, exp.Year, exp.Month, exp.Day, exp.DayOfMonth, exp.DayOfWeek, exp.DayOfYear,
    exp.WeekOfYear, exp.Quarter, exp.Hour, exp.Minute, exp.Second, exp.LastDay, exp.NextDay, exp.TimestampFromParts,
    exp.StrToUnix, exp.UnixToStr, exp.Extract, exp.TimestampDiff, exp.TimeStrToTime, exp.MakeInterval,
    # arrays, maps, structs, generators, lambdas, JSON
    exp.Array, exp.ArrayContains, exp.ArrayDistinct, exp.ArrayToString, exp.ArrayPosition, exp.ArrayRemove,
    exp.ArraySort, exp.ArrayIntersect, exp.ArrayExcept, exp.ArraysZip, exp.ArraySize, exp.ArrayMax, exp.ArrayMin,
    exp.Flatten, exp.GenerateSeries, exp.ArraySlice, exp.Explode, exp.Posexplode, exp.PosexplodeOuter, exp.Inline,
    exp.Stack, exp.Struct, exp.VarMap, exp.Map, exp.MapKeys, exp.MapFromEntries, exp.StrToMap, exp.ArrayFilter,
    exp.Transform, exp.Reduce, exp.JSONExtractScalar, exp.FromJson, exp.JSONFormat, exp.Typeof,
})  # fmt: skip
# Spark built-ins sqlglot does not type (lowercase, ASCII).
_ANONYMOUS_FUNCTIONS = frozenset({
    "pmod", "bround", "isnull", "isnotnull", "octet_length", "btrim", "format_number", "crc32", "hash", "xxhash64",
    "make_date", "date_part", "timestamp_seconds", "weekday", "array_union", "arrays_overlap", "cardinality",
    "inline_outer", "json_tuple", "map_values", "forall", "zip_with", "map_filter", "transform_keys",
    "transform_values", "try_sum", "try_avg", "try_to_number", "every", "some", "positive",
})  # fmt: skip
_TABLE_FUNCTIONS = frozenset({"range"})  # table-valued functions allowed in FROM
_ORDER_DEPENDENT_AGGREGATES = (exp.ArrayAgg, exp.ArrayUniqueAgg)  # allowed directly inside array_sort
_NOT_DETERMINISTIC = frozenset({
    "rand", "random", "randn", "uuid", "shuffle", "now", "current_date", "current_timestamp", "current_time",
    "localtimestamp", "current_timezone", "current_user", "user", "session_user", "current_database",
    "current_schema", "current_catalog", "monotonically_increasing_id", "spark_partition_id", "input_file_name",
    "input_file_block_start", "input_file_block_length", "version", "first", "last", "any_value", "collect_list",
    "collect_set", "percentile_approx", "approx_percentile", "mode",
    # max_by(x, y) / min_by(x, y): of the rows tied on y, which x is returned depends on the row order.
    "max_by", "min_by", "arg_max", "arg_min",
})  # fmt: skip
_TIE_DEPENDENT = frozenset({"max_by", "min_by", "arg_max", "arg_min"})
# Bare names Spark resolves to a session or clock value when no column has that name.
_SESSION_WORDS = frozenset({
    "user", "current_user", "session_user", "current_date", "current_timestamp", "current_time", "localtimestamp",
    "current_timezone", "current_catalog", "current_database", "current_schema", "grouping__id",
})  # fmt: skip
_SYNTAX_RULES = {
    "QueryTransform": "script TRANSFORM … USING is not allowed on the Spark engine",
    "Placeholder": "placeholders (? and :name) are not allowed on the Spark engine; write parameters as $name",
    "TableSample": "TABLESAMPLE is not allowed on the Spark engine (sampling is not deterministic)",
}
_SUBSTITUTION_RULE = "the SQL contains '${', which Spark would replace with configuration or environment values"
_MEANING_RULE = "the SQL does not print as Spark SQL that reads back the same; rewrite it"
_TABLE_ARGS = {"sample": "TABLESAMPLE", "pivots": "PIVOT", "version": "time travel"}
# Where VALUES is a relation for Spark too (its own rendering, checked against Spark's parser).
_VALUES_PARENTS = (exp.From, exp.Join, exp.Subquery, exp.Lateral, exp.CTE, exp.Union, exp.Intersect, exp.Except,
                   exp.Exists)


@dataclass(frozen=True)
class SparkStep:
    """A step that passed the gate; only :func:`render` turns it into SQL for Spark."""

    name: str  # the step name
    tree: exp.Expression  # the checked tree (a private copy, without hints or comments)
    parameter_names: frozenset[str]  # the $names the step uses


def _quote(text: str) -> str:
    cut = text if len(text) <= QUOTED_CHARS_MAX else text[: QUOTED_CHARS_MAX - 1] + "…"
    return repr(cut)


def _fail(step: str, rule: str) -> InputError:
    return InputError(f"step {step!r}: {rule}")


def _sql(step: str, tree: exp.Expr) -> str:
    """Spark SQL for a tree: every identifier quoted, no comments, refused where sqlglot would guess."""
    try:
        return tree.sql(dialect=_DIALECT, identify=True, comments=False, unsupported_level=ErrorLevel.RAISE)
    except RecursionError:
        raise
    except Exception:  # UnsupportedError, or a generator bug on an odd tree
        raise _fail(step, "the SQL uses a form that cannot be printed faithfully as Spark SQL") from None


def _parse(step: str, sql: str) -> exp.Expression:
    """The one query in sql (hints and comments dropped); InputError for anything else."""
    try:
        tokens = _DIALECT.tokenize(sql)
        trees = [t for t in _DIALECT.parser().parse(tokens, sql) if t is not None]
    except RecursionError:
        raise
    except SqlglotError as exc:
        first = _TOKEN.sub(r"'\1'", (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        raise _fail(step, f"the SQL does not parse as Spark SQL: {first[: QUOTED_CHARS_MAX * 2]}") from None
    except Exception as exc:  # sqlglot's parser also fails with IndexError and the like, e.g. on map(a)
        raise _fail(step, f"the SQL does not parse as Spark SQL ({type(exc).__name__})") from None
    for before, token in itertools.pairwise(tokens):
        if before.token_type == TokenType.PARAMETER and token.token_type == TokenType.L_BRACE:
            raise _fail(step, "write parameters as $name, not ${name} (Spark substitutes ${…} from its configuration)")
        if {before.token_type, token.token_type} <= _STRING_TOKENS and token.start == before.end + 1:
            # Spark reads 'a''b' as a'b; sqlglot reads two adjacent literals, CONCAT('a', 'b').
            raise _fail(step, "write a quote inside a string as \\' (Spark and sqlglot read '' differently)")
    if len(trees) != 1:
        raise InputError(f"step {step!r} must be exactly one query, found {len(trees)} statements")
    tree = trees[0]
    if not isinstance(tree, _QUERIES):
        kind = type(tree).__name__
        if isinstance(tree, exp.Command):
            kind += f" ({_quote(tree.name.upper())})"
        raise InputError(
            f"step {step!r} must be a query (SELECT, WITH … SELECT, UNION/INTERSECT/EXCEPT or VALUES), "
            f"found a statement of type {kind}"
        )
    for hint in list(tree.find_all(exp.Hint)):
        hint.pop()
    for node in tree.walk():
        node.comments = None
    return tree


def _function_label(node: exp.Expr) -> str:
    """The Spark name of a function node, as the user most likely wrote it."""
    if isinstance(node, exp.Anonymous):
        return node.name
    try:
        head = node.sql(dialect=_DIALECT).split("(", 1)[0].strip().lower()
    except Exception:  # only a label for a message: fall back to the class name
        head = ""
    return head if _NAME.match(head) else (node.sql_name() if isinstance(node, exp.Func) else node.key).lower()


def _sorted_aggregate_refusal(aggregate: exp.Expr, sort: exp.ArraySort) -> str | None:
    """None when an order-dependent aggregate is the array array_sort (or sort_array) sorts by its natural
    order; else the rule. A comparator can call two elements equal, and those stay in row order."""
    if aggregate.arg_key == "this" and sort.args.get("expression") is None:
        return None
    return (
        f"function {_function_label(aggregate)} is allowed on the Spark engine only as the one argument of "
        "array_sort (or sort_array) without a comparator: its order depends on the row order, and steps "
        "must be deterministic"
    )


def _refusal(node: exp.Expr) -> str | None:
    """Why a node that is not plain allowed syntax is refused, or None when it is fine (no context)."""
    if isinstance(node, exp.Anonymous):
        name = node.name
        if name.isascii() and name.lower() in _ANONYMOUS_FUNCTIONS:
            return None
    elif type(node) in _FUNCTIONS:
        return None
    elif isinstance(node, _ORDER_DEPENDENT_AGGREGATES) and isinstance(node.parent, exp.ArraySort):
        return _sorted_aggregate_refusal(node, node.parent)
    if isinstance(node, exp.Func):
        label = _function_label(node)
        rule = f"function {_quote(label)[1:-1]} is not allowed on the Spark engine"
        if label.lower() in _TIE_DEPENDENT:
            rule += (
                ": of the rows tied on its ordering argument, which value it returns depends on the row order, "
                "and steps must be deterministic (max(struct(y, x)).x breaks ties by x)"
            )
        elif label.lower() in _NOT_DETERMINISTIC:
            rule += (
                ": its result depends on the clock, the session or the row order, and steps must be "
                "deterministic (pass such a value as a parameter)"
            )
        return rule
    kind = type(node).__name__
    return _SYNTAX_RULES.get(kind, f"{kind} syntax is not allowed on the Spark engine")


def _visible_ctes(table: exp.Table) -> set[str]:
    """Lowercased names of the CTEs in scope at table (a CTE sees only the CTEs before it)."""
    names: set[str] = set()
    child: exp.Expr = table
    node = table.parent
    while node is not None:
        if isinstance(node, exp.With):
            for cte in node.expressions:
                if cte is child:
                    break
                names.add(cte.alias.lower())
        else:
            with_ = node.args.get("with_")
            if isinstance(with_, exp.With) and with_ is not child:
                names.update(cte.alias.lower() for cte in with_.expressions)
        child, node = node, node.parent
    return names


def _check_table(step: str, table: exp.Table, relations: frozenset[str]) -> None:
    extra = sorted(key for key, value in table.args.items() if value and key not in ("this", "alias"))
    target = table.this
    if isinstance(target, exp.Func):
        label = _function_label(target)
        if label.lower() not in _TABLE_FUNCTIONS:
            raise _fail(step, f"table function {_quote(label)[1:-1]} is not allowed on the Spark engine")
    elif {"db", "catalog"} & set(extra) or not isinstance(target, exp.Identifier):
        dotted = ".".join(part.name for part in table.parts)
        raise InputError(f"step {step!r} reads {_quote(dotted)}, which is not a declared source or an earlier step")
    if extra:
        raise _fail(step, f"{_TABLE_ARGS.get(extra[0], extra[0])} on a relation is not allowed on the Spark engine")
    if isinstance(target, exp.Func):
        return
    name = table.name.lower()
    if name not in relations and name not in _visible_ctes(table):
        raise InputError(
            f"step {step!r} reads {_quote(table.name)}, which is not a declared source or an earlier step"
        )


def _check_context(step: str, node: exp.Expr) -> bool:
    """True when node is a context-checked kind and passes; raises when it fails; False otherwise."""
    parent = node.parent
    if isinstance(node, exp.Var):
        unit = node.arg_key == "unit" or (isinstance(parent, exp.Extract) and node.arg_key == "this")
        if (unit and _UNIT.match(node.name)) or isinstance(parent, exp.Parameter):
            return True
        raise _fail(step, f"the word {_quote(node.name)} is not allowed here on the Spark engine")
    if isinstance(node, exp.Column):
        if not node.table and isinstance(node.this, exp.Identifier) and node.name.lower() in _SESSION_WORDS:
            raise _fail(
                step,
                f"the bare name {_quote(node.name)} can mean a session or clock value on Spark; "
                "qualify the column with its relation (t.name)",
            )
        return True
    if isinstance(node, exp.Dot):
        if isinstance(node.expression, exp.Identifier):
            return True
        raise _fail(step, "qualified function names (db.function) are not allowed on the Spark engine")
    if isinstance(node, exp.With):
        if node.args.get("recursive"):
            raise _fail(step, "WITH RECURSIVE is not allowed on the Spark engine")
        return True
    if isinstance(node, exp.DataType):
        if node.this == exp.DataType.Type.USERDEFINED:
            raise _fail(step, f"the type {_quote(node.sql(dialect=_DIALECT))} is not allowed on the Spark engine")
        return True
    if isinstance(node, exp.ColumnDef):
        if isinstance(parent, exp.DataType):
            return True
        raise _fail(step, "a column definition is not allowed here on the Spark engine")
    return False


def _check_parameter(step: str, node: exp.Parameter) -> str:
    name = node.this.name if isinstance(node.this, exp.Var) else ""
    if not _NAME.match(name):
        raise _fail(step, "parameters are written $name with a plain name (letters, digits, _)")
    return name


def _check_tree(step: str, tree: exp.Expr, relations: frozenset[str]) -> frozenset[str]:
    """Check every node against the allow-list; the names of the parameters used."""
    parameters: set[str] = set()
    for count, node in enumerate(tree.walk(), start=1):
        if count > STEP_NODES_MAX:
            raise _fail(step, f"the SQL has more than {STEP_NODES_MAX} syntax nodes")
        if isinstance(node, exp.Table):
            _check_table(step, node, relations)
        elif isinstance(node, exp.Values) and node.parent is not None and not isinstance(node.parent, _VALUES_PARENTS):
            # sqlglot prints x IN (VALUES (1), (2)) as it reads it; Spark reads that VALUES as a call of a
            # function named values, which is on no allow-list.
            raise _fail(
                step, "VALUES is allowed only as a relation on the Spark engine (write IN (SELECT * FROM VALUES …))"
            )
        elif isinstance(node, exp.Parameter):
            parameters.add(_check_parameter(step, node))
        elif type(node) in _SYNTAX or _check_context(step, node):
            continue
        elif isinstance(node.parent, exp.Table) and node.arg_key == "this":
            continue  # a table function, checked with its table
        elif (rule := _refusal(node)) is not None:
            raise _fail(step, rule)
    return frozenset(parameters)


def _identifier_names(tree: exp.Expr) -> list[str]:
    """The names of the identifiers in tree, sorted (a rendering must keep each one); a function's name
    lowercased, as sqlglot prints `pmod`(…) as `PMOD`(…) and Spark matches function names in any case."""
    nodes = tree.find_all(exp.Identifier)
    return sorted(node.name.lower() if isinstance(node.parent, exp.Anonymous) else node.name for node in nodes)


def _check_rendering(step: str, tree: exp.Expr, relations: frozenset[str]) -> tuple[str, frozenset[str]]:
    """Print tree and prove that sqlglot reads the text back to a tree that passes the gate again and
    prints the same text (after at most one normalizing pass, e.g. INTERVAL 5 DAY -> INTERVAL '5' DAY);
    refuse ``${`` anywhere in it. The text and the parameter names it still holds."""
    text = _sql(step, tree)
    names = _identifier_names(tree)
    for _ in range(RENDER_PASSES_MAX):
        if "${" in text:
            raise _fail(step, _SUBSTITUTION_RULE)
        if any(token.comments for token in _DIALECT.tokenize(text)):
            raise _fail(step, _MEANING_RULE)  # every comment was dropped before printing
        again = _parse(step, text)
        if _identifier_names(again) != names:
            raise _fail(step, _MEANING_RULE)  # a name printed unquoted read back as another name
        parameters = _check_tree(step, again, relations)
        printed = _sql(step, again)
        if printed == text:
            return text, parameters
        text = printed
    raise _fail(step, "the SQL uses a form that does not print back the same as Spark SQL; rewrite it")


def gate_step(step_name: str, sql: str, relations: Collection[str]) -> SparkStep:
    """Parse, check against the allow-list, return the checked tree. relations = the names the step may
    read (declared sources and earlier steps, case-insensitive like Spark); CTE names defined inside the
    statement are also fine."""
    allowed = frozenset(name.lower() for name in relations)
    try:
        tree = _parse(step_name, sql)
        parameters = _check_tree(step_name, tree, allowed)
        probe = tree.copy()
        for node in list(probe.find_all(exp.Parameter)):
            node.replace(exp.Literal.number(0))
        _check_rendering(step_name, probe, allowed)
    except RecursionError:
        raise _fail(step_name, "the SQL is nested too deeply") from None
    return SparkStep(step_name, tree, parameters)


def _decimal_literal(text: str) -> exp.Expr:
    value = decimal.Decimal(text)
    if not value.is_finite():
        raise InputError("NaN and infinity are not allowed")
    digits, exponent = value.as_tuple().digits, int(value.as_tuple().exponent)
    scale = max(0, -exponent)
    precision = max(max(0, len(digits) + exponent) + scale, 1)
    if precision > DECIMAL_PRECISION_MAX:
        raise InputError(f"a decimal parameter needs more than {DECIMAL_PRECISION_MAX} digits on the Spark engine")
    to = exp.DataType.build(f"DECIMAL({precision}, {scale})", dialect=_DIALECT)
    return exp.Cast(this=exp.Literal.string(format(value, "f")), to=to)


def _string_literal(text: str) -> exp.Expr:
    """Plain printable ASCII without quote, backslash or $ as '…'; anything else as its UTF-8 bytes,
    CAST(X'…' AS STRING), which reads the same under every Spark parser setting and cannot form ${."""
    if all(" " <= char <= "~" and char not in "'\\$" for char in text):
        return exp.Literal.string(text)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError("a string parameter is not valid Unicode") from None
    return exp.Cast(this=exp.HexString(this=data.hex().upper()), to=exp.DataType.build("STRING"))


def _literal(type_name: str, value: Any) -> exp.Expr:
    """The Spark literal for a canonical parameter value (see dataflow/definitions/parameters.py)."""
    if type_name == "string" and isinstance(value, str):
        return _string_literal(value)
    if type_name == "int" and isinstance(value, int) and not isinstance(value, bool):
        number = exp.Literal.number(abs(value))
        return exp.Paren(this=exp.Neg(this=number)) if value < 0 else number
    if type_name == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        # Canonical JSON (RFC 8785) writes 2.0 as 2, so a float may come back as an int.
        if not math.isfinite(value):
            raise InputError("NaN and infinity are not allowed")
        return exp.Cast(this=exp.Literal.string(repr(float(value))), to=exp.DataType.build("DOUBLE"))
    if type_name == "bool" and isinstance(value, bool):
        return exp.Boolean(this=value)
    if type_name == "date" and isinstance(value, str):
        day = dt.date.fromisoformat(value)
        return exp.Cast(this=exp.Literal.string(day.isoformat()), to=exp.DataType.build("DATE"))
    if type_name == "timestamp" and isinstance(value, str):
        moment = dt.datetime.fromisoformat(value)
        if moment.tzinfo is None:  # a wall-clock time, like DuckDB's TIMESTAMP
            to = exp.DataType.build("TIMESTAMP_NTZ", dialect=_DIALECT)
        else:  # an instant, written in UTC, whatever the session time zone
            moment, to = moment.astimezone(dt.UTC), exp.DataType.build("TIMESTAMP_LTZ", dialect=_DIALECT)
        return exp.Cast(this=exp.Literal.string(moment.isoformat(sep=" ")), to=to)
    if type_name == "decimal" and isinstance(value, str):
        return _decimal_literal(value)
    raise InputError(f"the value is not a canonical {type_name} for the Spark engine")


def render(step: SparkStep, bound: Mapping[str, tuple[str, Any]]) -> str:
    """Spark SQL rendered from the checked tree (never the user's text), with every $name replaced by a
    typed literal built by the platform. bound maps name -> (declared type name, canonical value).

    Literals: string ``'…'`` when printable ASCII without ``'``, ``\\`` or ``$``, else
    ``CAST(X'<UTF-8 hex>' AS STRING)``; int ``42`` or ``(-5)``; float ``CAST('<repr>' AS DOUBLE)``
    (NaN and infinity refused); bool ``TRUE``; date ``CAST('2026-11-02' AS DATE)``; timestamp with an
    offset ``CAST('2026-11-02 08:30:00+00:00' AS TIMESTAMP_LTZ)`` (the instant, in UTC), without one
    ``CAST('…' AS TIMESTAMP_NTZ)``; decimal ``CAST('12.3' AS DECIMAL(3, 1))`` (its own precision and scale).
    """
    tree = step.tree.copy()
    for node in list(tree.find_all(exp.Parameter)):
        name = node.this.name
        if name not in bound:
            raise _fail(step.name, f"parameter {name!r} has no value")
        type_name, value = bound[name]
        try:
            node.replace(_literal(type_name, value))
        except (InputError, ValueError, ArithmeticError) as exc:
            reason = exc.message if isinstance(exc, InputError) else "the value does not fit its type"
            raise _fail(step.name, f"parameter {name!r} ({type_name}): {reason}") from None
    relations = frozenset(t.name.lower() for t in step.tree.find_all(exp.Table) if isinstance(t.this, exp.Identifier))
    try:
        text, left = _check_rendering(step.name, tree, relations)
    except RecursionError:
        raise _fail(step.name, "the SQL is nested too deeply") from None
    invariant(not left, f"step {step.name!r}: every parameter was replaced by a literal")
    return text
