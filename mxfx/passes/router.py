"""Router detection: a linear whose output reaches softmax/sigmoid and then an expert selection.

Selections: ``topk`` (Mixtral, OLMoE, DeepSeek), ``argmax`` / ``max(dim)`` (top-1,
Switch-style), ``sort`` / ``argsort``.

Routers decide which experts run; the policy keeps them in their own precision
by default (the recipe, "Routed Experts": only expert, shared and attention GEMMs are MXFP8).
Found from graph structure (not names), so any MoE code is covered: HF
transformers' and torchtitan's routers cast logits to fp32, may scale them,
DeepSeek-V3 inserts group selection between the sigmoid and the topk, and
noisy top-k gating adds random noise to the logits. An argmax straight on a
projection's output is not taken for a router (it is as likely a classifier's
prediction): give such a router a policy rule (``{"module": ..., "precision": "bf16"}``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from mxfx.fx import example_value, is_call

_GATES_FN = (
    torch.softmax,
    F.softmax,
    torch.sigmoid,
    F.sigmoid,
    torch.special.softmax,
    torch.nn.functional.log_softmax,
    torch.log_softmax,
)
_GATES_METHODS = ("softmax", "sigmoid", "log_softmax")
_SELECT_FN = (torch.topk, torch.argmax, torch.sort, torch.argsort)
_SELECT_METHODS = ("topk", "argmax", "sort", "argsort")
_MAX_FN = (torch.max,)
_MAX_METHODS = ("max",)
MAX_HOPS_TO_GATE = 4
MAX_HOPS_TO_TOPK = 12


_NOISE_FN = (torch.randn_like, torch.rand_like, torch.randn, torch.rand, torch.normal)
_NOISE_METHODS = ("normal_", "uniform_", "exponential_")
MAX_HOPS_TO_NOISE = 3


def _is_noise(node: fx.Node) -> bool:
    """True when ``node`` is drawn from a random generator within a few ops: the gating noise of
    noisy top-k routers (``logits + randn_like(logits) * softplus(w_noise(x))``)."""
    frontier, seen = [node], {node}
    for _ in range(MAX_HOPS_TO_NOISE + 1):
        if any(is_call(n, _NOISE_FN, _NOISE_METHODS) for n in frontier):
            return True
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen]
        seen.update(frontier)
    return False


def _per_expert(node: fx.Node, src: fx.Node) -> bool:
    """True when ``node`` reads ``src`` and otherwise at most small broadcast operands: casts, views,
    scaling by a constant, a learned bias ``[E]``, a temperature buffer, or gating noise
    (:func:`_is_noise`). A second operand of the activation's own size (a residual add, the
    ``h * sigmoid(h)`` of a SiLU) stops the walk."""
    others = [a for a in node.all_input_nodes if a is not src]
    if not others:
        return True
    v_src = example_value(src)
    width = v_src.shape[-1] if isinstance(v_src, torch.Tensor) and v_src.dim() else 1
    for a in others:
        v = example_value(a)
        if not isinstance(v, torch.Tensor) or (v.numel() > width and not _is_noise(a)):
            return False
    return True


def _reaches(start: fx.Node, pred, max_hops: int, through=lambda n, src: True) -> list[fx.Node]:
    """Nodes satisfying ``pred`` within ``max_hops`` user edges of ``start``, walking only nodes for which
    ``through(node, the node it was reached from)`` holds."""
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
                elif through(u, n):
                    nxt.append(u)
        frontier = nxt
    return found


def _is_selection(node: fx.Node, with_max: bool) -> bool:
    """topk/argmax/sort/argsort, and with ``with_max`` also ``max`` along a dim (values and indices)."""
    if is_call(node, _SELECT_FN, _SELECT_METHODS):
        return True
    # torch.max(x, dim) and x.max(dim) both carry (x, dim) as args; without a dim, max is a reduction
    return with_max and is_call(node, _MAX_FN, _MAX_METHODS) and (len(node.args) >= 2 or "dim" in node.kwargs)


def is_router(linear: fx.Node) -> bool:
    """True when ``linear``'s output feeds softmax/sigmoid whose result feeds an expert selection
    (topk, argmax, max along a dim, sort, argsort), or feeds topk directly (GPT-OSS: topk on the
    logits, softmax after).

    Every step of the walk (linear -> gate -> selection) may only add small broadcast operands
    (:func:`_per_expert`): a projection that reaches a router through a residual add, or a
    hand-written SiLU ``h * sigmoid(h)`` several layers before one, is not mistaken for it.
    argmax/sort/``max`` count only after a gate: straight on a projection they are as likely a
    classifier's prediction, a max-pool or a softmax's shift.
    """
    on_logits = lambda n: is_call(n, (torch.topk,), ("topk",))  # noqa: E731
    if _reaches(linear, on_logits, MAX_HOPS_TO_GATE, _per_expert):
        return True
    gates = _reaches(linear, lambda n: is_call(n, _GATES_FN, _GATES_METHODS), MAX_HOPS_TO_GATE, _per_expert)
    return any(_reaches(g, lambda n: _is_selection(n, with_max=True), MAX_HOPS_TO_TOPK, _per_expert) for g in gates)
