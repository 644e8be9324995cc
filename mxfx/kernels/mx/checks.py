"""Argument checks of the MX kernels, made the same way on every device (Triton and reference paths)."""

from __future__ import annotations

import torch

from mxfx.numerics import mx as mxf

TOKEN_DIM_HINT = " (the token dim, for activations)"


def check_lastdim_args(x, rule: str, op: str) -> None:
    """Checks of an op blocked along the last dim: a bf16/fp16/fp32 tensor, a known rule, the last dim a
    multiple of 32."""
    mxf.check_input(x, op)
    mxf.check_rule(rule, op)
    mxf.check_block_axis(x.shape, -1, op)


def check_dual_args(
    x,
    rule: str,
    op: str,
    *,
    row: bool = True,
    col: bool = True,
    dequantized: torch.dtype | None = None,
    mx: bool = True,
    hint: str = "",
) -> torch.Tensor:
    """Checks of the dual (both-orientation) quantizes; returns x as ``[B, M, K]``.

    Raises:
        TypeError: x not a bf16/fp16/fp32 tensor, or ``dequantized`` not a floating dtype of 16+ bits.
        ValueError: neither orientation asked for, neither the MX pairs nor the dequantized values
            asked for (``mx=False`` without ``dequantized``), an unknown rule, or x not 2D/3D with M
            and K multiples of 32 (see :func:`mxfx.numerics.mx.check_both_axes`).
    """
    if not (row or col):
        raise ValueError(f"{op}: asked for no orientation (row=False, col=False); ask for at least one orientation")
    if not mx and dequantized is None:
        raise ValueError(f"{op}: asked for no output (mx=False, dequantized=None); pass a dequantized dtype or mx=True")
    x3 = mxf.check_both_axes(x, rule, op, hint)
    if dequantized is not None:
        mxf.check_output_dtype(dequantized, x, op, name="x")
    return x3


def check_route_args(dy: torch.Tensor, weight, op: str) -> None:
    """Raise ValueError naming ``op`` unless ``dy`` is ``[S, D]`` and ``weight`` a tensor of S values
    ([S] or [S, 1])."""
    if not isinstance(weight, torch.Tensor) or dy.dim() != 2 or weight.numel() != dy.shape[0]:
        raise ValueError(
            f"{op}: expected dy [S, D] and weight [S] or [S, 1], got dy of shape {tuple(dy.shape)} and weight "
            f"of shape {tuple(getattr(weight, 'shape', ()))}"
        )
