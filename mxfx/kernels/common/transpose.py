"""Triton transpose of 1-byte payloads: ``q [..., R, C]`` -> a new contiguous ``[..., C, R]``.

fp8_block's dgrad weight copy is the forward copy's E4M3 qdata transposed (``mxfx.runtime.cache``). torch's strided copy
moves one byte per thread with scattered writes; this kernel loads a ``TILE x TILE`` tile along its rows,
transposes it in registers and shared memory (``tl.trans``) and stores it along the output's rows, so both sides
are coalesced. Bytes move unchanged (qdata is viewed as ``uint8``): the result equals
``q.transpose(-2, -1).contiguous()`` byte for byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.common.launch import launch_direct

TILE = 64
"""Rows and columns of a tile (4 KiB of 1-byte values, 4 warps)."""


@triton.jit
def _transpose_kernel(src, dst, R, C, s_b, s_r, s_c, BLOCK: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_r * BLOCK + tl.arange(0, BLOCK)
    cols = pid_c * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    tile = tl.load(src + b * s_b + rows[:, None].to(tl.int64) * s_r + cols[None, :] * s_c, mask=mask)
    out = dst + b * R * C + cols[:, None].to(tl.int64) * R + rows[None, :]
    tl.store(out, tl.trans(tile), mask=tl.trans(mask))


def transpose_lastdims(q: torch.Tensor) -> torch.Tensor:
    """``q [..., R, C]`` (a 1-byte dtype, CUDA, any strides) -> contiguous ``[..., C, R]``, same dtype and bytes.

    Raises:
        ValueError: ``q`` has fewer than 2 dims or elements wider than one byte.
    """
    op = "mxfx.kernels.common.transpose.transpose_lastdims"
    if q.dim() < 2 or q.element_size() != 1:
        raise ValueError(
            f"{op}: expects a tensor of 2+ dims with 1-byte elements (E4M3 qdata), got {tuple(q.shape)} {q.dtype}"
        )
    *lead, r, c = q.shape
    src = q.view(torch.uint8).reshape(-1, r, c)
    out = torch.empty((src.shape[0], c, r), dtype=torch.uint8, device=q.device)
    if out.numel():
        grid = (triton.cdiv(r, TILE), triton.cdiv(c, TILE), src.shape[0])
        launch_direct(_transpose_kernel, grid, src, out, r, c, *src.stride(), BLOCK=TILE, num_warps=4)
    return out.view(q.dtype).view(*lead, c, r)
