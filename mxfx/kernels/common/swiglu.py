"""The SwiGLU ``h = silu(gate) * up`` of every format: its FP32 product (the body of ``mxfx::swiglu_product``,
:func:`mxfx.kernels.common.custom_ops.swiglu_product`), and its FP32 backward.

A SwiGLU feeding a low-precision GEMM is quantized straight from gate and up by its format's fused kernel (the
forward operand). Where the GEMM's weight gradient is low precision too, its token-blocked operand is quantized
from that product, the same FP32 values: :func:`mxfx.kernels.common.silu.swiglu_fp32` on the CPU, the Triton
kernel on CUDA (:func:`mxfx.kernels.common.silu_triton.swiglu_product`, whose SiLU is the fused kernels' own), so
the forward and wgrad operands are quantized from one product, bit for bit.
"""

from __future__ import annotations

import torch

from mxfx.device import triton_available
from mxfx.kernels.common.silu import swiglu_fp32

_OP = "mxfx.swiglu_product"


def check_product(gate, up) -> None:
    """The checks of ``mxfx::swiglu_product`` (and its fake): floating tensors of one shape on one device."""
    if not (isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor)):
        raise TypeError(f"{_OP}: gate and up must be tensors, got {type(gate).__name__} and {type(up).__name__}")
    if not (gate.is_floating_point() and up.is_floating_point()):
        raise TypeError(f"{_OP}: gate ({gate.dtype}) and up ({up.dtype}) must be floating tensors")
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(
            f"{_OP}: gate of shape {tuple(gate.shape)} and up of shape {tuple(up.shape)} must be one [..., H] shape"
        )
    if gate.device != up.device:
        raise ValueError(f"{_OP}: gate on {gate.device} and up on {up.device}; move both to one device")


def fp32_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The body of ``mxfx::swiglu_product`` (:func:`mxfx.kernels.common.custom_ops.swiglu_product`): checked, then
    the Triton kernel on CUDA, :func:`mxfx.kernels.common.silu.swiglu_fp32` elsewhere."""
    check_product(gate, up)
    if triton_available(gate):
        from mxfx.kernels.common import silu_triton

        return silu_triton.swiglu_product(gate, up)
    return swiglu_fp32(gate, up)


def backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 gradients of ``silu(g) * u`` from ``dh`` and the values of gate and up (any float dtype):
    ``dg = dh * u * s * (1 + g (1 - s))``, ``du = dh * g * s``, s = sigmoid(g)."""
    g, u = gate.float(), up.float()
    s = torch.sigmoid(g)
    dh = dh.float()
    return dh * u * s * (1 + g * (1 - s)), dh * g * s
