"""MX GEMM: ``C = A @ B^T`` with both operands MXFP8-blocked along the reduction dim.

Every GEMM of a linear is written in this one orientation (format_spec.md,
"GEMM operand orientation"): forward ``X[M,K] . W[N,K]^T``, dgrad
``dY[M,N] . (W^T)[K,N]^T``, wgrad ``dY^T[N,M] . X^T[K,M]^T``. Callers quantize
each operand so that its last dim is the reduction dim.

Implementation by device (the one dispatch point for dense MX GEMMs):

* CPU: exact emulation, dequantize both operands to fp32, fp32 matmul.
* CUDA without native MX GEMM (Hopper, sm90): dequantize to bf16 (exact:
  E4M3 x 2^e fits bf16 except for scales below 2^-118), cuBLAS bf16 GEMM with
  fp32 accumulation. Equal to a native MX GEMM up to summation order.
"""

from __future__ import annotations

import torch

from mxfx.kernels import ops as kops


def _emulation_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


@torch.library.custom_op("mxfx::mm", mutates_args=())
def mx_mm(
    a_qdata: torch.Tensor, a_scales: torch.Tensor, b_qdata: torch.Tensor, b_scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``dequant(A)[M,K] @ dequant(B)[N,K]^T`` with fp32 accumulation, output ``[M, N]`` of ``out_dtype``.

    Args:
        a_qdata: float8_e4m3fn ``[M, K]``; a_scales: uint8 E8M0 ``[M, K/32]``.
        b_qdata: float8_e4m3fn ``[N, K]``; b_scales: uint8 E8M0 ``[N, K/32]``.
        out_dtype: dtype of the result (bf16 activations, fp32 weight gradients).
    """
    cdt = _emulation_dtype(a_qdata.device)
    a = kops.dequantize(a_qdata, a_scales, cdt)
    b = kops.dequantize(b_qdata, b_scales, cdt)
    if cdt == torch.float32:
        return torch.mm(a, b.t()).to(out_dtype)
    return torch.mm(a, b.t(), out_dtype=torch.float32).to(out_dtype) if out_dtype == torch.float32 else torch.mm(a, b.t()).to(out_dtype)


@mx_mm.register_fake
def _(a_qdata, a_scales, b_qdata, b_scales, out_dtype):
    return a_qdata.new_empty((a_qdata.shape[0], b_qdata.shape[0]), dtype=out_dtype)


def hp_mm_t(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """High-precision ``a[M,K] @ b[N,K]^T`` with fp32 accumulation (the "bf16" wgrad path)."""
    if a.device.type == "cpu":
        return torch.mm(a.float(), b.float().t()).to(out_dtype)
    if out_dtype == torch.float32 and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b.t(), out_dtype=torch.float32)
    return torch.mm(a, b.t().to(a.dtype)).to(out_dtype)


def _rows_in_groups(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Zero output rows past the last group end (``_grouped_mm`` leaves them unwritten)."""
    rows = torch.arange(out.shape[0], device=out.device).unsqueeze(-1)
    return torch.where(rows < offs[-1].to(rows.dtype), out, torch.zeros((), dtype=out.dtype, device=out.device))


@torch.library.custom_op("mxfx::grouped_mm", mutates_args=())
def mx_grouped_mm(
    a_qdata: torch.Tensor,
    a_scales: torch.Tensor,
    b_qdata: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Grouped MX GEMM: rows ``offs[e-1]:offs[e]`` of ``dequant(A)[S,K]`` times ``dequant(B)[e][N,K]^T``.

    Args:
        a_qdata/a_scales: ``[S, K]`` e4m3 / ``[S, K/32]`` uint8, blocked along K.
        b_qdata/b_scales: ``[E, N, K]`` e4m3 / ``[E, N, K/32]`` uint8, blocked along K.
        offs: int32 ``[E]`` cumulative group ends (empty groups allowed).
        out_dtype: result dtype.

    Returns ``[S, N]``; rows past ``offs[-1]`` are zero.
    """
    cdt = _emulation_dtype(a_qdata.device)
    a = kops.dequantize(a_qdata, a_scales, cdt)
    b = kops.dequantize(b_qdata, b_scales, cdt)
    out = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
    return _rows_in_groups(out, offs).to(out_dtype)


@mx_grouped_mm.register_fake
def _(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype):
    return a_qdata.new_empty((a_qdata.shape[0], b_qdata.shape[1]), dtype=out_dtype)


@torch.library.custom_op("mxfx::grouped_mm_wgrad", mutates_args=())
def mx_grouped_mm_wgrad(
    a_qdata: torch.Tensor,
    a_scales: torch.Tensor,
    b_qdata: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Per-group token reduction: ``out[e] = dequant(A)[:, grp e] @ dequant(B)[:, grp e]^T``.

    Args:
        a_qdata/a_scales: ``[N, T]`` / ``[N, T/32]``, blocked along tokens T.
        b_qdata/b_scales: ``[K, T]`` / ``[K, T/32]``, blocked along tokens T.
        offs: int32 ``[E]`` group ends along T; each group starts at a multiple of 32
            so no 32-block mixes two groups.

    Returns ``[E, N, K]`` of ``out_dtype``.
    """
    cdt = _emulation_dtype(a_qdata.device)
    a = kops.dequantize(a_qdata, a_scales, cdt)
    b = kops.dequantize(b_qdata, b_scales, cdt)
    return torch._grouped_mm(a, b.t(), offs=offs).to(out_dtype)


@mx_grouped_mm_wgrad.register_fake
def _(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype):
    return a_qdata.new_empty((offs.shape[0], a_qdata.shape[0], b_qdata.shape[0]), dtype=out_dtype)


def hp_grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """BF16 per-group ``dy[grp]^T @ x[grp]`` -> ``[E, N, K]`` (the routed "bf16" wgrad, seed Table 25).

    Traced into graphs as ``aten._grouped_mm``, whose fake kernel takes bf16 only.
    """
    return torch._grouped_mm(dy.t().to(torch.bfloat16), x.to(torch.bfloat16), offs=offs).to(out_dtype)
