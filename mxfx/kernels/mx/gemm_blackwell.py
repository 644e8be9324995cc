"""Native MX GEMMs on Blackwell: ``torch._scaled_mm`` (sm100 and sm120) and ``torch._scaled_grouped_mm`` (sm100)
with E8M0 scales in the blocked layout of :mod:`mxfx.numerics.layout`.

Each GEMM computes ``C = A @ B^T`` with both operands MXFP8-blocked along the reduction dim, as
:mod:`mxfx.kernels.mx.gemm` (which chooses this path where the format runs the GEMM natively) states: it builds
exactly the operands the native call reads (:class:`NativeOperands`, by :func:`native_mm_operands`,
:func:`native_grouped_mm_operands`, :func:`native_grouped_wgrad_operands`), makes the call and reads the result back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxfx.kernels.common.gemm import rows_in_groups
from mxfx.numerics import layout

_E8M0 = torch.float8_e8m0fnu
_BLOCK = 32
_MN_ALIGN = 16  # FP8 GEMMs need the non-reduction dims of B (output columns) in multiples of 16 bytes


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
        raise TypeError(
            f"mxfx.gemm: {name} must be float8_e4m3fn qdata with uint8 E8M0 scales, got {qdata.dtype}/{scales.dtype}"
        )
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

    Scales already in the blocked layout (1D, ``blocked_numel(rows, K/32)`` bytes:
    :func:`mxfx.numerics.layout.is_blocked`, as ``mxfx.kernels.mx.device_path.quantize_dual_blocked`` writes them)
    are taken as they are, with no ``to_blocked`` pass; their rows are already padded to 128.

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
        raise ValueError(
            f"mxfx.gemm: mm operands {tuple(a_qdata.shape)} and {tuple(b_qdata.shape)} must be [M, K] and [N, K]"
        )
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
    scale_row = torch.where(
        in_group, t_starts[gid] + r - p_starts[gid], s_rows - 1
    )  # scratch rows: last row, zeroed below
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
    off = base[gid] + ((r // 128) * col_tiles + cl // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + cl % 4
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


def mm(a_qdata, a_scales, b_qdata, b_scales, out_dtype, b_dequantized=None, a_dequantized=None):
    """``torch._scaled_mm`` on :func:`native_mm_operands`: ``[M, N]`` of ``out_dtype`` (the dequantized operands,
    which only the emulation reads, are ignored)."""
    o = native_mm_operands(a_qdata, a_scales, b_qdata, b_scales)
    out = torch._scaled_mm(o.mat_a, o.mat_b, scale_a=o.scale_a, scale_b=o.scale_b, out_dtype=out_dtype)
    return out[:, : o.cols] if out.shape[1] != o.cols else out


def grouped_mm(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype, b_dequantized=None, a_dequantized=None):
    """``torch._scaled_grouped_mm`` on :func:`native_grouped_mm_operands`: ``[S, N]`` of ``out_dtype``, rows past
    ``offs[-1]`` zero (the dequantized operands are ignored, as in :func:`mm`)."""
    o = native_grouped_mm_operands(a_qdata, a_scales, b_qdata, b_scales, offs)
    out = torch._scaled_grouped_mm(o.mat_a, o.mat_b, o.scale_a, o.scale_b, offs=o.offs, out_dtype=out_dtype)
    return rows_in_groups(out.index_select(0, o.rows), offs)


def grouped_wgrad(a_qdata, a_scales, b_qdata, b_scales, offs, out_dtype):
    """``torch._scaled_grouped_mm`` on :func:`native_grouped_wgrad_operands`: ``[E, N, K]`` of ``out_dtype``."""
    o = native_grouped_wgrad_operands(a_qdata, a_scales, b_qdata, b_scales, offs)
    return torch._scaled_grouped_mm(o.mat_a, o.mat_b, o.scale_a, o.scale_b, offs=o.offs, out_dtype=out_dtype)
