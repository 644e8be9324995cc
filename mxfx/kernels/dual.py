"""Triton MXFP8 quantize in both orientations from one read of ``x [M, K]``.

Rowwise: blocks along K, ``q_row [M, K]``, ``s_row [M, K/32]``. Columnwise: blocks
down M, stored transposed, ``q_col [K, M]``, ``s_col [K, M/32]`` (exactly
``quantize_lastdim(x.t())``): the wgrad operands of OCP MX v1.0 GEMMs need both.
Each program reads one ``[BLOCK_M, BLOCK_K]`` tile once and encodes it twice.
M must be a multiple of 32 (the columnwise blocks run along it), so M's
specialization key (divisible by 16) never changes with the token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.format import BLOCK_SIZE
from mxfx.kernels.mx_block import encode_blocks, load_tile, store_rowwise

DUAL_CONFIG = (64, 64, 4)
"""(BLOCK_M, BLOCK_K, num_warps)."""


@triton.jit
def _dual_kernel(
    x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr,
    M, K, sxb, sxm, sxk,
    RCEIL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    m0 = tl.program_id(0) * BM
    k0 = tl.program_id(1) * BK
    b = tl.program_id(2)
    v = load_tile(x_ptr, b, m0, k0, M, K, sxb, sxm, sxk, BM, BK)
    qbits, sbyte = encode_blocks(tl.reshape(v, [BM, BK // 32, 32]), 2, RCEIL)
    store_rowwise(qr_ptr, sr_ptr, qbits, sbyte, b, m0, k0, M, K, False, BM, BK)
    # columnwise: blocks of 32 rows; element (m, k) goes to q_col[b, k, m]
    qbits_c, sbyte_c = encode_blocks(tl.reshape(v, [BM // 32, 32, BK]), 1, RCEIL)
    NB: tl.constexpr = BM // 32
    am = tl.arange(0, BM)
    ak = tl.arange(0, BK)
    an = tl.arange(0, NB)
    kmask = (k0 + ak) < K
    mmask = (m0 + am) < M
    qc_base = qc_ptr + (b.to(tl.int64) * K + k0) * M + m0
    tl.store(qc_base + ak[None, :] * M + am[:, None], tl.reshape(qbits_c, [BM, BK]),
             mask=mmask[:, None] & kmask[None, :])
    sc_base = sc_ptr + (b.to(tl.int64) * K + k0) * (M // 32) + m0 // 32
    tl.store(sc_base + ak[None, :] * (M // 32) + an[:, None], sbyte_c,
             mask=((m0 // 32 + an) < M // 32)[:, None] & kmask[None, :])


def quantize_dual(x: torch.Tensor, rule: str):
    """Both orientations of ``x [M, K]`` (or ``[B, M, K]``; CUDA, bf16/fp16/fp32, any strides).

    Returns ``(q_row [.., M, K], s_row [.., M, K/32], q_col [.., K, M], s_col [.., K, M/32])``
    (e4m3 / uint8 E8M0, contiguous). Raises ValueError unless M and K are multiples of 32.
    """
    if x.dim() not in (2, 3) or x.shape[-2] % BLOCK_SIZE or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"mxfx.quantize_dual: needs a 2D [M, K] or 3D [B, M, K] tensor with M and K multiples of "
            f"{BLOCK_SIZE}, got shape {tuple(x.shape)}; pad the token dim to a multiple of {BLOCK_SIZE}"
        )
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    B, M, K = x3.shape
    dev = x.device
    q_row = torch.empty((B, M, K), dtype=torch.uint8, device=dev)
    s_row = torch.empty((B, M, K // 32), dtype=torch.uint8, device=dev)
    q_col = torch.empty((B, K, M), dtype=torch.uint8, device=dev)
    s_col = torch.empty((B, K, M // 32), dtype=torch.uint8, device=dev)
    bm, bk, warps = DUAL_CONFIG
    if M * K > 0:
        _dual_kernel[(triton.cdiv(M, bm), triton.cdiv(K, bk), B)](
            x3, q_row, s_row, q_col, s_col, M, K, *x3.stride(), RCEIL=rule == "rceil", BM=bm, BK=bk,
            num_warps=warps,
        )
    out = (q_row.view(torch.float8_e4m3fn), s_row, q_col.view(torch.float8_e4m3fn), s_col)
    return tuple(t if x.dim() == 3 else t[0] for t in out)
