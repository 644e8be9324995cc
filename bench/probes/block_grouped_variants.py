"""Probe: variants of the fp8_block grouped GEMM (``mxfx.kernels.fp8_block.grouped_gemm``) side by side with BF16
``torch._grouped_mm`` and the module's kernel.

Variants of one kernel body (constexpr switches), persistent over the tiles of all groups as the module's:

* ``ptr``: pointer loads, each column's weight-block scale loaded as a vector (the module's design until 2026-12-03);
* ``ptr_sb``: pointer loads, the tile inside one 128-wide weight block so its B scale is one scalar per K step,
  folded into the row scales (one FMA per accumulator value per K step instead of a multiply and an FMA);
* ``tma_sb``: ``ptr_sb`` with A and B read through TMA tensor descriptors (A rows past a group's end are read and
  never stored; B is the ``[G * N, K]`` view): the module's design since;
* ``tma_sb_skew``: ``tma_sb`` promoting step k's partial sum after issuing step k+1's MMA (two partials live);
* ``tma_sb_ws``: ``tma_sb`` with Triton's warp specialization on the K loop.

Each variant is checked against the reference decode (relative error < 1e-2) before it is timed; the best of a
few tiles per variant and shape is printed in TFLOP/s and as a ratio to BF16.

    python bench/probes/block_grouped_variants.py           # H200, about 2 minutes
    TRITON_INTERPRET=1 python bench/probes/block_grouped_variants.py check   # CPU: the variants against the reference
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mxfx.kernels.fp8_block import device_path as bq  # noqa: E402
from mxfx.kernels.fp8_block import gemm as block_gemm  # noqa: E402
from mxfx.kernels.fp8_block import grouped_gemm as block_grouped

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: the TMA variants are left out
    TensorDescriptor = None


@triton.jit
def _variant(
    a_ptr, a_desc, as_ptr, b_ptr, b_desc, bs_ptr, offs_ptr, c_ptr,
    S, N, K, G,
    s_am, s_asm, s_ask, s_bg, s_bn, s_bsg, s_bsn, s_bsk, s_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TMA: tl.constexpr, SCALAR_SB: tl.constexpr, SKEW: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    tile = pid
    seen = 0
    g = 0
    while g <= G:
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
            a_ptrs = a_ptr + rows[:, None].to(tl.int64) * s_am + ks[None, :]
            b_ptrs = b_ptr + g.to(tl.int64) * s_bg + cols[None, :].to(tl.int64) * s_bn + ks[:, None]
            as_ptrs = as_ptr + rows.to(tl.int64) * s_asm
            bs_g = bs_ptr + g.to(tl.int64) * s_bsg
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            s_prev = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for kb in tl.range(0, steps, num_stages=STAGES, warp_specialize=WS):
                if TMA:
                    a = a_desc.load([m0, kb * BLOCK_K])
                    b = b_desc.load([g * N + n0, kb * BLOCK_K]).T
                else:
                    a = tl.load(a_ptrs + kb * BLOCK_K, mask=row_ok[:, None], other=0.0)
                    b = tl.load(b_ptrs + kb * BLOCK_K, mask=col_ok[None, :], other=0.0)
                partial = tl.dot(a, b, out_dtype=tl.float32)
                sa = tl.load(as_ptrs + kb * s_ask, mask=row_ok, other=0.0)
                if SCALAR_SB:  # one weight block across the tile: a scalar, folded into the row scales
                    s = sa * tl.load(bs_g + (n0 // 128) * s_bsn + kb * s_bsk)
                    if SKEW:
                        acc += prev * s_prev[:, None]
                        prev = partial
                        s_prev = s
                    else:
                        acc += partial * s[:, None]
                else:
                    sb = tl.load(bs_g + (cols // 128) * s_bsn + kb * s_bsk, mask=col_ok, other=0.0)
                    acc += partial * (sa[:, None] * sb[None, :])
            if SKEW:
                acc += prev * s_prev[:, None]
            c_ptrs = c_ptr + rows[:, None].to(tl.int64) * s_cm + cols[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            tile += num_programs
        seen += group_tiles
        g += 1


VARIANTS = {
    "ptr": dict(TMA=False, SCALAR_SB=False, SKEW=False, WS=False),
    "ptr_sb": dict(TMA=False, SCALAR_SB=True, SKEW=False, WS=False),
    "tma_sb": dict(TMA=True, SCALAR_SB=True, SKEW=False, WS=False),
    "tma_sb_skew": dict(TMA=True, SCALAR_SB=True, SKEW=True, WS=False),
    "tma_sb_ws": dict(TMA=True, SCALAR_SB=True, SKEW=False, WS=True),
}
TILES = [  # (BLOCK_M, BLOCK_N, stages, warps, programs per SM)
    (128, 128, 4, 8, 1), (128, 128, 3, 8, 1), (64, 128, 3, 4, 2), (64, 128, 4, 4, 2), (128, 64, 4, 4, 2),
    (64, 64, 4, 4, 3),
]


def run_variant(name, tile, a, sa, b, sb, offs, sms):
    """Launch variant ``name`` with ``tile`` on contiguous K-major operands; returns the bf16 output."""
    bm, bn, stages, warps, per_sm = tile
    flags = VARIANTS[name]
    S, K = a.shape
    G, N, _ = b.shape
    out = torch.empty((S, N), dtype=torch.bfloat16, device=a.device)
    if flags["TMA"]:
        a_desc = TensorDescriptor.from_tensor(a, [bm, 128])
        b_desc = TensorDescriptor.from_tensor(b.view(G * N, K), [bn, 128])
    else:
        a_desc = b_desc = None
    tiles = (triton.cdiv(S, bm) + G) * triton.cdiv(N, bn)
    grid = (min(sms * per_sm, tiles),)
    _variant[grid](
        a, a_desc, sa, b, b_desc, sb, offs, out, S, N, K, G,
        a.stride(0), sa.stride(0), sa.stride(1), b.stride(0), b.stride(1), sb.stride(0), sb.stride(1), sb.stride(2),
        out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, STAGES=stages, num_warps=warps, **flags,
    )
    return out


def operands(s, e, k, n, sizes, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(s, k, device=dev, generator=g).bfloat16()
    w = (torch.randn(e, n, k, device=dev, generator=g) * 0.02).bfloat16()
    aq, sa = bq.quantize_1x128(x)
    wq, ws = bq.quantize_128x128(w)
    return x, w, offs, (aq, sa, wq, ws)


def check() -> None:
    """Interpreter: every variant equals the reference decode within bf16 rounding, unequal and empty groups."""
    sizes = [40, 0, 130, 86]
    x, w, offs, ops = operands(256, 4, 256, 256, sizes, "cpu")
    ref = block_gemm.reference_grouped_mm(*ops, offs, torch.float32)
    for name, flags in VARIANTS.items():
        if flags["TMA"] and TensorDescriptor is None or flags["WS"]:
            continue
        for sms in (1, 3):
            out = run_variant(name, (32, 64, 1, 4, 1), *ops, offs, sms)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            print(f"{name} sms={sms}: rel err {err:.2e}")
            assert err < 1e-2, name


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def time_all() -> None:
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [  # (label, S, experts, K, N, equal)
        ("OLMoE gate_up 64x1024 2048->2048", 65536, 64, 2048, 2048, True),
        ("OLMoE down 64x1024 1024->2048", 65536, 64, 1024, 2048, True),
        ("OLMoE gate_up unequal 2048->2048", 65536, 64, 2048, 2048, False),
        ("Qwen3 gate_up 128x512 2048->1536", 65536, 128, 2048, 1536, True),
        ("Qwen3 down 128x512 768->2048", 65536, 128, 768, 2048, True),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for label, s, e, k, n, equal in cases:
        if equal:
            sizes = [s // e] * e
        else:
            gen = torch.Generator().manual_seed(7)
            wts = torch.rand(e, generator=gen) ** 3
            wts[torch.randperm(e, generator=gen)[: e // 8]] = 0.0
            sz = (wts / wts.sum() * s).floor().long()
            sz[int(wts.argmax())] += s - int(sz.sum())
            sizes = sz.tolist()
        x, w, offs, ops = operands(s, e, k, n, sizes, dev)
        ref = block_gemm.reference_grouped_mm(*ops, offs, torch.float32) if e <= 64 else None
        flops = 2 * s * k * n
        t_bf16 = bench(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))
        line = [f"{label}: bf16 {flops / t_bf16 / 1e9:.0f} TFLOP/s"]
        block_grouped.grouped_mm(*ops, offs)
        t_mod = bench(lambda: block_grouped.grouped_mm(*ops, offs))
        line.append(f"module {flops / t_mod / 1e9:.0f} ({t_bf16 / t_mod:.2f}x)")
        for name, flags in VARIANTS.items():
            if flags["TMA"] and TensorDescriptor is None:
                continue
            best = None
            for tile in TILES:
                if flags["SCALAR_SB"] and 128 % tile[1]:
                    continue
                try:
                    out = run_variant(name, tile, *ops, offs, sms)
                    if ref is not None:
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        if not err < 1e-2:
                            print(f"  {name} {tile}: WRONG rel err {err:.2e}")
                            continue
                    t = bench(lambda: run_variant(name, tile, *ops, offs, sms))
                except Exception as exc:  # a tile that does not compile (registers, shared memory) is skipped
                    print(f"  {name} {tile}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                    continue
                if best is None or t < best[0]:
                    best = (t, tile)
            if best:
                line.append(f"{name} {flops / best[0] / 1e9:.0f} ({t_bf16 / best[0]:.2f}x, {best[1]})")
        print("\n  ".join(line), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["check"]:
        check()
    else:
        time_all()
