"""Probe: run one MX kernel a few times at one shape, for Nsight Compute to profile (``ncu``).

Usage: ``ncu --clock-control none --set full -k regex:^_ --launch-skip 2 --launch-count 1
python bench/probes/ncu_cases.py CASE M K`` with CASE one of :data:`CASES`. The kernels run exactly
as ``bench/kernels.py`` times them; this script only gives each a name and a fixed call count, so that
the profiler sees the third launch (after compilation and one warm call).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mxfx.kernels import dispatch  # noqa: E402

CASES = {
    "dual": lambda x: dispatch.quantize_dual(x, "rceil"),
    "dual_source": lambda x: dispatch.quantize_dual_source(x, "rceil"),
    "dual_blocked": lambda x: dispatch.quantize_dual_blocked(x, "rceil"),
    "dual_hat": lambda x: dispatch.quantize_dual_source(x, "rceil", dequantized=torch.bfloat16),
    "columnwise": lambda x: dispatch.quantize_lastdim(x.t(), "rceil"),
    "blocked": lambda x: dispatch.quantize_blocked(x, "rceil"),
    "rowwise": lambda x: dispatch.quantize_lastdim(x, "rceil"),
}


def main() -> None:
    case, m, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if case == "refresh":  # the fp32 main weight: converted once, outside the profiled launches
        x = x.float()
        fn = lambda t: dispatch.quantize_dual_source(t, "rceil", dequantized=torch.bfloat16)  # noqa: E731
    else:
        fn = CASES[case]
    for _ in range(4):
        fn(x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
