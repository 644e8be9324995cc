"""Torch custom ops (namespace ``mxfx``) around the MX kernels, with fake implementations.

Graphs hold these ops opaquely, so Inductor neither fuses them into slow
dynamic-shape code nor trips over E8M0 dtypes: scales are uint8 E8M0 bytes here.
Each op blocks along the last dimension of its input.
"""

from __future__ import annotations

import torch

from mxfx import kernels
from mxfx.format import BLOCK_SIZE

_E4M3 = torch.float8_e4m3fn


def _scale_shape(shape) -> list:
    return [*shape[:-1], shape[-1] // BLOCK_SIZE]


@torch.library.custom_op("mxfx::quantize", mutates_args=())
def quantize(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> ``(qdata e4m3 [..., K], scales uint8 [..., K/32])``."""
    return kernels.quantize_lastdim(x, rule)


@quantize.register_fake
def _(x, rule):
    return x.new_empty(x.shape, dtype=_E4M3), x.new_empty(_scale_shape(x.shape), dtype=torch.uint8)


@torch.library.custom_op("mxfx::dequantize", mutates_args=())
def dequantize(qdata: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(qdata [..., K], scales [..., K/32])`` -> ``[..., K]`` of ``dtype``."""
    return kernels.dequantize_lastdim(qdata, scales, dtype)


@dequantize.register_fake
def _(qdata, scales, dtype):
    return qdata.new_empty(qdata.shape, dtype=dtype)


@torch.library.custom_op("mxfx::quantize_dual", mutates_args=())
def quantize_dual(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> rowwise ``(q [M, K], s [M, K/32])`` and columnwise ``(q [K, M], s [K, M/32])``."""
    return kernels.quantize_dual(x, rule)


@quantize_dual.register_fake
def _(x, rule):
    t = x.shape[:-2] + (x.shape[-1], x.shape[-2])
    return (
        x.new_empty(x.shape, dtype=_E4M3),
        x.new_empty(_scale_shape(x.shape), dtype=torch.uint8),
        x.new_empty(t, dtype=_E4M3),
        x.new_empty(_scale_shape(t), dtype=torch.uint8),
    )


@torch.library.custom_op("mxfx::quantize_dequantize", mutates_args=())
def quantize_dequantize(x: torch.Tensor, rule: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> ``(qdata, scales, x_hat)`` with ``x_hat`` the dequantized ``dtype`` tensor."""
    return kernels.quantize_dequantize(x, rule, dtype)


@quantize_dequantize.register_fake
def _(x, rule, dtype):
    return (
        x.new_empty(x.shape, dtype=_E4M3),
        x.new_empty(_scale_shape(x.shape), dtype=torch.uint8),
        x.new_empty(x.shape, dtype=dtype),
    )


@torch.library.custom_op("mxfx::swiglu_quantize", mutates_args=())
def swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantize of ``silu(gate) * up`` (fp32 product): ``gate, up [..., H]`` -> ``(q [..., H], s [..., H/32])``."""
    return kernels.swiglu_quantize(gate, up, rule)


@swiglu_quantize.register_fake
def _(gate, up, rule):
    return gate.new_empty(gate.shape, dtype=_E4M3), gate.new_empty(_scale_shape(gate.shape), dtype=torch.uint8)


@torch.library.custom_op("mxfx::route_weight_quantize", mutates_args=())
def route_weight_quantize(dy: torch.Tensor, weight: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantize of ``dy [S, D] * weight [S]`` (fp32 product), the combine-backward gradient."""
    return kernels.route_weight_quantize(dy, weight, rule)


@route_weight_quantize.register_fake
def _(dy, weight, rule):
    return dy.new_empty(dy.shape, dtype=_E4M3), dy.new_empty(_scale_shape(dy.shape), dtype=torch.uint8)


@torch.library.custom_op("mxfx::quantize_blocked", mutates_args=())
def quantize_blocked(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> ``(qdata e4m3 [..., K], blocked uint8 scales)``: the scale matrix of
    ``x.reshape(-1, K)`` in the blocked layout of :mod:`mxfx.layout` (rows padded to 128,
    scale columns to 4, padding zero), as Blackwell block-scaled GEMMs consume it."""
    from mxfx.kernels.dispatch import quantize_blocked as impl

    return impl(x, rule)


@quantize_blocked.register_fake
def _(x, rule):
    from mxfx.layout import blocked_numel

    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    return x.new_empty(x.shape, dtype=_E4M3), x.new_empty(blocked_numel(rows, x.shape[-1] // BLOCK_SIZE), dtype=torch.uint8)
