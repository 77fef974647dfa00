"""Layering of src/dpopt: no import cycle, and the privacy boundary loads no post-processing code.

The graph is built statically with ``ast`` from every module under src/dpopt:
an edge A -> B for each intra-package import in A, resolved to the module
it loads (``from . import x`` is an edge to the submodule ``x`` when it is one;
``from .pkg import name`` is an edge to ``pkg``, i.e. its ``__init__``).
Imports under ``if TYPE_CHECKING:`` are ignored. Module-level imports are
what runs at import time and must form a DAG. Function-level imports (and
``import_module("dpopt....")`` calls with a literal name) are allowed for
optional or heavy dependencies and lazy public re-exports, but not to break
a cycle: one whose target reaches its importer through module-level imports
is reported as a layering defect.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "dpopt"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under src/dpopt (packages by their __init__), and every
    compiled extension module by its .pyi stub (``dpopt._native``: a module that imports nothing of dpopt)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")) + sorted((SRC / PACKAGE).rglob("*.pyi")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.setdefault(".".join(parts), path)  # a .py wins over a stub of the same name
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve(importer: str, level: int, module: str | None, modules: dict[str, Path]) -> str | None:
    """Absolute dotted name of ``from <level dots><module> import ...`` inside ``importer``."""
    if level == 0:
        return module
    base = importer.split(".")
    if not _is_package(importer, modules):
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _targets(node: ast.AST, importer: str, modules: dict[str, Path]) -> list[str]:
    """The intra-package modules an import statement (or import_module call) loads."""
    found: list[str] = []
    if isinstance(node, ast.Import):
        found = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        mod = _resolve(importer, node.level, node.module, modules)
        if mod is None:
            return []
        for alias in node.names:
            sub = f"{mod}.{alias.name}"
            found.append(sub if sub in modules else mod)
    elif isinstance(node, ast.Call):
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
        if (
            name == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found = [node.args[0].value]
    out = []
    for name in found:
        while name and name not in modules and "." in name:  # "dpopt.x.attr" -> the module dpopt.x
            name = name.rsplit(".", 1)[0]
        if name in modules and name != importer and name.split(".")[0] == PACKAGE:
            out.append(name)
    return out


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[tuple[str, int]]]]:
    """(module-level edges, function-level edges with line numbers) of every module under src/dpopt."""
    modules = _modules()
    top: dict[str, set[str]] = {m: set() for m in modules}
    inner: dict[str, set[tuple[str, int]]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

        def walk(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if _type_checking_block(child):
                    continue
                nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom, ast.Call)):
                    for target in _targets(child, name, modules):
                        if in_function or isinstance(child, ast.Call):
                            inner[name].add((target, child.lineno))
                        else:
                            top[name].add(target)
                walk(child, nested)

        walk(tree, False)
        if any(
            isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "import_module"
            for n in ast.walk(tree)
        ):
            inner[name].update((t, line) for t, line in _lazy_table(tree, name, modules))
    return top, inner


def _lazy_table(tree: ast.Module, importer: str, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """Lazy re-export tables (PEP 562): module-level dicts whose string values name dpopt modules."""
    out = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for v in value.values:
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                for cand in (v.value, f"{importer}.{v.value}"):
                    if cand in modules and cand != importer:
                        out.append((cand, v.lineno))
                        break
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:  # Tarjan (graphs here are small: recursion is fine)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
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
            if len(comp) > 1 or v in graph[v]:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for comp in sccs:  # one concrete cycle through the component's first module, for the message
        members, start = set(comp), comp[0]
        path, seen = [start], {start}

        def dfs(v: str) -> bool:
            for w in sorted(graph[v] & members):
                if w == start:
                    return True
                if w not in seen:
                    seen.add(w)
                    path.append(w)
                    if dfs(w):
                        return True
                    path.pop()
            return False

        dfs(start)
        cycles.append(path + [start])
    return cycles


def _reaches(graph: dict[str, set[str]], src: str, dst: str) -> bool:
    seen, todo = {src}, [src]
    while todo:
        v = todo.pop()
        if v == dst:
            return True
        for w in graph[v] - seen:
            seen.add(w)
            todo.append(w)
    return False


def test_graph_sees_the_package():
    top, _ = import_graph()
    assert "dpopt.privatizer" in top and "dpopt.engine.fast" in top
    assert "dpopt.types" in top["dpopt.privatizer"]
    assert {"dpopt.engine.reference", "dpopt.engine.capture", "dpopt.engine.layers"} <= top["dpopt.engine.fast"]
    assert "dpopt.engine.rules" in top["dpopt.engine.capture"]


def test_cycle_finder_on_a_small_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert sorted(map(tuple, find_cycles(graph))) == [("a", "b", "c", "a"), ("e", "e")]
    assert not find_cycles({"a": {"b"}, "b": set()})


def test_lazy_public_exports_are_seen():
    _, inner = import_graph()
    assert "dpopt.privatizer" in {t for t, _ in inner["dpopt"]}
    assert "dpopt.engine.reference" in {t for t, _ in inner["dpopt"]}


def test_no_import_cycle_among_module_level_imports():
    top, _ = import_graph()
    cycles = find_cycles(top)
    assert not cycles, "import cycles among module-level imports in src/dpopt:\n" + "\n".join(
        "  " + " -> ".join(c) for c in cycles
    )


def test_no_function_level_import_breaks_a_cycle():
    """A function-level import A -> B where B reaches A at module level only hides a cycle: fix the layering."""
    top, inner = import_graph()
    hiding = sorted(
        f"  {a}:{line} imports {b} inside a function, and {b} imports {a} (via module-level imports)"
        for a, edges in inner.items()
        for b, line in edges
        if _reaches(top, b, a)
    )
    assert not hiding, "function-level imports that only hide an import cycle:\n" + "\n".join(hiding)


def test_core_types_module_is_a_leaf():
    top, inner = import_graph()
    assert not top["dpopt.types"] and not inner["dpopt.types"], "dpopt.types must import nothing from dpopt"


def _loaded_after(statement: str) -> set[str]:
    code = textwrap.dedent(f"""
        import sys
        {statement}
        print("\\n".join(sorted(m for m in sys.modules if m == "dpopt" or m.startswith("dpopt."))))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return set(res.stdout.split())


def test_privatizer_loads_no_transforms():
    """The privacy boundary does not depend on post-processing code (fresh interpreter)."""
    loaded = _loaded_after("import dpopt.privatizer")
    assert "dpopt.privatizer" in loaded and "dpopt.types" in loaded
    leaked = sorted(m for m in loaded if m == "dpopt.transforms" or m.startswith("dpopt.transforms."))
    assert not leaked, f"import dpopt.privatizer loaded post-processing modules: {leaked}"


@pytest.mark.parametrize("statement", ["import dpopt.engine", "import dpopt.engine.reference"])
def test_engines_load_no_transforms(statement):
    loaded = _loaded_after(statement)
    leaked = sorted(m for m in loaded if m == "dpopt.transforms" or m.startswith("dpopt.transforms."))
    assert not leaked, f"{statement} loaded post-processing modules: {leaked}"


def test_per_sample_module_is_gone():
    """The reference path lives in dpopt.engine.reference; no shim is left at dpopt.per_sample."""
    assert not (SRC / PACKAGE / "per_sample.py").exists()
    import dpopt

    assert dpopt.per_sample_gradients.__module__ == "dpopt.engine.reference"
    assert dpopt.iter_per_sample_gradients.__module__ == "dpopt.engine.reference"
