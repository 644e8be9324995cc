"""Triton grouped weight gradient with an FP32 epilogue that writes or adds into the gradient.

``out[g] (+)= dy[tokens of g]^T @ x[tokens of g]`` for ``dy [S, N]`` and ``x [S, K]`` (BF16 or FP16), int32 group
ends ``offs [G]`` (group g owns rows ``[offs[g-1], offs[g])``, ends non-decreasing, at most S, any alignment),
``out [G, N, K]`` FP32 through its strides (a parameter's ``.grad`` or a view of it). ``accumulate=True`` adds the
product to what ``out`` holds (gradient accumulation over microbatches, no separate ``add_``); ``False`` writes
it (an empty group's block is zeroed). One program per (output tile, group): it walks its group's tokens 64 at a
time, ``tl.dot`` of the transposed ``dy`` tile by the ``x`` tile into an FP32 accumulator (BF16 products are exact
in FP32; the sum's order is the tensor cores'), then reads ``out`` once if accumulating and writes it once: the
gradient makes one trip through memory instead of a BF16 result, its widening and ``AccumulateGrad``'s add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.common.gemm import check_grouped_wgrad_into
from mxfx.kernels.common.launch import launch

CONFIG = {"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_T": 64, "num_warps": 4, "num_stages": 3}
"""Launch of the kernel: 128x128 FP32 outputs, 64 tokens per step (docs/kernel-notes.md: measured configurations)."""
LONG_GROUPS_CONFIG = {"BLOCK_N": 256, "BLOCK_K": 128, "BLOCK_T": 64, "num_warps": 8, "num_stages": 3}
"""Launch where groups average at least :data:`LONG_GROUPS` tokens (few experts, each a long contraction)."""
LONG_GROUPS = 4096


def config_for(tokens: int, groups: int) -> dict:
    """The launch configuration for ``tokens`` rows split over ``groups`` groups (their mean size chooses)."""
    return dict(LONG_GROUPS_CONFIG if tokens >= LONG_GROUPS * max(groups, 1) else CONFIG)


@triton.jit
def _grouped_wgrad_into_kernel(
    dy_ptr,
    x_ptr,
    offs_ptr,
    out_ptr,
    N,
    K,
    s_dys,
    s_dyn,
    s_xs,
    s_xk,
    s_og,
    s_on,
    s_ok,
    ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    g = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    ns = (tl.program_id(0) // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (tl.program_id(0) % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    end = tl.maximum(tl.load(offs_ptr + g), start)
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
    ptrs = out_ptr + g.to(tl.int64) * s_og + ns[:, None].to(tl.int64) * s_on + ks[None, :] * s_ok
    mask = n_ok[:, None] & k_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, acc, mask=mask)


def grouped_wgrad_into(
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    *,
    config: dict | None = None,
) -> None:
    """Launch the kernel (module docstring) on CUDA operands, or under Triton's interpreter.

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
    launch(
        _grouped_wgrad_into_kernel,
        grid,
        dy,
        x,
        offs,
        out,
        n,
        k,
        *dy.stride(),
        *x.stride(),
        *out.stride(),
        ACCUMULATE=accumulate,
        BLOCK_N=bn,
        BLOCK_K=bk,
        **cfg,
    )
