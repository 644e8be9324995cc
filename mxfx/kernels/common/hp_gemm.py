"""High-precision GEMMs with FP32 accumulation, the same for every format: a linear's BF16 weight gradient, the
routed experts' BF16 grouped weight gradient, and the BF16 GEMMs of the ``bf16_gemm`` format."""

from __future__ import annotations

import torch

from mxfx.kernels.common.device import native_bf16_matmul


def hp_mm_transposed(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """High-precision ``a[M,K] @ b[N,K]^T`` with fp32 accumulation (the "bf16" wgrad path), in ``out_dtype`` from
    the GEMM itself where it can write it (float32 from BF16/FP16 operands; any dtype on the CPU, whose GEMM runs
    in FP32). Autocast does not reach it: a backward traced under the forward's autocast would otherwise run the
    CPU's FP32 GEMM in BF16 and widen the result."""
    with torch.autocast(a.device.type, enabled=False):
        if a.device.type == "cpu":
            return torch.mm(a.float(), b.float().t()).to(out_dtype)
        if out_dtype == torch.float32 and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(a, b.t(), out_dtype=torch.float32)
        return torch.mm(a, b.t().to(a.dtype)).to(out_dtype)


@torch.library.custom_op("mxfx::grouped_wgrad_bf16", mutates_args=())
def _grouped_wgrad_bf16_op(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """BF16 per-group ``dy[grp]^T @ x[grp]``: ``dy [S, N]``, ``x [S, K]``, int32 ``offs [E]`` -> ``[E, N, K]`` in
    ``out_dtype``.

    Groups may end anywhere. CUDA's grouped GEMM takes unaligned group ends along the reduction
    dim only when A is column-major and B row-major (torch's own ``_grouped_mm`` backward layouts;
    any other layout trips its 16-byte alignment assert), so the operands are made contiguous
    ``[S, *]`` here, inside an op whose strides no compiler can change. That replaces padding every
    group to 32 rows (a zero fill and a scatter of both operands), which cost more than the GEMM
    (``bench/probes/grouped_wgrad_alignment.py``).

    Operands are rounded to BF16, products accumulate in FP32. A float32 ``out_dtype`` (the weight gradient of an
    FP32 main weight) is the GEMM's own result on the CPU: the FP32 GEMM of the exact BF16 operands, with no BF16
    rounding and no widening pass after it. On CUDA torch's grouped GEMM writes BF16 only for BF16 operands
    (torch 2.13 refuses ``out_dtype=torch.float32``), so the BF16 result is widened here, inside the op, where a
    grouped GEMM with a float32 epilogue takes its place. Group ends must be non-decreasing and at most S (they
    are data: not checked on the host); rows past ``offs[-1]`` are ignored. On CUDA, N and K must be multiples of
    8 (16-byte rows).

    Raises:
        ValueError: dy or x not 2D, different row counts, or offs not a 1D int32 tensor.
    """
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0] or offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(
            f"mxfx.grouped_wgrad_bf16: needs dy [S, N], x [S, K] and int32 offs [E], got dy {tuple(dy.shape)}, "
            f"x {tuple(x.shape)}, offs {tuple(offs.shape)} {offs.dtype}"
        )
    dy, x = dy.to(torch.bfloat16).contiguous(), x.to(torch.bfloat16).contiguous()
    if dy.device.type == "cpu" and (out_dtype == torch.float32 or not native_bf16_matmul(dy.device)):
        # the same GEMM in FP32 (exact BF16 operands, FP32 accumulation), rounded once to out_dtype
        return torch._grouped_mm(dy.float().t(), x.float(), offs=offs).to(out_dtype)
    return torch._grouped_mm(dy.t(), x, offs=offs).to(out_dtype)


@_grouped_wgrad_bf16_op.register_fake
def _(dy, x, offs, out_dtype):
    return dy.new_empty((offs.shape[0], dy.shape[1], x.shape[1]), dtype=out_dtype)


def hp_grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """BF16 per-group ``dy[grp]^T @ x[grp]`` -> ``[E, N, K]`` in ``out_dtype`` (the routed "bf16" wgrad, the recipe,
    "Kernel Problems and Fusions" (Table 25)): ``mxfx::grouped_wgrad_bf16`` (see :func:`_grouped_wgrad_bf16_op`),
    no group padding needed, the result in ``out_dtype`` from the op itself (no cast in the graph after it).
    """
    return _grouped_wgrad_bf16_op(dy, x, offs, out_dtype)
