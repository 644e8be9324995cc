"""The fp8_block routed wgrad (into the FP32 gradient, accumulate on) at several launch configurations, beside BF16.

Per routed shape of a step (``--tokens`` tokens routed top-k, equal groups): the BF16 wgrad-into kernel the step
runs today, the two grouped-tokens quantizes the FP8 wgrad needs (dY and x, 1x128 along each group's tokens),
the FP8 Triton kernel at each ``(BLOCK_N, BLOCK_K, num_stages, num_warps)`` and the warp-specialized sm90 kernel
(``MXFX_BLOCK_WGRAD_SM90``); each first checked against the reference decode on 4 groups.
``triton.testing.do_bench`` medians; TFLOP/s count the GEMM alone.

    python bench/probes/block_wgrad_configs.py [--models olmoe,qwen3] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.gemm import MODELS  # noqa: E402
from mxfx.kernels.common import grouped_wgrad_triton  # noqa: E402
from mxfx.kernels.fp8_block import device_path, gemm as block_gemm, grouped_gemm_triton  # noqa: E402

CONFIGS = [(128, 128, 3, 8), (128, 128, 4, 8), (128, 64, 3, 4), (128, 64, 4, 4), (64, 128, 3, 4)]  # sm90: no spills


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="olmoe,qwen3")
    p.add_argument("--tokens", type=int, default=8192)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    sm90 = block_gemm._wgrad_sm90_kernel()  # the warp-specialized kernel (opt-in in the library), where Gluon is
    names = ["BF16 into", "quantize dY + x", *("fp8 {}x{} s{} w{}".format(*c) for c in CONFIGS), "fp8 sm90 WS"]
    header, cells = [], {n: [] for n in names}
    for model in args.models.split(","):
        d, h, e, topk = MODELS[model]
        s = args.tokens * topk
        for k, n in ((d, 2 * h), (h, d)):  # gate/up (d -> 2h) and down (h -> d)
            header.append(f"{model} {k}->{n} ({e}x{s // e})")
            offs = torch.full((e,), s // e, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)
            dy = torch.randn(s, n, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(s, k, device="cuda", dtype=torch.bfloat16)
            grad = torch.zeros(e, n, k, device="cuda")
            flops = 2 * s * n * k

            def ms(fn) -> float:
                return triton.testing.do_bench(fn, return_mode="median")

            t = ms(lambda: grouped_wgrad_triton.grouped_wgrad_into(dy, x, offs, grad, True))
            cells["BF16 into"].append(f"{t:.3f} ({flops / t / 1e9:.0f})")

            def quantize():
                return (
                    *device_path.quantize_1x128_grouped_tokens(dy, offs),
                    *device_path.quantize_1x128_grouped_tokens(x, offs),
                )

            cells["quantize dY + x"].append(f"{ms(quantize):.3f}")
            ops = quantize()
            ref = block_gemm.reference_grouped_wgrad(*ops, offs[:4], torch.float32)
            for cfg, name in zip(CONFIGS, names[2:]):
                try:
                    got = grouped_gemm_triton.grouped_wgrad(*ops, offs, torch.float32, config=cfg)[:4]
                    err = ((got - ref).norm() / ref.norm()).item()
                    if not err < 1e-3:  # the reference sums each group in another order
                        raise RuntimeError(f"relative error {err:.2e} against the reference decode")
                    t = ms(
                        lambda cfg=cfg: grouped_gemm_triton.grouped_wgrad(
                            *ops, offs, out=grad, accumulate=True, config=cfg
                        )
                    )
                    cells[name].append(f"{t:.3f} ({flops / t / 1e9:.0f})")
                except Exception as exc:  # noqa: BLE001 (a configuration the GPU refuses is reported, not fatal)
                    print(f"{name} at {header[-1]}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    cells[name].append("-")
            try:
                if sm90 is None:
                    raise RuntimeError("this Triton has no Gluon Hopper API")
                got = sm90.grouped_wgrad(*ops, offs, torch.empty_like(grad), accumulate=False)[:4]
                err = ((got - ref).norm() / ref.norm()).item()
                if not err < 1e-3:
                    raise RuntimeError(f"relative error {err:.2e} against the reference decode")
                t = ms(lambda: sm90.grouped_wgrad(*ops, offs, grad, accumulate=True))
                cells["fp8 sm90 WS"].append(f"{t:.3f} ({flops / t / 1e9:.0f})")
            except Exception as exc:  # noqa: BLE001 (reported, not fatal: the other rows still print)
                print(f"fp8 sm90 WS at {header[-1]}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                cells["fp8 sm90 WS"].append("-")
            print(f"{header[-1]}: {flops / 1e12:.2f} TFLOP per call", flush=True)
            dy = x = grad = ops = None  # freed before the next shape
            torch.cuda.empty_cache()
    print("| ms (TFLOP/s) | " + " | ".join(header) + " |")
    print("|---|" + "---:|" * len(header))
    for name in names:
        print(f"| {name} | " + " | ".join(cells[name]) + " |")


if __name__ == "__main__":
    main()
