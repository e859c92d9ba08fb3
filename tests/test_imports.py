"""Import hygiene: the host-side modules load without jax, first-party modules import each other without cycles
(module level or inside functions alike), and the kernels never import jphoton."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jphoton", "pallas_kernels")

# Modules the scheduler, the request path and the server's validation use: they must stay free of jax (and of the
# device), so that they load fast and can be tested and reused without an accelerator stack.
JAX_FREE = ("jphoton.engine.scheduler", "jphoton.engine.plan", "jphoton.engine.pages", "jphoton.sequence", "jphoton.params",
            "jphoton.constrain.compiler", "jphoton.constrain.choice", "jphoton.constrain.automaton",
            "jphoton.constrain.json_regex", "jphoton.text.tokenizer", "jphoton.models.config", "jphoton.engine.driver",
            "jphoton.engine.lifecycle", "jphoton.requests", "jphoton.server.wire", "jphoton.image.decode", "jphoton.image",
            "jphoton.image.crops", "jphoton.image.skills", "jphoton.image.spatial", "jphoton.engine.images")


@pytest.mark.parametrize("module", JAX_FREE)
def test_host_side_module_imports_without_jax(module):
    code = f"import sys; import {module}; assert 'jax' not in sys.modules, 'jax was imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"importing {module} pulled in jax (or failed):\n{r.stderr[-3000:]}"


def _modules() -> dict[str, pathlib.Path]:
    """Every first-party module: dotted name -> file (a package is its __init__.py)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def _resolve(name: str, modules: dict) -> str | None:
    """The longest known module that `name` (a.b.c, maybe an attribute path) starts with; None if not first-party."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: pathlib.Path, modules: dict) -> set[str]:
    """First-party modules that `module` imports anywhere in its file (top level, functions, methods). `from pkg import
    name` counts as an import of pkg.name when that is a module, else of pkg."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if _is_package(path) else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package `level - 1` steps above this module's package
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[:-(node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                target = _resolve(f"{base}.{alias.name}", modules) if alias.name != "*" else None
                if target != f"{base}.{alias.name}":  # not a submodule: an import of the module it comes from
                    target = _resolve(base, modules)
                if target:
                    found.add(target)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the first-party modules it imports. A package's __init__ importing its own submodules is not an
    edge (that is how a package exposes its parts; a submodule importing the package's names is the one to watch)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        deps = _imports(module, path, modules)
        if _is_package(path):
            deps = {d for d in deps if not d.startswith(module + ".")}
        graph[module] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state = dict.fromkeys(graph, 0)  # 0 unvisited, 1 on the stack, 2 done
    for start in sorted(graph):
        if state[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child, 2) == 1:
                return path[path.index(child):] + [child]
            elif state.get(child, 2) == 0:
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_the_graph_sees_function_level_and_from_imports():
    graph = import_graph()
    assert "jphoton.models.matmul" in graph["jphoton.models.llama"]  # `from jphoton.models.matmul import ...`
    assert "jphoton.models.llama" in graph["jphoton.models.protocol"]  # `from jphoton.models import llama`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_among_first_party_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_do_not_import_jphoton():
    graph = import_graph()
    bad = {m: sorted(d for d in deps if d.split(".")[0] == "jphoton")
           for m, deps in graph.items() if m.split(".")[0] == "pallas_kernels"}
    bad = {m: deps for m, deps in bad.items() if deps}
    assert not bad, f"pallas_kernels modules importing jphoton: {bad}"
