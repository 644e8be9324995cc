"""Grouped fp8_block weight gradient written into (or added to) an FP32 gradient on Hopper (sm90), in Gluon.

Computes what :func:`mxfx.kernels.fp8_block.grouped_gemm_triton.grouped_wgrad` computes, ``out[g] (+)= A[:, slots of
g] @ B[:, slots of g]^T``: A (dY^T) ``[N, 128 C]`` and B (X^T) ``[K, 128 C]`` E4M3 in the grouped-tokens slot layout
(``mxfx.numerics.block.quantize_1x128_grouped_tokens``: group g's 128-token tiles at slots ``first[g] ..
first[g] + tiles[g]``, +0 past its end), 1x128 scales ``[N, C]`` / ``[K, C]``, ``out [G, N, K]`` FP32 contiguous;
each slot is one FP8 ``wgmma`` into a fresh FP32 partial sum, promoted with ``sa[:, None] * sb[None, :]``, and
``accumulate`` adds the finished sum to the gradient in one FP32 add (the Triton kernel's numerics).

Design: the forward sm90 kernel's (:mod:`mxfx.kernels.fp8_block.grouped_gemm_sm90`): one persistent program per SM,
tiles ``p, p + P, ...`` of 128 x 128 (N x K) per group, a producer warp filling a ring with TMA (per slot two 64-row
boxes of A and one 128-row box of B), two math warpgroups owning the upper and lower 64 rows. The epilogue's FP32
read, what bounds this GEMM at short groups, is taken off the critical path: after a tile's stages the producer
TMA-loads the tile's two gradient blocks into shared memory (one 64 x 128 buffer a warpgroup, freed by the
warpgroup once read), so they arrive during the mainloop; each warpgroup adds and stores its block from registers.

Needs: A, B contiguous, 16-byte aligned; N and K multiples of 128; ``out`` FP32 contiguous ``[G, N, K]``.
:func:`supported` says whether a call qualifies; the caller takes the Triton kernel otherwise.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mxfx import device as devices
from mxfx.kernels.common.launch import aligned16, descriptor, launch_direct
from mxfx.kernels.common.hopper import LOAD_REGS, MATH_REGS, MAXNREG, SHARED_BYTES, tma_load, triton_tested
from mxfx.numerics.block import group_tile_starts, n_tiles

ROWS = gl.constexpr(64)
"""Rows of N one math warpgroup owns (the M of its ``wgmma``)."""
BLOCK_K = gl.constexpr(128)
"""Columns of K a tile spans."""
TILE = gl.constexpr(128)
"""Tokens a slot holds (the ``wgmma`` reduction length of a step)."""


@gluon.jit
def _tile(first_ptr, tiles_ptr, t, tiles_nk, tiles_k):
    """Tile t (group by group, then N blocks, K blocks fastest): its group, first N row, first K column, and the
    group's first slot and slot count."""
    g = t // tiles_nk
    r = t - g * tiles_nk
    return g, (r // tiles_k) * (2 * ROWS), (r % tiles_k) * BLOCK_K, gl.load(first_ptr + g), gl.load(tiles_ptr + g)


@gluon.jit
def _load_partition(
    a_desc, b_desc, c_desc, a0_bufs, a1_bufs, b_bufs, c0_smem, c1_smem, ready, empty, c_ready, c_empty,
    first_ptr, tiles_ptr, n_tiles, tiles_nk, tiles_k, N, STAGES: gl.constexpr, ACCUMULATE: gl.constexpr,
):  # fmt: skip
    """The producer warp: per tile one ring stage a slot (A's two 64-row boxes, B's box), then the tile's two
    gradient blocks (``ACCUMULATE``) into the warpgroups' buffers once their previous blocks were read."""
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    it = 0
    j = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        g, n0, k0, slot0, steps = _tile(first_ptr, tiles_ptr, t, tiles_nk, tiles_k)
        for i in range(0, steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            col = (slot0 + i) * TILE
            tma_load(a_desc, [n0, col], ready.index(s), a0_bufs.index(s))
            tma_load(a_desc, [n0 + ROWS, col], ready.index(s), a1_bufs.index(s))
            tma_load(b_desc, [k0, col], ready.index(s), b_bufs.index(s))
            it += 1
        if ACCUMULATE:  # the tile's gradient blocks, after its stages (needed only at its end), once the
            # epilogue of the previous tile has read the buffers
            mbarrier.wait(c_empty.index(0), (j & 1) ^ 1)
            mbarrier.expect(c_ready.index(0), c_desc.block_type.nbytes)
            tma_load(c_desc, [g * N + n0, k0], c_ready.index(0), c0_smem)
            mbarrier.wait(c_empty.index(1), (j & 1) ^ 1)
            mbarrier.expect(c_ready.index(1), c_desc.block_type.nbytes)
            tma_load(c_desc, [g * N + n0 + ROWS, k0], c_ready.index(1), c1_smem)
        j += 1


@gluon.jit
def _math_partition(
    a_bufs, b_bufs, c_smem, ready, empty, c_ready, c_empty, operands,
    WG: gl.constexpr, STAGES: gl.constexpr, ACCUMULATE: gl.constexpr,
):  # fmt: skip
    """Math warpgroup ``WG``: rows ``WG * 64 ..`` of each tile; per slot a fresh ``wgmma`` partial sum, waited for,
    the stage handed back, promoted with that slot's row and column scales (loaded a step ahead); then the
    fetched gradient block added (``ACCUMULATE``) and the block stored from registers."""
    as_ptr, bs_ptr, first_ptr, tiles_ptr, out_ptr, n_tiles, tiles_nk, tiles_k, N, s_an, s_ac, s_bk, s_bc, s_og, s_on = (
        operands
    )
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_K, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma)
    zero = gl.zeros((ROWS, BLOCK_K), gl.float32, mma)
    it = 0
    j = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        g, n0, k0, slot0, steps = _tile(first_ptr, tiles_ptr, t, tiles_nk, tiles_k)
        rows = n0 + WG * ROWS + gl.arange(0, ROWS, layout=row_layout)
        cols = k0 + gl.arange(0, BLOCK_K, layout=col_layout)
        as_ptrs = as_ptr + rows.to(gl.int64) * s_an
        bs_ptrs = bs_ptr + cols.to(gl.int64) * s_bk
        acc = zero
        live = steps > 0
        sa = gl.load(as_ptrs + slot0 * s_ac, mask=(rows >= 0) & live, other=0.0)
        sb = gl.load(bs_ptrs + slot0 * s_bc, mask=(cols >= 0) & live, other=0.0)
        for i in range(0, steps):
            s = it % STAGES
            ahead = i + 1 < steps
            sa_next = gl.load(as_ptrs + (slot0 + i + 1) * s_ac, mask=(rows >= 0) & ahead, other=0.0)
            sb_next = gl.load(bs_ptrs + (slot0 + i + 1) * s_bc, mask=(cols >= 0) & ahead, other=0.0)
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            partial = warpgroup_mma(
                a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True
            )
            partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
            mbarrier.arrive(empty.index(s), count=1)
            acc += partial * (gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0))
            sa, sb = sa_next, sb_next
            it += 1
        if ACCUMULATE:  # one FP32 add of the finished sum to the gradient block the producer fetched
            mbarrier.wait(c_ready.index(WG), j & 1)
            prior = c_smem.load(mma)
            mbarrier.arrive(c_empty.index(WG), count=1)
            acc = prior + acc
        ptrs = (
            out_ptr
            + g.to(gl.int64) * s_og
            + gl.expand_dims(rows.to(gl.int64) * s_on, 1)
            + gl.expand_dims(cols.to(gl.int64), 0)
        )
        gl.store(ptrs, acc)
        j += 1


@gluon.jit(do_not_specialize=("n_tiles", "s_og"))
def _grouped_wgrad_kernel(
    a_desc, b_desc, c_desc, as_ptr, bs_ptr, first_ptr, tiles_ptr, out_ptr, n_tiles, tiles_nk, tiles_k, N,
    s_an, s_ac, s_bk, s_bc, s_og, s_on, STAGES: gl.constexpr, ACCUMULATE: gl.constexpr,
):  # fmt: skip
    a0_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, ROWS, TILE], a_desc.layout)
    a1_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, ROWS, TILE], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, TILE], b_desc.layout)
    c0_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c1_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per math warpgroup
    for i in gl.static_range(2):
        mbarrier.init(c_ready.index(i), count=1)
        mbarrier.init(c_empty.index(i), count=1)
    operands = (as_ptr, bs_ptr, first_ptr, tiles_ptr, out_ptr, n_tiles, tiles_nk, tiles_k, N, s_an, s_ac, s_bk, s_bc,
                s_og, s_on)  # fmt: skip
    gl.warp_specialize(
        [
            (
                _math_partition,
                (a0_bufs, b_bufs, c0_smem, ready, empty, c_ready, c_empty, operands, 0, STAGES, ACCUMULATE),
            ),
            (
                _math_partition,
                (a1_bufs, b_bufs, c1_smem, ready, empty, c_ready, c_empty, operands, 1, STAGES, ACCUMULATE),
            ),
            (
                _load_partition,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    a0_bufs,
                    a1_bufs,
                    b_bufs,
                    c0_smem,
                    c1_smem,
                    ready,
                    empty,
                    c_ready,
                    c_empty,
                    first_ptr,
                    tiles_ptr,
                    n_tiles,
                    tiles_nk,
                    tiles_k,
                    N,
                    STAGES,
                    ACCUMULATE,
                ),
            ),  # fmt: skip
        ],
        [4, 1],
        [MATH_REGS, LOAD_REGS],
    )


def stages() -> int:
    """Ring stages that fit beside the two gradient buffers: each two 64x128 boxes of A and one 128x128 of B; <= 8."""
    stage = (2 * ROWS.value + BLOCK_K.value) * TILE.value
    epilogue = 2 * ROWS.value * BLOCK_K.value * 4
    return min(8, (SHARED_BYTES - epilogue - 1024) // stage)


def supported(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether :func:`grouped_wgrad` serves these operands: an sm90 GPU, a tested Triton, A and B contiguous with
    16-byte aligned bases, N and K multiples of 128, ``out`` FP32 contiguous."""
    return (
        a.device.type == "cuda"
        and devices.capability(a.device)[0] == 9
        and triton_tested()
        and a.is_contiguous()
        and b.is_contiguous()
        and aligned16(a)
        and aligned16(b)
        and out.dtype == torch.float32
        and out.is_contiguous()
        and out.shape[1] % BLOCK_K.value == 0
        and out.shape[2] % BLOCK_K.value == 0
    )


def launch_args(a, a_scales, b, b_scales, offs, out, accumulate: bool):
    """(grid, args, kwargs) of the launch, without running it (the sm90 compile test reads them)."""
    G, N, K = out.shape
    ends = offs.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    first = group_tile_starts(offs).to(torch.int32)  # on the device: no sync
    tiles = torch.div(sizes + TILE.value - 1, TILE.value, rounding_mode="floor").to(torch.int32)
    fp8 = gl.float8e4nv
    a_layout = gl.NVMMASharedLayout.get_default_for([ROWS.value, TILE.value], fp8)
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_K.value, TILE.value], fp8)
    c_layout = gl.NVMMASharedLayout.get_default_for([ROWS.value, BLOCK_K.value], gl.float32)
    a_desc = descriptor(TensorDescriptor.from_tensor, a, [ROWS.value, TILE.value], a_layout)
    b_desc = descriptor(TensorDescriptor.from_tensor, b, [BLOCK_K.value, TILE.value], b_layout)
    c_desc = descriptor(TensorDescriptor.from_tensor, out.view(G * N, K), [ROWS.value, BLOCK_K.value], c_layout)
    tiles_k = n_tiles(K)
    tiles_nk = n_tiles(N) * tiles_k
    count = G * tiles_nk
    grid = (max(1, min(devices.num_sms(a.device), count)),)
    args = (a_desc, b_desc, c_desc, a_scales, b_scales, first, tiles, out, count, tiles_nk, tiles_k, N,
            *a_scales.stride(), *b_scales.stride(), out.stride(0), out.stride(1))  # fmt: skip
    return grid, args, dict(STAGES=stages(), ACCUMULATE=accumulate, num_warps=4, maxnreg=MAXNREG)


def grouped_wgrad(a, a_scales, b, b_scales, offs, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """Launch the kernel (module docstring) on operands :func:`supported` accepts, after
    :func:`mxfx.kernels.fp8_block.gemm.grouped_wgrad`'s checks; returns ``out``."""
    if out.numel() == 0:
        return out
    grid, args, kwargs = launch_args(a, a_scales, b, b_scales, offs, out, accumulate)
    launch_direct(_grouped_wgrad_kernel, grid, *args, **kwargs)
    return out
