"""Probe: the dual quantize with streaming cache hints, and with several K tiles per program (software-pipelined).

Usage:
* ``python -m bench.probes.dual_hints`` on a GPU: % of a 2 GiB copy for the module's ``quantize_dual_source``
  and ``quantize_dual`` and for each variant here, each checked byte for byte against the module;
* ``TRITON_INTERPRET=1 python -m bench.probes.dual_hints check`` on CPU: every variant's bytes against the
  module's kernel under Triton's interpreter, on a small exactly representable input.

Why: the dual passes sit at 77-89% of copy while the fused SwiGLU, with nearly twice the SASS per byte, reaches
97% (BENCHMARKS.md, 2026-12-02), so instruction issue alone does not explain their gap. Two memory-side
candidates, same arithmetic (``mx_block.encode_blocks``) and same outputs as the module:

* ``hint``: the input read with ``evict_first`` and the four outputs stored with ``.cs`` (streaming), so
  that neither displaces the other in L2;
* ``loop=L, stages=S``: one program walks L consecutive K tiles of its 32 rows in a ``tl.range`` loop with
  S pipeline stages, so the next tile's loads are in flight while this one is encoded and stored.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl


from mxfx.kernels import dual
from mxfx.kernels.mx_block import encode_blocks


@triton.jit
def _dual_hinted(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, n_groups, COL_T: tl.constexpr,
                 EVICT: tl.constexpr, CACHE: tl.constexpr, LOOP: tl.constexpr, STAGES: tl.constexpr,
                 BK: tl.constexpr):
    """Program p: rows m0 = (p // n_groups) * 32, K tiles (p % n_groups) * LOOP + t for t < LOOP. Contiguous
    x [M, K]; q_row [M, K]; s_row storage [K/32, M]; q_col [M, K] (source layout) or [K, M] (COL_T);
    s_col storage [M/32, K]: the module's layouts."""
    pid = tl.program_id(0)
    m0 = (pid // n_groups) * 32
    kg = (pid % n_groups) * LOOP
    ar = tl.arange(0, 32)
    ac = tl.arange(0, BK)
    aj = tl.arange(0, BK // 32)
    for t in tl.range(0, LOOP, num_stages=STAGES):
        k0 = (kg + t) * BK
        v = tl.load(x_ptr + (m0 + ar[:, None]).to(tl.int64) * K + k0 + ac[None, :], eviction_policy=EVICT)
        v = v.to(tl.float32)
        q, s = encode_blocks(tl.reshape(v, [32, BK // 32, 32]), 2, True)
        tl.store(qr_ptr + (m0 + ar[:, None]).to(tl.int64) * K + k0 + ac[None, :], tl.reshape(q, [32, BK]),
                 cache_modifier=CACHE)
        tl.store(sr_ptr + (k0 // 32 + aj[None, :]).to(tl.int64) * M + m0 + ar[:, None], s, cache_modifier=CACHE)
        q, s = encode_blocks(tl.reshape(v, [1, 32, BK]), 1, True)
        q = tl.reshape(q, [32, BK])
        if COL_T:
            tl.store(qc_ptr + (k0 + ac[None, :]).to(tl.int64) * M + m0 + ar[:, None], q, cache_modifier=CACHE)
        else:
            tl.store(qc_ptr + (m0 + ar[:, None]).to(tl.int64) * K + k0 + ac[None, :], q, cache_modifier=CACHE)
        tl.store(sc_ptr + (m0 // 32) * K + k0 + ac[None, :], tl.reshape(s, [1, BK]), cache_modifier=CACHE)


VARIANTS = [  # (name, evict, cache, loop, stages, BK, warps)
    ("plain", "", "", 1, 1, 64, 1),
    ("hint", "evict_first", ".cs", 1, 1, 64, 1),
    ("loop=4, stages=2", "", "", 4, 2, 64, 1),
    ("loop=4, stages=2, hint", "evict_first", ".cs", 4, 2, 64, 1),
    ("loop=4, stages=3, hint", "evict_first", ".cs", 4, 3, 64, 1),
    ("loop=8, stages=2, hint", "evict_first", ".cs", 8, 2, 64, 1),
]


def run(x, col_t, evict, cache, loop, stages, bk, warps):
    """The variant's ``(q_row, s_row storage, q_col storage, s_col storage)`` for contiguous ``x [M, K]``."""
    M, K = x.shape
    if M % 32 or K % (bk * loop):
        raise ValueError(f"dual_hints: x of shape {tuple(x.shape)} needs M % 32 == 0 and K % {bk * loop} == 0")
    dev = x.device
    q_row = torch.empty(M, K, dtype=torch.uint8, device=dev)
    s_row = torch.empty(K // 32, M, dtype=torch.uint8, device=dev)
    q_col = torch.empty((K, M) if col_t else (M, K), dtype=torch.uint8, device=dev)
    s_col = torch.empty(M // 32, K, dtype=torch.uint8, device=dev)
    n_groups = K // (bk * loop)
    _dual_hinted[(M // 32 * n_groups,)](x, q_row, s_row, q_col, s_col, M, K, n_groups, COL_T=col_t, EVICT=evict,
                                        CACHE=cache, LOOP=loop, STAGES=stages, BK=bk, num_warps=warps)
    return q_row, s_row, q_col, s_col


def module(x, col_t):
    """The module's outputs as storage tensors, comparable with :func:`run`'s."""
    if col_t:
        q_row, s_row, q_col, s_col = dual.quantize_dual(x, "rceil")
        return q_row.view(torch.uint8), s_row.t(), q_col.view(torch.uint8), s_col.t()
    q_row, s_row, _, q_col, s_col, _ = dual.quantize_dual_source(x, "rceil")
    return q_row.view(torch.uint8), s_row.t(), q_col.view(torch.uint8).t(), s_col.t()


def same(a, b):
    return all(torch.equal(u.contiguous(), w.contiguous()) for u, w in zip(a, b))


def check():
    g = torch.Generator().manual_seed(0)
    # not exactly representable in E4M3: the interpreter's rounding may differ from the reference's, but the
    # variants and the module's kernel run the same encode under the same interpreter, so they must agree
    x = (torch.randint(-448, 449, (64, 512), generator=g).float() / 4).to(torch.bfloat16)
    for col_t in (False, True):
        ref = module(x, col_t)
        for name, *cfg in VARIANTS:
            assert same(run(x, col_t, *cfg), ref), (name, col_t)
    print("dual_hints check: every variant equals the module under the interpreter")


def time_all():
    from bench.mx_kernels import SHAPES, copy_bandwidth, median_ms

    copy_gbs = copy_bandwidth()
    print(f"copy {copy_gbs:.0f} GB/s\n| variant | shape | % of copy | bytes |\n|---|---|---|---|")
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * m * k + 2 * m * k * 33 / 32
        for col_t in (False, True):
            tag = "transposed" if col_t else "source"
            ref = module(x, col_t)
            pct = 100 * nbytes / median_ms(lambda: module(x, col_t)) / 1e6 / copy_gbs
            print(f"| module {tag} | {m}x{k} | {pct:.1f}% | - |", flush=True)
            for name, *cfg in VARIANTS:
                pct = 100 * nbytes / median_ms(lambda: run(x, col_t, *cfg)) / 1e6 / copy_gbs
                ok = "exact" if same(run(x, col_t, *cfg), ref) else "DIFFER"
                print(f"| {name}, {tag} | {m}x{k} | {pct:.1f}% | {ok} |", flush=True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["check"]):
        sys.exit(f"dual_hints: unknown arguments {sys.argv[1:]}; run with no argument (GPU) or 'check'")
    if sys.argv[1:] == ["check"]:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("dual_hints: 'check' runs the kernels under Triton's interpreter: TRITON_INTERPRET=1 python "
                     "-m bench.probes.dual_hints check")
        check()
    elif not torch.cuda.is_available():
        sys.exit("dual_hints: timing needs a CUDA GPU (TRITON_INTERPRET=1 ... check runs on CPU)")
    else:
        time_all()
