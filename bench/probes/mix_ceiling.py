"""Probe: what pure streaming reaches on this GPU for each kernel's mix of bytes read and written.

Usage: ``python bench/probes/mix_ceiling.py`` (CUDA).

The benchmark rates every kernel against one 2 GiB copy (read and write in equal parts). A kernel that writes three
bytes for each one it reads meets a different memory system: HBM turns the bus around between reads and writes, and
write-heavy traffic moves less per second. Here a Triton kernel with no arithmetic streams one input (flat, 16-byte
accesses, each byte read once) into the outputs of each mix, at the benchmark's element counts, and its best tile
over a few is reported as % of the same copy, bytes counted as ``bench/kernels.py`` counts them (scales aside).
A kernel at or near its mix's figure is bound by the memory system, not by its code.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MIXES = [  # (name, input dtype, 16-bit outputs, byte outputs): the kernels whose traffic each mix copies
    ("copy: bf16 -> bf16 (1:1)", torch.bfloat16, 1, 0),
    ("rowwise / blocked / route: bf16 -> 1 B (2:1)", torch.bfloat16, 0, 1),
    ("dual passes: bf16 -> 2 x 1 B (1:1)", torch.bfloat16, 0, 2),
    ("quantize-dequantize: bf16 -> 1 B + bf16 (2:3)", torch.bfloat16, 1, 1),
    ("dual + both dequantized: bf16 -> 2 x 1 B + 2 x bf16 (1:3)", torch.bfloat16, 2, 2),
    ("fp32 refresh: fp32 -> 2 x 1 B + 2 x bf16 (2:3)", torch.float32, 2, 2),
    ("SwiGLU saved pairs: fp32 (gate + up) -> 3 x 1 B (4:3)", torch.float32, 0, 3),
]
TILES = [(2048, 4), (4096, 4), (4096, 8), (8192, 8)]  # (values per program, warps)


@triton.jit
def _stream(x_ptr, h0, h1, q0, q1, q2, H: tl.constexpr, Q: tl.constexpr, BLOCK: tl.constexpr):
    """Read ``x`` once; write H 16-bit and Q byte outputs of the same length (a value's bf16 and its high byte)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs).to(tl.float32)
    if H >= 1:
        tl.store(h0 + offs, v.to(tl.bfloat16))
    if H >= 2:
        tl.store(h1 + offs, (-v).to(tl.bfloat16))
    q = (v.to(tl.int32, bitcast=True) >> 24).to(tl.uint8)
    if Q >= 1:
        tl.store(q0 + offs, q)
    if Q >= 2:
        tl.store(q1 + offs, q ^ 1)
    if Q >= 3:
        tl.store(q2 + offs, q ^ 2)


def main():
    from kernels import SHAPES, copy_bandwidth, median_ms

    copy_gbs = copy_bandwidth()
    print(f"copy {copy_gbs:.0f} GB/s\n| mix | elements | best % of copy | (values, warps) |\n|---|---|---|---|")
    for name, dtype, h, q in MIXES:
        for m, k in SHAPES:
            n = m * k
            x = torch.randn(n, device="cuda", dtype=dtype)
            hs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(h)]
            qs = [torch.empty(n, device="cuda", dtype=torch.uint8) for _ in range(q)]
            outs = (hs + [x] * 2)[:2] + (qs + [x] * 3)[:3]  # absent outputs: the input as a placeholder pointer
            nbytes = n * (x.element_size() + 2 * h + q)
            best = (0.0, None)
            for block, warps in TILES:
                def call(block=block, warps=warps):
                    _stream[(n // block,)](x, *outs, H=h, Q=q, BLOCK=block, num_warps=warps)
                call()
                if h and not torch.equal(hs[0], x.to(torch.bfloat16)):
                    raise AssertionError(f"mix_ceiling: {name} wrote wrong values")
                pct = 100 * nbytes / median_ms(call) / 1e6 / copy_gbs
                best = max(best, (pct, (block, warps)), key=lambda t: t[0])
            print(f"| {name} | {m}x{k} | {best[0]:.1f}% | {best[1]} |", flush=True)
            del x, hs, qs, outs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("mix_ceiling: needs a CUDA GPU")
    main()
