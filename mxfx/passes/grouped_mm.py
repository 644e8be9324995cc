"""Grouped expert GEMM pass: ``torch._grouped_mm(x, W.transpose(-2, -1), offs)`` -> MX grouped GEMM.

Pattern: a ``torch._grouped_mm`` call with a 2D input ``x [S, K]``, a 3D weight
operand ``[E, K, N]`` and ``offs``, no bias — what HF transformers'
``experts_implementation="grouped_mm"`` and torchtitan's ``GroupedExperts`` emit
for the up/gate and down projections.

Replacement: :func:`mxfx.ops.grouped_mm.mx_grouped_mm_op` on the *source*
weight: casts and the transpose in front of the weight are walked back to the
parameter ``W [E, N, K]``, so the MX weight operands are quantized from the
FP32 main weight (seed §11.4.1) rather than from a BF16 copy. Valid because the
op computes the same per-expert products with MX-rounded operands and fp32
accumulation; the output dtype is the original call's. Operands of different
dtypes are left as written: eager rejects them, and so does the compiled graph.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.passes.fx import (
    erase_unused_chain, example_value, gemm_size, is_call, mixed_dtype_reason, module_fqn, shape_str, size_hint, weight_source,
)
from mxfx.policy import Policy
from mxfx.report import OpRecord, PrecisionMap

def _skip_reason(x, b, offs, bias) -> str:
    if x is None or b is None or offs is None:
        return "no example value for the operands"
    if bias is not None:
        return "grouped GEMM with bias"
    if x.dim() != 2 or b.dim() != 3:
        return f"operands of {x.dim()}D x {b.dim()}D (expected 2D x 3D)"
    k, n = size_hint(b.shape[1]), size_hint(b.shape[2])
    if k % 32 or n % 32:
        return f"features {k}->{n} are not multiples of 32"
    return ""


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Rewrite eligible grouped GEMMs in ``gm`` in place; returns how many were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, (torch._grouped_mm,)):
            continue
        args = dict(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), node.args))
        args.update(node.kwargs)
        x_node, b_node, offs_node = args.get("mat_a"), args.get("mat_b"), args.get("offs")
        x, b, offs = example_value(x_node), example_value(b_node), example_value(offs_node)
        module = module_fqn(node)
        shapes = f"x{shape_str(x)} w{shape_str(b)}"
        # autocast does not cover torch._grouped_mm: eager rejects mixed operand dtypes in or out of it
        reason = _skip_reason(x, b, offs, args.get("bias")) or mixed_dtype_reason(
            "torch._grouped_mm", {"x": x, "weight": b}, autocast_on=False)
        macs = gemm = None
        if not reason:
            macs, gemm = gemm_size(x.shape[:1], b.shape[2], b.shape[1])
            if gemm is not None:  # "auto" judges one expert's GEMM: M = rows per expert
                gemm = (max(1, gemm[0] // max(size_hint(b.shape[0]), 1)), gemm[1], gemm[2])
        d = policy.decide("grouped_mm", module, macs, gemm)
        reason = d.reason or reason
        if reason:
            pm.add(OpRecord(node.name, "grouped_mm", module, shapes, "bf16", "bf16", "bf16", "bf16", "-", reason))
            continue
        source, transposed = weight_source(b_node)
        with gm.graph.inserting_before(node):
            weight = source if transposed else gm.graph.call_method("transpose", (source, -2, -1))
            if not transposed:
                weight.meta["example_value"] = example_value(source).transpose(-2, -1)
            new = gm.graph.call_function(
                mx_grouped_mm_op,
                (x_node, weight, offs_node),
                {
                    "scale_rule": d.scale_rule,
                    "wgrad": d.wgrad,
                    "save": d.save,
                    "out_dtype": args.get("out_dtype") or x.dtype,
                    **({"keep_dequantized_weights": True} if policy.keep_dequantized_weights else {}),
                },
            )
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        erase_unused_chain(gm, b_node)
        pm.add(OpRecord(new.name, "grouped_mm", module, shapes, "mxfp8", "mxfp8", d.wgrad, d.save, d.scale_rule))
        rewritten += 1
    return rewritten

