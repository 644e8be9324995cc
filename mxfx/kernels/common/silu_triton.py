"""mxfx's SiLU in Triton (:func:`silu_f32`, the device function every fused SwiGLU kernel calls) and the kernel
of the FP32 SwiGLU product (:func:`swiglu_product`).

:func:`silu_f32` computes :func:`mxfx.kernels.common.silu.silu_fp32` bit for bit in compiled kernels
(``python -m bench.probes.silu_exhaustive`` checks all 2^32 fp32 inputs). Every kernel that forms
``silu(gate) * up`` does it as ``silu_f32(g) * u`` on the fp32 values of its loads, so the product is the same
bits in each of them: the fused MX and fp8_block SwiGLU quantizes and :func:`swiglu_product`, which writes it
for the wgrad operands (:mod:`mxfx.kernels.common.swiglu`). Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mxfx.kernels.common.launch import INTERPRETED, launch
from mxfx.kernels.common.silu import SILU_FLUSH_GATE


if INTERPRETED:  # the interpreter has no libdevice expf: numpy's, which may differ from it by an ulp

    @triton.jit
    def exp_f32(v):
        """e^v in fp32."""
        return tl.exp(v)

else:

    @triton.jit
    def exp_f32(v):
        """e^v in fp32 with libdevice ``expf``, the function PyTorch's CUDA kernels call (not Triton's
        approximate ``tl.exp``)."""
        return libdevice.exp(v)


FLT_MAX = tl.constexpr(3.4028234663852886e38)
SILU_FLUSH_GATE_C = tl.constexpr(SILU_FLUSH_GATE)


@triton.jit
def rcp_approx_ftz(d):
    """MUFU reciprocal of fp32 ``d`` (``rcp.approx.ftz.f32``, the first step of ``div.rn.f32``; compiled
    kernels only): results below 2^-126 flush to +0 for positive d."""
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True, pack=1)


if INTERPRETED:

    @triton.jit
    def silu_f32(g):
        """mxfx's SiLU (``mxfx.kernels.common.silu``) with an IEEE division, then the flush band's -0."""
        s = tl.math.div_rn(g, 1.0 + exp_f32(-g))
        zero = g * 0.0  # -0 for a finite negative g (a literal -0.0 is 0 - 0.0 = +0 in Triton 3.6)
        flush = (g <= SILU_FLUSH_GATE_C) & (zero == 0.0)  # finite g in the band
        return tl.where(flush, zero, s)

else:

    @triton.jit
    def silu_f32(g):
        """mxfx's SiLU (``mxfx.kernels.common.silu``): ``g / (1 + exp(-g))`` as ``div.rn.f32``'s fast path computes
        it (approximate reciprocal, one Newton step, one quotient correction), without its range check and
        slow-path branch; a gate of +Inf gives +Inf, as ``F.silu``. The divisor is clamped at FLT_MAX (no
        ``inf * 0`` NaN once exp overflows), so
        where its reciprocal flushes to +0 (divisor above 2^126) the correction ``q - r * (d * q - g)``
        gives -0 for every finite g. Negations are written as products with -1.0: Triton 3.6 lowers a
        unary minus to ``0 - x``, which turns -(+0) into +0 (the flush band's zero positive) and costs an
        FADD per negation, where ``x * -1.0`` folds into the FFMA's operand sign."""
        ng = g * -1.0
        d = tl.minimum(1.0 + exp_f32(ng), FLT_MAX)
        r = rcp_approx_ftz(d)
        r = tl.fma(r, tl.fma(d * -1.0, r, 1.0), r)
        q = g * r
        s = tl.fma(r * -1.0, tl.fma(d, q, ng), q)
        return tl.where(g > FLT_MAX, g, s)  # +Inf: the correction's Inf - Inf would give NaN


PRODUCT_CONFIG = (32, 128, 4)
"""(BLOCK_R, BLOCK_C, num_warps) of :func:`swiglu_product`: a plain elementwise pass."""


@triton.jit(do_not_specialize=["R"])
def _swiglu_product_kernel(g_ptr, u_ptr, out_ptr, R, C, sgr, sgc, sur, suc, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (r < R)[:, None] & (c < C)[None, :]
    rows = r.to(tl.int64)[:, None]
    g = tl.load(g_ptr + rows * sgr + c[None, :] * sgc, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * sur + c[None, :] * suc, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * C + c[None, :], silu_f32(g) * u, mask=mask)


def swiglu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu_f32(gate) * up`` in fp32: ``gate, up [..., H]`` (CUDA, same shape, any strides and float dtypes) ->
    a new contiguous fp32 ``[..., H]``. Shapes and devices are checked by the caller
    (:func:`mxfx.kernels.common.custom_ops.swiglu_product`)."""
    out = torch.empty(gate.shape, dtype=torch.float32, device=gate.device)
    h = gate.shape[-1] if gate.dim() else 1
    g2, u2 = gate.reshape(-1, h), up.reshape(-1, h)  # views for a gate_up tensor's halves, copies where none exists
    rows = g2.shape[0]
    br, bc, warps = PRODUCT_CONFIG
    if rows * h > 0:
        launch(
            _swiglu_product_kernel,
            (triton.cdiv(rows, br), triton.cdiv(h, bc)),
            g2,
            u2,
            out,
            rows,
            h,
            *g2.stride(),
            *u2.stride(),
            BR=br,
            BC=bc,
            num_warps=warps,
        )
    return out
