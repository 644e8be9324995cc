"""The import graph of mxfx has no cycle, counting imports inside function bodies too.

Importing each module in a fresh interpreter would miss a cycle closed by a function-body import (it runs
only when the function is called), so this reads every import statement of every module with ``ast``.
Edges are the explicit imports only (``import a.b`` / ``from a.b import c``, ``c`` counted as a module when
it is one); a package's ``__init__`` that Python runs on the way is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mxfx

ROOT = Path(mxfx.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """mxfx modules that ``name`` imports anywhere in its source (module level or in any function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_reader_sees_function_body_imports():
    """The walker counts an import inside a function (where today's cycles used to sit) and relative imports."""
    mods = {"p": Path("p/__init__.py"), "p.a": Path("p/a.py"), "p.b": Path("p/b.py")}
    src = "def f():\n    from p import b\n    from . import a\n"
    tree = Path(__file__).parent / "_import_probe.py"
    tree.write_text(src)
    try:
        assert _imports("p.a", tree, mods) == {"p.b"}
    finally:
        tree.unlink()
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_mxfx():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 30  # the walk saw the package's imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_kernels_import_one_way():
    """Each format's kernels (``mxfx.kernels.mx``, ``mxfx.kernels.fp8_block``) use the shared ones
    (``mxfx.kernels.common``), the format math (``mxfx.numerics``), the device facts (``mxfx.device``) and the op
    definitions (``mxfx.library``), never each other; the shared kernels use neither format's; no kernel imports a
    layer above (formats, ops, passes, runtime, the policy or the backend)."""
    modules = _modules()
    base = ("mxfx.numerics", "mxfx.device", "mxfx.library")
    allowed = {
        "mxfx.kernels.common": ("mxfx.kernels.common", *base),
        "mxfx.kernels.mx": ("mxfx.kernels.mx", "mxfx.kernels.common", *base),
        "mxfx.kernels.fp8_block": ("mxfx.kernels.fp8_block", "mxfx.kernels.common", *base),
    }
    seen, wrong = set(), []
    for name, path in modules.items():
        package = next((p for p in allowed if name == p or name.startswith(p + ".")), None)
        if package is None:
            continue
        seen.add(package)
        for dep in _imports(name, path, modules):
            if not any(dep == ok or dep.startswith(ok + ".") for ok in allowed[package]):
                wrong.append(f"{name} imports {dep}")
    assert seen == set(allowed) and not wrong, wrong
