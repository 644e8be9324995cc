"""fp8_block's dense GEMM on CUDA: cuBLAS's blockwise FP8 GEMM (``torch.nn.functional.scaled_mm`` with explicit
recipes; sm90 and a torch built with CUDA 12.9+). :mod:`mxfx.kernels.fp8_block.gemm` checks the operands and
chooses this path for CUDA tensors.

cuBLAS scale layouts (a wrong one can be a silent wrong answer, so they are built here, never taken from the caller
as is): A's 1x128 scales column-major (stride ``(1, M)``); B's 128x128 scales, seen as
``[ceil(N/128), ceil(K/128)]``, row-major with the row stride rounded up to a multiple of 4 (zero padding); B's
1x128 scales, seen as ``[N, ceil(K/128)]``, column-major. tests/test_block_gpu.py checks K/128 = 5 against the
reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mxfx.numerics.block import tiled_rows
from mxfx.numerics.layout import column_major


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    # a symbolic dim (traced under dynamic shapes) is padded by its symbolic remainder, maybe zero: no guard on it
    extra = -t.shape[dim] % multiple
    if statically_known_true(extra == 0):
        return t
    pad = [0, 0] * (t.dim() - dim - 1) + [0, extra]
    return F.pad(t.view(torch.uint8), pad).view(t.dtype)  # zero bytes: E4M3 +0, adds nothing to the sums


def _same(size, target) -> bool:
    """Whether two sizes are known equal without a guard (plain ints: equal); a symbolic pair not known equal takes
    the padding or slicing path, which is also right when they turn out equal."""
    return statically_known_true(size == target)


def _pad_rows(scales: torch.Tensor, rows) -> torch.Tensor:
    """1x128 ``scales [R, ceil(K/128)]`` with rows of 1.0 up to ``rows``, column-major (padded as their transpose:
    one copy, already in the layout cuBLAS reads)."""
    return F.pad(scales.t(), (0, rows - scales.shape[0]), value=1.0).t()


def mm(a, a_scales, b, b_scales, out_dtype):
    """``A @ B^T`` by cuBLAS's blockwise FP8 GEMM for operands :func:`mxfx.kernels.fp8_block.gemm.scaled_mm` has
    checked: A ``[M, K]`` with 1x128 scales, B ``[N, K]`` with 128x128 or 1x128 scales (module docstring), the
    result ``[M, N]`` in ``out_dtype``.

    Raises:
        RuntimeError: cuBLAS refused the call (names the shapes, the scales and what blockwise FP8 needs).
    """
    m, n = a.shape[0], b.shape[0]
    # torch._scaled_mm wants K and N multiples of 16; M is padded too, so the column-major scale strides (M, N)
    # stay 16-byte aligned. Zero rows and columns (E4M3 +0, scale 1) add nothing; the output is sliced back.
    a_q = _pad_to(_pad_to(a, 1, 16), 0, 16).contiguous()
    b_q = _pad_to(_pad_to(b, 1, 16), 0, 16).contiguous()
    a_s = column_major(a_scales if _same(a_q.shape[0], m) else _pad_rows(a_scales, a_q.shape[0]))  # stride (1, M)
    if not tiled_rows(b, b_scales):
        # [ceil(K/128) padded to a multiple of 4, N/128] with stride (1, padded): the 128x128 grid, K blocks padded
        # with zeros (never read). The explicit-recipe API: torch._scaled_mm infers the recipe from the shapes and
        # takes an unpadded grid for K/128 not a multiple of 4 with wrong sums on torch 2.11
        kt = b_scales.shape[1]
        padded = b_scales
        if kt % 4 or not b_scales.is_contiguous() or b_scales.storage_offset():  # else: that grid already
            padded = b_scales.new_zeros(b_scales.shape[0], -(-kt // 4) * 4)
            padded[:, :kt] = b_scales
        b_s, recipe_b = padded.t(), F.ScalingType.BlockWise128x128
    else:
        sb = b_scales if _same(b_q.shape[0], n) else _pad_rows(b_scales, b_q.shape[0])
        b_s, recipe_b = column_major(sb), F.ScalingType.BlockWise1x128  # [N, K/128], stride (1, N)
    try:
        out = F.scaled_mm(a_q, b_q.t(), a_s, F.ScalingType.BlockWise1x128, b_s, recipe_b, output_dtype=out_dtype)
    except RuntimeError as e:
        raise RuntimeError(
            f"mxfx.block_gemm.scaled_mm: cuBLAS refused A {tuple(a.shape)} x B {tuple(b.shape)} with scales "
            f"{tuple(a_scales.shape)} and {tuple(b_scales.shape)} (out {out_dtype}); blockwise FP8 needs sm90 "
            f"and a torch built with CUDA 12.9+"
        ) from e
    return out if _same(out.shape[0], m) and _same(out.shape[1], n) else out[:m, :n]
