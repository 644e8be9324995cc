"""Device-path selection for the MX kernels: Triton when the tensor is on CUDA, the reference otherwise.

The Triton modules (``mxfx.kernels.mx.quantize``, ``dual``, ``dequantize``, ``swiglu``) are
imported lazily, only once a CUDA tensor arrives and Triton imports, so
``import mxfx`` works on CPU-only installs without Triton. Both paths give the same
bytes (``tests/test_kernels.py``).
"""

from __future__ import annotations

import torch

from mxfx.numerics import mx as mxf
from mxfx.device import triton_available
from mxfx.kernels.mx.checks import TOKEN_DIM_HINT, check_dual_args, check_lastdim_args, check_route_args
from mxfx.kernels.common.silu import swiglu_fp32
from mxfx.kernels.mx.views import laid_out_as, lastdim_scales, mn_major
from mxfx.numerics.layout import blocked_numel, to_blocked


def quantize_lastdim(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantize along the last dim: ``x [..., K]`` -> ``(qdata e4m3 [..., K], scales u8 [..., K/32])``.

    Any strides: a transposed view quantizes "columnwise" without a copy on the GPU path. qdata is
    contiguous; scales are laid out by :func:`mxfx.kernels.mx.views.lastdim_scales` on every device
    (MN-major for an input strided along K).
    """
    if triton_available(x):
        from mxfx.kernels.mx import quantize as tq

        return tq.quantize_lastdim(x, rule)
    check_lastdim_args(x, rule, "mxfx.quantize")
    return _reference_lastdim(x, rule)


def _reference_lastdim(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``mxfx.numerics.mx.quantize_lastdim`` with the kernels' scale layout (:func:`lastdim_scales`)."""
    q, s = mxf.quantize_lastdim(x, rule)
    return q, laid_out_as(s, lastdim_scales(x))


def _mn_major(s: torch.Tensor) -> torch.Tensor:
    """``s``'s values stored MN-major (the dual quantizes' scale layout, :mod:`mxfx.kernels.mx.views`)."""
    return laid_out_as(s, mn_major(s.shape, s))


def quantize_blocked(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise quantize with scales in the blocked layout (:mod:`mxfx.numerics.layout`) of ``x.reshape(-1, K)``.

    Returns ``(qdata e4m3 [..., K], blocked uint8 [blocked_numel(rows, K/32)])``, padding zero.
    """
    if triton_available(x):
        from mxfx.kernels.mx import quantize as tq

        return tq.quantize_blocked(x, rule)
    check_lastdim_args(x, rule, "mxfx.quantize_blocked")
    q, s = mxf.quantize_lastdim(x, rule)
    return q, to_blocked(s.reshape(s.shape[:-1].numel(), s.shape[-1]))  # also with no rows or no scale columns


def dequantize_lastdim(qdata: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_lastdim`: ``qdata * 2^(scales - 127)`` cast to ``dtype``."""
    mxf.check_output_dtype(dtype, qdata, "mxfx.dequantize")
    if triton_available(qdata):
        from mxfx.kernels.mx import dequantize as tdq

        return tdq.dequantize_lastdim(qdata, scales, dtype)
    mxf.check_pair(qdata, scales, -1, "mxfx.dequantize")
    return mxf.dequantize_lastdim(qdata, scales, dtype)


def quantize_dual(x: torch.Tensor, rule: str):
    """Both orientations of a 2D ``x [M, K]`` from one read.

    Returns ``(q_row [M, K], s_row [M, K/32], q_col [K, M], s_col [K, M/32])``: the
    columnwise pair is blocked down dim 0, its qdata stored transposed (contiguous ``[K, M]``),
    i.e. exactly ``quantize_lastdim(x.t())``, layouts included. Both scale tensors are MN-major
    (transpose views of contiguous ``[K/32, M]`` / ``[M/32, K]`` tensors, :mod:`mxfx.kernels.mx.views`).
    A 3D ``[B, M, K]`` input is handled per batch.
    On every device: ValueError unless x is 2D/3D with M and K multiples of 32 (naming the
    shape), TypeError for a non-tensor or an unsupported dtype (:func:`mxfx.kernels.mx.checks.check_dual_args`).
    """
    if triton_available(x):
        from mxfx.kernels.mx import dual

        return dual.quantize_dual(x, rule)
    check_dual_args(x, rule, "mxfx.quantize_dual", hint=TOKEN_DIM_HINT)
    q_row, s_row = mxf.quantize_lastdim(x, rule)
    q_col, s_col = mxf.quantize_lastdim(x.transpose(-2, -1), rule)
    return q_row, _mn_major(s_row), q_col, _mn_major(s_col)


def quantize_dual_blocked(x: torch.Tensor, rule: str):
    """:func:`quantize_dual` with both scale matrices in the blocked layout of ``mxfx.numerics.layout``, as
    Blackwell MX GEMMs read them: ``(q_row [.., M, K], s_row [.., blocked_numel(M, K/32)], q_col [.., K, M],
    s_col [.., blocked_numel(K, M/32)])``, the scales ``to_blocked`` of quantize_dual's, per batch for a
    3D x (padding zero). One pass on CUDA, no ``to_blocked`` pass after it. Raises as :func:`quantize_dual`.
    """
    if triton_available(x):
        from mxfx.kernels.mx import dual

        return dual.quantize_dual_blocked(x, rule)
    check_dual_args(x, rule, "mxfx.quantize_dual_blocked", hint=TOKEN_DIM_HINT)
    q_row, s_row = mxf.quantize_lastdim(x, rule)
    q_col, s_col = mxf.quantize_lastdim(x.transpose(-2, -1), rule)

    def blocked(s):  # per batch; nothing to lay out (no batch, rows or columns) gives the empty layout, no stack
        if s.numel() == 0:
            return s.new_zeros((*s.shape[:-2], blocked_numel(*s.shape[-2:])))
        mats = s.reshape(-1, *s.shape[-2:])
        return torch.stack([to_blocked(m) for m in mats]).reshape(*s.shape[:-2], -1)

    return q_row, blocked(s_row), q_col, blocked(s_col)


def quantize_dual_source(
    x: torch.Tensor,
    rule: str,
    *,
    row: bool = True,
    col: bool = True,
    dequantized: torch.dtype | None = None,
    mx: bool = True,
):
    """Both orientations of ``x [M, K]`` (or ``[B, M, K]``) from one read, in the source layout
    (that of a contiguous x).

    Returns ``(q_row, s_row, h_row, q_col, s_col, h_col)``: the pairs of :func:`quantize_dual`
    (same values and scale layouts), but ``q_col [.., K, M]`` is the transpose view of a
    contiguous ``[.., M, K]`` tensor (the source layout); ``h_*`` are the
    dequantized values in ``dequantized`` (None without it); orientations not asked for are None,
    and so are the pairs with ``mx=False`` (the dequantized values alone, one read, no MX writes).
    Raises ValueError unless x is 2D/3D with M and K multiples of 32, when neither orientation
    is asked for, or with ``mx=False`` and no ``dequantized``; TypeError for an input dtype other than
    bf16/fp16/fp32 or a ``dequantized`` dtype that is not a float of 16+ bits
    (:func:`mxfx.kernels.mx.checks.check_dual_args`, the same on every device).
    """
    if triton_available(x):
        from mxfx.kernels.mx import dual

        return dual.quantize_dual_source(x, rule, row=row, col=col, dequantized=dequantized, mx=mx)
    check_dual_args(x, rule, "mxfx.quantize_dual_source", row=row, col=col, dequantized=dequantized, mx=mx)
    out = []
    for want, dim in ((row, -1), (col, -2)):
        if not want:
            out += [None, None, None]
            continue
        # columnwise blocked down M in x's own layout: qdata, scales and values come out as the contiguous
        # [.., M, K] / [.., M/32, K] tensors whose transpose views are the source layout, no transpose made
        q, s, h = mxf.quantize_blocks(x, rule, dim, dequantized)
        if dim == -1:
            s = _mn_major(s)
        else:
            q, s, h = q.transpose(-2, -1), s.transpose(-2, -1), (h.transpose(-2, -1) if h is not None else None)
        out += [q, s, h] if mx else [None, None, h]
    return tuple(out)


def quantize_dequantize(x: torch.Tensor, rule: str, dtype: torch.dtype):
    """Quantize along the last dim and also return the dequantized tensor: ``(qdata, scales, x_hat)``."""
    mxf.check_output_dtype(dtype, x, "mxfx.quantize_dequantize", name="input")
    if triton_available(x):
        from mxfx.kernels.mx import quantize as tq

        return tq.quantize_dequantize(x, rule, dtype)
    check_lastdim_args(x, rule, "mxfx.quantize_dequantize")
    q, s, h = mxf.quantize_blocks(x, rule, dequantized=dtype)
    return q, laid_out_as(s, lastdim_scales(x)), h


def _with_dequantized(x: torch.Tensor, rule: str, dtype: torch.dtype | None) -> tuple:
    """Rowwise reference quantize of ``x``: ``(q, s)``, or ``(q, s, x_hat)`` with ``dtype``, from one pass."""
    q, s, h = mxf.quantize_blocks(x, rule, dequantized=dtype)
    return (q, s) if dtype is None else (q, s, h)


def swiglu_quantize(
    gate: torch.Tensor, up: torch.Tensor, rule: str, dequantized: torch.dtype | None = None, save_inputs: bool = False
):
    """MX quantize of ``silu(gate) * up`` formed in fp32 (no 16-bit intermediate): ``(qdata, scales)``,
    or ``(qdata, scales, h_hat)`` with ``dequantized`` (h_hat = dequantize(qdata, scales) in that dtype,
    written by the same pass). With ``save_inputs``, the rowwise MX pairs of gate and of up follow,
    ``(gate_q, gate_s, up_q, up_s)``, from the same read (what the SwiGLU backward keeps).

    Raises:
        ValueError: gate and up of different shapes or on different devices, H not a multiple of 32, or
            an unknown rule. TypeError: an unsupported input or ``dequantized`` dtype.
    """
    if isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor) and gate.device != up.device:
        raise ValueError(f"mxfx.swiglu_quantize: gate on {gate.device} and up on {up.device}; move both to one device")
    if dequantized is not None:
        mxf.check_input(gate, "mxfx.swiglu_quantize")
        mxf.check_output_dtype(dequantized, gate, "mxfx.swiglu_quantize", name="gate")
    if triton_available(gate):
        from mxfx.kernels.mx import swiglu

        return swiglu.swiglu_quantize(gate, up, rule, dequantized, save_inputs)
    check_lastdim_args(gate, rule, "mxfx.swiglu_quantize")
    check_lastdim_args(up, rule, "mxfx.swiglu_quantize")
    if gate.shape != up.shape:
        raise ValueError(
            f"mxfx.swiglu_quantize: gate of shape {tuple(gate.shape)} and up of shape {tuple(up.shape)} must match"
        )
    out = _with_dequantized(swiglu_fp32(gate, up), rule, dequantized)
    return (*out, *mxf.quantize_lastdim(gate, rule), *mxf.quantize_lastdim(up, rule)) if save_inputs else out


def route_weight_quantize(dy: torch.Tensor, weight: torch.Tensor, rule: str, dequantized: torch.dtype | None = None):
    """MX quantize of ``dy [S, D] * weight [S, 1]`` formed in fp32 (combine backward, the recipe,
    "Kernel Problems and Fusions" (Table 25)): ``(qdata, scales)``, or with ``dequantized`` also the dequantized
    values from the same pass."""
    op = "mxfx.route_weight_quantize"
    mxf.check_input(dy, op)
    if dequantized is not None:
        mxf.check_output_dtype(dequantized, dy, op, name="dy")
    if triton_available(dy):
        from mxfx.kernels.mx import quantize as tq

        return tq.route_weight_quantize(dy, weight, rule, dequantized)
    check_route_args(dy, weight, op)
    check_lastdim_args(dy, rule, op)
    q, s, *h = _with_dequantized(dy.float() * weight.float().reshape(-1, 1), rule, dequantized)
    return (q, laid_out_as(s, lastdim_scales(dy)), *h)
