"""The local dispatch: each token's row gathered once per expert it is routed to, with a scatter-free backward.

``gather_routed_rows(x, perm, top_k)`` is ``x[perm // top_k]``: ``x [T, D]`` the tokens, ``perm [T * top_k]`` a
permutation of the flat (token, slot) pairs (the order that sorts them by expert, as HF transformers and torchtitan
make it with ``sort`` / ``argsort``). Autograd's backward of that gather is a scatter-add of ``T * top_k`` rows into
``T`` (``index_put`` with ``accumulate=True``: FP32 atomics on a GPU, in an unspecified order). Here the backward
knows the index is a permutation: it inverts it and sums each token's ``top_k`` rows, a gather and a reduction in
a fixed order, accumulated in FP32 and rounded once to ``x``'s dtype. Deterministic, and no atomics.
"""

from __future__ import annotations

import torch


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``slot`` with ``slot[perm[j]] = j`` for a permutation ``perm`` of ``range(len(perm))``: a scatter of the
    positions, each written once (no atomics), into zeros (an index that is no permutation leaves zeros, not
    unwritten memory: a wrong result, the same every time)."""
    arange = torch.arange(perm.shape[0], device=perm.device, dtype=perm.dtype)
    return torch.zeros_like(perm).scatter_(0, perm, arange)


def token_sum(rows: torch.Tensor, top_k: int | torch.SymInt, dtype: torch.dtype) -> torch.Tensor:
    """Each token's ``top_k`` consecutive rows of ``rows [T * top_k, D]`` summed in ``dtype``, in slot order
    (``((r0 + r1) + r2) + ...``): ``[T, D]``. Written as a chain of adds, not a reduction, so that a compiled graph
    fuses it with the gather that forms ``rows`` into one elementwise kernel whose loads run along D (a reduction
    over the short slot axis reads across rows); a symbolic ``top_k`` takes ``sum``, whose order is the compiler's."""
    per_token = rows.view(rows.shape[0] // top_k, top_k, rows.shape[-1])  # not -1: D may be 0
    if not isinstance(top_k, int):
        return per_token.sum(1, dtype=dtype)
    total = per_token[:, 0].to(dtype)
    for j in range(1, top_k):
        total = total + per_token[:, j].to(dtype)
    return total


class _RoutedRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, perm, top_k):
        ctx.save_for_backward(perm)
        ctx.top_k, ctx.tokens, ctx.x_dtype = top_k, x.shape[0], x.dtype
        return x[perm // top_k]

    @staticmethod
    def backward(ctx, d_rows):
        (perm,) = ctx.saved_tensors
        slot = inverse_permutation(perm)  # slot[j] = the row of flat pair j (token j // top_k)
        summed = token_sum(d_rows[slot], ctx.top_k, torch.promote_types(d_rows.dtype, torch.float32))
        return summed.to(ctx.x_dtype), None, None


def gather_routed_rows(x: torch.Tensor, perm: torch.Tensor, top_k: int | torch.SymInt) -> torch.Tensor:
    """``x[perm // top_k]`` (module docstring): ``x [T, D]``, ``perm`` a permutation of ``range(T * top_k)``,
    integer ``[T * top_k]``; returns ``[T * top_k, D]`` in x's dtype. Its gradient is each token's ``top_k`` rows
    summed in FP32, in a fixed order. ``perm`` must be a permutation, which is not checked (that would read it on
    the host): the dispatch pass (:mod:`mxfx.passes.dispatch_backward`) calls this only with the indices of a
    ``sort`` or ``argsort``; for any other index the gradient is undefined.

    Raises:
        TypeError: x or perm not a tensor.
        ValueError: x not 2D, perm not a 1D int32 / int64 tensor of ``T * top_k`` entries on x's device, or top_k
            not a positive int (a symbolic size under dynamic shapes).
    """
    op = "mxfx.gather_routed_rows"
    check_routing(op, x, perm, top_k)
    if x.dim() != 2:
        raise ValueError(f"{op}: x of shape {tuple(x.shape)} must be [T, D] tokens; flatten the leading dims first")
    if perm.shape[0] != x.shape[0] * top_k:
        raise ValueError(
            f"{op}: perm has {perm.shape[0]} entries; x of shape {tuple(x.shape)} routed to top_k={top_k} experts "
            f"needs {x.shape[0]} * {top_k}"
        )
    return _RoutedRows.apply(x, perm, top_k)


def check_routing(op: str, rows: torch.Tensor, perm: torch.Tensor, top_k) -> None:
    """Refuse, naming ``op``: ``rows`` (the tokens or the routed rows) not a tensor, a ``top_k`` that is not a
    positive int (or symbolic size), a ``perm`` that is not a 1D int32 / int64 tensor on rows' device."""
    if not isinstance(rows, torch.Tensor) or not isinstance(perm, torch.Tensor):
        raise TypeError(f"{op}: takes tensors, got {type(rows).__name__} rows and a {type(perm).__name__} perm")
    if not isinstance(top_k, (int, torch.SymInt)) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"{op}: top_k={top_k!r} must be a positive int (the experts each token is routed to)")
    if perm.dim() != 1 or perm.dtype not in (torch.int32, torch.int64) or perm.device != rows.device:
        raise ValueError(
            f"{op}: perm must be a 1D int32 or int64 permutation on {rows.device}, got {perm.dtype} "
            f"{tuple(perm.shape)} on {perm.device}"
        )
