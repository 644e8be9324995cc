"""The MX grouped GEMM that a routed-expert GEMM becomes (:mod:`mxfx.passes.grouped_mm` for grouped GEMMs,
:mod:`mxfx.passes.batched_mm` for HF's per-row batched ones): the policy's decision for one and its insertion."""

from __future__ import annotations

import torch
import torch.fx as fx

from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.fx import example_value, gemm_size, size_hint, unique_stats_site
from mxfx.policy import Decision, Policy

GROUPED_WGRAD = "bf16"
"""What the precision map says of a converted grouped GEMM's high-precision wgrad: a BF16 grouped GEMM, whatever
the operands' dtypes (:func:`mxfx.ops.grouped_mm.mx_grouped_mm_op`)."""


def insert_grouped(gm: fx.GraphModule, before: fx.Node, x_node, w_node, offs_node, decision: Decision, out_dtype):
    """Insert ``mx_grouped_mm_op(x, W, offs)`` under ``decision``'s settings before ``before``; ``w_node`` is the
    ``[E, N, K]`` weight; int64 offs are cast to the int32 the op takes. An FP32 x whose GEMM writes 16-bit
    results (autocast: the GEMM read x's 16-bit cast) gets its gradient from the dgrad GEMM in that dtype, widened
    after, as the cast's backward gives it in eager (``dgrad_dtype``), not an FP32 result of twice the bytes."""
    x_dtype = example_value(x_node).dtype
    dgrad_dtype = out_dtype if x_dtype == torch.float32 and out_dtype in (torch.bfloat16, torch.float16) else None
    with gm.graph.inserting_before(before):
        offs = example_value(offs_node)
        if offs.dtype != torch.int32:
            cast = gm.graph.call_method("to", (offs_node, torch.int32))
            cast.meta["example_value"] = offs.to(torch.int32)
            offs_node = cast
        return gm.graph.call_function(
            mx_grouped_mm_op,
            (x_node, w_node, offs_node),
            {
                **unique_stats_site(gm, decision.settings.graph_kwargs(), "grouped_mm"),
                "out_dtype": out_dtype,
                **({"dgrad_dtype": dgrad_dtype} if dgrad_dtype is not None else {}),
            },
        )


def decide(policy: Policy, module: str, x, e, n, k, runs: str = "") -> Decision:
    """The policy's decision for a grouped GEMM of ``x [S, K]`` over ``e`` experts of ``[N, K]``:
    ``min_size="auto"`` judges one expert's GEMM, M = rows per expert. ``runs``: the dtype the GEMM as written runs
    in (:meth:`mxfx.policy.Decision.fit`)."""
    macs, gemm = gemm_size(x.shape[:1], n, k)
    if gemm is not None:
        gemm = (max(1, gemm[0] // max(size_hint(e), 1)), gemm[1], gemm[2])
    return policy.decide("grouped_mm", module, macs, gemm).fit(size_hint(k), size_hint(n), runs)
