"""fp8_block GEMMs: dense through cuBLAS (``torch._scaled_mm``), grouped through Gluon or Triton, plain torch on CPU.

Both compute ``A @ B^T`` on operands tiled along the reduction dim K (``mxfx.numerics.block``):

* :func:`scaled_mm`: A ``[M, K]`` with 1x128 scales ``[M, ceil(K/128)]``; B ``[N, K]`` with either
  128x128 scales ``[ceil(N/128), ceil(K/128)]`` (a weight: forward and dgrad) or 1x128 scales
  ``[N, ceil(K/128)]`` (wgrad, where both operands are tiled along the tokens).
* :func:`grouped_mm`: A ``[S, K]`` 1x128, B ``[G, N, K]`` 128x128 per group, rows grouped by
  cumulative ends ``offs`` (``torch._grouped_mm``'s convention); :mod:`mxfx.kernels.fp8_block.grouped_gemm_triton`.

This module checks the operands and chooses the kernel: on CUDA the dense GEMM is cuBLAS's blockwise FP8 GEMM
(sm90+, :mod:`mxfx.kernels.fp8_block.gemm_cublas`), the grouped one the Gluon sm90 kernel or the Triton one
(:func:`grouped_kernel_name`); elsewhere (CPU) both are the reference decode held here: dequantize each operand to
float32 exactly, then a float32 GEMM. GPU results agree with it up to float32 summation order and Hopper's FP8
accumulation (tests/test_block_gemm.py states the bounds).
"""

from __future__ import annotations

import functools

import torch

from mxfx.numerics.block import TILE, check_group_slots, dequantize_values, group_tile_starts, n_tiles, tiled_rows
from mxfx.device import has_triton, triton_available
from mxfx.kernels.common.gemm import check_out_dtype, mm_into
from mxfx.kernels.common.launch import env_switch
from mxfx.kernels.fp8_block import gemm_cublas
from mxfx.numerics.layout import check_group_ends


def _check_operand(t, s, op, name, scale_shapes):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"{op}: {name} must be a torch.float8_e4m3fn tensor, got {getattr(t, 'dtype', type(t).__name__)}"
        )
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        raise TypeError(f"{op}: {name} scales must be a float32 tensor, got {getattr(s, 'dtype', type(s).__name__)}")
    if tuple(s.shape) not in [tuple(x) for x in scale_shapes]:
        wanted = " or ".join(str(tuple(x)) for x in scale_shapes)
        raise ValueError(f"{op}: {name} of shape {tuple(t.shape)} needs scales of shape {wanted}, got {tuple(s.shape)}")
    if s.device != t.device:
        raise ValueError(f"{op}: {name} is on {t.device} but its scales are on {s.device}; move them to one device")


def scaled_mm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``A @ B^T`` for fp8_block operands (module docstring): ``[M, K] x [N, K] -> [M, N]`` in ``out_dtype``.

    Raises:
        TypeError: operands not E4M3, scales not float32, unknown out_dtype.
        ValueError: shapes or devices that do not pair up (the message names them).
    """
    op = "mxfx.block_gemm.scaled_mm"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{op}: needs A [M, K] and B [N, K] with one K, got {tuple(a.shape)} and {tuple(b.shape)}")
    (m, k), n = a.shape, b.shape[0]
    _check_operand(a, a_scales, op, "A", [(m, n_tiles(k))])
    _check_operand(b, b_scales, op, "B", [(n_tiles(n), n_tiles(k)), (n, n_tiles(k))])
    check_out_dtype(out_dtype, op)
    if a.device != b.device:
        raise ValueError(f"{op}: A is on {a.device} but B is on {b.device}")
    if a.is_cuda:
        return gemm_cublas.mm(a, a_scales, b, b_scales, out_dtype)
    return reference_mm(a, a_scales, b, b_scales, out_dtype)


def reference_mm(a, a_scales, b, b_scales, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The reference decode of :func:`scaled_mm`: exact float32 operands, a float32 GEMM, one cast."""
    a, b = _decoded(a, a_scales, b, b_scales)
    return (a @ b.t()).to(out_dtype)


def reference_mm_into(a, a_scales, b, b_scales, out: torch.Tensor, accumulate: bool) -> None:
    """:func:`reference_mm` written into float32 ``out [M, N]`` (``accumulate=False``) or added to it (``True``) by
    the float32 GEMM itself (:func:`mxfx.kernels.common.gemm.mm_into`): a weight gradient accumulated in the
    parameter's ``.grad``."""
    mm_into(out, *_decoded(a, a_scales, b, b_scales), accumulate)


def _decoded(a, a_scales, b, b_scales) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands of :func:`scaled_mm` decoded exactly to float32 (B's scales 1x128 or 128x128)."""
    b_dims = (-1,) if tiled_rows(b, b_scales) else (-2, -1)
    return dequantize_values(a, a_scales, (-1,)), dequantize_values(b, b_scales, b_dims)


def grouped_mm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Grouped ``A @ B[g]^T`` for fp8_block operands (module docstring): ``[S, K] x [G, N, K] -> [S, N]``.

    Group g owns rows ``[offs[g-1], offs[g])`` (``offs`` int32 ``[G]``, cumulative, non-decreasing,
    at most S); rows past ``offs[-1]`` come out as zeros. Triton on CUDA, the reference decode elsewhere.

    Raises:
        TypeError / ValueError: dtypes, shapes or devices that do not pair up (named in the message).
    """
    op = "mxfx.block_gemm.grouped_mm"
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2]:
        raise ValueError(f"{op}: needs A [S, K] and B [G, N, K] with one K, got {tuple(a.shape)} and {tuple(b.shape)}")
    (s, k), (g, n, _) = a.shape, b.shape
    _check_operand(a, a_scales, op, "A", [(s, n_tiles(k))])
    _check_operand(b, b_scales, op, "B", [(g, n_tiles(n), n_tiles(k))])
    check_out_dtype(out_dtype, op)
    if (
        offs.dtype != torch.int32
        or tuple(offs.shape) != (g,)
        or not offs.is_contiguous()
        or offs.device != a.device
        or b.device != a.device
    ):
        raise ValueError(
            f"{op}: offs must be contiguous int32 of shape ({g},) on {a.device} beside B on {b.device}; got "
            f"{offs.dtype} {tuple(offs.shape)} with strides {offs.stride()} on {offs.device}"
        )
    if triton_available(a):
        return _grouped_kernel(a, b, out_dtype).grouped_mm(a, a_scales, b, b_scales, offs, out_dtype)
    return reference_grouped_mm(a, a_scales, b, b_scales, offs, out_dtype)


SM90_ENV = "MXFX_GROUPED_SM90"
"""Switch (read at each call): 1/true/yes/on runs forward and dgrad on the warp-specialized sm90 kernel wherever it
serves the operands, 0/false/no/off on the Triton kernel; unset, :data:`SM90_MAX_K` chooses."""

SM90_MAX_K = 4096
"""Largest K (reduction length) for which the sm90 kernel is the default. On an H100 it measured 0.95-1.45x the
Triton kernel at the routed shapes of OLMoE, Qwen3-30B-A3B and Mixtral-8x7B's gate/up (K 768-4096; +3.6% tokens/s
in the OLMoE step) and 0.82-1.06x at K 7168 and 14336 (DeepSeek-V3's gate/up, Mixtral's down): docs/kernel-notes.md,
2026-12-06."""


def _grouped_kernel(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype):
    """The module whose ``grouped_mm`` runs on these CUDA operands: the warp-specialized sm90 kernel
    (:mod:`mxfx.kernels.fp8_block.grouped_gemm_sm90`) where it serves them and :func:`_sm90_wanted`, else the
    Triton kernel (:mod:`mxfx.kernels.fp8_block.grouped_gemm_triton`)."""
    from mxfx.kernels.fp8_block import grouped_gemm_triton

    sm90 = _sm90_kernel() if _sm90_wanted(a.shape[1]) else None
    return sm90 if sm90 is not None and sm90.supported(a, b, out_dtype) else grouped_gemm_triton


def _sm90_wanted(k: int) -> bool:
    """:data:`SM90_ENV` where set, else ``k <= SM90_MAX_K``."""
    chosen = env_switch(SM90_ENV, None)
    return k <= SM90_MAX_K if chosen is None else chosen


def grouped_kernel_name(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> str:
    """Which kernel :func:`grouped_mm` launches for these operands: "sm90 warp-specialized", "Triton" or
    "reference" (not CUDA)."""
    if not triton_available(a):
        return "reference"
    return "sm90 warp-specialized" if _grouped_kernel(a, b, out_dtype).__name__.endswith("_sm90") else "Triton"


def grouped_kernel_for(device: torch.device, k: int, n: int, out_dtype: torch.dtype) -> str:
    """:func:`grouped_kernel_name` from shapes alone (what a compiled graph will run, its operands contiguous as the
    quantize ops and weight caches write them; :data:`SM90_ENV` as set now): "sm90 warp-specialized", "Triton" or
    "reference"."""
    if device.type != "cuda" or not has_triton():
        return "reference"
    sm90 = _sm90_kernel() if _sm90_wanted(k) else None
    return "sm90 warp-specialized" if sm90 is not None and sm90.serves(device, k, n, out_dtype) else "Triton"


@functools.cache
def _sm90_kernel():
    """:mod:`mxfx.kernels.fp8_block.grouped_gemm_sm90`, or None where this Triton has no Gluon Hopper API."""
    try:
        from mxfx.kernels.fp8_block import grouped_gemm_sm90
    except ImportError:
        return None
    return grouped_gemm_sm90


def reference_grouped_mm(a, a_scales, b, b_scales, offs, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The reference decode of :func:`grouped_mm`: exact float32 operands, one float32 GEMM per group (each
    group's weight decoded on its own, so the memory it takes is one expert's, not all of them)."""
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    ends = offs.tolist()
    check_group_ends(ends, a.shape[0], "mxfx.block_gemm.grouped_mm")
    start = 0
    for gi, end in enumerate(ends):
        if end > start:
            x = dequantize_values(a[start:end], a_scales[start:end], (-1,))
            out[start:end] = x @ dequantize_values(b[gi], b_scales[gi], (-2, -1)).t()
        start = end
    return out.to(out_dtype)


def grouped_wgrad(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Grouped wgrad ``dW[g] = A[:, tokens of g] @ B[:, tokens of g]^T``: ``[N, 128 C] x [K, 128 C] -> [G, N, K]``.

    A (dY^T) and B (X^T) are E4M3 in 1x128 tiles along the tokens that restart at each group start, one tile per
    128-column slot, as ``mxfx.kernels.fp8_block.quantize.quantize_1x128_grouped_tokens`` writes them (+0 past each
    group's end): scales ``[N, C]`` and ``[K, C]`` with ``C = mxfx.numerics.block.group_tile_capacity(S, G)`` for S
    routed tokens, group g's tiles at slots ``group_tile_starts(offs)[g] + j``. An empty group's dW is zeros.
    Triton on CUDA, the reference decode elsewhere (which checks ``offs`` against the operands' slots on the host;
    CUDA reads no ``offs`` on the host: pass the group ends the operands were quantized with).

    With ``out`` (float32 ``[G, N, K]``, a parameter's gradient) the result is written there (``accumulate=False``)
    or added to it (``True``) and ``out`` is returned (``out_dtype`` is then ``out``'s): on the CPU by the reference's
    GEMMs themselves, on CUDA by the Triton kernel's epilogue (no result tensor, no second pass).

    Raises:
        TypeError / ValueError: dtypes, shapes or devices that do not pair up (named in the message), an ``out``
        that is not float32 ``[G, N, K]`` on A's device.
    """
    op = "mxfx.block_gemm.grouped_wgrad"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.shape[1] % TILE:
        raise ValueError(
            f"{op}: needs A [N, 128 C] and B [K, 128 C] with one C (token slots, as quantize_1x128_grouped_tokens "
            f"writes them), got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    (n, width), k, g = a.shape, b.shape[0], offs.numel()
    cap = width // TILE
    _check_operand(a, a_scales, op, "A", [(n, cap)])
    _check_operand(b, b_scales, op, "B", [(k, cap)])
    check_out_dtype(out_dtype, op)
    if (
        offs.dtype != torch.int32
        or offs.dim() != 1
        or not offs.is_contiguous()
        or {offs.device, b.device} != {a.device}
    ):
        raise ValueError(
            f"{op}: offs must be contiguous int32 [G] on {a.device} beside B on {b.device}; got {offs.dtype} "
            f"{tuple(offs.shape)} with strides {offs.stride()} on {offs.device}"
        )
    if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != (g, n, k) or out.device != a.device):
        raise ValueError(
            f"{op}: out must be float32 {(g, n, k)} on {a.device} (the gradient [G, N, K] it writes), got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if triton_available(a):
        from mxfx.kernels.fp8_block import grouped_gemm_triton

        sm90 = _wgrad_sm90_kernel() if env_switch(WGRAD_SM90_ENV, False) and out_dtype == torch.float32 else None
        if sm90 is not None:
            into = out if out is not None else torch.empty((g, n, k), dtype=torch.float32, device=a.device)
            if sm90.supported(a, b, into):
                return sm90.grouped_wgrad(a, a_scales, b, b_scales, offs, into, accumulate and out is not None)
        return grouped_gemm_triton.grouped_wgrad(
            a, a_scales, b, b_scales, offs, out_dtype, out=out, accumulate=accumulate
        )
    return reference_grouped_wgrad(a, a_scales, b, b_scales, offs, out_dtype, out, accumulate)


WGRAD_SM90_ENV = "MXFX_BLOCK_WGRAD_SM90"
"""Switch (read at each call): 1/true/yes/on runs :func:`grouped_wgrad` with an FP32 result on the warp-specialized
sm90 kernel (:mod:`mxfx.kernels.fp8_block.grouped_wgrad_sm90`) wherever it serves the operands; unset or off, on
the Triton kernel. Opt-in until the kernel's GPU tests and timings are in (docs/kernel-notes.md)."""


@functools.cache
def _wgrad_sm90_kernel():
    """:mod:`mxfx.kernels.fp8_block.grouped_wgrad_sm90`, or None where this Triton has no Gluon Hopper API."""
    try:
        from mxfx.kernels.fp8_block import grouped_wgrad_sm90
    except ImportError:
        return None
    return grouped_wgrad_sm90


def reference_grouped_wgrad(
    a, a_scales, b, b_scales, offs, out_dtype=torch.float32, out=None, accumulate=False
) -> torch.Tensor:
    """The reference decode of :func:`grouped_wgrad`: exact float32 operands per group, one float32 GEMM each,
    writing (or adding into) ``out`` when given."""
    into = (
        out
        if out is not None
        else torch.empty((offs.numel(), a.shape[0], b.shape[0]), dtype=torch.float32, device=a.device)
    )
    ends = offs.tolist()
    check_group_slots(ends, a.shape[1] // TILE, "mxfx.block_gemm.grouped_wgrad")
    starts = group_tile_starts(offs).tolist()
    start = 0
    for gi, end in enumerate(ends):
        if end > start:
            slots = slice(starts[gi], starts[gi] + n_tiles(end - start))
            cols = slice(TILE * slots.start, TILE * slots.start + end - start)  # the group's tokens, no padding
            x = dequantize_values(a[:, cols], a_scales[:, slots], (-1,))
            w = dequantize_values(b[:, cols], b_scales[:, slots], (-1,))
            mm_into(into[gi], x, w, accumulate)
        elif not accumulate:
            into[gi].zero_()
        start = end
    return into if out is not None else into.to(out_dtype)
