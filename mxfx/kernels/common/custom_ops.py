"""The torch ops every format shares (namespace ``mxfx``), and the functions callers reach them by.

* ``mxfx::hp_mm``: the CPU GEMM of :func:`hp_mm_transposed`, a linear's high-precision ("bf16") weight gradient
  and the GEMMs of the ``bf16_gemm`` format; :func:`hp_mm_into` writes (or adds) that gradient into ``.grad``;
* ``mxfx::grouped_wgrad_bf16``: the routed experts' BF16 grouped weight gradient (:func:`hp_grouped_wgrad`, its
  body :func:`mxfx.kernels.common.gemm.grouped_wgrad_bf16`); :func:`hp_grouped_wgrad_into` into ``.grad``;
* ``mxfx::swiglu_product``: the FP32 SwiGLU product (:func:`swiglu_product`, its body
  :func:`mxfx.kernels.common.swiglu.fp32_product`).

The ``_into`` forms (the parameter's ``.grad``, :mod:`mxfx.runtime.main_grad`) run the GEMM's own accumulating
epilogue where one exists, else the GEMM and :func:`mxfx.kernels.common.gemm.accumulate_into`.
"""

from __future__ import annotations

import functools
import warnings

import torch

from mxfx import library
from mxfx.device import triton_available
from mxfx.kernels.common import gemm
from mxfx.kernels.common.gemm import accumulate_into, check_grouped_wgrad_into, grouped_mm_into, mm_into
from mxfx.kernels.common.launch import env_switch, name_op_functions, op_or_body, traced
from mxfx.kernels.common.swiglu import check_product, fp32_product


@library.custom_op("mxfx::hp_mm", mutates_args=())
def _hp_mm_op(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """CPU body of :func:`hp_mm_transposed`: ``a [M, K] @ b [N, K]^T`` as the FP32 GEMM of the operands in ``a``'s
    dtype (exact in FP32), rounded once to ``out_dtype``. An opaque op: traced, the casts to ``a``'s dtype and back
    up to FP32 would sit in one fused kernel, which Inductor may compute without the BF16 rounding."""
    return torch.mm(a.float(), b.to(a.dtype).float().t()).to(out_dtype)


@library.register_fake(_hp_mm_op)
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


@library.custom_op("mxfx::grouped_wgrad_bf16", mutates_args=())
def _grouped_wgrad_bf16_op(
    dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """:func:`mxfx.kernels.common.gemm.grouped_wgrad_bf16` as an opaque op: the operand layouts it makes stay as
    made."""
    return gemm.grouped_wgrad_bf16(dy, x, offs, out_dtype)


@library.register_fake(_grouped_wgrad_bf16_op)
def _(dy, x, offs, out_dtype):
    return dy.new_empty((offs.shape[0], dy.shape[1], x.shape[1]), dtype=out_dtype)


def hp_grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """BF16 per-group ``dy[grp]^T @ x[grp]`` -> ``[E, N, K]`` in ``out_dtype`` (the routed "bf16" wgrad, the recipe,
    "Kernel Problems and Fusions" (Table 25)): ``mxfx::grouped_wgrad_bf16`` (see
    :func:`mxfx.kernels.common.gemm.grouped_wgrad_bf16`), no group padding needed, the result in ``out_dtype`` from
    the op itself (no cast in the graph after it).
    """
    return _grouped_wgrad_bf16_op(dy, x, offs, out_dtype)


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
                torch.addmm(out, dy.t(), x.to(dy.dtype), out_dtype=torch.float32, beta=1 if accumulate else 0, out=out)
            return
        except (RuntimeError, NotImplementedError) as e:
            _addmm_refused.append(str(e))
            warnings.warn(
                f"mxfx.hp_mm_into: torch.addmm with a float32 output refused {dy.dtype} operands "
                f"({str(e).splitlines()[0][:160]}); dense weight gradients are added in a separate pass",
                stacklevel=2,
            )
    accumulate_into(out, hp_mm_transposed(dy.t(), x.t(), out.dtype), accumulate)


_addmm_refused: list[str] = []  # torch.addmm's refusal of a float32 output for 16-bit operands, once seen


WGRAD_SM90_ENV = "MXFX_WGRAD_SM90"
"""Switch (read at each call): 1/true/yes/on runs the grouped wgrad into FP32 on the sm90 ping-pong kernel wherever
it serves the operands; unset or off, on the Triton kernel. Opt-in until the kernel's GPU tests and timings are in
(docs/kernel-notes.md)."""


@functools.cache
def _wgrad_sm90():
    """:mod:`mxfx.kernels.common.grouped_wgrad_sm90`, or None where this Triton has no Gluon Hopper API."""
    try:
        from mxfx.kernels.common import grouped_wgrad_sm90
    except ImportError:
        return None
    return grouped_wgrad_sm90


def grouped_wgrad_kernel(dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor):
    """The module whose ``grouped_wgrad_into`` runs on these CUDA operands (BF16 ``dy``/``x``, FP32 ``out``): the
    sm90 ping-pong kernel (:mod:`mxfx.kernels.common.grouped_wgrad_sm90`) where it serves them, the operands are
    data (not a trace's stand-ins) and :data:`WGRAD_SM90_ENV` asks for it, else the Triton kernel
    (:mod:`mxfx.kernels.common.grouped_wgrad_triton`)."""
    from mxfx.kernels.common import grouped_wgrad_triton  # Triton, imported once a CUDA tensor arrives

    sm90 = _wgrad_sm90() if env_switch(WGRAD_SM90_ENV, False) and not traced(dy) else None
    return sm90 if sm90 is not None and sm90.supported(dy, x, out) else grouped_wgrad_triton


def hp_grouped_wgrad_into(
    dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, accumulate: bool
) -> None:
    """:func:`hp_grouped_wgrad` (BF16 operands, FP32 accumulation) written into ``out [E, N, K]`` or added to it: by
    the FP32 GEMM of the exact BF16 operands itself on the CPU, by the Triton kernel's epilogue
    (:func:`grouped_wgrad_kernel`) into an FP32 ``out`` on CUDA, through :func:`accumulate_into`
    elsewhere."""
    if out.device.type == "cpu":
        check_grouped_wgrad_into(dy, x, offs, out)
        a, b = (t.to(torch.bfloat16).to(out.dtype).t() for t in (dy, x))
        grouped_mm_into(out, a, b, offs.tolist(), accumulate)
    elif triton_available(out) and out.dtype == torch.float32:  # the GEMM's epilogue writes or adds into out
        dy, x = dy.to(torch.bfloat16), x.to(torch.bfloat16)
        grouped_wgrad_kernel(dy, x, out).grouped_wgrad_into(dy, x, offs, out, accumulate)
    else:
        accumulate_into(out, _grouped_wgrad_bf16_op(dy, x, offs, out.dtype), accumulate)


@library.custom_op("mxfx::swiglu_product", mutates_args=())
def _product_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return fp32_product(gate, up)


@library.register_fake(_product_op)
def _(gate, up):
    check_product(gate, up)
    return gate.new_empty(gate.shape, dtype=torch.float32)


swiglu_product = op_or_body(
    _product_op,
    fp32_product,
    """``silu(gate) * up`` in fp32 with mxfx's SiLU:
``gate, up [..., H]`` (same shape and device, any float dtypes and strides) -> a contiguous fp32 ``[..., H]``, the
values the fused SwiGLU quantizes read (``mxfx::swiglu_product``).

Raises:
    TypeError: gate or up not a floating tensor. ValueError: different shapes or devices, or a 0-d gate.""",
)

name_op_functions(globals())
