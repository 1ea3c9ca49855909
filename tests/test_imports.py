"""No import cycle anywhere in the product (issue 28 item 4): every module under engine/, app/ and
strata_fetch/ is read with ast (nothing is imported or run), each `import`/`from ... import` it makes of
another product module becomes an edge, and any cycle among them fails with its path.

Imports inside functions count too: a lazy import breaks the circle at import time but not the tangle
(engine <-> distributed, sessions <-> session_quant and app.main <-> self_test were all lazy on one side).
`python -m pytest tests/test_imports.py` with STRATA_IMPORTS_ROOT set to an exported tree checks that one.
Only `if TYPE_CHECKING:` blocks are left out (they never run).
"""
from __future__ import annotations

import ast
from pathlib import Path

import os

# STRATA_IMPORTS_ROOT: another tree to read (e.g. a `git archive HEAD` export, to check what is committed).
ROOT = Path(os.environ.get("STRATA_IMPORTS_ROOT") or Path(__file__).resolve().parents[1])
PACKAGES = ("engine", "app", "strata_fetch")


def module_files() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imported_names(name: str, path: Path) -> list[str]:
    """Dotted names this module imports (a `from X import y` gives X.y and X: y may be a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    out: list[str] = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit_one(sub)
                continue
            visit_one(child)

    def visit_one(node):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            out.append(stem)
            out.extend(f"{stem}.{a.name}" for a in node.names)
        else:
            visit(node)
    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        for imported in imported_names(name, path):
            # The module itself when it is one of ours; a package's __init__ counts only when named alone.
            if imported in files and imported != name:
                edges.add(imported)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_the_reader_sees_a_cycle_when_there_is_one():
    """The check itself: a made-up graph with one circle and one chain."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_is_read_from_every_package():
    graph = import_graph()
    assert {"engine.engine", "engine.handlers", "app.main", "strata_fetch.index_fetch"} <= set(graph)
    assert "engine.errors" in graph["engine.engine"]          # a relative import is resolved
    assert "engine.errors" in graph["strata_fetch.index_fetch"]


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    described = []
    for comp in found:
        inside = set(comp)
        described.append("; ".join(f"{m} -> {', '.join(sorted(graph[m] & inside))}" for m in comp))
    assert not found, "import cycles:\n" + "\n".join(described)


def test_distributed_uses_only_the_engines_public_surface():
    """The distributed strategy drives the engine through its public members (dispatch, log,
    require_model, ...): no `engine._name` anywhere in engine/ranks/distributed.py."""
    tree = ast.parse((ROOT / "engine" / "ranks" / "distributed.py").read_text(encoding="utf-8"))
    private = sorted({f"line {n.lineno}: engine.{n.attr}" for n in ast.walk(tree)
                      if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                      and n.value.id == "engine" and n.attr.startswith("_")})
    assert not private, private
    assert "engine.engine" not in import_graph()["engine.ranks.distributed"]
