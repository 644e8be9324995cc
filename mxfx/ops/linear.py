"""MXFP8 linear: like ``F.linear``, but forward, dgrad and (optionally) wgrad run as MX GEMMs.

Operands are blocked along each GEMM's reduction dim (``docs/format.md``):

* forward ``Y = MX(X) . MX(W)^T``: X rowwise (along K), W rowwise (along K).
* dgrad ``dX = MX(dY) . MX(W)``: dY rowwise (along N), W quantized down its
  columns (along N) from W itself, not the forward copy transposed.
* wgrad ``dW = MX(dY)^T . MX(X)``: both blocked along tokens (M, zero-padded to a
  multiple of 32), or a BF16 GEMM when ``wgrad="bf16"``.

Saved for backward (``save``, decided by the pass per the recipe, "Smaller Saved Activations", "Dense and Shared-Expert Linears"):
``"mxfp8"`` keeps only an MX copy of X (33/32 bytes per value instead of BF16's
2): token-blocked for an MX wgrad (made in the same read as the forward's
rowwise copy), or the forward's rowwise copy, dequantized for a BF16 wgrad.
``"bf16"`` keeps a reference to X itself, for inputs another op keeps alive
anyway (an MX copy would add memory, not replace it). The weight (a parameter)
is saved by reference. With a SwiGLU input (``up``), gate and up are saved per
``save`` and the SwiGLU backward runs in fp32 (:mod:`mxfx.ops.swiglu`). Bias
gradients are summed in fp32; accumulation is fp32 throughout.

Under autocast the output has the autocast dtype (as ``F.linear`` would) while
X is quantized from its own values (no extra rounding to bf16 first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxfx.runtime.cache import weight_operands
from mxfx.kernels import custom_ops
from mxfx.ops import swiglu
from mxfx.ops.block import block_linear
from mxfx.kernels.device import emulated_operand_dtype
from mxfx.ops.gemm import hp_mm_transposed, mx_mm, quantize_dual_operand, quantize_operand
from mxfx.ops.settings import MXSettings, resolve


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """Zero-pad dim 0 to a multiple of 32 (zero rows add nothing to a token-reduction GEMM)."""
    return F.pad(t, (0, 0, 0, (-t.shape[0]) % 32))


class _MXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, up, weight, bias, out_dtype, settings: MXSettings):
        m = x2d.shape[0]
        rule, wgrad, save = settings.scale_rule, settings.wgrad, settings.save
        packed = ()
        x_hat = None  # dequant(xq, xs) from the quantize pass itself (emulated GEMMs), else None
        if up is not None:
            # SwiGLU: fused rowwise quantize for the GEMM, writing the saved gate/up pairs in the same pass
            xq, xs, x_hat, packed = swiglu.quantize_input_and_pack(x2d, up, save, rule)
            if wgrad == "mxfp8":  # the token-blocked copy from the fp32 product
                kind, wgrad_input = "mx_tokens", custom_ops.quantize(_pad_tokens(swiglu.swiglu_fp32(x2d, up)).t(), rule)
            else:  # BF16 wgrad from the forward's own rowwise MX copy
                kind, wgrad_input = "mx_rows", (xq, xs)
        elif wgrad == "mxfp8" and save == "mxfp8":
            # Rowwise for the forward GEMM and token-blocked for wgrad, from one read. Native MX GEMMs get
            # both scale matrices in their blocked layout from the pass itself. Those are not cut to m rows:
            # the padded zero rows have scale byte 0, which is the layout's own padding.
            native = emulated_operand_dtype("mm", x2d.device) is None
            xq, xs, xq_t, xs_t = (custom_ops.quantize_dual_blocked if native else custom_ops.quantize_dual)(_pad_tokens(x2d), rule)
            xq, xs = xq[:m], (xs if native else xs[:m])
            kind, wgrad_input = "mx_tokens", (xq_t, xs_t)
        else:
            xq, xs, x_hat = quantize_operand(x2d, rule)
            if save == "bf16":  # the input stays alive elsewhere: keep a reference
                kind, wgrad_input = ("hp_tokens" if wgrad == "mxfp8" else "hp"), (x2d,)
            else:  # BF16 wgrad from the forward's own rowwise MX copy
                kind, wgrad_input = "mx_rows", (xq, xs)
        wq, ws, w_dequantized = weight_operands(weight, rule, "forward", settings.keep_dequantized_weights)
        y = mx_mm(xq, xs, wq, ws, out_dtype, w_dequantized, x_hat)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(weight, *wgrad_input, *packed)
        ctx.settings, ctx.rows, ctx.x_dtype, ctx.out_dtype = settings, m, x2d.dtype, out_dtype
        ctx.has_bias, ctx.has_up, ctx.wgrad_kind, ctx.n_wgrad_inputs = bias is not None, up is not None, kind, len(wgrad_input)
        return y

    @staticmethod
    def backward(ctx, dy):
        m, x_dtype, kind, n_wgrad, rule = ctx.rows, ctx.x_dtype, ctx.wgrad_kind, ctx.n_wgrad_inputs, ctx.settings.scale_rule
        weight, *saved = ctx.saved_tensors
        wgrad_input, packed = saved[:n_wgrad], tuple(saved[n_wgrad:])
        dy = dy.contiguous()
        need_dw = ctx.needs_input_grad[2]
        mx_wgrad = need_dw and kind in ("mx_tokens", "hp_tokens")
        dyt_hat = None
        if mx_wgrad:  # dY rowwise for dgrad and token-blocked for wgrad, from one read
            dyq, dys, dy_hat, dyq_t, dys_t, dyt_hat = quantize_dual_operand(_pad_tokens(dy), rule)
            # the first m token rows; scales in the blocked layout (native GEMMs) stay whole, see above
            dyq, dys, dy_hat = (t if t is None or t.dim() == 1 else t[:m] for t in (dyq, dys, dy_hat))
        else:
            dyq, dys, dy_hat = quantize_operand(dy, rule)
        dx = dup = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            wq_t, ws_t, w_dequantized = weight_operands(weight, rule, "dgrad", ctx.settings.keep_dequantized_weights)
            dh = mx_mm(dyq, dys, wq_t, ws_t, x_dtype, w_dequantized, dy_hat)
            if ctx.has_up:
                dx, dup = (t.to(x_dtype) for t in swiglu.backward(dh, packed))
            else:
                dx = dh
        dw = None
        if mx_wgrad:
            if kind == "hp_tokens":
                wgrad_input = custom_ops.quantize(_pad_tokens(wgrad_input[0]).t(), rule)
            dw = mx_mm(dyq_t, dys_t, *wgrad_input, weight.dtype, None, dyt_hat)
        elif need_dw:
            x_saved = wgrad_input[0] if kind == "hp" else custom_ops.dequantize(*wgrad_input, ctx.out_dtype)
            dw = hp_mm_transposed(dy.t(), x_saved.t(), weight.dtype)
        db = dy.float().sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dx, dup, dw, db, None, None


def mx_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    up: torch.Tensor | None = None,
    input_dtype: torch.dtype | None = None,
    settings: MXSettings | None = None,
    **setting_fields,
) -> torch.Tensor:
    """MXFP8 ``F.linear``: ``x [..., K] . weight [N, K]^T (+ bias [N])`` -> ``[..., N]``.

    Args:
        x: bf16/fp16/fp32 input of any leading shape; K a multiple of 32. With
            ``up`` given, x is the SwiGLU gate and the input is ``silu(x) * up``.
        weight: ``[N, K]`` (fp32 main weight or bf16); N a multiple of 32.
        bias: optional ``[N]``.
        up: optional SwiGLU up operand, x's shape (fused SwiGLU + quantize).
        input_dtype: the dtype the linear's input had in the model, when it differs
            from ``x.dtype`` (a fused SwiGLU whose product the model cast, e.g.
            ``(silu(g) * u).to(torch.bfloat16)``): the output dtype follows it.
        settings, **setting_fields: an :class:`mxfx.ops.settings.MXSettings` and/or its fields by name
            (``scale_rule``, ``wgrad`` (default "mxfp8": token-blocked MX GEMM), ``save``,
            ``keep_dequantized_weights``, ``format``); fields given by name override ``settings``.
            ``format="fp8_block"`` runs :func:`mxfx.ops.block.block_linear` (K and N multiples of 128).

    Returns:
        ``[..., N]`` in the autocast dtype if autocast is on, else ``input_dtype or x.dtype``.

    Raises:
        ValueError: K or N not a multiple of 32 (keep such a linear in BF16), or a settings value
            not valid. TypeError: a keyword that is not a settings field.
    """
    settings = resolve("mxfx.mx_linear", settings, setting_fields, wgrad_default="mxfp8")
    n, k = weight.shape
    if k % 32 or n % 32 or x.shape[-1] != k or (up is not None and up.shape != x.shape):
        raise ValueError(
            f"mxfx.mx_linear: input {tuple(x.shape)} and weight {tuple(weight.shape)} need matching in_features "
            f"and in/out features that are multiples of 32; pad the layer or keep it in BF16"
        )
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else (input_dtype or x.dtype)
    if settings.format == "fp8_block":
        with torch.autocast(dev, enabled=False):
            return block_linear(x, weight, bias, up, out_dtype, settings)
    up2d = None if up is None else up.reshape(-1, k)
    with torch.autocast(dev, enabled=False):
        if not torch.is_grad_enabled():  # inference graph: the forward GEMM only, nothing saved
            xq, xs, x_hat = swiglu.quantize_input(x.reshape(-1, k), up2d, settings.scale_rule)
            wq, ws, w_dequantized = weight_operands(weight, settings.scale_rule, "forward", settings.keep_dequantized_weights)
            y = mx_mm(xq, xs, wq, ws, out_dtype, w_dequantized, x_hat)
            y = y if bias is None else y + bias.to(out_dtype)
            return y.reshape(*x.shape[:-1], n)
        y = _MXLinear.apply(x.reshape(-1, k), up2d, weight, bias, out_dtype, settings)
    return y.reshape(*x.shape[:-1], n)
