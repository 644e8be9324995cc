"""Triton's cache key of an mxfx kernel, the same in every process.

Triton keys a compiled kernel (in memory and in its cache folder) by its ``cache_key``: a hash of its source, of the
keys of the ``@triton.jit`` functions it calls and of the ``tl.constexpr`` globals they all read. Each function's key
is computed once, at its first use, and kept. Triton 3.6 merges a callee's globals into its caller's before it has
computed the callee's key, so a caller keyed before its callees leaves their globals out: its key then depends on
which kernel a process happened to key first. A process that keys the kernels in another order (one whose graphs
come from Inductor's cache, say) finds none of the first one's compiled kernels and compiles them again.

:func:`fix` keys a kernel's callees before the kernel, depth first, so that its key is the complete one whatever
was keyed before (Triton 3.9 computes it so itself). It reads each function's source for the names it calls, as
Triton does; it neither changes nor replaces anything of Triton's.
"""

from __future__ import annotations

import ast
import textwrap

_FIXED: set[int] = set()  # ids of the kernels whose keys (and their callees') are computed


def jit_function(obj):
    """The ``@triton.jit`` function under ``obj`` (a JIT function, or an autotuner/heuristics wrapper of one), or None
    for anything else."""
    seen = 0
    while obj is not None and seen < 8:
        # on the type: the instance's ``cache_key`` is a property that computes the key
        if hasattr(type(obj), "cache_key") and isinstance(getattr(obj, "src", None), str):
            return obj
        obj = getattr(obj, "fn", None)
        seen += 1
    return None


def _resolve(node: ast.AST, scope: dict):
    """The value a name or a dotted chain of attributes (``a.b.c``) in ``fn``'s source names in ``scope``, or None
    (a local name, a call's result, anything not found)."""
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        return None if base is None else getattr(base, node.attr, None)
    return None


def _callees(fn) -> list:
    """The JIT functions ``fn``'s source names: globals (``name``) and attributes of globals (``module.name``,
    ``package.module.name``), in source order."""
    scope = getattr(getattr(fn, "fn", None), "__globals__", {})
    found, out = set(), []
    for node in ast.walk(ast.parse(textwrap.dedent(fn.src))):
        if not isinstance(node, (ast.Name, ast.Attribute)):
            continue
        value = _resolve(node, scope)
        callee = jit_function(value) if value is not None else None
        if callee is not None and callee is not fn and id(callee) not in found:
            found.add(id(callee))
            out.append(callee)
    return out


def fix(kernel) -> None:
    """Compute the Triton cache key of ``kernel`` (a JIT function or a wrapper of one) after those of every JIT
    function it calls, transitively; once per kernel, a set lookup after that. Anything else: nothing to do.

    Best effort: where a kernel's source cannot be read for its callees (a global whose attribute raises, say),
    the key is left for Triton to compute as it would have, and the launch goes on."""
    if id(kernel) in _FIXED:
        return
    fn = jit_function(kernel)
    if fn is None:
        return
    try:
        _fix_tree(fn, set())
    except Exception:  # noqa: BLE001 (reading the source is an optimization of keying; Triton keys it anyway)
        return
    _FIXED.add(id(kernel))


def _fix_tree(fn, visiting: set[int]) -> None:
    if id(fn) in _FIXED or id(fn) in visiting:
        return
    visiting.add(id(fn))
    for callee in _callees(fn):
        _fix_tree(callee, visiting)
    fn.cache_key  # noqa: B018 (computed and kept by Triton: its callees' keys exist by now)
    _FIXED.add(id(fn))
