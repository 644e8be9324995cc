"""The SwiGLU ``h = silu(gate) * up`` of every format: its FP32 product as a graph op, and its FP32 backward.

A SwiGLU feeding a low-precision GEMM is quantized straight from gate and up by its format's fused kernel (the
forward operand). Where the GEMM's weight gradient is low precision too, its token-blocked operand is quantized
from :data:`product`, the same FP32 values: :func:`mxfx.kernels.common.silu.swiglu_fp32` on the CPU, the Triton
kernel on CUDA (:func:`mxfx.kernels.common.silu_triton.swiglu_product`, whose SiLU is the fused kernels' own), so
the forward and wgrad operands are quantized from one product, bit for bit.
"""

from __future__ import annotations

import torch

from mxfx.device import triton_available
from mxfx.kernels.common.launch import name_op_functions, op_or_body
from mxfx.kernels.common.silu import swiglu_fp32

_OP = "mxfx.swiglu_product"


def _check(gate, up) -> None:
    if not (isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor)):
        raise TypeError(f"{_OP}: gate and up must be tensors, got {type(gate).__name__} and {type(up).__name__}")
    if not (gate.is_floating_point() and up.is_floating_point()):
        raise TypeError(f"{_OP}: gate ({gate.dtype}) and up ({up.dtype}) must be floating tensors")
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(f"{_OP}: gate of shape {tuple(gate.shape)} and up of shape {tuple(up.shape)} must be one "
                         f"[..., H] shape")
    if gate.device != up.device:
        raise ValueError(f"{_OP}: gate on {gate.device} and up on {up.device}; move both to one device")


def _product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    if triton_available(gate):
        from mxfx.kernels.common import silu_triton

        return silu_triton.swiglu_product(gate, up)
    return swiglu_fp32(gate, up)


@torch.library.custom_op("mxfx::swiglu_product", mutates_args=())
def _product_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _product(gate, up)


@_product_op.register_fake
def _(gate, up):
    _check(gate, up)
    return gate.new_empty(gate.shape, dtype=torch.float32)


product = op_or_body(_product_op, _product, """``silu(gate) * up`` in fp32 with mxfx's SiLU: ``gate, up [..., H]``
(same shape and device, any float dtypes and strides) -> a contiguous fp32 ``[..., H]``, the values the fused
SwiGLU quantizes read (``mxfx::swiglu_product``).

Raises:
    TypeError: gate or up not a floating tensor. ValueError: different shapes or devices, or a 0-d gate.""")

name_op_functions(globals())


def backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 gradients of ``silu(g) * u`` from ``dh`` and the values of gate and up (any float dtype):
    ``dg = dh * u * s * (1 + g (1 - s))``, ``du = dh * g * s``, s = sigmoid(g)."""
    g, u = gate.float(), up.float()
    s = torch.sigmoid(g)
    dh = dh.float()
    return dh * u * s * (1 + g * (1 - s)), dh * g * s
