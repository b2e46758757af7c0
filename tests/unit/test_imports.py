"""The house rules on imports and size (issue 54), read from the sources with ``ast``:

- the layers: ``cluster`` < ``actors`` < ``serve_app`` < ``lab``; a module imports only its
  own layer or lower ones, and ``cluster`` never imports Ray;
- no import cycle between modules, counting imports under ``TYPE_CHECKING`` and inside
  functions (a cycle hidden from the interpreter is still one for the reader);
- no product file (``cluster``, ``actors``, ``serve_app``) over 600 lines;
- no benchmark code in the product: every command but ``serve`` lives in ``lab``, and no
  product module is a benchmark.

``PENDING_*`` name exactly what still breaks a rule while its owner's rewrite is not merged;
each entry must still break its rule (a fixed one fails until removed), so the lists only shrink.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("cluster", "actors", "serve_app", "lab")
PRODUCT = LAYERS[:3]
MAX_PRODUCT_FILE_LINES = 600

PENDING_CYCLES: set[frozenset[str]] = set()
PENDING_LONG: set[str] = set()


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the four layers."""
    out = {}
    for top in LAYERS:
        for path in (ROOT / top).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    assert len(out) > 150, f"found only {len(out)} modules under {ROOT}"
    return out


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Every dotted name an import statement anywhere in ``tree`` reaches, relative imports
    resolved (``from . import x`` names ``pkg.x``; the caller decides what is a module)."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest module of the project that ``name`` is or lies in, if any."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = {resolve(n, modules) for n in imported_names(tree, module, path.name == "__init__.py")}
        # A module's own package __init__ is run by the import system, not chosen by the module.
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {top: i for i, top in enumerate(LAYERS)}
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if rank[t.split(".")[0]] > rank[m.split(".")[0]])


def ray_in_cluster(modules: dict[str, Path]) -> list[str]:
    found = []
    for module, path in modules.items():
        if module.split(".")[0] != "cluster":
            continue
        tree = ast.parse(path.read_text())
        found += [f"{module}: {n}" for n in imported_names(tree, module, path.name == "__init__.py")
                  if n == "ray" or n.startswith("ray.")]
    return found


def long_product_files(modules: dict[str, Path]) -> dict[str, int]:
    out = {}
    for module, path in modules.items():
        lines = len(path.read_text().splitlines())
        if module.split(".")[0] in PRODUCT and lines > MAX_PRODUCT_FILE_LINES:
            out[path.relative_to(ROOT).as_posix()] = lines
    return out


def test_imports_point_down_and_cluster_never_imports_ray():
    modules = module_files()
    assert upward_imports(import_graph(modules)) == []
    assert ray_in_cluster(modules) == []


def test_no_import_cycles_beyond_the_pending_ones():
    found = set(cycles(import_graph(module_files())))
    assert sorted(map(sorted, found - PENDING_CYCLES)) == [], "import cycles (break them: move the shared part down)"
    assert sorted(map(sorted, PENDING_CYCLES - found)) == [], "fixed: remove from PENDING_CYCLES"


def test_no_product_file_over_600_lines_beyond_the_pending_ones():
    found = long_product_files(module_files())
    assert {f: n for f, n in found.items() if f not in PENDING_LONG} == {}, "split these files"
    assert sorted(PENDING_LONG - set(found)) == [], "fixed: remove from PENDING_LONG"


def test_no_benchmark_code_in_the_product():
    """Every command but the server comes from ``lab``; no product module is named a benchmark."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    commands = project["project"]["entry-points"]["prefix_cache.commands"]
    outside = {name: target for name, target in commands.items()
               if name != "serve" and not target.startswith("lab.")}
    assert outside == {}
    assert commands["serve"] == "serve_app.cli_serve"
    benches = [m for m in module_files() if m.split(".")[0] in PRODUCT
               and re.match(r"bench|tools?$|loadtest|demo", m.rpartition(".")[2])]
    assert benches == []


def test_the_checks_find_what_they_look_for():
    """Each check on a small made-up project: a cycle hidden in a function and under
    TYPE_CHECKING, an upward import, a relative import, Ray in the pure layer."""
    sources = {
        "cluster.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cluster.b import B\n",
        "cluster.b": "def f():\n    from . import a\n",
        "cluster.c": "import ray\nfrom actors import x\n",
        "actors.x": "from cluster.a import thing\n",
    }
    modules = {name: Path(f"/{name}.py") for name in sources}
    graph = {}
    for name, text in sources.items():
        names = imported_names(ast.parse(text), name, False)
        graph[name] = {t for t in (resolve(n, modules) for n in names) if t and t != name}
    assert graph == {"cluster.a": {"cluster.b"}, "cluster.b": {"cluster.a"},
                     "cluster.c": {"actors.x"}, "actors.x": {"cluster.a"}}
    assert cycles(graph) == [frozenset({"cluster.a", "cluster.b"})]
    assert upward_imports(graph) == ["cluster.c -> actors.x"]
    assert imported_names(ast.parse(sources["cluster.c"]), "cluster.c", False) == ["ray", "actors", "actors.x"]
