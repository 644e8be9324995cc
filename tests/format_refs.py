"""Plain-torch reference decodes of each format's GEMM operands, for the op tests parametrized over formats.

``act(fmt, t, axis, rule)``: ``t`` quantized along ``axis`` as that format quantizes an activation or gradient
(MXFP8: blocks of 32; fp8_block: 1x128 tiles; bf16_gemm: each value rounded to BF16), dequantized to float32.
``weight(fmt, w, axis, rule)``: a weight ``[..., N, K]`` as its cached GEMM operand reads it, blocked along ``axis``
(-1: the forward's K, -2: the dgrad's N) (MXFP8: blocks of 32 along that axis; fp8_block: one 128x128 grid, the same
values both ways). ``pad``: the tokens a token-blocked wgrad operand is zero-padded to (zero rows add nothing to the
product).
"""

import torch
import torch.nn.functional as F

import mxfx
from mxfx.numerics import block as bf

FORMATS = ("mxfp8", "fp8_block", "bf16_gemm")
RULES = {"mxfp8": ("rceil", "floor"), "fp8_block": ("rceil", "amax"), "bf16_gemm": ("rceil",)}
TOKEN_PAD = {"mxfp8": 32, "fp8_block": 1, "bf16_gemm": 1}
OUT_RTOL = {"mxfp8": 1e-4, "fp8_block": 1e-4, "bf16_gemm": 8e-3}
"""Relative tolerance of an FP32-output GEMM against the reference: summation order (K <= 384 terms), and for
bf16_gemm on the CPU its BF16 result (a 2^-8 relative rounding)."""


def act(fmt: str, t: torch.Tensor, axis: int, rule: str) -> torch.Tensor:
    if fmt == "bf16_gemm":  # no scales: the BF16 rounding of each value
        return t.bfloat16().float()
    if fmt == "mxfp8":
        q, s = mxfx.quantize(t, axis=axis, rule=rule)
        return mxfx.dequantize(q, s, axis=axis, dtype=torch.float32)
    q, s = bf.quantize_1x128(t, axis=axis, rule=rule)
    return bf.dequantize_1x128(q, s, axis=axis, dtype=torch.float32)


def weight(fmt: str, w: torch.Tensor, axis: int, rule: str) -> torch.Tensor:
    if fmt in ("mxfp8", "bf16_gemm"):
        return act(fmt, w, axis, rule)
    return bf.dequantize_128x128(*bf.quantize_128x128(w, rule), dtype=torch.float32)


def tokens(fmt: str, t: torch.Tensor, rule: str) -> torch.Tensor:
    """``t [M, D]`` quantized along its tokens (dim 0) as a wgrad operand, padded as the format pads, cut back to M."""
    m = t.shape[0]
    if m == 0:
        return t.float()
    padded = F.pad(t, (0, 0, 0, (-m) % TOKEN_PAD[fmt]))
    return act(fmt, padded, 0, rule)[:m]
