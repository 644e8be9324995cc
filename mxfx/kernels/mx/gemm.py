"""MX GEMM: ``C = A @ B^T`` with both operands MXFP8-blocked along the reduction dim.

Every GEMM of a linear is written in this one orientation (``docs/format.md``,
"GEMM operand orientation"): forward ``X[M,K] . W[N,K]^T``, dgrad
``dY[M,N] . (W^T)[K,N]^T``, wgrad ``dY^T[N,M] . X^T[K,M]^T``. Callers quantize
each operand so that its last dim is the reduction dim.

Three custom ops (``mxfx::mm``, ``mxfx::grouped_mm``, ``mxfx::grouped_mm_wgrad``) run one of two
implementations, as their ``native`` argument says: the MXFP8 format (:mod:`mxfx.formats.mxfp8`) passes True where
its ``native_gemms`` list the op for the device's architecture.

* native (sm100 all three, sm120 dense only): ``torch._scaled_mm`` / ``torch._scaled_grouped_mm``
  with E8M0 scales in the blocked layout of :mod:`mxfx.numerics.layout`; operands built by
  :func:`native_mm_operands`, :func:`native_grouped_mm_operands`, :func:`native_grouped_wgrad_operands`.
* emulated (Hopper, older GPUs, CPU): both operands dequantized exactly (fp32 on CPU, bf16 on CUDA,
  exact for E4M3 x 2^e except scales below 2^-118) and multiplied with fp32 accumulation: equal to a
  native MX GEMM up to summation order. Operands may arrive already dequantized (``a_dequantized``
  from the quantize pass, ``b_dequantized`` from the weight cache under ``keep_dequantized_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mxfx.numerics import layout
from mxfx.kernels.common import gemm as common_gemm
from mxfx.kernels.common.gemm import accumulate_into, rows_in_groups
from mxfx.kernels.mx import custom_ops
from mxfx.kernels.mx.device_path import dequantize_lastdim
from mxfx.kernels.common.launch import name_op_functions, op_or_body

_E8M0 = torch.float8_e8m0fnu
_BLOCK = 32
_MN_ALIGN = 16  # FP8 GEMMs need the non-reduction dims of B (output columns) in multiples of 16 bytes


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
    (written by the activation's quantize pass, :func:`quantize_operand`) dequantizing A.
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


# --- native operands (Blackwell) ---------------------------------------------------------------


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad dim -2 of ``t`` to ``rows`` (bytewise, so it works for float8 on any device)."""
    if t.shape[-2] == rows:
        return t.contiguous()
    raw = t.contiguous().view(torch.uint8)
    out = raw.new_zeros((*raw.shape[:-2], rows, raw.shape[-1]))
    out[..., : t.shape[-2], :] = raw
    return out.view(t.dtype)


def _blocked_scales(qdata: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales of ``qdata`` in the blocked layout. Its rows are padded to 128 with zero bytes, which also
    covers the operand's own padding to 16 rows (zero rows of qdata)."""
    return (scales if layout.is_blocked(qdata, scales) else layout.to_blocked(scales)).view(_E8M0)


def _check_pair(name: str, qdata: torch.Tensor | None, scales: torch.Tensor | None) -> None:
    if qdata is None or scales is None:
        raise ValueError(
            f"mxfx.gemm: native MX GEMMs need {name}'s MX pair, got None (dequantized values alone serve only "
            f"emulated GEMMs); pass its qdata and scales"
        )
    if qdata.dtype != torch.float8_e4m3fn or scales.dtype != torch.uint8:
        raise TypeError(f"mxfx.gemm: {name} must be float8_e4m3fn qdata with uint8 E8M0 scales, got {qdata.dtype}/{scales.dtype}")
    k = qdata.shape[-1]
    if k % _BLOCK == 0 and layout.is_blocked(qdata, scales):
        return
    if k % _BLOCK or tuple(scales.shape) != (*qdata.shape[:-1], k // _BLOCK):
        raise ValueError(
            f"mxfx.gemm: {name} qdata {tuple(qdata.shape)} and scales {tuple(scales.shape)} do not pair up "
            f"(need the reduction dim a multiple of {_BLOCK} and scales [..., K/{_BLOCK}])"
        )


@dataclass(frozen=True)
class NativeOperands:
    """Exactly what one native call receives, plus how to read its result back.

    Attributes:
        mat_a: float8_e4m3fn, row-major (2D).
        mat_b: float8_e4m3fn, ``[K, N]`` (or ``[E, K, N]``) column-major: ``B^T`` of the logical operand.
        scale_a, scale_b: float8_e8m0fnu scales in the blocked layout (:mod:`mxfx.numerics.layout`).
        offs: int32 group ends the native grouped call gets (None for dense).
        rows: int64 ``[S]`` row of the native result holding each logical output row (None: rows 0..M-1).
        cols: number of logical output columns (the native result may have zero-padded extra columns).
    """

    mat_a: torch.Tensor
    mat_b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    offs: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    cols: int = 0


def native_mm_operands(a_qdata, a_scales, b_qdata, b_scales) -> NativeOperands:
    """Operands of ``torch._scaled_mm`` for ``dequant(A)[M,K] @ dequant(B)[N,K]^T``.

    Scales go to the blocked layout (:func:`mxfx.numerics.layout.to_blocked`: rows padded
    to 128, scale columns to 4, padding bytes zero) and are viewed as
    ``float8_e8m0fnu``, which is how ``_scaled_mm`` recognises the MXFP8 recipe
    (torch ``check_mxfp8_recipe``: e4m3 operands, one BlockWise1x32 e8m0 scale
    each; torchao ``_addmm_mx_dispatch`` builds the same call). B's rows (the
    output columns) are zero-padded to a multiple of 16 when needed, the FP8
    GEMM alignment; the caller slices the result to ``cols``. A's rows need no
    padding: only its scales are padded, by the layout.

    Scales already in the blocked layout (1D, ``blocked_numel(rows, K/32)`` bytes: :func:`is_blocked`,
    as ``mxfx.kernels.mx.device_path.quantize_dual_blocked`` writes them) are taken as they are, with no ``to_blocked``
    pass; their rows are already padded to 128.

    Args:
        a_qdata: float8_e4m3fn ``[M, K]``; a_scales: uint8 ``[M, K/32]``, or blocked.
        b_qdata: float8_e4m3fn ``[N, K]``; b_scales: uint8 ``[N, K/32]``, or blocked.

    Returns:
        :class:`NativeOperands` with ``mat_a [M, K]`` row-major, ``mat_b [K, N']``
        column-major (N' = N rounded up to 16), scales flat blocked e8m0.

    Raises:
        TypeError / ValueError: operands that are not MX pairs or do not share K.
    """
    _check_pair("A", a_qdata, a_scales)
    _check_pair("B", b_qdata, b_scales)
    if a_qdata.dim() != 2 or b_qdata.dim() != 2 or a_qdata.shape[1] != b_qdata.shape[1]:
        raise ValueError(f"mxfx.gemm: mm operands {tuple(a_qdata.shape)} and {tuple(b_qdata.shape)} must be [M, K] and [N, K]")
    n = b_qdata.shape[0]
    n_pad = _ceil_to(n, _MN_ALIGN)
    return NativeOperands(
        mat_a=a_qdata.contiguous(),
        mat_b=_pad_rows(b_qdata, n_pad).t(),
        scale_a=_blocked_scales(a_qdata, a_scales),
        scale_b=_blocked_scales(b_qdata, b_scales),
        cols=n,
    )


def _group_starts(ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, sizes) int64 of groups given their cumulative int ``ends``."""
    ends = ends.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    return ends - sizes, sizes


def native_grouped_mm_operands(a_qdata, a_scales, b_qdata, b_scales, offs) -> NativeOperands:
    """Operands of ``torch._scaled_grouped_mm`` (2D x 3D) for the routed expert GEMM.

    The layout torch's MXFP8 grouped kernel (FBGEMM, sm100) reads, as torchao's
    ``_compute_fwd_sm100`` and torch's ``test_mxfp8_scaled_grouped_mm_2d_3d`` build it:

    * every token group is zero-padded to a multiple of 32 rows (an MX kernel
      tile never mixes two experts; torchao ``pad_token_groups_for_grouped_mm``),
      ``offs`` become the padded group ends;
    * A's scales are blocked *per group*: group g's scale rows start on a
      128-row tile boundary (at the sum of the earlier groups' sizes rounded up
      to 128), so the whole matrix equals the concatenation of each group's
      :func:`~mxfx.numerics.layout.to_blocked` (torchao ``torch_to_blocked_2d_M_groups``);
      shape ``[R, ceil4(K/32)]`` with a static ``R`` (S + 31E + 32 rounded to 32, plus 128 E);
    * B's scales are blocked per expert: ``[E, blocked_numel(N, K/32)]``.

    Args:
        a_qdata/a_scales: ``[S, K]`` e4m3 / ``[S, K/32]`` uint8, rows sorted by group.
        b_qdata/b_scales: ``[E, N, K]`` e4m3 / ``[E, N, K/32]`` uint8.
        offs: int32 ``[E]`` cumulative group ends (empty groups allowed, no host sync).

    Returns:
        :class:`NativeOperands`; the logical output row i is row ``rows[i]`` of
        the native result (rows past ``offs[-1]`` point at a scratch block and
        must be zeroed by the caller).
    """
    _check_pair("A", a_qdata, a_scales)
    _check_pair("B", b_qdata, b_scales)
    s, k = a_qdata.shape
    e, n, _ = b_qdata.shape
    kb = k // _BLOCK
    dest, padded_offs, capacity = layout.group_padding(offs, s)
    a_pad = a_qdata.new_zeros((capacity, k)).view(torch.uint8).index_copy(0, dest, a_qdata.view(torch.uint8))
    # scale row of each padded row: its group's 128-aligned start + its index inside the group
    p_starts, p_sizes = _group_starts(padded_offs)
    t_sizes = (p_sizes + 127) // 128 * 128
    t_starts = torch.cumsum(t_sizes, 0) - t_sizes
    s_rows = _ceil_to(capacity, 128) + 128 * e
    r = torch.arange(capacity, device=offs.device)
    gid = torch.searchsorted(padded_offs.to(torch.int64), r, right=True)
    in_group = gid < e
    gid = gid.clamp(max=e - 1)
    scale_row = torch.where(in_group, t_starts[gid] + r - p_starts[gid], s_rows - 1)  # scratch rows: last row, zeroed below
    padded_scales = a_scales.new_zeros((capacity, kb)).index_copy(0, dest, a_scales)
    rows_scales = a_scales.new_zeros((s_rows, kb)).index_copy(0, scale_row, padded_scales)
    rows_scales[s_rows - 1] = 0
    n_pad = _ceil_to(n, 128)  # per-expert scale tiles; qdata N stays (N is a multiple of 32)
    b_s = _pad_rows(b_scales, n_pad).reshape(e * n_pad, kb)
    return NativeOperands(
        mat_a=a_pad.view(a_qdata.dtype),
        mat_b=b_qdata.contiguous().transpose(-2, -1),
        scale_a=layout.to_blocked(rows_scales).view(_E8M0).reshape(s_rows, _ceil_to(kb, 4)),
        scale_b=layout.to_blocked(b_s).view(_E8M0).reshape(e, -1),
        offs=padded_offs,
        rows=dest,
        cols=n,
    )


def k_groups_blocked(scales: torch.Tensor, scale_offs: torch.Tensor) -> torch.Tensor:
    """Blocked layout of scales whose reduction dim is cut into groups (the 2D x 2D wgrad).

    Group g (scale columns ``scale_offs[g-1]:scale_offs[g]``) is laid out as its own
    :func:`~mxfx.numerics.layout.to_blocked` matrix ``[ceil128(rows), ceil4(cols_g)]``,
    starting at byte ``ceil128(rows) * (sum of earlier ceil4(cols))``; as torchao's
    ``torch_to_blocked_2d_K_groups``. Output ``[ceil128(rows), cols + 4 E]`` uint8.
    """
    rows, cols = scales.shape
    e = scale_offs.shape[0]
    prows = _ceil_to(rows, 128)
    starts, sizes = _group_starts(scale_offs)
    width = (sizes + 3) // 4 * 4
    base = (torch.cumsum(width, 0) - width) * prows
    c = torch.arange(cols, device=scales.device)
    gid = torch.searchsorted(scale_offs.to(torch.int64), c, right=True).clamp(max=e - 1)
    cl = c - starts[gid]  # column inside the group
    col_tiles = width[gid] // 4
    r = torch.arange(rows, device=scales.device).unsqueeze(1)
    off = (
        base[gid]
        + ((r // 128) * col_tiles + cl // 4) * 512
        + (r % 32) * 16
        + ((r % 128) // 32) * 4
        + cl % 4
    )
    out = scales.new_zeros(prows * (cols + 4 * e))
    out[off.reshape(-1)] = scales.reshape(-1)
    return out.view(prows, cols + 4 * e)


def native_grouped_wgrad_operands(a_qdata, a_scales, b_qdata, b_scales, offs) -> NativeOperands:
    """Operands of ``torch._scaled_grouped_mm`` (2D x 2D, groups along the reduction dim) for routed wgrad.

    Args:
        a_qdata/a_scales: ``[N, T]`` / ``[N, T/32]``, blocked along tokens T.
        b_qdata/b_scales: ``[K, T]`` / ``[K, T/32]``, blocked along tokens T.
        offs: int32 ``[E]`` group ends along T, each a multiple of 32 (mxfx pads groups so).

    Returns:
        :class:`NativeOperands`: ``mat_a [N, T]`` row-major, ``mat_b [T, K]``
        column-major, scales per :func:`k_groups_blocked` (group ends ``offs / 32``).
    """
    _check_pair("A", a_qdata, a_scales)
    _check_pair("B", b_qdata, b_scales)
    scale_offs = torch.div(offs, _BLOCK, rounding_mode="floor")
    return NativeOperands(
        mat_a=a_qdata.contiguous(),
        mat_b=b_qdata.contiguous().t(),
        scale_a=k_groups_blocked(a_scales, scale_offs).view(_E8M0),
        scale_b=k_groups_blocked(b_scales, scale_offs).view(_E8M0),
        offs=offs,
        cols=b_qdata.shape[0],
    )


def _native_mm(a_qdata, a_scales, b_qdata, b_scales, out_dtype, b_dequantized=None, a_dequantized=None):
    o = native_mm_operands(a_qdata, a_scales, b_qdata, b_scales)
    out = torch._scaled_mm(o.mat_a, o.mat_b, scale_a=o.scale_a, scale_b=o.scale_b, out_dtype=out_dtype)
    return out[:, : o.cols] if out.shape[1] != o.cols else out


def _native_grouped_mm(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, b_dequantized=None, a_dequantized=None):
    o = native_grouped_mm_operands(a_qdata, a_scales, b_qdata, b_scales, offs)
    out = torch._scaled_grouped_mm(o.mat_a, o.mat_b, o.scale_a, o.scale_b, offs=o.offs, out_dtype=out_dtype)
    return rows_in_groups(out.index_select(0, o.rows), offs)


def _native_grouped_wgrad(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype):
    o = native_grouped_wgrad_operands(a_qdata, a_scales, b_qdata, b_scales, offs)
    return torch._scaled_grouped_mm(o.mat_a, o.mat_b, o.scale_a, o.scale_b, offs=o.offs, out_dtype=out_dtype)


# --- the ops -----------------------------------------------------------------------------------
#
# Each op takes ``native``: whether it runs as a native MX GEMM (the format decides, per GEMM op and device:
# :attr:`mxfx.formats.base.Format.native_gemms`), else emulated.


def _mm(a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized=None, a_dequantized=None):
    impl = _native_mm if native else _emulated_mm
    return impl(a_qdata, a_scales, b_qdata, b_scales, out_dtype, b_dequantized, a_dequantized)


def _grouped_mm(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native, b_dequantized=None, a_dequantized=None):
    impl = _native_grouped_mm if native else _emulated_grouped_mm
    return impl(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, b_dequantized, a_dequantized)


def _grouped_mm_wgrad(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, native):
    impl = _native_grouped_wgrad if native else _emulated_grouped_wgrad
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
            quantize pass that made A (:func:`quantize_operand`); likewise. With it, an
            emulated GEMM also takes ``a_qdata`` and ``a_scales`` as None
            (:func:`quantize_dual_operand`).
    """
    return _mm(a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized, a_dequantized)


@_mm_op.register_fake
def _(a_qdata, a_scales, b_qdata, b_scales, out_dtype, native, b_dequantized=None, a_dequantized=None):
    a = a_qdata if a_qdata is not None else a_dequantized
    b = b_qdata if b_qdata is not None else b_dequantized
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def quantize_operand(x: torch.Tensor, rule: str, values: torch.dtype | None):
    """Rowwise MX of a GEMM's A operand: ``(qdata [..., K], scales [..., K/32], x_hat or None)``.

    ``values``: the dtype an emulated GEMM reads its operands in (:func:`emulation_dtype`), None for a native
    one. With it the same pass also writes ``x_hat`` = dequant(qdata, scales) in that dtype
    (``mxfx::quantize_dequantize``): pass it to :func:`mx_mm` / :func:`mx_grouped_mm` as ``a_dequantized`` and
    the GEMM reads it instead of dequantizing A again. Without it ``x_hat`` is None. Same values either way.
    """
    return a_operand(values, custom_ops.quantize, custom_ops.quantize_dequantize, x, rule)


def a_operand(values: torch.dtype | None, quantize: Callable, quantize_with_values: Callable, x: torch.Tensor, *args):
    """The A operand of a GEMM made by a quantize pass over ``x``: ``(qdata, scales, values or None)``.

    ``quantize(x, *args) -> (qdata, scales)`` for a native GEMM (``values`` None);
    ``quantize_with_values(x, *args, values) -> (qdata, scales, dequantized)``, the same pass also writing
    the dequantized values in dtype ``values``, for an emulated one (pass them on as ``a_dequantized``). Used by
    :func:`quantize_operand`, the fused SwiGLU and route-weight quantizes.
    """
    if values is not None:
        return quantize_with_values(x, *args, values)
    return (*quantize(x, *args), None)


def quantize_dual_operand(x: torch.Tensor, rule: str, values: torch.dtype | None):
    """Both orientations of ``x [M, K]`` as operands of dense GEMMs, from one read:
    ``(q_row, s_row, row_hat, q_col, s_col, col_hat)``.

    The rowwise operand is blocked along K (``[M, K]``, a dgrad's A); the columnwise one down M
    (``[K, M]``, a wgrad's A). For emulated GEMMs (``values``: the dtype they read, :func:`emulation_dtype`)
    the pass writes only the dequantized values of both, in that dtype, and the MX pairs are None
    (``mxfx::quantize_dual_dequantized``: the GEMMs read nothing else, and no dequantize pass
    follows); ``col_hat`` is then the transpose view of an ``[M, K]`` tensor. For native MX GEMMs (``values``
    None) the MX pairs come back and the ``*_hat`` are None, both scale matrices in the blocked layout the
    native GEMM reads (``mxfx::quantize_dual_blocked``; 1D, not to be sliced: zero token rows padded in get scale
    byte 0, the layout's own padding). Same values either way. M and K must be multiples of 32 (pad the tokens
    first).

    Raises:
        ValueError: x not 2D/3D, or M or K not a multiple of 32.
        TypeError: x not a bf16/fp16/fp32 tensor.
    """
    if values is not None:
        row_hat, col_hat = custom_ops.quantize_dual_dequantized(x, rule, values)
        return None, None, row_hat, None, None, col_hat.transpose(-2, -1)
    q, s, qt, st = custom_ops.quantize_dual_blocked(x, rule)
    return q, s, None, qt, st, None


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
