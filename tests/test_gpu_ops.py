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
    # A fixed cotangent, identical on both devices: a loss like out.square() would hand each device a
    # gradient that already differs at bf16 level, and re-quantizing that to MXFP8 flips E4M3 roundings
    # (rms ~ sqrt(2^-9 * 2^-4) ~ 1.1%), which measures the inputs, not the op.
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, out.dtype)
    out.backward(cot)
    return [out.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves if t is not None and t.requires_grad]


def _close(a, b):
    # A value sitting on an E4M3 rounding boundary may flip by one ulp (12.5%) between the bf16
    # (CUDA) and fp32 (CPU) emulation paths; compare whole tensors by relative norm.
    names = ["output"] + [f"grad {i}" for i in range(len(a) - 1)]
    for name, x, y in zip(names, a, b):
        err = ((x - y).norm() / y.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.3e} between CUDA and CPU"



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


@cuda
@pytest.mark.parametrize("end", [0, 37, 200, 263])
def test_zero_rows_past_end_writes_only_the_tail(end):
    from mxfx.kernels.zero_rows import zero_rows_past_end_

    out = torch.randn(263, 1030, device="cuda", dtype=torch.bfloat16)
    before = out.clone()
    offs = torch.tensor([0, min(end, 20), end], dtype=torch.int32, device="cuda")
    zero_rows_past_end_(out, offs)
    assert torch.equal(out[:end], before[:end])
    assert not out[end:].any()
