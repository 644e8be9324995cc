"""Probe: can CUDA ``torch._grouped_mm`` write the routed wgrad straight in fp32 (``out_dtype``)?

A BF16 result converted to the FP32 main weight's dtype afterwards costs a full extra pass over
[E, N, K]. Prints whether the call is accepted, its error against the BF16-then-convert path, and both times.
"""

import torch
import triton

torch.manual_seed(0)
e, s, n, k = 64, 32768, 2048, 2048
sizes = torch.multinomial(torch.ones(e), s, replacement=True).bincount(minlength=e)
offs = sizes.cumsum(0).to(torch.int32).cuda()
dy = torch.randn(s, n, device="cuda", dtype=torch.bfloat16)
x = torch.randn(s, k, device="cuda", dtype=torch.bfloat16)
ref = lambda: torch._grouped_mm(dy.t(), x, offs=offs).to(torch.float32)  # noqa: E731
r = ref()
try:
    fp32 = lambda: torch._grouped_mm(dy.t(), x, offs=offs, out_dtype=torch.float32)  # noqa: E731
    o = fp32()
    print("out_dtype=float32 accepted:", o.dtype, "rel diff vs bf16-then-convert", ((o - r).norm() / r.norm()).item())
    print(
        f"bf16+convert {triton.testing.do_bench(ref, return_mode='median'):.3f} ms, "
        f"fp32 out {triton.testing.do_bench(fp32, return_mode='median'):.3f} ms"
    )
except Exception as err:  # noqa: BLE001
    print("out_dtype=float32 refused:", type(err).__name__, str(err)[:200])
