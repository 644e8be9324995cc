"""Probe: which address form makes the module's source-layout dual quantize 4-5 points slower than dual_hints' plain kernel.

Usage: ``python -m bench.probes.dual_source_addr`` on a GPU (% of a 2 GiB copy, every variant checked byte for
byte against the module); ``TRITON_INTERPRET=1 python -m bench.probes.dual_source_addr check`` on CPU.

Why: on the H200 the module's ``_dual_kernel`` (source layout, even tiles, one matrix) and ``dual_hints``' plain
kernel compile to the same 992 SASS instructions per thread, the same registers and the same memory
instructions, and write the same buffers, yet time 89.9 / 90.0 / 87.0% against 95.6 / 95.0 / 91.3% of copy
(BENCHMARKS.md, 2026-12-02). The two differ only in how addresses are formed. Each flag here switches one
piece to the plain kernel's form:

* ``LOAD``: ``(m0 + rows).to(int64) * K + k0 + cols`` (int64 per element) instead of an int64 tile base plus
  int32 offsets ``rows * K + cols``;
* ``QSTORE``: the same for the two qdata stores;
* ``SROW``: the rowwise scales' offsets ``(k0 / 32 + j).to(int64) * M + m0 + rows``;
* ``SCOL``: the columnwise scales stored as a 1D ``[BK]`` vector rather than a ``[1, BK]`` tile.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl


from bench.probes import dual_hints
from bench.probes.dual_hints import same
from mxfx.kernels.mx_block import encode_blocks


@triton.jit
def _variant(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, n_k, LOAD: tl.constexpr, QSTORE: tl.constexpr,
             SROW: tl.constexpr, SCOL: tl.constexpr, BK: tl.constexpr):
    """The module's layouts for contiguous x [M, K]: q_row, q_col [M, K]; s_row storage [K/32, M]; s_col
    storage [M/32, K]. Tiles [32, BK] dividing x."""
    pid = tl.program_id(0)
    m0 = (pid // n_k) * 32
    k0 = (pid % n_k) * BK
    ar = tl.arange(0, 32)
    ac = tl.arange(0, BK)
    aj = tl.arange(0, BK // 32)
    if LOAD:
        v = tl.load(x_ptr + (m0 + ar[:, None]).to(tl.int64) * K + k0 + ac[None, :])
    else:
        v = tl.load(x_ptr + (m0.to(tl.int64) * K + k0) + ar[:, None] * K + ac[None, :])
    v = v.to(tl.float32)
    if QSTORE:
        qoffs = (m0 + ar[:, None]).to(tl.int64) * K + k0 + ac[None, :]
    else:
        qoffs = (m0.to(tl.int64) * K + k0) + ar[:, None] * K + ac[None, :]
    q, s = encode_blocks(tl.reshape(v, [32, BK // 32, 32]), 2, True)
    tl.store(qr_ptr + qoffs, tl.reshape(q, [32, BK]))
    if SROW:
        tl.store(sr_ptr + (k0 // 32 + aj[None, :]).to(tl.int64) * M + m0 + ar[:, None], s)
    else:
        tl.store(sr_ptr + ((k0 // 32).to(tl.int64) * M + m0) + aj[None, :] * M + ar[:, None], s)
    q, s = encode_blocks(tl.reshape(v, [1, 32, BK]), 1, True)
    tl.store(qc_ptr + qoffs, tl.reshape(q, [32, BK]))
    if SCOL:
        tl.store(sc_ptr + (m0 // 32) * K + k0 + ac, tl.reshape(s, [BK]))
    else:
        tl.store(sc_ptr + ((m0 // 32).to(tl.int64) * K + k0) + tl.arange(0, 1)[:, None] * K + ac[None, :], s)


FLAGS = ("LOAD", "QSTORE", "SROW", "SCOL")
VARIANTS = [dict.fromkeys(FLAGS, False)] + [{f: f == g for f in FLAGS} for g in FLAGS] + [dict.fromkeys(FLAGS, True)]


def run(x, flags, bk=64):
    M, K = x.shape
    u8 = lambda *s: torch.empty(*s, dtype=torch.uint8, device=x.device)  # noqa: E731
    out = u8(M, K), u8(K // 32, M), u8(M, K), u8(M // 32, K)
    _variant[(M // 32 * (K // bk),)](x, *out, M, K, K // bk, **flags, BK=bk, num_warps=1)
    return out


def module(x):
    """The module's source-layout outputs as storage tensors, comparable with :func:`run`'s."""
    return dual_hints.module(x, False)


def name(flags):
    on = [f for f in FLAGS if flags[f]]
    return "module form" if not on else "plain form" if len(on) == len(FLAGS) else " + ".join(on)


def check():
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(-448, 449, (64, 256), generator=g).float() / 4).to(torch.bfloat16)
    ref = module(x)
    for flags in VARIANTS:
        assert same(run(x, flags), ref), name(flags)
    print("dual_source_addr check: every variant equals the module under the interpreter")


def time_all():
    from bench.probes.variant_table import time_variants

    time_variants("module `quantize_dual_source`", module,
                  [(name(flags), lambda x, flags=flags: run(x, flags)) for flags in VARIANTS], same)


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["check"]):
        sys.exit(f"dual_source_addr: unknown arguments {sys.argv[1:]}; run with no argument (GPU) or 'check'")
    if sys.argv[1:] == ["check"]:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("dual_source_addr: 'check' needs TRITON_INTERPRET=1")
        check()
    elif not torch.cuda.is_available():
        sys.exit("dual_source_addr: timing needs a CUDA GPU (TRITON_INTERPRET=1 ... check runs on CPU)")
    else:
        time_all()
