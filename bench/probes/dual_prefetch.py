"""Probe: the transposed dual quantize as a persistent program that loads its next tile while it encodes this one.

Usage:
* ``python bench/probes/dual_prefetch.py`` on a GPU: % of a 2 GiB copy for the module's ``quantize_dual`` and for
  each variant here, each checked byte for byte against the module;
* ``TRITON_INTERPRET=1 python bench/probes/dual_prefetch.py check`` on CPU: every variant's bytes against the
  module's kernel under Triton's interpreter;
* ``python bench/probes/dual_prefetch.py sass`` (no GPU): where the loads sit in each variant's sm90 SASS.

Why: Nsight Compute puts 57.6% of the transposed pass's stall cycles on global-load scoreboards, with each scheduler
idle half the time and 18 of 20 possible warps per SM resident (BENCHMARKS.md, 2026-12-02 night): the pass waits on
its loads, and cutting 13% of its instructions moved nothing. Each program of the module loads one [32, 64] tile and
waits for it. Here a program walks tiles ``p, p + P, p + 2P, ...`` (P programs, a few per SM) and, with ``PREFETCH``,
issues the next tile's loads into registers before it encodes the current one, so every warp keeps a tile's bytes in
flight while it computes. Same encode (``dual._encode_rows``), same outputs and layouts as the module.
"""

from __future__ import annotations

import os
import re
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from mxfx.kernels import dual  # noqa: E402
from mxfx.kernels.dual import _encode_rows  # noqa: E402
from mxfx.kernels.mx_block import CVT_ALL, load_tile, to_f32  # noqa: E402
from variant_table import check_persistent, probe_main, same_bytes, time_variants  # noqa: E402


@triton.jit
def _dual_persistent(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, n_k_tiles, n_tiles, step, ITERS: tl.constexpr,
                     PREFETCH: tl.constexpr, CVT: tl.constexpr):
    """Contiguous bf16 ``x [M, K]`` (M, K multiples of 32 and 64): tile t is rows (t // n_k_tiles) * 32, columns
    (t % n_k_tiles) * 64; ``step`` programs, ITERS tiles each; outputs as the module's transposed pass writes them."""
    pid = tl.program_id(0)
    ar = tl.arange(0, 32)[:, None]
    ac = tl.arange(0, 64)[None, :]
    b = pid * 0
    raw = tl.load(x_ptr + ((pid // n_k_tiles) * 32 + ar).to(tl.int64) * K + (pid % n_k_tiles) * 64 + ac)
    for i in range(0, ITERS):  # cdiv(n_tiles, step), a constexpr: Triton's interpreter wants a plain bound
        # past the end a program redoes the last tile: the same bytes written twice, no masks in the loop
        t = tl.minimum(pid + i * step, n_tiles - 1)
        m0 = (t // n_k_tiles) * 32
        k0 = (t % n_k_tiles) * 64
        if PREFETCH:  # this tile's values came in the last iteration; ask for the next one's now
            v = to_f32(raw, CVT)
            tn = tl.minimum(t + step, n_tiles - 1)  # the last tile again past the end: a harmless L2 hit
            raw = tl.load(x_ptr + ((tn // n_k_tiles) * 32 + ar).to(tl.int64) * K + (tn % n_k_tiles) * 64 + ac)
        else:
            v = to_f32(tl.load(x_ptr + (m0 + ar).to(tl.int64) * K + k0 + ac), CVT)
        _encode_rows(v, qr_ptr, sr_ptr, sr_ptr, b, m0, k0, M, K, True, True, False, False, True, 32, 64, False, CVT)
        vt = load_tile(x_ptr, b, k0, m0, K, M, 0, 1, K, 64, 32, True, False, CVT)  # the x^T tile: an L1 hit
        _encode_rows(vt, qc_ptr, sc_ptr, sc_ptr, b, k0, m0, K, M, True, True, False, False, True, 64, 32, False, CVT)


VARIANTS = [  # (name, prefetch, programs per SM, maxnreg); offline (``sass``) the capped ones spill 10-50 registers
    ("persistent, 20 per SM", False, 20, 96),
    ("prefetch, 12 per SM", True, 12, None),
    ("prefetch, 16 per SM", True, 16, 128),
    ("prefetch, 20 per SM", True, 20, 96),
]


def _kernel(maxnreg):
    if maxnreg is None:
        return _dual_persistent
    return triton.autotune([triton.Config({}, num_warps=1, maxnreg=maxnreg)], key=[])(_dual_persistent)


def run(x, prefetch, per_sm, maxnreg, sms=None):
    """The variant's ``(q_row, s_row, q_col, s_col)`` for contiguous bf16 ``x [M, K]``, as ``dual.quantize_dual``
    returns them."""
    M, K = x.shape
    if M % 32 or K % 64 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"dual_prefetch: needs a contiguous bf16 x with M % 32 == 0 and K % 64 == 0, got "
                         f"{x.dtype} {tuple(x.shape)}")
    dev = x.device
    q_row = torch.empty(M, K, dtype=torch.uint8, device=dev)
    s_row = torch.empty(K // 32, M, dtype=torch.uint8, device=dev)
    q_col = torch.empty(K, M, dtype=torch.uint8, device=dev)
    s_col = torch.empty(M // 32, K, dtype=torch.uint8, device=dev)
    n_tiles = (M // 32) * (K // 64)
    if sms is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    grid = (min(n_tiles, sms * per_sm),)
    kernel = _kernel(None if dev.type != "cuda" else maxnreg)
    kwargs = {} if kernel is not _dual_persistent else {"num_warps": 1}
    kernel[grid](x, q_row, s_row, q_col, s_col, M, K, K // 64, n_tiles, grid[0], ITERS=triton.cdiv(n_tiles, grid[0]),
                 PREFETCH=prefetch, CVT=CVT_ALL, **kwargs)
    return (q_row.view(torch.float8_e4m3fn), s_row.t(), q_col.view(torch.float8_e4m3fn), s_col.t())


def check():
    # the clamped last prefetch runs too: with three "SMs" a program walks several tiles
    check_persistent("dual_prefetch", [(name, lambda x, sms, cfg=cfg: run(x, *cfg, sms=sms))
                                       for name, *cfg in VARIANTS])


def sass():
    """Where each variant's global loads sit among its SASS instructions (no GPU needed)."""
    import sass_sm90

    x = torch.randn(256, 2048, dtype=torch.bfloat16)
    for name, prefetch, per_sm, maxnreg in VARIANTS:
        launch = sass_sm90.Launch(_dual_persistent, (1,), (x, x, x, x, x, 256, 2048, 32, 256, 8),
                                  {"ITERS": 8, "PREFETCH": prefetch, "CVT": CVT_ALL, "num_warps": 1,
                                   "maxnreg": maxnreg})
        c = sass_sm90.compile_sm90(launch)
        lines = [ln for ln in c.sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
        loads = [i for i, ln in enumerate(lines) if "LDG" in ln]
        print(f"{name}: {len(lines)} instructions, loads at {loads}, spills {c.counts.get('STL', 0)}")


def time_all():
    time_variants("module transposed", lambda x: dual.quantize_dual(x, "rceil"),
                  [(name, lambda x, cfg=cfg: run(x, *cfg)) for name, *cfg in VARIANTS], same_bytes)


if __name__ == "__main__":
    probe_main("dual_prefetch", time_all, check, sass)
