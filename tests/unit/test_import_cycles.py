"""No import cycles in the package, and bench/ depends on the package, never on tests/.

Every import, read with ast (nothing is imported): at module level, and inside functions too,
where an import deferred to break a cycle only hides it (scrape.py imported kube.py that way
while kube.py imported scrape.py). `if TYPE_CHECKING:` blocks never run and are left out.
`from package import name` is an edge to package.name when that is a module, else to package
(whose __init__ runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = [ROOT / "operator", ROOT / "trainer_image", ROOT / "devcluster"]
BENCH = ROOT / "bench"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the package and of bench/, by dotted name (bench's as bench.<name>)."""
    found = {_module_name(p, r): p for r in SOURCE_ROOTS for p in (r / "dtjob").rglob("*.py")}
    found |= {_module_name(p, ROOT): p for p in BENCH.rglob("*.py")}
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """The import statements of a tree, wherever they are, but under `if TYPE_CHECKING:`."""

    def __init__(self) -> None:
        self.found: list[ast.Import | ast.ImportFrom] = []

    def visit_If(self, node: ast.If) -> None:
        for child in node.orelse if _is_type_checking(node) else [node.test, *node.body, *node.orelse]:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append(node)


def _run_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    visitor = _Imports()
    visitor.visit(tree)
    return visitor.found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules `name` (at `path`) imports when it runs: all of them, known or not."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _run_time_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        for alias in node.names:
            child = f"{base}.{alias.name}"
            found.add(child if child in known else base)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) & known for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself),
    each sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges.get(node, ()):
                    found.append(sorted(component))
    return found


def test_cycles_finds_a_cycle_and_names_its_modules() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert sorted(cycles(edges)) == [["a", "b", "c"], ["e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_reads_relative_from_and_deferred_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import p.x\n"
        "from p import y, CONSTANT\n"
        "from . import z\n"
        "if TYPE_CHECKING:\n    import p.hidden\n"
        "try:\n    import p.w\nexcept ImportError:\n    pass\n"
        "def f():\n    import p.late\n"
    )
    known = {"p", "p.x", "p.y", "p.z", "p.w", "p.hidden", "p.late", "p.m"}
    assert imports("p.m", source, known) & known == {"p.x", "p.y", "p", "p.z", "p.w", "p.late"}


def test_the_package_has_no_import_cycles() -> None:
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_bench_depends_on_the_package_not_on_tests() -> None:
    mods = modules()
    known = set(mods)
    offenders = {
        name: sorted(i for i in imports(name, path, known) if i == "tests" or i.startswith("tests."))
        for name, path in mods.items()
        if name == "bench" or name.startswith("bench.")
    }
    assert not {k: v for k, v in offenders.items() if v}, (
        f"bench/ imports tests/: { ({k: v for k, v in offenders.items() if v}) }"
    )
    assert len(offenders) >= 4, f"bench/'s modules were not found: {sorted(offenders)}"


def test_the_package_does_not_import_tests_or_bench() -> None:
    mods = modules()
    known = set(mods)
    wrong = {
        name: sorted(i for i in imports(name, path, known) if i.split(".")[0] in ("tests", "bench"))
        for name, path in mods.items()
        if name.startswith("dtjob")
    }
    assert not {k: v for k, v in wrong.items() if v}, wrong
