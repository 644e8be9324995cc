"""Low-precision linear: like ``F.linear``, but forward, dgrad and (optionally) wgrad run as GEMMs of the op's
format (:mod:`mxfx.formats`), the operands made and multiplied by that format.

* forward ``Y = Q(X) . Q(W)^T``; dgrad ``dX = Q(dY) . Q(W^T)^T`` (the weight's cached forms, from the FP32 main
  weight once per optimizer step); wgrad ``dW = Q(dY)^T . Q(X)`` with both operands blocked along the tokens,
  or a BF16 GEMM when ``wgrad="bf16"``.

Saved for backward (``save``, decided by the pass per the recipe, "Smaller Saved Activations", "Dense and
Shared-Expert Linears"): ``"mxfp8"`` keeps only a low-precision copy of X: token-blocked for a low-precision
wgrad (made in the same read as the forward's rowwise copy), or the forward's rowwise copy, dequantized for a
BF16 wgrad. ``"bf16"`` keeps a reference to X itself, for inputs another op keeps alive anyway. A frozen weight
keeps and quantizes nothing for a wgrad. The weight (a parameter) is saved by reference. With a SwiGLU input
(``up``), gate and up are saved per ``save`` and the SwiGLU backward runs in fp32. Bias gradients are summed
in fp32; accumulation is fp32 throughout.

Under autocast the output has the autocast dtype (as ``F.linear`` would) while X is quantized from its own
values (no extra rounding to bf16 first).

Linears reading one input (q, k and v projections) can share its quantize: :func:`mx_linear_input` makes X's
operands once and each :func:`mx_linear` takes them as ``x_mx`` (:mod:`mxfx.passes.shared_quantize`); a token-blocked
copy saved by several of them is then one tensor.
"""

from __future__ import annotations

import torch

from mxfx.numerics.mx import INPUT_DTYPES
from mxfx.ops.settings import OpSettings, resolve
from mxfx.ops.wgrad import weight_gradient

# what a linear keeps for its wgrad: nothing (frozen weight), X by reference for a BF16 wgrad ("hp") or a
# low-precision one quantized in backward ("hp_tokens"), X's token-blocked operand ("tokens"), or the forward's
# rowwise operand, dequantized for a BF16 wgrad ("rows")
_KINDS = ("none", "hp", "hp_tokens", "tokens", "rows")


def _observe_forward(settings: OpSettings, x, up, a, weight, w, x_tokens, kind: str = "linear") -> None:
    """Statistics of a forward's quantizes (:meth:`OpSettings.observe`): the input ``x`` (``silu(x) * up`` with
    ``up``) against its A operand ``a`` and its token-blocked wgrad operand ``x_tokens`` (when made), the weight
    against its forward form ``w``."""
    source, combine = ((x,), "") if up is None else ((x, up), "swiglu")
    settings.observe(kind, "forward_x", "rows", source, a, combine)
    settings.observe(kind, "forward_w", "weight", (weight,), w)
    if x_tokens is not None:
        settings.observe(kind, "wgrad_x", "tokens", source, x_tokens, combine)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, up, weight, bias, out_dtype, dgrad_dtype, settings: OpSettings, given):
        fmt, rule, wgrad, save = settings.format, settings.scale_rule, settings.wgrad, settings.save
        need_dw = ctx.needs_input_grad[2]
        keep_x = need_dw and save == "bf16" and up is None  # x stays alive elsewhere: keep a reference
        tokens = need_dw and wgrad == "mxfp8" and not keep_x
        if given is None:
            a, x_tokens, packed = fmt.forward_operands(x2d, up, rule, save, tokens)
        else:  # x's operands made once for every linear reading it (mx_linear_input)
            if tokens and given[1] is None:
                raise ValueError(
                    f"mxfx.mx_linear: x_mx for x {tuple(x2d.shape)} holds no token-blocked operand, and "
                    f"this linear's {fmt.name} wgrad reads one: make it with mx_linear_input(x, "
                    f"tokens=True)"
                )
            (a, x_tokens), packed = (given[0], given[1] if tokens else None), ()
        w = fmt.weight_operand(weight, rule, "forward", settings.keep_dequantized_weights)
        _observe_forward(settings, x2d, up, a, weight, w, x_tokens)
        y = fmt.mm(a, w, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        if not need_dw:
            kind, wgrad_input = "none", ()
        elif keep_x:
            kind, wgrad_input = ("hp_tokens" if wgrad == "mxfp8" else "hp"), (x2d,)
        elif tokens:
            kind, wgrad_input = "tokens", x_tokens
        else:
            kind, wgrad_input = "rows", fmt.saved_rows(a)
        ctx.save_for_backward(weight, *wgrad_input, *packed)
        ctx.settings, ctx.x_dtype, ctx.out_dtype, ctx.kind, ctx.n_wgrad = (
            settings,
            x2d.dtype,
            out_dtype,
            kind,
            len(wgrad_input),
        )
        ctx.bias_dtype, ctx.has_up, ctx.dgrad_dtype = None if bias is None else bias.dtype, up is not None, dgrad_dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        settings, kind = ctx.settings, ctx.kind
        fmt, rule = settings.format, settings.scale_rule
        weight, *saved = ctx.saved_tensors
        wgrad_input, packed = tuple(saved[: ctx.n_wgrad]), tuple(saved[ctx.n_wgrad :])
        dy = dy.contiguous()
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dy_tokens = kind in ("tokens", "hp_tokens")  # set by the forward only where the weight needs a gradient
        dy_rows, dy_t = fmt.grad_operands(dy, rule, rows=need_dx, tokens=dy_tokens)
        if dy_rows is not None:
            settings.observe("linear", "dgrad_dy", "rows", (dy,), dy_rows)
        if dy_t is not None:
            settings.observe("linear", "wgrad_dy", "tokens", (dy,), dy_t)
        dx = dup = dw = db = None
        if need_dx:
            w = fmt.weight_operand(weight, rule, "dgrad", settings.keep_dequantized_weights)
            dh = fmt.mm(dy_rows, w, ctx.dgrad_dtype)
            if ctx.has_up:
                dx, dup = (t.to(ctx.x_dtype) for t in fmt.swiglu_backward(dh, packed))
            else:
                dx = dh.to(ctx.x_dtype)  # widened where the dgrad GEMM ran at the autocast dtype
        if ctx.needs_input_grad[2]:
            if dy_tokens:
                x_tokens = wgrad_input
                if kind == "hp_tokens":
                    x_tokens = fmt.tokens_operand(wgrad_input[0], rule)
                    settings.observe("linear", "wgrad_x", "tokens", wgrad_input, x_tokens)
                dw = weight_gradient(settings, weight, dy_t, x_tokens)
            else:
                x_saved = wgrad_input[0] if kind == "hp" else fmt.dequantize(wgrad_input, ctx.out_dtype)
                dw = weight_gradient(settings, weight, (dy,), (x_saved,), low_precision=False)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            db = dy.float().sum(0).to(ctx.bias_dtype)
        return dx, dup, dw, db, None, None, None, None


def _rows(operand) -> int:
    """Rows of an operand's first 2-D tensor (qdata, or the values alone; blocked scales are 1-D); -1 without one."""
    tensors = operand if isinstance(operand, (tuple, list)) else ()
    return next((t.shape[0] for t in tensors if isinstance(t, torch.Tensor) and t.dim() == 2), -1)


def mx_linear_input(
    x: torch.Tensor, *, tokens: bool = False, settings: OpSettings | None = None, **setting_fields
) -> tuple:
    """The operands :func:`mx_linear` makes of its input ``x``, made once for several linears reading it (``x_mx``).

    Args:
        x: bf16/fp16/fp32 input of any leading shape, K (its last dim) a multiple of the format's
            ``feature_multiple``. Its values are read, never its gradient: the operands require none.
        tokens: also make the token-blocked operand a low-precision wgrad reads (from the same read where the
            format has that kernel).
        settings, **setting_fields: as :func:`mx_linear`'s; only ``format`` and ``scale_rule`` are read.

    Returns:
        ``(rows, tokens or None)``: the forward GEMM's A operand of ``x`` reshaped to ``[M, K]`` and, with
        ``tokens``, its token-blocked wgrad operand; tuples of the format's tensors, the same bytes as
        :func:`mx_linear` makes of ``x`` itself.

    Raises:
        ValueError: K not a multiple of the format's feature multiple, or a settings value not valid.
    """
    op = "mxfx.mx_linear_input"
    settings = resolve(op, settings, setting_fields, wgrad_default="mxfp8")
    fmt, k = settings.format, x.shape[-1]
    fmt.check_features(op, k, fmt.feature_multiple)
    with torch.autocast(x.device.type, enabled=False):
        a, x_tokens, _ = fmt.forward_operands(x.detach().reshape(-1, k), None, settings.scale_rule, "mxfp8", tokens)
    return a, x_tokens


def mx_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    up: torch.Tensor | None = None,
    input_dtype: torch.dtype | None = None,
    x_mx: tuple | None = None,
    settings: OpSettings | None = None,
    **setting_fields,
) -> torch.Tensor:
    """Low-precision ``F.linear``: ``x [..., K] . weight [N, K]^T (+ bias [N])`` -> ``[..., N]``.

    Args:
        x: bf16/fp16/fp32 input of any leading shape. With ``up`` given, x is the SwiGLU gate and the input
            is ``silu(x) * up``.
        weight: ``[N, K]`` (fp32 main weight or bf16); K and N multiples of the format's ``feature_multiple``
            (32 for MXFP8, 128 for fp8_block).
        bias: optional ``[N]`` (or ``[1, N]``, as ``F.linear`` broadcasts it; its gradient comes in its shape).
        up: optional SwiGLU up operand, x's shape (fused SwiGLU + quantize).
        input_dtype: the dtype the linear's input had in the model, when it differs from ``x.dtype`` (a fused
            SwiGLU whose product the model cast, e.g. ``(silu(g) * u).to(torch.bfloat16)``): the output dtype
            follows it.
        settings, **setting_fields: an :class:`mxfx.ops.settings.OpSettings` and/or its fields by name
            (``format`` (default MXFP8), ``scale_rule``, ``wgrad`` (default "mxfp8": token-blocked
            low-precision GEMM), ``save``, ``keep_dequantized_weights``, ``stats`` / ``stats_every``: quantization
            statistics of sites ``<stats>/linear/<direction>``, :mod:`mxfx.runtime.stats`,
            ``fuse_wgrad_accumulation``: the wgrad GEMM writes the weight's ``.grad`` itself, :mod:`mxfx.ops.wgrad`);
            fields given by name override ``settings``.

    Returns:
        ``[..., N]`` in the autocast dtype if autocast is on, else ``input_dtype or x.dtype``. x's gradient is in
        x's dtype; for an FP32 x under autocast it holds the dgrad GEMM's result in the autocast dtype, as
        ``F.linear``'s autocast input cast gives it.

    Raises:
        ValueError: shapes that do not pair up (a weight not ``[N, K]``, a bias not ``[N]``), K or N not a multiple
            of the format's feature multiple (keep such a linear in BF16), a settings value not valid, or an ``x_mx``
            that is not a pair of x's rows (or lacks the token-blocked operand this linear's wgrad reads).
            TypeError: a keyword that is not a settings field; an ``input_dtype``, input or weight not bf16/fp16/fp32.
    """
    op = "mxfx.mx_linear"
    settings = resolve(op, settings, setting_fields, wgrad_default="mxfp8")
    fmt = settings.format
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        what = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{op}: weight must be a floating [N, K] tensor (F.linear's layout); got {what}")
    if weight.dtype not in INPUT_DTYPES or not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        what = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(
            f"{op}: input ({what}) and weight ({weight.dtype} {tuple(weight.shape)}) must be bfloat16, float16 or "
            "float32 tensors (the weight cache is made from the weight); cast them first"
        )
    n, k = weight.shape
    if bias is not None:
        if (
            not isinstance(bias, torch.Tensor)
            or not bias.is_floating_point()
            or bias.numel() != n
            or (bias.dim() > 0 and bias.shape[-1] != n)
        ):
            what = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(
                f"{op}: bias must be a floating [N] = [{n}] tensor for weight {tuple(weight.shape)}; got {what}"
            )
        bias = bias.reshape(n)  # a [1, N] bias (which F.linear broadcasts) gets its gradient in its own shape
    if input_dtype is not None and input_dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{op}: input_dtype={input_dtype!r} (input {tuple(x.shape)}) must be torch.bfloat16, "
            "torch.float16, torch.float32 or None"
        )
    if x.shape[-1] != k or (up is not None and up.shape != x.shape):
        raise ValueError(
            f"{op}: input {tuple(x.shape)}{'' if up is None else f', up {tuple(up.shape)}'} and weight "
            f"{tuple(weight.shape)} [N, K] do not pair up: x needs K = {k} features (and up x's shape)"
        )
    fmt.check_features(op, k, n)
    dev = x.device.type
    autocast = torch.is_autocast_enabled(dev)
    out_dtype = torch.get_autocast_dtype(dev) if autocast else (input_dtype or x.dtype)
    # under autocast an FP32 input's gradient comes from the dgrad GEMM at the autocast dtype, widened after, as
    # through F.linear's autocast input cast (not an FP32 result of twice the bytes)
    dgrad_dtype = out_dtype if autocast and x.dtype == torch.float32 and up is None else x.dtype
    x2d = x.reshape(-1, k)
    up2d = None if up is None else up.reshape(-1, k)
    if x_mx is not None and (
        up is not None or not isinstance(x_mx, (tuple, list)) or len(x_mx) != 2 or _rows(x_mx[0]) != x2d.shape[0]
    ):
        raise ValueError(
            f"{op}: x_mx must be the pair (rows, tokens or None) mx_linear_input makes of x "
            f"{tuple(x.shape)} ({x2d.shape[0]} rows), and cannot be combined with a SwiGLU up operand"
        )
    if x_mx is not None:
        fmt.check_input_operand(f"{op} (x_mx)", x_mx[0], x2d)
    with torch.autocast(dev, enabled=False):
        if torch.is_grad_enabled():
            y = _Linear.apply(x2d, up2d, weight, bias, out_dtype, dgrad_dtype, settings, x_mx)
        else:  # inference graph: the forward GEMM only, nothing saved
            a = fmt.input_operand(x2d, up2d, settings.scale_rule, "mm") if x_mx is None else x_mx[0]
            w = fmt.weight_operand(weight, settings.scale_rule, "forward", settings.keep_dequantized_weights)
            _observe_forward(settings, x2d, up2d, a, weight, w, None)
            y = fmt.mm(a, w, out_dtype)
            y = y if bias is None else y + bias.to(out_dtype)
    return y.reshape(*x.shape[:-1], n)
