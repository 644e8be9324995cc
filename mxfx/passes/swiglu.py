"""SwiGLU pass: ``mx_op(silu(gate) * up)`` -> ``mx_op(gate, up=up)`` (fused SwiGLU + quantize).

Pattern: the input of an MX linear or MX grouped GEMM (inserted by the earlier
passes) is ``silu(gate) * up`` in either operand order, possibly followed by
dtype casts, or its rows gathered by a 1-D index (the sort of
:mod:`mxfx.passes.batched_mm`: gate and up are gathered instead), with gate/up coming from two matmuls or from
``chunk``/``split`` of one fused gate_up projection. The product and the silu must have no other user (else the BF16
``h`` is needed anyway and fusing saves nothing).

Replacement: the consumer takes gate and up and quantizes ``silu(gate) * up``
formed in fp32 straight to MXFP8 (``mxfx::swiglu_quantize``): no BF16 ``h`` is
written (the recipe, "Kernel Problems and Fusions", Table 25). The SwiGLU backward runs in fp32 from gate
and up, saved in the policy's ``save`` precision for op kind "swiglu"
(MXFP8 by default, as the recipe's fused routed path). Variants that are not
plain silu (GPT-OSS's clamped ``g * sigmoid(1.702 g) * (u + 1)``) do not match
and are left alone.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.settings import settings_of
from mxfx.ops.linear import mx_linear
from mxfx.passes import columns
from mxfx.fx import CASTS, example_value, is_call, module_fqn, shape_str
from mxfx.policy import Policy
from mxfx.report import OpRecord, PrecisionMap

MX_CONSUMERS = (mx_linear, mx_grouped_mm_op)
_SILU_FN = (F.silu, torch.nn.functional.silu)
_MUL_FN = (operator.mul, torch.mul)


def _silu_input(node) -> fx.Node | None:
    if isinstance(node, fx.Node) and is_call(node, _SILU_FN, ("silu",)) and len(node.users) == 1:
        return node.args[0] if node.args else node.kwargs.get("input")
    return None


def _casts_behind(x: fx.Node, dead: list) -> fx.Node:
    while x.op == "call_method" and x.target in CASTS and len(x.users) == 1:
        dead.append(x)
        x = x.args[0]
    return x


def _row_gather(x: fx.Node) -> fx.Node | None:
    """``rows`` when ``x`` is ``t[rows]`` with ``rows`` a 1-D integer tensor (a row permutation or gather)."""
    if not (is_call(x, (operator.getitem,)) and len(x.args) == 2 and len(x.users) == 1):
        return None
    rows = example_value(x.args[1])
    ok = rows is not None and rows.dim() == 1 and not rows.is_floating_point() and rows.dtype != torch.bool
    return x.args[1] if ok else None


def match(x: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node], fx.Node | None] | None:
    """``(gate, up, dead_nodes, rows)`` when ``x`` is ``silu(gate) * up`` (through casts), or that product's rows
    ``[rows]`` (a row gather commutes with the elementwise SwiGLU: ``rows`` is then not None), else None."""
    dead = []
    x = _casts_behind(x, dead)
    rows = _row_gather(x)
    if rows is not None:
        dead.append(x)
        x = _casts_behind(x.args[0], dead)
    if not (is_call(x, _MUL_FN, ("mul",)) and len(x.users) == 1 and len(x.args) == 2):
        return None
    a, b = x.args
    for silu, up in ((a, b), (b, a)):
        gate = _silu_input(silu)
        if gate is not None and isinstance(up, fx.Node):
            gv, uv = example_value(gate), example_value(up)
            if gv is not None and uv is not None and gv.shape == uv.shape and gv.dtype == uv.dtype:
                return gate, up, [*dead, x, silu], rows
    return None


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Fuse SwiGLUs into their MX consumers in place; returns how many were fused."""
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in MX_CONSUMERS:
            continue
        found = match(node.args[0])
        if found is None:
            continue
        gate, up, dead, rows = found
        module = module_fqn(dead[-1]) or module_fqn(node)
        d = policy.decide("swiglu", module)
        g, product = example_value(gate), example_value(dead[-2])  # dead ends in the product, then the silu
        shapes = f"gate{shape_str(g)}"
        if d.precision != "mxfp8":  # as written: silu and product, forward and backward, in the product's dtype
            p = columns.ran(product)
            pm.add(
                OpRecord(
                    dead[-1].name,
                    "swiglu",
                    module,
                    shapes,
                    scale_rule="-",
                    **columns.gemm_columns(product, g, None, p, p, "-", p, d.reason),
                )
            )
            continue
        h = example_value(node.args[0])
        if rows is not None:  # (silu(g) * u)[rows] == silu(g[rows]) * u[rows]
            with gm.graph.inserting_before(node):
                gate, up = (gm.graph.call_function(operator.getitem, (t, rows)) for t in (gate, up))
            for t in (gate, up):
                t.meta["example_value"] = example_value(t.args[0])[example_value(rows)]
        kwargs = {**node.kwargs, "up": up, "save": d.save}
        if node.target is mx_linear and h is not None and g is not None and h.dtype != g.dtype:
            kwargs["input_dtype"] = h.dtype  # the model cast the product: the output dtype follows the cast
        node.args = (gate, *node.args[1:])
        node.kwargs = kwargs
        for n in dead:  # consumers first: mul after casts, silu last
            gm.graph.erase_node(n)
        consumer = settings_of(node.kwargs)  # the consumer's format and scale rule quantize the product
        fmt = consumer.format.name
        # backward in fp32 from gate and up, saved in the format or as they are
        saved = fmt if d.save == "mxfp8" else columns.ran(g)
        pm.add(
            OpRecord(
                node.name,
                "swiglu",
                module,
                shapes,
                scale_rule=consumer.format.rule_shown(consumer.scale_rule),
                **columns.gemm_columns(product, g, None, fmt, "fp32", "-", saved, "fused into " + node.name),
            )
        )
        fused += 1
    return fused
