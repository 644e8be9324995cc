"""MXFP8 grouped expert GEMM: like ``torch._grouped_mm(x, W.transpose(-2, -1), offs)``.

The routed-expert recipe of the recipe, "Routed Experts", for one projection:

* forward ``Y[g] = MX(X[g]) . MX(W[g])^T``: X rowwise (along K), the expert
  weight ``W [E, N, K]`` blocked along K (forward weight cache);
* dgrad ``dX[g] = MX(dY[g]) . MX(W[g])``: dY rowwise (along N), ``W^T [E, K, N]``
  blocked along N (dgrad weight cache);
* wgrad ``dW[g] = dY[g]^T . X[g]``: by default a BF16 grouped GEMM on the
  dequantized saved input (the recipe, "Kernel Problems and Fusions" (Table 25)); with ``wgrad="mxfp8"`` both operands
  are blocked along tokens *per expert group*: each group is zero-padded to a
  multiple of 32 rows, so no 32-block mixes two experts' rows.

Optional fusions on either side (the recipe, "Kernel Problems and Fusions"):

* ``up is not None``: the input is ``silu(x) * up`` (SwiGLU), quantized straight
  from gate and up; its backward runs in fp32 from gate/up saved per ``save``
  and from the dgrad's result in the input's dtype (the model's own GEMM output).
* ``route_weight [S]``: the output rows are scaled by the route weights (the
  combine's weighted sum); in backward the route-weight multiply is fused into
  the quantization of the gradient dgrad consumes (``mxfx::route_weight_quantize``).

Groups may be empty or of any size. The input saved for wgrad is stored in
MXFP8 (33/32 bytes per value) when ``save="mxfp8"``, else as given.
"""

from __future__ import annotations

import torch

from mxfx.numerics import layout
from mxfx.runtime.cache import weight_operands
from mxfx.numerics.mx import check_input
from mxfx.kernels import custom_ops
from mxfx.kernels.launch import traced
from mxfx.ops import swiglu
from mxfx.ops.block import block_grouped_mm, check_x_tiles, weigh_rows
from mxfx.ops.gemm import a_operand, hp_grouped_wgrad, mx_grouped_mm, mx_grouped_mm_wgrad, quantize_operand
from mxfx.ops.settings import MXSettings, resolve

def _pad_rows(t: torch.Tensor, dest: torch.Tensor, capacity: int) -> torch.Tensor:
    """``t [S, D]`` scattered to rows ``dest`` of a zero ``[capacity, D]`` buffer (groups padded to 32)."""
    return t.new_zeros((capacity, t.shape[1])).index_copy(0, dest, t)


def _token_blocked(t: torch.Tensor, dest: torch.Tensor, capacity: int, rule: str):
    """MX of ``t [S, D]`` blocked along tokens per group: ``(q [D, C], s [D, C/32])``."""
    return custom_ops.quantize(_pad_rows(t, dest, capacity).t(), rule)


class _MXGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, up, weight, offs, route_weight, out_dtype, settings: MXSettings, x_q, x_s, x_dequantized):
        s_rows = x.shape[0]
        rule, wgrad, save = settings.scale_rule, settings.wgrad, settings.save
        if up is not None:
            xq, xs, x_hat, packed = swiglu.quantize_input_and_pack(x, up, save, rule, "grouped_mm")
        else:
            xq, xs, x_hat = quantize_operand(x, rule, "grouped_mm") if x_q is None else (x_q, x_s, x_dequantized)
            packed = ()
        wq, ws, w_dequantized = weight_operands(weight, rule, "forward", settings.keep_dequantized_weights)
        y = mx_grouped_mm(xq, xs, wq, ws, offs, out_dtype, w_dequantized, x_hat)
        if not ctx.needs_input_grad[2]:  # a frozen expert stack: nothing is kept or quantized for a wgrad
            wgrad_input = ()
        elif wgrad == "mxfp8":
            dest, _, capacity = layout.group_padding(offs, s_rows)
            h = x if up is None else swiglu.swiglu_fp32(x, up)
            wgrad_input = _token_blocked(h, dest, capacity, rule)
        elif save == "mxfp8" or up is not None:
            wgrad_input = (xq, xs)  # the forward's own MX copy: dequantized for the BF16 wgrad
        else:
            wgrad_input = (x,)
        y_unweighted = ()
        if route_weight is not None:
            y_unweighted = (y,)
            y = weigh_rows(y, route_weight, out_dtype)
        ctx.save_for_backward(weight, offs, route_weight, *y_unweighted, *wgrad_input, *packed)
        ctx.settings, ctx.n_wgrad_inputs, ctx.x_dtype = settings, len(wgrad_input), x.dtype
        ctx.has_up, ctx.has_route_weight = up is not None, route_weight is not None
        return y

    @staticmethod
    def backward(ctx, dout):
        n_wgrad, x_dtype, has_rw, rule = ctx.n_wgrad_inputs, ctx.x_dtype, ctx.has_route_weight, ctx.settings.scale_rule
        weight, offs, route_weight, *rest = ctx.saved_tensors
        y_unweighted = rest[0] if has_rw else None
        rest = rest[1:] if has_rw else rest
        wgrad_input, packed = rest[:n_wgrad], tuple(rest[n_wgrad:])
        dout = dout.contiguous()
        d_rw = dx = dup = dw = None
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if has_rw:
            d_rw = (dout.float() * y_unweighted.float()).sum(-1).reshape(route_weight.shape).to(route_weight.dtype)
            if need_dx:
                dyq, dys, dy_hat = a_operand(
                    "grouped_mm", custom_ops.route_weight_quantize, custom_ops.route_weight_quantize_dequantize,
                    dout, route_weight.reshape(-1), rule,
                )
            dy = dout.float() * route_weight.reshape(-1, 1).float()  # fp32: quantized once, never via bf16
        else:
            if need_dx:
                dyq, dys, dy_hat = quantize_operand(dout, rule, "grouped_mm")
            dy = dout
        if need_dx:
            wq_t, ws_t, w_dequantized = weight_operands(weight, rule, "dgrad", ctx.settings.keep_dequantized_weights)
            dh = mx_grouped_mm(dyq, dys, wq_t, ws_t, offs, x_dtype, w_dequantized, dy_hat)
            if ctx.has_up:
                dx, dup = (t.to(x_dtype) for t in swiglu.backward(dh, packed))
            else:
                dx = dh
        if ctx.needs_input_grad[2]:
            if ctx.settings.wgrad == "mxfp8":
                dest, padded_offs, capacity = layout.group_padding(offs, dy.shape[0])
                dyq_t, dys_t = _token_blocked(dy, dest, capacity, rule)
                xq_t, xs_t = wgrad_input
                dw = mx_grouped_mm_wgrad(dyq_t, dys_t, xq_t, xs_t, padded_offs, weight.dtype)
            else:
                x_saved = wgrad_input[0] if n_wgrad == 1 else custom_ops.dequantize(*wgrad_input, torch.bfloat16)
                # no group padding: mxfx::grouped_wgrad_bf16 takes any group ends (see there)
                dw = hp_grouped_wgrad(dy.to(dout.dtype), x_saved, offs, weight.dtype)
        return dx, dup, dw, None, d_rw, None, None, None, None, None


def _check_x_mx(x_mx, x: torch.Tensor, up) -> tuple:
    """``x_mx`` of :func:`mx_grouped_mm_op` as ``(qdata, scales, values or None)``, all None when not given."""
    if x_mx is None:
        return None, None, None
    if not isinstance(x_mx, (tuple, list)) or len(x_mx) not in (2, 3):
        raise ValueError("mxfx.grouped_mm: x_mx must be (qdata, scales) or (qdata, scales, dequantized values)")
    x_q, x_s, x_dequantized = (*x_mx, None) if len(x_mx) == 2 else x_mx
    if not isinstance(x_q, torch.Tensor) or not isinstance(x_s, torch.Tensor) or x_q.dtype != torch.float8_e4m3fn:
        raise ValueError("mxfx.grouped_mm: x_mx needs x's qdata (float8_e4m3fn tensor) and scales (uint8 E8M0 tensor)")
    if x_dequantized is not None and (not isinstance(x_dequantized, torch.Tensor) or not x_dequantized.is_floating_point()
                                      or x_dequantized.element_size() < 2):
        raise TypeError(
            f"mxfx.grouped_mm: the values in x_mx must be the dequantized tensor (bf16/fp16/fp32), got "
            f"{getattr(x_dequantized, 'dtype', type(x_dequantized).__name__)}"
        )
    k = x.shape[-1]
    if up is not None or x_q.shape != x.shape or x_s.shape != (*x.shape[:-1], k // 32) or (
        x_dequantized is not None and x_dequantized.shape != x.shape
    ):
        shapes = " / ".join(str(tuple(t.shape)) for t in x_mx if t is not None)
        raise ValueError(
            f"mxfx.grouped_mm: x_mx of shapes {shapes} must be the MX pair of x {tuple(x.shape)} ([S, K] / "
            f"[S, K/32], and values [S, K] if given) and cannot be combined with a SwiGLU up operand"
        )
    return x_q, x_s, x_dequantized


def mx_grouped_mm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    *,
    up: torch.Tensor | None = None,
    route_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    x_mx: tuple[torch.Tensor, ...] | None = None,
    settings: MXSettings | None = None,
    **setting_fields,
) -> torch.Tensor:
    """MXFP8 ``torch._grouped_mm(x, weight.transpose(-2, -1), offs)`` with optional SwiGLU input and route weights.

    Args:
        x: ``[S, K]`` input rows sorted by expert (the SwiGLU gate when ``up`` is given).
        weight: ``[E, N, K]`` expert weights (fp32 main weight or bf16; K, N multiples of 32).
        offs: int32 ``[E]`` cumulative group ends.
        up: optional ``[S, K]`` SwiGLU up operand: the input becomes ``silu(x) * up``.
        route_weight: optional ``[S]`` or ``[S, 1]``: output rows are scaled by it.
        out_dtype: result dtype (default ``x.dtype``).
        x_mx: optional ``(qdata e4m3 [S, K], scales uint8 [S, K/32])`` with ``x`` exactly
            its dequantization (rows received by an MX all-to-all, the recipe, "Smaller Dispatch and Combine Payloads", or gathered
            from the MX of the tokens before the dispatch's row gather): the forward GEMM uses
            it instead of quantizing ``x`` again. Not with ``up``. A third element, the
            dequantized values ``[S, K]`` in :func:`mxfx.kernels.device.emulated_operand_dtype`,
            is what an emulated GEMM reads instead of dequantizing the pair. Under
            ``format="fp8_block"`` the pair is x's 1x128 tiles instead (qdata ``[S, K]``, float32
            scales ``[S, K/128]``, any strides): x's own quantization, gathered rows included.
        settings, **setting_fields: an :class:`mxfx.ops.settings.MXSettings` and/or its fields by name
            (``scale_rule``, ``wgrad`` (default "bf16", the routed recipe), ``save``,
            ``keep_dequantized_weights``, ``format``); fields given by name override ``settings``.

    Returns ``[S, N]``.

    Like ``torch._grouped_mm``, group ends must be non-decreasing and at most S: checked for CPU tensors in eager
    code; on a GPU, or inside a traced graph, offs values are not read (that would need a device sync).

    Raises:
        TypeError: x not a bf16/fp16/fp32 tensor, offs not a tensor, out_dtype not floating.
        ValueError: an unknown scale rule, shapes that do not pair up or are not multiples of 32,
            offs not int32 (or, on the CPU, not non-decreasing ends of at most S rows), no experts, route_weight not [S] or [S, 1], a weight that
            is not 3D, a settings value not valid, or ``x_mx`` given with ``up`` or with shapes
            that do not match ``x``. TypeError also for a keyword that is not a settings field.
    """
    op = "mxfx.grouped_mm"
    settings = resolve(op, settings, setting_fields, wgrad_default="bf16")
    check_input(x, op)
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"{op}: offs must be an int32 tensor of cumulative group ends, got {type(offs).__name__}")
    if out_dtype is not None and (not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point):
        raise TypeError(f"{op}: out_dtype={out_dtype!r} must be a floating dtype (e.g. torch.bfloat16) or None")
    if weight.dim() != 3:
        raise ValueError(f"{op}: weight of shape {tuple(weight.shape)} must be 3D [E, N, K] expert weights")
    e, n, k = weight.shape
    if x.dim() != 2 or x.shape[-1] != k or k % 32 or n % 32 or offs.shape != (e,):
        raise ValueError(
            f"mxfx.grouped_mm: input {tuple(x.shape)}, weight {tuple(weight.shape)} [E, N, K] and offs "
            f"{tuple(offs.shape)} do not pair up (need x [S, K], offs [E], K and N multiples of 32); "
            f"keep this GEMM in BF16 or pad its features"
        )
    if e == 0:
        raise ValueError(f"{op}: weight of shape {tuple(weight.shape)} has no experts; give at least one")
    if route_weight is not None and tuple(route_weight.shape) not in ((x.shape[0],), (x.shape[0], 1)):
        raise ValueError(
            f"{op}: route_weight of shape {tuple(route_weight.shape)} must be [S] or [S, 1], one weight per row of "
            f"x {tuple(x.shape)}"
        )
    if offs.dtype != torch.int32:
        raise ValueError(
            f"{op}: offs of shape {tuple(offs.shape)} has dtype {offs.dtype}; it holds the int32 cumulative "
            f"group ends, as torch._grouped_mm takes them: pass offs.to(torch.int32)"
        )
    if offs.device.type == "cpu" and not traced(offs):  # host values: checked here (on a GPU it would be a sync)
        layout.check_group_ends(offs.tolist(), x.shape[0], op)
    out_dtype = out_dtype or x.dtype
    if settings.format == "fp8_block":
        return block_grouped_mm(x, weight, offs, up, route_weight, out_dtype, settings, x_tiles=check_x_tiles(x_mx, x, up))
    x_q, x_s, x_dequantized = _check_x_mx(x_mx, x, up)
    if not torch.is_grad_enabled():  # inference graph: the forward GEMM only, nothing saved
        xq, xs, x_hat = (swiglu.quantize_input(x, up, settings.scale_rule, "grouped_mm") if x_q is None
                         else (x_q, x_s, x_dequantized))
        wq, ws, w_dequantized = weight_operands(weight, settings.scale_rule, "forward", settings.keep_dequantized_weights)
        y = mx_grouped_mm(xq, xs, wq, ws, offs, out_dtype, w_dequantized, x_hat)
        return y if route_weight is None else weigh_rows(y, route_weight, out_dtype)
    return _MXGroupedMM.apply(x, up, weight, offs, route_weight, out_dtype, settings, x_q, x_s, x_dequantized)
