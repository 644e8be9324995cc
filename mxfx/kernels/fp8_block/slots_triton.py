"""Where a group's 128-token tiles sit in a grouped-tokens operand, found inside a Triton program without a host sync.

The grouped-tokens layout (``mxfx.numerics.block.quantize_1x128_grouped_tokens``) gives each group's token tiles
consecutive 128-column slots, group after group: group g's tiles start at slot ``sum over f < g of
ceil(size_f / 128)``. Both helpers read the ``G`` group ends ``offs`` as one vector of ``G_PAD`` (a power of two at
least ``G``) and take a prefix sum over it: a few vector instructions a program, where a loop over the groups would
issue two dependent scalar loads per group before the program's own work.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tiles_per_group(offs_ptr, G, G_PAD: tl.constexpr, TILE_T: tl.constexpr):
    """``(starts, ends, tiles, first slots)`` of every group, vectors of ``G_PAD`` (zeros past ``G``)."""
    g = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + g, mask=g < G, other=0)
    starts = tl.load(offs_ptr + g - 1, mask=(g > 0) & (g < G), other=0)
    tiles = tl.where(g < G, tl.cdiv(ends - starts, TILE_T), 0)
    return starts, ends, tiles, tl.cumsum(tiles, 0) - tiles


@triton.jit
def slot_rows(offs_ptr, G, slot, G_PAD: tl.constexpr, TILE_T: tl.constexpr):
    """``(first row of the tile, group start, group end)`` of token-tile slot ``slot``; ``(0, 0, 0)`` for a slot
    past the last group's tiles (an unused slot: no rows)."""
    starts, ends, tiles, first = _tiles_per_group(offs_ptr, G, G_PAD, TILE_T)
    hit = (slot >= first) & (slot < first + tiles)  # at most one group holds the slot
    r0 = tl.sum(tl.where(hit, starts + (slot - first) * TILE_T, 0), 0)
    return r0, tl.sum(tl.where(hit, starts, 0), 0), tl.sum(tl.where(hit, ends, 0), 0)


@triton.jit
def group_slots(offs_ptr, G, g, G_PAD: tl.constexpr, TILE_T: tl.constexpr):
    """``(first slot, tiles)`` of group ``g``'s token tiles."""
    _, _, tiles, first = _tiles_per_group(offs_ptr, G, G_PAD, TILE_T)
    mine = tl.arange(0, G_PAD) == g
    return tl.sum(tl.where(mine, first, 0), 0), tl.sum(tl.where(mine, tiles, 0), 0)
