"""Triton MXFP8 dequantize along the last dim: ``x_hat = q * 2^(s - 127)`` in fp32, cast to the output dtype.

A pair in the source layout (``q`` the transpose view of a contiguous ``[.., M, K]``
tensor, ``s`` of ``[.., M/32, K]``; see :mod:`mxfx.kernels.mx.dual`) is read
along its storage rows and written in that same layout: no transpose either way.

Bit-identical to ``mxfx.numerics.mx.dequantize_lastdim`` (OCP MX v1.0 §6.3 / §5.3: E8M0
byte 255 is NaN, byte 0 is 2^-127).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.numerics.mx import check_pair
from mxfx.kernels.common.launch import launch
from mxfx.kernels.mx.blocks import as_brc, decode_scale, flat_blocks, tile_origin

FLAT_CONFIG = (64, 32, 4)
"""(BLOCK_R, BLOCK_C, num_warps) for contiguous inputs: BLOCK_R 32-value blocks per program."""
DEQUANT_CONFIG = (16, 256, 8)
"""(BLOCK_R, BLOCK_C, num_warps) for strided inputs."""


@triton.jit(do_not_specialize=["R"])
def _dequantize_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    R,
    C,
    sqb,
    sqr,
    sqc,
    ssb,
    ssr,
    ssc,
    n_c_tiles,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    NB: tl.constexpr = BC // 32
    b, r0, c0 = tile_origin(n_c_tiles, BR, BC)
    b = b.to(tl.int64)
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    an = tl.arange(0, NB)
    rmask = (r0 + ar) < R
    mask = rmask[:, None] & ((c0 + ac) < C)[None, :]
    q_base = q_ptr + b * sqb + r0.to(tl.int64) * sqr + c0.to(tl.int64) * sqc
    qbits = tl.load(q_base + ar[:, None] * sqr + ac[None, :] * sqc, mask=mask, other=0)
    s_base = s_ptr + b * ssb + r0.to(tl.int64) * ssr + (c0 // 32).to(tl.int64) * ssc
    sbyte = tl.load(
        s_base + ar[:, None] * ssr + an[None, :] * ssc,
        mask=rmask[:, None] & ((c0 // 32 + an) < C // 32)[None, :],
        other=0,
    )
    q = tl.reshape(qbits.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BR, NB, 32])
    out = tl.reshape(q * decode_scale(sbyte)[:, :, None], [BR, BC])
    o_base = out_ptr + (b * R + r0) * C + c0
    tl.store(o_base + ar[:, None] * C + ac[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_source_kernel(q_ptr, s_ptr, out_ptr, M, K, n_k_tiles, BM: tl.constexpr, BK: tl.constexpr):
    """Storage ``q [B, M, K]``, ``s [B, M/32, K]`` (blocks down M), contiguous -> ``out [B, M, K]``."""
    b, m0, k0 = tile_origin(n_k_tiles, BM, BK)
    b = b.to(tl.int64)
    am = tl.arange(0, BM)
    ak = tl.arange(0, BK)
    an = tl.arange(0, BM // 32)
    kmask = (k0 + ak) < K
    mask = ((m0 + am) < M)[:, None] & kmask[None, :]
    offs = (b * M + m0 + am)[:, None] * K + (k0 + ak)[None, :]
    qbits = tl.load(q_ptr + offs, mask=mask, other=0)
    s_offs = (b * (M // 32) + m0 // 32 + an)[:, None] * K + (k0 + ak)[None, :]
    sbyte = tl.load(s_ptr + s_offs, mask=((m0 // 32 + an) < M // 32)[:, None] & kmask[None, :], other=0)
    q = tl.reshape(qbits.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BM // 32, 32, BK])
    out = tl.reshape(q * decode_scale(sbyte)[:, None, :], [BM, BK])
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


SOURCE_CONFIG = (64, 256, 8)
"""(BLOCK_M, BLOCK_K, num_warps) for pairs in the source layout."""


def source_layout(qdata: torch.Tensor, scales: torch.Tensor) -> bool:
    """True when ``(qdata [.., K, M], scales [.., K, M/32])`` are transpose views of contiguous
    ``[.., M, K]`` / ``[.., M/32, K]`` tensors (the columnwise pair of :mod:`mxfx.kernels.mx.dual`)."""
    return (
        qdata.dim() >= 2
        and qdata.shape[-2] > 1
        and qdata.shape[-1] > 0
        and qdata.transpose(-2, -1).is_contiguous()
        and scales.transpose(-2, -1).is_contiguous()
        and not qdata.is_contiguous()
    )


def _dequantize_source(qdata: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = qdata.view(torch.uint8).transpose(-2, -1)
    s = scales.view(torch.uint8).transpose(-2, -1)
    M, K = q.shape[-2], q.shape[-1]
    B = q.numel() // (M * K)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    bm, bk, warps = SOURCE_CONFIG
    n_k = triton.cdiv(K, bk)
    if B * M * K > 0:
        launch(
            _dequantize_source_kernel,
            (triton.cdiv(M, bm) * n_k, B),
            q,
            s,
            out,
            M,
            K,
            n_k,
            BM=bm,
            BK=bk,
            num_warps=warps,
        )
    return out.transpose(-2, -1)


def dequantize_lastdim(qdata: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(q e4m3 [..., K], s uint8 [..., K/32])`` on CUDA (any strides) -> ``[..., K]`` of ``dtype``.

    Contiguous, except for a pair in the source layout (:func:`source_layout`), whose result
    keeps that layout (the transpose view of a contiguous tensor). Scales may be MN-major
    (:mod:`mxfx.kernels.mx.views`): they are read through their strides, not copied.
    """
    check_pair(qdata, scales, -1, "mxfx.dequantize")
    if source_layout(qdata, scales):
        return _dequantize_source(qdata, scales, dtype)
    q8, s8 = qdata.view(torch.uint8), scales.view(torch.uint8)
    if s8.is_contiguous() or s8.dim() > 3:
        q3, _ = flat_blocks(as_brc(q8))
    else:  # MN-major scales (mxfx.kernels.mx.views): 2D tiles, each reading its scales by their strides
        q3 = q8 if q8.dim() == 3 else as_brc(q8)
    B, R, C = q3.shape
    s3 = s8.reshape(B, R, C // 32)
    out = torch.empty(qdata.shape, dtype=dtype, device=qdata.device)
    br, bc, warps = FLAT_CONFIG if C == 32 else DEQUANT_CONFIG
    n_c = triton.cdiv(C, bc)
    if R * C > 0:
        launch(
            _dequantize_kernel,
            (triton.cdiv(R, br) * n_c, B),
            q3,
            s3,
            out,
            R,
            C,
            *q3.stride(),
            *s3.stride(),
            n_c,
            BR=br,
            BC=bc,
            num_warps=warps,
        )
    return out
