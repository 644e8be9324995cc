"""Triton: zero the rows of a grouped-GEMM output that lie past the last group end.

``torch._grouped_mm`` leaves output rows ``offs[-1]:`` unwritten. Zeroing them with a
``torch.where`` over the whole output costs a full read and write of it; this kernel
reads ``offs[-1]`` on the device and stores zeros into the tail rows only, with no host
sync. A fixed grid of programs strides over the tail's row tiles, so when every row is
routed (the common case) the launch does no more than read ``offs[-1]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.common.launch import launch

BLOCK_R, BLOCK_C = 32, 512
PROGRAMS = 256
"""Row-tile programs per launch (each strides over the tail's tiles)."""


@triton.jit(do_not_specialize=["R"])
def _zero_rows_kernel(out_ptr, offs_ptr, n_groups, R, C, stride_r, BR: tl.constexpr, BC: tl.constexpr):
    end = tl.load(offs_ptr + n_groups - 1).to(tl.int64)
    zero = tl.zeros([BR, BC], dtype=out_ptr.dtype.element_ty)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    first = end // BR  # the tile holding row `end`: earlier tiles lie inside the groups
    for tile in range(first + tl.program_id(0), tl.cdiv(R, BR), tl.num_programs(0)):
        rows = tile * BR + tl.arange(0, BR)
        mask = ((rows >= end) & (rows < R))[:, None] & (cols < C)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_r + cols[None, :], zero, mask=mask)


def zero_rows_past_end_(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """In place: ``out[offs[-1]:] = 0`` for a CUDA ``out [S, N]`` with unit column stride; returns ``out``.

    Args:
        out: ``[S, N]`` CUDA tensor, ``out.stride(1) == 1``.
        offs: int32/int64 ``[E]`` cumulative group ends on the same device (E >= 1).

    Raises:
        ValueError: ``out`` not 2D with unit column stride, or ``offs`` not a non-empty 1D tensor.
    """
    if out.dim() != 2 or out.stride(1) != 1 or offs.dim() != 1 or offs.numel() == 0:
        raise ValueError(
            f"mxfx zero_rows_past_end_: expected out [S, N] with unit column stride and non-empty offs [E], "
            f"got out {tuple(out.shape)} strides {out.stride()}, offs {tuple(offs.shape)}"
        )
    r, c = out.shape
    if r * c > 0:
        grid = (min(triton.cdiv(r, BLOCK_R), PROGRAMS), triton.cdiv(c, BLOCK_C))
        launch(
            _zero_rows_kernel, grid, out, offs, offs.numel(), r, c, out.stride(0), BR=BLOCK_R, BC=BLOCK_C, num_warps=4
        )
    return out
