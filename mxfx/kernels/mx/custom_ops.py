"""The MX kernel ops graph code calls: torch custom ops (namespace ``mxfx``) with fake implementations.

Each public function here (``quantize``, ``dequantize``, ...) is what the MX
autograd functions call. In eager code, and in every CPU graph, it calls the
custom op ``mxfx::<name>``: graphs hold it opaquely, so Inductor neither fuses
the format math into slow dynamic-shape code nor trips over E8M0 dtypes (scales
are uint8 E8M0 bytes here). While a CUDA graph is traced, it calls the kernel's
Python body instead, whose Triton launches enter the graph through
``wrap_triton`` and are launched by Inductor's generated code without the
custom op's host cost (:mod:`mxfx.kernels.common.launch`). Both give the same bytes.
Each quantize op blocks along the last dimension of its input.

The GEMM ops (``mxfx::mm``, ``mxfx::grouped_mm``, ``mxfx::grouped_mm_wgrad``: :func:`mx_mm`, :func:`mx_grouped_mm`,
:func:`mx_grouped_mm_wgrad`) run :mod:`mxfx.kernels.mx.gemm`'s native or emulated GEMM; :func:`mm_into` and
:func:`grouped_wgrad_into` write a weight gradient into (or add it to) a given tensor.
"""

from __future__ import annotations

import functools

import torch

from mxfx import library
from mxfx.numerics.mx import BLOCK_SIZE, dequantize_lastdim
from mxfx.kernels.common.launch import name_op_functions, op_or_body
from mxfx.kernels.common.gemm import accumulate_into
from mxfx.kernels.mx import device_path, gemm
from mxfx.kernels.mx.checks import check_lastdim_args
from mxfx.numerics.layout import blocked_numel
from mxfx.kernels.mx.views import lastdim_scales, mn_major, scale_shape

_E4M3 = torch.float8_e4m3fn


def _custom_op(name: str, fake):
    """Decorator: the function becomes the custom op ``mxfx::<name>`` (no mutated arguments), ``fake`` its
    fake implementation (output shapes, dtypes and strides for tracing)."""

    def register(fn):
        op = library.custom_op(f"mxfx::{name}")(fn)
        library.register_fake(op)(fake)
        return op

    return register


def _pair_fake(x):
    """Fake rowwise MX pair of ``x [..., K]`` with contiguous rows: fresh ``(qdata e4m3 [..., K],
    scales uint8 [..., K/32])``, both contiguous (the SwiGLU outputs, whatever gate's strides)."""
    return x.new_empty(x.shape, dtype=_E4M3), x.new_empty(scale_shape(x.shape), dtype=torch.uint8)


def _lastdim_fake(x):
    """Fake of ``quantize_lastdim(x)``: contiguous qdata, scales laid out as the kernels lay them out
    (:func:`mxfx.kernels.mx.views.lastdim_scales`: MN-major for an input strided along K)."""
    return x.new_empty(x.shape, dtype=_E4M3), lastdim_scales(x)


def _quantize_fake(x, rule):
    check_lastdim_args(x, rule, "mxfx.quantize")  # what the op checks before its kernel
    return _lastdim_fake(x)


@_custom_op("quantize", fake=_quantize_fake)
def _quantize_op(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> ``(qdata e4m3 [..., K], scales uint8 [..., K/32])``."""
    return device_path.quantize_lastdim(x, rule)


@_custom_op("dequantize", fake=lambda qdata, scales, dtype: qdata.new_empty(qdata.shape, dtype=dtype))
def _dequantize_op(qdata: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(qdata [..., K], scales [..., K/32])`` -> ``[..., K]`` of ``dtype``."""
    return device_path.dequantize_lastdim(qdata, scales, dtype).contiguous()  # the fake's layout, whatever the input's


@library.custom_op("mxfx::quantize_dual", mutates_args=())
def _quantize_dual_op(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> rowwise ``(q [M, K], s [M, K/32])`` and columnwise ``(q [K, M], s [K, M/32])``."""
    return device_path.quantize_dual(x, rule)


@library.register_fake(_quantize_dual_op)
def _(x, rule):
    t = x.shape[:-2] + (x.shape[-1], x.shape[-2])
    return (  # scales MN-major (mxfx.kernels.mx.dual)
        x.new_empty(x.shape, dtype=_E4M3),
        mn_major(scale_shape(x.shape), x),
        x.new_empty(t, dtype=_E4M3),
        mn_major(scale_shape(t), x),
    )


@library.custom_op("mxfx::quantize_dual_blocked", mutates_args=())
def _quantize_dual_blocked_op(
    x: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_quantize_dual_op` with both scale matrices in the blocked layout of :mod:`mxfx.numerics.layout`."""
    return device_path.quantize_dual_blocked(x, rule)


@library.register_fake(_quantize_dual_blocked_op)
def _(x, rule):
    *lead, m, k = x.shape
    return (
        x.new_empty(x.shape, dtype=_E4M3),
        x.new_empty((*lead, blocked_numel(m, k // BLOCK_SIZE)), dtype=torch.uint8),
        x.new_empty((*lead, k, m), dtype=_E4M3),
        x.new_empty((*lead, blocked_numel(k, m // BLOCK_SIZE)), dtype=torch.uint8),
    )


def _quantize_dual_dequantized(x: torch.Tensor, rule: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, h_row, _, _, h_col = device_path.quantize_dual_source(x, rule, dequantized=dtype, mx=False)
    return h_row, h_col.transpose(-2, -1)


@_custom_op(
    "quantize_dual_dequantized",
    fake=lambda x, rule, dtype: (x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape, dtype=dtype)),
)
def _quantize_dual_dequantized_op(x: torch.Tensor, rule: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> the dequantized values of its rowwise and its columnwise MX, both ``[M, K]`` of ``dtype``."""
    return _quantize_dual_dequantized(x, rule, dtype)


@_custom_op("quantize_dequantize", fake=lambda x, rule, dtype: (*_lastdim_fake(x), x.new_empty(x.shape, dtype=dtype)))
def _quantize_dequantize_op(
    x: torch.Tensor, rule: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> ``(qdata, scales, x_hat)`` with ``x_hat`` the dequantized ``dtype`` tensor."""
    return device_path.quantize_dequantize(x, rule, dtype)


@_custom_op("swiglu_quantize", fake=lambda gate, up, rule: _pair_fake(gate))
def _swiglu_quantize_op(gate: torch.Tensor, up: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantize of ``silu(gate) * up`` (fp32 product): ``gate, up [..., H]`` -> ``(q [..., H], s [..., H/32])``."""
    return device_path.swiglu_quantize(gate, up, rule)


def _mx_and_values_fake(x, dtype):
    return (*_pair_fake(x), x.new_empty(x.shape, dtype=dtype))


@_custom_op("swiglu_quantize_dequantize", fake=lambda gate, up, rule, dtype: _mx_and_values_fake(gate, dtype))
def _swiglu_quantize_dequantize_op(
    gate: torch.Tensor, up: torch.Tensor, rule: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_swiglu_quantize_op` plus the dequantized values ``[..., H]`` of ``dtype``, from the same pass."""
    return device_path.swiglu_quantize(gate, up, rule, dtype)


def _saved_pairs_fake(gate):
    """Fakes of the gate and up MX pairs: two fresh pairs (one pair repeated would alias gate's to up's)."""
    return _pair_fake(gate) + _pair_fake(gate)


@_custom_op(
    "swiglu_quantize_save", fake=lambda gate, up, rule: _swiglu_quantize_op(gate, up, rule) + _saved_pairs_fake(gate)
)
def _swiglu_quantize_save_op(
    gate: torch.Tensor, up: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_swiglu_quantize_op` followed by the rowwise MX pairs of gate and up (contiguous), from one read."""
    return device_path.swiglu_quantize(gate, up, rule, save_inputs=True)


@_custom_op(
    "swiglu_quantize_dequantize_save",
    fake=lambda gate, up, rule, dtype: _mx_and_values_fake(gate, dtype) + _saved_pairs_fake(gate),
)
def _swiglu_quantize_dequantize_save_op(
    gate: torch.Tensor, up: torch.Tensor, rule: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_swiglu_quantize_dequantize_op` followed by the rowwise MX pairs of gate and up, from one read."""
    return device_path.swiglu_quantize(gate, up, rule, dtype, save_inputs=True)


@_custom_op(
    "route_weight_quantize_dequantize",
    fake=lambda dy, weight, rule, dtype: (*_lastdim_fake(dy), dy.new_empty(dy.shape, dtype=dtype)),
)
def _route_weight_quantize_dequantize_op(
    dy: torch.Tensor, weight: torch.Tensor, rule: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_route_weight_quantize_op` plus the dequantized values ``[S, D]`` of ``dtype``, from the same pass."""
    return device_path.route_weight_quantize(dy, weight, rule, dtype)


@_custom_op("route_weight_quantize", fake=lambda dy, weight, rule: _lastdim_fake(dy))
def _route_weight_quantize_op(dy: torch.Tensor, weight: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantize of ``dy [S, D] * weight [S]`` (fp32 product), the combine-backward gradient."""
    return device_path.route_weight_quantize(dy, weight, rule)


@library.custom_op("mxfx::quantize_blocked", mutates_args=())
def _quantize_blocked_op(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> ``(qdata e4m3 [..., K], blocked uint8 scales)``: the scale matrix of
    ``x.reshape(-1, K)`` in the blocked layout of :mod:`mxfx.numerics.layout` (rows padded to 128,
    scale columns to 4, padding zero), as Blackwell block-scaled GEMMs consume it."""
    return device_path.quantize_blocked(x, rule)


@library.register_fake(_quantize_blocked_op)
def _(x, rule):
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    return x.new_empty(x.shape, dtype=_E4M3), x.new_empty(
        blocked_numel(rows, x.shape[-1] // BLOCK_SIZE), dtype=torch.uint8
    )


# --- the GEMMs: the bodies choose a native or an emulated GEMM (mxfx.kernels.mx.gemm) -------------

_OPERANDS = "Tensor? a_qdata, Tensor? a_scales, Tensor? b_qdata, Tensor? b_scales"
_DEQUANTIZED = "Tensor? b_dequantized=None, Tensor? a_dequantized=None"


@library.custom_op(
    "mxfx::mm", mutates_args=(), schema=f"({_OPERANDS}, ScalarType out_dtype, bool native, {_DEQUANTIZED}) -> Tensor"
)
def _mm_op(
    a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized=None, a_dequantized=None
) -> torch.Tensor:
    """``dequant(A)[M,K] @ dequant(B)[N,K]^T`` with fp32 accumulation, output ``[M, N]`` of ``out_dtype``.

    Args:
        a_qdata: float8_e4m3fn ``[M, K]``; a_scales: uint8 E8M0 ``[M, K/32]``.
        b_qdata: float8_e4m3fn ``[N, K]``; b_scales: uint8 E8M0 ``[N, K/32]``; both None when
            ``b_dequantized`` is given to an emulated GEMM (the weight cache keeps no MX form then).
        out_dtype: dtype of the result (bf16 activations, fp32 weight gradients).
        native: run ``torch._scaled_mm`` (Blackwell), else the emulation (:mod:`mxfx.kernels.mx.gemm`).
        b_dequantized: optional ``dequant(B)`` (bf16 ``[N, K]``, from the weight
            cache under ``keep_dequantized_weights``); emulation uses it instead of
            dequantizing B, native paths ignore it.
        a_dequantized: optional ``dequant(A)`` in the emulation dtype, written by the
            quantize pass that made A (:func:`mxfx.kernels.mx.operands.quantize_operand`); likewise. With it, an
            emulated GEMM also takes ``a_qdata`` and ``a_scales`` as None
            (:func:`mxfx.kernels.mx.operands.quantize_dual_operand`).
    """
    return gemm.mm(a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized, a_dequantized)


@library.register_fake(_mm_op)
def _(a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized=None, a_dequantized=None):
    a = a_qdata if a_qdata is not None else a_dequantized
    b = b_qdata if b_qdata is not None else b_dequantized
    gemm.check_call("mxfx::mm", out_dtype, a)
    gemm.check_shapes("mxfx::mm", a, b, (2, 2))
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@library.custom_op(
    "mxfx::grouped_mm",
    mutates_args=(),
    schema=f"({_OPERANDS}, Tensor offs, ScalarType out_dtype, bool native, {_DEQUANTIZED}) -> Tensor",
)
def _grouped_mm_op(
    a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native, b_dequantized=None, a_dequantized=None
) -> torch.Tensor:
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
    return gemm.grouped_mm(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native, b_dequantized, a_dequantized)


@library.register_fake(_grouped_mm_op)
def _(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native, b_dequantized=None, a_dequantized=None):
    a = a_qdata if a_qdata is not None else a_dequantized
    b = b_qdata if b_qdata is not None else b_dequantized
    gemm.check_call("mxfx::grouped_mm", out_dtype, a, offs)
    gemm.check_shapes("mxfx::grouped_mm", a, b, (2, 3))
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@library.custom_op("mxfx::grouped_mm_wgrad", mutates_args=())
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
    return gemm.grouped_mm_wgrad(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native)


@library.register_fake(_grouped_mm_wgrad_op)
def _(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native):
    gemm.check_call("mxfx::grouped_mm_wgrad", out_dtype, a_qdata)
    return a_qdata.new_empty((offs.shape[0], a_qdata.shape[0], b_qdata.shape[0]), dtype=out_dtype)


# --- what callers use: the custom op, or its body when traced on CUDA ---------------------------

quantize = op_or_body(
    _quantize_op,
    device_path.quantize_lastdim,
    """``x [..., K]`` -> ``(qdata e4m3 [..., K],
scales uint8 E8M0 [..., K/32])`` (``mxfx::quantize``).""",
)
dequantize = op_or_body(
    _dequantize_op,
    device_path.dequantize_lastdim,
    """``(qdata [..., K], scales [..., K/32],
dtype)`` -> ``[..., K]`` of ``dtype`` (``mxfx::dequantize``).""",
)
dequantize_fusible = op_or_body(
    _dequantize_op,
    dequantize_lastdim,
    """:func:`dequantize` for values that feed
elementwise math (the SwiGLU backward): while a CUDA graph is traced, the plain-torch reference of
``mxfx.numerics.mx`` enters the graph instead of the Triton kernel, so Inductor fuses the decode into its consumer
and no dequantized tensor is written; elsewhere ``mxfx::dequantize``. Same values either way (the kernels
equal that reference bit for bit).""",
)
quantize_dual = op_or_body(
    _quantize_dual_op,
    device_path.quantize_dual,
    """``x [M, K]`` -> rowwise ``(q [M, K],
s [M, K/32])`` and columnwise ``(q [K, M], s [K, M/32])`` (``mxfx::quantize_dual``).""",
)
quantize_dual_blocked = op_or_body(
    _quantize_dual_blocked_op,
    device_path.quantize_dual_blocked,
    """``x [M, K]`` ->
``(q [M, K], s_row blocked, q_t [K, M], s_col blocked)``: :func:`quantize_dual` with both scale matrices in the
blocked layout of :mod:`mxfx.numerics.layout` (``mxfx::quantize_dual_blocked``).""",
)
quantize_dual_dequantized = op_or_body(
    _quantize_dual_dequantized_op,
    _quantize_dual_dequantized,
    """``(x [M, K],
rule, dtype)`` -> ``(row_hat, col_hat)``, both contiguous ``[M, K]`` of ``dtype``: the dequantized values of
x's rowwise MX (blocks along K) and of its columnwise MX (blocks down M), from one read, no MX pair written
(``mxfx::quantize_dual_dequantized``; what an emulated GEMM reads of both orientations).""",
)
quantize_dequantize = op_or_body(
    _quantize_dequantize_op,
    device_path.quantize_dequantize,
    """``(x [..., K], rule,
dtype)`` -> ``(qdata, scales, x_hat)``, x_hat the dequantized ``dtype`` tensor (``mxfx::quantize_dequantize``).""",
)
swiglu_quantize = op_or_body(
    _swiglu_quantize_op,
    device_path.swiglu_quantize,
    """MX quantize of ``silu(gate) * up``
formed in fp32: ``gate, up [..., H]`` -> ``(q [..., H], s [..., H/32])`` (``mxfx::swiglu_quantize``).""",
)
swiglu_quantize_dequantize = op_or_body(
    _swiglu_quantize_dequantize_op,
    device_path.swiglu_quantize,
    """``(gate,
up, rule, dtype)`` -> ``(q, s, h_hat)``: :func:`swiglu_quantize` plus the dequantized values in ``dtype``
(``mxfx::swiglu_quantize_dequantize``).""",
)
swiglu_quantize_save = op_or_body(
    _swiglu_quantize_save_op,
    functools.partial(device_path.swiglu_quantize, dequantized=None, save_inputs=True),
    """``(gate, up, rule)`` -> ``(q, s, gate_q, gate_s, up_q, up_s)``:
:func:`swiglu_quantize` plus the MX pairs of gate and up that the SwiGLU backward keeps, from one read
(``mxfx::swiglu_quantize_save``).""",
)
swiglu_quantize_dequantize_save = op_or_body(
    _swiglu_quantize_dequantize_save_op,
    functools.partial(device_path.swiglu_quantize, save_inputs=True),
    """``(gate, up, rule, dtype)`` -> ``(q, s, h_hat, gate_q, gate_s,
up_q, up_s)`` (``mxfx::swiglu_quantize_dequantize_save``).""",
)
route_weight_quantize_dequantize = op_or_body(
    _route_weight_quantize_dequantize_op,
    device_path.route_weight_quantize,
    """``(dy, weight, rule, dtype)`` -> ``(q, s, x_hat)``: :func:`route_weight_quantize` plus the dequantized values
in ``dtype`` (``mxfx::route_weight_quantize_dequantize``).""",
)
route_weight_quantize = op_or_body(
    _route_weight_quantize_op,
    device_path.route_weight_quantize,
    """MX quantize of
``dy [S, D] * weight [S]`` formed in fp32 (``mxfx::route_weight_quantize``).""",
)
quantize_blocked = op_or_body(
    _quantize_blocked_op,
    device_path.quantize_blocked,
    """``x [..., K]`` -> ``(qdata,
blocked uint8 scales)`` (``mxfx::quantize_blocked``).""",
)
_TRACED = (
    "Traced on CUDA, the chosen implementation's kernels and GEMM enter the graph (:mod:`mxfx.kernels.common.launch`)."
)
mx_mm = op_or_body(_mm_op, gemm.mm, f"``mxfx::mm`` (shapes and dtypes: :func:`_mm_op`). {_TRACED}")
mx_grouped_mm = op_or_body(
    _grouped_mm_op, gemm.grouped_mm, f"``mxfx::grouped_mm`` (see :func:`_grouped_mm_op`). {_TRACED}"
)
mx_grouped_mm_wgrad = op_or_body(
    _grouped_mm_wgrad_op,
    gemm.grouped_mm_wgrad,
    f"``mxfx::grouped_mm_wgrad`` (see :func:`_grouped_mm_wgrad_op`). {_TRACED}",
)


def mm_into(
    a_qdata, a_scales, b_qdata, b_scales, out: torch.Tensor, accumulate: bool, native: bool, a_dequantized=None
) -> None:
    """:func:`mx_mm` (a wgrad's operands, blocked along the tokens) written into ``out [N, K]`` (``accumulate=False``)
    or added to it (``True``), in ``out``'s dtype: a weight gradient accumulated in the parameter's ``.grad``
    (:mod:`mxfx.runtime.main_grad`). Emulated on the CPU by the FP32 GEMM itself; elsewhere the GEMM, then one pass
    (:func:`mxfx.kernels.common.gemm.accumulate_into`), until a kernel with an accumulating epilogue takes it."""
    if native or out.device.type != "cpu":
        accumulate_into(
            out, mx_mm(a_qdata, a_scales, b_qdata, b_scales, out.dtype, native, None, a_dequantized), accumulate
        )
        return
    gemm.emulated_mm_into(a_qdata, a_scales, b_qdata, b_scales, out, accumulate, a_dequantized)


def grouped_wgrad_into(
    a_qdata, a_scales, b_qdata, b_scales, offs, out: torch.Tensor, accumulate: bool, native: bool
) -> None:
    """:func:`mx_grouped_mm_wgrad` written into ``out [E, N, K]`` or added to it, as :func:`mm_into`."""
    if native or out.device.type != "cpu":
        accumulate_into(
            out, mx_grouped_mm_wgrad(a_qdata, a_scales, b_qdata, b_scales, offs, out.dtype, native), accumulate
        )
        return
    gemm.emulated_grouped_wgrad_into(a_qdata, a_scales, b_qdata, b_scales, offs, out, accumulate)


name_op_functions(globals())
