"""MX GEMM: ``C = A @ B^T`` with both operands MXFP8-blocked along the reduction dim.

Every GEMM of a linear is written in this one orientation (``docs/format.md``,
"GEMM operand orientation"): forward ``X[M,K] . W[N,K]^T``, dgrad
``dY[M,N] . (W^T)[K,N]^T``, wgrad ``dY^T[N,M] . X^T[K,M]^T``. Callers quantize
each operand so that its last dim is the reduction dim.

Three GEMMs (:func:`mm`, :func:`grouped_mm`, :func:`grouped_mm_wgrad`: the bodies of the custom ops ``mxfx::mm``,
``mxfx::grouped_mm``, ``mxfx::grouped_mm_wgrad`` of :mod:`mxfx.kernels.mx.custom_ops`) run one of two
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

from mxfx import device as devices
from mxfx.kernels.common import gemm as common_gemm
from mxfx.kernels.common.gemm import check_offs, check_out_dtype, rows_in_groups
from mxfx.kernels.mx import gemm_blackwell
from mxfx.kernels.mx.device_path import dequantize_lastdim


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


def check_shapes(op: str, a: torch.Tensor, b: torch.Tensor, dims: tuple[int, int] | None) -> None:
    """Raise ValueError naming ``op`` unless A and B (qdata or dequantized values) have ``dims`` dims (None: any)
    and share their last (reduction) dim: the GEMM bodies' check, and their fakes'."""
    if dims is not None and (a.dim(), b.dim()) != dims:
        raise ValueError(
            f"{op}: A of shape {tuple(a.shape)} and B of shape {tuple(b.shape)} must be {dims[0]}D and "
            f"{dims[1]}D for this GEMM"
        )
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"{op}: A of shape {tuple(a.shape)} and B of shape {tuple(b.shape)} must share their last "
            f"(reduction) dim: C = A @ B^T with both operands blocked along it"
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
    check_shapes("mxfx.gemm", a, b, dims)
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


# --- native or emulated: the bodies of the GEMM ops (mxfx.kernels.mx.custom_ops) ------------------
#
# Each takes ``native``: whether it runs as a native MX GEMM (the format decides, per GEMM op and device:
# :attr:`mxfx.formats.base.Format.native_gemms`), else emulated.


def check_call(op: str, out_dtype, a, offs=None) -> None:
    """What every GEMM op checks before its body, naming ``op``: a floating ``out_dtype``; group ends ``offs``
    (:func:`mxfx.kernels.common.gemm.check_offs`) against A's rows."""
    check_out_dtype(out_dtype, op)
    if offs is not None and a is not None:
        check_offs(op, offs, a)


def check_native(op: str, native: bool, t: torch.Tensor) -> None:
    """``native`` asks for torch's MX GEMM, which runs on an sm100 or sm120 GPU only.

    Raises:
        ValueError: ``native`` with ``t`` elsewhere, naming ``op`` and the device (the emulation: ``native=False``).
    """
    if not native or t is None:
        return
    cap = devices.capability(t.device)
    if cap is None or cap[0] < 10:
        where = t.device.type if cap is None else f"sm{cap[0]}{cap[1]}"
        raise ValueError(
            f"{op}: native=True runs torch's MX GEMM, which needs an sm100 or sm120 GPU; these operands are on {where} "
            "(pass native=False for the exact emulation)"
        )


def mm(a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized=None, a_dequantized=None):
    """The body of ``mxfx::mm``: :func:`mxfx.kernels.mx.gemm_blackwell.mm` where ``native``, else the emulation."""
    check_call("mxfx::mm", out_dtype, a_qdata if a_qdata is not None else a_dequantized)
    check_native("mxfx::mm", native, a_qdata if a_qdata is not None else a_dequantized)
    impl = gemm_blackwell.mm if native else _emulated_mm
    return impl(a_qdata, a_scales, b_qdata, b_scales, out_dtype, b_dequantized, a_dequantized)


def grouped_mm(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native, b_dequantized=None, a_dequantized=None):
    """The body of ``mxfx::grouped_mm``, native or emulated as :func:`mm`."""
    check_call("mxfx::grouped_mm", out_dtype, a_qdata if a_qdata is not None else a_dequantized, offs)
    check_native("mxfx::grouped_mm", native, a_qdata if a_qdata is not None else a_dequantized)
    impl = gemm_blackwell.grouped_mm if native else _emulated_grouped_mm
    return impl(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, b_dequantized, a_dequantized)


def grouped_mm_wgrad(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native):
    """The body of ``mxfx::grouped_mm_wgrad``, native or emulated as :func:`mm`."""
    check_call("mxfx::grouped_mm_wgrad", out_dtype, a_qdata)
    check_native("mxfx::grouped_mm_wgrad", native, a_qdata)
    impl = gemm_blackwell.grouped_wgrad if native else _emulated_grouped_wgrad
    return impl(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype)


def emulated_mm_into(
    a_qdata, a_scales, b_qdata, b_scales, out: torch.Tensor, accumulate: bool, a_dequantized=None
) -> None:
    """The emulated dense GEMM written into ``out [N, K]`` or added to it by the GEMM itself, in ``out``'s dtype (the
    CPU path of :func:`mxfx.kernels.mx.custom_ops.mm_into`)."""
    a, b = _dequantized(a_qdata, a_scales, b_qdata, b_scales, None, a_dequantized, dims=(2, 2))
    common_gemm.mm_into(out, a.to(out.dtype), b.to(out.dtype), accumulate)


def emulated_grouped_wgrad_into(
    a_qdata, a_scales, b_qdata, b_scales, offs, out: torch.Tensor, accumulate: bool
) -> None:
    """The emulated grouped wgrad written into ``out [E, N, K]`` or added to it, as :func:`emulated_mm_into` (the
    CPU path of :func:`mxfx.kernels.mx.custom_ops.grouped_wgrad_into`)."""
    a, b = _dequantized(a_qdata, a_scales, b_qdata, b_scales)
    common_gemm.grouped_mm_into(out, a.to(out.dtype), b.to(out.dtype), offs.tolist(), accumulate)
