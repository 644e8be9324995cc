"""MXFP8 linear: like ``F.linear``, but forward, dgrad and (optionally) wgrad run as MX GEMMs.

Operands are blocked along each GEMM's reduction dim (format_spec.md):

* forward ``Y = MX(X) . MX(W)^T``: X rowwise (along K), W rowwise (along K).
* dgrad ``dX = MX(dY) . MX(W)``: dY rowwise (along N), W quantized down its
  columns (along N) from W itself, not the forward copy transposed.
* wgrad ``dW = MX(dY)^T . MX(X)``: both blocked along tokens (M, zero-padded to a
  multiple of 32), or a BF16 GEMM when ``wgrad="bf16"``.

Saved for backward: with ``wgrad="mxfp8"`` only the token-blocked MX copy of X
(33/32 bytes per value instead of BF16's 2), produced in the same read as the
forward's rowwise copy; with ``wgrad="bf16"`` the compute-dtype X. The weight
(a parameter, alive anyway) is saved by reference. Bias gradients are summed in
fp32. Accumulation is fp32 throughout.

Under autocast the output has the autocast dtype (as ``F.linear`` would) while
X is quantized from its own values (no extra rounding to bf16 first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxfx.kernels import ops as kops
from mxfx.ops.gemm import hp_mm_t, mx_mm


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """Zero-pad dim 0 to a multiple of 32 (zero rows add nothing to a token-reduction GEMM)."""
    return F.pad(t, (0, 0, 0, (-t.shape[0]) % 32))


def _quantize_weight(weight: torch.Tensor, rule: str, orientation: str):
    """Weight operand: "forward" = W [N, K] blocked along K; "dgrad" = W^T [K, N] blocked along N."""
    w = weight if orientation == "forward" else weight.t()
    return kops.quantize(w, rule)


class _MXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, out_dtype, rule, wgrad):
        m = x2d.shape[0]
        if wgrad == "mxfp8":
            xq, xs, xq_t, xs_t = kops.quantize_dual(_pad_tokens(x2d), rule)
            xq, xs = xq[:m], xs[:m]
            ctx.save_for_backward(weight, xq_t, xs_t)
        else:
            xq, xs = kops.quantize(x2d, rule)
            ctx.save_for_backward(weight, x2d.to(out_dtype))
        wq, ws = _quantize_weight(weight, rule, "forward")
        y = mx_mm(xq, xs, wq, ws, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.meta = (m, x2d.dtype, bias is not None, rule, wgrad)
        return y

    @staticmethod
    def backward(ctx, dy):
        m, x_dtype, has_bias, rule, wgrad = ctx.meta
        weight, *saved = ctx.saved_tensors
        dy = dy.contiguous()
        mx_wgrad = wgrad == "mxfp8" and ctx.needs_input_grad[1]
        if mx_wgrad:  # dY rowwise for dgrad and token-blocked for wgrad, from one read
            dyq, dys, dyq_t, dys_t = kops.quantize_dual(_pad_tokens(dy), rule)
            dyq, dys = dyq[:m], dys[:m]
        else:
            dyq, dys = kops.quantize(dy, rule)
        dx = None
        if ctx.needs_input_grad[0]:
            wq_t, ws_t = _quantize_weight(weight, rule, "dgrad")
            dx = mx_mm(dyq, dys, wq_t, ws_t, x_dtype)
        dw = None
        if mx_wgrad:
            xq_t, xs_t = saved
            dw = mx_mm(dyq_t, dys_t, xq_t, xs_t, weight.dtype)
        elif ctx.needs_input_grad[1]:
            (x_saved,) = saved
            dw = hp_mm_t(dy.t(), x_saved.t(), weight.dtype)
        db = dy.float().sum(0).to(weight.dtype) if has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


def mx_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scale_rule: str = "rceil",
    wgrad: str = "mxfp8",
) -> torch.Tensor:
    """MXFP8 ``F.linear``: ``x [..., K] . weight [N, K]^T (+ bias [N])`` -> ``[..., N]``.

    Args:
        x: bf16/fp16/fp32 input of any leading shape; K a multiple of 32.
        weight: ``[N, K]`` (fp32 main weight or bf16); N a multiple of 32.
        bias: optional ``[N]``.
        scale_rule: "rceil" or "floor".
        wgrad: "mxfp8" (token-blocked MX GEMM) or "bf16".

    Returns:
        ``[..., N]`` in the autocast dtype if autocast is on, else ``x.dtype``.

    Raises:
        ValueError: K or N not a multiple of 32 (keep such a linear in BF16).
    """
    n, k = weight.shape
    if k % 32 or n % 32 or x.shape[-1] != k:
        raise ValueError(
            f"mxfx.mx_linear: input {tuple(x.shape)} and weight {tuple(weight.shape)} need matching in_features "
            f"and in/out features that are multiples of 32; pad the layer or keep it in BF16"
        )
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    with torch.autocast(dev, enabled=False):
        y = _MXLinear.apply(x.reshape(-1, k), weight, bias, out_dtype, scale_rule, wgrad)
    return y.reshape(*x.shape[:-1], n)
