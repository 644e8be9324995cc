"""Batched expert GEMM pass: ``bmm(W[expert_ids], x[..., None])`` -> sort by expert + MX grouped GEMM.

Pattern: HF transformers' ``experts_implementation="batched_mm"``: the expert
weights are indexed per row, ``W[ids]`` with ``ids [S]`` integer and ``W`` a 3-D
parameter, then one matrix-vector product per row:

* ``bmm(W[ids], x.unsqueeze(-1)).squeeze(-1)`` with ``W [E, N, K]``, or
* ``bmm(x.unsqueeze(1), W[ids]).squeeze(1)`` with ``W [E, K, N]`` (transposed layout);

``torch.matmul`` in place of ``bmm`` matches too.

Replacement: the rows are sorted by expert (``torch.sort(ids, stable=True)``),
group ends ``offs [E]`` found with ``searchsorted``, and
:func:`mxfx.ops.grouped_mm.mx_grouped_mm_op` runs on ``x[perm]`` and the
parameter itself; its result is put back in row order with the inverse
permutation. Valid: row ``s`` of both is ``x[s] . W[ids[s]]^T``, here with
MX-rounded operands and fp32 accumulation; the output dtype is the ``bmm``'s
(the autocast dtype under autocast). One sort per ``ids`` serves every GEMM
that indexes with it.

Why a sort and not an MX batched GEMM: ``W[ids]`` materializes ``S`` copies of
``[N, K]`` (top-k copies of every expert per token, the memory bottleneck of
this implementation), and a batched matrix-vector product has no reuse of the
weight for a block-scaled GEMM to exploit. Sorted rows reuse the one grouped
kernel, its weight caches and the SwiGLU fusion (which sees through the row
gather, :mod:`mxfx.passes.swiglu`) and the combine fusion (which sorts the
route weights the same way, :mod:`mxfx.passes.combine`).
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from mxfx.passes import columns
from mxfx.passes.combine import UNSORT_META
from mxfx.fx import example_value, is_call, module_fqn, shape_str, size_hint
from mxfx.passes.expert_gemm import GROUPED_WGRAD, decide, insert_grouped
from mxfx.policy import Policy
from mxfx.report import OpRecord, PrecisionMap

_BMM = (torch.bmm, torch.matmul)


def _index_of_parameter(node) -> tuple[fx.Node, fx.Node] | None:
    """``(W, ids)`` when ``node`` is ``W[ids]`` with ``W`` a 3-D floating graph input and ``ids`` 1-D integer."""
    if not (isinstance(node, fx.Node) and is_call(node, (operator.getitem,)) and len(node.args) == 2):
        return None
    w, ids = node.args
    wv, iv = example_value(w), example_value(ids)
    if not (isinstance(w, fx.Node) and w.op in ("placeholder", "get_attr") and wv is not None and iv is not None):
        return None
    if wv.dim() != 3 or not wv.is_floating_point() or iv.dim() != 1 or iv.is_floating_point() or iv.dtype == torch.bool:
        return None
    return w, ids


def _unsqueezed(node, dim: int) -> fx.Node | None:
    """``t`` when ``node`` is ``t.unsqueeze(dim)`` (dim -1 also as 2, dim 1 also as -2)."""
    if not (isinstance(node, fx.Node) and is_call(node, (torch.unsqueeze,), ("unsqueeze",)) and len(node.args) == 2):
        return None
    t = example_value(node.args[0])
    if t is None or t.dim() != 2 or node.args[1] % 3 != dim % 3:
        return None
    return node.args[0]


def match(node: fx.Node):
    """``(squeeze_node, x, W, ids, transposed)`` for a per-row batched expert GEMM at ``node`` (a bmm), else None."""
    if not (is_call(node, _BMM, ("bmm", "matmul")) and len(node.args) == 2 and len(node.users) == 1):
        return None
    squeeze = next(iter(node.users))
    if not is_call(squeeze, (torch.squeeze,), ("squeeze",)) or len(squeeze.args) != 2:
        return None
    a, b = node.args
    for sel, vec, dim, transposed in ((a, b, -1, False), (b, a, 1, True)):
        found = _index_of_parameter(sel)
        x = _unsqueezed(vec, dim)
        if found and x is not None and squeeze.args[1] % 3 == dim % 3 and len(sel.users) == 1:
            return squeeze, x, found[0], found[1], transposed
    return None


def _row_order(gm: fx.GraphModule, ids: fx.Node, experts: int, cache: dict) -> tuple[fx.Node, fx.Node, fx.Node]:
    """``(perm, inv, offs)`` for ``ids``, built once right after ``ids``: rows sorted by expert (stable),
    the inverse permutation, and int32 group ends ``[E]``."""
    if ids in cache:
        return cache[ids]
    iv = example_value(ids)
    g = gm.graph
    with g.inserting_after(ids):
        order = g.call_function(torch.sort, (ids,), {"stable": True})
    with g.inserting_after(order):
        sorted_ids = g.call_function(operator.getitem, (order, 0))
    with g.inserting_after(sorted_ids):
        perm = g.call_function(operator.getitem, (order, 1))
    with g.inserting_after(perm):
        inv = g.call_function(torch.argsort, (perm,))
    with g.inserting_after(inv):
        experts_ids = g.call_function(torch.arange, (experts,), {"device": iv.device, "dtype": iv.dtype})
    with g.inserting_after(experts_ids):
        offs = g.call_function(torch.searchsorted, (sorted_ids, experts_ids), {"right": True, "out_int32": True})
    with getattr(iv, "fake_mode", None) or contextlib.nullcontext():  # example values as Dynamo's fake tensors
        s_vals, p_vals = torch.sort(iv, stable=True)
        order.meta["example_value"] = (s_vals, p_vals)
        sorted_ids.meta["example_value"], perm.meta["example_value"] = s_vals, p_vals
        inv.meta["example_value"] = torch.argsort(p_vals)
        experts_ids.meta["example_value"] = torch.arange(experts, device=iv.device, dtype=iv.dtype)
        offs.meta["example_value"] = torch.searchsorted(
            s_vals, experts_ids.meta["example_value"], right=True, out_int32=True
        )
    cache[ids] = perm, inv, offs
    return cache[ids]


def _gather(gm: fx.GraphModule, t: fx.Node, rows: fx.Node) -> fx.Node:
    """``t[rows]`` (inserted at the graph's current insertion point)."""
    node = gm.graph.call_function(operator.getitem, (t, rows))
    node.meta["example_value"] = example_value(t)[example_value(rows)]
    return node


def rewrite(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Rewrite per-row batched expert GEMMs in ``gm`` in place (part of the ``grouped_mm`` pass, under its switch);
    returns how many were rewritten."""
    rewritten, orders = 0, {}
    for node in list(gm.graph.nodes):
        found = match(node)
        if found is None:
            continue
        squeeze, x_node, w_node, ids, transposed = found
        x, w, out = example_value(x_node), example_value(w_node), example_value(squeeze)
        e, n, k = (w.shape[0], w.shape[2], w.shape[1]) if transposed else w.shape
        module = module_fqn(node)
        shapes = f"x{shape_str(x)} w{shape_str(w)}"
        reason = "" if x.is_floating_point() else f"input dtype {x.dtype}"
        d = None
        if not reason:
            d = decide(policy, module, x, e, n, k, columns.kept_dtype(out, x))
            reason = d.reason
        if reason:
            pm.add(
                OpRecord(
                    node.name,
                    "grouped_mm",
                    module,
                    shapes,
                    scale_rule="-",
                    **columns.kept_gemm(out, x, w, f"batched_mm: {reason}"),
                )
            )
            continue
        perm, inv, offs = _row_order(gm, ids, size_hint(e), orders)
        with gm.graph.inserting_before(node):
            xs = _gather(gm, x_node, perm)
            weight = w_node
            if transposed:
                weight = gm.graph.call_method("transpose", (w_node, -2, -1))
                weight.meta["example_value"] = w.transpose(-2, -1)
        new = insert_grouped(gm, node, xs, weight, offs, d, out.dtype)
        new.meta.update(node.meta)
        new.meta["example_value"] = out
        with gm.graph.inserting_after(new):
            back = _gather(gm, new, inv)
        back.meta.update(squeeze.meta)
        back.meta[UNSORT_META] = perm
        squeeze.replace_all_uses_with(back)
        sel = node.args[1] if transposed else node.args[0]
        vec = node.args[0] if transposed else node.args[1]
        for dead in (squeeze, node, sel, vec):
            if not dead.users:
                gm.graph.erase_node(dead)
        shapes += f" -> {str(out.dtype).removeprefix('torch.')}"
        rule = d.format.rule_shown(d.scale_rule)
        pm.add(
            OpRecord(
                new.name,
                "grouped_mm",
                module,
                shapes,
                scale_rule=rule,
                **columns.converted_gemm(
                    d, out, x, w, GROUPED_WGRAD, "was batched_mm (W[ids] then bmm): rows sorted by expert"
                ),
            )
        )
        rewritten += 1
    return rewritten
