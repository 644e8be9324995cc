"""Dispatch-to-expert pass: rows received by an MX all-to-all feed the grouped MX GEMM as MX, not DQ -> Q.

Pattern (after the all-to-all and grouped-GEMM passes):
``rows = mx_all_to_all(x, ...)`` with MXFP8 forward transport, then zero or more
row gathers (``rows[idx]`` with a 1D integer index, ``index_select(rows, 0, idx)``,
``.contiguous()``), then ``mx_grouped_mm_op(rows', W, offs)`` taking them as its
plain input (no SwiGLU ``up``).

Replacement: the all-to-all also returns the received pair
(``return_mx=True``); the same gathers are applied to qdata and scales (a
32-block lies inside one row, so gathering rows moves whole blocks with their
scales), and the grouped op gets them as ``x_mx``. Valid because the rows the
op would quantize are ``dequantize(qdata, scales)`` and re-quantizing those is
exact (``tests/test_grouped.py``): the bytes the GEMM reads are unchanged, one
dequantize-and-quantize round trip is gone (seed §11.1.3, dispatch consumed as
MX). The dequantized rows stay in the graph for autograd and for other
consumers; when nothing reads them, the compiler drops their computation.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mxfx.ops.all_to_all import mx_all_to_all
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.passes.fx import example_value, is_call
from mxfx.policy import Policy
from mxfx.report import PrecisionMap

_INDEX_SELECT = (torch.index_select,)


def _row_gather(node: fx.Node, src: fx.Node) -> bool:
    """``node`` reads rows of ``src`` only: ``src[idx]`` (1D integer tensor), ``index_select(src, 0, idx)``, ``contiguous``."""
    if node.op == "call_function" and node.target is operator.getitem and node.args[0] is src:
        idx = example_value(node.args[1]) if isinstance(node.args[1], fx.Node) else None
        return idx is not None and idx.dim() == 1 and not idx.is_floating_point() and idx.dtype != torch.bool
    if is_call(node, _INDEX_SELECT, ("index_select",)) and node.args[0] is src:
        return len(node.args) >= 3 and node.args[1] == 0
    return is_call(node, (), ("contiguous",)) and node.args[0] is src


def _path_to_grouped(rows: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """Row gathers from ``rows`` to an ``mx_grouped_mm_op`` reading them as ``x``, or None."""
    chain, cur = [], rows
    while True:
        for user in cur.users:
            if user.target is mx_grouped_mm_op and user.args[0] is cur and user.kwargs.get("up") is None:
                if user.kwargs.get("x_mx") is None:
                    return chain, user
        nxt = [u for u in cur.users if _row_gather(u, cur)]
        if len(nxt) != 1:
            return None
        cur = nxt[0]
        chain.append(cur)


def _replay(gm: fx.GraphModule, chain: list[fx.Node], src: fx.Node, before: fx.Node) -> fx.Node:
    """The gathers of ``chain`` applied to ``src`` (uint8 bytes), inserted before ``before``."""
    cur = src
    with gm.graph.inserting_before(before):
        for g in chain:
            cur = gm.graph.create_node(g.op, g.target, (cur, *g.args[1:]), dict(g.kwargs))
    return cur


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Hand received MX pairs to the grouped GEMMs they feed; returns how many."""
    done = 0
    for a2a in list(gm.graph.nodes):
        if a2a.target is not mx_all_to_all or a2a.kwargs.get("forward") != "mxfp8" or a2a.kwargs.get("return_mx"):
            continue
        found = _path_to_grouped(a2a)
        if found is None:
            continue
        chain, grouped = found
        with gm.graph.inserting_after(a2a):
            new = gm.graph.call_function(mx_all_to_all, a2a.args, {**a2a.kwargs, "return_mx": True})
        with gm.graph.inserting_after(new):
            rows = gm.graph.call_function(operator.getitem, (new, 0))
            q = gm.graph.call_function(operator.getitem, (new, 1))
            s = gm.graph.call_function(operator.getitem, (new, 2))
        rows.meta.update(a2a.meta)
        a2a.replace_all_uses_with(rows)
        gm.graph.erase_node(a2a)
        # gathers on the e4m3 payload go through its bytes: index kernels need not know float8
        with gm.graph.inserting_before(grouped):
            q_bytes = gm.graph.call_method("view", (q, torch.uint8))
        q_rows = _replay(gm, chain, q_bytes, grouped)
        s_rows = _replay(gm, chain, s, grouped)
        with gm.graph.inserting_before(grouped):
            q_e4m3 = gm.graph.call_method("view", (q_rows, torch.float8_e4m3fn))
        grouped.kwargs = {**grouped.kwargs, "x_mx": (q_e4m3, s_rows)}
        for rec in pm.records:
            if rec.node == a2a.name:
                rec.node = rows.name
                rec.add_note(f"received MX pair feeds {grouped.name} directly (no DQ->Q)")
            elif rec.node == grouped.name:
                rec.add_note("input taken as MX from the dispatch all-to-all")
        done += 1
    return done
