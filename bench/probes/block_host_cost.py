"""Probe: host time per call of the fp8_block ops, as custom ops and as their bodies (CUDA).

Each case is called ``--calls`` times on small operands (the GPU finishes each kernel long before the host issues
the next), timed on the host without synchronizing, then once more to the end of the GPU work; the host figure is
microseconds per call. What it answers: how much of a host-bound compiled step an opaque ``mxfx::block_*`` op
costs beside the launch of its kernel alone.

    python bench/probes/block_host_cost.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from triton.tools.tensor_descriptor import TensorDescriptor

from mxfx.kernels import block_gemm, block_grouped, block_ops, block_quantize


def _host_us(fn, calls: int) -> tuple[float, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    dev = "cuda"
    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
    up = torch.randn_like(x)
    w = torch.randn(1024, 1024, device=dev)
    we = torch.randn(8, 1024, 1024, device=dev)
    xq, xs = block_quantize.quantize_1x128(x)
    wq, ws = block_quantize.quantize_128x128(w)
    weq, wes = block_quantize.quantize_128x128(we)
    offs = torch.tensor([32, 64, 96, 128, 160, 192, 224, 256], dtype=torch.int32, device=dev)
    kt = ws.shape[1]
    padded = ws.new_zeros(ws.shape[0], -(-kt // 4) * 4)
    padded[:, :kt] = ws
    xbf, wbf = x, w.bfloat16()
    cases = {
        "torch.mm bf16 (reference)": lambda: torch.mm(xbf, wbf.t()),
        "torch.empty": lambda: torch.empty(256, 1024, device=dev),
        "op block_quantize": lambda: block_ops.block_quantize(x, "rceil"),
        "body quantize_1x128 (Triton launch)": lambda: block_quantize.quantize_1x128(x),
        "op block_forward_operands(swiglu, pack)": lambda: block_ops.block_forward_operands(x, up, None, None, "rceil", True),
        "op block_forward_operands(x, tokens)": lambda: block_ops.block_forward_operands(x, None, x, None, "rceil", False),
        "op block_mm": lambda: block_ops.block_mm(xq, xs, wq, ws, torch.bfloat16),
        "body block_gemm.scaled_mm": lambda: block_gemm.scaled_mm(xq, xs, wq, ws, torch.bfloat16),
        "F.scaled_mm alone": lambda: F.scaled_mm(xq, wq.t(), xs, F.ScalingType.BlockWise1x128, padded.t(),
                                                 F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
        "op block_grouped_mm": lambda: block_ops.block_grouped_mm(xq, xs, weq, wes, offs, torch.bfloat16),
        "body block_grouped.grouped_mm (autotuned)": lambda: block_grouped.grouped_mm(xq, xs, weq, wes, offs),
        "body block_grouped.grouped_mm (one config)": lambda: block_grouped.grouped_mm(
            xq, xs, weq, wes, offs, config={"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4}),
        "TensorDescriptor.from_tensor": lambda: TensorDescriptor.from_tensor(xq, [128, 128]),
    }
    print(f"{'case':48s} {'host us/call':>12s} {'to GPU end':>12s}")
    for name, fn in cases.items():
        host, total = _host_us(fn, args.calls)
        print(f"{name:48s} {host:12.1f} {total:12.1f}")


if __name__ == "__main__":
    main()
