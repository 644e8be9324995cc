"""Keys that let Inductor's FX graph cache and AOTAutograd cache reuse compiled mxfx graphs.

A rewritten graph calls mxfx's own functions (``mx_linear``, ``mx_grouped_mm``, ...):
Python callables that AOTAutograd traces through into ATen ops and mxfx's
``torch.library`` custom ops. AOTAutograd's cache bypasses any graph with a
``call_function`` target it cannot vouch for, unless the target is named in
``torch._inductor.config.unsafe_marked_cacheable_functions`` with a key string;
that dict is part of the cache key, so the key must change whenever what the
function traces to could change. :func:`trace_key` is that key: a hash of
mxfx's source files and the torch version, so editing mxfx invalidates every
cached mxfx graph, and nothing that varies between processes (ids, counters)
enters it.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
import torch.fx as fx

from mxfx.kernels.common.launch import opaque_kernels

_PACKAGE = Path(__file__).resolve().parent


@functools.cache
def source_key() -> str:
    """Hex digest of every ``.py`` file of the mxfx package (path and bytes) plus ``torch.__version__``."""
    h = hashlib.sha256(torch.__version__.encode())
    for f in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(f.relative_to(_PACKAGE)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def trace_key() -> str:
    """:func:`source_key` plus the choices that change what mxfx's functions trace to: custom ops kept opaque, or
    Triton kernels inlined in the graph (:func:`mxfx.kernels.common.launch.opaque_kernels`: the compile's policy
    ``kernels``, else ``MXFX_OPAQUE_KERNELS``)."""
    return f"{source_key()};opaque_kernels={int(opaque_kernels())}"


def mxfx_targets(gm: fx.GraphModule) -> set[str]:
    """Qualified names (``module.name``) of the mxfx functions called by ``gm`` and its subgraphs."""
    names = set()
    for g in gm.modules():
        if not isinstance(g, fx.GraphModule):
            continue
        for node in g.graph.nodes:
            module = getattr(node.target, "__module__", None) or ""
            if node.op == "call_function" and module.split(".")[0] == "mxfx":
                names.add(f"{module}.{node.target.__name__}")
    return names


def config_patches(gm: fx.GraphModule) -> dict:
    """Inductor config patches marking ``gm``'s mxfx targets cacheable under :func:`trace_key`."""
    names = mxfx_targets(gm)
    if not names:
        return {}
    import torch._inductor.config as inductor_config

    marked = dict(inductor_config.unsafe_marked_cacheable_functions)
    marked.update(dict.fromkeys(sorted(names), trace_key()))
    return {"unsafe_marked_cacheable_functions": marked}
