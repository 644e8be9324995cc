"""The fp8_block kernels as torch custom ops (``mxfx::block_*``), so compiled graphs hold them opaquely.

Bodies dispatch per device (:mod:`mxfx.kernels.fp8_block.device_path`, :mod:`mxfx.kernels.fp8_block.gemm`): Triton and
cuBLAS on CUDA, the exact reference decode on CPU (whose grouped paths read group ends on the host: fine
inside an op, not in a trace). Every 1x128 scale matrix an op returns is column-major (stride ``(1, rows)``,
what cuBLAS reads; the fake implementations say so too), every qdata contiguous.

* ``block_quantize(x [M, K], rule)`` -> ``(qdata [M, K], scales [M, ceil(K/128)])``, 1x128 along K;
* ``block_swiglu_quantize(gate, up, rule)``: the same of ``silu(gate) * up`` formed in fp32;
* ``block_route_weight_quantize(dy [S, D], weight [S], rule)``: the same of ``dy * weight[:, None]`` in fp32;
* ``block_route_grad_operands(dy, weight, y [S, D], rule)``: that pair, ``dy * weight[:, None]`` in BF16 and the
  route weights' gradient ``sum(dy * y, -1)`` in fp32, from one read of ``dy``;
* ``block_route_grad_operands_gathered(src [T, D], index [S], weight, y, rule)``: the same of ``dy = src[index]``,
  its rows gathered by the kernel (a combine's backward: each token's gradient once per expert it went to);
* ``block_quantize_tokens(x [T, K], rule)`` -> ``([K, T], [K, ceil(T/128)])``, 1x128 along tokens;
* ``block_quantize_grouped_tokens(x [S, K], offs, rule)`` -> ``([K, 128 C], [K, C])``, tiles restarting at every
  group start (``C = mxfx.numerics.block.group_tile_capacity(S, G)``);
* ``block_grouped_grad_operands(dy [S, D], weight [S] | None, offs, rule)``: the two above of ``dy`` (times the
  route weights) from one read, the dgrad and wgrad operands of a routed gradient;
* ``block_forward_operands(x, up, tokens_src, offs, rule, pack)``: every quantization a forward makes of one
  GEMM input, in one op (see there);
* ``block_mm``, ``block_grouped_mm``, ``block_grouped_wgrad``: :mod:`mxfx.kernels.fp8_block.gemm`'s GEMMs;
  ``block_mm_into``, ``block_grouped_wgrad_into``: the two wgrads written into (or added to) a given gradient.
"""

from __future__ import annotations

import warnings

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mxfx import library
from mxfx.numerics.block import TILE, check_rule, group_tile_capacity, n_tiles
from mxfx.numerics.mx import check_input
from mxfx.kernels.fp8_block import device_path, gemm
from mxfx.kernels.common.gemm import accumulate_into, check_offs
from mxfx.kernels.common.launch import name_op_functions, op_or_body
from mxfx.numerics.layout import column_major

_E4M3 = torch.float8_e4m3fn


def _fake_col_major(like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return like.new_empty((cols, rows), dtype=torch.float32).t()


def _rows_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fake 1x128 rows pair of ``x [M, K]``: contiguous qdata ``[M, K]``, column-major scales."""
    return (
        torch.empty_like(x, dtype=_E4M3, memory_format=torch.contiguous_format),
        _fake_col_major(x, x.shape[0], n_tiles(x.shape[1])),
    )


def _check_2d(x: torch.Tensor, op: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"mxfx::{op}: needs a 2D tensor, got shape {tuple(x.shape)}; flatten the leading dims first")


def _check_inputs(op: str, rule: str, **tensors: torch.Tensor | None) -> None:
    """The checks every quantize op (and its fake) makes before its kernel, naming the op and the argument: 2D
    bf16/fp16/fp32 inputs with at least one feature, and an fp8_block scale rule."""
    for name, t in tensors.items():
        if t is None:
            continue
        check_input(t, f"mxfx::{op} ({name})", "fp8_block", min_dim=1)
        _check_2d(t, op)
        if t.shape[1] == 0:
            raise ValueError(f"mxfx::{op}: {name} of shape {tuple(t.shape)} has no features to quantize (K = 0)")
    check_rule(rule, f"mxfx::{op}")


def _check_pair(op: str, x: torch.Tensor, other: torch.Tensor, name: str) -> None:
    """``other`` (up, or the token-tiled source) has ``x``'s shape."""
    if other.shape != x.shape:
        raise ValueError(f"mxfx::{op}: {name} of shape {tuple(other.shape)} must have x's shape {tuple(x.shape)}")


def _quantize(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs("block_quantize", rule, x=x)
    q, s = device_path.quantize_1x128(x, rule)
    return q.contiguous(), column_major(s)


@library.custom_op("mxfx::block_quantize", mutates_args=())
def _block_quantize_op(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize(x, rule)


@library.register_fake(_block_quantize_op)
def _(x, rule):
    _check_inputs("block_quantize", rule, x=x)
    return _rows_fake(x)


def _swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs("block_swiglu_quantize", rule, gate=gate, up=up)
    _check_pair("block_swiglu_quantize", gate, up, "up")
    q, s = device_path.swiglu_quantize_1x128(gate, up, rule)
    return q.contiguous(), column_major(s)


@library.custom_op("mxfx::block_swiglu_quantize", mutates_args=())
def _block_swiglu_quantize_op(gate: torch.Tensor, up: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _swiglu_quantize(gate, up, rule)


@library.register_fake(_block_swiglu_quantize_op)
def _(gate, up, rule):
    _check_inputs("block_swiglu_quantize", rule, gate=gate, up=up)
    _check_pair("block_swiglu_quantize", gate, up, "up")
    return _rows_fake(gate)


def _check_route_weight(op: str, dy: torch.Tensor, weight: torch.Tensor) -> None:
    """One floating route weight per row of ``dy [S, D]``: ``weight [S]`` on dy's device."""
    if not weight.is_floating_point():
        raise TypeError(f"mxfx::{op}: weight of shape {tuple(weight.shape)} has dtype {weight.dtype}; pass floats")
    if weight.device != dy.device:
        raise ValueError(f"mxfx::{op}: weight is on {weight.device}, dy {tuple(dy.shape)} on {dy.device}: move it")
    if weight.shape != (dy.shape[0],):
        raise ValueError(
            f"mxfx::{op}: weight must be one route weight per row of dy {tuple(dy.shape)}, shape ({dy.shape[0]},); "
            f"got {tuple(weight.shape)}: flatten the route weights to [S]"
        )


def _route_weight_quantize(dy: torch.Tensor, weight: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs("block_route_weight_quantize", rule, dy=dy)
    _check_route_weight("block_route_weight_quantize", dy, weight)
    q, s = device_path.route_weight_quantize_1x128(dy, weight, rule)
    return q.contiguous(), column_major(s)


@library.custom_op("mxfx::block_route_weight_quantize", mutates_args=())
def _block_route_weight_quantize_op(
    dy: torch.Tensor, weight: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _route_weight_quantize(dy, weight, rule)


@library.register_fake(_block_route_weight_quantize_op)
def _(dy, weight, rule):
    _check_inputs("block_route_weight_quantize", rule, dy=dy)
    _check_route_weight("block_route_weight_quantize", dy, weight)
    return _rows_fake(dy)


def _check_route_grad(dy: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, rule: str) -> None:
    op = "block_route_grad_operands"
    _check_inputs(op, rule, dy=dy, y=y)
    _check_route_weight(op, dy, weight)
    if y.shape != dy.shape or y.device != dy.device:
        raise ValueError(
            f"mxfx::{op}: y (the unweighted output) of shape {tuple(y.shape)} on {y.device} must have dy's shape "
            f"{tuple(dy.shape)} on {dy.device}"
        )


def _route_grad_operands(dy: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, rule: str):
    _check_route_grad(dy, weight, y, rule)
    q, s, dy16, d_weight = device_path.route_grad_operands_1x128(dy, weight, y, rule)
    return q.contiguous(), column_major(s), dy16, d_weight


@library.custom_op("mxfx::block_route_grad_operands", mutates_args=())
def _block_route_grad_operands_op(
    dy: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _route_grad_operands(dy, weight, y, rule)


@library.register_fake(_block_route_grad_operands_op)
def _(dy, weight, y, rule):
    _check_route_grad(dy, weight, y, rule)
    return (
        *_rows_fake(dy),
        torch.empty_like(dy, dtype=torch.bfloat16, memory_format=torch.contiguous_format),
        dy.new_empty((dy.shape[0],), dtype=torch.float32),
    )


def _check_route_grad_gathered(src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, rule):
    op = "block_route_grad_operands_gathered"
    _check_inputs(op, rule, src=src, y=y)
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64) or index.device != src.device:
        raise ValueError(
            f"mxfx::{op}: index must be an int32 or int64 row index [S] on {src.device}, got {index.dtype} "
            f"{tuple(index.shape)} on {index.device}"
        )
    _check_route_weight(op, y, weight)
    if src.dim() != 2 or y.shape != (index.shape[0], src.shape[1]) or y.device != src.device:
        raise ValueError(
            f"mxfx::{op}: y (the unweighted output) of shape {tuple(y.shape)} on {y.device} must be [S, D] = "
            f"{(index.shape[0], src.shape[-1])} for index [S] into src {tuple(src.shape)} on {src.device}"
        )


def _route_grad_operands_gathered(src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, rule):
    _check_route_grad_gathered(src, index, weight, y, rule)
    q, s, dy16, d_weight = device_path.route_grad_operands_1x128(src, weight, y, rule, rows_of=index)
    return q.contiguous(), column_major(s), dy16, d_weight


@library.custom_op("mxfx::block_route_grad_operands_gathered", mutates_args=())
def _block_route_grad_operands_gathered_op(
    src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _route_grad_operands_gathered(src, index, weight, y, rule)


@library.register_fake(_block_route_grad_operands_gathered_op)
def _(src, index, weight, y, rule):
    _check_route_grad_gathered(src, index, weight, y, rule)
    return (
        *_rows_fake(y),
        torch.empty_like(y, dtype=torch.bfloat16, memory_format=torch.contiguous_format),
        y.new_empty((y.shape[0],), dtype=torch.float32),
    )


def _quantize_tokens(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs("block_quantize_tokens", rule, x=x)
    q, s = device_path.quantize_1x128_colwise(x, rule)
    return q.contiguous(), column_major(s)


@library.custom_op("mxfx::block_quantize_tokens", mutates_args=())
def _block_quantize_tokens_op(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_tokens(x, rule)


def _tokens_fake(x):
    t, k = x.shape
    return x.new_empty((k, t), dtype=_E4M3), _fake_col_major(x, k, n_tiles(t))


@library.register_fake(_block_quantize_tokens_op)
def _(x, rule):
    _check_inputs("block_quantize_tokens", rule, x=x)
    return _tokens_fake(x)


def _quantize_dual(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs("block_quantize_dual", rule, x=x)
    q, s, qt, st = device_path.quantize_1x128_dual(x, rule)
    return q.contiguous(), column_major(s), qt.contiguous(), column_major(st)


@library.custom_op("mxfx::block_quantize_dual", mutates_args=())
def _block_quantize_dual_op(
    x: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_dual(x, rule)


@library.register_fake(_block_quantize_dual_op)
def _(x, rule):
    _check_inputs("block_quantize_dual", rule, x=x)
    return (*_rows_fake(x), *_tokens_fake(x))


def _quantize_grouped_tokens(x: torch.Tensor, offs: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs("block_quantize_grouped_tokens", rule, x=x)
    check_offs("mxfx::block_quantize_grouped_tokens", offs, x)
    q, s = device_path.quantize_1x128_grouped_tokens(x, offs, rule)
    return q.contiguous(), column_major(s)


@library.custom_op("mxfx::block_quantize_grouped_tokens", mutates_args=())
def _block_quantize_grouped_tokens_op(
    x: torch.Tensor, offs: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_grouped_tokens(x, offs, rule)


@library.register_fake(_block_quantize_grouped_tokens_op)
def _(x, offs, rule):
    _check_inputs("block_quantize_grouped_tokens", rule, x=x)
    check_offs("mxfx::block_quantize_grouped_tokens", offs, x)
    t, k = x.shape
    slots = group_tile_capacity(t, offs.shape[0])
    return x.new_empty((k, TILE * slots), dtype=_E4M3), _fake_col_major(x, k, slots)


def _grouped_grad_operands(
    dy: torch.Tensor, weight: torch.Tensor | None, offs: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "block_grouped_grad_operands"
    _check_inputs(op, rule, dy=dy)
    if weight is not None:
        _check_route_weight(op, dy, weight)
    check_offs(f"mxfx::{op}", offs, dy, "dy")
    q, s, qt, st = device_path.quantize_1x128_grouped_dual(dy, offs, rule, weight)
    return q.contiguous(), column_major(s), qt.contiguous(), column_major(st)


@library.custom_op("mxfx::block_grouped_grad_operands", mutates_args=())
def _block_grouped_grad_operands_op(
    dy: torch.Tensor, weight: torch.Tensor | None, offs: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _grouped_grad_operands(dy, weight, offs, rule)


@library.register_fake(_block_grouped_grad_operands_op)
def _(dy, weight, offs, rule):
    op = "block_grouped_grad_operands"
    _check_inputs(op, rule, dy=dy)
    if weight is not None:
        _check_route_weight(op, dy, weight)
    check_offs(f"mxfx::{op}", offs, dy, "dy")
    t, k = dy.shape
    slots = group_tile_capacity(t, offs.shape[0])
    return (*_rows_fake(dy), dy.new_empty((k, TILE * slots), dtype=_E4M3), _fake_col_major(dy, k, slots))


def _check_tokens_src(x: torch.Tensor, tokens_src: torch.Tensor, grouped: bool) -> None:
    """``tokens_src`` has ``x``'s shape; the dense operand's (not ``grouped``) may have more rows, zeros padding a
    symbolic token count (:func:`mxfx.formats.fp8_block.token_rows`). Symbolic rows are compared only where that
    needs no guard (their padded count is not known to be ``>= x``'s), concrete ones always: when the op runs."""
    if grouped:
        fits = tokens_src.shape == x.shape
    else:
        fits = tokens_src.shape[1] == x.shape[1] and not statically_known_true(tokens_src.shape[0] < x.shape[0])
    if not fits:
        more = "" if grouped else ", or its features with more (zero) rows"
        raise ValueError(
            f"mxfx::block_forward_operands: tokens_src of shape {tuple(tokens_src.shape)} must have "
            f"x's shape {tuple(x.shape)}{more}"
        )


def _check_forward_operands(x, up, tokens_src, offs, rule, pack) -> None:
    op = "block_forward_operands"
    _check_inputs(op, rule, x=x, up=up, tokens_src=tokens_src)
    if up is not None:
        _check_pair(op, x, up, "up")
    if tokens_src is not None:
        _check_tokens_src(x, tokens_src, offs is not None)
    if offs is not None:
        check_offs(f"mxfx::{op}", offs, x)
    if pack and up is None:
        raise ValueError(
            f"mxfx::block_forward_operands: pack=True packs the SwiGLU gate and up; got gate {tuple(x.shape)} and no up"
        )


def _fused_forward_operands(x, up, tokens_src, offs, rule, pack) -> list | None:
    """:func:`block_forward_operands` from one kernel, where one kernel writes every pair asked for: ``x`` alone,
    ``x`` with its token-tiled or group-token-tiled copy (``tokens_src is x``), or the SwiGLU product with or
    without the packed inputs; None otherwise."""
    if tokens_src is None and not pack:
        return list(_quantize(x, rule) if up is None else _swiglu_quantize(x, up, rule))
    if tokens_src is None:
        q, s, gq, gs, uq, us = device_path.swiglu_quantize_1x128_save(x, up, rule)
        return [q, column_major(s), gq, column_major(gs), uq, column_major(us)]
    if up is None and not pack and tokens_src is x:
        return list(_quantize_dual(x, rule) if offs is None else _grouped_grad_operands(x, None, offs, rule))
    return None


def _forward_operands_composed(x, up, tokens_src, offs, rule, pack) -> list:
    """:func:`block_forward_operands` through the single-pair ops (on fake tensors these run their own fake
    implementations: the op's fake)."""
    _check_forward_operands(x, up, tokens_src, offs, rule, pack)
    pairs = [_block_swiglu_quantize_op(x, up, rule) if up is not None else _block_quantize_op(x, rule)]
    if tokens_src is not None:
        pairs.append(
            _block_quantize_tokens_op(tokens_src, rule)
            if offs is None
            else _block_quantize_grouped_tokens_op(tokens_src, offs, rule)
        )
    if pack:
        pairs += [_block_quantize_op(x, rule), _block_quantize_op(up, rule)]
    return [t for pair in pairs for t in pair]


@library.custom_op("mxfx::block_forward_operands", mutates_args=())
def _block_forward_operands_op(
    x: torch.Tensor,
    up: torch.Tensor | None,
    tokens_src: torch.Tensor | None,
    offs: torch.Tensor | None,
    rule: str,
    pack: bool,
) -> list[torch.Tensor]:
    _check_forward_operands(x, up, tokens_src, offs, rule, pack)
    fused = _fused_forward_operands(x, up, tokens_src, offs, rule, pack)
    return fused if fused is not None else _forward_operands_composed(x, up, tokens_src, offs, rule, pack)


library.register_fake(_block_forward_operands_op)(_forward_operands_composed)


def _forward_operands_traced(x, up, tokens_src, offs, rule, pack) -> list:
    """Traced on CUDA: the one kernel of :func:`_fused_forward_operands` enters the graph; a combination no single
    kernel writes stays the opaque op (separate kernels would let the partitioner move the pairs only the backward
    reads into the backward, see :func:`block_forward_operands`)."""
    _check_forward_operands(x, up, tokens_src, offs, rule, pack)
    fused = _fused_forward_operands(x, up, tokens_src, offs, rule, pack)
    return fused if fused is not None else _block_forward_operands_op(x, up, tokens_src, offs, rule, pack)


_fp32_out_refused: list[str] = []  # cuBLAS's refusal of a float32 output, once seen


def _mm(
    a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    if not (a.is_cuda and out_dtype == torch.float32):
        return gemm.scaled_mm(a, a_scales, b, b_scales, out_dtype)
    if not _fp32_out_refused:
        try:
            return gemm.scaled_mm(a, a_scales, b, b_scales, out_dtype)
        except RuntimeError as e:
            _fp32_out_refused.append(str(e.__cause__ or e))
            warnings.warn(
                f"mxfx::block_mm: cuBLAS refused a float32 output for blockwise FP8 ({_fp32_out_refused[0][:200]}); "
                f"weight gradients come out of the GEMM in bf16 and are widened to float32",
                stacklevel=2,
            )
    return gemm.scaled_mm(a, a_scales, b, b_scales, torch.bfloat16).float()


@library.custom_op("mxfx::block_mm", mutates_args=())
def _block_mm_op(
    a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return _mm(a, a_scales, b, b_scales, out_dtype)


@library.register_fake(_block_mm_op)
def _(a, a_scales, b, b_scales, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _mm_traced(a, a_scales, b, b_scales, out_dtype):
    """Traced on CUDA: cuBLAS's blockwise GEMM (``torch._scaled_mm``) and its operand layouts enter the graph; a
    float32 output stays the opaque op, which can fall back where cuBLAS refuses it."""
    if out_dtype == torch.float32:
        return _block_mm_op(a, a_scales, b, b_scales, out_dtype)
    return gemm.scaled_mm(a, a_scales, b, b_scales, out_dtype)


@library.custom_op("mxfx::block_grouped_mm", mutates_args=())
def block_grouped_mm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`mxfx.kernels.fp8_block.gemm.grouped_mm`, always an opaque op: its Triton launch builds host TMA
    descriptors and autotunes with a pre-hook, which ``wrap_triton`` cannot trace."""
    return gemm.grouped_mm(a, a_scales, b, b_scales, offs, out_dtype)


@library.register_fake(block_grouped_mm)
def _(a, a_scales, b, b_scales, offs, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@library.custom_op("mxfx::block_grouped_wgrad", mutates_args=())
def block_grouped_wgrad(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`mxfx.kernels.fp8_block.gemm.grouped_wgrad` (an opaque op: not on the default policy's hot path)."""
    return gemm.grouped_wgrad(a, a_scales, b, b_scales, offs, out_dtype)


@library.register_fake(block_grouped_wgrad)
def _(a, a_scales, b, b_scales, offs, out_dtype):
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype)


@library.custom_op("mxfx::block_mm_into", mutates_args=("out",))
def block_mm_into(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
) -> None:
    """``mxfx::block_mm`` (a wgrad's 1x128-tiled ``[N, T]`` and ``[K, T]``) written into float32 ``out [N, K]``
    (``accumulate=False``) or added to it (``True``): a weight gradient accumulated in the parameter's ``.grad``
    (:mod:`mxfx.runtime.main_grad`). On the CPU by the reference's GEMM itself; on CUDA cuBLAS's blockwise GEMM
    has no accumulating output, so its result is added (or copied) in one more pass."""
    if a.is_cuda:
        accumulate_into(out, _mm(a, a_scales, b, b_scales, out.dtype), accumulate)
    else:
        gemm.reference_mm_into(a, a_scales, b, b_scales, out, accumulate)


@library.register_fake(block_mm_into)
def _(a, a_scales, b, b_scales, out, accumulate):
    return None


@library.custom_op("mxfx::block_grouped_wgrad_into", mutates_args=("out",))
def block_grouped_wgrad_into(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
) -> None:
    """``mxfx::block_grouped_wgrad`` written into float32 ``out [G, N, K]`` or added to it
    (:func:`mxfx.kernels.fp8_block.gemm.grouped_wgrad` with ``out``): by the reference's GEMMs themselves on the CPU,
    by the Triton kernel's epilogue on CUDA."""
    gemm.grouped_wgrad(a, a_scales, b, b_scales, offs, out=out, accumulate=accumulate)


@library.register_fake(block_grouped_wgrad_into)
def _(a, a_scales, b, b_scales, offs, out, accumulate):
    return None


# --- what callers use: the custom op, or its body when traced on CUDA (mxfx.kernels.common.launch) ---------

block_quantize = op_or_body(
    _block_quantize_op,
    _quantize,
    """``x [M, K]`` -> ``(qdata [M, K], scales
[M, ceil(K/128)])``, 1x128 along K (``mxfx::block_quantize``).""",
)
block_swiglu_quantize = op_or_body(
    _block_swiglu_quantize_op,
    _swiglu_quantize,
    """:func:`block_quantize` of
``silu(gate) * up`` formed in fp32 (``mxfx::block_swiglu_quantize``).""",
)
block_route_weight_quantize = op_or_body(
    _block_route_weight_quantize_op,
    _route_weight_quantize,
    """:func:`block_quantize` of
``dy [S, D] * weight[:, None]`` formed in fp32 (``mxfx::block_route_weight_quantize``).""",
)
block_route_grad_operands = op_or_body(
    _block_route_grad_operands_op,
    _route_grad_operands,
    """The backward operands of a
route-weighted grouped GEMM from one read of its output gradient ``dy [S, D]`` (route weights ``weight [S]``,
unweighted output ``y [S, D]``): :func:`block_route_weight_quantize`'s pair, ``dy * weight[:, None]`` in BF16 and
``sum(dy * y, -1)`` in fp32 ``[S]`` (``mxfx::block_route_grad_operands``).""",
)
block_route_grad_operands_gathered = op_or_body(
    _block_route_grad_operands_gathered_op,
    _route_grad_operands_gathered,
    """:func:`block_route_grad_operands`
of ``src[index]`` (``src [T, D]``, ``index [S]`` integers in range), its rows read where the kernel needs them, never
written out as ``[S, D]`` (``mxfx::block_route_grad_operands_gathered``).""",
)
block_quantize_tokens = op_or_body(
    _block_quantize_tokens_op,
    _quantize_tokens,
    """``x [T, K]`` -> ``(qdata [K, T],
scales [K, ceil(T/128)])``, 1x128 along the tokens (``mxfx::block_quantize_tokens``).""",
)
block_quantize_dual = op_or_body(
    _block_quantize_dual_op,
    _quantize_dual,
    """:func:`block_quantize` and
:func:`block_quantize_tokens` of ``x [T, K]`` from one read (``mxfx::block_quantize_dual``).""",
)
block_quantize_grouped_tokens = op_or_body(
    _block_quantize_grouped_tokens_op,
    _quantize_grouped_tokens,
    """``x [S, K]``,
``offs`` -> ``(qdata [K, S], scales [K, C])``, 1x128 along each group's tokens
(``mxfx::block_quantize_grouped_tokens``).""",
)
block_grouped_grad_operands = op_or_body(
    _block_grouped_grad_operands_op,
    _grouped_grad_operands,
    """Both operands of a routed
gradient from one read (``mxfx::block_grouped_grad_operands``): ``dy [S, D]`` (times ``weight[:, None]``, one
route weight per row, formed in fp32, where ``weight`` is given) -> ``(qdata [S, D], scales [S, ceil(D/128)])`` of
:func:`block_quantize` (the dgrad operand) and ``(qdata [D, 128 C], scales [D, C])`` of
:func:`block_quantize_grouped_tokens` (the wgrad operand).""",
)
block_forward_operands = op_or_body(
    _block_forward_operands_op,
    _forward_operands_traced,
    """Every fp8_block
quantization a forward makes of one GEMM input, as one op (``mxfx::block_forward_operands``): ``[qdata, scales]``
of the forward operand (``x``, or ``silu(x) * up`` with ``up``), then, with ``tokens_src``, its token-tiled wgrad
operand (:func:`block_quantize_tokens`, or with ``offs`` :func:`block_quantize_grouped_tokens`; without ``offs``
``tokens_src`` may carry zero rows past x's, a symbolic token count padded), then, with
``pack``, the 1x128 pairs of ``x`` and ``up`` (the SwiGLU inputs saved for backward).

One op (one kernel where one writes them all) because the forward reads its first pair: AOTAutograd's
partitioner moves a forward op whose outputs only the backward reads into the backward, and saves that op's input
instead, in BF16 (twice the bytes of the FP8 copy the policy asked to save).

Raises:
    TypeError: an input that is not bfloat16, float16 or float32 (the message names it).
    ValueError: a tensor that is not 2D or has no features, ``up`` or ``tokens_src`` not of ``x``'s shape (a dense
        ``tokens_src`` with fewer rows or other features), ``offs``
        not int32 ``[G]`` on x's device (on the CPU also decreasing or past x's rows), an unknown rule, or ``pack``
        without ``up``.""",
)
block_mm = op_or_body(
    _block_mm_op,
    _mm_traced,
    """:func:`mxfx.kernels.fp8_block.gemm.scaled_mm` (``mxfx::block_mm``).
A float32 result (the weight gradient) that a cuBLAS build refuses for blockwise scaling is computed in bf16 and
widened, with a warning once per process.""",
)

name_op_functions(globals())
