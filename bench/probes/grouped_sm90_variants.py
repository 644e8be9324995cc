"""Tile, band, stage and epilogue variants of the sm90 warp-specialized grouped fp8_block GEMM, one run.

For each routed-expert shape (rows = 16384 tokens x top-k, equal and skewed groups), forward: BF16
``torch._grouped_mm``, the Triton kernel (``mxfx.kernels.fp8_block.grouped_gemm_triton``, tuned) and each variant of
``mxfx.kernels.fp8_block.grouped_gemm_sm90``, each first checked against the reference decode on a few groups.
Times are ``triton.testing.do_bench`` medians; TFLOP/s count 2 S K N.

    python bench/probes/grouped_sm90_variants.py [--shapes olmoe,mixtral] [--variants narrow,wide]
    python bench/probes/grouped_sm90_variants.py --variants narrow,wide --out-dtype float32
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.gemm import group_sizes  # noqa: E402
from mxfx.kernels.fp8_block import device_path as bq  # noqa: E402
from mxfx.kernels.fp8_block import gemm as block_gemm  # noqa: E402
from mxfx.kernels.fp8_block import grouped_gemm_triton, grouped_gemm_sm90  # noqa: E402

SHAPES = {  # name: (rows, groups, K, N): forward of gate/up (d -> 2h) and down (h -> d)
    "olmoe": [(131072, 64, 2048, 2048), (131072, 64, 1024, 2048)],
    "qwen3": [(131072, 128, 2048, 1536), (131072, 128, 768, 2048)],
    "mixtral": [(32768, 8, 4096, 28672), (32768, 8, 14336, 4096)],
    "deepseek": [(131072, 256, 7168, 4096), (131072, 256, 2048, 7168)],
}

VARIANTS = {  # each over grouped_gemm_sm90.CONFIG; "default": the configuration the kernel picks for the shape
    "default": None,
    "narrow": {"BLOCK_N": 128},
    "band8": {"BAND": 8},
    "band16": {"BAND": 16},
    "stages4": {"STAGES": 4},
    "no_tma_store": {"EPI_TMA": False},
    "wide": {"BLOCK_N": 256},
    "wide_epi2": {"BLOCK_N": 256, "EPI_BUFS": 2},  # an output buffer per half: no wait between the halves' stores
    "wide_band16": {"BLOCK_N": 256, "BAND": 16},
}


def check(out, a, sa, b, sb, offs, groups=4) -> float:
    """Relative error of ``out`` against the reference decode on the first ``groups`` non-empty groups and the
    rows past ``offs[-1]`` (zeros)."""
    ends = offs.tolist()
    errs, start, seen = [], 0, 0
    for g, end in enumerate(ends):
        if end > start and seen < groups:
            ref = block_gemm.reference_grouped_mm(
                a[start:end],
                sa[start:end],
                b[g : g + 1],
                sb[g : g + 1],
                torch.tensor([end - start], dtype=torch.int32, device=a.device),
                torch.float32,
            )
            errs.append(((out[start:end].float() - ref).norm() / ref.norm()).item())
            seen += 1
        start = end
    tail = out[ends[-1] :]
    assert tail.numel() == 0 or bool((tail == 0).all()), "rows past offs[-1] are not zeros"
    return max(errs)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out-dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the FP8 kernels' output")
    args = p.parse_args()
    out_dtype = getattr(torch, args.out_dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| shape | groups | bf16 | triton | " + " | ".join(args.variants.split(",")) + " | (TFLOP/s; max rel. err) |")
    for model in args.shapes.split(","):
        for s, e, k, n in SHAPES[model]:
            for equal in (True, False):
                sizes = group_sizes(s - 64, e, equal, torch.Generator().manual_seed(7))  # 64 tail rows
                offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
                x = torch.randn(s, k, device="cuda", generator=g).bfloat16()
                w = (torch.randn(e, n, k, device="cuda", generator=g) * 0.02).bfloat16()
                a, sa = bq.quantize_1x128(x)
                b, sb = bq.quantize_128x128(w)
                flops = 2 * s * k * n
                cells, errs = [], []
                fns = {
                    "bf16": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
                    "triton": lambda: grouped_gemm_triton.grouped_mm(a, sa, b, sb, offs, out_dtype),
                }
                for v in args.variants.split(","):
                    cfg = (
                        grouped_gemm_sm90.config_for(n)
                        if VARIANTS[v] is None
                        else {**grouped_gemm_sm90.CONFIG, **VARIANTS[v]}
                    )
                    fns[v] = lambda cfg=cfg: grouped_gemm_sm90.grouped_mm(a, sa, b, sb, offs, out_dtype, config=cfg)
                for name, fn in fns.items():
                    out = fn()
                    if name != "bf16":
                        errs.append(check(out, a, sa, b, sb, offs))
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    cells.append(f"{flops / ms / 1e9:.0f}")
                kind = "equal" if equal else "skewed"
                print(f"| {model} {k}->{n} | {kind} | " + " | ".join(cells) + f" | {max(errs):.1e} |", flush=True)
                x = w = a = b = None  # freed before the next shape
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
