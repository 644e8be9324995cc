"""Fused MXFP8 quantization statistics: one launch reads the values a quantize read and the operand it made, and
reduces them to one sample of :func:`mxfx.runtime.stats.reduce_parts` on the device
(:mod:`mxfx.kernels.common.quant_stats`: the fields, the partial rows, the finishing kernel).

The operand is seen as a region ``[B, R, C]`` blocked along C in 32-value blocks. Per element it reads the values
(formed from up to three sources: ``a``, ``silu(a) * b`` or ``a * w``), and the qdata with the E8M0 scale of its
block, or the operand's dequantized values (an emulated GEMM's), or both; the scale exponent of a block comes from
the scales, or, for an operand of dequantized values alone, from the block's amax under the scale rule (the bytes
the quantize wrote: :func:`mxfx.kernels.mx.blocks.block_scale`). Importing this module imports Triton.
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
    merge,
    no_stats,
    offsets,
    saturated_payload,
    store_partials,
    tile_origin,
    value_stats,
)
from mxfx.kernels.mx.blocks import abs_bits, block_scale, blocked_offset, decode_scale
from mxfx.numerics.layout import is_blocked
from mxfx.numerics.mx import BLOCK_SIZE, check_rule

CONFIG = (32, 128, 8)
"""(BLOCK_R, BLOCK_C, num_warps): one tile of BLOCK_R rows by BLOCK_C / 32 blocks per loop step of a program."""

SCALES_FROM_VALUES, SCALES_STRIDED, SCALES_BLOCKED = 0, 1, 2
"""Where a launch reads its scales (``SCALES``): none given (the block amax of the values under the rule), an
E8M0 tensor ``[B, R, C/32]`` read through its strides, the blocked layout (:mod:`mxfx.numerics.layout`)."""


@triton.jit
def _mx_stats_kernel(
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
    v_ptr,
    svb,
    svr,
    svc,
    map_ptr,
    part_ptr,
    hist_ptr,
    R,
    C,
    CS,
    SCOLS,
    n_r_tiles,
    n_c_tiles,
    n_tiles,
    per_prog,
    hist_min,
    COMBINE: tl.constexpr,
    SCALES: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_VALUES: tl.constexpr,
    COL_MAP: tl.constexpr,
    RCEIL: tl.constexpr,
    HIST_BINS: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    NB: tl.constexpr = BC // 32
    pid = tl.program_id(0)
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    an = tl.arange(0, NB)
    part = no_stats()
    hist = tl.zeros([HIST_BINS], tl.int32)
    dead = tl.zeros([], tl.int32)
    for k in range(0, per_prog):
        t = pid * per_prog + k
        b, r0, c0 = tile_origin(t, n_r_tiles, n_c_tiles, BR, BC)
        rows = r0 + ar
        cols = c0 + ac
        rmask = rows < tl.where(t < n_tiles, R, 0)  # no rows in the steps past the last tile
        if COL_MAP:
            src = tl.load(map_ptr + cols, mask=cols < C, other=-1)
            counted = rmask[:, None] & (src >= 0)[None, :]
            loaded = counted
        else:
            src = cols
            counted = rmask[:, None] & (cols < C)[None, :]
            loaded = rmask[:, None] & (cols < CS)[None, :]
        x = load_values(
            a_ptr + offsets(b, rows, src, sab, sar, sac),
            b_ptr + offsets(b, rows, src, sbb, sbr, sbc),
            w_ptr + offsets(b, rows, src, swb, swr, swc),
            loaded,
            COMBINE,
        )
        blk = tl.max(tl.reshape(abs_bits(x), [BR, NB, 32]), axis=2)  # NaN and Inf bits sort above every finite
        live = (blk > 0) & (blk < 0x7F800000)
        sb = c0 // 32 + an
        smask = rmask[:, None] & (sb < (C + 31) // 32)[None, :]
        if SCALES == 0:  # SCALES_FROM_VALUES
            _, sbyte, _ = block_scale(blk, RCEIL)
        elif SCALES == 1:  # SCALES_STRIDED
            sbyte = tl.load(s_ptr + offsets(b, rows, sb, ssb, ssr, ssc), mask=smask, other=0)
        else:  # SCALES_BLOCKED
            sbyte = tl.load(s_ptr + blocked_offset(rows[:, None], sb[None, :], SCOLS), mask=smask, other=0)
        scale = decode_scale(sbyte)
        if HAS_Q:
            qbits = tl.load(q_ptr + offsets(b, rows, cols, sqb, sqr, sqc), mask=counted, other=0)
        if HAS_VALUES:
            dq = tl.load(v_ptr + offsets(b, rows, cols, svb, svr, svc), mask=counted, other=0.0).to(tl.float32)
        else:
            q3 = tl.reshape(qbits.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BR, NB, 32])
            dq = tl.reshape(q3 * scale[:, :, None], [BR, BC])
        if HAS_Q:
            sat = saturated_payload(qbits)
        else:  # dequantized values alone: payload 448 is the value 448 * scale (exact in bf16 and fp32)
            top = (448.0 * scale)[:, :, None]
            sat = tl.reshape(tl.abs(tl.reshape(dq, [BR, NB, 32])) == top, [BR, BC])
        part = merge(part, value_stats(x, dq, sat, counted))
        exps, h, d = exponent_stats(sbyte.to(tl.int32) - 127, live & smask, hist_min, HIST_BINS, BR * NB)
        part = merge(part, exps)
        hist += h
        dead += d
    store_partials(part_ptr, hist_ptr, pid, part, hist, dead, HIST_BINS)


def stats_vector(
    a: torch.Tensor,
    b: torch.Tensor | None,
    w: torch.Tensor | None,
    qdata: torch.Tensor | None,
    scales: torch.Tensor | None,
    values: torch.Tensor | None,
    rule: str,
    cols: int | None = None,
    col_map: torch.Tensor | None = None,
    hist_min: int = -128,
    hist_bins: int = 256,
) -> torch.Tensor:
    """One sample vector (float64 ``[11 + hist_bins]``, :mod:`mxfx.kernels.common.quant_stats`) of an MXFP8 operand
    blocked along its last dim, from one statistics launch and the finishing one; no host sync.

    Args:
        a, b, w: the sources ``[R, CS]`` or ``[B, R, CS]`` (any strides, expanded views too) in the operand's layout:
            the values are ``a``, ``silu(a) * b`` (b: SwiGLU up) or ``a * w`` (w: route weights broadcast); b and w
            may be None.
        qdata: float8_e4m3fn ``[.., R, C']`` (C' >= the region's columns), or None (then ``values`` is given and
            the scales are those the quantize computed from the values' blocks under ``rule``).
        scales: uint8 E8M0 ``[.., R, C'/32]``, or 1-D in the blocked layout of a 2-D qdata's ``[R, C'/32]``; None
            with qdata None.
        values: the operand's dequantized values ``[.., R, C']`` (what an emulated GEMM reads), or None (then
            qdata times the scale).
        rule: "rceil" or "floor" (read only without scales).
        cols: the region's columns C, a multiple of 32 (default: ``a``'s); columns of it past ``a``'s are zero
            values, counted (zero-padded tokens).
        col_map: int32 ``[C]``, the source column of each operand column, -1 where the column counts nowhere (a
            group's padding rows); None: column c reads source column c.
        hist_min, hist_bins: the exponent histogram's first exponent and bins (a power of two).

    Raises:
        ValueError: neither qdata nor values, scales without qdata, tensors that are not one region (or scales
            not qdata's), or an unknown rule.
    """
    op = "mxfx.kernels.mx.quant_stats"
    check_rule(rule, op)
    if (qdata is None) != (scales is None) or (qdata is None and values is None):
        raise ValueError(f"{op}: give qdata with its scales, dequantized values, or both")
    C = int(col_map.numel() if col_map is not None else a.shape[-1] if cols is None else cols)
    common.check_region(a, (b, w), (qdata, values), C, op)
    if C % BLOCK_SIZE:
        raise ValueError(f"{op}: the operand's {C} columns are not whole {BLOCK_SIZE}-value blocks")
    if scales is not None and not (
        is_blocked(qdata, scales)
        if scales.dim() == 1
        else scales.shape == (*qdata.shape[:-1], qdata.shape[-1] // BLOCK_SIZE)
    ):
        raise ValueError(
            f"{op}: scales {tuple(scales.shape)} are not those of qdata {tuple(qdata.shape)} (one E8M0 "
            f"byte per {BLOCK_SIZE} values, or the blocked layout of a 2-D qdata)"
        )
    B, R = (a.shape[0] if a.dim() == 3 else 1), a.shape[-2]
    sources = (*common.region_args(a, a), *common.region_args(b, a), *common.region_args(w, a))
    scols, mode = 0, SCALES_FROM_VALUES
    if qdata is not None:
        q, sq = common.region(qdata.view(torch.uint8))
        if scales.dim() == 1:
            mode, s, ss, scols = SCALES_BLOCKED, scales, (0, 0, 0), qdata.shape[-1] // BLOCK_SIZE
        else:
            mode, (s, ss) = SCALES_STRIDED, common.region(scales.view(torch.uint8))
    else:
        q, sq, s, ss = a, (0, 0, 0), a, (0, 0, 0)
    br, bc, warps = CONFIG
    n_r, n_c = triton.cdiv(R, br), triton.cdiv(C, bc)
    steps = B * n_r * n_c
    p, per_prog = common.programs(steps)
    partials, hist = common.workspace(p, hist_bins, a.device)
    launch(
        _mx_stats_kernel,
        (p,),
        *sources,
        q,
        *sq,
        s,
        *ss,
        *common.region_args(values, a),
        col_map if col_map is not None else a,
        partials,
        hist,
        R,
        C,
        a.shape[-1],
        scols,
        n_r,
        n_c,
        steps,
        per_prog,
        hist_min,
        COMBINE=common.combine_code(b, w),
        SCALES=mode,
        HAS_Q=qdata is not None,
        HAS_VALUES=values is not None,
        COL_MAP=col_map is not None,
        RCEIL=rule == "rceil",
        HIST_BINS=hist_bins,
        BR=br,
        BC=bc,
        num_warps=warps,
    )
    return common.finish(partials, hist)
