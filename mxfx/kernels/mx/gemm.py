"""MX GEMM: ``C = A @ B^T`` with both operands MXFP8-blocked along the reduction dim.

Every GEMM of a linear is written in this one orientation (``docs/format.md``,
"GEMM operand orientation"): forward ``X[M,K] . W[N,K]^T``, dgrad
``dY[M,N] . (W^T)[K,N]^T``, wgrad ``dY^T[N,M] . X^T[K,M]^T``. Callers quantize
each operand so that its last dim is the reduction dim.

Three custom ops (``mxfx::mm``, ``mxfx::grouped_mm``, ``mxfx::grouped_mm_wgrad``) run one of two
implementations, as their ``native`` argument says: the MXFP8 format (:mod:`mxfx.formats.mxfp8`) passes True where
its ``native_gemms`` list the op for the device's architecture.

* native (sm100 all three, sm120 dense only): ``torch._scaled_mm`` / ``torch._scaled_grouped_mm``,
  :mod:`mxfx.kernels.mx.gemm_blackwell`.
* emulated (Hopper, older GPUs, CPU), held here: both operands dequantized exactly (fp32 on CPU, bf16 on CUDA,
  exact for E4M3 x 2^e except scales below 2^-118) and multiplied with fp32 accumulation: equal to a
  native MX GEMM up to summation order. Operands may arrive already dequantized (``a_dequantized``
  from the quantize pass, ``b_dequantized`` from the weight cache under ``keep_dequantized_weights``).
"""

from __future__ import annotations

import torch

from mxfx.kernels.common import gemm as common_gemm
from mxfx.kernels.common.gemm import accumulate_into, rows_in_groups
from mxfx.kernels.mx import gemm_blackwell
from mxfx.kernels.mx.device_path import dequantize_lastdim
from mxfx.kernels.common.launch import name_op_functions, op_or_body

# --- emulation (any device) --------------------------------------------------------------------


def emulation_dtype(device: torch.device) -> torch.dtype:
    """The dtype emulated GEMMs dequantize into: fp32 on CPU, bf16 on CUDA (exact for E4M3 x 2^e)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _device(*tensors) -> torch.device:
    """The device of the first tensor given (operands may arrive as dequantized values alone)."""
    for t in tensors:
        if t is not None:
            return t.device
    raise ValueError(
        "mxfx.gemm: A has neither an MX pair (qdata and scales) nor dequantized values; pass its qdata and scales, "
        "or a_dequantized to an emulated GEMM"
    )


def _dequantized(a_qdata, a_scales, b_qdata, b_scales, b_dequantized=None, a_dequantized=None, dims=None):
    """Both operands dequantized exactly, in the emulation dtype of their device; ``dims`` = (A's, B's)
    number of dims the calling GEMM takes (checked, so a wrong operand is named, not left to torch).

    ``b_dequantized`` (the cached BF16 weight) replaces dequantizing B when given, ``a_dequantized``
    (written by the activation's quantize pass, :func:`mxfx.kernels.mx.operands.quantize_operand`) dequantizing A.
    """
    for name, q, sc, hat in (("A", a_qdata, a_scales, a_dequantized), ("B", b_qdata, b_scales, b_dequantized)):
        if hat is None and (q is None or sc is None):
            raise ValueError(
                f"mxfx.gemm: {name} has neither an MX pair (qdata and scales) nor dequantized values; pass its "
                f"qdata and scales, or {name.lower()}_dequantized to an emulated GEMM"
            )
        if hat is not None and (not hat.is_floating_point() or hat.element_size() < 2):
            raise TypeError(
                f"mxfx.gemm: {name.lower()}_dequantized of shape {tuple(hat.shape)} has dtype {hat.dtype}; it holds "
                f"dequantized values (bf16/fp16/fp32), not qdata or integers"
            )
        if hat is not None and q is not None and hat.shape != q.shape:
            raise ValueError(
                f"mxfx.gemm: {name.lower()}_dequantized of shape {tuple(hat.shape)} is not the dequantization of "
                f"{name}'s qdata of shape {tuple(q.shape)}; pass the values its quantize pass wrote"
            )
    cdt = emulation_dtype(_device(a_qdata, a_dequantized))
    # Plain kernel calls, not the mxfx::dequantize op: this runs inside a GEMM op's own implementation
    # (or is traced into a CUDA graph), where a nested custom op would only add dispatcher overhead.
    a = dequantize_lastdim(a_qdata, a_scales, cdt) if a_dequantized is None else a_dequantized.to(cdt)
    b = dequantize_lastdim(b_qdata, b_scales, cdt) if b_dequantized is None else b_dequantized.to(cdt)
    if dims is not None and (a.dim(), b.dim()) != dims:
        raise ValueError(
            f"mxfx.gemm: A of shape {tuple(a.shape)} and B of shape {tuple(b.shape)} must be {dims[0]}D and "
            f"{dims[1]}D for this GEMM"
        )
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"mxfx.gemm: A of shape {tuple(a.shape)} and B of shape {tuple(b.shape)} must share their last "
            f"(reduction) dim: C = A @ B^T with both operands blocked along it"
        )
    return a, b


def _emulated_mm(a_qdata, a_scales, b_qdata, b_scales, out_dtype, b_dequantized=None, a_dequantized=None):
    a, b = _dequantized(a_qdata, a_scales, b_qdata, b_scales, b_dequantized, a_dequantized, dims=(2, 2))
    if a.dtype == torch.float32:
        return torch.mm(a, b.t()).to(out_dtype)
    if out_dtype == torch.float32:
        return torch.mm(a, b.t(), out_dtype=torch.float32)
    return torch.mm(a, b.t()).to(out_dtype)


def _emulated_grouped_mm(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, b_dequantized=None, a_dequantized=None):
    a, b = _dequantized(a_qdata, a_scales, b_qdata, b_scales, b_dequantized, a_dequantized, dims=(2, 3))
    out = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
    return rows_in_groups(out, offs).to(out_dtype)


def _emulated_grouped_wgrad(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype):
    a, b = _dequantized(a_qdata, a_scales, b_qdata, b_scales)
    if a.is_cuda:
        # Token-reduction operands in the layouts torch's own grouped-GEMM backward uses (A
        # column-major [N, T], B row-major [T, K]). The opposite layouts are the suspect in a
        # CUDA-vs-CPU mismatch of this path on sm90 (tests/test_gpu_ops.py); not yet re-run there.
        a, b = a.t().contiguous().t(), b.t().contiguous().t()
    return torch._grouped_mm(a, b.t(), offs=offs).to(out_dtype)


# --- the ops -----------------------------------------------------------------------------------
#
# Each op takes ``native``: whether it runs as a native MX GEMM (the format decides, per GEMM op and device:
# :attr:`mxfx.formats.base.Format.native_gemms`), else emulated.


def _mm(a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized=None, a_dequantized=None):
    impl = gemm_blackwell.mm if native else _emulated_mm
    return impl(a_qdata, a_scales, b_qdata, b_scales, out_dtype, b_dequantized, a_dequantized)


def _grouped_mm(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native, b_dequantized=None, a_dequantized=None):
    impl = gemm_blackwell.grouped_mm if native else _emulated_grouped_mm
    return impl(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, b_dequantized, a_dequantized)


def _grouped_mm_wgrad(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native):
    impl = gemm_blackwell.grouped_wgrad if native else _emulated_grouped_wgrad
    return impl(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype)


_OPERANDS = "Tensor? a_qdata, Tensor? a_scales, Tensor? b_qdata, Tensor? b_scales"
_DEQUANTIZED = "Tensor? b_dequantized=None, Tensor? a_dequantized=None"


@torch.library.custom_op(
    "mxfx::mm", mutates_args=(), schema=f"({_OPERANDS}, ScalarType out_dtype, bool native, {_DEQUANTIZED}) -> Tensor"
)
def _mm_op(a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized=None, a_dequantized=None) -> torch.Tensor:
    """``dequant(A)[M,K] @ dequant(B)[N,K]^T`` with fp32 accumulation, output ``[M, N]`` of ``out_dtype``.

    Args:
        a_qdata: float8_e4m3fn ``[M, K]``; a_scales: uint8 E8M0 ``[M, K/32]``.
        b_qdata: float8_e4m3fn ``[N, K]``; b_scales: uint8 E8M0 ``[N, K/32]``; both None when
            ``b_dequantized`` is given to an emulated GEMM (the weight cache keeps no MX form then).
        out_dtype: dtype of the result (bf16 activations, fp32 weight gradients).
        native: run ``torch._scaled_mm`` (Blackwell), else the emulation (see module docstring).
        b_dequantized: optional ``dequant(B)`` (bf16 ``[N, K]``, from the weight
            cache under ``keep_dequantized_weights``); emulation uses it instead of
            dequantizing B, native paths ignore it.
        a_dequantized: optional ``dequant(A)`` in the emulation dtype, written by the
            quantize pass that made A (:func:`mxfx.kernels.mx.operands.quantize_operand`); likewise. With it, an
            emulated GEMM also takes ``a_qdata`` and ``a_scales`` as None
            (:func:`mxfx.kernels.mx.operands.quantize_dual_operand`).
    """
    return _mm(a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized, a_dequantized)


@_mm_op.register_fake
def _(a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized=None, a_dequantized=None):
    a = a_qdata if a_qdata is not None else a_dequantized
    b = b_qdata if b_qdata is not None else b_dequantized
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op(
    "mxfx::grouped_mm", mutates_args=(),
    schema=f"({_OPERANDS}, Tensor offs, ScalarType out_dtype, bool native, {_DEQUANTIZED}) -> Tensor",
)
def _grouped_mm_op(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native, b_dequantized=None,
                   a_dequantized=None) -> torch.Tensor:
    """Grouped MX GEMM: rows ``offs[e-1]:offs[e]`` of ``dequant(A)[S,K]`` times ``dequant(B)[e][N,K]^T``.

    Args:
        a_qdata/a_scales: ``[S, K]`` e4m3 / ``[S, K/32]`` uint8, blocked along K (None: see below).
        b_qdata/b_scales: ``[E, N, K]`` e4m3 / ``[E, N, K/32]`` uint8, blocked along K; None when
            ``b_dequantized`` is given to an emulated GEMM.
        offs: int32 ``[E]`` cumulative group ends (empty groups allowed).
        out_dtype: result dtype.
        native: run ``torch._scaled_grouped_mm`` (sm100), else the emulation.
        b_dequantized: optional bf16 ``[E, N, K]`` = ``dequant(B)`` (see :func:`mx_mm`).
        a_dequantized: optional ``dequant(A)`` ``[S, K]`` in the emulation dtype, written by the pass
            that quantized A; with it an emulated GEMM also takes ``a_qdata`` / ``a_scales`` as None.

    Returns ``[S, N]``; rows past ``offs[-1]`` are zero.
    """
    return _grouped_mm(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native, b_dequantized, a_dequantized)


@_grouped_mm_op.register_fake
def _(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native, b_dequantized=None, a_dequantized=None):
    a = a_qdata if a_qdata is not None else a_dequantized
    b = b_qdata if b_qdata is not None else b_dequantized
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("mxfx::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(
    a_qdata: torch.Tensor,
    a_scales: torch.Tensor,
    b_qdata: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    native: bool,
) -> torch.Tensor:
    """Per-group token reduction: ``out[e] = dequant(A)[:, grp e] @ dequant(B)[:, grp e]^T``.

    Args:
        a_qdata/a_scales: ``[N, T]`` / ``[N, T/32]``, blocked along tokens T.
        b_qdata/b_scales: ``[K, T]`` / ``[K, T/32]``, blocked along tokens T.
        offs: int32 ``[E]`` group ends along T; each group starts at a multiple of 32
            so no 32-block mixes two groups.
        native: run ``torch._scaled_grouped_mm`` (sm100), else the emulation.

    Returns ``[E, N, K]`` of ``out_dtype``.
    """
    return _grouped_mm_wgrad(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native)


@_grouped_mm_wgrad_op.register_fake
def _(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native):
    return a_qdata.new_empty((offs.shape[0], a_qdata.shape[0], b_qdata.shape[0]), dtype=out_dtype)


def mm_into(a_qdata, a_scales, b_qdata, b_scales, out: torch.Tensor, accumulate: bool, native: bool,
            a_dequantized=None) -> None:
    """:func:`mx_mm` (a wgrad's operands, blocked along the tokens) written into ``out [N, K]`` (``accumulate=False``)
    or added to it (``True``), in ``out``'s dtype: a weight gradient accumulated in the parameter's ``.grad``
    (:mod:`mxfx.runtime.main_grad`). Emulated on the CPU by the FP32 GEMM itself; elsewhere the GEMM, then one pass
    (:func:`mxfx.kernels.common.gemm.accumulate_into`), until a kernel with an accumulating epilogue takes it."""
    if native or out.device.type != "cpu":
        accumulate_into(out, mx_mm(a_qdata, a_scales, b_qdata, b_scales, out.dtype, native, None, a_dequantized),
                        accumulate)
        return
    a, b = _dequantized(a_qdata, a_scales, b_qdata, b_scales, None, a_dequantized, dims=(2, 2))
    common_gemm.mm_into(out, a.to(out.dtype), b.to(out.dtype), accumulate)


def grouped_wgrad_into(a_qdata, a_scales, b_qdata, b_scales, offs, out: torch.Tensor, accumulate: bool,
                       native: bool) -> None:
    """:func:`mx_grouped_mm_wgrad` written into ``out [E, N, K]`` or added to it, as :func:`mm_into`."""
    if native or out.device.type != "cpu":
        accumulate_into(out, mx_grouped_mm_wgrad(a_qdata, a_scales, b_qdata, b_scales, offs, out.dtype, native),
                        accumulate)
        return
    a, b = _dequantized(a_qdata, a_scales, b_qdata, b_scales)
    common_gemm.grouped_mm_into(out, a.to(out.dtype), b.to(out.dtype), offs.tolist(), accumulate)


_TRACED = "Traced on CUDA, the chosen implementation's kernels and GEMM enter the graph (:mod:`mxfx.kernels.common.launch`)."
mx_mm = op_or_body(_mm_op, _mm, f"``mxfx::mm`` (shapes and dtypes: :func:`_mm_op`). {_TRACED}")
mx_grouped_mm = op_or_body(_grouped_mm_op, _grouped_mm, f"``mxfx::grouped_mm`` (see :func:`_grouped_mm_op`). {_TRACED}")
mx_grouped_mm_wgrad = op_or_body(
    _grouped_mm_wgrad_op, _grouped_mm_wgrad, f"``mxfx::grouped_mm_wgrad`` (see :func:`_grouped_mm_wgrad_op`). {_TRACED}",
)
name_op_functions(globals())
