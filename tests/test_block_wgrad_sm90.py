"""The warp-specialized sm90 fp8_block grouped wgrad (``mxfx.kernels.fp8_block.grouped_wgrad_sm90``, opt-in).

CPU: the kernel compiles for sm90 without a GPU, writing and accumulating, to FP8 ``wgmma`` (QGMMA) with register
reallocation, TMA loads (the gradient block's too when accumulating) and no spills, within shared memory. GPU
(skips without an sm90 GPU): against the reference decode per group for equal, empty, unaligned and one-token
groups, written and added into a gradient, and chosen by ``MXFX_BLOCK_WGRAD_SM90``.

Bound: as tests/test_block_gpu.py: the tensor cores' narrower accumulator inside each 128-token step and the FP32
summation order, ``2^-10 * (|dY| ^T @ |X|)`` of the dequantized operands.
"""

from __future__ import annotations

import pytest
import torch

from mxfx.numerics import block as bf
from mxfx.kernels.fp8_block import device_path, gemm as block_gemm

from tests.helpers import SM90_GPU, gluon_sm90

triton = pytest.importorskip("triton")
sass = pytest.importorskip("tests.sass")

_GPU = SM90_GPU


def _sm90():
    return gluon_sm90(block_gemm._wgrad_sm90_kernel)


def _operands(sizes, n, k, device, seed=5):
    g = torch.Generator().manual_seed(seed)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), k, generator=g).bfloat16()
    dy = torch.randn(sum(sizes), n, generator=g).bfloat16()
    (xq, xs), (dq, ds) = (device_path.quantize_1x128_grouped_tokens(t.to(device), offs.to(device)) for t in (x, dy))
    return dq, ds, xq, xs, offs.to(device), dy, x, offs


@pytest.mark.skipif(bool(sass.missing()), reason=sass.missing())
@pytest.mark.parametrize("accumulate", [True, False])
def test_kernel_compiles_for_sm90_to_fp8_wgmma_without_spills(accumulate):
    sm90 = _sm90()
    n, k, sizes = 256, 384, [100, 0, 300, 112]
    cap = bf.group_tile_capacity(sum(sizes), len(sizes))
    a = torch.empty(n, 128 * cap, dtype=torch.float8_e4m3fn)
    b = torch.empty(k, 128 * cap, dtype=torch.float8_e4m3fn)
    sa, sb = torch.empty(cap, n).t(), torch.empty(cap, k).t()
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = torch.empty(len(sizes), n, k)
    grid, args, kwargs = sm90.launch_args(a, sa, b, sb, offs, out, accumulate)
    c = sass.compile_sm90(sass.Launch(sm90._grouped_wgrad_kernel, grid, args, kwargs))
    counts = c.counts
    assert counts.get("QGMMA", 0) >= 8 and counts.get("HGMMA", 0) == 0, dict(counts)  # 4 a step, both warpgroups
    assert counts.get("USETMAXREG", 0) + counts.get("SETMAXNREG", 0) > 0, "no register reallocation"
    assert counts.get("UTMALDG", 0) >= (5 if accumulate else 3), dict(counts)  # A twice, B; the two gradient blocks
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0, "registers spilled to local memory"
    assert c.shared <= 227 * 1024


@pytest.mark.skipif(not _GPU, reason="needs an sm90 GPU")
@pytest.mark.parametrize("sizes", [[1024] * 4, [300, 0, 129, 1000, 7], [1, 127, 128, 129]])
def test_matches_reference_written_and_added(sizes):
    sm90 = _sm90()
    n, k = 256, 384
    dq, ds, xq, xs, offs, dy, x, offs_cpu = _operands(sizes, n, k, "cuda")
    out = torch.full((len(sizes), n, k), float("nan"), device="cuda")
    assert sm90.supported(dq, xq, out)
    sm90.grouped_wgrad(dq, ds, xq, xs, offs, out, accumulate=False)
    ref = block_gemm.reference_grouped_wgrad(*(t.cpu() for t in (dq, ds, xq, xs)), offs_cpu, torch.float32)
    start = 0
    for e, end in enumerate(offs_cpu.tolist()):
        dh = bf.dequantize_1x128(*bf.quantize_1x128(dy[start:end].float(), axis=0), axis=0, dtype=torch.float32)
        xh = bf.dequantize_1x128(*bf.quantize_1x128(x[start:end].float(), axis=0), axis=0, dtype=torch.float32)
        bound = 2.0**-10 * (dh.abs().t() @ xh.abs())
        assert ((out[e].cpu() - ref[e]).abs() <= bound).all(), e  # an empty group: zeros over the NaNs
        start = end
    prior = torch.randn(out.shape, device="cuda")
    grad = prior.clone()
    sm90.grouped_wgrad(dq, ds, xq, xs, offs, grad, accumulate=True)
    assert torch.equal(grad, prior + out)  # one FP32 add of the same finished sum


@pytest.mark.skipif(not _GPU, reason="needs an sm90 GPU")
def test_the_switch_picks_the_kernel(monkeypatch):
    n, k = 256, 384
    dq, ds, xq, xs, offs, *_ = _operands([500, 600], n, k, "cuda")
    triton_out = block_gemm.grouped_wgrad(dq, ds, xq, xs, offs)
    monkeypatch.setenv(block_gemm.WGRAD_SM90_ENV, "1")
    sm90_out = block_gemm.grouped_wgrad(dq, ds, xq, xs, offs)
    direct = _sm90().grouped_wgrad(dq, ds, xq, xs, offs, torch.empty_like(sm90_out), accumulate=False)
    assert torch.equal(sm90_out, direct)
    assert ((sm90_out - triton_out).norm() / triton_out.norm()).item() < 1e-5  # the same sums in another order
