"""Combine pass: ``mx_grouped_mm(h, W_down, offs) * route_weight[:, None]`` -> one op with ``route_weight``.

Pattern: the only user of an MX grouped GEMM (the routed down projection) is a
multiply by a per-row tensor of shape ``[S, 1]`` — the route
weights of the combine's weighted sum, as HF transformers and torchtitan write it —
possibly behind ``masked_fill(rows, 0)`` ops (newer HF versions zero
expert-parallel sentinel rows there; zeroing rows commutes with scaling rows)
or behind the gather that undoes a sort by expert (then the route weights are
sorted by the same permutation: ``y[inv] * w == (y * w[perm])[inv]``).

Replacement: the grouped GEMM scales its output rows itself; in backward the
gradient of that weighted sum, ``dOut * route_weight``, is formed inside the
quantization that the down projection's dgrad consumes
(``mxfx::route_weight_quantize``), so no route-expanded BF16 gradient is
written (the recipe, "Routed Experts", Table 25). The route-weight gradient
``sum(dOut * Y, -1)`` is computed from the saved unweighted output, exactly as
the multiply's own backward would.

Under expert parallelism the multiply sits after the combine all-to-all instead
(torchtitan: ``back.float() * w_sorted.reshape(-1, 1)``, then a scatter-add of the
rows into their tokens). Pattern: an :func:`mx_all_to_all` of 2D rows whose only
user is that multiply, optionally through a cast to fp32. Replacement:
``mx_all_to_all(..., route_weight=w)``, which returns the weighted fp32 rows and
sends ``dOut * w`` back through the transport quantize itself (fp32 product,
no BF16 rounding before the E4M3 one); ``d w`` from the saved received rows.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mxfx.ops.all_to_all import mx_all_to_all
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.settings import settings_of
from mxfx.passes import columns
from mxfx.fx import example_value, is_call, module_fqn, shape_str
from mxfx.policy import Policy
from mxfx.report import OpRecord, PrecisionMap, precision_of

PRODUCT_PRECISION = "fp32"
"""What the precision map says of a fused route-weight multiply: taken in fp32 and rounded once to the output
dtype (:func:`mxfx.ops.grouped_mm.weigh_rows`), whatever the dtype of the multiply it replaces."""

_MUL_FN = (operator.mul, torch.mul)
UNSORT_META = "mxfx_unsort_of"
"""Meta key on a row gather ``y[inv]`` that undoes a sort by expert: the sorting permutation's node
(set by :mod:`mxfx.passes.batched_mm`), so the route weights can be sorted the same way."""


def _route_weight(mul: fx.Node, out: fx.Node) -> fx.Node | None:
    if not (is_call(mul, _MUL_FN, ("mul",)) and len(mul.args) == 2):
        return None
    other = mul.args[1] if mul.args[0] is out else mul.args[0]
    y, w = example_value(out), example_value(other)
    if w is None or y is None or other is out:
        return None
    # [S, 1] only: a 1-D [S] weight would broadcast along the hidden dim (columns), not rows
    rows_only = y.dim() == 2 and w.dim() == 2 and tuple(w.shape) == (y.shape[0], 1)
    return other if rows_only and w.is_floating_point() else None


def _is_zero_row_fill(n: fx.Node) -> bool:
    """``masked_fill(y, mask, 0)``: HF transformers zeroes expert-parallel sentinel rows this way."""
    return is_call(n, (torch.masked_fill,), ("masked_fill",)) and len(n.args) >= 3 and n.args[2] == 0


def _move_chain_after(node: fx.Node, last: fx.Node, anchor: fx.Node) -> None:
    """Re-place the single-user chain ``node -> ... -> last`` just before ``anchor``, in order."""
    chain, n = [], next(iter(node.users))
    while True:
        chain.append(n)
        if n is last:
            break
        n = next(iter(n.users))
    for n in chain:
        anchor.prepend(n)


def _is_fp32_cast(n: fx.Node) -> bool:
    """``t.float()``, ``t.to(torch.float32)`` or ``t.to(dtype=torch.float32)``."""
    if is_call(n, (), ("float",)) and len(n.args) == 1 and not n.kwargs:
        return True
    if not is_call(n, (), ("to",)):
        return False
    dtype = n.kwargs.get("dtype", n.args[1] if len(n.args) == 2 else None)
    return dtype is torch.float32 and len(n.kwargs) <= 1


def _fuse_into_transport(gm: fx.GraphModule, pm: PrecisionMap) -> int:
    """``mx_all_to_all(rows) [-> float()] * w`` -> ``mx_all_to_all(rows, route_weight=w)``."""
    fused = 0
    for node in list(gm.graph.nodes):
        if node.target is not mx_all_to_all or len(node.users) != 1:
            continue
        if node.kwargs.get("return_mx") or node.kwargs.get("route_weight") is not None:
            continue
        y = example_value(node)
        if y is None or y.dim() != 2:
            continue
        last, mul = node, next(iter(node.users))
        if _is_fp32_cast(mul) and len(mul.users) == 1:
            last, mul = mul, next(iter(mul.users))
        rw = _route_weight(mul, last)
        if rw is None:
            continue
        node.kwargs = {**node.kwargs, "route_weight": rw}
        mul.prepend(node)  # the route weights may be computed after the collective was issued
        out, product = node, example_value(mul)
        if product.dtype != torch.float32:  # the op returns fp32 rows; the multiply's own result dtype is kept
            with gm.graph.inserting_after(node):
                out = gm.graph.call_method("to", (node, product.dtype))
            node.meta["example_value"] = product.float()
        out.meta.update(mul.meta)
        mul.replace_all_uses_with(out)
        gm.graph.erase_node(mul)
        if last is not node:
            gm.graph.erase_node(last)
        for rec in pm.records:
            if rec.node == node.name:
                rec.add_note("route-weight multiply fused into the combine-backward transport quantize")
        fused += 1
    return fused


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Fuse route-weight multiplies into MX grouped GEMMs and combine all-to-alls in place;
    returns how many were fused."""
    fused = _fuse_into_transport(gm, pm)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not mx_grouped_mm_op or len(node.users) != 1:
            continue
        if node.kwargs.get("route_weight") is not None:
            continue
        last, mul = node, next(iter(node.users))
        while _is_zero_row_fill(mul) and len(mul.users) == 1:  # zeroing rows commutes with scaling rows
            last, mul = mul, next(iter(mul.users))
        perm = mul.meta.get(UNSORT_META) if is_call(mul, (operator.getitem,)) and mul.args[0] is last else None
        if perm is not None and len(mul.users) == 1:  # y[inv] * w == (y * w[perm])[inv]
            last, mul = mul, next(iter(mul.users))
        rw = _route_weight(mul, last)
        if rw is None:
            continue
        if perm is not None:
            with gm.graph.inserting_before(mul):
                rw = gm.graph.call_function(operator.getitem, (rw, perm))
            rw.meta["example_value"] = example_value(rw.args[0])[example_value(perm)]
        product = example_value(mul)
        out_dtype = product.dtype
        # the GEMM keeps writing its rows in the dtype chosen for it (BF16 under autocast); the product's dtype is
        # the op's result
        gemm_dtype = node.kwargs.get("out_dtype") or example_value(node).dtype
        node.kwargs = {**node.kwargs, "route_weight": rw, "out_dtype": out_dtype, "gemm_dtype": gemm_dtype}
        node.meta["example_value"] = product  # the GEMM now returns the product's rows, in its dtype
        mul.prepend(node)  # where the multiply stood: after the route weights and every input
        if last is not node:
            _move_chain_after(node, last, mul)
        mul.replace_all_uses_with(last)
        gm.graph.erase_node(mul)
        rec = pm.find(node.name, ("grouped_mm",))
        if rec is not None and " -> " in rec.shapes:  # the GEMM now returns the product's dtype
            rec.shapes = rec.shapes.rsplit(" -> ", 1)[0] + " -> " + str(out_dtype).removeprefix("torch.")
        module, settings = module_fqn(node), settings_of(node.kwargs)
        # backward: dOut * route weight formed in the dgrad quantize; the unweighted output kept, in gemm_dtype
        pm.add(
            OpRecord(
                node.name,
                "combine",
                module,
                f"w{shape_str(example_value(rw))}",
                scale_rule=settings.format.rule_shown(settings.scale_rule),
                **columns.gemm_columns(
                    product,
                    example_value(node.args[0]),
                    None,
                    PRODUCT_PRECISION,
                    settings.format.name,
                    "-",
                    precision_of(out_dtype),
                    "route-weight multiply fused into the dgrad quantize"
                    if settings.format.low_precision
                    else "route-weight multiply fused into the GEMM (its dgrad scales dY by the route weights)",
                ),
            )
        )
        fused += 1
    return fused
