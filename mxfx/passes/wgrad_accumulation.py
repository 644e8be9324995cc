"""Fused weight-gradient accumulation (``Policy.fuse_wgrad_accumulation``), judged per op on the real weights.

The passes give every converted op the policy's ``fuse_wgrad_accumulation``; they see fake tensors only. The backend
then calls :func:`settle` with the graph's example inputs, the real parameters of every block run through the graph:
an op whose weight cannot take the fused accumulation in one of them (:func:`mxfx.runtime.main_grad.unfused_reason`:
hooks, not an FP32 leaf parameter; or a weight the graph computes from parameters), and every op while compiled
autograd is on (:func:`mxfx.runtime.main_grad.graph_reason`), is given back to autograd (its call
loses the setting: its backward returns the gradient), and its precision-map record says why; a fused op's record
says its wgrad writes ``.grad``. An op inside an activation-checkpointed region reads its weight through the region
body's inputs, traced back to the graph's (:func:`mxfx.fx.outer_inputs`), and its record is found by its qualified
name (:func:`mxfx.fx.record_prefixes`); ops inside other higher-order ops' bodies keep the setting, and their
backward judges the parameter when it runs (raising where it cannot take it).
"""

from __future__ import annotations

import torch.fx as fx

from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear
from mxfx.fx import all_graphs, module_fqn, outer_inputs, record_prefixes, weight_source
from mxfx.report import PrecisionMap
from mxfx.runtime import main_grad

FIELD = "fuse_wgrad_accumulation"
FUSED_NOTE = "wgrad adds into .grad"
UNFUSED_NOTE = "wgrad accumulated by autograd, not its GEMM"
COMPUTED = "the weight is computed in the graph from parameters, not a parameter itself"


def settle(gm: fx.GraphModule, inputs: list[list], pm: PrecisionMap) -> int:
    """Give back to autograd the weight gradient of each fused op in ``gm`` (or in a checkpointed region's body)
    whose weight, in any of ``inputs`` (one list of example inputs per block the graph runs for, in placeholder
    order), cannot take the fused accumulation; note the outcome in ``pm``. Returns how many ops keep the fusion.
    Each fused parameter is told to :func:`mxfx.runtime.main_grad.judged`, with the op's module."""
    index_of, judged_bodies = outer_inputs(gm)
    prefixes = record_prefixes(gm)
    everywhere = main_grad.graph_reason()  # a reason that holds for every op, in every body
    fused = 0
    for g in all_graphs(gm):
        for node in g.graph.nodes:
            fused_op = node.op == "call_function" and node.target in (mx_linear, mx_grouped_mm_op)
            if not fused_op or not node.kwargs.get(FIELD):
                continue
            if g is not gm and g not in judged_bodies and not everywhere:
                continue  # the body of another higher-order op: judged by its backward
            record = pm.find(prefixes[g] + node.name)
            source, _ = weight_source(node.args[1])
            if everywhere:
                weights, reason = [], everywhere
            elif source in index_of:
                weights = [i[index_of[source]] for i in inputs]
                reason = next(filter(None, map(main_grad.unfused_reason, weights)), "")
            else:  # computed in the graph (a parametrization such as weight_norm, W + B @ A): no .grad to write
                weights, reason = [], COMPUTED
            if reason:
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != FIELD}
            else:
                fused += 1
                module = (record.module if record is not None else module_fqn(node)) if len(inputs) == 1 else ""
                for w in weights:
                    main_grad.judged(w, module)
            if record is not None and record.wgrad != "-":
                record.add_note(f"{UNFUSED_NOTE}: {reason}" if reason else FUSED_NOTE)
        g.recompile()
    return fused
