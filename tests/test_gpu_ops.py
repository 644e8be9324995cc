"""MX autograd ops on CUDA (Triton kernels, Hopper emulated GEMMs) against the same ops on CPU.

Both devices quantize bit-identically; the GEMMs differ only in summation order and in
the emulation dtype (bf16 on CUDA, fp32 on CPU), hence the bf16-level tolerances.
"""

import pytest
import torch

from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(fn, tensors, device):
    leaves = [t.detach().to(device).requires_grad_(t.requires_grad) if t is not None else None for t in tensors]
    out = fn(*leaves)
    out.float().square().sum().backward()
    return [out.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves if t is not None and t.requires_grad]


def _close(a, b):
    # A value sitting on an E4M3 rounding boundary may flip by one ulp (12.5%) between the bf16
    # (CUDA) and fp32 (CPU) emulation paths; compare whole tensors by relative norm.
    for x, y in zip(a, b):
        assert ((x - y).norm() / y.norm()).item() < 1e-2


@cuda
@pytest.mark.parametrize("wgrad", ["mxfp8", "bf16"])
def test_linear_cuda_matches_cpu(wgrad):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 256, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(512, 256, generator=g) * 0.05).requires_grad_()
    b = torch.randn(512, generator=g).requires_grad_()
    fn = lambda x, w, b: mx_linear(x, w, b, wgrad=wgrad)  # noqa: E731
    _close(_run(fn, (x, w, b), "cuda"), _run(fn, (x, w, b), "cpu"))


@cuda
@pytest.mark.parametrize("swiglu,wgrad", [(False, "bf16"), (True, "bf16"), (True, "mxfp8")])
def test_grouped_cuda_matches_cpu(swiglu, wgrad):
    g = torch.Generator().manual_seed(0)
    sizes = [70, 0, 33, 150, 3]  # not multiples of 8: CUDA's grouped GEMM alignment must be handled
    s, k, n = sum(sizes), 128, 256
    x = torch.randn(s, k, generator=g).bfloat16().requires_grad_()
    up = torch.randn(s, k, generator=g).bfloat16().requires_grad_() if swiglu else None
    w = (torch.randn(len(sizes), n, k, generator=g) * 0.05).requires_grad_()
    rw = torch.rand(s, 1, generator=g).bfloat16().requires_grad_()
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)

    def fn(x, up, w, rw):
        return mx_grouped_mm_op(x, w, offs.to(x.device), up=up, route_weight=rw, wgrad=wgrad)

    _close(_run(fn, (x, up, w, rw), "cuda"), _run(fn, (x, up, w, rw), "cpu"))
