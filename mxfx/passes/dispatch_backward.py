"""Dispatch-backward pass: the local dispatch's row gather gets a backward without a scatter-add.

Pattern: ``rows = x[perm // k]`` (``operator.getitem`` with that index, or ``torch.gather(x, 0, idx)`` with ``idx``
that index as a column expanded over x's features, as torchtitan writes it; ``//`` written as ``operator.floordiv``,
``torch.floor_divide`` or ``torch.div(..., rounding_mode="floor")``), where ``perm`` is the index output of
``torch.sort`` / ``Tensor.sort`` or of ``torch.argsort`` / ``Tensor.argsort`` over a 1D tensor of ``T * k``
entries, ``x [T, D]`` is floating, ``k`` an int (or a symbolic size), and the rows go to the routed experts: an
``mx_grouped_mm_op`` takes them as its input or an ``mx_all_to_all`` sends them (directly, or through row-wise
ops: ``masked_fill``, ``contiguous``, casts, a multiply by route scores). HF transformers writes
``hidden_states[perm // num_top_k]``; torchtitan ``torch.gather(x, 0, (argsort(ids) // top_k).reshape(-1,
1).expand(-1, dim))``; expert-parallel code ``x[order // k]`` before the dispatch all-to-all.

Replacement: ``gather_routed_rows(x, perm, k)`` (:mod:`mxfx.ops.dispatch`), the same rows. Autograd's backward of
the gather is a scatter-add of the ``T * k`` row gradients into ``T`` (FP32 atomics on a GPU, in no fixed order:
134M of them a layer and microbatch at OLMoE's shapes); the replacement inverts the permutation and sums each
token's k rows in FP32 in a fixed order, so x's gradient is deterministic and written once. Valid because a sort's
indices are a permutation of ``range(T * k)``: each token appears exactly k times in ``perm // k``. The record of
the op the rows feed notes it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mxfx.fx import example_value, is_call, known_size, replace_with_call
from mxfx.passes.routing_index import column_index, floordiv, permutation, int_value
from mxfx.ops.all_to_all import mx_all_to_all
from mxfx.ops.dispatch import gather_routed_rows
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.policy import Policy
from mxfx.report import PrecisionMap

NOTE = "dispatch gather's backward: each token's top-k row gradients summed in a fixed order (no scatter-add)"
"""What the precision map notes on the op the rewritten rows feed."""

_ROW_METHODS = ("masked_fill", "masked_fill_", "contiguous", "to", "float", "bfloat16", "half", "mul")
_ROW_FNS = (torch.masked_fill, operator.mul, torch.mul)


def _feeds_routed_experts(rows: fx.Node) -> fx.Node | None:
    """The ``mx_grouped_mm_op`` taking ``rows`` as its input, or the ``mx_all_to_all`` sending them (through row
    ops that keep them rows), else None."""
    frontier = [rows]
    while frontier:
        cur = frontier.pop()
        for user in cur.users:
            if user.target in (mx_grouped_mm_op, mx_all_to_all) and user.args and user.args[0] is cur:
                return user
            if is_call(user, _ROW_FNS, _ROW_METHODS) and cur in user.args[:2]:
                frontier.append(user)
    return None


def _gathered_rows(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(x, index)`` of a row gather ``x[index]`` or ``torch.gather(x, 0, index as a column, expanded)``."""
    if is_call(node, (operator.getitem,)) and isinstance(node.args[0], fx.Node):
        return node.args[0], node.args[1]
    if is_call(node, (torch.gather,), ("gather",)) and isinstance(node.args[0], fx.Node):
        kw = dict(zip(("dim", "index"), node.args[1:]), **node.kwargs)
        if set(kw) == {"dim", "index"} and kw["dim"] == 0:
            index = column_index(kw["index"])
            return None if index is None else (node.args[0], index)
    return None


def _match(node: fx.Node) -> tuple[fx.Node, fx.Node, object, fx.Node] | None:
    """``(x, perm, k, reader)`` of a dispatch gather ``x[perm // k]`` (module docstring), else None."""
    gathered = _gathered_rows(node)
    if gathered is None:
        return None
    src, index = gathered
    div = floordiv(index)
    if div is None:
        return None
    perm, k = div
    x, p, top_k = example_value(src), example_value(perm), int_value(k)
    if permutation(perm) is None or x is None or p is None or top_k < 1 or x.dim() != 2 or not x.is_floating_point():
        return None
    tokens, pairs = known_size(x.shape[0]), known_size(p.shape[0])
    if tokens is None or pairs is None or pairs != tokens * top_k:
        return None
    rows = example_value(node)  # whole rows (a torch.gather index narrower than x would take a column slice)
    if rows is None or rows.dim() != 2 or known_size(rows.shape[1]) != known_size(x.shape[1]):
        return None
    reader = _feeds_routed_experts(node)
    return None if reader is None else (src, perm, k, reader)


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Give each dispatch gather of routed rows the scatter-free backward; returns how many were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        hit = _match(node)
        if hit is None:
            continue
        x, perm, k, reader = hit
        replace_with_call(gm, node, gather_routed_rows, (x, perm, k))
        record = pm.find(reader.name)
        if record is not None:
            record.add_note(NOTE)
        rewritten += 1
    return rewritten
