"""Triton MXFP8 quantize along the last dim, with optional fused prologue/epilogue.

One kernel, four host entry points:

* :func:`quantize_lastdim`: rowwise; a transposed view quantizes columnwise and
  writes the transposed layout (``quantize_lastdim(x.t())`` -> ``[K, M]``).
* :func:`quantize_blocked`: rowwise with scales written straight into the blocked
  layout of :mod:`mxfx.layout`.
* :func:`quantize_dequantize`: also writes ``x_hat`` = dequantize(q, s) in one pass.
* :func:`route_weight_quantize`: quantizes ``dy * weight[:, None]`` formed in fp32.

Bit-identical to ``mxfx.format.quantize_lastdim`` (OCP MX v1.0 §6.3, mxfx rules).
Only R (the row count, e.g. tokens) varies freely between calls and it is not
specialized; C and the strides are multiples of 32 (or 1) for every valid input, so
their specialization key does not change with the token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.mx_block import as_brc, decode_scale, encode_blocks, load_tile, scale_shape, store_rowwise
from mxfx.layout import blocked_numel

# (BLOCK_R, BLOCK_C, num_warps): contiguous input rows (stride along C is 1).
ROWWISE_CONFIG = (16, 256, 8)
# Input strided along C (a transposed view): tiles square enough to read along R and write along C.
COLWISE_CONFIG = (64, 64, 4)


@triton.jit(do_not_specialize=["R"])
def _quantize_kernel(
    x_ptr, w_ptr, q_ptr, s_ptr, xhat_ptr,
    R, C, sxb, sxr, sxc, swr,
    RCEIL: tl.constexpr, ROW_WEIGHT: tl.constexpr, WRITE_XHAT: tl.constexpr, BLOCKED: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr,
):
    r0 = tl.program_id(0) * BR
    c0 = tl.program_id(1) * BC
    b = tl.program_id(2)
    v = load_tile(x_ptr, b, r0, c0, R, C, sxb, sxr, sxc, BR, BC)
    if ROW_WEIGHT:
        rows = r0 + tl.arange(0, BR)
        w = tl.load(w_ptr + rows.to(tl.int64) * swr, mask=rows < R, other=0.0).to(tl.float32)
        v = v * w[:, None]
    qbits, sbyte = encode_blocks(tl.reshape(v, [BR, BC // 32, 32]), 2, RCEIL)
    store_rowwise(q_ptr, s_ptr, qbits, sbyte, b, r0, c0, R, C, BLOCKED, BR, BC)
    if WRITE_XHAT:
        xq = qbits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * decode_scale(sbyte)[:, :, None]
        ar = tl.arange(0, BR)
        ac = tl.arange(0, BC)
        base = xhat_ptr + (b.to(tl.int64) * R + r0) * C + c0
        mask = ((r0 + ar) < R)[:, None] & ((c0 + ac) < C)[None, :]
        tl.store(base + ar[:, None] * C + ac[None, :],
                 tl.reshape(xq, [BR, BC]).to(xhat_ptr.dtype.element_ty), mask=mask)


def _launch(x, rule, *, weight=None, xhat_dtype=None, blocked=False):
    x3 = as_brc(x)
    B, R, C = x3.shape
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if blocked:
        s = torch.zeros(blocked_numel(B * R, C // 32), dtype=torch.uint8, device=x.device)
    else:
        s = torch.empty(scale_shape(x.shape), dtype=torch.uint8, device=x.device)
    xhat = torch.empty(x.shape, dtype=xhat_dtype, device=x.device) if xhat_dtype is not None else q
    w = weight if weight is not None else x3
    br, bc, warps = ROWWISE_CONFIG if x3.stride(2) == 1 else COLWISE_CONFIG
    grid = (triton.cdiv(R, br), triton.cdiv(C, bc), B)
    if R * C > 0:
        _quantize_kernel[grid](
            x3, w, q, s, xhat, R, C, *x3.stride(), w.stride(0) if weight is not None else 0,
            RCEIL=rule == "rceil", ROW_WEIGHT=weight is not None, WRITE_XHAT=xhat_dtype is not None,
            BLOCKED=blocked, BR=br, BC=bc, num_warps=warps,
        )
    return q.view(torch.float8_e4m3fn), s, (xhat if xhat_dtype is not None else None)


def quantize_lastdim(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` (CUDA, bf16/fp16/fp32, any strides) -> ``(q e4m3 [..., K], s uint8 [..., K/32])``, contiguous."""
    q, s, _ = _launch(x, rule)
    return q, s


def quantize_blocked(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`quantize_lastdim`, scales in the blocked layout of ``x.reshape(-1, K)``'s scale matrix.

    Returns ``(q [..., K], s_blocked uint8 [blocked_numel(rows, K/32)])``, padding zero.
    """
    x2 = x.reshape(-1, x.shape[-1])
    q, s, _ = _launch(x2, rule, blocked=True)
    return q.view(x.shape), s


def quantize_dequantize(x: torch.Tensor, rule: str, dtype: torch.dtype):
    """``x [..., K]`` -> ``(q, s, x_hat)`` in one pass; ``x_hat`` = dequantize(q, s) as ``dtype``."""
    return _launch(x, rule, xhat_dtype=dtype)


def route_weight_quantize(dy: torch.Tensor, weight: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``dy [S, D] * weight [S] (or [S, 1])`` formed in fp32 -> ``(q [S, D], s [S, D/32])``."""
    q, s, _ = _launch(dy, rule, weight=weight.reshape(-1))
    return q, s
