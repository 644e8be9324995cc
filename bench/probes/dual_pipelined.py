"""Probe: the transposed dual quantize as persistent programs whose tile loads Triton's pipeliner issues ahead.

Usage:
* ``python bench/probes/dual_pipelined.py`` on a GPU: % of a 2 GiB copy for the module's ``quantize_dual`` and for
  each variant here, each checked byte for byte against the module;
* ``TRITON_INTERPRET=1 python bench/probes/dual_pipelined.py check`` on CPU: every variant's bytes against the
  module's kernel under Triton's interpreter;
* ``python bench/probes/dual_pipelined.py sass`` (no GPU): each variant's sm90 SASS, counted (async copies, TMA,
  shared memory traffic, registers).

Why: the transposed pass waits on its loads (Nsight Compute: 57.6% of stalls on global-load scoreboards, BENCHMARKS.md
2026-12-02 night); register prefetch (``dual_prefetch.py``) is placed late by ptxas and spills under caps. Here the
loads go to shared memory asynchronously: a program walks tiles ``p, p + P, ...`` in a ``tl.range`` loop with
``num_stages`` S, and Triton's pipeliner issues the loads S - 1 tiles ahead, as ``cp.async`` (``LDGSTS``) for
pointer loads or as TMA (``UTMALDG``) for tensor-descriptor loads. The x^T tile is either read again (an L1 or L2
hit, as the module does) or ``tl.trans`` of the loaded tile, which the compiler routes through shared memory.
Same encode (``dual._encode_rows``), same outputs and layouts as the module.
"""

from __future__ import annotations

import os
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
from variant_table import check_persistent, probe_main, same_bytes, time_variants, use_tma_scratch  # noqa: E402

BM, BK = 32, 64


@triton.jit
def _dual_pipelined(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, n_k_tiles, n_tiles, step, ITERS: tl.constexpr,
                    STAGES: tl.constexpr, TMA: tl.constexpr, TRANS: tl.constexpr, CVT: tl.constexpr):
    """Contiguous bf16 ``x [M, K]`` (M % 32 == 0, K % 64 == 0); tile t is rows (t // n_k_tiles) * 32, columns
    (t % n_k_tiles) * 64; outputs as the module's transposed pass writes them."""
    pid = tl.program_id(0)
    b = pid * 0
    ar = tl.arange(0, 32)[:, None]
    ac = tl.arange(0, 64)[None, :]
    if TMA:
        desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[32, 64])
    for i in tl.range(0, ITERS, num_stages=STAGES):  # a constexpr bound: Triton's interpreter wants a plain one
        # past the end a program redoes the last tile: the same bytes written twice, no masks in the loop
        t = tl.minimum(pid + i * step, n_tiles - 1)
        m0 = (t // n_k_tiles) * 32
        k0 = (t % n_k_tiles) * 64
        if TMA:
            raw = desc.load([m0, k0])
        else:
            raw = tl.load(x_ptr + (m0 + ar).to(tl.int64) * K + k0 + ac)
        if TRANS:
            vt = to_f32(tl.trans(raw), CVT)
        else:
            vt = load_tile(x_ptr, b, k0, m0, K, M, 0, 1, K, 64, 32, True, False, CVT)  # the x^T tile read again
        v = to_f32(raw, CVT)
        _encode_rows(v, qr_ptr, sr_ptr, sr_ptr, b, m0, k0, M, K, True, True, False, False, True, 32, 64, False, CVT)
        _encode_rows(vt, qc_ptr, sc_ptr, sc_ptr, b, k0, m0, K, M, True, True, False, False, True, 64, 32, False, CVT)


VARIANTS = [  # (name, stages, tma, trans, programs per SM, num_warps)
    ("cp.async S2, x^T reread, 16/SM", 2, False, False, 16, 1),
    ("cp.async S3, x^T reread, 16/SM", 3, False, False, 16, 1),
    ("cp.async S3, trans, 16/SM", 3, False, True, 16, 1),
    ("TMA S3, trans, 16/SM", 3, True, True, 16, 1),
    ("TMA S4, trans, 12/SM", 4, True, True, 12, 1),
    ("TMA S3, x^T reread, 16/SM", 3, True, False, 16, 1),
    ("TMA S3, trans, 8/SM 2 warps", 3, True, True, 8, 2),
    ("plain 1 tile/program, trans", 1, False, True, 0, 1),
]


def run(x, stages, tma, trans, per_sm, warps, sms=None):
    """The variant's ``(q_row, s_row, q_col, s_col)`` for contiguous bf16 ``x [M, K]``, as ``dual.quantize_dual``
    returns them. ``per_sm`` 0: one program per tile."""
    M, K = x.shape
    if M % BM or K % BK or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"dual_pipelined: needs a contiguous bf16 x with M % 32 == 0 and K % 64 == 0, got "
                         f"{x.dtype} {tuple(x.shape)}")
    dev = x.device
    q_row = torch.empty(M, K, dtype=torch.uint8, device=dev)
    s_row = torch.empty(K // 32, M, dtype=torch.uint8, device=dev)
    q_col = torch.empty(K, M, dtype=torch.uint8, device=dev)
    s_col = torch.empty(M // 32, K, dtype=torch.uint8, device=dev)
    n_tiles = (M // BM) * (K // BK)
    if sms is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    grid = (n_tiles if per_sm == 0 else min(n_tiles, sms * per_sm),)
    if tma and dev.type == "cuda":
        use_tma_scratch()
    _dual_pipelined[grid](x, q_row, s_row, q_col, s_col, M, K, K // BK, n_tiles, grid[0],
                          ITERS=triton.cdiv(n_tiles, grid[0]), STAGES=stages, TMA=tma, TRANS=trans, CVT=CVT_ALL,
                          num_warps=warps)
    return (q_row.view(torch.float8_e4m3fn), s_row.t(), q_col.view(torch.float8_e4m3fn), s_col.t())


def check():
    # TMA descriptors do not run under the interpreter: the pointer-load variants only
    check_persistent("dual_pipelined", [(name, lambda x, sms, cfg=cfg: run(x, *cfg, sms=sms))
                                        for name, *cfg in VARIANTS if not cfg[1]])


def sass():
    """Per variant: SASS instructions, async copies / TMA loads, shared memory traffic, registers, spills."""
    import sass_sm90

    x = torch.randn(256, 2048, dtype=torch.bfloat16)
    for name, stages, tma, trans, per_sm, warps in VARIANTS:
        launch = sass_sm90.Launch(_dual_pipelined, (1,), (x, x, x, x, x, 256, 2048, 32, 256, 132),
                                  {"ITERS": 8, "STAGES": stages, "TMA": tma, "TRANS": trans, "CVT": CVT_ALL,
                                   "num_warps": warps})
        c = sass_sm90.compile_sm90(launch)
        mem = ", ".join(f"{n} {op}" for op, n in sorted(c.memory.items()))
        extra = {k: c.counts.get(k, 0) for k in ("LDGSTS", "UTMALDG", "SYNCS", "STL", "LDSM")}
        print(f"{name}: {c.total} instructions; {mem}; {extra}; shared {c.shared} B; {c.registers} registers",
              flush=True)


def time_all():
    time_variants("module transposed", lambda x: dual.quantize_dual(x, "rceil"),
                  [(name, lambda x, cfg=cfg: run(x, *cfg)) for name, *cfg in VARIANTS], same_bytes)


if __name__ == "__main__":
    probe_main("dual_pipelined", time_all, check, sass)
