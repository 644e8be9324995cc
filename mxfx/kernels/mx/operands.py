"""The A operands of MX GEMMs that quantize passes make: ``(qdata, scales, values or None)``, ``values`` the
dequantized copy an emulated GEMM reads (written by the same pass), None where the GEMM runs natively.

:func:`quantize_operand` (rowwise), :func:`quantize_dual_operand` (both orientations from one read), and
:func:`a_operand`, the choice between a quantize op and its twin that also writes the values, which the SwiGLU
(:mod:`mxfx.kernels.mx.swiglu_operand`) and route-weight quantizes share.
"""

from __future__ import annotations

from typing import Callable

import torch

from mxfx.kernels.mx import custom_ops


def quantize_operand(x: torch.Tensor, rule: str, values: torch.dtype | None):
    """Rowwise MX of a GEMM's A operand: ``(qdata [..., K], scales [..., K/32], x_hat or None)``.

    ``values``: the dtype an emulated GEMM reads its operands in (:func:`mxfx.kernels.mx.gemm.emulation_dtype`),
    None for a native one. With it the same pass also writes ``x_hat`` = dequant(qdata, scales) in that dtype
    (``mxfx::quantize_dequantize``): pass it to :func:`mxfx.kernels.mx.custom_ops.mx_mm` /
    :func:`~mxfx.kernels.mx.custom_ops.mx_grouped_mm` as ``a_dequantized`` and the GEMM reads it instead of
    dequantizing A again. Without it ``x_hat`` is None. Same values either way.
    """
    return a_operand(values, custom_ops.quantize, custom_ops.quantize_dequantize, x, rule)


def a_operand(values: torch.dtype | None, quantize: Callable, quantize_with_values: Callable, x: torch.Tensor, *args):
    """The A operand of a GEMM made by a quantize pass over ``x``: ``(qdata, scales, values or None)``.

    ``quantize(x, *args) -> (qdata, scales)`` for a native GEMM (``values`` None);
    ``quantize_with_values(x, *args, values) -> (qdata, scales, dequantized)``, the same pass also writing
    the dequantized values in dtype ``values``, for an emulated one (pass them on as ``a_dequantized``). Used by
    :func:`quantize_operand`, the fused SwiGLU and route-weight quantizes.
    """
    if values is not None:
        return quantize_with_values(x, *args, values)
    return (*quantize(x, *args), None)


def quantize_dual_operand(x: torch.Tensor, rule: str, values: torch.dtype | None):
    """Both orientations of ``x [M, K]`` as operands of dense GEMMs, from one read:
    ``(q_row, s_row, row_hat, q_col, s_col, col_hat)``.

    The rowwise operand is blocked along K (``[M, K]``, a dgrad's A); the columnwise one down M
    (``[K, M]``, a wgrad's A). For emulated GEMMs (``values``: the dtype they read,
    :func:`~mxfx.kernels.mx.gemm.emulation_dtype`)
    the pass writes only the dequantized values of both, in that dtype, and the MX pairs are None
    (``mxfx::quantize_dual_dequantized``: the GEMMs read nothing else, and no dequantize pass
    follows); ``col_hat`` is then the transpose view of an ``[M, K]`` tensor. For native MX GEMMs (``values``
    None) the MX pairs come back and the ``*_hat`` are None, both scale matrices in the blocked layout the
    native GEMM reads (``mxfx::quantize_dual_blocked``; 1D, not to be sliced: zero token rows padded in get scale
    byte 0, the layout's own padding). Same values either way. M and K must be multiples of 32 (pad the tokens
    first).

    Raises:
        ValueError: x not 2D/3D, or M or K not a multiple of 32.
        TypeError: x not a bf16/fp16/fp32 tensor.
    """
    if values is not None:
        row_hat, col_hat = custom_ops.quantize_dual_dequantized(x, rule, values)
        return None, None, row_hat, None, None, col_hat.transpose(-2, -1)
    q, s, qt, st = custom_ops.quantize_dual_blocked(x, rule)
    return q, s, None, qt, st, None
