"""The reduction every format's fused statistics kernel ends in (:mod:`mxfx.kernels.mx.quant_stats`,
:mod:`mxfx.kernels.fp8_block.quant_stats`): device functions that form the values a quantize read, reduce a tile
of values and of scale blocks to partial statistics, and write one program's partial row; the finishing kernel that
reduces those rows into one sample vector on the device (no host sync).

Sample vector, float64 ``[len(FIELDS) + hist_bins]`` (the layout of :func:`mxfx.runtime.stats.reduce_parts`):

* counts: ``values`` (value and dequantized value both finite: "ok"), ``nonzero`` (ok, value != 0),
  ``underflow`` (nonzero, dequantized to 0), ``saturated`` (ok, payload at E4M3's largest magnitude 448),
  ``clipped`` (saturated, |value| > |dequantized|), ``nonfinite`` (counted, not ok);
* ``err_sq``, ``ref_sq``: sums over ok values of ``(dequantized - value)^2`` (the difference in fp32, squared and
  summed in fp64) and of ``value^2``; ``amax``: max |value| over ok values (0 when none);
* ``exp_min``, ``exp_max``: over the scale exponents of the live blocks (every value finite, one nonzero), +inf /
  -inf when none; then the exponent histogram, bin i counting exponent ``hist_min + i`` (clamped into the first
  and the last bin).

Counts are exact; the fp64 sums are summed in another order than torch's (equal to a relative 1e-9 and better).
Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.common.launch import launch
from mxfx.kernels.common.silu_triton import silu_f32

FIELDS = (
    "values",
    "nonzero",
    "underflow",
    "saturated",
    "clipped",
    "nonfinite",
    "err_sq",
    "ref_sq",
    "amax",
    "exp_min",
    "exp_max",
)
"""The sample vector's fields before the histogram, in order."""

PARTIAL_WIDTH = 16
"""float64 entries of one program's partial row: the :data:`FIELDS`, then zeros."""

MAX_PROGRAMS = 512
"""Programs of a statistics kernel at most; each reduces a contiguous run of tiles into one partial row."""

FINISH_ROWS = 64
"""Partial rows the finishing kernel reads at a time."""

COMBINE_NONE, COMBINE_SWIGLU, COMBINE_ROUTE_WEIGHT = 0, 1, 2
"""How a kernel forms its values from its sources (``COMBINE``): ``a``, ``silu(a) * b`` in fp32 (mxfx's SiLU,
:func:`mxfx.kernels.common.silu_triton.silu_f32`), ``a * w`` in fp32."""


def combine_code(b: torch.Tensor | None, w: torch.Tensor | None) -> int:
    """The ``COMBINE`` of sources ``(a, b, w)``: swiglu with ``b`` (up), route weight with ``w``, else plain.

    Raises:
        ValueError: both given.
    """
    if b is not None and w is not None:
        raise ValueError("mxfx.kernels.common.quant_stats: give up (b) or route weights (w), not both")
    return COMBINE_SWIGLU if b is not None else COMBINE_ROUTE_WEIGHT if w is not None else COMBINE_NONE


def region(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """``t`` (``[R, C]`` or ``[B, R, C]``, any strides) and its strides as a ``[B, R, C]`` region (2-D: batch
    stride 0)."""
    return t, ((0, *t.stride()) if t.dim() == 2 else tuple(t.stride()))


def region_args(t: torch.Tensor | None, absent: torch.Tensor) -> tuple:
    """``(t, batch stride, row stride, column stride)``: ``t`` as a kernel's ``[B, R, C]`` region argument
    (:func:`region`); for ``t`` None, ``absent`` with zero strides (a source the kernel does not read)."""
    t, strides = region(t) if t is not None else (absent, (0, 0, 0))
    return (t, *strides)


def check_region(a: torch.Tensor, like_a, wider, cols: int, op: str) -> None:
    """Raise ValueError naming ``op`` unless ``a`` is 2-D or 3-D, each of ``like_a`` (None skipped) has its shape and
    each of ``wider`` its leading dims and at least ``cols`` columns."""
    if (
        a.dim() not in (2, 3)
        or any(t is not None and t.shape != a.shape for t in like_a)
        or any(t is not None and (t.shape[:-1] != a.shape[:-1] or t.shape[-1] < cols) for t in wider)
    ):
        shapes = ", ".join(str(tuple(t.shape)) for t in (a, *like_a, *wider) if t is not None)
        raise ValueError(f"{op}: tensors of shapes {shapes} are not one [R, C] or [B, R, C] region of {cols} columns")


def programs(n_tiles: int) -> tuple[int, int]:
    """``(programs, tiles per program)`` of a statistics kernel over ``n_tiles`` tiles: one program at least."""
    p = max(1, min(n_tiles, MAX_PROGRAMS))
    return p, triton.cdiv(n_tiles, p)


def workspace(n_programs: int, hist_bins: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials float64 [n_programs, PARTIAL_WIDTH], histogram int32 [hist_bins] zeroed)`` of one launch."""
    return (
        torch.empty(n_programs, PARTIAL_WIDTH, dtype=torch.float64, device=device),
        torch.zeros(hist_bins, dtype=torch.int32, device=device),
    )


@triton.jit
def offsets(b, rows, cols, sb, sr, sc):
    """int64 element offsets ``[len(rows), len(cols)]`` of batch ``b`` of a strided ``[B, R, C]`` tensor."""
    return b.to(tl.int64) * sb + rows.to(tl.int64)[:, None] * sr + cols.to(tl.int64)[None, :] * sc


@triton.jit
def tile_origin(t, n_r_tiles, n_c_tiles, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``(batch, first row, first column)`` of tile ``t`` of a region walked batch by batch, each batch's
    ``n_r_tiles x n_c_tiles`` tiles of ``ROWS x COLS`` in row-major order."""
    per_batch = n_r_tiles * n_c_tiles
    return t // per_batch, (t % per_batch) // n_c_tiles * ROWS, t % n_c_tiles * COLS


@triton.jit
def finite(v):
    """Whether each fp32 value of ``v`` is finite, read from its bits."""
    return (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000


@triton.jit
def magnitude_bits(v):
    """Sign-cleared fp32 bits of ``v`` as int32: ordered as the magnitudes, NaN and Inf above every finite value."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def load_values(a_ptrs, b_ptrs, w_ptrs, mask, COMBINE: tl.constexpr):
    """fp32 values at ``a_ptrs`` formed per ``COMBINE`` with ``b_ptrs`` / ``w_ptrs``; 0 where not ``mask``."""
    v = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
    if COMBINE == 1:  # COMBINE_SWIGLU
        v = silu_f32(v) * tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
    elif COMBINE == 2:  # COMBINE_ROUTE_WEIGHT
        v = v * tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def saturated_payload(qbits):
    """Whether each E4M3 byte (uint8 tile) is +-448, the largest magnitude (S.1111.110)."""
    return (qbits.to(tl.int32) & 0x7F) == 0x7E


@triton.jit
def no_stats():
    """The partial row of no values (:data:`FIELDS` order, float64 ``[PARTIAL_WIDTH]``): zero counts, sums and
    amax, ``exp_min`` +inf, ``exp_max`` -inf; what :func:`merge` leaves unchanged."""
    i = tl.arange(0, 16)  # PARTIAL_WIDTH
    return tl.where(i == 9, float("inf"), tl.where(i == 10, float("-inf"), tl.zeros([16], tl.float64)))


@triton.jit
def merge(row, other):
    """Two partial rows as one: counts and sums added, ``amax`` and ``exp_max`` the larger, ``exp_min`` the
    smaller (float64 counts stay exact below 2^53)."""
    i = tl.arange(0, 16)  # PARTIAL_WIDTH
    return tl.where(i < 8, row + other, tl.where(i == 9, tl.minimum(row, other), tl.maximum(row, other)))


@triton.jit
def value_stats(x, dq, sat, counted):
    """One tile's value statistics as a partial row (:func:`no_stats`' layout): ``values``, ``nonzero``,
    ``underflow``, ``saturated``, ``clipped``, ``nonfinite``, ``err_sq``, ``ref_sq`` and ``amax`` over the elements
    where ``counted`` (module docstring), no exponents. ``x``, ``dq``: fp32 values and dequantized values; ``sat``:
    payload at 448."""
    ok = counted & finite(x) & finite(dq)
    xm = tl.where(ok, x, 0.0)
    dm = tl.where(ok, dq, 0.0)
    nz = xm != 0.0
    satm = ok & sat
    diff = (dm - xm).to(tl.float64)
    x64 = xm.to(tl.float64)
    i = tl.arange(0, 16)  # PARTIAL_WIDTH
    row = tl.where(i == 0, tl.sum(ok.to(tl.int32)).to(tl.float64), no_stats())
    row = tl.where(i == 1, tl.sum(nz.to(tl.int32)).to(tl.float64), row)
    row = tl.where(i == 2, tl.sum((nz & (dm == 0.0)).to(tl.int32)).to(tl.float64), row)
    row = tl.where(i == 3, tl.sum(satm.to(tl.int32)).to(tl.float64), row)
    row = tl.where(i == 4, tl.sum((satm & (tl.abs(xm) > tl.abs(dm))).to(tl.int32)).to(tl.float64), row)
    row = tl.where(i == 5, tl.sum((counted & ~ok).to(tl.int32)).to(tl.float64), row)
    row = tl.where(i == 6, tl.sum(diff * diff), row)
    row = tl.where(i == 7, tl.sum(x64 * x64), row)
    return tl.where(i == 8, tl.max(tl.abs(xm)).to(tl.float64), row)


@triton.jit
def exponent_stats(e, live, hist_min, HIST_BINS: tl.constexpr, N: tl.constexpr):
    """The partial row (:func:`no_stats`' layout) of the int32 exponents ``e`` where ``live``: their min and max
    (+inf / -inf when none); the int32 histogram ``[HIST_BINS]`` (bin i: exponent ``hist_min + i``, clamped into
    the end bins), plus the entries not live in its bin 0, and their count (``dead``, taken out of bin 0 by
    :func:`store_partials`); ``N``: ``e``'s number of elements."""
    ef = e.to(tl.float32)
    i = tl.arange(0, 16)  # PARTIAL_WIDTH
    row = tl.where(i == 9, tl.min(tl.where(live, ef, float("inf"))).to(tl.float64), no_stats())
    row = tl.where(i == 10, tl.max(tl.where(live, ef, float("-inf"))).to(tl.float64), row)
    # Entries not live go to bin 0 and are taken out of it at the end: on GPUs Triton 3.6's tl.histogram counts
    # the entries its mask leaves out (the interpreter honours the mask).
    bins = tl.where(live, tl.minimum(tl.maximum(e - hist_min, 0), HIST_BINS - 1), 0)
    hist = tl.histogram(tl.reshape(bins, [N]), HIST_BINS)
    return row, hist, N - tl.sum(tl.reshape(live, [N]).to(tl.int32))


@triton.jit
def store_partials(part_ptr, hist_ptr, pid, row, hist, dead, HIST_BINS: tl.constexpr):
    """Write program ``pid``'s partial ``row`` (:func:`no_stats`' layout) and add its histogram, less the ``dead``
    entries :func:`exponent_stats` put in bin 0, into the shared int32 one (integer atomics: the order does not
    matter)."""
    i = tl.arange(0, 16)  # PARTIAL_WIDTH
    tl.store(part_ptr + pid.to(tl.int64) * 16 + i, tl.where(i < 11, row, 0.0))  # FIELDS, then zeros
    j = tl.arange(0, HIST_BINS)
    hist -= tl.where(j == 0, dead, 0)
    tl.atomic_add(hist_ptr + j, hist, mask=hist > 0)


@triton.jit
def _finish_kernel(part_ptr, hist_ptr, out_ptr, P, N_FIELDS: tl.constexpr, HIST_BINS: tl.constexpr, PB: tl.constexpr):
    i = tl.arange(0, 16)  # PARTIAL_WIDTH
    total = tl.zeros([16], tl.float64)
    hi = tl.full([16], float("-inf"), tl.float64)
    lo = tl.full([16], float("inf"), tl.float64)
    for p0 in range(0, P, PB):
        rows = p0 + tl.arange(0, PB)
        v = tl.load(part_ptr + rows.to(tl.int64)[:, None] * 16 + i[None, :], mask=(rows < P)[:, None], other=0.0)
        live = (rows < P)[:, None]
        total += tl.sum(v, axis=0)
        hi = tl.maximum(hi, tl.max(tl.where(live, v, float("-inf")), axis=0))
        lo = tl.minimum(lo, tl.min(tl.where(live, v, float("inf")), axis=0))
    out = tl.where(i < 8, total, tl.where(i == 9, lo, hi))  # sums, then amax (max), exp_min (min), exp_max (max)
    tl.store(out_ptr + i, out, mask=i < N_FIELDS)
    j = tl.arange(0, HIST_BINS)
    tl.store(out_ptr + N_FIELDS + j, tl.load(hist_ptr + j).to(tl.float64))


def finish(partials: torch.Tensor, hist: torch.Tensor) -> torch.Tensor:
    """The sample vector (module docstring) of a statistics launch's ``partials`` and histogram, on their device."""
    out = torch.empty(len(FIELDS) + hist.numel(), dtype=torch.float64, device=partials.device)
    launch(
        _finish_kernel,
        (1,),
        partials,
        hist,
        out,
        partials.shape[0],
        N_FIELDS=len(FIELDS),
        HIST_BINS=hist.numel(),
        PB=FINISH_ROWS,
        num_warps=4,
    )
    return out
