"""Grouped BF16 weight gradient written into (or added to) an FP32 gradient on Hopper (sm90): a ping-pong
warp-specialized kernel in Gluon.

Computes what :mod:`mxfx.kernels.common.grouped_wgrad_triton` computes, ``out[g] (+)= dy[tokens of g]^T @
x[tokens of g]`` (``dy [S, N]`` and ``x [S, K]`` BF16 or FP16, int32 group ends ``offs [G]`` of any alignment,
``out [G, N, K]`` FP32 through its strides; ``accumulate=False`` writes, zeroing an empty group's block).

Why ping-pong: an output tile's epilogue reads and writes its FP32 gradient block (8 bytes a value against a
mainloop of ``2 * tokens`` FLOP a value), about as long as its mainloop at OLMoE's shapes. One persistent program
per SM takes tiles ``p, p + P, ...``; its two math warpgroups take them in turn, each a whole 128 x 128 output tile
(a 128-value FP32 accumulator a thread), so one warpgroup's epilogue and its next tile's gradient load run while
the other's ``wgmma`` keep the tensor cores busy:

* a producer warp (40 registers) walks the same tiles and fills a ring of ``STAGES`` shared-memory stages with
  TMA, per step of ``BLOCK_T`` tokens one ``[BLOCK_T, 128]`` box of ``dy`` and one of ``x``; the ring is shared
  and each warpgroup counts the other's steps to keep its place in it;
* a "turn" mbarrier per warpgroup orders the mainloops: a warpgroup starts tile j's once the other has ended
  tile j - 1's. Without it a warpgroup could reach a stage while the stage's earlier fill (the other's) is still
  pending, and mbarrier parity would take that earlier phase for its own;
* a math warpgroup (232 registers) starts its accumulator from the gradient block (``accumulate``) or zeros,
  issues ``wgmma`` on each stage (``dy``'s box transposed in shared memory as the left operand, one ``wgmma`` in
  flight while the previous stage is handed back), and stores the block once. BF16 products are exact in FP32;
  the sum's order is the tensor cores'.

A group's last token step may reach past its end into the next group's tokens (TMA boxes cover ``BLOCK_T`` rows;
past S they are zeros): that step's rows past the end are zeroed in both shared-memory boxes before its ``wgmma``.

Needs: ``dy`` and ``x`` contiguous (TMA), 16-byte aligned, N and K multiples of 8 and at least 128.
:func:`supported` says whether a call qualifies; the caller takes the Triton kernel otherwise.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mxfx import device as devices
from mxfx.kernels.common.gemm import check_grouped_wgrad_into
from mxfx.kernels.common.hopper import LOAD_REGS, MATH_REGS, MAXNREG, SHARED_BYTES, tma_load, triton_tested
from mxfx.kernels.common.launch import aligned16, descriptor, launch_direct

BLOCK = 128
"""Output tile edge (rows of N, columns of K) one math warpgroup owns."""
BLOCK_T = 64
"""Tokens per ring stage (the ``wgmma`` reduction length of a step)."""


@gluon.jit
def _tile(offs_ptr, t, tiles_nk, tiles_k, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """Tile t: its group, first N row, first K column, and the group's first and past-last token."""
    g = t // tiles_nk
    r = t - g * tiles_nk
    start = gl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    end = gl.maximum(gl.load(offs_ptr + g), start)
    return g, (r // tiles_k) * BLOCK_N, (r % tiles_k) * BLOCK_K, start, end


@gluon.jit
def _load_partition(
    dy_desc, x_desc, a_bufs, b_bufs, ready, empty, offs_ptr, n_tiles, tiles_nk, tiles_k, STAGES: gl.constexpr
):
    BT: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    nbytes: gl.constexpr = dy_desc.block_type.nbytes + x_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        g, n0, k0, start, end = _tile(offs_ptr, t, tiles_nk, tiles_k, BLOCK_N, BLOCK_K)
        for t0 in range(start, end, BT):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma_load(dy_desc, [t0, n0], ready.index(s), a_bufs.index(s))
            tma_load(x_desc, [t0, k0], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _zero_rows_from(buf, first):
    """Zero rows ``first..`` of one shared-memory box (a group's tokens end inside it)."""
    BT: gl.constexpr = buf.type.shape[0]
    W: gl.constexpr = buf.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    rows = gl.arange(0, BT, layout=gl.SliceLayout(1, layout))
    v = buf.load(layout)
    keep = gl.expand_dims(rows < first, 1) & gl.full([BT, W], True, gl.int1, layout)
    buf.store(gl.where(keep, v, gl.zeros_like(v)))


@gluon.jit
def _block(
    out_ptr, g, n0, k0, N, K, s_og, s_on, s_ok, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, layout: gl.constexpr
):
    """Pointers to the gradient block of tile ``(g, n0, k0)`` in the accumulator's layout, and its mask."""
    ns = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    ks = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    rows = out_ptr + g.to(gl.int64) * s_og + ns.to(gl.int64) * s_on
    ptrs = gl.expand_dims(rows, 1) + gl.expand_dims(ks * s_ok, 0)
    return ptrs, gl.expand_dims(ns < N, 1) & gl.expand_dims(ks < K, 0)


@gluon.jit
def _math_partition(
    a_bufs, b_bufs, ready, empty, turn, operands, WG: gl.constexpr, STAGES: gl.constexpr, ACCUMULATE: gl.constexpr
):
    offs_ptr, out_ptr, n_tiles, tiles_nk, tiles_k, N, K, s_og, s_on, s_ok = operands
    BT: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_K: gl.constexpr = b_bufs.type.shape[2]
    # bf16 wgmma: instruction K = 16, N = the tile's width; the warpgroup's 4 warps along M (two 64-row halves)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_K, 16])
    it = 0
    j = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        g, n0, k0, start, end = _tile(offs_ptr, t, tiles_nk, tiles_k, BLOCK_N, BLOCK_K)
        steps = gl.cdiv(end - start, BT)
        if j % 2 == WG:
            if ACCUMULATE:
                ptrs, mask = _block(out_ptr, g, n0, k0, N, K, s_og, s_on, s_ok, BLOCK_N, BLOCK_K, mma)
                acc = gl.load(ptrs, mask=mask, other=0.0)
            else:
                acc = gl.zeros((BLOCK_N, BLOCK_K), gl.float32, mma)
            if j > 0:  # the other warpgroup's mainloop of tile j - 1 is over: its stages were all handed back
                mbarrier.wait(turn.index(1 - WG), ((j + 1) // 2 - 1) & 1)
            for i in range(0, steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                left = end - start - i * BT
                if left < BT:  # the group ends inside this step: the next group's tokens count zero
                    _zero_rows_from(a_bufs.index(s), left)
                    _zero_rows_from(b_bufs.index(s), left)
                    fence_async_shared()
                acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if i > 0:  # the previous step's wgmma is done: its stage goes back to the producer
                    mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if steps > 0:
                mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
            mbarrier.arrive(turn.index(WG), count=1)  # the other warpgroup's next mainloop may start
            if (steps > 0) or (not ACCUMULATE):
                ptrs, mask = _block(out_ptr, g, n0, k0, N, K, s_og, s_on, s_ok, BLOCK_N, BLOCK_K, mma)
                gl.store(ptrs, acc, mask=mask)
        else:
            it += steps
        j += 1


@gluon.jit(do_not_specialize=("n_tiles", "s_og"))
def _grouped_wgrad_into_sm90_kernel(
    dy_desc,
    x_desc,
    offs_ptr,
    out_ptr,
    n_tiles,
    tiles_nk,
    tiles_k,
    N,
    K,
    s_og,
    s_on,
    s_ok,
    STAGES: gl.constexpr,
    ACCUMULATE: gl.constexpr,
):
    BT: gl.constexpr = dy_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BT, dy_desc.block_type.shape[1]], dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BT, x_desc.block_type.shape[1]], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)  # the warpgroup that consumed the stage
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)  # warpgroup i's mainloop of a tile is over
    operands = (offs_ptr, out_ptr, n_tiles, tiles_nk, tiles_k, N, K, s_og, s_on, s_ok)
    gl.warp_specialize(
        [
            (_math_partition, (a_bufs, b_bufs, ready, empty, turn, operands, 0, STAGES, ACCUMULATE)),
            (_math_partition, (a_bufs, b_bufs, ready, empty, turn, operands, 1, STAGES, ACCUMULATE)),
            (
                _load_partition,
                (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, offs_ptr, n_tiles, tiles_nk, tiles_k, STAGES),
            ),
        ],
        [4, 1],
        [MATH_REGS, LOAD_REGS],
    )


def stages(itemsize: int = 2) -> int:
    """Ring stages that fit in shared memory: each two ``BLOCK_T x BLOCK`` boxes; at most 8."""
    return min(8, (SHARED_BYTES - 1024) // (2 * BLOCK_T * BLOCK * itemsize))


def supported(dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether :func:`grouped_wgrad_into` serves these operands: an sm90 GPU, a tested Triton, ``dy`` and ``x``
    contiguous 16-bit with 16-byte aligned bases and rows, at least one token, N and K of at least one tile (128),
    ``out`` FP32."""
    return (
        dy.device.type == "cuda"
        and devices.capability(dy.device)[0] == 9
        and triton_tested()
        and dy.dtype == x.dtype
        and dy.dtype in _GL_TYPES
        and out.dtype == torch.float32
        and dy.is_contiguous()
        and x.is_contiguous()
        and dy.shape[0] > 0
        and dy.shape[1] % 8 == 0
        and x.shape[1] % 8 == 0
        and min(dy.shape[1], x.shape[1]) >= BLOCK
        and aligned16(dy)
        and aligned16(x)
    )


_GL_TYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.cache
def _box_layout(dtype: torch.dtype):
    """The shared-memory layout of a ``BLOCK_T x BLOCK`` box (built once per dtype)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK], _GL_TYPES[dtype])


def launch_args(dy, x, offs, out, accumulate: bool):
    """(grid, args, kwargs) of the launch, without running it (the sm90 compile test reads them)."""
    G, N, K = out.shape
    layout = _box_layout(dy.dtype)
    dy_desc = descriptor(TensorDescriptor.from_tensor, dy, [BLOCK_T, BLOCK], layout)
    x_desc = descriptor(TensorDescriptor.from_tensor, x, [BLOCK_T, BLOCK], layout)
    tiles_k = triton.cdiv(K, BLOCK)
    tiles_nk = triton.cdiv(N, BLOCK) * tiles_k
    n_tiles = G * tiles_nk
    sms = devices.num_sms(dy.device)
    grid = (max(1, min(sms, n_tiles)),)
    args = (dy_desc, x_desc, offs, out, n_tiles, tiles_nk, tiles_k, N, K, *out.stride())
    kwargs = dict(
        STAGES=stages(dy.element_size()),
        ACCUMULATE=accumulate,
        num_warps=4,
        maxnreg=MAXNREG,
    )
    return grid, args, kwargs


def grouped_wgrad_into(dy, x, offs, out, accumulate: bool) -> None:
    """Launch the kernel (module docstring) on operands :func:`supported` accepts.

    Raises:
        ValueError: shapes, dtypes or devices that do not pair up
            (:func:`mxfx.kernels.common.gemm.check_grouped_wgrad_into`).
    """
    check_grouped_wgrad_into(dy, x, offs, out, kernel=True)
    if out.numel() == 0:
        return
    grid, args, kwargs = launch_args(dy, x, offs, out, accumulate)
    launch_direct(_grouped_wgrad_into_sm90_kernel, grid, *args, **kwargs)
