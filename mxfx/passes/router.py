"""Router detection: a linear whose output reaches softmax/sigmoid and then topk.

Routers decide which experts run; the policy keeps them in their own precision
by default (seed §11.4.1: only expert, shared and attention GEMMs are MXFP8).
Found from graph structure (not names), so any MoE code is covered: HF
transformers' and torchtitan's routers cast logits to fp32, may scale them,
and DeepSeek-V3 inserts group selection between the sigmoid and the topk.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from mxfx.passes.fx import is_call

_GATES_FN = (torch.softmax, F.softmax, torch.sigmoid, F.sigmoid, torch.special.softmax, torch.nn.functional.log_softmax, torch.log_softmax)
_GATES_METHODS = ("softmax", "sigmoid", "log_softmax")
_TOPK_FN = (torch.topk,)
_TOPK_METHODS = ("topk",)
MAX_HOPS_TO_GATE = 4
MAX_HOPS_TO_TOPK = 12


def _unary(node: fx.Node) -> bool:
    """True when ``node`` reads exactly one graph value (casts, views, scaling by a constant)."""
    return len(node.all_input_nodes) == 1


def _reaches(start: fx.Node, pred, max_hops: int, through=lambda n: True) -> list[fx.Node]:
    """Nodes satisfying ``pred`` within ``max_hops`` user edges of ``start``, walking only ``through`` nodes."""
    found, frontier, seen = [], [start], {start}
    for _ in range(max_hops):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                if pred(u):
                    found.append(u)
                elif through(u):
                    nxt.append(u)
        frontier = nxt
    return found


def is_router(linear: fx.Node) -> bool:
    """True when ``linear``'s output feeds softmax/sigmoid whose result feeds topk (or feeds topk directly).

    Between the linear and the gate only unary ops (casts, views, temperature
    scaling) may stand, so a projection whose output merely reaches a router
    through a residual add is not mistaken for one.
    """
    is_topk = lambda n: is_call(n, _TOPK_FN, _TOPK_METHODS)  # noqa: E731
    if _reaches(linear, is_topk, MAX_HOPS_TO_GATE, _unary):  # topk on the logits, softmax after (GPT-OSS)
        return True
    gates = _reaches(linear, lambda n: is_call(n, _GATES_FN, _GATES_METHODS), MAX_HOPS_TO_GATE, _unary)
    return any(_reaches(g, is_topk, MAX_HOPS_TO_TOPK) for g in gates)
