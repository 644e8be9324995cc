"""The fp8_block kernels as torch custom ops (``mxfx::block_*``), so compiled graphs hold them opaquely.

Bodies dispatch per device (:mod:`mxfx.kernels.block_device_path`, :mod:`mxfx.kernels.block_gemm`): Triton and
cuBLAS on CUDA, the exact reference decode on CPU (whose grouped paths read group ends on the host: fine
inside an op, not in a trace). Every 1x128 scale matrix an op returns is column-major (stride ``(1, rows)``,
what cuBLAS reads; the fake implementations say so too), every qdata contiguous.

* ``block_quantize(x [M, K], rule)`` -> ``(qdata [M, K], scales [M, ceil(K/128)])``, 1x128 along K;
* ``block_swiglu_quantize(gate, up, rule)``: the same of ``silu(gate) * up`` formed in fp32;
* ``block_quantize_tokens(x [T, K], rule)`` -> ``([K, T], [K, ceil(T/128)])``, 1x128 along tokens;
* ``block_quantize_grouped_tokens(x [S, K], offs, rule)`` -> ``([K, S], [K, C])``, tiles restarting at every
  group start (``C = mxfx.block_format.group_tile_capacity(S, G)``);
* ``block_forward_operands(x, up, tokens_src, offs, rule, pack)``: every quantization a forward makes of one
  GEMM input, in one op (see there);
* ``block_mm``, ``block_grouped_mm``, ``block_grouped_wgrad``: :mod:`mxfx.kernels.block_gemm`'s GEMMs.
"""

from __future__ import annotations

import warnings

import torch

from mxfx.block_format import group_tile_capacity, n_tiles
from mxfx.kernels import block_device_path, block_gemm

_E4M3 = torch.float8_e4m3fn


def _col_major(s: torch.Tensor) -> torch.Tensor:
    return s.t().contiguous().t()


def _fake_col_major(like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return like.new_empty((cols, rows), dtype=torch.float32).t()


def _check_2d(x: torch.Tensor, op: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"mxfx::{op}: needs a 2D tensor, got shape {tuple(x.shape)}; flatten the leading dims first")


@torch.library.custom_op("mxfx::block_quantize", mutates_args=())
def block_quantize(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d(x, "block_quantize")
    q, s = block_device_path.quantize_1x128(x, rule)
    return q.contiguous(), _col_major(s)


@block_quantize.register_fake
def _(x, rule):
    _check_2d(x, "block_quantize")
    return torch.empty_like(x, dtype=_E4M3, memory_format=torch.contiguous_format), _fake_col_major(x, x.shape[0], n_tiles(x.shape[1]))


@torch.library.custom_op("mxfx::block_swiglu_quantize", mutates_args=())
def block_swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d(gate, "block_swiglu_quantize")
    q, s = block_device_path.swiglu_quantize_1x128(gate, up, rule)
    return q.contiguous(), _col_major(s)


@block_swiglu_quantize.register_fake
def _(gate, up, rule):
    _check_2d(gate, "block_swiglu_quantize")
    return (torch.empty_like(gate, dtype=_E4M3, memory_format=torch.contiguous_format),
            _fake_col_major(gate, gate.shape[0], n_tiles(gate.shape[1])))


@torch.library.custom_op("mxfx::block_quantize_tokens", mutates_args=())
def block_quantize_tokens(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d(x, "block_quantize_tokens")
    q, s = block_device_path.quantize_1x128_colwise(x, rule)
    return q.contiguous(), _col_major(s)


@block_quantize_tokens.register_fake
def _(x, rule):
    _check_2d(x, "block_quantize_tokens")
    t, k = x.shape
    return x.new_empty((k, t), dtype=_E4M3), _fake_col_major(x, k, n_tiles(t))


@torch.library.custom_op("mxfx::block_quantize_grouped_tokens", mutates_args=())
def block_quantize_grouped_tokens(x: torch.Tensor, offs: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d(x, "block_quantize_grouped_tokens")
    q, s = block_device_path.quantize_1x128_grouped_tokens(x, offs, rule)
    return q.contiguous(), _col_major(s)


@block_quantize_grouped_tokens.register_fake
def _(x, offs, rule):
    _check_2d(x, "block_quantize_grouped_tokens")
    t, k = x.shape
    return x.new_empty((k, t), dtype=_E4M3), _fake_col_major(x, k, group_tile_capacity(t, offs.shape[0]))


def _forward_operands(x, up, tokens_src, offs, rule, pack) -> list:
    """Body of :func:`block_forward_operands`, real and fake alike (on fake tensors the ops it calls run their
    own fake implementations)."""
    _check_2d(x, "block_forward_operands")
    if pack and up is None:
        raise ValueError(f"mxfx::block_forward_operands: pack=True packs the SwiGLU gate and up; got gate {tuple(x.shape)} "
                         f"and no up")
    pairs = [block_swiglu_quantize(x, up, rule) if up is not None else block_quantize(x, rule)]
    if tokens_src is not None:
        pairs.append(block_quantize_tokens(tokens_src, rule) if offs is None
                     else block_quantize_grouped_tokens(tokens_src, offs, rule))
    if pack:
        pairs += [block_quantize(x, rule), block_quantize(up, rule)]
    return [t for pair in pairs for t in pair]


@torch.library.custom_op("mxfx::block_forward_operands", mutates_args=())
def block_forward_operands(x: torch.Tensor, up: torch.Tensor | None, tokens_src: torch.Tensor | None,
                           offs: torch.Tensor | None, rule: str, pack: bool) -> list[torch.Tensor]:
    """Every fp8_block quantization a forward makes of one GEMM input, as one op: ``[qdata, scales]`` of the
    forward operand (``x``, or ``silu(x) * up`` with ``up``: :func:`block_quantize` / :func:`block_swiglu_quantize`),
    then, with ``tokens_src``, its token-tiled wgrad operand (:func:`block_quantize_tokens`, or with ``offs``
    :func:`block_quantize_grouped_tokens`), then, with ``pack``, the 1x128 pairs of ``x`` and ``up`` (the SwiGLU
    inputs saved for backward).

    One op because the forward reads its first pair: AOTAutograd's partitioner moves a forward op whose outputs
    only the backward reads into the backward, and saves that op's input instead, in BF16 (twice the bytes of the
    FP8 copy the policy asked to save).

    Raises:
        ValueError: a tensor that is not 2D, or ``pack`` without ``up``.
    """
    return _forward_operands(x, up, tokens_src, offs, rule, pack)


block_forward_operands.register_fake(_forward_operands)


_fp32_out_refused: list[str] = []  # cuBLAS's refusal of a float32 output, once seen


@torch.library.custom_op("mxfx::block_mm", mutates_args=())
def block_mm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`mxfx.kernels.block_gemm.scaled_mm`. A float32 result (the weight gradient) that a cuBLAS build
    refuses for blockwise scaling is computed in bf16 and widened, with a warning once per process."""
    if not (a.is_cuda and out_dtype == torch.float32):
        return block_gemm.scaled_mm(a, a_scales, b, b_scales, out_dtype)
    if not _fp32_out_refused:
        try:
            return block_gemm.scaled_mm(a, a_scales, b, b_scales, out_dtype)
        except RuntimeError as e:
            _fp32_out_refused.append(str(e.__cause__ or e))
            warnings.warn(f"mxfx::block_mm: cuBLAS refused a float32 output for blockwise FP8 ({_fp32_out_refused[0][:200]}); "
                          f"weight gradients come out of the GEMM in bf16 and are widened to float32", stacklevel=2)
    return block_gemm.scaled_mm(a, a_scales, b, b_scales, torch.bfloat16).float()


@block_mm.register_fake
def _(a, a_scales, b, b_scales, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op("mxfx::block_grouped_mm", mutates_args=())
def block_grouped_mm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                     offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return block_gemm.grouped_mm(a, a_scales, b, b_scales, offs, out_dtype)


@block_grouped_mm.register_fake
def _(a, a_scales, b, b_scales, offs, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("mxfx::block_grouped_wgrad", mutates_args=())
def block_grouped_wgrad(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                        offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return block_gemm.grouped_wgrad(a, a_scales, b, b_scales, offs, out_dtype)


@block_grouped_wgrad.register_fake
def _(a, a_scales, b, b_scales, offs, out_dtype):
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype)
