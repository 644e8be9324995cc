"""High-precision GEMMs with FP32 accumulation, the same for every format: a linear's BF16 weight gradient, the
routed experts' BF16 grouped weight gradient, and the BF16 GEMMs of the ``bf16_gemm`` format.

Each weight-gradient GEMM also has an ``_into`` form that writes its result into a given tensor (the parameter's
``.grad``, :mod:`mxfx.runtime.main_grad`) or adds it there, with :func:`mm_into` and :func:`grouped_mm_into`, the
accumulating GEMMs the CPU references of every format share, and :func:`accumulate_into`, the separate pass of a
device path whose GEMM has no accumulating epilogue yet."""

from __future__ import annotations

import warnings

import torch

from mxfx.device import native_bf16_matmul, triton_available


@torch.library.custom_op("mxfx::hp_mm", mutates_args=())
def _hp_mm_op(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """CPU body of :func:`hp_mm_transposed`: ``a [M, K] @ b [N, K]^T`` as the FP32 GEMM of the operands in ``a``'s
    dtype (exact in FP32), rounded once to ``out_dtype``. An opaque op: traced, the casts to ``a``'s dtype and back
    up to FP32 would sit in one fused kernel, which Inductor may compute without the BF16 rounding."""
    return torch.mm(a.float(), b.to(a.dtype).float().t()).to(out_dtype)


@_hp_mm_op.register_fake
def _(a, b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def hp_mm_transposed(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """High-precision ``a[M,K] @ b[N,K]^T`` with fp32 accumulation (the "bf16" wgrad path): operands in ``a``'s dtype,
    the result in ``out_dtype`` from the GEMM itself (float32 from BF16/FP16 operands on CUDA; any dtype on the
    CPU, whose GEMM runs in FP32: :func:`_hp_mm_op`). Autocast does not reach it: a backward traced under the
    forward's autocast would otherwise run the GEMM in BF16 and widen the result."""
    if a.device.type == "cpu":
        return _hp_mm_op(a, b, out_dtype)
    with torch.autocast(a.device.type, enabled=False):
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


def hp_mm_into(dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """:func:`hp_mm_transposed`'s weight gradient ``dy [M, N]^T @ x [M, K]`` written into ``out [N, K]`` or added to
    it: by the FP32 GEMM itself on the CPU; on CUDA by cuBLAS with an FP32 output and beta 1 or 0 for BF16/FP16
    operands (``torch.addmm``'s ``out_dtype``), through :func:`accumulate_into` where that is refused or the
    operands are of another dtype."""
    if out.device.type == "cpu":  # operands in dy's dtype, as hp_mm_transposed reads them
        mm_into(out, dy.t().to(out.dtype), x.t().to(dy.dtype).to(out.dtype), accumulate)
        return
    if out.dtype == torch.float32 and dy.dtype in (torch.bfloat16, torch.float16) and not _addmm_refused:
        try:
            with torch.autocast(out.device.type, enabled=False):
                torch.addmm(out, dy.t(), x.to(dy.dtype), out_dtype=torch.float32, beta=1 if accumulate else 0,
                            out=out)
            return
        except (RuntimeError, NotImplementedError) as e:
            _addmm_refused.append(str(e))
            warnings.warn(f"mxfx.hp_mm_into: torch.addmm with a float32 output refused {dy.dtype} operands "
                          f"({str(e).splitlines()[0][:160]}); dense weight gradients are added in a separate pass",
                          stacklevel=2)
    accumulate_into(out, hp_mm_transposed(dy.t(), x.t(), out.dtype), accumulate)


_addmm_refused: list[str] = []  # torch.addmm's refusal of a float32 output for 16-bit operands, once seen


def hp_grouped_wgrad_into(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
                          accumulate: bool) -> None:
    """:func:`hp_grouped_wgrad` (BF16 operands, FP32 accumulation) written into ``out [E, N, K]`` or added to it: by
    the FP32 GEMM of the exact BF16 operands itself on the CPU, by the Triton kernel's epilogue
    (:mod:`mxfx.kernels.common.grouped_wgrad_triton`) into an FP32 ``out`` on CUDA, through :func:`accumulate_into`
    elsewhere."""
    if out.device.type == "cpu":
        a, b = (t.to(torch.bfloat16).to(out.dtype).t() for t in (dy, x))
        grouped_mm_into(out, a, b, offs.tolist(), accumulate)
    elif triton_available(out) and out.dtype == torch.float32:  # the GEMM's epilogue writes or adds into out
        from mxfx.kernels.common import grouped_wgrad_triton  # Triton, imported once a CUDA tensor arrives

        grouped_wgrad_triton.grouped_wgrad_into(dy.to(torch.bfloat16), x.to(torch.bfloat16), offs, out, accumulate)
    else:
        accumulate_into(out, _grouped_wgrad_bf16_op(dy, x, offs, out.dtype), accumulate)
