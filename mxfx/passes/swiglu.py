"""SwiGLU pass: ``mx_op(silu(gate) * up)`` -> ``mx_op(gate, up=up)`` (fused SwiGLU + quantize).

Pattern: the input of an MX linear or MX grouped GEMM (inserted by the earlier
passes) is ``silu(gate) * up`` in either operand order, possibly followed by
dtype casts, with gate/up coming from two matmuls or from ``chunk``/``split``
of one fused gate_up projection. The product and the silu must have no other
user (else the BF16 ``h`` is needed anyway and fusing saves nothing).

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
from mxfx.ops.linear import mx_linear
from mxfx.passes.fx import CASTS, example_value, is_call, module_fqn, shape_str
from mxfx.policy import Policy
from mxfx.report import OpRecord, PrecisionMap

MX_CONSUMERS = (mx_linear, mx_grouped_mm_op)
_SILU_FN = (F.silu, torch.nn.functional.silu)
_MUL_FN = (operator.mul, torch.mul)


def _silu_input(node) -> fx.Node | None:
    if isinstance(node, fx.Node) and is_call(node, _SILU_FN, ("silu",)) and len(node.users) == 1:
        return node.args[0] if node.args else node.kwargs.get("input")
    return None


def match(x: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """``(gate, up, dead_nodes)`` when ``x`` is ``silu(gate) * up`` (through casts), else None."""
    dead = []
    while x.op == "call_method" and x.target in CASTS and len(x.users) == 1:
        dead.append(x)
        x = x.args[0]
    if not (is_call(x, _MUL_FN, ("mul",)) and len(x.users) == 1 and len(x.args) == 2):
        return None
    a, b = x.args
    for silu, up in ((a, b), (b, a)):
        gate = _silu_input(silu)
        if gate is not None and isinstance(up, fx.Node):
            gv, uv = example_value(gate), example_value(up)
            if gv is not None and uv is not None and gv.shape == uv.shape and gv.dtype == uv.dtype:
                return gate, up, [*dead, x, silu]
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
        gate, up, dead = found
        module = module_fqn(dead[-1]) or module_fqn(node)
        d = policy.decide("swiglu", module)
        shapes = f"gate{shape_str(example_value(gate))}"
        if d.precision != "mxfp8":
            pm.add(OpRecord(dead[-1].name, "swiglu", module, shapes, "bf16", "bf16", "-", "bf16", "-", d.reason))
            continue
        kwargs = {**node.kwargs, "up": up, "save": d.save}
        h, g = example_value(node.args[0]), example_value(gate)
        if node.target is mx_linear and h is not None and g is not None and h.dtype != g.dtype:
            kwargs["input_dtype"] = h.dtype  # the model cast the product: the output dtype follows the cast
        node.args = (gate, *node.args[1:])
        node.kwargs = kwargs
        for n in dead:  # consumers first: mul after casts, silu last
            gm.graph.erase_node(n)
        pm.add(OpRecord(node.name, "swiglu", module, shapes, "mxfp8", "fp32", "-", d.save, d.scale_rule, "fused into " + node.name))
        fused += 1
    return fused
