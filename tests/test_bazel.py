"""The Bazel build covers the code: every module of jphoton, pallas_kernels, server and benchmarks sits in exactly one
target, every test file has its py_test, and each target's deps (transitively) hold every first-party module its
sources import. The BUILD files are read as Python (Starlark's syntax for what they use) with stub rules, so this
runs without Bazel; tools/bazel/bazel.sh runs the real thing."""

from __future__ import annotations

import ast
import fnmatch
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jphoton", "pallas_kernels", "benchmarks")
BUILD_DIRS = ("", "jphoton", "jphoton/server", "pallas_kernels", "benchmarks", "tests", "notebooks", "tools/bazel")


def _read_builds() -> dict[str, dict]:
    """label -> {"kind", "srcs" (paths from ROOT), "deps" (labels)} for every rule in the BUILD files."""
    targets: dict[str, dict] = {}
    for pkg in BUILD_DIRS:
        base = ROOT / pkg

        def glob(patterns, exclude=(), base=base):
            return sorted({str(p.relative_to(base)) for pat in patterns for p in base.glob(pat) if p.is_file()}
                          - set(exclude))

        def label(dep, pkg=pkg):
            if dep.startswith(":"):
                return f"//{pkg}{dep}"
            return dep if ":" in dep else f"{dep}:{dep.rsplit('/', 1)[-1]}"

        def rule(kind, pkg=pkg, label=label):
            def add(name, srcs=(), deps=(), main=None, **_):
                files = [f"{pkg}/{s}".lstrip("/") for s in srcs if not s.startswith("//")]
                if kind == "pytest_test":
                    files = [f"{pkg}/{name}.py"]
                if kind == "pytest_test":  # the macro adds conftest (tools/bazel/pytest.bzl)
                    deps = [*deps, ":conftest"]
                targets[f"//{pkg}:{name}"] = {"kind": kind, "srcs": files, "deps": [label(d) for d in deps]}
            return add

        namespace = {"glob": glob, "load": lambda *a, **k: None, "package": lambda **k: None,
                     "exports_files": lambda *a, **k: None, "toolchain": lambda **k: None,
                     "py_runtime": lambda **k: None, "py_runtime_pair": lambda **k: None,
                     **{k: rule(k) for k in ("py_library", "py_binary", "py_test", "pytest_test", "filegroup")}}
        exec(compile((base / "BUILD").read_text(), str(base / "BUILD"), "exec"), namespace)
    return targets


def _module_files() -> dict[str, str]:
    """dotted module -> path from ROOT, for the first-party packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = str(path.relative_to(ROOT))
    return out


def _imports(path: pathlib.Path, modules: dict[str, str]) -> set[str]:
    """First-party module files `path` imports (anywhere in it); `from jphoton import LLM` counts the module that
    defines LLM (jphoton/__init__.py loads its public names lazily)."""
    import jphoton

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            for a in node.names:
                names.add(f"{node.module}.{a.name}")
                if node.module == "jphoton" and a.name in jphoton._PUBLIC:
                    names.add(jphoton._PUBLIC[a.name])
    files = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            files.add(modules[name])
    return files


def test_every_module_and_test_file_belongs_to_one_target():
    targets = _read_builds()
    owners: dict[str, list[str]] = {}
    for label, t in targets.items():
        if t["kind"] != "filegroup":
            for f in t["srcs"]:
                owners.setdefault(f, []).append(label)
    modules = set(_module_files().values())
    tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")}
    missing = sorted(f for f in modules | tests if f not in owners)
    assert not missing, f"files in no Bazel target: {missing}"
    shared = {f: o for f, o in owners.items() if len(o) > 1 and not f.startswith("tools/")}
    assert not shared, f"files in several targets: {shared}"
    test_files = {f for f in tests if fnmatch.fnmatch(f, "tests/test_*.py")}
    assert test_files == {t["srcs"][0] for t in targets.values() if t["kind"] == "pytest_test"}


def test_deps_cover_every_first_party_import():
    targets = _read_builds()
    modules = _module_files()
    owner = {f: label for label, t in targets.items() for f in t["srcs"] if t["kind"] != "filegroup"}
    problems = []
    for label, t in targets.items():
        if t["kind"] == "filegroup":
            continue
        reach, todo = {label}, [label]
        while todo:
            for dep in targets[todo.pop()]["deps"]:
                if dep not in reach:
                    assert dep in targets, f"{label}: unknown dep {dep}"
                    reach.add(dep)
                    todo.append(dep)
        for src in t["srcs"]:
            for f in _imports(ROOT / src, modules):
                if owner.get(f) not in reach:
                    problems.append(f"{label} ({src}) imports {f}, which is in {owner.get(f)}, not in its deps")
    assert not problems, "\n".join(problems)


def test_the_host_target_stays_free_of_jax():
    host = _read_builds()["//jphoton:host"]["srcs"]
    uses_jax = [f for f in host if any(
        isinstance(n, (ast.Import, ast.ImportFrom)) and "jax" in ((n.module or "") if isinstance(n, ast.ImportFrom)
                                                                   else " ".join(a.name for a in n.names)).split(".")
        for n in ast.walk(ast.parse((ROOT / f).read_text())))]
    assert not uses_jax, f"//jphoton:host sources importing jax: {uses_jax}"
