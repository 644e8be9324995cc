"""Probe: launch configurations of the grouped wgrad with the FP32 epilogue (``grouped_wgrad_into``, accumulate on).

Times every configuration of :data:`CONFIGS` at the routed wgrad shapes of ``bench/gemm.py``'s models (equal groups,
16,384 tokens routed top-k, at most 2^32 gradient elements as there) beside the BF16 grouped GEMM alone and the three
trips it replaces (BF16 GEMM, widening, add), each configuration checked against an FP32 product on 4 groups.
Prints one table: ms per configuration and shape, the fastest marked. Needs an sm90 GPU.

    python -m bench.probes.grouped_wgrad_into_configs [--models olmoe,qwen3,mixtral,deepseek]
        [--configs all|default] [--variants library,vector-load,vector-red,tma-load,tma-red]

``--variants``: the kernel's mainloop (vector loads or TMA boxes) and accumulating epilogue (a read beside the
accumulator and a store, or vector ``red.add``), each timed at every configuration; ``library`` (the default) is
the library's own choice of both. ``--configs default``: only the two launches the library chooses between
(``CONFIG``, ``LONG_GROUPS_CONFIG``).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton

from bench.gemm import MODELS, wgrad_into_shape
from mxfx.kernels.common import grouped_wgrad_triton

CONFIGS = [
    {"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_T": bt, "num_warps": w, "num_stages": st}
    for (bn, bk), bt, w, st in itertools.product(((128, 128), (128, 256), (256, 128)), (64, 128), (4, 8), (3, 4))
    if not (bn * bk == 2**15 and w == 4)  # a 256x128 FP32 accumulator in 128 threads spills
    and (bn + bk) * bt * 2 * st <= 200 * 1024  # shared memory of the staged operand tiles
]
VARIANTS = {  # name: grouped_wgrad_into's (tma, red)
    "library": (None, True),
    "vector-load": (False, False),
    "vector-red": (False, True),
    "tma-load": (True, False),
    "tma-red": (True, True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="olmoe,qwen3,deepseek")
    p.add_argument("--configs", default="all", choices=["all", "default"])
    p.add_argument("--variants", default="library", help=f"comma list of {', '.join(VARIANTS)}")
    args = p.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        p.error(f"--variants: unknown {sorted(set(variants) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    configs = (
        CONFIGS if args.configs == "all" else [grouped_wgrad_triton.CONFIG, grouped_wgrad_triton.LONG_GROUPS_CONFIG]
    )
    torch.manual_seed(0)
    header = ["config"]
    results: dict[str, list[float | None]] = {}
    for model in args.models.split(","):
        d, h, experts, topk = MODELS[model]
        for k, n in ((d, 2 * h), (h, d)):
            s, e = wgrad_into_shape(16384 * topk, experts, n, k)
            header.append(f"{model} {k}->{n} ({e}x{s // e})")
            offs = torch.full((e,), s // e, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)
            dy = torch.randn(s, n, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(s, k, device="cuda", dtype=torch.bfloat16)
            grad = torch.randn(e, n, k, device="cuda")
            first = grad[:4].clone()
            rows = s // e
            ref = torch.stack(
                [
                    first[i] + dy[i * rows : (i + 1) * rows].float().t() @ x[i * rows : (i + 1) * rows].float()
                    for i in range(4)
                ]
            )
            flops = 2 * s * n * k
            base = {
                "BF16 GEMM alone": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
                "three trips": lambda: grad.add_(torch._grouped_mm(dy.t(), x, offs=offs).float()),
            }
            for name, fn in base.items():
                results.setdefault(name, []).append(triton.testing.do_bench(fn, return_mode="median"))
            for cfg, variant in itertools.product(configs, variants):
                name = "{BLOCK_N}x{BLOCK_K}x{BLOCK_T} w{num_warps} s{num_stages}".format(**cfg) + f" {variant}"
                tma, red = VARIANTS[variant]
                run = functools.partial(grouped_wgrad_triton.grouped_wgrad_into, config=cfg, tma=tma, red=red)
                try:
                    grad[:4].copy_(first)
                    run(dy, x, offs, grad, True)
                    err = ((grad[:4] - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        raise RuntimeError(f"relative error {err:.2e}")
                    t = triton.testing.do_bench(lambda run=run: run(dy, x, offs, grad, True), return_mode="median")
                except Exception as exc:  # noqa: BLE001 (a configuration the GPU refuses is reported, not fatal)
                    print(f"{name} at {header[-1]}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    t = None
                results.setdefault(name, []).append(t)
            print(f"{header[-1]}: {flops / 1e12:.2f} TFLOP per call", flush=True)
            dy = x = grad = None  # freed before the next shape
            torch.cuda.empty_cache()
    cols = len(header) - 1
    best = [
        min((r[i] for name, r in results.items() if "x" in name[:4] and r[i] is not None), default=None)
        for i in range(cols)
    ]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name, times in results.items():
        cells = [("n/a" if t is None else f"{t:.3f}" + (" *" if t == best[i] else "")) for i, t in enumerate(times)]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
