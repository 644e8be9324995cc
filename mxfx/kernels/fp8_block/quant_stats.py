"""Fused fp8_block quantization statistics: one launch reads the values a quantize read and the operand's qdata and
FP32 scales, and reduces them to one sample of :func:`mxfx.runtime.stats.reduce_parts` on the device
(:mod:`mxfx.kernels.common.quant_stats`: the fields, the partial rows, the finishing kernel).

The operand is seen as a region ``[B, R, C]`` of scale blocks ``rows_per_scale x 128`` (1x128 tiles: 1; 128x128
weight blocks: 128); a dim that 128 does not divide ends in a shorter block. Per element it reads the values (formed
from up to three sources: ``a``, ``silu(a) * b`` or ``a * w``) and the qdata; per block its scale, whose exponent is
``floor(log2 scale)`` (scales are normal FP32, at least 2^-126: :mod:`mxfx.numerics.block`). Importing this module
imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.common import quant_stats as common
from mxfx.kernels.common.launch import launch
from mxfx.kernels.common.quant_stats import (
    exponent_stats,
    load_values,
    magnitude_bits,
    merge,
    no_stats,
    offsets,
    saturated_payload,
    store_partials,
    tile_origin,
    value_stats,
)
from mxfx.numerics.block import TILE, n_tiles

CONFIG = (32, 128, 4)
"""(BLOCK_R, BLOCK_C, num_warps): rows by columns (one 128-wide tile) of a loop step; a 128x128 block is four."""


@triton.jit
def _block_stats_kernel(
    a_ptr,
    sab,
    sar,
    sac,
    b_ptr,
    sbb,
    sbr,
    sbc,
    w_ptr,
    swb,
    swr,
    swc,
    q_ptr,
    sqb,
    sqr,
    sqc,
    s_ptr,
    ssb,
    ssr,
    ssc,
    map_ptr,
    part_ptr,
    hist_ptr,
    R,
    C,
    n_r_tiles,
    n_c_tiles,
    n_tiles,
    per_prog,
    hist_min,
    COMBINE: tl.constexpr,
    COL_MAP: tl.constexpr,
    SR: tl.constexpr,
    HIST_BINS: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    NB: tl.constexpr = BC // 128
    UNIT: tl.constexpr = SR if SR > BR else BR  # rows of one loop step
    SROWS: tl.constexpr = 1 if SR > 1 else BR  # scale rows of one loop step
    pid = tl.program_id(0)
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    an = tl.arange(0, NB)
    part = no_stats()
    hist = tl.zeros([HIST_BINS], tl.int32)
    dead = tl.zeros([], tl.int32)
    for k in range(0, per_prog):
        t = pid * per_prog + k
        b, r0, c0 = tile_origin(t, n_r_tiles, n_c_tiles, UNIT, BC)
        cols = c0 + ac
        r_end = tl.where(t < n_tiles, R, 0)  # no rows in the steps past the last tile
        if COL_MAP:
            src = tl.load(map_ptr + cols, mask=cols < C, other=-1)
            in_cols = src >= 0
        else:
            src = cols
            in_cols = cols < C
        srows = r0 // SR + tl.arange(0, SROWS)
        sb = c0 // 128 + an
        smask = (srows * SR < r_end)[:, None] & (sb < (C + 127) // 128)[None, :]
        scale = tl.load(s_ptr + offsets(b, srows, sb, ssb, ssr, ssc), mask=smask, other=1.0)
        blk = tl.zeros([SROWS, NB], tl.int32)
        for j in range(0, UNIT // BR):
            rows = r0 + j * BR + ar
            counted = (rows < r_end)[:, None] & in_cols[None, :]
            x = load_values(
                a_ptr + offsets(b, rows, src, sab, sar, sac),
                b_ptr + offsets(b, rows, src, sbb, sbr, sbc),
                w_ptr + offsets(b, rows, src, swb, swr, swc),
                counted,
                COMBINE,
            )
            row_blk = tl.max(tl.reshape(magnitude_bits(x), [BR, NB, 128]), axis=2)  # NaN, Inf above every finite
            if SR > 1:
                blk = tl.maximum(blk, tl.max(row_blk, axis=0, keep_dims=True))
            else:
                blk = row_blk
            qbits = tl.load(q_ptr + offsets(b, rows, cols, sqb, sqr, sqc), mask=counted, other=0)
            q3 = tl.reshape(qbits.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BR, NB, 128])
            dq = tl.reshape(q3 * scale[:, :, None], [BR, BC])
            part = merge(part, value_stats(x, dq, saturated_payload(qbits), counted))
        live = (blk > 0) & (blk < 0x7F800000) & smask
        e = ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        exps, h, d = exponent_stats(e, live, hist_min, HIST_BINS, SROWS * NB)
        part = merge(part, exps)
        hist += h
        dead += d
    store_partials(part_ptr, hist_ptr, pid, part, hist, dead, HIST_BINS)


def stats_vector(
    a: torch.Tensor,
    b: torch.Tensor | None,
    w: torch.Tensor | None,
    qdata: torch.Tensor,
    scales: torch.Tensor,
    rows_per_scale: int = 1,
    col_map: torch.Tensor | None = None,
    hist_min: int = -128,
    hist_bins: int = 256,
) -> torch.Tensor:
    """One sample vector (float64 ``[11 + hist_bins]``, :mod:`mxfx.kernels.common.quant_stats`) of an fp8_block
    operand, from one statistics launch and the finishing one; no host sync.

    Args:
        a, b, w: the sources ``[R, C]`` or ``[B, R, C]`` (any strides, expanded views too) in the operand's layout:
            the values are ``a``, ``silu(a) * b`` (b: SwiGLU up) or ``a * w`` (w: route weights broadcast); b and w
            may be None.
        qdata: float8_e4m3fn ``[.., R, C]``, in the operand's layout (read at the operand's columns).
        scales: float32 ``[.., ceil(R / rows_per_scale), ceil(C / 128)]``, any strides.
        rows_per_scale: 1 (1x128 tiles along C) or 128 (128x128 blocks; they restart at every batch entry).
        col_map: int32 ``[C]``, the source column of each operand column, -1 where it counts nowhere (the region
            is then ``col_map``'s columns); None: column c is source column c.
        hist_min, hist_bins: the exponent histogram's first exponent and bins (a power of two).

    Raises:
        ValueError: ``rows_per_scale`` neither 1 nor 128, tensors that are not one region, or scales not its
            blocks'.
    """
    op = "mxfx.kernels.fp8_block.quant_stats"
    if rows_per_scale not in (1, TILE):
        raise ValueError(f"{op}: rows_per_scale={rows_per_scale} must be 1 or {TILE}")
    C = int(col_map.numel() if col_map is not None else a.shape[-1])
    common.check_region(a, (b, w), (qdata,), C, op)
    if scales.shape[:-1] != (*a.shape[:-2], n_tiles(a.shape[-2]) if rows_per_scale > 1 else a.shape[-2]) or (
        scales.shape[-1] < n_tiles(C)
    ):
        raise ValueError(
            f"{op}: scales {tuple(scales.shape)} are not those of {rows_per_scale}x{TILE} blocks of a "
            f"region {tuple(a.shape[:-1])} x {C}"
        )
    B, R = (a.shape[0] if a.dim() == 3 else 1), a.shape[-2]
    sources = (*common.region_args(a, a), *common.region_args(b, a), *common.region_args(w, a))
    br, bc, warps = CONFIG
    n_r, n_c = triton.cdiv(R, max(br, rows_per_scale)), triton.cdiv(C, bc)
    steps = B * n_r * n_c
    p, per_prog = common.programs(steps)
    partials, hist = common.workspace(p, hist_bins, a.device)
    launch(
        _block_stats_kernel,
        (p,),
        *sources,
        *common.region_args(qdata.view(torch.uint8), a),
        *common.region_args(scales, a),
        col_map if col_map is not None else a,
        partials,
        hist,
        R,
        C,
        n_r,
        n_c,
        steps,
        per_prog,
        hist_min,
        COMBINE=common.combine_code(b, w),
        COL_MAP=col_map is not None,
        SR=rows_per_scale,
        HIST_BINS=hist_bins,
        BR=br,
        BC=bc,
        num_warps=warps,
    )
    return common.finish(partials, hist)
