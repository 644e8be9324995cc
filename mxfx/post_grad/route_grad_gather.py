"""Gathered route gradient: a routed GEMM's output gradient is read from its tokens, not written out per row.

In a backward graph, the gradient of a combine's token sum (``sum_routed_rows``: each token's top-k expert rows) is
each token's gradient gathered back to its rows, ``aten.index(g, [index])`` with ``g [T, D]`` and ``index [T * k]``
(the rows' tokens). Where that ``[T * k, D]`` tensor only feeds ``mxfx::block_route_grad_operands`` (fp8_block's
one-read dY of a route-weighted grouped GEMM), Inductor writes it out in full (FP32 when the residual stream is, 512
MiB a call at OLMoE's shapes) for the op to read back. :func:`run` gives the op the token gradient and the index
instead, ``mxfx::block_route_grad_operands_gathered(g, index, ...)``, whose kernel reads each row from ``g`` where
it needs it; the gathered tensor is dropped when nothing else reads it. The values are the same bit for bit: the
op gathers the same rows. The kernel does not bounds-check the index as ``aten.index`` does: a backward graph's
``aten.index`` is the gradient of a forward gather or ``index_put`` by the same index (``sum_routed_rows``' sort
order divided by k, a user's ``index_put``), which the forward already read and checked.

It runs on Inductor's post-grad graphs (:mod:`mxfx.post_grad`); ``MXFX_GATHER_ROUTE_GRAD=0`` turns it off.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from mxfx.kernels.fp8_block import custom_ops  # noqa: F401  (defines the ops matched and made here)

ENV = "MXFX_GATHER_ROUTE_GRAD"

_ROUTE_GRAD = torch.ops.mxfx.block_route_grad_operands.default
_GATHERED = torch.ops.mxfx.block_route_grad_operands_gathered.default
_INDEX = torch.ops.aten.index.Tensor


def _row_gather(node) -> tuple[fx.Node, fx.Node] | None:
    """``(src, index)`` when ``node`` is ``aten.index(src, [index])`` of a 2D floating ``src`` by one 1D int32 or
    int64 ``index`` on its device, else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is _INDEX):
        return None
    if len(node.args) != 2 or node.kwargs or not isinstance(node.args[1], (list, tuple)) or len(node.args[1]) != 1:
        return None
    src, (index,) = node.args
    if not (isinstance(src, fx.Node) and isinstance(index, fx.Node)):
        return None
    s, i = src.meta.get("val"), index.meta.get("val")
    if not (isinstance(s, torch.Tensor) and isinstance(i, torch.Tensor)):
        return None
    if s.dim() != 2 or not s.is_floating_point() or i.dim() != 1 or i.dtype not in (torch.int32, torch.int64):
        return None
    return (src, index) if i.device == s.device else None


def run(graph: fx.Graph) -> int:
    """Replace each ``block_route_grad_operands`` of gathered rows in ``graph`` by the gathered op (module
    docstring); erase gathers left unread. Returns how many ops it replaced."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _ROUTE_GRAD or node.kwargs or len(node.args) != 4:
            continue
        gathered = node.args[0]
        found = _row_gather(gathered)
        if found is None:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(_GATHERED, (*found, *node.args[1:]))
        # its value and source line; not the old call's eager argument values (another signature)
        new.meta.update({k: node.meta[k] for k in ("val", "stack_trace") if k in node.meta})
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if not gathered.users:
            graph.erase_node(gathered)
        done += 1
    return done
