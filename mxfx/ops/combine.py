"""The local combine: each token's top-k expert rows summed back into the token, with a gather for a backward.

``sum_routed_rows(y, perm, top_k)``: ``y [T * top_k, D]`` holds the routed experts' rows in the order ``perm``
sorted the flat (token, slot) pairs by expert (row j belongs to token ``perm[j] // top_k``, as the dispatch
gathered it, :mod:`mxfx.ops.dispatch`); it returns ``[T, D]``, each token's rows summed in FP32 in slot order and
rounded once to y's dtype (float64 rows in float64). Its backward hands row j its token's gradient,
``d_out[perm // top_k]``: a gather.

Models write the same sum three ways, each with a scatter-add on one side: ``zeros.index_add(0, perm // k, y)``
(HF transformers' older MoE blocks) and ``zeros.scatter_add(0, index, y)`` (torchtitan) scatter-add in the forward
(atomics on a GPU, accumulating in y's dtype in no fixed order); ``y[inv].view(T, k, D).sum(1)`` with ``inv`` the
inverse of ``perm`` (HF transformers' grouped experts) gathers in the forward, and its backward is an
``index_put`` with ``accumulate=True``: a zero fill and a scatter-add of ``T * k`` rows (134M atomic adds a layer
and microbatch at OLMoE's shapes) where one gather does.
"""

from __future__ import annotations

import torch

from mxfx.ops.dispatch import check_routing, inverse_permutation, token_sum


class _SummedRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, perm, top_k):
        ctx.save_for_backward(perm)
        ctx.top_k = top_k
        rows = y[inverse_permutation(perm)]
        return token_sum(rows, top_k, torch.promote_types(y.dtype, torch.float32)).to(y.dtype)

    @staticmethod
    def backward(ctx, d_out):
        (perm,) = ctx.saved_tensors
        return d_out[perm // ctx.top_k], None, None


def sum_routed_rows(y: torch.Tensor, perm: torch.Tensor, top_k: int | torch.SymInt) -> torch.Tensor:
    """Each token's ``top_k`` rows of ``y`` summed (module docstring): ``y [T * top_k, D]`` floating, ``perm`` a
    permutation of ``range(T * top_k)``, integer ``[T * top_k]`` on y's device; returns ``[T, D]`` in y's dtype.
    ``perm`` must be a permutation, which is not checked (that would read it on the host): the combine-sum pass
    (:mod:`mxfx.passes.combine_sum`) calls this only with the indices of a ``sort`` or ``argsort``. For any other
    index the result is wrong (the same every time); an index out of range fails where the inverse is formed (on
    the CPU torch's index error; on a GPU a device-side assert).

    Raises:
        TypeError: y or perm not a tensor.
        ValueError: y not 2D float16 / bfloat16 / float32 / float64, perm not a 1D int32 / int64 tensor of y's
            row count on y's device, or top_k not a positive int (a symbolic size under dynamic shapes) dividing
            that count.
    """
    op = "mxfx.sum_routed_rows"
    check_routing(op, y, perm, top_k)
    if y.dim() != 2 or y.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(
            f"{op}: y must be [T * top_k, D] rows of float16, bfloat16, float32 or float64 (dequantize FP8 rows "
            f"first), got {y.dtype} {tuple(y.shape)}"
        )
    if perm.shape[0] != y.shape[0] or y.shape[0] % top_k:
        raise ValueError(
            f"{op}: y of shape {tuple(y.shape)} and perm of {perm.shape[0]} entries must both hold T * top_k rows "
            f"(top_k={top_k})"
        )
    return _SummedRows.apply(y, perm, top_k)
