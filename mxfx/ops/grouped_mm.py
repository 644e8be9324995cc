"""Low-precision grouped expert GEMM: like ``torch._grouped_mm(x, W.transpose(-2, -1), offs)``, in the op's format.

The routed-expert recipe of the recipe, "Routed Experts", for one projection:

* forward ``Y[g] = Q(X[g]) . Q(W[g])^T``: X rowwise (along K), the expert weight ``W [E, N, K]`` from its
  forward weight cache;
* dgrad ``dX[g] = Q(dY[g]) . Q(W[g])``: dY rowwise (along N), ``W^T [E, K, N]`` from its dgrad weight cache;
* wgrad ``dW[g] = dY[g]^T . X[g]``: by default a BF16 grouped GEMM on the dequantized saved input (the recipe,
  "Kernel Problems and Fusions" (Table 25)); with ``wgrad="mxfp8"`` both operands are blocked along tokens
  *per expert group*, so no block mixes two experts' rows.

Optional fusions on either side (the recipe, "Kernel Problems and Fusions"):

* ``up is not None``: the input is ``silu(x) * up`` (SwiGLU), quantized straight from gate and up; its
  backward runs in fp32 from gate/up saved per ``save`` and from the dgrad's result in the input's dtype.
* ``route_weight [S]``: the output rows are scaled by the route weights (the combine's weighted sum); in
  backward the route-weight multiply goes into the quantization of the gradient dgrad consumes where the
  format has that kernel.

Groups may be empty or of any size; output rows past ``offs[-1]`` are as the format's ``grouped_mm`` leaves them
(:meth:`mxfx.formats.base.Format.grouped_mm`). The input saved for the wgrad: with ``save="bf16"`` (and no ``up``) x as
given (an MX wgrad quantizes it along each group's tokens in backward); else the token-blocked copy an MX wgrad
reads, or the forward's own low-precision copy, dequantized for a BF16 wgrad. A frozen expert stack keeps nothing
for a wgrad.
"""

from __future__ import annotations

import torch

from mxfx.formats.base import route_weighted
from mxfx.kernels.common.launch import readable_on_host
from mxfx.numerics import layout
from mxfx.numerics.mx import INPUT_DTYPES
from mxfx.ops.settings import OpSettings, resolve
from mxfx.ops.wgrad import weight_gradient


def weigh_rows(y: torch.Tensor, route_weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows of the GEMM output ``y [S, N]`` (in the op's ``gemm_dtype``) scaled by ``route_weight [S]``.

    The product is taken in fp32 and rounded once to ``out_dtype``. ``y`` itself is the GEMM's result in its
    ``gemm_dtype``, the tensor the model's own ``y * w`` would read (under autocast the GEMM's BF16 rows, even where
    the product is FP32), and the one backward keeps for the route-weight gradient: an fp32 GEMM output would
    double the bytes of the largest tensor of the routed block for a rounding the model does anyway.
    """
    return (y.float() * route_weight.reshape(-1, 1).float()).to(out_dtype)


X_MX_FROM = ("gather", "all_to_all")
"""Where an ``x_mx`` given to :func:`mx_grouped_mm_op` comes from: ``gather``, x's own quantization (rows
quantized before the row gather that makes x: the pair is what quantizing x makes, bit for bit), or
``all_to_all``, the pair an MX all-to-all received, of which x is the dequantization."""


def _observe_forward(settings: OpSettings, x, up, a, observe_x: bool, weight, w, offs, x_tokens) -> None:
    """Statistics of a forward's quantizes (:meth:`OpSettings.observe`): the input against its A operand ``a``
    where ``observe_x`` (not where ``a`` is a received all-to-all pair of which ``x`` is the dequantization: that
    payload is the all-to-all's own site), the weight against its forward form ``w``, and the input against its
    wgrad operand ``x_tokens`` blocked per expert group when there is one."""
    source, combine = ((x,), "") if up is None else ((x, up), "swiglu")
    if observe_x:
        settings.observe("grouped_mm", "forward_x", "rows", source, a, combine)
    settings.observe("grouped_mm", "forward_w", "weight", (weight,), w)
    if x_tokens is not None:
        settings.observe("grouped_mm", "wgrad_x", "group_tokens", source, x_tokens, combine, offs)


_BF16 = torch.bfloat16  # the high-precision routed wgrad's operand dtype (mxfx::grouped_wgrad_bf16)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        up,
        weight,
        offs,
        route_weight,
        out_dtype,
        gemm_dtype,
        dgrad_dtype,
        settings: OpSettings,
        given,
        observe_x,
    ):
        fmt, rule, wgrad, save = settings.format, settings.scale_rule, settings.wgrad, settings.save
        need_dw = ctx.needs_input_grad[2]  # a frozen expert stack: nothing is kept or quantized for a wgrad
        keep_x = need_dw and save == "bf16" and up is None  # x as given; an MX wgrad quantizes it in backward
        tokens = need_dw and wgrad == "mxfp8" and not keep_x
        a, x_tokens, packed = fmt.forward_operands(x, up, rule, save, tokens, offs=offs, given=given)
        w = fmt.weight_operand(weight, rule, "forward", settings.keep_dequantized_weights)
        _observe_forward(settings, x, up, a, observe_x, weight, w, offs, x_tokens)
        y = fmt.grouped_mm(a, w, offs, gemm_dtype)
        if not need_dw:
            wgrad_input = ()
        elif keep_x:
            wgrad_input = (x,)
        elif tokens:
            wgrad_input = x_tokens
        else:  # save == "mxfp8" or a SwiGLU input
            wgrad_input = fmt.saved_rows(a)  # the forward's own copy: dequantized for the BF16 wgrad
        y_unweighted = ()
        if route_weight is not None:
            y_unweighted = (y,)
            y = weigh_rows(y, route_weight, out_dtype)
        ctx.save_for_backward(weight, offs, route_weight, *y_unweighted, *wgrad_input, *packed)
        ctx.settings, ctx.n_wgrad, ctx.x_dtype, ctx.keep_x = settings, len(wgrad_input), x.dtype, keep_x
        ctx.dgrad_dtype = dgrad_dtype
        ctx.has_up, ctx.has_route_weight = up is not None, route_weight is not None
        return y

    @staticmethod
    def backward(ctx, dout):
        settings, has_rw = ctx.settings, ctx.has_route_weight
        fmt, rule = settings.format, settings.scale_rule
        weight, offs, route_weight, *rest = ctx.saved_tensors
        y_unweighted = rest[0] if has_rw else None
        rest = rest[1:] if has_rw else rest
        wgrad_input, packed = tuple(rest[: ctx.n_wgrad]), tuple(rest[ctx.n_wgrad :])
        dout = dout.contiguous()
        d_rw = dx = dup = dw = None
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        low_wgrad = ctx.needs_input_grad[2] and settings.wgrad == "mxfp8"
        # dgrad operand, dy and the route weights' gradient from one read of dout where the format's kernel can
        # (statistics compare the quantized rows with the fp32 dy, which that path leaves in BF16)
        together = has_rw and need_dx and not low_wgrad and not settings.stats
        if has_rw and not together:
            d_rw = (dout.float() * y_unweighted.float()).sum(-1)
        dy_tokens = None
        if need_dx:
            if low_wgrad:  # dY's dgrad and wgrad operands, from one read where the format's kernel can
                dy_rows, dy_tokens = fmt.grouped_grad_operands(dout, route_weight, offs, rule)
                dy = route_weighted(dout, route_weight) if settings.stats else None  # what statistics compare to
            elif together:
                dy_rows, dy, d_rw = fmt.route_grad_operands(dout, route_weight, y_unweighted, rule)
            else:
                dy_rows, dy = fmt.grouped_grad_operand(dout, route_weight, rule)
            settings.observe("grouped_mm", "dgrad_dy", "rows", (dy,), dy_rows)
            w = fmt.weight_operand(weight, rule, "dgrad", settings.keep_dequantized_weights)
            dh = fmt.grouped_mm(dy_rows, w, offs, ctx.dgrad_dtype)
            if ctx.has_up:
                dx, dup = (t.to(ctx.x_dtype) for t in fmt.swiglu_backward(dh, packed))
            else:
                dx = dh.to(ctx.x_dtype)  # widened where the dgrad GEMM ran at the autocast dtype
        else:
            dy = route_weighted(dout, route_weight)
        if ctx.needs_input_grad[2]:
            if low_wgrad:
                if dy_tokens is None:
                    dy_tokens = fmt.grouped_tokens_operand(dy, offs, rule)
                settings.observe("grouped_mm", "wgrad_dy", "group_tokens", (dy,), dy_tokens, offs=offs)
                x_tokens = wgrad_input
                if ctx.keep_x:  # saved as given: quantized along each group's tokens now
                    x_tokens = fmt.grouped_tokens_operand(wgrad_input[0], offs, rule)
                    settings.observe("grouped_mm", "wgrad_x", "group_tokens", wgrad_input, x_tokens, offs=offs)
                dw = weight_gradient(settings, weight, dy_tokens, x_tokens, offs)
            else:
                x_saved = wgrad_input[0] if ctx.n_wgrad == 1 else fmt.dequantize(wgrad_input, _BF16)
                # no group padding: mxfx::grouped_wgrad_bf16 takes any group ends. It rounds both operands to BF16
                # itself; rounded here instead, the casts fuse into the kernels that make dY (the route-weight
                # product) and x (an FP32 input under autocast), and no FP32 copy of either is written for it
                dw = weight_gradient(settings, weight, (dy.to(_BF16),), (x_saved.to(_BF16),), offs, low_precision=False)
        if d_rw is not None:
            d_rw = d_rw.reshape(route_weight.shape).to(route_weight.dtype)
        return dx, dup, dw, None, d_rw, None, None, None, None, None, None


def mx_grouped_mm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    *,
    up: torch.Tensor | None = None,
    route_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    gemm_dtype: torch.dtype | None = None,
    dgrad_dtype: torch.dtype | None = None,
    x_mx: tuple[torch.Tensor, ...] | None = None,
    x_mx_from: str | None = None,
    settings: OpSettings | None = None,
    **setting_fields,
) -> torch.Tensor:
    """MXFP8 ``torch._grouped_mm(x, weight.transpose(-2, -1), offs)`` with optional SwiGLU input and route weights.

    Args:
        x: ``[S, K]`` input rows sorted by expert (the SwiGLU gate when ``up`` is given).
        weight: ``[E, N, K]`` expert weights (fp32 main weight or bf16; K, N multiples of the format's
            ``feature_multiple``: 32 for MXFP8, 128 for fp8_block).
        offs: int32 ``[E]`` cumulative group ends.
        up: optional ``[S, K]`` SwiGLU up operand: the input becomes ``silu(x) * up``.
        route_weight: optional ``[S]`` or ``[S, 1]``: output rows are scaled by it.
        out_dtype: result dtype (default ``x.dtype``).
        gemm_dtype: with ``route_weight``, the dtype the GEMM writes its rows in before the route weights scale
            them in fp32 (bf16, fp16 or fp32; default ``out_dtype``): a combine whose weighted rows are FP32 while
            the GEMM runs under BF16 autocast keeps (and saves for the route weights' gradient) BF16 rows, half the
            bytes. A narrower range than the product's (float16) overflows where the product would not.
        dgrad_dtype: the dtype (bf16, fp16 or fp32) the dgrad GEMM writes x's gradient in, then cast to x's dtype
            (default ``x.dtype``): an FP32 input under BF16 autocast gets its gradient from a BF16 GEMM result, as
            an autocast GEMM's input (its BF16 cast) would; half the bytes of an FP32 result.
        x_mx: optional ``(qdata e4m3 [S, K], scales uint8 [S, K/32])`` whose quantization ``x`` stands for
            (rows received by an MX all-to-all, the recipe, "Smaller Dispatch and Combine Payloads", or gathered
            from the MX of the tokens before the dispatch's row gather): the forward GEMM uses
            it instead of quantizing ``x`` again. Not with ``up``. A third element, the
            dequantized values ``[S, K]`` in :meth:`mxfx.formats.mxfp8.MXFP8.values_dtype`,
            is what an emulated GEMM reads instead of dequantizing the pair. Under
            ``format="fp8_block"`` the pair is x's 1x128 tiles instead (qdata ``[S, K]``, float32
            scales ``[S, K/128]``, any strides): x's own quantization, gathered rows included.
        x_mx_from: with ``x_mx`` (and only with it), where the pair comes from (:data:`X_MX_FROM`):
            ``"gather"``, x's own quantization (x is the high-precision rows: site ``forward_x`` observes the pair
            against them, as it would the pair made here), or ``"all_to_all"``, a received pair of which x is the
            dequantization (no ``forward_x``: the payload is the all-to-all's site ``<role>_fwd``).
        settings, **setting_fields: an :class:`mxfx.ops.settings.OpSettings` and/or its fields by name
            (``format``, ``scale_rule``, ``wgrad`` (default "bf16", the routed recipe), ``save``,
            ``keep_dequantized_weights``, ``stats`` / ``stats_every``: quantization statistics of sites
            ``<stats>/grouped_mm/<direction>``, :mod:`mxfx.runtime.stats`, ``fuse_wgrad_accumulation``: the wgrad
            GEMM writes the weight's ``.grad`` itself, :mod:`mxfx.ops.wgrad`); fields given by name override
            ``settings``.

    Returns ``[S, N]``.

    Like ``torch._grouped_mm``, group ends must be non-decreasing and at most S: checked for CPU tensors in eager
    code; on a GPU, or inside a traced graph, offs values are not read (that would need a device sync). Rows past
    ``offs[-1]`` come out as zeros, except under ``format="bf16_gemm"``, whose GEMM (torch's) leaves them unwritten;
    no rows at all (an expert-parallel rank that received none) give an empty result and zero weight gradients.

    Raises:
        TypeError: x not a bf16/fp16/fp32 tensor, offs not a tensor, out_dtype or route_weight not floating,
            gemm_dtype or dgrad_dtype not bf16/fp16/fp32.
        ValueError: an unknown scale rule, shapes that do not pair up or do not fit the format (``feature_multiple``),
            offs not int32 (or, on the CPU, not non-decreasing ends of at most S rows), no experts, route_weight not [S]
            or [S, 1], a weight that is not 3D, a settings value not valid, ``x_mx`` given with ``up`` or with shapes
            that do not match ``x``, ``x_mx_from`` not one of :data:`X_MX_FROM` with ``x_mx`` or given without it,
            or a ``gemm_dtype`` other than the result's without ``route_weight``.
            TypeError also for a keyword that is not a settings field.
    """
    op = "mxfx.grouped_mm"
    settings = resolve(op, settings, setting_fields, wgrad_default="bf16")
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        what = (
            f"input of shape {tuple(x.shape)} has dtype {x.dtype}"
            if isinstance(x, torch.Tensor)
            else f"input is a {type(x).__name__}"
        )
        raise TypeError(f"{op}: {what}; its GEMMs quantize a bfloat16, float16 or float32 tensor (cast it first)")
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"{op}: offs must be an int32 tensor of cumulative group ends, got {type(offs).__name__}")
    if out_dtype is not None and (not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point):
        raise TypeError(f"{op}: out_dtype={out_dtype!r} must be a floating dtype (e.g. torch.bfloat16) or None")
    if out_dtype is not None and out_dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{op}: out_dtype={out_dtype!r} (input {tuple(x.shape)}): the GEMMs write torch.bfloat16, torch.float16 "
            "or torch.float32; cast the result afterwards"
        )
    if not isinstance(weight, torch.Tensor) or weight.dtype not in INPUT_DTYPES:
        what = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(
            f"{op}: weight ({what}) must be a bfloat16, float16 or float32 tensor [E, N, K] (its weight cache is "
            "made from it); cast the expert weights first"
        )
    for name, dtype in (("gemm_dtype", gemm_dtype), ("dgrad_dtype", dgrad_dtype)):  # what the GEMMs write
        if dtype is not None and dtype not in INPUT_DTYPES:
            raise TypeError(
                f"{op}: {name}={dtype!r} (input {tuple(x.shape)}) must be torch.bfloat16, torch.float16, "
                "torch.float32 or None"
            )
    if gemm_dtype is not None and route_weight is None and gemm_dtype != (out_dtype or x.dtype):
        raise ValueError(
            f"{op}: gemm_dtype={gemm_dtype} without route_weight (input {tuple(x.shape)}): the GEMM's rows are the "
            "result then; give out_dtype alone"
        )
    if weight.dim() != 3:
        raise ValueError(f"{op}: weight of shape {tuple(weight.shape)} must be 3D [E, N, K] expert weights")
    e, n, k = weight.shape
    if x.dim() != 2 or x.shape[-1] != k or offs.shape != (e,):
        raise ValueError(
            f"mxfx.grouped_mm: input {tuple(x.shape)}, weight {tuple(weight.shape)} [E, N, K] and offs "
            f"{tuple(offs.shape)} do not pair up (need x [S, K] and offs [E]); "
            f"keep this GEMM in BF16 or pad its features"
        )
    if e == 0:
        raise ValueError(f"{op}: weight of shape {tuple(weight.shape)} has no experts; give at least one")
    if route_weight is not None and tuple(route_weight.shape) not in ((x.shape[0],), (x.shape[0], 1)):
        raise ValueError(
            f"{op}: route_weight of shape {tuple(route_weight.shape)} must be [S] or [S, 1], one weight per row of "
            f"x {tuple(x.shape)}"
        )
    if route_weight is not None and not route_weight.is_floating_point():
        raise TypeError(
            f"{op}: route_weight of shape {tuple(route_weight.shape)} has dtype {route_weight.dtype}; the route "
            f"weights scale the output rows: pass them as a floating tensor (e.g. route_weight.float())"
        )
    if offs.dtype != torch.int32:
        raise ValueError(
            f"{op}: offs of shape {tuple(offs.shape)} has dtype {offs.dtype}; it holds the int32 cumulative "
            f"group ends, as torch._grouped_mm takes them: pass offs.to(torch.int32)"
        )
    if readable_on_host(offs):  # host values: checked here (on a GPU it would be a sync)
        layout.check_group_ends(offs.tolist(), x.shape[0], op)
    offs = offs.contiguous()  # the kernels read the group ends as a flat array
    out_dtype = out_dtype or x.dtype
    gemm_dtype = gemm_dtype or out_dtype
    dgrad_dtype = dgrad_dtype or x.dtype
    fmt = settings.format
    fmt.check_features(op, k, n)
    given = fmt.given_input(x_mx, x, up)
    if (x_mx is None) != (x_mx_from is None) or x_mx_from not in (None, *X_MX_FROM):
        raise ValueError(
            f"{op}: x_mx_from={x_mx_from!r} with x_mx {'given' if x_mx is not None else 'None'}; with "
            f"x_mx (and only with it) say where it comes from: 'gather' (x's own quantization, x the rows "
            f"it was made from) or 'all_to_all' (a received pair, x its dequantization)"
        )
    observe_x = x_mx_from != "all_to_all"
    if torch.is_grad_enabled():
        return _GroupedMM.apply(
            x, up, weight, offs, route_weight, out_dtype, gemm_dtype, dgrad_dtype, settings, given, observe_x
        )
    # inference graph: the forward GEMM only, nothing saved
    a = given if given is not None else fmt.input_operand(x, up, settings.scale_rule, "grouped_mm")
    w = fmt.weight_operand(weight, settings.scale_rule, "forward", settings.keep_dequantized_weights)
    _observe_forward(settings, x, up, a, observe_x, weight, w, offs, None)
    y = fmt.grouped_mm(a, w, offs, gemm_dtype)
    return y if route_weight is None else weigh_rows(y, route_weight, out_dtype)
