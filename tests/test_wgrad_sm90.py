"""The ping-pong sm90 grouped wgrad into an FP32 gradient (``mxfx.kernels.common.grouped_wgrad_sm90``).

CPU: the kernel compiles for sm90 without a GPU, to BF16 ``wgmma`` (HGMMA), TMA loads and register reallocation
between its partitions, within shared memory. GPU (skips without an sm90 GPU): equal, skewed, empty and unaligned
groups, tokens past ``offs[-1]``, write and accumulate, BF16 and FP16, against a float64 product of the operands;
and which kernel :func:`grouped_wgrad_kernel` picks (the sm90 one is opt-in, ``MXFX_WGRAD_SM90=1``).

Bound: BF16/FP16 products are exact in FP32 and each value is a sum of at most a group's tokens plus the old
gradient, so ``2^-16 * (|dy|^T @ |x| + |old|)`` holds FP32 summation in any order for groups of up to a few
thousand tokens, while one token counted twice or left out (about ``1/tokens`` of that sum, 2^-12 at 4,096) fails.
"""

from __future__ import annotations


import pytest
import torch

from mxfx.kernels.common import custom_ops

from tests.helpers import SM90_GPU, gluon_sm90

triton = pytest.importorskip("triton")
sass = pytest.importorskip("tests.sass")

_GPU = SM90_GPU


def _sm90():
    return gluon_sm90(custom_ops._wgrad_sm90)


@pytest.mark.skipif(bool(sass.missing()), reason=sass.missing())
@pytest.mark.parametrize("accumulate", [True, False])
def test_kernel_compiles_for_sm90_to_bf16_wgmma(accumulate):
    sm90 = _sm90()
    s, g, n, k = 1024, 4, 512, 1024
    dy = torch.empty(s, n, dtype=torch.bfloat16)
    x = torch.empty(s, k, dtype=torch.bfloat16)
    offs = torch.arange(1, g + 1, dtype=torch.int32) * (s // g)
    grid, args, kwargs = sm90.launch_args(dy, x, offs, torch.empty(g, n, k), accumulate)
    c = sass.compile_sm90(sass.Launch(sm90._grouped_wgrad_into_sm90_kernel, grid, args, kwargs))
    counts = c.counts
    # 128x128 tile, 64 tokens a step: 2 (64-row halves) x 4 (K=16 instructions) per step, in both warpgroups
    assert counts.get("HGMMA", 0) >= 16 and counts.get("QGMMA", 0) == 0, dict(counts)
    assert counts.get("USETMAXREG", 0) + counts.get("SETMAXNREG", 0) > 0, "no register reallocation"
    assert counts.get("UTMALDG", 0) >= 2, dict(counts)
    # Triton 3.6 (the one the kernel is timed with) spills nothing; 3.9's register allocation keeps a few values of
    # the prefetched gradient block in local memory (about 20 loads a tile), allowed there up to a bound
    limit = 0 if triton.__version__.startswith("3.6") else 32
    assert counts.get("LDL", 0) <= limit and counts.get("STL", 0) <= limit, "registers spilled to local memory"
    assert c.shared <= 227 * 1024


CASES = {
    "equal": ([512] * 8, 1024, 1024),
    "skewed, empty, unaligned": ([1000, 0, 129, 7, 0, 300, 2048, 1], 768, 1024),
    "one group, tail tokens": ([777], 256, 2048),
    "many tiles per program": ([1024] * 16, 2048, 512),
    "N and K not multiples of 128": ([300, 200, 0, 64], 336, 392),
}


def _reference(dy, x, sizes, old):
    out, start = [], 0
    for e, size in enumerate(sizes):
        d, xx = dy[start : start + size].double(), x[start : start + size].double()
        base = old[e].double() if old is not None else 0
        out.append((d.t() @ xx + base, d.abs().t() @ xx.abs() + (old[e].double().abs() if old is not None else 0)))
        start += size
    return out


@pytest.mark.skipif(not _GPU, reason="needs an sm90 GPU")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgrad_into_matches_the_float64_product(case, accumulate, dtype):
    sm90 = _sm90()
    sizes, n, k = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(len(sizes) * k + n)
    s = sum(sizes) + 37  # tokens past offs[-1]: never counted
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    dy = torch.randn(s, n, device="cuda", generator=gen).to(dtype)
    x = torch.randn(s, k, device="cuda", generator=gen).to(dtype)
    dy[sum(sizes) :] = float("nan")  # a token past the last group would poison the result
    out = torch.randn(len(sizes), n, k, device="cuda", generator=gen) * 10
    old = out.clone() if accumulate else None
    if not accumulate:
        out.fill_(float("nan"))  # every block is written, empty groups' as zeros
    assert sm90.supported(dy, x, out)
    sm90.grouped_wgrad_into(dy, x, offs, out, accumulate)
    for e, (ref, mag) in enumerate(_reference(dy, x, sizes, old)):
        err = (out[e].double() - ref).abs()
        bound = 2.0**-16 * mag
        assert (err <= bound).all(), f"{case} group {e}: max excess {(err - bound).max().item():.3e}"


@pytest.mark.skipif(not _GPU, reason="needs an sm90 GPU")
def test_a_non_finite_token_of_the_next_group_stays_in_its_group():
    """The last step of group 0 reads group 1's first tokens into shared memory; they are zeroed there, so an inf
    in group 1 leaves group 0's gradient finite."""
    sm90 = _sm90()
    dy = torch.randn(200, 256, device="cuda").bfloat16()
    x = torch.randn(200, 256, device="cuda").bfloat16()
    dy[100], x[101] = float("inf"), float("inf")
    offs = torch.tensor([100, 200], dtype=torch.int32, device="cuda")
    out = torch.zeros(2, 256, 256, device="cuda")
    sm90.grouped_wgrad_into(dy, x, offs, out, True)
    assert out[0].isfinite().all()
    assert not out[1].isfinite().all()


@pytest.mark.skipif(not _GPU, reason="needs an sm90 GPU")
def test_the_switch_picks_the_kernel_where_it_serves(monkeypatch):
    from mxfx.kernels.common import grouped_wgrad_triton

    sm90 = _sm90()
    dy = torch.randn(256, 512, device="cuda").bfloat16()
    x = torch.randn(256, 384, device="cuda").bfloat16()
    out = torch.zeros(2, 512, 384, device="cuda")
    monkeypatch.delenv(custom_ops.WGRAD_SM90_ENV, raising=False)
    assert custom_ops.grouped_wgrad_kernel(dy, x, out) is grouped_wgrad_triton  # opt-in
    monkeypatch.setenv(custom_ops.WGRAD_SM90_ENV, "1")
    assert custom_ops.grouped_wgrad_kernel(dy, x, out) is sm90
    assert custom_ops.grouped_wgrad_kernel(dy, x[:, :380], out[..., :380]) is grouped_wgrad_triton  # not contiguous
    narrow = torch.zeros(2, 512, 64, device="cuda")
    assert custom_ops.grouped_wgrad_kernel(dy, x[:, :64].contiguous(), narrow) is grouped_wgrad_triton  # K < 128
    monkeypatch.setenv(custom_ops.WGRAD_SM90_ENV, "0")
    assert custom_ops.grouped_wgrad_kernel(dy, x, out) is grouped_wgrad_triton
    monkeypatch.setenv(custom_ops.WGRAD_SM90_ENV, "maybe")
    with pytest.raises(ValueError, match="MXFX_WGRAD_SM90"):
        custom_ops.grouped_wgrad_kernel(dy, x, out)
