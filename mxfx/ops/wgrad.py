"""An op's weight gradient: its wgrad GEMM's result returned to autograd, or written by the GEMM into the parameter's
``.grad`` (``OpSettings.fuse_wgrad_accumulation``, :mod:`mxfx.runtime.main_grad`).

The GEMM is the format's low-precision wgrad (``low_precision``: :meth:`mxfx.formats.base.Format.wgrad_mm` /
:meth:`~mxfx.formats.base.Format.grouped_wgrad` on the format's token-blocked operands) or the BF16 one of the
high-precision operands ``dy [M, N]`` and ``x [M, K]`` (:mod:`mxfx.kernels.common.custom_ops`), dense or grouped by
``offs``. Fused, the op ``mxfx::wgrad_into_grad`` runs it in the backward graph: opaque, marked side-effectful
so that no dead-code elimination drops it (its result is the parameter's ``.grad``, which no graph output carries),
resolving the parameter when it runs.
"""

from __future__ import annotations

import torch

from mxfx import formats, library
from mxfx.kernels.common.custom_ops import hp_grouped_wgrad, hp_grouped_wgrad_into, hp_mm_into, hp_mm_transposed
from mxfx.ops.settings import OpSettings
from mxfx.runtime import main_grad


def _gemm(fmt, dy, x, offs, low_precision: bool, out_dtype: torch.dtype) -> torch.Tensor:
    if low_precision:
        return fmt.wgrad_mm(dy, x, out_dtype) if offs is None else fmt.grouped_wgrad(dy, x, offs, out_dtype)
    if offs is None:
        return hp_mm_transposed(dy[0].t(), x[0].t(), out_dtype)
    return hp_grouped_wgrad(dy[0], x[0], offs, out_dtype)


def _gemm_into(fmt, dy, x, offs, low_precision: bool, out: torch.Tensor, accumulate: bool) -> None:
    if low_precision and offs is None:
        fmt.wgrad_mm_into(dy, x, out, accumulate)
    elif low_precision:
        fmt.grouped_wgrad_into(dy, x, offs, out, accumulate)
    elif offs is None:
        hp_mm_into(dy[0], x[0], out, accumulate)
    else:
        hp_grouped_wgrad_into(dy[0], x[0], offs, out, accumulate)


def _wgrad_into_grad(
    weight: torch.Tensor,
    dy: list[torch.Tensor | None],
    x: list[torch.Tensor | None],
    offs: torch.Tensor | None,
    format_name: str,
    low_precision: bool,
) -> None:
    """The wgrad GEMM of ``weight`` (as :func:`weight_gradient`) written into its parameter's ``.grad`` or added to
    it (:func:`mxfx.runtime.main_grad.target`); nothing where this backward accumulates into no such gradient."""
    t = main_grad.target(weight, "mxfx::wgrad_into_grad")
    if t is None:
        return
    with torch.autocast(weight.device.type, enabled=False):  # the GEMMs' own dtypes, whatever the backward's
        _gemm_into(formats.get(format_name), tuple(dy), tuple(x), offs, low_precision, t.out, t.accumulate)
    main_grad.finish(t)


wgrad_into_grad = library.define(
    "mxfx::wgrad_into_grad",
    "(Tensor weight, Tensor?[] dy, Tensor?[] x, Tensor? offs, str format_name, bool low_precision) -> ()",
    _wgrad_into_grad,
    lambda weight, dy, x, offs, format_name, low_precision: None,
)
"""The op of :func:`_wgrad_into_grad`, called once per fused weight and backward (:mod:`mxfx.library`)."""
# Kept in compiled backward graphs though it returns nothing (its result is the parameter's .grad); no effect token
# orders it: the gradient is read only after the backward, and Inductor's FX graph cache refuses graphs with tokens.
torch.fx.node.has_side_effect(wgrad_into_grad)


def weight_gradient(
    settings: OpSettings,
    weight: torch.Tensor,
    dy: tuple,
    x: tuple,
    offs: torch.Tensor | None = None,
    low_precision: bool = True,
) -> torch.Tensor | None:
    """The gradient of ``weight`` an op's backward returns: the wgrad GEMM (module docstring) in the weight's dtype,
    or None when ``settings.fuse_wgrad_accumulation``: the GEMM then writes the parameter's ``.grad`` itself.

    ``dy`` and ``x``: the format's token-blocked operands (``low_precision``), else ``(dy [M, N],)`` and
    ``(x [M, K],)`` in high precision; ``offs``: int32 group ends of a grouped (routed-expert) wgrad.
    """
    fmt = settings.format
    if not settings.fuse_wgrad_accumulation:
        return _gemm(fmt, dy, x, offs, low_precision, weight.dtype)
    wgrad_into_grad(weight, list(dy), list(x), offs, fmt.name, low_precision)
    return None
