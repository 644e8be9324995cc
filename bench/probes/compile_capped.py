"""Probe: ``quantize_dual``, launched with a register cap (``dual.TRANSPOSED_MAXNREG``), eager and compiled.

Usage: ``python -m bench.probes.compile_capped`` on a GPU. Prints True per path when every output byte equals the
CPU reference (``mxfx.numerics.mx.quantize_lastdim`` of x and x^T), NaN and zero blocks included: eager, compiled with
the kernels inline (``wrap_triton`` of the one-config autotuner that carries the cap) and as the opaque
``mxfx::quantize_dual`` op, each at a second shape under ``dynamic=True``.
"""
import os, torch
from mxfx.kernels import custom_ops, device_path
from mxfx.numerics import mx as mxf
x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
x[3, 7] = float("nan"); x[64:96, 32:64] = 0
ref = (*mxf.quantize_lastdim(x.cpu(), "rceil"), *mxf.quantize_lastdim(x.cpu().t(), "rceil"))
def same(a, b):
    return all(torch.equal(p.cpu().contiguous().view(torch.uint8), q.contiguous().view(torch.uint8)) for p, q in zip(a, b))
print("eager", same(device_path.quantize_dual(x, "rceil"), ref))
for opaque in ("0", "1"):
    os.environ["MXFX_OPAQUE_KERNELS"] = opaque
    torch._dynamo.reset()
    fn = torch.compile(lambda t: [u * 1 if u.dtype != torch.float8_e4m3fn else u for u in custom_ops.quantize_dual(t * 1, "rceil")], dynamic=True)
    print("compiled opaque", opaque, same(fn(x), ref))
    x2 = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    r2 = (*mxf.quantize_lastdim(x2.cpu(), "rceil"), *mxf.quantize_lastdim(x2.cpu().t(), "rceil"))
    print("compiled opaque", opaque, "second shape", same(fn(x2), r2))
