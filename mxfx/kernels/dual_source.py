"""Triton MXFP8 quantize of ``x [M, K]`` in both orientations, every output in x's own layout.

The columnwise pair (blocks of 32 down M) is the logical ``[K, M]`` operand that
``quantize_lastdim(x.t())`` gives, but stored in the *source layout*: ``q_col`` is
the ``.transpose(-2, -1)`` view of a contiguous ``[M, K]`` byte tensor and ``s_col``
that of a contiguous ``[M/32, K]`` one. Same values, no transpose: every load and
store of the kernel runs along K with 16-byte accesses, where the transposing kernel
of :mod:`mxfx.kernels.dual` moves bytes through shared memory. What keeps it below
copy bandwidth is the column amax, reduced across the warps that hold a block's 32
rows (H200: 61% of copy writing MX forms only, 89% as a refresh that also writes the
BF16 forms; BENCHMARKS.md). Emulated GEMMs (Hopper, which has no MX GEMM) read either
layout at the same cost, so the weight caches there keep the dgrad form in this one
(``mxfx.ops.gemm.colwise_in_source_layout``).

Optionally the same pass writes the dequantized values of each orientation (bf16
for the emulated GEMMs), in the same layout: one read of the FP32 main weight gives
everything a Hopper weight-cache refresh builds.

Bit-identical to ``mxfx.format.quantize_lastdim`` of ``x`` and of ``x.transpose(-2, -1)``
(OCP MX v1.0 §6.3, mxfx rules); the dequantized forms equal ``dequantize_lastdim``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.launch import launch
from mxfx.kernels.mx_block import check_both_axes, decode_scale, encode_blocks, load_tile, tile_origin

SOURCE_DUAL_CONFIG = (32, 256, 4)
"""(BLOCK_M, BLOCK_K, num_warps): one 32-row column block by 256 columns per program."""
TRANSPOSED_CONFIG = (32, 128, 1)
"""(BLOCK_M, BLOCK_K, num_warps) with the columnwise pair stored transposed."""


@triton.jit
def _store_tile(ptr, vals, b, r0, c0, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """Store ``vals [BR, BC]`` at rows r0.., cols c0.. of batch b of a contiguous [B, R, C] tensor."""
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    base = ptr + (b.to(tl.int64) * R + r0) * C + c0
    mask = ((r0 + ar) < R)[:, None] & ((c0 + ac) < C)[None, :]
    tl.store(base + ar[:, None] * C + ac[None, :], vals.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_tile_t(ptr, vals, b, r0, c0, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """Store ``vals [BR, BC]`` transposed: vals[r, c] at [b, c0 + c, r0 + r] of a contiguous [B, C, R] tensor."""
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    base = ptr + (b.to(tl.int64) * C + c0) * R + r0
    mask = ((r0 + ar) < R)[:, None] & ((c0 + ac) < C)[None, :]
    tl.store(base + ac[None, :] * R + ar[:, None], vals.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dual_source_kernel(
    x_ptr, qr_ptr, sr_ptr, hr_ptr, qc_ptr, sc_ptr, hc_ptr,
    M, K, sxb, sxm, sxk, n_k_tiles,
    RCEIL: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, HAT: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, COL_T: tl.constexpr = False,
):
    b, m0, k0 = tile_origin(n_k_tiles, BM, BK)
    v = load_tile(x_ptr, b, m0, k0, M, K, sxb, sxm, sxk, BM, BK)
    if ROW:  # blocks of 32 along K: q_row [B, M, K], s_row [B, M, K/32]
        q, s = encode_blocks(tl.reshape(v, [BM, BK // 32, 32]), 2, RCEIL)
        _store_tile(qr_ptr, tl.reshape(q, [BM, BK]), b, m0, k0, M, K, BM, BK)
        _store_tile(sr_ptr, s, b, m0, k0 // 32, M, K // 32, BM, BK // 32)
        if HAT:
            h = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * decode_scale(s)[:, :, None]
            _store_tile(hr_ptr, tl.reshape(h, [BM, BK]), b, m0, k0, M, K, BM, BK)
    if COL:  # blocks of 32 along M: q_col storage [B, M, K], s_col storage [B, M/32, K]
        q, s = encode_blocks(tl.reshape(v, [BM // 32, 32, BK]), 1, RCEIL)
        if COL_T:
            _store_tile_t(qc_ptr, tl.reshape(q, [BM, BK]), b, m0, k0, M, K, BM, BK)
            _store_tile_t(sc_ptr, s, b, m0 // 32, k0, M // 32, K, BM // 32, BK)
        else:
            _store_tile(qc_ptr, tl.reshape(q, [BM, BK]), b, m0, k0, M, K, BM, BK)
            _store_tile(sc_ptr, s, b, m0 // 32, k0, M // 32, K, BM // 32, BK)
        if HAT:
            h = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * decode_scale(s)[:, None, :]
            _store_tile(hc_ptr, tl.reshape(h, [BM, BK]), b, m0, k0, M, K, BM, BK)


def quantize_dual_source(x: torch.Tensor, rule: str, *, row: bool = True, col: bool = True,
                         dequantized: torch.dtype | None = None, col_transposed: bool = False):
    """Rowwise and columnwise MX of ``x [M, K]`` or ``[B, M, K]`` (CUDA, bf16/fp16/fp32, any strides), in x's layout.

    Args:
        x: the source; M and K multiples of 32.
        rule: "rceil" or "floor".
        row, col: which orientations to write (at least one).
        dequantized: also write the dequantized values of each written orientation in this dtype.

    Returns:
        ``(q_row [.., M, K], s_row [.., M, K/32], h_row, q_col [.., K, M], s_col [.., K, M/32], h_col)``:
        e4m3 qdata, uint8 E8M0 scales, ``h_*`` the dequantized tensors (None without ``dequantized``);
        the row outputs contiguous, the column outputs transpose views of contiguous ``[.., M, K]`` /
        ``[.., M/32, K]`` tensors; orientations not written are all None.

    Raises:
        ValueError: not 2D/3D, M or K not a multiple of 32, or neither orientation asked for.
        TypeError: unsupported dtype (see ``mxfx.format.check_input``).
    """
    op = "mxfx.quantize_dual_source"
    if not (row or col):
        raise ValueError(f"{op}: asked for no orientation (row=False, col=False); ask for at least one orientation")
    x3 = check_both_axes(x, rule, op)
    B, M, K = x3.shape
    dev = x.device

    def new(shape, dtype, want):
        return torch.empty(shape, dtype=dtype, device=dev) if want else None

    q_row, s_row = new((B, M, K), torch.uint8, row), new((B, M, K // 32), torch.uint8, row)
    if col_transposed:
        q_col, s_col = new((B, K, M), torch.uint8, col), new((B, K, M // 32), torch.uint8, col)
    else:
        q_col, s_col = new((B, M, K), torch.uint8, col), new((B, M // 32, K), torch.uint8, col)
    h_row = new((B, M, K), dequantized, row and dequantized is not None)
    h_col = new((B, M, K), dequantized, col and dequantized is not None)
    bm, bk, warps = TRANSPOSED_CONFIG if col_transposed else SOURCE_DUAL_CONFIG
    n_k = triton.cdiv(K, bk)
    if M * K > 0:
        # outputs not written get the (read-only) input as a placeholder pointer
        args = [t if t is not None else x3 for t in (q_row, s_row, h_row, q_col, s_col, h_col)]
        launch(
            _dual_source_kernel, (triton.cdiv(M, bm) * n_k, B), x3, *args, M, K, *x3.stride(), n_k,
            RCEIL=rule == "rceil", ROW=row, COL=col, HAT=dequantized is not None, BM=bm, BK=bk, COL_T=col_transposed,
            num_warps=warps,
        )

    def out(t, transpose, fp8=False):
        if t is None:
            return None
        t = t.view(torch.float8_e4m3fn) if fp8 else t
        t = t.transpose(-2, -1) if transpose else t
        return t if x.dim() == 3 else t[0]

    return (out(q_row, False, True), out(s_row, False), out(h_row, False),
            out(q_col, not col_transposed, True), out(s_col, not col_transposed), out(h_col, True))
