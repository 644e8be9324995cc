"""Probe: run one MX kernel a few times at one shape, for Nsight Compute to profile (``ncu``).

Usage: ``ncu --clock-control none --set full -k regex:^_ --launch-skip 2 --launch-count 1
python -m bench.probes.ncu_cases CASE M K`` with CASE one of :data:`CASES`. The kernels run exactly
as ``bench/mx_kernels.py`` times them; this script only gives each a name and a fixed call count, so that
the profiler sees the third launch (after compilation and one warm call).
"""

from __future__ import annotations

import os
import sys

import torch


from mxfx.kernels import device_path

_DUAL_HAT = lambda x: device_path.quantize_dual_source(x, "rceil", dequantized=torch.bfloat16)  # noqa: E731
CASES = {  # name: (fn, input dtype)
    "dual": (lambda x: device_path.quantize_dual(x, "rceil"), torch.bfloat16),
    "dual_source": (lambda x: device_path.quantize_dual_source(x, "rceil"), torch.bfloat16),
    "dual_blocked": (lambda x: device_path.quantize_dual_blocked(x, "rceil"), torch.bfloat16),
    "dual_hat": (_DUAL_HAT, torch.bfloat16),
    "refresh": (_DUAL_HAT, torch.float32),  # the fp32 main weight
    "columnwise": (lambda x: device_path.quantize_lastdim(x.t(), "rceil"), torch.bfloat16),
    "blocked": (lambda x: device_path.quantize_blocked(x, "rceil"), torch.bfloat16),
    "rowwise": (lambda x: device_path.quantize_lastdim(x, "rceil"), torch.bfloat16),
}


def main() -> None:
    case, m, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fn, dtype = CASES[case]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    for _ in range(4):
        fn(x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
