"""Triton grouped GEMM on fp8_block operands: ``out[rows of group g] = A[rows] @ B[g]^T``.

A is ``[S, K]`` E4M3 with 1x128 float32 scales ``[S, ceil(K/128)]`` (activations or gradients,
tiled along the reduction dim K); B is ``[G, N, K]`` E4M3 with 128x128 float32 scales
``[G, ceil(N/128), ceil(K/128)]`` (expert weights). Rows are grouped as ``torch._grouped_mm``
groups them: ``offs`` int32 ``[G]`` holds cumulative group ends, group g owns rows
``[offs[g-1], offs[g])``; empty groups and group sizes that are not multiples of anything are
fine, and rows past ``offs[-1]`` are written as zeros.

Design (the DeepGEMM one, written for Triton): every 128-wide step of K is one FP8 ``tl.dot``
into a fresh FP32 partial sum, promoted once into the FP32 accumulator with the product of the
row's A scale and the tile's B scale: ``acc += partial * (sa[m] * sb)``. A tile is at most 128
columns wide and starts on a multiple of its width, so it lies inside one 128-column weight block:
the B scale is one scalar per K step, folded into the row scales (one FMA per accumulator value per
step). The launch is persistent: one program per SM (or two, three for the smaller tiles) walks the
tiles of all groups in one launch (group by group, tiles numbered globally, program p takes tiles
p, p + P, ...), so group sizes never reach the host and nothing is synchronised.

Loads: where A and B are K-major with 16-byte aligned rows (every cached weight form and every
quantized activation of the passes) both are read through TMA tensor descriptors: A over ``[S, K]``
(rows past a group's end are read and never stored), B over ``[G * N, K]`` (K past its end reads as
zeros). Otherwise (a transposed view, K not a multiple of 16) they are read through pointers with
masks.

B is read through its strides: the forward passes the weight ``W [G, N, K]`` itself; dgrad
(``dX = dY W``) passes the weight's transpose ``[G, K, N]`` with its scales transposed, either as
a view (slower: non-K-major loads) or as a contiguous copy (the fast layout, TMA). Under the rceil
rule the 128x128 scales of a block serve both orientations unchanged.

Numerics: each partial sum holds exact E4M3 products summed in FP32 over 128 values (on Hopper
the FP8 tensor cores accumulate with fewer mantissa bits, the reason for the per-128 promotion);
the only other roundings are the scale product (exact for power-of-two scales inside FP32's
normal range), the promotion FMA and the output cast.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mxfx import device as devices
from mxfx.kernels.common import kernel_keys, tuning
from mxfx.kernels.common.launch import aligned16
from mxfx.kernels.fp8_block.slots_triton import group_slots
from mxfx.numerics.block import TILE


def _descriptor_blocks(nargs: dict) -> None:
    """Autotune pre-hook: the TMA descriptors' block shapes follow the config's tile."""
    if nargs.get("a_desc") is not None:
        nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


CONFIGS = [
    triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "PROGRAMS_PER_SM": per_sm},
        num_stages=stages,
        num_warps=warps,
        pre_hook=_descriptor_blocks,
    )
    for bm, bn, stages, warps, per_sm in (
        (128, 128, 4, 8, 1),
        (128, 128, 3, 8, 1),
        (64, 128, 3, 4, 2),
        (64, 128, 4, 4, 2),
        (128, 64, 4, 4, 2),
        (64, 64, 4, 4, 3),
    )
]
"""A small sm90 set: 128-wide K steps, tiles at most 128 columns wide (one weight block, module docstring); the
accumulator and the 128-K partial sum each take BLOCK_M x BLOCK_N FP32 values. 8-warp tiles run one program per
SM, 4-warp tiles two or three, so that while one program promotes its partial sums on the CUDA cores another's
FP8 MMAs run. PROGRAMS_PER_SM sets the persistent grid to match. Autotuned per (N, K, G, layout); token counts
are not in the key (they change every step). Measured tiles and variants: docs/kernel-notes.md."""


def _grouped_body(
    a_ptr,
    a_desc,
    as_ptr,
    b_ptr,
    b_desc,
    bs_ptr,
    offs_ptr,
    c_ptr,
    S,
    N,
    K,
    G,
    s_am,
    s_ak,
    s_asm,
    s_ask,
    s_bg,
    s_bn,
    s_bk,
    s_bsg,
    s_bsn,
    s_bsk,
    s_cm,
    s_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # read by the launch grid only
):
    tl.static_assert(128 % BLOCK_N == 0, "a tile must lie inside one 128-column weight block")
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    tile = pid  # the next global tile number this program computes
    seen = 0  # tiles of the groups walked so far
    b_g = b_ptr  # group g's weight and scales (pointers advance: 64-bit offsets at any size)
    bs_g = bs_ptr
    g = 0
    while g <= G:  # group G is the tail past offs[-1]: zeros (a while: triton 3.6's interpreter cannot range over G)
        m_start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        m_end = tl.load(offs_ptr + g, mask=g < G, other=S)
        m_start = tl.minimum(m_start, S)
        m_end = tl.maximum(tl.minimum(m_end, S), m_start)
        group_tiles = tl.cdiv(m_end - m_start, BLOCK_M) * tiles_n
        steps = tl.where(g < G, k_steps, 0)
        while tile < seen + group_tiles:
            t = tile - seen
            m0 = m_start + (t // tiles_n) * BLOCK_M
            n0 = (t % tiles_n) * BLOCK_N
            rows = m0 + tl.arange(0, BLOCK_M)
            cols = n0 + tl.arange(0, BLOCK_N)
            row_ok = rows < m_end
            col_ok = cols < N
            ks = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + rows[:, None].to(tl.int64) * s_am + ks[None, :] * s_ak
            b_ptrs = b_g + cols[None, :].to(tl.int64) * s_bn + ks[:, None] * s_bk
            as_ptrs = as_ptr + rows.to(tl.int64) * s_asm
            bs_ptrs = bs_g + (n0 // 128) * s_bsn  # the tile's weight block row
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in range(0, steps):
                if TMA:
                    a = a_desc.load([m0, kb * BLOCK_K])
                    b = b_desc.load([g * N + n0, kb * BLOCK_K]).T
                elif EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                    b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
                else:
                    k_ok = kb * BLOCK_K + ks < K
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                partial = tl.dot(a, b, out_dtype=tl.float32)
                sa = tl.load(as_ptrs + kb * s_ask, mask=row_ok, other=0.0)
                acc += partial * (sa * tl.load(bs_ptrs + kb * s_bsk))[:, None]
                a_ptrs += BLOCK_K * s_ak
                b_ptrs += BLOCK_K * s_bk
            c_ptrs = c_ptr + rows[:, None].to(tl.int64) * s_cm + cols[None, :] * s_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            tile += num_programs
        seen += group_tiles
        b_g += s_bg
        bs_g += s_bsg
        g += 1


_kernel = triton.jit(do_not_specialize=["S"])(_grouped_body)
_kernel_tuned = triton.autotune(  # launches _kernel itself: one set of compiled variants for both paths
    configs=CONFIGS,
    key=["N", "K", "G", "s_ak", "s_bn", "s_bk", "EVEN_K", "TMA"],
)(_kernel)

INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 64, "PROGRAMS_PER_SM": 1}
"""Tile of the untuned launch (the Triton interpreter, where autotuning would only slow tests)."""


@functools.cache
def _tuning_kernel(device_index: int) -> str:
    return tuning.kernel_id(_kernel, torch.cuda.get_device_name(device_index))


def grouped_mm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    tune: bool = True,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch the grouped kernel (module docstring); arguments as :func:`mxfx.kernels.fp8_block.gemm.grouped_mm`
    after its checks. Tuned: the config recorded for this key (:mod:`mxfx.kernels.common.tuning`, across
    processes), else Triton's autotuner, whose winner is recorded. ``tune=False`` (or a ``config`` of
    BLOCK_M/BLOCK_N, plus num_warps/num_stages) launches one fixed tile instead."""
    S, K = a.shape
    G, N, _ = b.shape
    out = torch.empty((S, N), dtype=out_dtype, device=a.device)
    if S == 0 or N == 0:
        return out
    interpret = a.device.type == "cpu"
    device_index = None if interpret else a.device.index if a.device.index is not None else torch.cuda.current_device()
    programs_cap = 3 if interpret else devices.num_sms(a.device)
    tma = _tma_ready(a) and _tma_ready(b)
    # block shapes here are placeholders: the launch sets them from its tile (the autotune pre-hook, or below)
    a_desc = TensorDescriptor.from_tensor(a, [16, TILE]) if tma else None
    b_desc = TensorDescriptor.from_tensor(b.view(G * N, K), [16, TILE]) if tma else None
    args = (
        a,
        a_desc,
        a_scales,
        b,
        b_desc,
        b_scales,
        offs,
        out,
        S,
        N,
        K,
        G,
        *a.stride(),
        *a_scales.stride(),
        *b.stride(),
        *b_scales.stride(),
        *out.stride(),
    )
    even_k = K % TILE == 0

    def grid(meta):
        # PROGRAMS_PER_SM programs per SM (3 in all under the interpreter: each walks several tiles); fewer
        # when the tiles are few (an upper bound on them, no sync)
        tiles = (triton.cdiv(S, meta["BLOCK_M"]) + G) * triton.cdiv(N, meta["BLOCK_N"])
        return (min(programs_cap * meta.get("PROGRAMS_PER_SM", 1), tiles),)

    if tune and config is None and not interpret:
        # the autotuner's key, with the output dtype (mxfx.kernels.common.tuning: kept across processes)
        key = (N, K, G, a.stride(1), b.stride(1), b.stride(2), even_k, tma, out_dtype)
        best = tuning.lookup(_tuning_kernel(device_index), key, CONFIGS)
        if best is None:
            kernel_keys.fix(_kernel_tuned)
            _kernel_tuned[grid](*args, BLOCK_K=TILE, EVEN_K=even_k, TMA=tma)
            tuning.record(_tuning_kernel(device_index), key, _kernel_tuned.best_config)
            return out
        config = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
    cfg = dict(config or INTERPRETER_CONFIG)
    warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    cfg.setdefault("PROGRAMS_PER_SM", 1)
    _descriptor_blocks({"a_desc": a_desc, "b_desc": b_desc, "BLOCK_K": TILE, **cfg})
    kernel_keys.fix(_kernel)
    _kernel[grid(cfg)](*args, BLOCK_K=TILE, EVEN_K=even_k, TMA=tma, num_warps=warps, num_stages=stages, **cfg)
    return out


def _tma_ready(t: torch.Tensor) -> bool:
    """A tensor TMA can read whole: contiguous (K-major, rows one after another) with 16-byte aligned rows and base."""
    return t.is_contiguous() and t.shape[-1] % 16 == 0 and aligned16(t)


WGRAD_CONFIG = (128, 64, 3, 4)
"""(BLOCK_N, BLOCK_K, num_stages, num_warps) of the grouped wgrad kernel: 128x64 output tiles of each expert,
128 tokens per step (one scale slot), four warps (two programs an SM, one's epilogue beside the other's loop)."""


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,
    a_desc,
    as_ptr,
    b_ptr,
    b_desc,
    bs_ptr,
    offs_ptr,
    c_ptr,
    N,
    K,
    G,
    s_an,
    s_at,
    s_asn,
    s_ass,
    s_bk,
    s_bt,
    s_bsk,
    s_bss,
    s_cg,
    s_cn,
    s_ck,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    TMA: tl.constexpr,
    G_PAD: tl.constexpr,
):
    """``C[g] = A[:, tokens of g] @ B[:, tokens of g]^T`` (``ACCUMULATE``: ``C[g] +=``, one FP32 add of the finished
    sum): A ``[N, 128 C]``, B ``[K, 128 C]`` E4M3, group g's token tile j in the 128 columns of slot
    ``tile_start[g] + j`` (+0 past the group's end) with its 1x128 scales there; one program per (output tile,
    group). Every tile is whole and aligned: read through the TMA descriptors (``TMA``) or vector loads, masked
    only at N and K."""
    g = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    n0 = (tl.program_id(0) // tiles_k) * BLOCK_N
    k0 = (tl.program_id(0) % tiles_k) * BLOCK_K
    ns = n0 + tl.arange(0, BLOCK_N)
    ks = k0 + tl.arange(0, BLOCK_K)
    slot0, tiles = group_slots(offs_ptr, G, g, G_PAD, BLOCK_T)  # this group's first slot and tile count
    n_ok = ns < N
    k_ok = ks < K
    ts = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for j in range(0, tiles):
        t0 = (slot0 + j) * BLOCK_T
        if TMA:
            a = a_desc.load([n0, t0])
            b = b_desc.load([k0, t0])
        else:
            tok = t0 + ts
            a = tl.load(a_ptr + ns[:, None].to(tl.int64) * s_an + tok[None, :] * s_at, mask=n_ok[:, None], other=0.0)
            b = tl.load(b_ptr + ks[:, None].to(tl.int64) * s_bk + tok[None, :] * s_bt, mask=k_ok[:, None], other=0.0)
        partial = tl.dot(a, b.T, out_dtype=tl.float32)
        sa = tl.load(as_ptr + ns * s_asn + (slot0 + j) * s_ass, mask=n_ok, other=0.0)
        sb = tl.load(bs_ptr + ks * s_bsk + (slot0 + j) * s_bss, mask=k_ok, other=0.0)
        acc += partial * (sa[:, None] * sb[None, :])
    c_ptrs = c_ptr + g.to(tl.int64) * s_cg + ns[:, None].to(tl.int64) * s_cn + ks[None, :].to(tl.int64) * s_ck
    c_ok = n_ok[:, None] & k_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_ok, other=0.0)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_ok)


def grouped_wgrad(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    config: tuple | None = None,
) -> torch.Tensor:
    """Launch the grouped wgrad kernel; arguments as :func:`mxfx.kernels.fp8_block.gemm.grouped_wgrad` after its
    checks: with ``out`` (float32 ``[G, N, K]``, any strides) the kernel writes the result there, or adds it
    (``accumulate``), and returns ``out``."""
    n, _ = a.shape
    k = b.shape[0]
    g = offs.numel()
    if out is None:
        out, accumulate = torch.empty((g, n, k), dtype=out_dtype, device=a.device), False
    if out.numel() == 0:
        return out
    interpret = a.device.type == "cpu"
    bn, bk, stages, warps = config or ((32, 64, 1, 4) if interpret else WGRAD_CONFIG)
    tma = _tma_ready(a) and _tma_ready(b)
    grid = (triton.cdiv(n, bn) * triton.cdiv(k, bk), g)
    kernel_keys.fix(_grouped_wgrad_kernel)
    _grouped_wgrad_kernel[grid](
        a,
        TensorDescriptor.from_tensor(a, [bn, TILE]) if tma else None,
        a_scales,
        b,
        TensorDescriptor.from_tensor(b, [bk, TILE]) if tma else None,
        b_scales,
        offs,
        out,
        n,
        k,
        g,
        *a.stride(),
        *a_scales.stride(),
        *b.stride(),
        *b_scales.stride(),
        *out.stride(),
        BLOCK_N=bn,
        BLOCK_K=bk,
        BLOCK_T=TILE,
        ACCUMULATE=accumulate,
        TMA=tma,
        G_PAD=triton.next_power_of_2(g),
        num_stages=stages,
        num_warps=warps,
    )
    return out
