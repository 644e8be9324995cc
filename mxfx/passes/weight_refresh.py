"""Weight-refresh pass: rebuild MX weight caches inside a compiled optimizer step.

Pattern: a ``torch.compile(optimizer.step, backend="mxfp8")`` graph, where
parameters arrive as ``get_attr`` nodes (or placeholders whose example is an
``nn.Parameter``) and are updated in place: ``torch._foreach_*_(params, ...)``,
``torch._fused_adam(w)_(params, ...)``, ``p.add_``/``mul_``/``addcdiv_``/
``lerp_``/``copy_``..., any call whose name ends in ``_`` and whose first
argument is, or lists, a parameter. Graphs that update no parameter (forward
and backward graphs) are left alone.

Replacement: the same graph plus, right after the last parameter update,
``mxfx::refresh_weight_caches(plan, [p0, p1, ...])``. Reading a parameter after
its in-place update reads the updated value (AOTAutograd functionalizes the
graph: the op receives the new values that are then copied back into the
parameters), so the op quantizes the weights the next forward will use, inside
the same compiled region, once per step (the recipe, "DDP Must Be MXFP8-Aware": "after every optimizer
copy-back, rebuild all required MXFP8 caches"). ``plan`` names the parameter
objects (weakly held by :mod:`mxfx.runtime.cache`); which of them have caches, and in
which rule and orientations, is resolved at run time, so the step may be
compiled before the model. The op carries an ordered effect token, so neither
AOTAutograd nor Inductor drops or reorders it. Once the compiled step returns
(the parameters now hold the new values and versions), the backend's wrapper
stamps the rebuilt caches fresh (:func:`mxfx.runtime.cache.after_step`).

The precision-map record names the format the caches are rebuilt in: that of the caches the parameters hold
when the step compiles (usually after a first forward), else the policy's ``format``.

Valid because the caches are pure functions of the weights: rebuilding them
from the updated values gives exactly what the next forward would have built.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from mxfx.fx import mutated_args
from mxfx.runtime import cache
from mxfx import formats
from mxfx.policy import Policy
from mxfx.report import OpRecord, PrecisionMap

REFRESH = torch.ops.mxfx.refresh_weight_caches.default
PLANS_META = "mxfx_refresh_plans"
"""``gm.meta`` key: refresh plan ids of the graph (the backend stamps them after each call)."""


def _parameter(gm: fx.GraphModule, node) -> nn.Parameter | None:
    """The real parameter a node stands for, or None."""
    if not isinstance(node, fx.Node):
        return None
    obj = None
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part, None)
    elif node.op == "placeholder":
        arg = node.meta.get("grapharg")
        obj = getattr(arg, "example", None) if arg is not None else None
    return obj if isinstance(obj, nn.Parameter) else None


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Insert one cache refresh after the parameter updates of an optimizer-step graph; returns 1 or 0."""
    params: dict[fx.Node, nn.Parameter] = {}
    last = None
    for node in gm.graph.nodes:
        for arg in mutated_args(node):
            p = _parameter(gm, arg)
            if p is not None:
                params.setdefault(arg, p)
                last = node
    if last is None:
        return 0
    nodes = list(params)
    plan = cache.new_plan(params.values())
    with gm.graph.inserting_after(last):
        new = gm.graph.call_function(REFRESH, (plan, nodes))
    gm.meta.setdefault(PLANS_META, []).append(plan)
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params.values()})
    fmt, where = _refresh_format(policy, params.values())
    pm.add(
        OpRecord(
            new.name,
            "weight_refresh",
            "",
            f"{len(nodes)} params ({', '.join(dtypes)})",
            fmt,
            fmt,
            "-",
            "-",
            "-",
            f"after {last.name}; caches of the parameters that have them are rebuilt (resolved at run time); {where}",
        )
    )
    return 1


def _refresh_format(policy: Policy, params) -> tuple[str, str]:
    """``(format, where it comes from)`` for the precision map: the formats of the caches the parameters hold now
    ("+"-joined when both), else the policy's format (no cache built yet when the step compiles)."""
    held = cache.cached_formats(params)
    if held:
        return "+".join(sorted(held)), "format of the caches held when the step compiled"
    return formats.get(policy.format).name, "no cache held when the step compiled: format of this policy"
