"""Code shape (issue 13, item 10), read from the source with ``ast``; nothing is imported.

(a) The import graph of ``durable_dataflow`` has no cycle among the imports that run when a module
    is imported (top level, class bodies, ``try``/``if`` blocks, but not ``if TYPE_CHECKING:``).
    Imports inside functions are lazy: they are listed (``test_lazy_imports_are_listed``) and left
    out of the graph.
(b) No module imports or uses another ``durable_dataflow`` module's private name (``from x import _y``,
    ``x._y``, ``X._y`` for a name ``X`` imported from ``x``). Private attributes of third-party objects
    (``row._mapping``) are not this project's names and are not checked.
(d) Every import, type-only and lazy ones included, points down: the parts in ``PARTS`` order, and
    inside ``dataflow`` the wings in ``WINGS`` order (definitions <- execution <- protocol <- schedules,
    with ``dataflow.schema`` below them and ``dataflow.worker`` above); no cycle even among type-only
    and lazy imports.
(c) Every platform table (the ``sa.Table`` objects of the parts' ``schema`` modules) is used only by
    the module(s) that own its statements (``OWNERS``); the schema modules and the migrations may
    name every table.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = "durable_dataflow"
SOURCE = Path(__file__).resolve().parents[2] / "src" / PACKAGE

# table (schema module, name) -> (owning modules, why they own it)
OWNERS: dict[tuple[str, str], tuple[frozenset[str], str]] = {
    ("core.schema", "ledger_entries"): (
        frozenset({"core.ledger"}),
        "the hash-chained ledger: append, read, verify, and the read-only counts Ops shows",
    ),
    ("core.schema", "ledger_outbox"): (
        frozenset({"core.ledger"}),
        "the keys of committed entries awaiting delivery (lineage): written with the entry, read, deleted",
    ),
    ("core.schema", "leases"): (
        frozenset({"core.leases", "core.fencing"}),
        "leases grants and guards attempts; fencing locks the lease row (FOR UPDATE) to fence a write",
    ),
    ("core.schema", "checkpoints"): (
        frozenset({"core.checkpoints"}),
        "a checkpoint is written only after its chain and facts verify, in the caller's transaction",
    ),
    ("dataflow.schema", "definitions"): (
        frozenset({"dataflow.definitions.catalog"}),
        "the content-addressed definitions catalogue: stored once per hash, read by the service, CLI, Ops",
    ),
    ("dataflow.schema", "dataflow_runs"): (
        frozenset({"dataflow.protocol.runs"}),
        "the DataflowRun projection: insert, update (attempt-guarded), claim, lookups, listings, counts",
    ),
    ("dataflow.schema", "run_results"): (
        frozenset({"dataflow.execution.results"}),
        "stored result bytes: written in the commit that ends execution, read for export and verification",
    ),
    ("dataflow.schema", "tenant_result_bytes"): (
        frozenset({"dataflow.execution.results"}),
        "the bytes each tenant's results stored: added to by results.store, read for the result_bytes quota",
    ),
    ("dataflow.schema", "partition_tokens"): (
        frozenset({"dataflow.protocol.partition_tokens"}),
        "the monotonic token per partition of a replace_partition target, taken in the pre-dispatch commit",
    ),
    ("dataflow.schema", "workers"): (
        frozenset({"dataflow.protocol.fleet"}),
        "one heartbeat row per worker process and serve sweeper: register, beat, mark stopped, list with liveness",
    ),
    ("dataflow.schedules.schedule_schema", "schedules"): (
        frozenset({"dataflow.schedules.schedules"}),
        "applied schedules per tenant and definition name: apply, pause, list",
    ),
    ("dataflow.schedules.schedule_schema", "schedule_ticks"): (
        frozenset({"dataflow.schedules.schedules"}),
        "one decision per tick, exactly once (insert-or-ignore on its primary key)",
    ),
    ("datasources.schema", "datasources"): (
        frozenset({"datasources.registry"}),
        "the named-datasource registry per tenant",
    ),
    ("datasources.schema", "datasource_locations"): (
        frozenset({"datasources.registry"}),
        "where each datasource was created and what was created there: never re-created once recorded",
    ),
    ("api.schema", "api_tokens"): (
        frozenset({"api.tokens"}),
        "operator and tenant tokens: issued, listed, revoked, checked by hash",
    ),
}
SCHEMA_MODULES = frozenset(schema for schema, _ in OWNERS)
EVERY_TABLE_ALLOWED = ("migrations",)  # migrations create (and may backfill) every part's tables


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    lazy: bool
    typed: bool = False  # under ``if TYPE_CHECKING:``: never runs, but still a dependency of the code


@dataclass
class Module:
    name: str  # dotted, without the package prefix ("dataflow.protocol.service"; "" for the package itself)
    path: Path
    tree: ast.Module
    is_package: bool
    imports: list[Import] = field(default_factory=list)


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _load() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        name, is_package = _module_name(path)
        found[name] = Module(name, path, ast.parse(path.read_text(encoding="utf-8"), str(path)), is_package)
    return found


MODULES = _load()


def _local(dotted: str) -> str | None:
    """``durable_dataflow.x.y`` -> ``x.y`` (``""`` for the package), else None."""
    if dotted == PACKAGE:
        return ""
    if dotted.startswith(PACKAGE + "."):
        return dotted[len(PACKAGE) + 1 :]
    return None


def _absolute(module: Module, node: ast.ImportFrom) -> str | None:
    """The local name of what a ``from … import`` imports from (relative imports resolved)."""
    if node.level == 0:
        return _local(node.module or "")
    base = module.name.split(".") if module.name else []
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _join(package: str, name: str) -> str:
    return f"{package}.{name}" if package else name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    body: list[ast.stmt], lazy: bool, typed: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement, with whether it is lazy (inside a function) and whether it is
    type-only (inside ``if TYPE_CHECKING:``, which never runs)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, lazy, typed
        elif isinstance(node, ast.If):
            yield from _import_nodes(node.body, lazy, typed or _is_type_checking(node.test))
            yield from _import_nodes(node.orelse, lazy, typed)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _import_nodes(node.body, True, typed)
        elif isinstance(node, ast.ClassDef):
            yield from _import_nodes(node.body, lazy, typed)  # a class body runs at import time
        elif isinstance(node, ast.Try | ast.TryStar):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _import_nodes(block, lazy, typed)
        elif isinstance(node, ast.With | ast.AsyncWith | ast.For | ast.AsyncFor | ast.While):
            yield from _import_nodes(node.body, lazy, typed)
            yield from _import_nodes(getattr(node, "orelse", []), lazy, typed)


def _targets(module: Module, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The project modules an import statement loads (a submodule when the name is one, else the
    package or module the names come from)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            local = _local(alias.name)
            if local is not None:
                yield local
        return
    source = _absolute(module, node)
    if source is None:
        return
    for alias in node.names:
        submodule = _join(source, alias.name)
        yield submodule if submodule in MODULES else source


def _packages_run_first(importer: str, target: str) -> list[str]:
    """The packages whose ``__init__`` runs before ``target`` when ``importer`` imports it: the
    target's enclosing packages that do not already enclose the importer (the root never counts)."""
    parts = target.split(".")
    enclosing = {".".join(importer.split(".")[:n]) for n in range(1, importer.count(".") + 2)}
    return [p for p in (".".join(parts[:n]) for n in range(1, len(parts))) if p not in enclosing]


for _module in MODULES.values():
    for _node, _lazy, _typed in _import_nodes(_module.tree.body, False):
        _loaded = set(_targets(_module, _node))
        _loaded |= {p for t in _loaded for p in _packages_run_first(_module.name, t)}
        for _target in sorted(_loaded):
            if _target != _module.name:
                _module.imports.append(Import(_module.name, _target, _node.lineno, _lazy, _typed))


def _label(name: str) -> str:
    return _join(PACKAGE, name)


# ---- (a) no import cycle -----------------------------------------------------------------------


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_cycle_at_import_time() -> None:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    where: dict[tuple[str, str], int] = {}
    for module in MODULES.values():
        for item in module.imports:
            if not item.lazy and not item.typed:
                edges[module.name].add(item.imported)
                where.setdefault((module.name, item.imported), item.line)
    cycles = _cycles(edges)
    described = []
    for component in cycles:
        members = set(component)
        links = sorted(
            f"{_label(a)}:{where[(a, b)]} -> {_label(b)}" for a in component for b in edges[a] if b in members
        )
        described.append("cycle among " + ", ".join(_label(m) for m in component) + ":\n    " + "\n    ".join(links))
    assert not cycles, "\n".join(described)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_importing_a_submodule_runs_its_packages_first() -> None:
    assert _packages_run_first("dataflow.execution.sources", "datasources.contract") == ["datasources"]
    assert _packages_run_first("datasources.registry", "datasources.contract") == []
    assert _packages_run_first("cli", "cli.common") == []


def test_lazy_imports_are_listed() -> None:
    """Lazy (function-level) imports of project modules are outside the cycle check; this lists
    them (``pytest -s``) so a reader sees what the graph leaves out. Each must name a real module."""
    lazy = sorted(
        (item.importer, item.line, item.imported)
        for module in MODULES.values()
        for item in module.imports
        if item.lazy
    )
    for importer, line, imported in lazy:
        print(f"lazy import: {_label(importer)}:{line} -> {_label(imported)}")
        assert imported in MODULES, f"{_label(importer)}:{line} imports {_label(imported)}, which does not exist"


# ---- (d) parts and wings: every import points down ---------------------------------------------

# Each part may import the parts before it (and the package root, for ``__version__``).
PARTS = ("core", "datasources", "dataflow", "migrations", "ops", "lineage", "platform", "api", "cli")
# Inside ``dataflow``: rank of each wing; a module may import modules of its own rank or lower.
WINGS = {
    "dataflow": 0,  # the package itself: its docstring says how the wings are ordered
    "dataflow.schema": 0,  # the part's tables, each with one owner (OWNERS): below every wing
    "dataflow.definitions": 1,  # what a dataflow is
    "dataflow.execution": 2,  # computing its result
    "dataflow.protocol": 3,  # the run's recorded life
    "dataflow.schedules": 4,  # runs submitted by time
    "dataflow.worker": 5,  # the loop above them all
}


def _every_edge() -> list[Import]:
    return [item for module in MODULES.values() for item in module.imports]


def _part_rank(name: str) -> int | None:
    return None if name == "" else PARTS.index(name.split(".")[0])


def _wing_rank(name: str) -> int:
    """The rank of the wing holding a dataflow module (its longest listed prefix)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in WINGS:
            return WINGS[prefix]
    raise AssertionError(f"{_label(name)} lies in no wing of WINGS")


def _against_the_order(edges: list[Import]) -> list[str]:
    """Each import that points up: to a later part, or inside dataflow to a later wing."""
    found = []
    for item in edges:
        src, dst = _part_rank(item.importer), _part_rank(item.imported)
        kind = "type-only" if item.typed else "lazy" if item.lazy else "import"
        where = f"{_label(item.importer)}:{item.line} -> {_label(item.imported)} ({kind})"
        if src is not None and dst is not None and dst > src:
            found.append(where + ": a later part")
        elif src == dst == PARTS.index("dataflow") and _wing_rank(item.imported) > _wing_rank(item.importer):
            found.append(where + ": a later wing")
    return found


def test_every_part_and_module_is_placed() -> None:
    """Every module lies in a listed part, and every dataflow module in a listed wing (a new flat file in
    dataflow/ must choose its wing)."""
    for name in MODULES:
        if name:
            assert name.split(".")[0] in PARTS, f"{_label(name)} lies in no part of PARTS"
        if name.startswith("dataflow"):
            _wing_rank(name)
    for wing in WINGS:
        assert wing in MODULES, f"{wing} is listed in WINGS but does not exist"


def test_every_import_points_down_the_parts_and_the_wings() -> None:
    found = _against_the_order(_every_edge())
    assert not found, "imports against the order of parts and wings:\n" + "\n".join(sorted(found))


def test_the_order_check_finds_an_upward_import() -> None:
    """The check is not vacuous: a type-only import of protocol from execution, a lazy import of the CLI
    from core and an import of the worker from schedules are each found; imports down are not."""
    up = [
        Import("dataflow.execution.compute", "dataflow.protocol.runs", 1, False, True),
        Import("core.db", "cli", 2, True),
        Import("dataflow.schedules.backfill", "dataflow.worker", 3, False),
    ]
    down = [
        Import("dataflow.protocol.runs", "dataflow.execution.results", 4, False),
        Import("dataflow.definitions.catalog", "dataflow.schema", 5, False, True),
        Import("api.app", "dataflow.protocol.views", 6, True),
    ]
    assert len(_against_the_order(up)) == 3
    assert _against_the_order(down) == []


def test_no_cycle_even_among_type_only_and_lazy_imports() -> None:
    """A cycle through a type-only or function-level import still ties two modules together: one cannot
    be read, moved or tested without the other."""
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for item in _every_edge():
        edges[item.importer].add(item.imported)
    cycles = _cycles(edges)
    assert not cycles, "cycles (any kind of import): " + "; ".join(", ".join(map(_label, c)) for c in cycles)


# ---- (b) no private name of another module -----------------------------------------------------


def _bound_names(module: Module) -> dict[str, str]:
    """Local names bound by imports of project objects -> the project module they come from (for a
    module, itself; for a name imported from a module, that module)."""
    bound: dict[str, str] = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = _local(alias.name)
                if local is None:
                    continue
                if alias.asname is not None:
                    bound[alias.asname] = local
                else:
                    bound[alias.name.split(".")[0]] = ""  # `import durable_dataflow.x` binds the package
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source is None:
                continue
            for alias in node.names:
                submodule = _join(source, alias.name)
                bound[alias.asname or alias.name] = submodule if submodule in MODULES else source
    return bound


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None when the chain does not start at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _private_uses(module: Module) -> Iterator[str]:
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source is None or source == module.name:
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    yield f"{module.path.name}:{node.lineno}: from {_label(source)} import {alias.name}"
    bound = _bound_names(module)
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        chain = _dotted(node)
        if chain is None or chain[0] not in bound:
            continue
        owner = bound[chain[0]]
        # Walk down the dotted chain while it names project modules: `durable_dataflow.core.db._x`.
        for part in chain[1:-1]:
            if _join(owner, part) in MODULES:
                owner = _join(owner, part)
            else:
                break
        if owner != module.name:
            yield f"{module.path.name}:{node.lineno}: {'.'.join(chain)} (private name of {_label(owner)})"


def test_no_module_uses_another_modules_private_names() -> None:
    found = [
        f"{_label(module.name)} ({use})"
        for module in MODULES.values()
        for use in _private_uses(module)
    ]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_private_name_check_sees_both_forms(tmp_path: Path) -> None:
    source = (
        "from durable_dataflow.core.db import _sqlite_file\n"
        "from durable_dataflow.core import db\n"
        "from durable_dataflow.dataflow.protocol.runs import Run\n"
        "def f(row):\n"
        "    return db._postgres_engine, Run._private, row._mapping, db.__name__\n"
    )
    module = Module("cli.example", tmp_path / "example.py", ast.parse(source), False)
    uses = list(_private_uses(module))
    assert len(uses) == 3, uses
    assert any("_sqlite_file" in u for u in uses) and any("db._postgres_engine" in u for u in uses)
    assert any("Run._private" in u for u in uses)


# ---- (c) each table used only by its owners ----------------------------------------------------


def _declared_tables() -> set[tuple[str, str]]:
    """Every ``name = sa.Table(...)`` / ``Table(...)`` at the top of a schema module."""
    declared: set[tuple[str, str]] = set()
    for name, module in MODULES.items():
        if not name.endswith("schema") or name.startswith(EVERY_TABLE_ALLOWED):
            continue
        for node in module.tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                func = node.value.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called == "Table":
                    declared.update((name, t.id) for t in node.targets if isinstance(t, ast.Name))
    return declared


def test_the_ownership_map_names_every_table() -> None:
    assert _declared_tables() == set(OWNERS)
    for schema, table in OWNERS:
        owners, reason = OWNERS[(schema, table)]
        assert reason and all(owner in MODULES for owner in owners), (schema, table)


def _table_uses(module: Module) -> Iterator[tuple[tuple[str, str], int]]:
    """Where a module uses a table object: a name bound to it by ``from <schema> import <table>``,
    or ``<schema module>.<table>``."""
    tables: dict[str, tuple[str, str]] = {}  # local name -> table
    schemas: dict[str, str] = {}  # local name -> schema module
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                local_name = alias.asname or alias.name
                if source in SCHEMA_MODULES and (source, alias.name) in OWNERS:
                    tables[local_name] = (source, alias.name)
                elif source is not None and _join(source, alias.name) in SCHEMA_MODULES:
                    schemas[local_name] = _join(source, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                local = _local(alias.name)
                if local in SCHEMA_MODULES and alias.asname:
                    schemas[alias.asname] = local
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in tables:
            yield tables[node.id], node.lineno
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in schemas:
            key = (schemas[node.value.id], node.attr)
            if key in OWNERS:
                yield key, node.lineno


@functools.cache
def _table_uses_of(name: str) -> tuple[tuple[tuple[str, str], int], ...]:
    """``_table_uses`` of one module, walked once for every test that asks."""
    return tuple(_table_uses(MODULES[name]))


def test_each_table_is_used_only_by_its_owners() -> None:
    found = []
    for name in MODULES:
        if name in SCHEMA_MODULES or name.startswith(EVERY_TABLE_ALLOWED):
            continue
        for (schema, table), line in _table_uses_of(name):
            owners, _ = OWNERS[(schema, table)]
            if name not in owners:
                found.append(
                    f"{_label(name)}:{line} uses {table} (owned by {', '.join(_label(o) for o in sorted(owners))})"
                )
    assert not found, "tables used outside their owning modules:\n" + "\n".join(sorted(set(found)))


@pytest.mark.parametrize("table", sorted(f"{schema}.{table}" for schema, table in OWNERS))
def test_each_table_has_an_owner_that_uses_it(table: str) -> None:
    schema, name = table.rsplit(".", 1)
    owners, _ = OWNERS[(schema, name)]
    users = {m for m in MODULES if any(key == (schema, name) for key, _ in _table_uses_of(m))}
    assert owners <= users, f"{table}: owners that do not use it: {sorted(owners - users)}"
