"""The routing indices the routed-expert passes recognise in a graph: the permutation that sorts a routing's flat
(token, slot) pairs by expert (the index output of a ``sort`` or ``argsort`` of a 1D tensor), ``perm // k`` (each
pair's token), and a row index written as a column expanded over the features (``torch.gather`` /
``scatter_add`` along dim 0). An index the graph writes in place anywhere (or a view of it) is none of them: the
rewrites that rely on it being a permutation would compute something else."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mxfx.fx import example_value, is_call, known_size, written


def permutation(node) -> fx.Node | None:
    """``node`` when it is the index output of a sort or argsort of a 1D tensor that the graph never writes in
    place (nor a view of it), else None."""
    if not isinstance(node, fx.Node) or written(node):
        return None
    if is_call(node, (operator.getitem,)) and node.args[1] == 1:
        src = node.args[0]
        if isinstance(src, fx.Node) and is_call(src, (torch.sort,), ("sort",)):
            return node if _sorted_is_1d(src) else None
        return None
    if is_call(node, (torch.argsort,), ("argsort",)):
        return node if _sorted_is_1d(node) else None
    return None


def _sorted_is_1d(call: fx.Node) -> bool:
    """The tensor a sort/argsort call orders is 1D (so its indices permute ``range(numel)``)."""
    t = example_value(call.args[0]) if call.args else None
    return t is not None and t.dim() == 1


def int_value(arg) -> int | None:
    """The value (a symbolic size's hint) of ``arg``, an int or a graph node holding one (a top-k, an ``arange``
    bound), else None."""
    if isinstance(arg, fx.Node):
        arg = arg.meta.get("example_value")
        if not isinstance(arg, (int, torch.SymInt)) or isinstance(arg, bool):
            return None
    elif not isinstance(arg, int) or isinstance(arg, bool):
        return None
    return known_size(arg)


def floordiv(node) -> tuple[fx.Node, object] | None:
    """``(perm, k)`` of ``perm // k`` with k an int or a node holding one (a symbolic size), its result never
    written in place (nor a view of it), else None."""
    if not isinstance(node, fx.Node) or len(node.args) < 2 or int_value(node.args[1]) is None or written(node):
        return None
    k = node.args[1]
    if is_call(node, (operator.floordiv, torch.floor_divide), ("floor_divide", "__floordiv__")):
        return node.args[0], k
    if is_call(node, (torch.div,), ("div",)) and node.kwargs.get("rounding_mode") == "floor":
        return node.args[0], k
    return None


def column_index(idx) -> fx.Node | None:
    """``i`` of ``i.reshape(-1, 1).expand(-1, D)`` (or ``view`` / ``unsqueeze(1)``): a gather index that picks whole
    rows, else None."""
    if not (isinstance(idx, fx.Node) and is_call(idx, (), ("expand",)) and isinstance(idx.args[0], fx.Node)):
        return None
    col = idx.args[0]
    if is_call(col, (), ("reshape", "view")) and tuple(col.args[1:]) in (((-1, 1),), (-1, 1)):
        return col.args[0]
    if is_call(col, (torch.unsqueeze,), ("unsqueeze",)) and tuple(col.args[1:]) in ((1,), (-1,)):
        return col.args[0]
    return None
