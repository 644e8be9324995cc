"""Triton MXFP8 quantize in both orientations from one read of ``x [M, K]`` (``quantize_dual``).

For ``x [M, K]`` (contiguous along K): columnwise blocks run down M and are stored
transposed, ``q_col [K, M]``, ``s_col [K, M/32]`` (exactly ``quantize_lastdim(x.t())``);
and rowwise ``q_row [M, K]``, ``s_row [M, K/32]``. The wgrad operands
of OCP MX v1.0 GEMMs need the columnwise pair.

Each program reads its ``[BLOCK_M, BLOCK_K]`` tile once, as four row-interleaved
slices (rows ``m0 + 4i + j``, j = 0..3) in x's own orientation. A thread then holds
four M-neighbours of each column, packs their E4M3 bytes into one 32-bit word
(little-endian: byte j is row ``4i + j``), and the transpose to ``[K, M]`` moves
32-bit words rather than single bytes. M must be a multiple of 32 (the columnwise
blocks run along it), so M's specialization key (divisible by 16) never changes
with the token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.launch import launch
from mxfx.kernels.mx_block import abs_bits, block_scale, check_both_axes, encode_blocks, to_e4m3_bits

DUAL_CONFIG = (128, 64, 4)
"""(BLOCK_M, BLOCK_K, num_warps). A plainer kernel that encodes the columnwise bytes and transposes
them with ``tl.trans`` reached at most 36% of copy bandwidth on the H200 (this one: 50%)."""


@triton.jit
def _amax8(v, BM: tl.constexpr, BK: tl.constexpr):
    """Per-column amax bits over groups of 8 slice rows: ``[BM/4, BK]`` -> ``[BM/32, BK]``."""
    return tl.max(tl.reshape(abs_bits(v), [BM // 32, 8, BK]), axis=1)


@triton.jit
def _col_bytes(v, inv_scale, nonfinite, BM: tl.constexpr, BK: tl.constexpr):
    """E4M3 bytes of one slice with its column blocks' scales, as int32 ``[BM/4, BK]``."""
    q = to_e4m3_bits(tl.reshape(v, [BM // 32, 8, BK]), inv_scale[:, None, :], nonfinite[:, None, :])
    return tl.reshape(q, [BM // 4, BK]).to(tl.int32)


@triton.jit
def _row_store(v, j, qr_ptr, sr_ptr, b, m0, k0, M, K, RCEIL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Rowwise encode and store slice j (rows m0 + 4i + j) into q_row [B, M, K], s_row [B, M, K/32]."""
    NB: tl.constexpr = BK // 32
    qbits, sbyte = encode_blocks(tl.reshape(v, [BM // 4, NB, 32]), 2, RCEIL)
    rows = (b.to(tl.int64) * M + m0 + j) + 4 * tl.arange(0, BM // 4)
    rmask = (m0 + j + 4 * tl.arange(0, BM // 4)) < M
    ak = tl.arange(0, BK)
    an = tl.arange(0, NB)
    tl.store(qr_ptr + rows[:, None] * K + (k0 + ak)[None, :], tl.reshape(qbits, [BM // 4, BK]),
             mask=rmask[:, None] & ((k0 + ak) < K)[None, :])
    tl.store(sr_ptr + rows[:, None] * (K // 32) + (k0 // 32 + an)[None, :], sbyte,
             mask=rmask[:, None] & ((k0 // 32 + an) < K // 32)[None, :])


@triton.jit
def _dual_kernel(
    x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr,
    M, K, sxb, sxm, sxk, n_k_tiles,
    RCEIL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    m0 = (pid // n_k_tiles) * BM
    k0 = (pid % n_k_tiles) * BK
    ai = tl.arange(0, BM // 4)
    ak = tl.arange(0, BK)
    kmask = (k0 + ak) < K
    mask = ((m0 + 4 * ai) < M)[:, None] & kmask[None, :]  # M % 4 == 0: slice row 4i+j < M iff 4i < M - m0
    base = x_ptr + b.to(tl.int64) * sxb + m0.to(tl.int64) * sxm + k0.to(tl.int64) * sxk
    offs = (4 * ai)[:, None] * sxm + ak[None, :] * sxk
    x0 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(base + sxm + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + 2 * sxm + offs, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(base + 3 * sxm + offs, mask=mask, other=0.0).to(tl.float32)
    # columnwise: blocks of 32 rows = 8 slice rows x 4 slices
    amax = tl.maximum(tl.maximum(_amax8(x0, BM, BK), _amax8(x1, BM, BK)),
                      tl.maximum(_amax8(x2, BM, BK), _amax8(x3, BM, BK)))
    inv_scale, sbyte, nonfinite = block_scale(amax, RCEIL)
    word = _col_bytes(x0, inv_scale, nonfinite, BM, BK)
    word |= _col_bytes(x1, inv_scale, nonfinite, BM, BK) << 8
    word |= _col_bytes(x2, inv_scale, nonfinite, BM, BK) << 16
    word |= _col_bytes(x3, inv_scale, nonfinite, BM, BK) << 24
    # q_col [B, K, M] as int32 words [B, K, M/4]; s_col [B, K, M/32]
    krow = (b.to(tl.int64) * K + k0) + ak
    tl.store(qc_ptr + krow[None, :] * (M // 4) + (m0 // 4 + ai)[:, None], word, mask=mask)
    an = tl.arange(0, BM // 32)
    tl.store(sc_ptr + krow[None, :] * (M // 32) + (m0 // 32 + an)[:, None], sbyte,
             mask=((m0 // 32 + an) < M // 32)[:, None] & kmask[None, :])
    _row_store(x0, 0, qr_ptr, sr_ptr, b, m0, k0, M, K, RCEIL, BM, BK)
    _row_store(x1, 1, qr_ptr, sr_ptr, b, m0, k0, M, K, RCEIL, BM, BK)
    _row_store(x2, 2, qr_ptr, sr_ptr, b, m0, k0, M, K, RCEIL, BM, BK)
    _row_store(x3, 3, qr_ptr, sr_ptr, b, m0, k0, M, K, RCEIL, BM, BK)


def quantize_dual(x: torch.Tensor, rule: str):
    """Both orientations of ``x [M, K]`` (or ``[B, M, K]``; CUDA, bf16/fp16/fp32, any strides).

    Returns ``(q_row [.., M, K], s_row [.., M, K/32], q_col [.., K, M], s_col [.., K, M/32])``
    (e4m3 / uint8 E8M0, contiguous). Raises ValueError unless M and K are multiples of 32.
    """
    x3 = check_both_axes(x, rule, "mxfx.quantize_dual", " (the token dim, for activations)")
    B, M, K = x3.shape
    dev = x.device
    q_row = torch.empty((B, M, K), dtype=torch.uint8, device=dev)
    s_row = torch.empty((B, M, K // 32), dtype=torch.uint8, device=dev)
    q_col = torch.empty((B, K, M // 4), dtype=torch.int32, device=dev)  # 4 E4M3 bytes per word
    s_col = torch.empty((B, K, M // 32), dtype=torch.uint8, device=dev)
    bm, bk, warps = DUAL_CONFIG
    n_k = triton.cdiv(K, bk)
    if M * K > 0:
        launch(
            _dual_kernel, (triton.cdiv(M, bm) * n_k, B), x3, q_row, s_row, q_col, s_col, M, K, *x3.stride(), n_k,
            RCEIL=rule == "rceil", BM=bm, BK=bk, num_warps=warps,
        )
    out = (q_row.view(torch.float8_e4m3fn), s_row, q_col.view(torch.uint8).view(torch.float8_e4m3fn), s_col)
    return tuple(t if x.dim() == 3 else t[0] for t in out)
