"""Triton grouped weight gradient with an FP32 epilogue that writes or adds into the gradient.

``out[g] (+)= dy[tokens of g]^T @ x[tokens of g]`` for ``dy [S, N]`` and ``x [S, K]`` (BF16 or FP16), int32 group
ends ``offs [G]`` (group g owns rows ``[offs[g-1], offs[g])``, ends non-decreasing, at most S, any alignment),
``out [G, N, K]`` FP32 through its strides (a parameter's ``.grad`` or a view of it). ``accumulate=True`` adds the
product to what ``out`` holds (gradient accumulation over microbatches, no separate ``add_``); ``False`` writes
it (an empty group's block is zeroed). One program per (output tile, group): it walks its group's tokens 64 at a
time, ``tl.dot`` of the transposed ``dy`` tile by the ``x`` tile into an FP32 accumulator (BF16 products are exact
in FP32; the sum's order is the tensor cores'), then reads ``out`` once if accumulating and writes it once: the
gradient makes one trip through memory instead of a BF16 result, its widening and ``AccumulateGrad``'s add.

Two mainloops: vector loads of any strides (masked per token), or, where ``dy`` and ``x`` are contiguous with
16-byte aligned bases and rows (:func:`tma_ready`) and groups average at least :data:`TMA_MIN_TOKENS` tokens, TMA
boxes through host tensor descriptors: the group's whole steps read unmasked (a box past S or N/K comes back
zero-filled), its last partial step with the rows past the group's end zeroed in both operands (the next group's
tokens, finite or not, add nothing). Accumulating, the epilogue adds the block with vector float reductions
(``red.global.add``, applied in L2): no gradient value is held beside the 128-register accumulator, so nothing
spills; the L2's add flushes subnormal results to zero (values below 2^-126, far under any gradient that
matters).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from mxfx.kernels.common.gemm import check_grouped_wgrad_into
from mxfx.kernels.common.launch import aligned16, descriptor, launch

CONFIG = {"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_T": 64, "num_warps": 4, "num_stages": 3}
"""Launch of the kernel: 128x128 FP32 outputs, 64 tokens per step (docs/kernel-notes.md: measured configurations)."""
LONG_GROUPS_CONFIG = {"BLOCK_N": 256, "BLOCK_K": 128, "BLOCK_T": 64, "num_warps": 8, "num_stages": 3}
"""Launch where groups average at least :data:`LONG_GROUPS` tokens (few experts, each a long contraction)."""
LONG_GROUPS = 4096
TMA_MIN_TOKENS = 1024
"""Mean tokens per group from which the TMA mainloop serves (where :func:`tma_ready`); shorter groups, whose
partial last step is a larger share, take the vector loads (docs/kernel-notes.md)."""


def config_for(tokens: int, groups: int) -> dict:
    """The launch configuration for ``tokens`` rows split over ``groups`` groups (their mean size chooses)."""
    return dict(LONG_GROUPS_CONFIG if tokens >= LONG_GROUPS * max(groups, 1) else CONFIG)


@triton.jit
def _tile(offs_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's group, the first N row and K column of its output tile, and the group's first and past-last
    token."""
    g = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    end = tl.maximum(tl.load(offs_ptr + g), start)
    return g, (tl.program_id(0) // tiles_k) * BLOCK_N, (tl.program_id(0) % tiles_k) * BLOCK_K, start, end


@triton.jit
def _epilogue(out_ptr, acc, g, n0, k0, N, K, s_og, s_on, s_ok, ACCUMULATE: tl.constexpr, RED: tl.constexpr):
    """Write ``acc`` to the gradient block of tile ``(g, n0, k0)``, or add it (``ACCUMULATE``): read into registers
    beside the accumulator, or (``RED``) as vector reductions the L2 applies, no gradient value in registers."""
    ns = n0 + tl.arange(0, acc.shape[0])
    ks = k0 + tl.arange(0, acc.shape[1])
    ptrs = out_ptr + g.to(tl.int64) * s_og + ns[:, None].to(tl.int64) * s_on + ks[None, :] * s_ok
    mask = (ns < N)[:, None] & (ks < K)[None, :]
    if ACCUMULATE and RED:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _grouped_wgrad_into_kernel(
    dy_ptr,
    x_ptr,
    offs_ptr,
    out_ptr,
    N,
    K,
    s_og,
    s_on,
    s_ok,
    s_dys,
    s_dyn,
    s_xs,
    s_xk,
    ACCUMULATE: tl.constexpr,
    RED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    g, n0, k0, start, end = _tile(offs_ptr, K, BLOCK_N, BLOCK_K)
    ns = n0 + tl.arange(0, BLOCK_N)
    ks = k0 + tl.arange(0, BLOCK_K)
    n_ok = ns < N
    k_ok = ks < K
    ts = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        tok = t0 + ts
        t_ok = tok < end
        dy = tl.load(
            dy_ptr + tok[:, None].to(tl.int64) * s_dys + ns[None, :] * s_dyn,
            mask=t_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + tok[:, None].to(tl.int64) * s_xs + ks[None, :] * s_xk, mask=t_ok[:, None] & k_ok[None, :], other=0.0
        )
        acc = tl.dot(tl.trans(dy), x, acc)
    _epilogue(out_ptr, acc, g, n0, k0, N, K, s_og, s_on, s_ok, ACCUMULATE, RED)


@triton.jit
def _grouped_wgrad_into_tma_kernel(
    dy_desc,
    x_desc,
    offs_ptr,
    out_ptr,
    N,
    K,
    s_og,
    s_on,
    s_ok,
    ACCUMULATE: tl.constexpr,
    RED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    STAGES: tl.constexpr,
):
    g, n0, k0, start, end = _tile(offs_ptr, K, BLOCK_N, BLOCK_K)
    whole = (end - start) // BLOCK_T
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in tl.range(0, whole, num_stages=STAGES):
        t0 = start + i * BLOCK_T
        acc = tl.dot(dy_desc.load([t0, n0]).T, x_desc.load([t0, k0]), acc)
    t0 = start + whole * BLOCK_T
    if t0 < end:  # the group's last tokens: rows past its end belong to the next group
        keep = (t0 + tl.arange(0, BLOCK_T) < end)[:, None]
        dy = tl.where(keep, dy_desc.load([t0, n0]), 0.0)
        x = tl.where(keep, x_desc.load([t0, k0]), 0.0)
        acc = tl.dot(dy.T, x, acc)
    _epilogue(out_ptr, acc, g, n0, k0, N, K, s_og, s_on, s_ok, ACCUMULATE, RED)


def tma_ready(dy: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the TMA mainloop can read ``dy`` and ``x``: at least one row, contiguous, 16-byte aligned bases and
    rows (a multiple of 8 16-bit values)."""
    return dy.shape[0] > 0 and all(t.is_contiguous() and aligned16(t) and t.shape[1] % 8 == 0 for t in (dy, x))


def grouped_wgrad_into(
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    *,
    config: dict | None = None,
    tma: bool | None = None,
    red: bool = True,
) -> None:
    """Launch the kernel (module docstring) on CUDA operands, or under Triton's interpreter. ``tma``: the TMA
    mainloop where :func:`tma_ready` (None: where groups average :data:`TMA_MIN_TOKENS` tokens or more); ``red``:
    an accumulating epilogue of vector float reductions, else a read of the block beside the accumulator and a
    store (both kept for timing one against the other, ``bench/probes/grouped_wgrad_into_configs.py``).

    Raises:
        ValueError: shapes, dtypes or devices that do not pair up
            (:func:`mxfx.kernels.common.gemm.check_grouped_wgrad_into`).
    """
    check_grouped_wgrad_into(dy, x, offs, out, kernel=True)
    if out.numel() == 0:
        return
    g, n, k = out.shape
    cfg = config_for(dy.shape[0], g) if config is None else dict(config)
    bn, bk = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    grid = (triton.cdiv(n, bn) * triton.cdiv(k, bk), g)
    if tma is None:
        tma = dy.shape[0] >= TMA_MIN_TOKENS * max(g, 1)
    if tma and tma_ready(dy, x):
        bt = cfg.pop("BLOCK_T")
        boxes = (descriptor(TensorDescriptor.from_tensor, t, [bt, w]) for t, w in ((dy, bn), (x, bk)))
        kernel, operands, strides = _grouped_wgrad_into_tma_kernel, tuple(boxes), ()
        cfg.update(BLOCK_T=bt, STAGES=cfg.pop("num_stages"))
    else:
        kernel, operands, strides = _grouped_wgrad_into_kernel, (dy, x), (*dy.stride(), *x.stride())
    launch(
        kernel,
        grid,
        *operands,
        offs,
        out,
        n,
        k,
        *out.stride(),
        *strides,
        ACCUMULATE=accumulate,
        RED=red,
        BLOCK_N=bn,
        BLOCK_K=bk,
        **cfg,
    )
