"""The SwiGLU input side of an MX GEMM: ``h = silu(gate) * up`` fused with its quantization.

When a SwiGLU feeds an MX linear or grouped GEMM, the GEMM's input operand is
quantized straight from gate and up (``mxfx::swiglu_quantize``): no BF16 ``h``
is written (the recipe, "Kernel Problems and Fusions", Table 25). The backward is computed in fp32 from the
saved gate and up, which are stored in MXFP8 (rowwise, 33/32 bytes per value,
as the recipe's fused routed path does) or in their own dtype, per the policy's
``save`` precision (:func:`pack`, read back by :func:`unpack` for :func:`mxfx.kernels.common.swiglu.backward`).
"""

from __future__ import annotations

import torch

from mxfx.kernels.mx import custom_ops
from mxfx.kernels.mx.operands import a_operand, quantize_operand


def quantize_input(x: torch.Tensor, up: torch.Tensor | None, rule: str, values: torch.dtype | None) -> tuple:
    """Rowwise MX of a GEMM's input: ``(qdata, scales, x_hat or None)``.

    ``x`` itself through :func:`mxfx.kernels.mx.operands.quantize_operand`, or ``silu(x) * up`` with the fused
    SwiGLU quantize when ``up`` is given; with ``values`` (the dtype an emulated GEMM reads) either pass also
    writes the dequantized form in it (:func:`mxfx.kernels.mx.operands.a_operand`).
    """
    if up is None:
        return quantize_operand(x, rule, values)
    return a_operand(values, custom_ops.swiglu_quantize, custom_ops.swiglu_quantize_dequantize, x, up, rule)


def quantize_input_and_pack(
    x: torch.Tensor, up: torch.Tensor, save: str, rule: str, values: torch.dtype | None
) -> tuple:
    """:func:`quantize_input` of ``silu(x) * up`` and :func:`pack` of gate ``x`` and ``up``.

    Args:
        x, up: gate and up ``[..., H]`` (bf16/fp16/fp32, same shape, any strides; H a multiple of 32).
        save: "mxfp8" | "bf16", how backward keeps gate and up; rule: "rceil" | "floor";
        values: the dtype the GEMM reads its operands in where it is emulated, None where it runs natively.

    Returns:
        ``(qdata e4m3 [..., H], scales uint8 [..., H/32], x_hat or None, packed)``: the GEMM's A operand
        (x_hat its values in dtype ``values``) and what :func:`unpack` reads.
        With ``save="mxfp8"`` one pass reads gate and up once and writes the operand and both saved MX
        pairs (``mxfx::swiglu_quantize_save``, or ``..._dequantize_save`` with ``values``): the
        same bytes as three separate passes (OCP MX v1.0 §6.3 blocks, ``mxfx.numerics.mx`` rules).

    Raises:
        TypeError / ValueError: as :func:`mxfx.kernels.mx.device_path.swiglu_quantize` (dtype, shapes, rule).
    """
    if save != "mxfp8":
        return (*quantize_input(x, up, rule, values), pack(x, up, save, rule))
    if values is None:
        q, s, *packed = custom_ops.swiglu_quantize_save(x, up, rule)
        return q, s, None, tuple(packed)
    q, s, x_hat, *packed = custom_ops.swiglu_quantize_dequantize_save(x, up, rule, values)
    return q, s, x_hat, tuple(packed)


def pack(gate: torch.Tensor, up: torch.Tensor, save: str, rule: str) -> tuple:
    """What backward keeps of gate/up: MX pairs (``save="mxfp8"``) or the tensors themselves."""
    if save == "mxfp8":
        return (*custom_ops.quantize(gate, rule), *custom_ops.quantize(up, rule))
    return (gate, up)


def unpack(saved: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`, as fp32 tensors (on CUDA graphs decoded inside the backward's fused kernel): the gate
    and up that :func:`mxfx.kernels.common.swiglu.backward` reads."""
    if len(saved) == 4:
        gq, gs, uq, us = saved
        return custom_ops.dequantize_fusible(gq, gs, torch.float32), custom_ops.dequantize_fusible(
            uq, us, torch.float32
        )
    gate, up = saved
    return gate.float(), up.float()
