"""Fused weight-gradient accumulation (``Policy.fuse_wgrad_accumulation``), judged per op on the real weights.

The passes give every converted op the policy's ``fuse_wgrad_accumulation``; they see fake tensors only. The backend
then calls :func:`settle` with the graph's example inputs, the real parameters of every block run through the graph:
an op whose weight cannot take the fused accumulation in one of them (:func:`mxfx.runtime.main_grad.unfused_reason`:
hooks, not an FP32 leaf parameter; or a weight the graph computes from parameters) is given back to autograd (its call
loses the setting: its backward returns the gradient), and its precision-map record says why; a fused op's record
says its wgrad writes ``.grad``. An op inside an activation-checkpointed region reads its weight through the region
body's inputs, traced back to the graph's (:func:`outer_inputs`); ops inside other higher-order ops' bodies keep the
setting, and their backward judges the parameter when it runs (raising where it cannot take it).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear
from mxfx.fx import all_graphs, module_fqn, weight_source
from mxfx.report import PrecisionMap
from mxfx.runtime import main_grad

FIELD = "fuse_wgrad_accumulation"
FUSED_NOTE = "wgrad GEMM writes the weight's .grad (fuse_wgrad_accumulation)"
UNFUSED_NOTE = "wgrad accumulated by autograd, not its GEMM"
COMPUTED = "the weight is computed in the graph from parameters, not a parameter itself"


CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
"""The higher-order op of an activation-checkpointed region: ``(body, *operands)``, the body's placeholders in the
operands' order."""


def settle(gm: fx.GraphModule, inputs: list[list], pm: PrecisionMap) -> int:
    """Give back to autograd the weight gradient of each fused op in ``gm`` (or in a checkpointed region's body)
    whose weight, in any of ``inputs`` (one list of example inputs per block the graph runs for, in placeholder
    order), cannot take the fused accumulation; note the outcome in ``pm``. Returns how many ops keep the fusion.
    Each fused parameter is told to :func:`mxfx.runtime.main_grad.judged`, with the op's module."""
    index_of, judged_bodies = outer_inputs(gm)
    fused = 0
    for g in all_graphs(gm):
        for node in g.graph.nodes:
            fused_op = node.op == "call_function" and node.target in (mx_linear, mx_grouped_mm_op)
            if not fused_op or not node.kwargs.get(FIELD):
                continue
            if g is not gm and g not in judged_bodies:
                continue  # the body of another higher-order op: judged by its backward
            record = pm.find(node.name) if g is gm else None  # record names are the outer graph's
            source, _ = weight_source(node.args[1])
            if source in index_of:
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


def outer_inputs(gm: fx.GraphModule) -> tuple[dict[fx.Node, int], list[fx.GraphModule]]:
    """``(placeholder -> index, bodies)``: the index among ``gm``'s placeholders of the input each placeholder of
    ``gm``, or of an activation-checkpointed region's body in it (:data:`CHECKPOINT`, at any depth), stands for
    (the same tensor handed down as an operand; a placeholder fed a computed value is left out), and those bodies."""
    index_of = {p: i for i, p in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    bodies, pending = [], [gm]
    while pending:
        g = pending.pop()
        for node in g.graph.nodes:
            if node.op != "call_function" or node.target is not CHECKPOINT or node.args[0].op != "get_attr":
                continue
            body = getattr(g, node.args[0].target)
            inner = [n for n in body.graph.nodes if n.op == "placeholder"]
            index_of.update((p, index_of[a]) for p, a in zip(inner, node.args[1:]) if a in index_of)
            bodies.append(body)
            pending.append(body)
    return index_of, bodies
