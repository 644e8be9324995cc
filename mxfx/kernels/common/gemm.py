"""The GEMM pieces every format shares: the body of the BF16 grouped weight gradient (:func:`grouped_wgrad_bf16`,
native BF16 or FP32 on the CPU), the accumulating GEMMs the CPU references of every format write a weight gradient
with (:func:`mm_into`, :func:`grouped_mm_into`), :func:`accumulate_into` (the separate pass of a device path whose
GEMM has no accumulating epilogue yet) and :func:`rows_in_groups` (the zero rows past a grouped GEMM's last group).
The ops and the functions callers use (``hp_mm_transposed``, ``hp_grouped_wgrad`` and their ``_into`` forms) are in
:mod:`mxfx.kernels.common.custom_ops`."""

from __future__ import annotations

import torch

from mxfx.device import native_bf16_matmul, triton_available
from mxfx.kernels.common.launch import readable_on_host
from mxfx.numerics.layout import check_group_ends


def accumulate_into(out: torch.Tensor, result: torch.Tensor, accumulate: bool) -> None:
    """``out += result`` (``accumulate``) or ``out = result``, in place: the separate pass of a weight-gradient GEMM
    whose kernel cannot yet add into (or write) ``out`` itself."""
    if accumulate:
        out.add_(result)
    else:
        out.copy_(result)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out [N, K] (+)= a [N, T] @ b [K, T]^T`` by the GEMM itself (``addmm_``, beta 1 or 0: what ``out`` held is
    read only when ``accumulate``, NaN included). ``a`` and ``b`` in ``out``'s dtype (the exact FP32 decodes of the
    CPU references)."""
    out.addmm_(a, b.t(), beta=1 if accumulate else 0)


OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Output dtypes of the GEMMs: what a low-precision GEMM may write."""


def check_out_dtype(out_dtype, op: str) -> None:
    """Raise TypeError naming ``op`` unless ``out_dtype`` is one of :data:`OUT_DTYPES`."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype {out_dtype} is not one of bfloat16, float16, float32")


def check_offs(op: str, offs: torch.Tensor, x: torch.Tensor, operand: str = "x") -> None:
    """Raise ValueError naming ``op`` unless the group ends ``offs`` are contiguous int32 ``[G]`` on ``x``'s device
    and, where they can be read on the host (:func:`readable_on_host`; on a GPU the kernels read them, never
    synced), are non-decreasing and at most ``x``'s rows; ``operand`` is ``x``'s name in the message."""
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.device != x.device or not offs.is_contiguous():
        raise ValueError(
            f"{op}: offs must be contiguous int32 [G] on {x.device} (kernels read it as a flat array), got "
            f"{offs.dtype} {tuple(offs.shape)} with strides {offs.stride()} on {offs.device}; pass the cumulative "
            f"group ends as offs.to(torch.int32).contiguous() on that device"
        )
    if readable_on_host(offs):
        check_group_ends(offs.tolist(), x.shape[0], op, operand)


def check_grouped_wgrad_into(
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    *,
    kernel: bool = False,
    op: str = "mxfx.grouped_wgrad_into",
) -> None:
    """Raise ValueError naming ``op`` where the operands of a grouped wgrad into ``out`` do not pair up: ``dy [S, N]``
    and ``x [S, K]`` floating, contiguous int32 ``offs [G]``, ``out [G, N, K]`` floating with distinct elements, one
    device; on the host also the
    values of ``offs`` (non-decreasing group ends of at most S). ``kernel``: the GPU kernels' stricter dtypes, BF16
    or FP16 operands of one dtype and a float32 ``out``."""
    shapes = f"dy {tuple(dy.shape)}, x {tuple(x.shape)}, offs {tuple(offs.shape)} {offs.dtype}, out {tuple(out.shape)}"
    if dy.dim() != 2 or x.dim() != 2 or offs.dim() != 1 or offs.dtype != torch.int32 or not offs.is_contiguous():
        raise ValueError(f"{op}: needs dy [S, N], x [S, K] and contiguous int32 offs [G]; got {shapes}")
    if any(st == 0 and size > 1 for st, size in zip(out.stride(), out.shape)):
        raise ValueError(
            f"{op}: out {tuple(out.shape)} with strides {out.stride()} overlaps itself; pass a tensor "
            f"whose elements are distinct (e.g. out.contiguous()), whose sum the caller takes"
        )
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: dy and x must have the same tokens S (rows); got {shapes}")
    g, n, k = offs.shape[0], dy.shape[1], x.shape[1]
    if tuple(out.shape) != (g, n, k):
        raise ValueError(f"{op}: out must be [G, N, K] = [{g}, {n}, {k}]; got {shapes}")
    floating = all(t.is_floating_point() for t in (dy, x, out))
    strict = dy.dtype == x.dtype and dy.dtype in (torch.bfloat16, torch.float16) and out.dtype == torch.float32
    if not floating or (kernel and not strict):
        need = "bfloat16 or float16 dy and x of one dtype and a float32 out" if kernel else "floating dy, x and out"
        raise ValueError(f"{op}: needs {need}; got dy {dy.dtype}, x {x.dtype}, out {out.dtype} ({shapes})")
    devices = {str(t.device) for t in (dy, x, offs, out)}
    if len(devices) != 1:
        raise ValueError(
            f"{op}: dy, x, offs and out must be on one device; got dy on {dy.device}, x on {x.device}, "
            f"offs on {offs.device}, out on {out.device}"
        )
    if readable_on_host(offs):
        check_group_ends(offs.tolist(), dy.shape[0], op, "dy")


def grouped_mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ends: list[int], accumulate: bool) -> None:
    """Per group g, ``out[g] [N, K] (+)= a[:, tokens of g] @ b[:, tokens of g]^T`` (:func:`mm_into`), the tokens of
    group g being columns ``[ends[g-1], ends[g])`` of ``a [N, T]`` and ``b [K, T]`` (``ends``: the group ends on the
    host, as the CPU references read them); an empty group's ``out[g]`` is zeroed when written, kept when added to."""
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            mm_into(out[g], a[:, start:end], b[:, start:end], accumulate)
        elif not accumulate:
            out[g].zero_()
        start = end


def rows_in_groups(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A grouped GEMM's ``out [S, N]`` with its rows past the last group end ``offs[-1]`` zeroed (torch's
    ``_grouped_mm`` and ``_scaled_grouped_mm`` leave them unwritten): the Triton kernel on CUDA, ``torch.where``
    elsewhere."""
    if triton_available(out) and out.dim() == 2 and out.stride(1) == 1:
        from mxfx.kernels.common.zero_rows import zero_rows_past_end_

        return zero_rows_past_end_(out, offs)  # writes the tail only, no pass over the whole output
    rows = torch.arange(out.shape[0], device=out.device).unsqueeze(-1)
    return torch.where(rows < offs[-1].to(rows.dtype), out, torch.zeros((), dtype=out.dtype, device=out.device))


def grouped_wgrad_bf16(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """BF16 per-group ``dy[grp]^T @ x[grp]``: ``dy [S, N]``, ``x [S, K]``, int32 ``offs [E]`` -> ``[E, N, K]`` in
    ``out_dtype``.

    Groups may end anywhere. CUDA's grouped GEMM takes unaligned group ends along the reduction
    dim only when A is column-major and B row-major (torch's own ``_grouped_mm`` backward layouts;
    any other layout trips its 16-byte alignment assert), so the operands are made contiguous
    ``[S, *]`` here, inside the op (``mxfx::grouped_wgrad_bf16``), whose strides no compiler can change. That
    replaces padding every group to 32 rows (a zero fill and a scatter of both operands), which cost more than the
    GEMM (``bench/probes/grouped_wgrad_alignment.py``).

    Operands are rounded to BF16, products accumulate in FP32. A float32 ``out_dtype`` (the weight gradient of an
    FP32 main weight) is the GEMM's own result on the CPU: the FP32 GEMM of the exact BF16 operands, with no BF16
    rounding and no widening pass after it. On CUDA torch's grouped GEMM writes BF16 only for BF16 operands
    (torch 2.13 refuses ``out_dtype=torch.float32``), so the BF16 result is widened here, inside the op, where a
    grouped GEMM with a float32 epilogue takes its place. Group ends must be non-decreasing and at most S (they
    are data: not checked on the host); rows past ``offs[-1]`` are ignored; no rows at all give zeros. On CUDA, N
    and K must be multiples of 8 (16-byte rows).

    Raises:
        ValueError: dy or x not 2D, different row counts, or offs not a 1D int32 tensor.
    """
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0] or offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(
            f"mxfx.grouped_wgrad_bf16: needs dy [S, N], x [S, K] and int32 offs [E], got dy {tuple(dy.shape)}, "
            f"x {tuple(x.shape)}, offs {tuple(offs.shape)} {offs.dtype}"
        )
    if dy.shape[0] == 0:  # no rows (an expert-parallel rank that received none): every group's sum is empty
        return dy.new_zeros((offs.shape[0], dy.shape[1], x.shape[1]), dtype=out_dtype)
    dy, x = dy.to(torch.bfloat16).contiguous(), x.to(torch.bfloat16).contiguous()
    if dy.device.type == "cpu" and (out_dtype == torch.float32 or not native_bf16_matmul(dy.device)):
        # the same GEMM in FP32 (exact BF16 operands, FP32 accumulation), rounded once to out_dtype
        return torch._grouped_mm(dy.float().t(), x.float(), offs=offs).to(out_dtype)
    return torch._grouped_mm(dy.t(), x, offs=offs).to(out_dtype)
