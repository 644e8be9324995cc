"""Warp-specialized grouped GEMM on fp8_block operands for Hopper (sm90), written in Gluon.

Computes what :mod:`mxfx.kernels.fp8_block.grouped_gemm_triton` computes, ``out[rows of group g] = A[rows] @ B[g]^T``
(A ``[S, K]`` E4M3 with 1x128 float32 scales, B ``[G, N, K]`` E4M3 with 128x128 float32 scales, group ends
``offs`` int32 ``[G]``, rows past ``offs[-1]`` written as zeros), with the same numerics: each 128-wide step of K
is one FP8 ``wgmma`` into a fresh FP32 partial sum, promoted into the FP32 accumulator with the product of the
row's A scale and the tile's B scale (one FMA per value per step).

Design: a schedule, then one persistent program per SM with three partitions of warps.

* the schedule (:func:`_schedule_kernel`, a small Triton launch before the GEMM, no host sync) numbers the tiles
  of all groups globally (group by group; inside a group in bands of ``BAND`` row blocks, row blocks fastest, so
  the programs running at once share their A rows and B columns in L2) and writes each tile's group, first row,
  first column and group end; program p of the GEMM takes tiles p, p + P, ..., reading the next tile's entry while
  it computes this one, so no partition walks the groups between tiles;
* a producer warp (40 registers) fills a ring of ``STAGES`` shared-memory stages with TMA: per K step two 64-row
  boxes of A and one ``BLOCK_N``-row box of B, each stage completing on its "ready" mbarrier;
* two math warpgroups (the default partition and one worker, 232 registers each) own the upper and lower 64 rows
  of a 128 x ``BLOCK_N`` tile; each issues its ``wgmma`` on the stage, waits for it, hands the stage back on its
  "empty" mbarrier (two arrivals free a stage) and promotes with scales loaded a step ahead. While one warpgroup
  promotes on the CUDA cores the other's ``wgmma`` keeps the tensor cores busy. A 256-wide tile (two weight
  blocks: a third less A and B read per FLOP than 128 x 128) runs one ``wgmma`` per 128-column half into the same
  partial-sum registers, each half promoted into its own accumulator (192 accumulator registers a thread).

Rows past a group's end are read by the TMA boxes (they belong to the next group, or are zeros past S) and never
stored: whole 64 x ``BLOCK_N`` blocks of a group leave through shared memory and a TMA store, blocks that cross a
group's end or N through masked stores.

Needs: A and B K-major and contiguous with K a multiple of 16 (TMA), a B tile inside one 128-column weight block
(``128 % BLOCK_N == 0``) or two (``BLOCK_N == 256``). :func:`supported` says whether a call qualifies; the caller
falls back to the Triton kernel otherwise.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mxfx import device as devices
from mxfx.kernels.common.launch import aligned16, descriptor, launch_direct
from mxfx.kernels.common.hopper import (
    LOAD_REGS,
    MATH_REGS,
    MAXNREG,
    SHARED_BYTES,
    tma_load,
    tma_store,
    triton_tested,
)
from mxfx.numerics.block import TILE


WG_ROWS = 64
"""Rows of a tile that one math warpgroup owns (the M of its ``wgmma``)."""


@triton.jit
def _schedule_kernel(
    offs_ptr,
    table_ptr,
    S,
    N,
    G,
    max_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BAND: tl.constexpr,
    G_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program g (of G + 1) writes the entries ``(g, first row, first column, group end)`` of group g's tiles
    (g == G: the rows past ``offs[-1]``) at their global numbers; program G also marks the entries past the last
    tile (group -1). Tiles of a group in bands of ``BAND`` row blocks, row blocks fastest in a band."""
    g = tl.program_id(0)
    idx = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + idx, mask=idx < G, other=S)
    starts = tl.load(offs_ptr + idx - 1, mask=(idx > 0) & (idx <= G), other=0)
    starts = tl.minimum(starts, S)
    ends = tl.where(idx <= G, tl.maximum(tl.minimum(ends, S), starts), starts)
    tiles_n = tl.cdiv(N, BLOCK_N)
    counts = tl.cdiv(ends - starts, BLOCK_M) * tiles_n
    first = tl.sum(tl.where(idx < g, counts, 0))
    count = tl.sum(tl.where(idx == g, counts, 0))
    start = tl.sum(tl.where(idx == g, starts, 0))
    end = tl.sum(tl.where(idx == g, ends, 0))
    tiles_m = tl.cdiv(end - start, BLOCK_M)
    for c0 in range(0, count, CHUNK):
        t = c0 + tl.arange(0, CHUNK)
        band = t // (BAND * tiles_n)
        height = tl.minimum(tiles_m - band * BAND, BAND)
        r = t - band * BAND * tiles_n
        height = tl.maximum(height, 1)
        entry = table_ptr + (first + t).to(tl.int64) * 4
        ok = t < count
        tl.store(entry, tl.zeros_like(t) + g, mask=ok)
        tl.store(entry + 1, start + (band * BAND + r % height) * BLOCK_M, mask=ok)
        tl.store(entry + 2, (r // height) * BLOCK_N, mask=ok)
        tl.store(entry + 3, tl.zeros_like(t) + end, mask=ok)
    if g == G:
        total = tl.sum(counts)
        for c0 in range(total, max_tiles, CHUNK):
            t = c0 + tl.arange(0, CHUNK)
            tl.store(table_ptr + t.to(tl.int64) * 4, tl.zeros_like(t) - 1, mask=t < max_tiles)


@gluon.jit
def _tile(table_ptr, t, max_tiles):
    """Entry t of the schedule (:func:`_schedule_kernel`): group, first row, first column, group end; group -1
    past the last tile."""
    entry = table_ptr + t.to(gl.int64) * 4
    live = t < max_tiles
    return (
        gl.load(entry, mask=live, other=-1),
        gl.load(entry + 1, mask=live, other=0),
        gl.load(entry + 2, mask=live, other=0),
        gl.load(entry + 3, mask=live, other=0),
    )


@gluon.jit
def _load_partition(
    a_desc, b_desc, a0_bufs, a1_bufs, b_bufs, ready, empty, table_ptr, max_tiles, N, K, G, STAGES: gl.constexpr
):
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    ROWS: gl.constexpr = a_desc.block_type.shape[0]
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    k_steps = gl.cdiv(K, BLOCK_K)
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    it = 0
    t = pid
    g, m0, n0, _ = _tile(table_ptr, t, max_tiles)
    while g >= 0:
        t_next = t + P
        g_next, m0_next, n0_next, _ = _tile(table_ptr, t_next, max_tiles)  # in flight during this tile
        steps = gl.where(g < G, k_steps, 0)  # the tail's tiles load nothing
        for kb in range(0, steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            k0 = kb * BLOCK_K
            tma_load(a_desc, [m0, k0], ready.index(s), a0_bufs.index(s))
            tma_load(a_desc, [m0 + ROWS, k0], ready.index(s), a1_bufs.index(s))
            tma_load(b_desc, [g * N + n0, k0], ready.index(s), b_bufs.index(s))
            it += 1
        t, g, m0, n0 = t_next, g_next, m0_next, n0_next


@gluon.jit
def _steps(a_bufs, b_bufs, ready, empty, as_ptrs, bs_ptrs, row_ok, s_ask, s_bsk, steps, it, zero, STAGES: gl.constexpr):
    """One tile's K steps, each ``wgmma`` waited for before its promotion (the other warpgroup's runs meanwhile),
    each step's scales loaded one step ahead: the FP32 accumulator and the ring position after them."""
    acc = zero
    scale = gl.load(as_ptrs, mask=row_ok & (steps > 0), other=0.0) * gl.load(bs_ptrs, mask=steps > 0, other=0.0)
    for kb in range(0, steps):
        s = it % STAGES
        ahead = kb + 1 < steps
        scale_next = gl.load(as_ptrs + (kb + 1) * s_ask, mask=row_ok & ahead, other=0.0) * gl.load(
            bs_ptrs + (kb + 1) * s_bsk, mask=ahead, other=0.0
        )
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        partial = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
        mbarrier.arrive(empty.index(s), count=1)
        acc += partial * gl.expand_dims(scale, 1)
        scale = scale_next
        it += 1
    return acc, it


@gluon.jit
def _steps_wide(
    a_bufs, b_bufs, ready, empty, as_ptrs, bs_ptrs, row_ok, s_ask, s_bsk, s_bsn, second, steps, it, zero,
    STAGES: gl.constexpr,
):  # fmt: skip
    """:func:`_steps` for a tile two weight blocks wide: per K step one ``wgmma`` per 128-column half into the same
    partial-sum registers, each promoted with its block's scale (``second``: the right half lies inside N, else its
    scales read as zeros): the two accumulators and the ring position after them."""
    HALF: gl.constexpr = zero.type.shape[1]
    acc0 = zero
    acc1 = zero
    live = steps > 0
    a_scale = gl.load(as_ptrs, mask=row_ok & live, other=0.0)
    b_scale0 = gl.load(bs_ptrs, mask=live, other=0.0)
    b_scale1 = gl.load(bs_ptrs + s_bsn, mask=live & second, other=0.0)
    for kb in range(0, steps):
        s = it % STAGES
        ahead = kb + 1 < steps
        a_next = gl.load(as_ptrs + (kb + 1) * s_ask, mask=row_ok & ahead, other=0.0)
        b_next0 = gl.load(bs_ptrs + (kb + 1) * s_bsk, mask=ahead, other=0.0)
        b_next1 = gl.load(bs_ptrs + s_bsn + (kb + 1) * s_bsk, mask=ahead & second, other=0.0)
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        b = b_bufs.index(s)
        partial = warpgroup_mma(a_bufs.index(s), b.slice(0, HALF).permute((1, 0)), zero, use_acc=False, is_async=True)
        partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
        acc0 += partial * gl.expand_dims(a_scale * b_scale0, 1)
        partial = warpgroup_mma(
            a_bufs.index(s), b.slice(HALF, HALF).permute((1, 0)), zero, use_acc=False, is_async=True
        )
        partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
        mbarrier.arrive(empty.index(s), count=1)
        acc1 += partial * gl.expand_dims(a_scale * b_scale1, 1)
        a_scale, b_scale0, b_scale1 = a_next, b_next0, b_next1
        it += 1
    return acc0, acc1, it


@gluon.jit
def _store_block(
    c_desc, c_bufs, buf: gl.constexpr, c_ptr, acc, rows, row_ok, row0, n0, end, N, s_cm, s_cn,
    col_layout: gl.constexpr, EPI_TMA: gl.constexpr,
):  # fmt: skip
    """Store one warpgroup's ``ROWS x HALF`` block of the output at ``(row0, n0)``: a whole block of its group
    through its shared-memory buffer ``buf`` of ``c_bufs`` and a TMA store (left running), a block crossing the
    group's end or N masked. The warpgroup's stores use its buffers in turn, so waiting until all but the
    ``len(c_bufs) - 1`` latest stores are done frees ``buf``."""
    ROWS: gl.constexpr = acc.type.shape[0]
    WIDTH: gl.constexpr = acc.type.shape[1]
    BUFS: gl.constexpr = c_bufs.type.shape[0]
    if EPI_TMA and (row0 + ROWS <= end) and (n0 + WIDTH <= N):
        tma.store_wait(BUFS - 1)  # the store that last read this buffer is done
        c_smem = c_bufs.index(buf)
        c_smem.store(acc.to(c_ptr.dtype.element_ty))
        fence_async_shared()
        tma_store(c_desc, [row0, n0], c_smem)
    else:
        cols = n0 + gl.arange(0, WIDTH, layout=col_layout)
        ptrs = c_ptr + gl.expand_dims(rows.to(gl.int64) * s_cm, 1) + gl.expand_dims(cols * s_cn, 0)
        mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0)
        gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _math_partition(
    a_bufs,
    b_bufs,
    ready,
    empty,
    c_desc,
    c_bufs,
    operands,
    WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    EPI_TMA: gl.constexpr,
):
    as_ptr, bs_ptr, table_ptr, c_ptr, max_tiles, N, K, G, s_asm, s_ask, s_bsg, s_bsn, s_bsk, s_cm, s_cn = operands
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    ROWS: gl.constexpr = a_bufs.type.shape[1]
    WIDE: gl.constexpr = BLOCK_N == 256  # two weight blocks a tile, each half its own wgmma and accumulator
    HALF: gl.constexpr = BLOCK_N // 2 if WIDE else BLOCK_N
    # fp8 wgmma: instruction K = 32, N = the tile's width (a half of a wide one); one warpgroup of 4 warps along M
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma)
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    k_steps = gl.cdiv(K, BLOCK_K)
    zero = gl.zeros((ROWS, HALF), gl.float32, mma)
    it = 0
    t = pid
    g, m0, n0, end = _tile(table_ptr, t, max_tiles)
    while g >= 0:
        t_next = t + P
        g_next, m0_next, n0_next, end_next = _tile(table_ptr, t_next, max_tiles)  # in flight during this tile
        steps = gl.where(g < G, k_steps, 0)  # group G: the rows past offs[-1], stored as zeros
        row0 = m0 + WG * ROWS
        rows = row0 + gl.arange(0, ROWS, layout=row_layout)
        row_ok = rows < end
        as_ptrs = as_ptr + rows.to(gl.int64) * s_asm
        bs_ptrs = bs_ptr + g.to(gl.int64) * s_bsg + (n0 // 128) * s_bsn
        if WIDE:
            acc, acc1, it = _steps_wide(
                a_bufs, b_bufs, ready, empty, as_ptrs, bs_ptrs, row_ok, s_ask, s_bsk, s_bsn, n0 + HALF < N, steps, it,
                zero, STAGES,
            )  # fmt: skip
        else:
            acc, it = _steps(
                a_bufs, b_bufs, ready, empty, as_ptrs, bs_ptrs, row_ok, s_ask, s_bsk, steps, it, zero, STAGES
            )
        _store_block(c_desc, c_bufs, 0, c_ptr, acc, rows, row_ok, row0, n0, end, N, s_cm, s_cn, col_layout, EPI_TMA)
        if WIDE:  # the right half into the second buffer where there is one
            _store_block(
                c_desc, c_bufs, c_bufs.type.shape[0] - 1, c_ptr, acc1, rows, row_ok, row0, n0 + HALF, end, N, s_cm,
                s_cn, col_layout, EPI_TMA,
            )  # fmt: skip
        t, g, m0, n0, end = t_next, g_next, m0_next, n0_next, end_next
    if EPI_TMA:
        tma.store_wait(0)


@gluon.jit(do_not_specialize=("max_tiles", "G", "s_asm", "s_ask", "s_bsg", "s_bsn", "s_bsk"))
def _grouped_kernel(
    a_desc,
    b_desc,
    c_desc,
    as_ptr,
    bs_ptr,
    table_ptr,
    c_ptr,
    max_tiles,
    N,
    K,
    G,
    s_asm,
    s_ask,
    s_bsg,
    s_bsn,
    s_bsk,
    s_cm,
    s_cn,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    EPI_TMA: gl.constexpr,
    EPI_BUFS: gl.constexpr,
):
    ROWS: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    gl.static_assert(ROWS == 64, "each math warpgroup owns 64 rows")
    gl.static_assert(BLOCK_K == 128, "one K step is one 1x128 / 128x128 scale block")
    gl.static_assert(128 % BLOCK_N == 0 or BLOCK_N == 256, "a tile inside one 128-column weight block, or two")
    a0_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, ROWS, BLOCK_K], a_desc.layout)
    a1_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, ROWS, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    gl.static_assert(EPI_BUFS == 1 or (EPI_BUFS == 2 and BLOCK_N == 256), "a second output buffer serves a wide tile")
    c0_bufs = gl.allocate_shared_memory(c_desc.dtype, [EPI_BUFS] + c_desc.block_type.shape, c_desc.layout)
    c1_bufs = gl.allocate_shared_memory(c_desc.dtype, [EPI_BUFS] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per math warpgroup
    operands = (as_ptr, bs_ptr, table_ptr, c_ptr, max_tiles, N, K, G, s_asm, s_ask, s_bsg, s_bsn, s_bsk, s_cm, s_cn)
    gl.warp_specialize(
        [
            (_math_partition, (a0_bufs, b_bufs, ready, empty, c_desc, c0_bufs, operands, 0, BLOCK_N, STAGES, EPI_TMA)),
            (_math_partition, (a1_bufs, b_bufs, ready, empty, c_desc, c1_bufs, operands, 1, BLOCK_N, STAGES, EPI_TMA)),
            (
                _load_partition,
                (a_desc, b_desc, a0_bufs, a1_bufs, b_bufs, ready, empty, table_ptr, max_tiles, N, K, G, STAGES),
            ),
        ],
        [4, 1],
        [MATH_REGS, LOAD_REGS],
    )


CONFIG = {"BLOCK_N": 128, "BAND": 4, "EPI_TMA": True, "EPI_BUFS": 1}
"""Tile width, band height of the schedule and epilogue of the launch (TMA stores; output buffers a math warpgroup
takes in turn: 2 lets a wide tile's right half be written while its left half's store runs, at the cost of
shared memory for the ring); the pipeline depth is as many stages as shared memory holds (:func:`stages`).
:func:`config_for` widens the tile where that pays."""

WIDE_TRITON = ("3.6",)
"""Triton releases (major.minor) whose build of the 256-wide tile keeps its K loops free of spills. Triton 3.9
spills inside them: it always passes ptxas ``--regAllocOptLevel=2`` (a workaround of its own), and ptxas 13.4
spills this kernel at every explicit level, none at its default."""


def config_for(n: int) -> dict:
    """The launch configuration of a GEMM of ``n`` output columns: :data:`CONFIG` with the 256-wide tile where ``n``
    fills at least one and this Triton compiles it without spills in its K loops (:data:`WIDE_TRITON`), else
    :data:`CONFIG` as it is."""
    wide = n >= 256 and ".".join(triton.__version__.split(".")[:2]) in WIDE_TRITON
    return dict(CONFIG, BLOCK_N=256) if wide else dict(CONFIG)


SCHEDULE_CHUNK = 1024
"""Tiles one schedule program writes per store."""


def _block_width(block_n: int) -> int:
    """Columns of one warpgroup's output block: the tile's, or half of a 256-wide tile's."""
    return min(block_n, TILE)


def stages(block_n: int, out_dtype: torch.dtype, epi_bufs: int = 1) -> int:
    """Stages of the ring that fit beside the math warpgroups' ``epi_bufs`` output blocks each: each stage two
    64x128 boxes of A and one ``block_n``x128 box of B (E4M3); at most 8."""
    stage = (2 * WG_ROWS + block_n) * TILE
    epilogue = 2 * epi_bufs * WG_ROWS * _block_width(block_n) * out_dtype.itemsize
    return min(8, (SHARED_BYTES - epilogue - 1024) // stage)


def serves(device: torch.device, k: int, n: int, out_dtype: torch.dtype) -> bool:
    """Whether the kernel serves a GEMM of reduction length ``k`` and ``n`` output columns on ``device``: an sm90
    GPU, a tested Triton, K a multiple of 16 and output rows of whole 16 bytes (TMA boxes)."""
    return (
        device.type == "cuda"
        and devices.capability(device)[0] == 9
        and triton_tested()
        and k % 16 == 0
        and n * out_dtype.itemsize % 16 == 0
    )


def supported(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether :func:`grouped_mm` serves these operands: :func:`serves` their shapes, and A ``[S, K]`` and B
    ``[G, N, K]`` contiguous with 16-byte aligned bases."""
    return (
        serves(a.device, a.shape[1], b.shape[1], out_dtype)
        and a.is_contiguous()
        and b.is_contiguous()
        and aligned16(a)
        and aligned16(b)
    )


_GL_TYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@functools.cache
def _smem_layouts(block_n: int, out_dtype: torch.dtype) -> tuple:
    """The shared-memory layouts of the A, B and output tiles (built once per tile width and output dtype)."""
    return (
        gl.NVMMASharedLayout.get_default_for([WG_ROWS, TILE], gl.float8e4nv),
        gl.NVMMASharedLayout.get_default_for([block_n, TILE], gl.float8e4nv),
        gl.NVMMASharedLayout.get_default_for([WG_ROWS, _block_width(block_n)], _GL_TYPES[out_dtype]),
    )


def launch_args(a, a_scales, b, b_scales, offs, out, config=None):
    """(grid, args, kwargs) of the GEMM's launch, without running it, and the schedule's ``(grid, args, kwargs)``
    that must run first (the sm90 compile test reads both)."""
    S, K = a.shape
    G, N, _ = b.shape
    cfg = dict(config_for(N) if config is None else config)
    block_n = cfg["BLOCK_N"]
    a_layout, b_layout, c_layout = _smem_layouts(block_n, out.dtype)
    a_desc = descriptor(TensorDescriptor.from_tensor, a, [WG_ROWS, TILE], a_layout)
    b_desc = descriptor(TensorDescriptor.from_tensor, b.view(G * N, K), [block_n, TILE], b_layout)
    c_desc = descriptor(TensorDescriptor.from_tensor, out, [WG_ROWS, _block_width(block_n)], c_layout)
    cfg.setdefault("STAGES", stages(block_n, out.dtype, cfg["EPI_BUFS"]))
    sms = devices.num_sms(a.device)
    max_tiles = (triton.cdiv(S, 2 * WG_ROWS) + G) * triton.cdiv(N, block_n)  # an upper bound, no sync
    table = torch.empty((max_tiles, 4), dtype=torch.int32, device=a.device)
    schedule = (
        (G + 1,),
        (offs, table, S, N, G, max_tiles),
        dict(
            BLOCK_M=2 * WG_ROWS,
            BLOCK_N=block_n,
            BAND=cfg.pop("BAND"),
            G_PAD=triton.next_power_of_2(G + 1),
            CHUNK=SCHEDULE_CHUNK,
            num_warps=4,
        ),
    )
    grid = (max(1, min(sms, max_tiles)),)
    args = (
        a_desc,
        b_desc,
        c_desc,
        a_scales,
        b_scales,
        table,
        out,
        max_tiles,
        N,
        K,
        G,
        *a_scales.stride(),
        *b_scales.stride(),
        *out.stride(),
    )
    kwargs = dict(cfg, num_warps=4, maxnreg=MAXNREG)
    return (grid, args, kwargs), schedule


def grouped_mm(a, a_scales, b, b_scales, offs, out_dtype=torch.bfloat16, *, config=None) -> torch.Tensor:
    """Launch the kernel (module docstring): the schedule, then the GEMM; arguments as
    :func:`mxfx.kernels.fp8_block.gemm.grouped_mm` after its checks, on operands :func:`supported` accepts."""
    S = a.shape[0]
    N = b.shape[1]
    out = torch.empty((S, N), dtype=out_dtype, device=a.device)
    if S == 0 or N == 0:
        return out
    (grid, args, kwargs), (s_grid, s_args, s_kwargs) = launch_args(a, a_scales, b, b_scales, offs, out, config)
    launch_direct(_schedule_kernel, s_grid, *s_args, **s_kwargs)
    launch_direct(_grouped_kernel, grid, *args, **kwargs)
    return out
