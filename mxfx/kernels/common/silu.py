"""mxfx's fp32 SiLU, the one every SwiGLU + quantize path computes: ``silu(g) = g / (1 + exp(-g))``.

It is PyTorch's CUDA ``F.silu`` on fp32 (libdevice ``expf``, then an IEEE division) on every input but
one band: finite gates ``g <= SILU_FLUSH_GATE`` (-87.3365...), where ``1 + exp(-g)`` exceeds 2^126, give
-0. There ``F.silu`` gives values of magnitude below 2^-119 (and -0 itself below -88.7228, once exp
overflows). The quantized value is ``silu(g) * up``: a flushed entry differs from eager's only where the
rest of its block is small enough for that product to survive, within E4M3's range of 2^17 below the
block's largest value (an ``up`` of 2^100 next to ordinary values, say), never in a training run's
activations. The flush lets the GPU kernel divide with a
hardware reciprocal, one Newton step and one correction, without ``div.rn``'s per-value range check and
slow-path branch (measured: docs/kernel-notes.md, "Kernel choices")
(``python -m bench.probes.silu_exhaustive`` checks the kernel's SiLU against this rule on all 2^32 fp32 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SILU_FLUSH_GATE = -87.3365478515625
"""The largest fp32 gate (bits 0xC2AEAC50) whose ``1 + expf(-g)`` exceeds 2^126: the reciprocal of
the divisor is below fp32's smallest normal, and mxfx's SiLU gives -0 for it and every finite gate below."""


def silu_fp32(g: torch.Tensor) -> torch.Tensor:
    """mxfx's SiLU of ``g`` (any shape) in fp32: ``F.silu(g.float())``, with -0 for finite
    ``g <= SILU_FLUSH_GATE`` (the module docstring says why). The CPU reference of the fused kernels."""
    g = g.float()
    flush = (g <= SILU_FLUSH_GATE) & g.isfinite()
    return torch.where(flush, torch.full_like(g, -0.0), F.silu(g))


def swiglu_fp32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU product ``silu(gate) * up`` in fp32 with mxfx's SiLU: ``silu_fp32(gate) * up.float()``. The CPU
    reference of every fused SwiGLU quantize (what their forward operands are quantized from) and of
    :func:`mxfx.kernels.common.custom_ops.swiglu_product` (what the wgrad operands are quantized from)."""
    return silu_fp32(gate).mul_(up.float())
