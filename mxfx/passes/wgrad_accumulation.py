"""Fused weight-gradient accumulation (``Policy.fuse_wgrad_accumulation``), judged per op on the real weights.

The passes give every converted op the policy's ``fuse_wgrad_accumulation``; they see fake tensors only. The backend
then calls :func:`settle` with the graph's example inputs, the real parameters of every block run through the graph:
an op whose weight cannot take the fused accumulation in one of them (:func:`mxfx.runtime.main_grad.unfused_reason`:
hooks, not an FP32 leaf parameter; or a weight the graph computes from parameters) is given back to autograd (its call loses the setting: its backward returns the
gradient), and its precision-map record says why; a fused op's record says its wgrad writes ``.grad``. Ops inside a
subgraph (a checkpointed region's body) read their weight through the subgraph's own inputs: they keep the setting,
and their backward judges the parameter when it runs (raising where it cannot take it).
"""

from __future__ import annotations

import torch.fx as fx

from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear
from mxfx.passes.fx import weight_source
from mxfx.report import PrecisionMap
from mxfx.runtime import main_grad

FIELD = "fuse_wgrad_accumulation"
FUSED_NOTE = "wgrad GEMM writes the weight's .grad (fuse_wgrad_accumulation)"
UNFUSED_NOTE = "wgrad accumulated by autograd, not its GEMM"
COMPUTED = "the weight is computed in the graph from parameters, not a parameter itself"


def settle(gm: fx.GraphModule, inputs: list[list], pm: PrecisionMap) -> int:
    """Give back to autograd the weight gradient of each fused op in ``gm`` whose weight, in any of ``inputs`` (one
    list of example inputs per block the graph runs for, in placeholder order), cannot take the fused accumulation;
    note the outcome in ``pm``. Returns how many ops keep the fusion."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fused = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (mx_linear, mx_grouped_mm_op) or not node.kwargs.get(FIELD):
            continue
        record = pm.find(node.name)
        source, _ = weight_source(node.args[1])
        if source in placeholders:
            index = placeholders.index(source)
            reason = next(filter(None, (main_grad.unfused_reason(i[index]) for i in inputs)), "")
        else:  # computed in the graph (a parametrization such as weight_norm, W + B @ A): no .grad to write
            reason = COMPUTED
        if reason:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != FIELD}
        else:
            fused += 1
        if record is not None and record.wgrad != "-":
            record.add_note(f"{UNFUSED_NOTE}: {reason}" if reason else FUSED_NOTE)
    gm.recompile()
    return fused
