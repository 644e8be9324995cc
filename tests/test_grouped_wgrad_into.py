"""The grouped weight gradient whose FP32 epilogue writes or adds into the gradient
(``mxfx.kernels.common.grouped_wgrad_triton``): against a float64 product per group, written over NaN (every element
written; an empty group zeroed) and added to a gradient (an empty group kept), through a strided view of the
gradient too. On the CPU in Triton's interpreter (FP16 operands: the interpreter's BF16 dot is not exact) and on
the GPU (BF16).

Bound: the operands are exact in FP32 and FP64; the FP32 accumulation over a group's tokens in the tensor cores'
order differs from the FP64 sum by at most about ``T * 2^-24 * sum |dy| |x|``; we allow ``2^-16 * (|dy|^T @ |x|)``.
"""

from __future__ import annotations

import sys

import pytest
import torch

SIZES = [70, 0, 129, 5]


def _case(device, dtype, transposed):
    gen = torch.Generator().manual_seed(3)
    s, n, k = sum(SIZES) + 3, 96, 80  # 3 rows past the last group, ignored: NaN and inf there must add nothing
    dy = torch.randn(s, n, generator=gen).to(dtype)
    x = torch.randn(s, k, generator=gen).to(dtype)
    dy[-3:], x[-3:] = float("nan"), float("inf")
    dy, x = dy.to(device), x.to(device)
    offs = torch.tensor(SIZES).cumsum(0).to(torch.int32).to(device)
    ref = torch.zeros(len(SIZES), n, k, dtype=torch.float64)
    bound = torch.zeros_like(ref)
    start = 0
    for g, end in enumerate(offs.tolist()):
        a, b = dy[start:end].double().cpu(), x[start:end].double().cpu()
        ref[g], bound[g] = a.t() @ b, 2.0**-16 * (a.abs().t() @ b.abs())
        start = end
    return dy, x, offs, ref, bound


def _grad(shape, device, transposed, fill):
    """A gradient of ``shape`` [G, N, K], as a transposed view of a [G, K, N] tensor where ``transposed``."""
    g, n, k = shape
    base = torch.full((g, k, n) if transposed else (g, n, k), fill, dtype=torch.float32, device=device)
    return base.transpose(1, 2) if transposed else base


def check(device, dtype, config=None, tma=None, red=True):
    from mxfx.kernels.common import grouped_wgrad_triton

    for transposed in (False, True):
        dy, x, offs, ref, bound = _case(device, dtype, transposed)
        out = _grad(ref.shape, device, transposed, float("nan"))
        grouped_wgrad_triton.grouped_wgrad_into(dy, x, offs, out, False, config=config, tma=tma, red=red)
        assert ((out.double().cpu() - ref).abs() <= bound).all(), "written"
        prev = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4))
        out = _grad(ref.shape, device, transposed, 0.0)
        out.copy_(prev)
        grouped_wgrad_triton.grouped_wgrad_into(dy, x, offs, out, True, config=config, tma=tma, red=red)
        assert ((out.double().cpu() - (ref + prev.double())).abs() <= bound + 2.0**-20).all(), "added"
        assert torch.equal(out[1].cpu(), prev[1]), "an empty group's gradient is kept"


INTERPRETER_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 32, "BLOCK_T": 16, "num_warps": 4, "num_stages": 1}


def test_grouped_wgrad_into_in_the_interpreter():
    from tests.helpers import run_interpreter_checks

    run_interpreter_checks(__file__)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm90+ CUDA GPU"
)
@pytest.mark.parametrize("red", [False, True], ids=["load-store", "red"])
@pytest.mark.parametrize("tma", [False, True], ids=["vector-loads", "tma"])
@pytest.mark.parametrize("config", ["CONFIG", "LONG_GROUPS_CONFIG"])
def test_grouped_wgrad_into_on_the_gpu(config, tma, red):
    from mxfx.kernels.common import grouped_wgrad_triton

    check("cuda", torch.bfloat16, getattr(grouped_wgrad_triton, config), tma, red)


def test_the_mean_group_size_chooses_the_launch():
    pytest.importorskip("triton")
    from mxfx.kernels.common import grouped_wgrad_triton as m

    assert m.config_for(64 * 2048, 64) == m.CONFIG  # OLMoE: 2,048 tokens per expert
    assert m.config_for(8 * 4096, 8) == m.LONG_GROUPS_CONFIG  # Mixtral: 4,096
    assert m.config_for(100, 0) == m.CONFIG


@pytest.mark.parametrize(
    ("tokens", "dy_cols", "kernel"),
    [
        (4 * 1024, 64, "_grouped_wgrad_into_tma_kernel"),  # groups of 1,024 tokens, TMA-ready
        (4 * 1023, 64, "_grouped_wgrad_into_kernel"),  # shorter groups
        (4 * 1024, 60, "_grouped_wgrad_into_kernel"),  # rows of 120 bytes: no TMA box
    ],
)
def test_the_mean_group_size_and_the_layout_choose_the_mainloop(tokens, dy_cols, kernel):
    pytest.importorskip("triton")
    from mxfx.kernels.common import grouped_wgrad_triton as m
    from tests import sass

    dy, x = torch.empty(tokens, dy_cols, dtype=torch.bfloat16), torch.empty(tokens, 32, dtype=torch.bfloat16)
    offs = torch.arange(1, 5, dtype=torch.int32) * (tokens // 4)
    (seen,) = sass.captured_launches([m], m.grouped_wgrad_into, dy, x, offs, torch.empty(4, dy_cols, 32), True)
    assert seen.kernel.fn.__name__ == kernel
    assert seen.kwargs["RED"] is True  # accumulating: red.add


@pytest.mark.parametrize("config", ["CONFIG", "LONG_GROUPS_CONFIG"])
def test_the_tma_kernel_compiles_for_sm90_without_spills(config):
    """The default launch at groups of 1,024+ tokens: BF16 wgmma fed by TMA, the accumulating epilogue as vector
    reductions, and no local memory (a read of the gradient block beside the 128-register accumulator spilled)."""
    from tests import sass

    if sass.missing():
        pytest.skip(sass.missing())
    from mxfx.kernels.common import grouped_wgrad_triton as m

    s, g, n, k = 4096, 4, 512, 1024
    dy, x = torch.empty(s, n, dtype=torch.bfloat16), torch.empty(s, k, dtype=torch.bfloat16)
    offs = torch.arange(1, g + 1, dtype=torch.int32) * (s // g)
    cfg = getattr(m, config)
    (launch,) = sass.captured_launches([m], m.grouped_wgrad_into, dy, x, offs, torch.empty(g, n, k), True, config=cfg)
    c = sass.compile_sm90(launch)
    assert c.counts.get("HGMMA", 0) > 0 and c.counts.get("UTMALDG", 0) > 0, dict(c.counts)
    assert c.counts.get("REDG", 0) > 0 and c.memory.get("LDG.E.128", 0) == 0, dict(c.memory)
    assert c.counts.get("LDL", 0) == 0 and c.counts.get("STL", 0) == 0, "registers spilled to local memory"


def test_grouped_wgrad_into_names_bad_shapes():
    pytest.importorskip("triton")
    from mxfx.kernels.common import grouped_wgrad_triton

    dy, x = torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16)
    offs = torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"out must be \[G, N, K\] = \[1, 16, 32\]; got .*out \(1, 32, 16\)"):
        grouped_wgrad_triton.grouped_wgrad_into(dy, x, offs, torch.zeros(1, 32, 16), True)
    with pytest.raises(ValueError, match="bfloat16 or float16 dy and x of one dtype and a float32 out"):
        grouped_wgrad_triton.grouped_wgrad_into(dy, x.float(), offs, torch.zeros(1, 16, 32), True)
    with pytest.raises(ValueError, match="float32 out; got dy torch.bfloat16, x torch.bfloat16, out torch.bfloat16"):
        grouped_wgrad_triton.grouped_wgrad_into(dy, x, offs, torch.zeros(1, 16, 32, dtype=torch.bfloat16), True)
    strided = torch.tensor([4, 0, 8, 0], dtype=torch.int32)[::2]  # the kernels would read 4, 0
    with pytest.raises(ValueError, match=r"contiguous int32 offs \[G\]"):
        grouped_wgrad_triton.grouped_wgrad_into(dy, x, strided, torch.zeros(2, 16, 32), True)
    with pytest.raises(ValueError, match=r"out \(2, 16, 32\) with strides \(0, 32, 1\) overlaps itself"):
        grouped_wgrad_triton.grouped_wgrad_into(
            dy, x, strided.contiguous(), torch.zeros(1, 16, 32).expand(2, 16, 32), True
        )


if __name__ == "__main__" and "--interpret" in sys.argv:  # run_interpreter_checks' subprocess
    check("cpu", torch.float16, INTERPRETER_CONFIG)
    for tma, red in ((False, False), (True, False), (True, True)):
        check("cpu", torch.float16, INTERPRETER_CONFIG, tma=tma, red=red)
    from mxfx.kernels.common import grouped_wgrad_triton

    for tma in (False, True):  # no rows (a rank that received none): every group's gradient is zero, written
        empty = torch.zeros(0, 64, dtype=torch.float16), torch.zeros(0, 32, dtype=torch.float16)
        out = torch.full((2, 64, 32), float("nan"))
        grouped_wgrad_triton.grouped_wgrad_into(*empty, torch.zeros(2, dtype=torch.int32), out, False, tma=tma)
        assert (out == 0).all(), tma
    print("grouped_wgrad_into: interpreter checks passed")
