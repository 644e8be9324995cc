"""An fp8_block training step on the GPU (skips without an sm90+ CUDA GPU): every GEMM of a compiled
linear + routed-expert step runs on FP8 tensor cores, read from the profiler's kernel names.

Forward, dgrad and wgrad of the linear are cuBLAS blockwise FP8 GEMMs (``nvjet_sm90_qq...``-style names,
:data:`tests.test_block_gpu.FP8_GEMM_NAME`); the grouped forward and dgrad are the Triton kernel
``_grouped_body``, the grouped wgrad (``wgrad="mxfp8"`` by rule here) ``_grouped_wgrad_kernel``. No other
GEMM kernel may run: a dequantize followed by a BF16 GEMM would show up as one.
"""

import warnings

import pytest
import torch
import torch.nn as nn

import mxfx
from tests.test_block_gpu import FP8_GEMM_NAME, _kernels

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm90+ CUDA GPU"
)


class LinearThenExperts(nn.Module):
    """A dense projection, then 4 experts as one grouped GEMM on expert-sorted rows (FP32 main weights)."""

    def __init__(self, d=1024, hidden=512, experts=4):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, hidden, d) * d**-0.5)

    def forward(self, x, offs):
        h = self.proj(x)
        return torch._grouped_mm(h.to(torch.bfloat16), self.experts.to(torch.bfloat16).transpose(-2, -1), offs=offs)


def _step(fn, x, offs):
    with torch.autocast("cuda", torch.bfloat16):
        y = fn(x, offs)
    loss = y.float().square().mean()
    loss.backward()
    return loss.detach()


@pytest.mark.slow
def test_fp8_block_step_runs_fp8_gemms_only():
    torch.manual_seed(0)
    model = LinearThenExperts().cuda()
    x = torch.randn(1000, 1024, device="cuda", requires_grad=True)  # 1000 tokens: partial 1x128 wgrad tiles
    offs = torch.tensor([300, 300, 700, 1000], dtype=torch.int32, device="cuda")  # one empty expert
    opts = {"format": "fp8_block", "rules": [{"op": "grouped_mm", "wgrad": "mxfp8"}]}
    torch._dynamo.reset()
    fn = torch.compile(model, backend="mxfp8", options=opts)
    loss = _step(fn, x, offs)  # compile, autotune, weight caches
    pm = mxfx.last_report()
    assert [r.forward for r in pm.records if r.kind in ("linear", "grouped_mm")] == ["fp8_block"] * 2, pm.to_text()
    names = _kernels(lambda: _step(fn, x, offs))
    gemm_like = [n for n in names if "gemm" in n.lower() or "nvjet" in n or "_grouped_" in n or "cutlass" in n]
    cublas_fp8 = [n for n in gemm_like if FP8_GEMM_NAME.search(n) and "_grouped_" not in n]
    assert len(cublas_fp8) >= 3, f"linear forward, dgrad, wgrad: {gemm_like}"
    grouped = [n for n in names if n in ("_grouped_body", "_grouped_kernel")]  # the Triton or the sm90 kernel
    assert len(grouped) == 2, f"grouped forward and dgrad: {gemm_like}"
    assert names.count("_grouped_wgrad_kernel") == 1, gemm_like
    stand_ins = [
        n
        for n in gemm_like
        if n not in cublas_fp8
        and n not in ("_grouped_body", "_grouped_kernel", "_grouped_wgrad_kernel")
        and "reduce" not in n.lower()
    ]  # a split-K reduction of an FP8 GEMM is no GEMM
    assert not stand_ins, f"non-FP8 GEMM kernels ran: {stand_ins}"
    # and the step computes the model's loss: FP8 operands move it by a few percent at most
    for p in model.parameters():
        p.grad = None
    ref = _step(model, x, offs)
    assert abs(loss - ref) / ref < 0.05, (loss, ref)
    print("kernels:", gemm_like)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9, reason="the note is sm90's"
)
def test_sm90_compile_notes_warn_once_per_format(monkeypatch):
    """MXFP8 ops on sm90: one note naming format="fp8_block", once per process; fp8_block ops ("auto" on sm90)
    get none."""
    from mxfx import backend

    monkeypatch.setattr(backend, "_warned_formats", set())
    lin = nn.Linear(256, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="no tensor cores on sm90.*fp8_block"):
        torch.compile(lin, backend="mxfp8", options={"inner": "aot_eager"})(x)
    for options in (
        {"inner": "aot_eager"},
        {"inner": "aot_eager", "format": "auto"},
        {"inner": "aot_eager", "format": "fp8_block"},
    ):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.compile(lin, backend="mxfp8", options=options)(x)
        messages = [str(w.message) for w in caught if str(w.message).startswith("mxfx: ")]
        notes = [m for m in messages if "sm90" in m or "fp8_block" in m]
        assert notes == [], (options, notes)  # the MX note once per process, none for fp8_block
