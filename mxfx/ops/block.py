"""fp8_block linear and grouped expert GEMM: what :func:`mxfx.ops.linear.mx_linear` and
:func:`mxfx.ops.grouped_mm.mx_grouped_mm_op` run for ``format="fp8_block"`` (``docs/block_format.md``).

Same contract as those ops, in the DeepSeek-V3 / Float8BlockScaling format; every GEMM is ``A @ B^T`` with
both operands tiled along its reduction dim:

* forward ``Y = Q(X) . Q(W)^T``: X in 1x128 tiles along K, W in 128x128 blocks (weight cache form
  "block_forward", from the FP32 main weight once per optimizer step);
* dgrad ``dX = Q(dY) . Q(W^T)^T``: dY 1x128 along N, the same 128x128 grid read as W^T ("block_dgrad");
* wgrad ``dW = Q(dY^T) . Q(X^T)^T`` with both operands in 1x128 tiles along the tokens (for routed experts
  restarting at every group start), or with ``wgrad="bf16"`` a BF16 GEMM on the saved input.

Saved for backward: with an FP8 wgrad, X's token-tiled copy (1 byte per value plus a 4-byte scale per
128); with a BF16 wgrad and ``save="mxfp8"``, the forward's own 1x128 copy (dequantized in backward);
with ``save="bf16"``, a reference to X. With a SwiGLU input (``up``) gate and up are saved in 1x128 tiles
(``save="mxfp8"``) or as given, and the SwiGLU backward runs in fp32. On sm90 the GEMMs are FP8 tensor-core
GEMMs (cuBLAS blockwise dense, Triton grouped), on CPU the exact fp32 decode. Features (K and N) must be
multiples of 128: the linear and grouped passes keep other GEMMs in BF16 and say so.
"""

from __future__ import annotations

import torch

from mxfx.numerics.block import dequantize_values
from mxfx.runtime.cache import block_weight_operand
from mxfx.kernels import block_ops
from mxfx.ops import swiglu
from mxfx.ops.gemm import hp_grouped_wgrad, hp_mm_transposed
from mxfx.ops.settings import MXSettings

TILE = 128


def check_features(op: str, k: int, n: int) -> None:
    """Raise ValueError naming ``op`` unless in/out features ``k``/``n`` are multiples of 128."""
    if k % TILE or n % TILE:
        raise ValueError(f"{op}: format='fp8_block' needs in/out features that are multiples of {TILE}, got "
                         f"{k}->{n}; keep this GEMM in BF16 (a policy rule) or use format='mxfp8'")


def _dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_values(q, s, (-1,)).to(dtype)


def _input(x: torch.Tensor, up: torch.Tensor | None, rule: str):
    """1x128 operand of the GEMM input: ``x``, or ``silu(x) * up`` fused with its quantize."""
    return block_ops.block_quantize(x, rule) if up is None else block_ops.block_swiglu_quantize(x, up, rule)


def _forward_operands(x: torch.Tensor, up: torch.Tensor | None, tokens_src: torch.Tensor | None,
                      offs: torch.Tensor | None, save: str, rule: str) -> tuple:
    """``(xq, xs, token-tiled pair or (), packed SwiGLU inputs or ())`` of a GEMM input, quantized in one op
    (:func:`mxfx.kernels.block_ops.block_forward_operands`); the SwiGLU inputs are saved as FP8 pairs under
    ``save="mxfp8"``, as given otherwise."""
    pack = up is not None and save == "mxfp8"
    out = block_ops.block_forward_operands(x, up, tokens_src, offs, rule, pack)
    xq, xs, rest = out[0], out[1], out[2:]
    tokens = tuple(rest[:2]) if tokens_src is not None else ()
    packed = tuple(rest[len(tokens):]) if pack else ((x, up) if up is not None else ())
    return xq, xs, tokens, packed


def _swiglu_backward(dh: torch.Tensor, packed: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    if len(packed) == 4:
        gq, gs, uq, us = packed
        packed = (_dequantize(gq, gs, torch.float32), _dequantize(uq, us, torch.float32))
    return swiglu.backward(dh, packed)


def _wgrad_source(x: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    return x if up is None else swiglu.swiglu_fp32(x, up)


class _BlockLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, up, weight, bias, out_dtype, settings: MXSettings):
        rule, wgrad, save = settings.scale_rule, settings.wgrad, settings.save
        need_dw = ctx.needs_input_grad[2]  # a frozen weight: nothing is kept or quantized for a wgrad
        keep_x = save == "bf16" and up is None and need_dw  # x stays alive elsewhere: keep a reference
        fp8_tokens = wgrad == "mxfp8" and not keep_x and need_dw
        xq, xs, tokens, packed = _forward_operands(x2d, up, _wgrad_source(x2d, up) if fp8_tokens else None, None,
                                                   save, rule)
        wq, ws = block_weight_operand(weight, rule, "forward")
        y = block_ops.block_mm(xq, xs, wq, ws, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        if not need_dw:
            kind, wgrad_input = "none", ()
        elif keep_x:
            kind, wgrad_input = ("hp_tokens" if wgrad == "mxfp8" else "hp"), (x2d,)
        elif fp8_tokens:
            kind, wgrad_input = "fp8_tokens", tokens
        else:
            kind, wgrad_input = "rows", (xq, xs)
        ctx.save_for_backward(weight, *wgrad_input, *packed)
        ctx.settings, ctx.x_dtype, ctx.out_dtype, ctx.kind, ctx.n_wgrad = settings, x2d.dtype, out_dtype, kind, len(wgrad_input)
        ctx.has_bias, ctx.has_up = bias is not None, up is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        rule, kind = ctx.settings.scale_rule, ctx.kind
        weight, *saved = ctx.saved_tensors
        wgrad_input, packed = saved[: ctx.n_wgrad], tuple(saved[ctx.n_wgrad:])
        dy = dy.contiguous()
        dx = dup = dw = db = None
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dy_tokens = kind in ("fp8_tokens", "hp_tokens")  # set by the forward only where the weight needs a gradient
        if need_dx and dy_tokens:  # both tilings of dY from one read
            dyq, dys, dyq_t, dys_t = block_ops.block_quantize_dual(dy, rule)
        elif need_dx:
            dyq, dys = block_ops.block_quantize(dy, rule)
        elif dy_tokens:
            dyq_t, dys_t = block_ops.block_quantize_tokens(dy, rule)
        if need_dx:
            wq_t, ws_t = block_weight_operand(weight, rule, "dgrad")
            dh = block_ops.block_mm(dyq, dys, wq_t, ws_t, ctx.x_dtype)
            if ctx.has_up:
                dx, dup = (t.to(ctx.x_dtype) for t in _swiglu_backward(dh, packed))
            else:
                dx = dh
        if ctx.needs_input_grad[2]:
            if dy_tokens:
                if kind == "hp_tokens":
                    wgrad_input = block_ops.block_quantize_tokens(wgrad_input[0], rule)
                dw = block_ops.block_mm(dyq_t, dys_t, *wgrad_input, weight.dtype)
            else:
                x_saved = wgrad_input[0] if kind == "hp" else _dequantize(*wgrad_input, ctx.out_dtype)
                dw = hp_mm_transposed(dy.t(), x_saved.t(), weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy.float().sum(0).to(weight.dtype)
        return dx, dup, dw, db, None, None


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, up: torch.Tensor | None,
                 out_dtype: torch.dtype, settings: MXSettings) -> torch.Tensor:
    """fp8_block ``F.linear`` (module docstring) for :func:`mxfx.ops.linear.mx_linear`, which checks the
    arguments and picks ``out_dtype``: ``x [..., K]`` (the SwiGLU gate with ``up``), ``weight [N, K]``
    -> ``[..., N]``. Runs with autocast off (``out_dtype`` carries its dtype).

    Raises:
        ValueError: K or N not a multiple of 128.
    """
    n, k = weight.shape
    check_features("mxfx.mx_linear", k, n)
    x2d = x.reshape(-1, k)
    up2d = None if up is None else up.reshape(-1, k)
    if not torch.is_grad_enabled():  # inference graph: the forward GEMM only, nothing saved
        y = block_ops.block_mm(*_input(x2d, up2d, settings.scale_rule),
                               *block_weight_operand(weight, settings.scale_rule, "forward"), out_dtype)
        y = y if bias is None else y + bias.to(out_dtype)
    else:
        y = _BlockLinear.apply(x2d, up2d, weight, bias, out_dtype, settings)
    return y.reshape(*x.shape[:-1], n)


def weigh_rows(y: torch.Tensor, route_weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows of the GEMM output ``y [S, N]`` (already in ``out_dtype``) scaled by ``route_weight [S]``.

    The product is taken in fp32 and rounded once to ``out_dtype``. ``y`` itself is the GEMM's
    ``out_dtype`` result, the tensor the model's own ``y * w`` would read, and the one backward
    keeps for the route-weight gradient: an fp32 GEMM output would double the bytes of the
    largest tensor of the routed block for a rounding the model does anyway.
    """
    return (y.float() * route_weight.reshape(-1, 1).float()).to(out_dtype)


def check_x_tiles(x_tiles, x: torch.Tensor, up: torch.Tensor | None) -> tuple | None:
    """``x_tiles`` of :func:`block_grouped_mm` checked against ``x``: None, or ``(qdata, scales)`` of x's 1x128
    tiles (E4M3 ``[S, K]``, float32 ``[S, ceil(K/128)]``, any strides), never with ``up``.

    Raises:
        ValueError: another pair (an MXFP8 one: uint8 scales per 32), other shapes, or ``up`` given too.
    """
    if x_tiles is None:
        return None
    q, s = x_tiles if isinstance(x_tiles, (tuple, list)) and len(x_tiles) == 2 else (None, None)
    want = (x.shape[0], -(-x.shape[-1] // TILE))
    if (up is not None or not isinstance(q, torch.Tensor) or not isinstance(s, torch.Tensor) or q.dtype != torch.float8_e4m3fn
            or s.dtype != torch.float32 or q.shape != x.shape or tuple(s.shape) != want):
        got = " / ".join(f"{tuple(t.shape)} {t.dtype}" for t in (x_tiles or ()) if isinstance(t, torch.Tensor))
        raise ValueError(f"mxfx.grouped_mm: under format='fp8_block' x_mx must be x's 1x128 tiles (qdata float8_e4m3fn "
                         f"{tuple(x.shape)}, float32 scales {want}) and not combined with up; got {got or x_tiles!r}")
    return q, s


class _BlockGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, up, weight, offs, route_weight, out_dtype, settings: MXSettings, x_tiles):
        rule, wgrad, save = settings.scale_rule, settings.wgrad, settings.save
        need_dw = ctx.needs_input_grad[2]  # a frozen expert stack: nothing is kept or quantized for a wgrad
        tokens_src = _wgrad_source(x, up) if wgrad == "mxfp8" and need_dw else None
        if x_tiles is None:
            xq, xs, tokens, packed = _forward_operands(x, up, tokens_src, offs, save, rule)
        else:  # x quantized before the dispatch's row gather (mxfx.passes.dispatch_mx); up is None
            (xq, xs), packed = x_tiles, ()
            tokens = tuple(block_ops.block_quantize_grouped_tokens(tokens_src, offs, rule)) if tokens_src is not None else ()
        wq, ws = block_weight_operand(weight, rule, "forward")
        y = block_ops.block_grouped_mm(xq, xs, wq, ws, offs, out_dtype)
        if not need_dw:
            wgrad_input = ()
        elif wgrad == "mxfp8":
            wgrad_input = tokens
        elif save == "mxfp8" or up is not None:
            wgrad_input = (xq, xs)  # the forward's own FP8 copy: dequantized for the BF16 wgrad
        else:
            wgrad_input = (x,)
        y_unweighted = ()
        if route_weight is not None:
            y_unweighted = (y,)
            y = weigh_rows(y, route_weight, out_dtype)
        ctx.save_for_backward(weight, offs, route_weight, *y_unweighted, *wgrad_input, *packed)
        ctx.settings, ctx.n_wgrad, ctx.x_dtype = settings, len(wgrad_input), x.dtype
        ctx.has_up, ctx.has_route_weight = up is not None, route_weight is not None
        return y

    @staticmethod
    def backward(ctx, dout):
        rule, has_rw = ctx.settings.scale_rule, ctx.has_route_weight
        weight, offs, route_weight, *rest = ctx.saved_tensors
        y_unweighted = rest[0] if has_rw else None
        rest = rest[1:] if has_rw else rest
        wgrad_input, packed = rest[: ctx.n_wgrad], tuple(rest[ctx.n_wgrad:])
        dout = dout.contiguous()
        d_rw = None
        if has_rw:
            d_rw = (dout.float() * y_unweighted.float()).sum(-1).reshape(route_weight.shape).to(route_weight.dtype)
            dy = dout.float() * route_weight.reshape(-1, 1).float()  # fp32: quantized once, never via bf16
        else:
            dy = dout
        dx = dup = dw = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dyq, dys = block_ops.block_quantize(dy, rule)
            wq_t, ws_t = block_weight_operand(weight, rule, "dgrad")
            dh = block_ops.block_grouped_mm(dyq, dys, wq_t, ws_t, offs, ctx.x_dtype)
            if ctx.has_up:
                dx, dup = (t.to(ctx.x_dtype) for t in _swiglu_backward(dh, packed))
            else:
                dx = dh
        if ctx.needs_input_grad[2]:
            if ctx.settings.wgrad == "mxfp8":
                dyq_t, dys_t = block_ops.block_quantize_grouped_tokens(dy, offs, rule)
                dw = block_ops.block_grouped_wgrad(dyq_t, dys_t, *wgrad_input, offs, weight.dtype)
            else:
                x_saved = wgrad_input[0] if ctx.n_wgrad == 1 else _dequantize(*wgrad_input, torch.bfloat16)
                dw = hp_grouped_wgrad(dy.to(dout.dtype), x_saved, offs, weight.dtype)
        return dx, dup, dw, None, d_rw, None, None, None


def block_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, up: torch.Tensor | None,
                     route_weight: torch.Tensor | None, out_dtype: torch.dtype, settings: MXSettings,
                     x_tiles: tuple | None = None) -> torch.Tensor:
    """fp8_block ``torch._grouped_mm(x, weight.transpose(-2, -1), offs)`` (module docstring) for
    :func:`mxfx.ops.grouped_mm.mx_grouped_mm_op`, which checks the arguments: ``x [S, K]`` (the SwiGLU gate
    with ``up``), ``weight [E, N, K]``, int32 ``offs [E]``, optional ``route_weight [S]`` -> ``[S, N]``; ``x_tiles``:
    x's 1x128 tiles made before a row gather (:func:`check_x_tiles`), used instead of quantizing ``x``.

    Raises:
        ValueError: K or N not a multiple of 128.
    """
    _, n, k = weight.shape
    check_features("mxfx.grouped_mm", k, n)
    if not torch.is_grad_enabled():
        y = block_ops.block_grouped_mm(*(x_tiles or _input(x, up, settings.scale_rule)),
                                       *block_weight_operand(weight, settings.scale_rule, "forward"), offs, out_dtype)
        return y if route_weight is None else weigh_rows(y, route_weight, out_dtype)
    return _BlockGroupedMM.apply(x, up, weight, offs, route_weight, out_dtype, settings, x_tiles)
