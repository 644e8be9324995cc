"""Dispatch-to-expert pass: rows received by an MX all-to-all feed the grouped MX GEMM as MX, not DQ -> Q.

Pattern (after the all-to-all and grouped-GEMM passes):
``rows = mx_all_to_all(x, ...)`` with MXFP8 forward transport, then zero or more
row gathers (``rows[idx]`` with a 1D integer index, ``index_select(rows, 0, idx)``,
``.contiguous()``), then ``mx_grouped_mm_op(rows', W, offs)`` taking them as its
plain input (no SwiGLU ``up``).

Replacement: the all-to-all also returns the received pair
(``return_mx=True``); the same gathers are applied to qdata and scales (a
32-block lies inside one row, so gathering rows moves whole blocks with their
scales), and the grouped op gets them as ``x_mx`` (``x_mx_from="all_to_all"``:
the statistics observe the payload at the all-to-all, not again as the op's
input). Valid because the rows the
op would quantize are ``dequantize(qdata, scales)`` and re-quantizing those is
exact (``tests/test_grouped.py``): the bytes the GEMM reads are unchanged, one
dequantize-and-quantize round trip is gone (the recipe, "Smaller Dispatch and Combine Payloads", dispatch consumed as
MX). The dequantized rows stay in the graph for autograd and for other
consumers; when nothing reads them, the compiler drops their computation.

Local dispatch (no all-to-all): ``rows = x[idx]`` gathers each token once per
expert it is routed to (top-k copies, HF transformers' ``x[order // topk]``),
then feeds the grouped GEMM. Replacement: ``x`` itself is quantized, k times
fewer rows, and the same gathers are applied to its qdata and scales (and,
where the grouped GEMM is emulated, to the dequantized values the same pass
writes, which the GEMM reads instead of dequantizing the pair). Valid for the
same reason: a gathered row's blocks and scales are those of its source row, so
``quantize(x)[idx] == quantize(x[idx])`` bit for bit (``x_mx_from="gather"``: the
op's statistics observe the gathered pair against its BF16 rows, the same
sample as without the hoist). Taken only when the
gathers make more rows than ``x`` has; the BF16 rows stay in the graph for
autograd and, when the saved pass keeps them, for the BF16 wgrad. Under
``format="fp8_block"`` the same holds for x's 1x128 tiles (a tile lies inside one
row): x is quantized in tiles and the gathered pair is handed on.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mxfx.ops.all_to_all import mx_all_to_all
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.settings import settings_of
from mxfx.fx import example_value, fill_example_value, is_call, known_size
from mxfx.policy import Policy
from mxfx.report import PrecisionMap

_INDEX_SELECT = (torch.index_select,)


def _row_gather(node: fx.Node, src: fx.Node) -> bool:
    """``node`` reads rows of ``src`` only: ``src[idx]`` (1D integer tensor),
    ``index_select(src, 0, idx)``, ``contiguous``."""
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
                fmt = settings_of(user.kwargs).format
                if (
                    user.kwargs.get("x_mx") is None and fmt.transport == fmt.name
                ):  # its all-to-all carries its own pairs
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


def _gathered_mx(gm: fx.GraphModule, chain: list[fx.Node], pair: list[fx.Node], before: fx.Node) -> list[fx.Node]:
    """The gathers of ``chain`` applied to ``pair`` = (qdata, scales, values...), as ``x_mx`` of ``before``.

    Gathers on the e4m3 payload go through its bytes: index kernels need not know float8."""
    with gm.graph.inserting_before(before):
        q_bytes = gm.graph.call_method("view", (pair[0], torch.uint8))
    rows = [_replay(gm, chain, t, before) for t in (q_bytes, *pair[1:])]
    with gm.graph.inserting_before(before):
        rows[0] = gm.graph.call_method("view", (rows[0], torch.float8_e4m3fn))
    return rows


def _local_gathers(grouped: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(x, gathers)`` when the input of ``grouped`` is rows gathered from ``x`` (more rows than x has)."""
    chain, cur = [], grouped.args[0]
    while isinstance(cur, fx.Node) and cur.args and isinstance(cur.args[0], fx.Node) and _row_gather(cur, cur.args[0]):
        chain.append(cur)
        cur = cur.args[0]
    src, out = example_value(cur), example_value(grouped.args[0])
    if not chain or src is None or out is None or not src.is_floating_point() or src.dim() != 2:
        return None
    if cur.target is operator.getitem and isinstance(cur.args[0], fx.Node) and cur.args[0].target is mx_all_to_all:
        return None  # received rows: the all-to-all hands its own MX pair on (above)
    n_src, n_out = known_size(src.shape[0]), known_size(out.shape[0])
    if n_src is None or n_out is None or n_out <= n_src:
        return None
    return cur, chain[::-1]


def _hoist_local(gm: fx.GraphModule, pm: PrecisionMap) -> int:
    """Quantize tokens before the row gather of a local dispatch; returns how many grouped GEMMs."""
    done = 0
    for grouped in list(gm.graph.nodes):
        if grouped.target is not mx_grouped_mm_op or grouped.kwargs.get("up") is not None:
            continue
        if grouped.kwargs.get("x_mx") is not None:
            continue
        found = _local_gathers(grouped)
        if found is None:
            continue
        src, chain = found
        settings = settings_of(grouped.kwargs)
        call = settings.format.rows_quantize_call(settings.scale_rule, example_value(src).device)
        if call is None:
            continue
        target, args, n_out = call
        with gm.graph.inserting_before(chain[0]):
            tokens = gm.graph.call_method("detach", (src,))  # gradients flow through the BF16 rows
            mx = gm.graph.call_function(target, (tokens, *args))
            pair = [gm.graph.call_function(operator.getitem, (mx, i)) for i in range(n_out)]
        for n in (tokens, mx):  # the saved pass reads them: an alias of the tokens, a reader with no backward
            fill_example_value(n)
        grouped.kwargs = {
            **grouped.kwargs,
            "x_mx": tuple(_gathered_mx(gm, chain, pair, grouped)),
            "x_mx_from": "gather",
        }
        n_src, n_out = example_value(src).shape[0], example_value(grouped.args[0]).shape[0]
        record = pm.find(grouped.name)
        if record:
            record.add_note(f"input quantized before the dispatch's row gather ({n_src} rows, not {n_out})")
        done += 1
    return done


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Hand MX pairs made before the dispatch (received by an MX all-to-all, or quantized before a
    local row gather) to the grouped GEMMs they feed; returns how many."""
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
        grouped.kwargs = {
            **grouped.kwargs,
            "x_mx": tuple(_gathered_mx(gm, chain, [q, s], grouped)),
            "x_mx_from": "all_to_all",
        }
        for rec in pm.records:
            if rec.node == a2a.name:
                rec.node = rows.name
                rec.add_note(f"received MX pair feeds {grouped.name} directly (no DQ->Q)")
            elif rec.node == grouped.name:
                rec.add_note("input taken as MX from the dispatch all-to-all")
        done += 1
    return done + _hoist_local(gm, pm)
