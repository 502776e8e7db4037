"""The package's layering: docs/design.md's layer table, checked against every import of every module.

A unit is a subpackage of ``lightning_fedmeta`` or a module at its top level (``lightning_fedmeta`` itself is the
package ``__init__``). A unit imports only units of its own layer or a lower one, and no two units import each other,
directly or through others. Imports inside functions and under ``TYPE_CHECKING`` count: a lazy import that exists to
break a cycle is still the cycle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import lightning_fedmeta

PACKAGE = "lightning_fedmeta"
ROOT = Path(lightning_fedmeta.__file__).parent
DESIGN = ROOT.parent / "docs" / "design.md"
MAX_TOP_LEVEL_MODULES = 12


def layer_table() -> dict[str, int]:
    """``| layer | `unit` | what |`` rows of docs/design.md's "### Layers" table."""
    text = DESIGN.read_text()
    start = text.index("### Layers")
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*`?([\w.]+)`?\s*\|", text[start:], re.M)
    assert rows, "docs/design.md's '### Layers' section has no table rows '| layer | `unit` | what |'"
    return {unit: int(layer) for layer, unit in rows}


def unit_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if len(rel.parts) > 1:
        return rel.parts[0]
    return PACKAGE if rel.name == "__init__.py" else rel.stem


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGE, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of_module(dotted: str) -> str:
    parts = dotted.split(".")
    if len(parts) == 1:
        return PACKAGE
    return parts[1]


def imports(path: Path) -> Iterator[tuple[str, int, str]]:
    """(imported dotted module, line, source line) for every import of the package in ``path``, at any depth."""
    source = path.read_text()
    lines = source.splitlines()
    name = module_name(path)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT.parent.joinpath(*sub.split(".")).with_suffix(".py").exists()
                             or ROOT.parent.joinpath(*sub.split("."), "__init__.py").exists())
                targets.append(sub if is_module else base)
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                yield target, node.lineno, lines[node.lineno - 1].strip()


def edges() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, 'file:line: source') for every import between two units."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        here = unit_of_file(path)
        for target, line, text in imports(path):
            there = unit_of_module(target)
            if there != here:
                out.append((here, there, f"{path.relative_to(ROOT.parent)}:{line}: {text}"))
    return out


def units() -> set[str]:
    found = {PACKAGE}
    for path in ROOT.iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            found.add(path.name)
        elif path.suffix == ".py" and path.name != "__init__.py":
            found.add(path.stem)
    return found


def test_the_layer_table_names_every_unit_and_only_those() -> None:
    table = layer_table()
    assert units() - set(table) == set(), (
        f"units missing from docs/design.md's layer table: {sorted(units() - set(table))}")
    assert set(table) - units() == set(), (
        f"docs/design.md's layer table names units that do not exist: {sorted(set(table) - units())}")


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    table = layer_table()
    bad = [f"{where}  ({here}, layer {table[here]} -> {there}, layer {table[there]})"
           for here, there, where in edges() if here in table and there in table and table[there] > table[here]]
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_units() -> None:
    found = edges()
    graph: dict[str, set[str]] = {}
    for here, there, _ in found:
        graph.setdefault(here, set()).add(there)
    cycles = strongly_connected(graph)
    report = []
    for component in cycles:
        report.append(f"cycle between {', '.join(component)}:")
        report += [f"  {where}" for here, there, where in found if here in component and there in component]
    assert not cycles, "\n".join(report)


def test_the_top_level_holds_at_most_twelve_modules() -> None:
    modules = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, f"{len(modules)} top-level modules: {modules}"


def test_the_checker_sees_a_lazy_import_cycle(tmp_path: Path) -> None:
    """The checks can fail: a function-level import from a lower unit to a higher one is an edge of both checks."""
    source = "def f():\n    from lightning_fedmeta.module import FederatedModule\n    return FederatedModule\n"
    tree = ast.parse(source)
    lazy = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert lazy and lazy[0].col_offset > 0
    graph = {"client": {"module"}, "module": {"client"}}
    assert strongly_connected(graph) == [["client", "module"]]
    table = layer_table()
    assert table["client"] < table["module"]
