"""Probe: run one routed-expert GEMM kernel a few times at one model's shape, for Nsight Compute to profile (``ncu``).

    ncu --clock-control none --set full -k regex:^_grouped_kernel --launch-skip 2 --launch-count 1 \
        python -m bench.probes.ncu_gemms forward mixtral

CASE (:data:`CASES`) is the grouped fp8_block forward or dgrad on the warp-specialized sm90 kernel, the Triton
grouped kernel beside it, the routed BF16 wgrad into an FP32 gradient on the Triton or the sm90 ping-pong kernel, or
torch's BF16 grouped GEMM (the reference rate); MODEL one of ``bench/gemm.py``'s, at its gate/up projection
(``--down``: the down projection), 16,384 tokens routed top-k in equal groups as ``bench/gemm.py`` times them.
Each case launches its kernels :data:`CALLS` times so that the profiler can skip the compile and a warm call.
"""

from __future__ import annotations

import argparse

import torch

from bench.gemm import MODELS, wgrad_into_shape
from mxfx.kernels.common import grouped_wgrad_sm90, grouped_wgrad_triton
from mxfx.kernels.fp8_block import device_path as bq
from mxfx.kernels.fp8_block import grouped_gemm_sm90, grouped_gemm_triton

CALLS = 4
TOKENS = 16384


def _offs(s: int, e: int) -> torch.Tensor:
    return torch.full((e,), s // e, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)


def _block_operands(s: int, e: int, k: int, n: int, dgrad: bool) -> tuple:
    """``(a, a_scales, b, b_scales)`` of the forward ``x [S, K] @ W[e]^T`` or the dgrad ``dy [S, N] @ W[e]``."""
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, ws = bq.quantize_128x128(w)
    if dgrad:
        a = torch.randn(s, n, device="cuda", dtype=torch.bfloat16)
        return (*bq.quantize_1x128(a), wq.transpose(1, 2).contiguous(), ws.transpose(1, 2).contiguous())
    return (*bq.quantize_1x128(torch.randn(s, k, device="cuda", dtype=torch.bfloat16)), wq, ws)


def _grouped(module, dgrad: bool):
    def case(s, e, k, n):
        ops, offs = _block_operands(s, e, k, n, dgrad), _offs(s, e)
        return lambda: module.grouped_mm(*ops, offs)

    return case


def _wgrad(module):
    def case(s, e, k, n):
        s, e = wgrad_into_shape(s, e, n, k)
        dy = torch.randn(s, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(s, k, device="cuda", dtype=torch.bfloat16)
        grad, offs = torch.zeros(e, n, k, device="cuda"), _offs(s, e)
        return lambda: module.grouped_wgrad_into(dy, x, offs, grad, True)

    return case


def _bf16_forward(s, e, k, n):
    x = torch.randn(s, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    offs = _offs(s, e)
    return lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)


CASES = {
    "forward": _grouped(grouped_gemm_sm90, False),
    "dgrad": _grouped(grouped_gemm_sm90, True),
    "forward-triton": _grouped(grouped_gemm_triton, False),
    "wgrad-triton": _wgrad(grouped_wgrad_triton),
    "wgrad-sm90": _wgrad(grouped_wgrad_sm90),
    "bf16-forward": _bf16_forward,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("--down", action="store_true", help="the down projection (K = the expert width)")
    args = p.parse_args()
    d, h, experts, topk = MODELS[args.model]
    k, n = (h, d) if args.down else (d, 2 * h)
    fn = CASES[args.case](TOKENS * topk, experts, k, n)
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    print(f"{args.case} {args.model} {k}->{n}: {CALLS} calls")


if __name__ == "__main__":
    main()
