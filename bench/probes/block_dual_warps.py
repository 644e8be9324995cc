"""The fp8_block dual quantize (both 1x128 tilings of ``x [T, K]`` from one read) at several warp counts, one run.

Compiled for sm90 a 128 x 128 tile takes 171 registers a thread at 8 warps (one program an SM) and 99 at 16; the
kernel is memory-bound, so how many warps an SM keeps in flight may be what bounds it. Each count's bytes are first
checked equal to the default's; times are ``triton.testing.do_bench`` medians, GB/s count bytes read + written.

    python bench/probes/block_dual_warps.py [--warps 4,8,16] [--shapes 8192x2048,65536x2048]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mxfx.kernels.fp8_block import quantize as bq  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warps", default="4,8,16")
    p.add_argument("--shapes", default="8192x2048,65536x2048,16384x4096")
    args = p.parse_args()
    warps = [int(w) for w in args.warps.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| shape | " + " | ".join(f"{w} warps us (GB/s)" for w in warps) + " |")
    print("|---|" + "---:|" * len(warps))
    for shape in args.shapes.split(","):
        t, k = (int(v) for v in shape.split("x"))
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * t * k + 2 * (t * k + 4 * t * k // 128)  # bf16 in; two E4M3 payloads and FP32 scales out
        want = bq.quantize_1x128_dual(x)
        cells = []
        for w in warps:
            got = bq.quantize_1x128_dual(x, warps=w)
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[::2], want[::2]))
            assert all(torch.equal(a, b) for a, b in zip(got[1::2], want[1::2])), w
            ms = triton.testing.do_bench(lambda w=w: bq.quantize_1x128_dual(x, warps=w), return_mode="median")
            cells.append(f"{ms * 1e3:.1f} ({nbytes / ms / 1e6:.0f})")
        print(f"| {t}x{k} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
