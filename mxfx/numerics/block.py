"""FP8 block format math ("fp8_block"): the plain-torch reference for quantize and dequantize.

The Hopper-native recipe of DeepSeek-V3 and TransformerEngine's ``Float8BlockScaling``: an E4M3
payload ("qdata", one byte per value) and one float32 scale ("scales") per **1x128 tile** of an
activation or gradient, along the GEMM's reduction dim, or per **128x128 block** of a weight.
``docs/block_format.md`` is the written form of this module; GPU kernels match it bit for bit.

Scale rules (``rule``):

* ``"rceil"`` (default): the scale is a power of two, 2^e with e the smallest integer such that
  amax / 2^e <= 448 (the MX rceil rule of :func:`mxfx.numerics.mx.scale_exponent`, with scales kept
  as float32). Rescaling by a power of two is exact, so the only rounding is the E4M3 one; the
  scale is an exponent alone (DeepSeek-V3's later UE8M0 scales, TransformerEngine's default
  ``power_2_scale``), and one 128x128 grid of power-of-two scales dequantizes to the same values
  whichever way a weight block is read, so a weight's forward and dgrad copies can share it.
  It uses at worst half of E4M3's range above the amax (amax lands in (224, 448]).
* ``"amax"``: s = fl32(amax / 448) and payload E4M3(fl32(x / s)): the amax lands on 448 (up to
  the rounding of s), one more bit of range on average, at the cost of a double rounding and of
  scales that differ between a block and its transpose only through their data. Offered for
  comparison; not byte-identical to TransformerEngine's amax path, which multiplies by a
  rounded reciprocal.

Special tiles and blocks (both rules):

* all zeros (amax = 0): scale 1.0, payload ±0 (each zero keeps its sign).
* any NaN or ±Inf: scale NaN and every payload byte the E4M3 NaN 0x7F, so the whole tile
  dequantizes to NaN and a GEMM that reads it gives NaN in the rows/columns it touches (as in
  :mod:`mxfx.numerics.mx`: no infinity fits E4M3 and none should be silently clamped to 448).
* tiny tiles: scales never go below 2^-126, the smallest normal float32 (GPU code may flush
  subnormal float32 scales to zero); the payload is computed with that stored scale (possibly an
  E4M3 subnormal or zero). Scales never exceed 2^120 for finite data (no clamp needed above).
* saturation: payload magnitudes clamp to 448 (only the amax rule can reach past it, by the
  rounding of s).
* ties: E4M3 rounding is to nearest, ties to even, from the float32 value x / s (exact under
  rceil; under amax that quotient is itself rounded to float32 first).
* partial tiles: a dim that is not a multiple of 128 ends in a shorter tile (block) whose amax
  is taken over the values present: the same bytes as zero-padding to a multiple of 128 and
  slicing. qdata keeps the input's shape; scales have ceil(dim / 128) entries along that dim.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from mxfx.numerics.layout import check_group_ends
from mxfx.numerics.mx import E4M3_MAX, check_input, check_output_dtype, scale_exponent

TILE = 128
"""Values along the reduction dim sharing one scale: a 1x128 tile, or each side of a 128x128 block."""

MIN_SCALE_EXP = -126
"""Smallest scale exponent: 2^-126 is the smallest normal float32."""

ScaleRule = Literal["rceil", "amax"]
SCALE_RULES: tuple[str, ...] = ("rceil", "amax")


def check_rule(rule: str, op: str) -> None:
    """Raise ValueError unless ``rule`` is a block-format scale rule."""
    if rule not in SCALE_RULES:
        raise ValueError(f"{op}: unknown fp8_block scale rule {rule!r}; valid rules: {', '.join(SCALE_RULES)}")


def n_tiles(n: int) -> int:
    """Tiles of 128 covering ``n`` values (the last one partial when 128 does not divide n)."""
    return -(-n // TILE)


def block_scales(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """float32 scale per tile from its float32 amax (module docstring: zero -> 1, non-finite -> NaN,
    never below 2^-126)."""
    if rule == "rceil":
        e = scale_exponent(amax, "rceil").clamp_min(MIN_SCALE_EXP)
        s = torch.exp2(e.to(torch.float32))
    else:
        check_rule(rule, "mxfx.numerics.block")
        s = (amax / E4M3_MAX).clamp_min(2.0**MIN_SCALE_EXP)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


NAN_BYTE = 0x7F
"""The E4M3 byte of every payload value of a NaN tile (positive NaN, S.1111.111)."""


def encode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E4M3 payload of float32 ``blocks`` divided by ``scales`` (broadcast), saturating; NaN scale -> NaN."""
    scaled = (blocks / scales).clamp(-E4M3_MAX, E4M3_MAX)  # clamp keeps NaN; torch's cast gives NaN above 464
    q = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    # a NaN tile: every byte 0x7F, whatever sign the NaN of each quotient carries (it varies by hardware)
    q = torch.where(torch.isnan(scales).expand_as(q), torch.full_like(q, NAN_BYTE), q)
    return q.view(torch.float8_e4m3fn)


def quantize_1x128_lastdim(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Reference 1x128 quantize along the last dim (no checks).

    ``x [..., K]`` -> ``(qdata float8_e4m3fn [..., K] contiguous, scales float32 [..., ceil(K/128)])``.
    """
    *lead, k = x.shape
    t = n_tiles(k)
    xf = F.pad(x.to(torch.float32), (0, t * TILE - k))
    blocks = xf.reshape(*lead, t, TILE)
    s = block_scales(blocks.abs().amax(dim=-1), rule)
    q = encode(blocks, s.unsqueeze(-1)).reshape(*lead, t * TILE)[..., :k]
    return q.contiguous(), s.contiguous()


def quantize_128x128_lastdims(w: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Reference 128x128 quantize over the last two dims (no checks).

    ``w [..., N, K]`` -> ``(qdata float8_e4m3fn [..., N, K], scales float32 [..., ceil(N/128), ceil(K/128)])``.
    """
    *lead, n, k = w.shape
    tn, tk = n_tiles(n), n_tiles(k)
    wf = F.pad(w.to(torch.float32), (0, tk * TILE - k, 0, tn * TILE - n))
    blocks = wf.reshape(*lead, tn, TILE, tk, TILE)
    s = block_scales(blocks.abs().amax(dim=(-3, -1)), rule)
    q = encode(blocks, s[..., :, None, :, None]).reshape(*lead, tn * TILE, tk * TILE)[..., :n, :k]
    return q.contiguous(), s.contiguous()


def expand_scales(scales: torch.Tensor, shape, dims: tuple[int, ...]) -> torch.Tensor:
    """Scales repeated 128 times along each of ``dims`` and cut to ``shape``: one scale per value."""
    out = scales
    for d in dims:
        out = out.repeat_interleave(TILE, dim=d)
    return out[tuple(slice(0, n) for n in shape)]


def dequantize_values(qdata: torch.Tensor, scales: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """float32 ``qdata * scale`` with ``scales`` tiled along ``dims`` (negative indices); exact
    (E4M3 x power of two), or one float32 rounding under the amax rule."""
    return qdata.to(torch.float32) * expand_scales(scales, qdata.shape, dims)


def tiled_rows(b: torch.Tensor, b_scales: torch.Tensor) -> bool:
    """True when B's scales are 1x128 (one row of scales per row of B), False for 128x128 blocks
    (with one row of B the two read the same)."""
    return b_scales.shape[0] == b.shape[0]


def _check_pair(qdata, scales, expected, op):
    if qdata.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"{op}: qdata of shape {tuple(qdata.shape)} has dtype {qdata.dtype}, expected torch.float8_e4m3fn"
        )
    if scales.dtype != torch.float32:
        raise TypeError(
            f"{op}: scales of shape {tuple(scales.shape)} have dtype {scales.dtype}, expected torch.float32"
        )
    if qdata.device != scales.device:
        raise ValueError(f"{op}: qdata is on {qdata.device} but scales are on {scales.device}; move them to one device")
    if tuple(scales.shape) != tuple(expected):
        raise ValueError(
            f"{op}: scales of shape {tuple(scales.shape)} do not match qdata of shape {tuple(qdata.shape)}; "
            f"expected scales of shape {tuple(expected)}"
        )


@torch.compiler.disable
def quantize_1x128(x: torch.Tensor, axis: int = -1, rule: ScaleRule = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to fp8_block in 1x128 tiles along ``axis`` (the GEMM's reduction dim).

    Args:
        x: bf16/fp16/fp32, any shape and strides; ``x.shape[axis]`` need not be a multiple of 128
            (the last tile is partial, see the module docstring).
        axis: the tiled axis (default last; -2 tiles down columns, the wgrad operands' tokens).
        rule: ``"rceil"`` (power-of-two scales, default) or ``"amax"``.

    Returns:
        ``(qdata, scales)``: qdata float8_e4m3fn of x's shape; scales float32 of x's shape with
        ``axis`` replaced by ``ceil(x.shape[axis] / 128)``.
    """
    op = "mxfx.numerics.block.quantize_1x128"
    check_input(x, op, "fp8_block", min_dim=1)
    check_rule(rule, op)
    axis = _axis(x, axis, op)
    with torch.no_grad():
        q, s = quantize_1x128_lastdim(x.movedim(axis, -1), rule)
    return q.movedim(-1, axis), s.movedim(-1, axis)


@torch.compiler.disable
def quantize_128x128(w: torch.Tensor, rule: ScaleRule = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight ``w [..., N, K]`` to fp8_block in 128x128 blocks over its last two dims.

    Returns ``(qdata float8_e4m3fn [..., N, K], scales float32 [..., ceil(N/128), ceil(K/128)])``.
    Under ``"rceil"`` the same pair, transposed, is the 128x128 quantize of ``w`` transposed.
    """
    op = "mxfx.numerics.block.quantize_128x128"
    check_input(w, op, "fp8_block", min_dim=2)
    check_rule(rule, op)
    with torch.no_grad():
        return quantize_128x128_lastdims(w, rule)


@torch.compiler.disable
def dequantize_1x128(
    qdata: torch.Tensor, scales: torch.Tensor, axis: int = -1, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dequantize a 1x128 pair tiled along ``axis``: ``qdata * scale`` formed in float32, cast to ``dtype``."""
    op = "mxfx.numerics.block.dequantize_1x128"
    axis = _axis(qdata, axis, op)
    expected = list(qdata.shape)
    expected[axis] = n_tiles(expected[axis])
    _check_pair(qdata, scales, expected, op)
    check_output_dtype(dtype, qdata, op)
    return dequantize_values(qdata, scales, (axis - qdata.dim(),)).to(dtype)


@torch.compiler.disable
def dequantize_128x128(qdata: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize a 128x128 pair over the last two dims: ``qdata * scale`` in float32, cast to ``dtype``."""
    op = "mxfx.numerics.block.dequantize_128x128"
    if qdata.dim() < 2:
        raise ValueError(f"{op}: qdata of shape {tuple(qdata.shape)} needs at least 2 dims [..., N, K]")
    expected = (*qdata.shape[:-2], n_tiles(qdata.shape[-2]), n_tiles(qdata.shape[-1]))
    _check_pair(qdata, scales, expected, op)
    check_output_dtype(dtype, qdata, op)
    return dequantize_values(qdata, scales, (-2, -1)).to(dtype)


def _axis(x: torch.Tensor, axis, op: str) -> int:
    if x.dim() == 0:
        raise ValueError(f"{op}: a scalar cannot be block-quantized; give a tensor with at least one dimension")
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"{op}: axis {axis!r} for shape {tuple(x.shape)} must be an int dimension index")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"{op}: axis {axis} is out of range for shape {tuple(x.shape)}")
    return axis % x.dim()


def group_tile_capacity(rows: int, groups: int) -> int:
    """Scale slots for 1x128 tiles along ``rows`` tokens that restart at each of ``groups`` group starts:
    ``ceil(rows / 128) + groups`` bounds the sum of ``ceil(size_g / 128)`` whatever the sizes (no sync)."""
    return n_tiles(rows) + groups


def group_tile_starts(offs: torch.Tensor) -> torch.Tensor:
    """First scale slot of each group's token tiles: the cumulative ``ceil(size_g / 128)`` before it (int64)."""
    sizes = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    tiles = (sizes + TILE - 1) // TILE
    return torch.cumsum(tiles, 0) - tiles


@torch.compiler.disable
def quantize_1x128_grouped_tokens(
    x: torch.Tensor, offs: torch.Tensor, rule: ScaleRule = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles down the token dim of ``x [S, K]``, restarting at every group start (grouped wgrad), each tile
    in a 128-row slot of its own.

    Group g owns rows ``[offs[g-1], offs[g])`` (``offs`` int32 cumulative ends, as ``torch._grouped_mm``);
    its last tile is partial unless its size is a multiple of 128. Returns ``(qdata [128 * C, K], scales [C, K])``
    with ``C = group_tile_capacity(S, G)``: group g's tile j in slot ``group_tile_starts(offs)[g] + j``, its
    rows at ``128 * slot + i``; rows of a slot past the group's end, and the slots past the last group's, hold
    +0 payload with scale 1.0. Every slot starts at a multiple of 128 rows, so a GEMM reads whole aligned tiles
    and no mask. Rows past ``offs[-1]`` are in no group.
    """
    op = "mxfx.numerics.block.quantize_1x128_grouped_tokens"
    check_input(x, op, "fp8_block", min_dim=2)
    check_rule(rule, op)
    if x.dim() != 2:
        raise ValueError(f"{op}: needs x [S, K], got shape {tuple(x.shape)}")
    s, k = x.shape
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: offs must be int32 (or int64) [G] group ends, got {offs.dtype} {tuple(offs.shape)}")
    ends = offs.tolist()
    check_group_ends(ends, s, op)
    slots = group_tile_capacity(s, offs.numel())
    q = torch.zeros(TILE * slots, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.ones(slots, k, dtype=torch.float32, device=x.device)
    start, slot = 0, 0
    with torch.no_grad():
        for end in ends:
            if end > start:
                gq, gs = quantize_1x128_lastdim(x[start:end].t(), rule)
                q[TILE * slot : TILE * slot + end - start] = gq.t()
                scales[slot : slot + gs.shape[1]] = gs.t()
                slot += gs.shape[1]
            start = end
    return q, scales


def check_group_slots(ends: list[int], slots: int, op: str) -> None:
    """Raise ValueError naming ``op`` unless the cumulative group ends ``ends`` (read on the host) are non-negative,
    non-decreasing and their groups' 128-token tiles fit in ``slots`` (an operand of
    :func:`quantize_1x128_grouped_tokens` made with other group ends would be read at the wrong tiles)."""
    check_group_ends(ends, max([0, *ends]), op)
    tiles = sum(n_tiles(b - a) for a, b in zip([0, *ends], ends))
    if tiles > slots:
        raise ValueError(
            f"{op}: offs {ends} make {tiles} tiles of 128 tokens, more than the operands' {slots} slots; quantize the "
            f"operands with these group ends (quantize_1x128_grouped_tokens)"
        )


def group_token_slots(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Row of each of ``rows`` tokens in a :func:`quantize_1x128_grouped_tokens` operand (int64 ``[rows]``): token t
    of group g at ``128 * group_tile_starts(offs)[g] + t - offs[g-1]``; -1 for a token past ``offs[-1]``."""
    ends = offs.to(torch.int64)
    t = torch.arange(rows, device=offs.device)
    group = torch.searchsorted(ends, t, right=True)
    read = group < ends.shape[0]
    group = group.clamp(max=max(ends.shape[0] - 1, 0))
    first = torch.cat([ends.new_zeros(1), ends[:-1]])
    return torch.where(read, TILE * group_tile_starts(offs)[group] + t - first[group], -1)
