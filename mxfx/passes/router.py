"""Router detection: a linear whose output reaches softmax/sigmoid and then an expert selection.

Selections: ``topk`` (Mixtral, OLMoE, DeepSeek), ``argmax`` / ``max(dim)`` (top-1,
Switch-style), ``sort`` / ``argsort``.

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
_TOPK_FN = (torch.topk, torch.argmax, torch.sort, torch.argsort)
_TOPK_METHODS = ("topk", "argmax", "sort", "argsort")
_MAX_FN = (torch.max,)
_MAX_METHODS = ("max",)
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


def _is_selection(node: fx.Node, with_max: bool) -> bool:
    """topk/argmax/sort/argsort, and with ``with_max`` also ``max`` along a dim (values and indices)."""
    if is_call(node, _TOPK_FN, _TOPK_METHODS):
        return True
    # torch.max(x, dim) and x.max(dim) both carry (x, dim) as args; without a dim, max is a reduction
    return with_max and is_call(node, _MAX_FN, _MAX_METHODS) and (len(node.args) >= 2 or "dim" in node.kwargs)


def is_router(linear: fx.Node) -> bool:
    """True when ``linear``'s output feeds softmax/sigmoid whose result feeds an expert selection
    (topk, argmax, max along a dim, sort, argsort), or feeds topk/argmax/sort/argsort directly.

    Between the linear and the gate only unary ops (casts, views, temperature
    scaling) may stand, so a projection whose output merely reaches a router
    through a residual add is not mistaken for one. ``max`` counts only after a
    gate: straight on a projection it is as likely a max-pool or a softmax's shift.
    """
    on_logits = lambda n: _is_selection(n, with_max=False)  # noqa: E731
    if _reaches(linear, on_logits, MAX_HOPS_TO_GATE, _unary):  # selection on the logits, softmax after (GPT-OSS)
        return True
    gates = _reaches(linear, lambda n: is_call(n, _GATES_FN, _GATES_METHODS), MAX_HOPS_TO_GATE, _unary)
    return any(_reaches(g, lambda n: _is_selection(n, with_max=True), MAX_HOPS_TO_TOPK) for g in gates)
