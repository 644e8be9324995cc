"""Combine-sum pass: the local combine's sum of each token's top-k expert rows gets a gather on both sides.

Pattern: the rows ``y [T * k, D]`` of the routed experts (an ``mx_grouped_mm_op``'s output, directly or through
row ops: a route-weight multiply, ``masked_fill``, casts), sorted by expert with ``perm`` (the index output of a
``sort`` / ``argsort`` of a 1D tensor of ``T * k`` entries), summed into their tokens in one of three spellings:

* ``zeros.index_add(0, perm // k, y)`` (``torch.index_add`` too), HF transformers' older MoE blocks;
* ``zeros.scatter_add(0, (perm // k) as a column expanded over D, y)`` (``torch.scatter_add`` too), torchtitan;
* ``y[inv].view(T, k, D).sum(1)`` with ``inv`` the inverse of ``perm`` (``inv = empty_like(perm); inv[perm] =
  arange(T * k)``, or ``perm.argsort()``), HF transformers' grouped experts;

where ``zeros`` is a fresh ``[T, D]`` zeros (``zeros_like``, ``new_zeros``, ``torch.zeros``) read by nothing else,
the column index of a scatter as wide as the rows, and neither ``perm``, ``perm // k``, ``inv`` (past the write
that builds it) nor its ``arange`` written in place anywhere in the graph (nor a view of one).

Replacement: ``sum_routed_rows(y, perm, k)`` (:mod:`mxfx.ops.combine`): each token's rows summed in FP32 in a fixed
order and rounded once, and a gather for a backward. Valid because a sort's indices are a permutation: each token
owns exactly k rows. What changes: the first two spellings' forward scatter-add (atomics accumulating in y's dtype
in no fixed order) becomes a gather and an FP32 sum; the third's backward ``index_put`` with ``accumulate`` (a zero
fill and ``T * k`` row atomics) becomes a gather of the same values. The record of the grouped GEMM the rows come
from notes it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mxfx.fx import example_value, is_call, known_size, replace_with_call, written
from mxfx.ops.combine import sum_routed_rows
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.passes.routing_index import column_index, floordiv, int_value, permutation
from mxfx.policy import Policy
from mxfx.report import PrecisionMap

NOTE = "combine's token sum: FP32 in a fixed order, a gather for its backward (no scatter-add)"
"""What the precision map notes on the grouped GEMM whose rows the rewritten sum reads."""

_ROW_METHODS = ("masked_fill", "contiguous", "to", "float", "bfloat16", "half", "mul")
_ROW_FNS = (torch.masked_fill, operator.mul, torch.mul)
_ZEROS_FNS = (torch.zeros_like, torch.zeros)
_ZEROS_METHODS = ("new_zeros",)


def _routed_gemm(y: fx.Node) -> fx.Node | None:
    """The ``mx_grouped_mm_op`` whose output ``y`` is, directly or through row ops, else None."""
    seen = 0
    while isinstance(y, fx.Node) and seen < 8:
        if y.target is mx_grouped_mm_op:
            return y
        if not (is_call(y, _ROW_FNS, _ROW_METHODS) and y.args and isinstance(y.args[0], fx.Node)):
            return None
        y, seen = y.args[0], seen + 1
    return None


def _sizes(y: fx.Node, perm: fx.Node, k) -> tuple[int, int, int] | None:
    """``(T, k, D)`` when ``y`` is ``[T * k, D]`` floating rows and ``perm`` holds ``T * k`` entries, else None."""
    rows, p = example_value(y), example_value(perm)
    k = int_value(k)
    if rows is None or p is None or rows.dim() != 2 or not rows.is_floating_point() or not k or k < 1:
        return None
    pairs, width = known_size(rows.shape[0]), known_size(rows.shape[1])
    if pairs is None or width is None or known_size(p.shape[0]) != pairs or pairs % k:
        return None
    return pairs // k, k, width


def _fresh_zeros(buf, shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """``buf`` is a zeros tensor of ``shape`` and ``dtype`` made for this sum alone (one user)."""
    t = example_value(buf)
    if t is None or not is_call(buf, _ZEROS_FNS, _ZEROS_METHODS) or len(buf.users) != 1:
        return False
    return tuple(known_size(s) for s in t.shape) == shape and t.dtype == dtype


def _scatter_form(node: fx.Node) -> tuple[fx.Node, fx.Node, object, fx.Node] | None:
    """``(y, perm, k, buf)`` of ``buf.index_add(0, perm // k, y)`` or ``buf.scatter_add(0, column, y)``, else None."""
    if is_call(node, (torch.index_add,), ("index_add",)):
        names, column = ("input", "dim", "index", "source"), False
    elif is_call(node, (torch.scatter_add,), ("scatter_add",)):
        names, column = ("input", "dim", "index", "src"), True
    else:
        return None
    kw = dict(zip(names, node.args), **node.kwargs)
    if set(kw) != set(names) or kw["dim"] != 0:  # an alpha, or another dimension
        return None
    index = column_index(kw["index"]) if column else kw["index"]
    div = floordiv(index)
    if div is None or permutation(div[0]) is None:
        return None
    src, columns = kw[names[3]], example_value(kw["index"])
    if column and (columns is None or columns.shape != getattr(example_value(src), "shape", None)):
        return None  # an index narrower than the rows scatters only some of their columns
    return src, div[0], div[1], kw["input"]


def _inverse_of(inv) -> fx.Node | None:
    """``perm`` when ``inv`` is its inverse: ``perm.argsort()``, or ``empty_like(perm)`` written once by
    ``inv[perm] = arange(len(perm))``; else None."""
    if not isinstance(inv, fx.Node):
        return None
    if is_call(inv, (torch.argsort,), ("argsort",)) and len(inv.args) == 1 and not inv.kwargs:
        return inv.args[0] if permutation(inv.args[0]) is not None and not written(inv) else None
    if not (is_call(inv, (torch.empty_like,)) and permutation(inv.args[0]) is not None):
        return None
    perm = inv.args[0]
    writes = [u for u in inv.users if is_call(u, (operator.setitem,))]
    if len(writes) != 1 or writes[0].args[0] is not inv or writes[0].args[1] is not perm:
        return None
    arange = writes[0].args[2]
    if written(inv, allowed=(writes[0],)) or not (isinstance(arange, fx.Node) and is_call(arange, (torch.arange,))):
        return None
    if written(arange):
        return None
    bounds = tuple(int_value(b) for b in arange.args)
    n = known_size(example_value(perm).shape[0])
    return perm if bounds in ((n,), (0, n), (0, n, 1)) else None


def _gather_form(node: fx.Node) -> tuple[fx.Node, fx.Node, object, fx.Node] | None:
    """``(y, perm, k, view)`` of ``y[inv].view(T, k, D).sum(1)`` (or ``.sum(-2)``), else None."""
    if not is_call(node, (torch.sum,), ("sum",)) or not isinstance(node.args[0], fx.Node):
        return None
    kw = dict(zip(("input", "dim"), node.args), **node.kwargs)
    if set(kw) != {"input", "dim"} or kw["dim"] not in (1, -2, (1,), (-2,), [1], [-2]):  # the k axis of [T, k, D]
        return None
    view = kw["input"]
    if not (is_call(view, (torch.reshape,), ("view", "reshape")) and len(view.users) == 1):
        return None
    sizes = view.args[1] if len(view.args) == 2 and isinstance(view.args[1], (tuple, list)) else view.args[1:]
    gathered = view.args[0]
    if len(sizes) != 3 or not (is_call(gathered, (operator.getitem,)) and len(gathered.users) == 1):
        return None
    if not isinstance(gathered.args[0], fx.Node) or written(gathered.args[0]):
        return None  # the replacement reads the rows where the sum stands: a write in between would reach it
    perm = _inverse_of(gathered.args[1])
    return None if perm is None else (gathered.args[0], perm, sizes[1], view)


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Rewrite each combine sum of routed rows as ``sum_routed_rows``; returns how many were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        scatter = _scatter_form(node)
        hit = scatter or _gather_form(node)
        if hit is None:
            continue
        y, perm, k, spent = hit  # spent: the scatter's zeros, or the gather's view
        gemm, sizes, out = _routed_gemm(y), _sizes(y, perm, k), example_value(node)
        if gemm is None or sizes is None or out is None or out.dtype != example_value(y).dtype:
            continue
        tokens, _, width = sizes
        if tuple(known_size(s) for s in out.shape) != (tokens, width):
            continue
        if scatter is not None and not _fresh_zeros(spent, (tokens, width), out.dtype):
            continue
        replace_with_call(gm, node, sum_routed_rows, (y, perm, k))
        for dead in (spent,) if scatter is not None else (spent, spent.args[0]):  # zeros; or view, then y[inv]
            if not dead.users:
                gm.graph.erase_node(dead)
        record = pm.find(gemm.name)
        if record is not None:
            record.add_note(NOTE)
        rewritten += 1
    return rewritten
