"""Triton MXFP8 quantize along the last dim, with optional fused prologue/epilogue.

One kernel, four host entry points:

* :func:`quantize_lastdim`: rowwise; a transposed view quantizes columnwise and
  writes the transposed layout (``quantize_lastdim(x.t())`` -> ``[K, M]``).
* :func:`quantize_blocked`: rowwise with scales written straight into the blocked
  layout of :mod:`mxfx.numerics.layout`.
* :func:`quantize_dequantize`: also writes ``x_hat`` = dequantize(q, s) in one pass.
* :func:`route_weight_quantize`: quantizes ``dy * weight[:, None]`` formed in fp32.

Bit-identical to ``mxfx.numerics.mx.quantize_lastdim`` (OCP MX v1.0 §6.3, mxfx rules).
Token counts change every call, so no launch may specialize on them beyond a
fixed key: rowwise, R (tokens) is not specialized at all; for a transposed input
(columnwise), the tokens are C, a multiple of 32 (always "divisible by 16"), and R
is the fixed model dim, kept specialized so the loads along it vectorize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.mx.checks import check_route_args
from mxfx.kernels.common.launch import launch
from mxfx.numerics.mx import check_block_axis, check_input, check_rule
from mxfx.kernels.mx.blocks import (
    CONVERT_ALL,
    CONVERT_BF16X2,
    SCALES_BLOCKED,
    SCALES_MN_MAJOR,
    SCALES_ROW_MAJOR,
    as_brc,
    conversion_bits,
    encode_blocks,
    flat_blocks,
    load_tile,
    store_dequantized,
    store_rowwise,
    tile_origin,
)
from mxfx.kernels.mx.views import mn_major_storage_shape, mn_major_view, scale_shape
from mxfx.numerics.layout import new_blocked_scales

FLAT_CONFIG = (64, 32, 2)
"""(BLOCK_R, BLOCK_C, num_warps) for contiguous inputs seen as a stream of 32-value blocks:
BLOCK_R blocks per program."""
ROWWISE_CONFIG = (16, 256, 8)
"""(BLOCK_R, BLOCK_C, num_warps) for strided rows with stride 1 along C (a row slice, say)."""
BLOCKED_CONFIG = (128, 128, 4)
"""(BLOCK_R, BLOCK_C, num_warps) with scales in the blocked layout, or None to stream blocks (FLAT_CONFIG):
128 rows by 4 scale columns are one whole 512-byte tile of that layout."""
COLWISE_CONFIG = (128, 32, 1)
"""(BLOCK_R, BLOCK_C, num_warps) for inputs strided along C (a transposed view, columnwise): 128 rows
(the model dim) by one block of 32 tokens, read as 32 runs of 256 bytes; the MN-major scales go out as one
128-byte line per program (``MXFX_BENCH_SWEEP=columnwise python bench/kernels.py``)."""
COLWISE_EVEN = True
"""Columnwise, drop the masks when the tiles divide the view (COLWISE_CONFIG, or FLAT_CONFIG for 32 tokens);
a fixed boolean key, as token counts are multiples of 32 there (measured: docs/kernel-notes.md, "Kernel choices")."""

CONVERSION_FORMS = {"quantize": CONVERT_ALL, "blocked": CONVERT_BF16X2, "dequantized": CONVERT_BF16X2}
"""Conversion forms (``blocks.CONVERT_*`` bits) by output: the plain quantize (rowwise, columnwise, route-weight)
takes both, the blocked-scale and the quantize-dequantize passes only the bf16 widening
(measured: docs/kernel-notes.md, "Kernel choices")."""


def _quantize(
    x_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    xhat_ptr,
    R,
    C,
    RPR,
    sxb,
    sxr,
    sxc,
    swr,
    n_c_tiles,
    RCEIL: tl.constexpr,
    ROW_WEIGHT: tl.constexpr,
    WRITE_XHAT: tl.constexpr,
    SCALES: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    EVEN: tl.constexpr,
    CONVERT: tl.constexpr,
):
    b, r0, c0 = tile_origin(n_c_tiles, BR, BC)
    v = load_tile(x_ptr, b, r0, c0, R, C, sxb, sxr, sxc, BR, BC, EVEN, CONVERT=CONVERT)
    if ROW_WEIGHT:
        rows = r0 + tl.arange(0, BR)
        w = tl.load(w_ptr + (rows // RPR).to(tl.int64) * swr, mask=rows < R, other=0.0).to(tl.float32)
        v = v * w[:, None]
    qbits, sbyte = encode_blocks(tl.reshape(v, [BR, BC // 32, 32]), 2, RCEIL, CONVERT)
    store_rowwise(q_ptr, s_ptr, qbits, sbyte, b, r0, c0, R, C, RPR, SCALES, BR, BC, EVEN)
    if WRITE_XHAT:
        store_dequantized(xhat_ptr, qbits, sbyte, b, r0, c0, R, C, BR, BC)


_quantize_kernel = triton.jit(do_not_specialize=["R"])(_quantize)
"""Stride 1 along C: R counts tokens (or blocks), never specialized."""
_quantize_kernel_t = triton.jit(_quantize)
"""Strided along C: C counts tokens (a multiple of 32, so one key); R is a model dim, kept
specialized so loads along it vectorize."""


def _launch(x, rule, *, weight=None, xhat_dtype=None, blocked=False, op="mxfx.quantize"):
    check_input(x, op)
    check_rule(rule, op)
    check_block_axis(x.shape, -1, op)
    x3, rpr = (as_brc(x), 1) if blocked and BLOCKED_CONFIG else flat_blocks(as_brc(x))
    B, R, C = x3.shape
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    # scales MN-major for a (2D+) input whose view is strided along C, as views.lastdim_scales says; the kernel
    # gets their contiguous storage, the caller its view (made after the launch)
    mn_major = not blocked and x.dim() >= 2 and x3.stride(2) != 1
    if blocked:
        s = new_blocked_scales(B * R // rpr, rpr * C // 32, device=x.device)  # padding zeroed
    else:
        shape = mn_major_storage_shape(x, (B, R, C)) if mn_major else scale_shape(x.shape)
        s = torch.empty(shape, dtype=torch.uint8, device=x.device)
    # unused pointer arguments get the (read-only) input, so no output buffer is passed twice
    xhat = torch.empty(x.shape, dtype=xhat_dtype, device=x.device) if xhat_dtype is not None else x3
    w = weight if weight is not None else x3
    rowwise = x3.stride(2) == 1
    if blocked and BLOCKED_CONFIG:
        br, bc, warps = BLOCKED_CONFIG
    elif rpr > 1 or C == 32:
        br, bc, warps = FLAT_CONFIG
    else:
        br, bc, warps = ROWWISE_CONFIG if rowwise else COLWISE_CONFIG
    n_c = triton.cdiv(C, bc)
    even = COLWISE_EVEN and not rowwise and not blocked and R % br == 0 and C % bc == 0
    if R * C > 0:
        launch(
            _quantize_kernel if rowwise else _quantize_kernel_t,
            (triton.cdiv(R, br) * n_c, B),
            x3,
            w,
            q,
            s,
            xhat,
            R,
            C,
            rpr,
            *x3.stride(),
            w.stride(0) if weight is not None else 0,
            n_c,
            RCEIL=rule == "rceil",
            ROW_WEIGHT=weight is not None,
            WRITE_XHAT=xhat_dtype is not None,
            SCALES=(SCALES_BLOCKED if blocked else SCALES_MN_MAJOR if mn_major else SCALES_ROW_MAJOR).value,
            BR=br,
            BC=bc,
            EVEN=even,
            num_warps=warps,
            CONVERT=conversion_bits(
                CONVERSION_FORMS["blocked" if blocked else "dequantized" if xhat_dtype is not None else "quantize"]
            ),
        )
    if mn_major:
        s = mn_major_view(s, scale_shape(x.shape))
    return q.view(torch.float8_e4m3fn), s, (xhat if xhat_dtype is not None else None)


def quantize_lastdim(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` (CUDA, bf16/fp16/fp32, any strides) -> ``(q e4m3 [..., K], s uint8 [..., K/32])``.

    q is contiguous; s is laid out by :func:`mxfx.kernels.mx.views.lastdim_scales`: row-major, or MN-major
    for an input strided along K (a transposed view: the columnwise operand).
    """
    q, s, _ = _launch(x, rule)
    return q, s


def quantize_blocked(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`quantize_lastdim`, scales in the blocked layout of ``x.reshape(-1, K)``'s scale matrix.

    Returns ``(q [..., K], s_blocked uint8 [blocked_numel(rows, K/32)])``, padding zero.
    """
    op = "mxfx.quantize_blocked"
    check_input(x, op)  # before x.shape[-1]: a 0-D x gets the checks' message
    check_block_axis(x.shape, -1, op)
    rows = x.shape[:-1].numel()
    if x.numel() == 0:  # no rows or K = 0: empty qdata, and the (empty or all-padding) blocked layout
        return (
            torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            new_blocked_scales(rows, x.shape[-1] // 32, device=x.device),
        )
    q, s, _ = _launch(x.reshape(rows, x.shape[-1]), rule, blocked=True, op=op)
    return q.view(x.shape), s


def quantize_dequantize(x: torch.Tensor, rule: str, dtype: torch.dtype):
    """``x [..., K]`` -> ``(q, s, x_hat)`` in one pass; ``x_hat`` = dequantize(q, s) as ``dtype``."""
    return _launch(x, rule, xhat_dtype=dtype, op="mxfx.quantize_dequantize")


def route_weight_quantize(dy: torch.Tensor, weight: torch.Tensor, rule: str, dequantized: torch.dtype | None = None):
    """Quantize ``dy [S, D] * weight [S] (or [S, 1])`` formed in fp32 -> ``(q [S, D], s [S, D/32])``;
    with ``dequantized``, ``(q, s, x_hat)``, x_hat = dequantize(q, s) in that dtype, from the same pass."""
    check_route_args(dy, weight, "mxfx.route_weight_quantize")
    q, s, hat = _launch(dy, rule, weight=weight.reshape(-1), xhat_dtype=dequantized, op="mxfx.route_weight_quantize")
    return (q, s) if dequantized is None else (q, s, hat)
