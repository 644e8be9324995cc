"""The weight caches are never a buffer Inductor may reuse.

The ``mxfx::cached_weight`` op returns the caches themselves, tensors that outlive the graph; Inductor
frees an op's outputs after their last use and writes later buffers of the same size into them
(``# reuse`` lines of its generated code). On CUDA with torch 2.11 an expert weight's fp32 scale grid became
an RMSNorm buffer that way, and every later forward read those values as scales
(tests/test_block_gpu_training.py checks the caches after training there). The backend turns buffer reuse
off for every graph that calls mxfx (:data:`mxfx.backend.CACHE_SAFE_INDUCTOR`); on CPU the same graph
shows it: plain Inductor reuses buffers in it, the mxfp8 backend's graphs reuse none.
"""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from mxfx import backend


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(256, 256) * 0.02)
        self.v = nn.Parameter(torch.randn(256, 256) * 0.02)

    def forward(self, x):
        h = torch.relu(F.rms_norm(F.linear(x, self.w), (256,)) * 2)
        return F.rms_norm(F.linear(h, self.v), (256,)).sum()


def _generated(backend_name: str, **kw) -> str:
    torch._dynamo.reset()
    fn = torch.compile(_TwoLinears(), backend=backend_name, **kw)
    x = torch.randn(512, 256)
    with torch.autocast("cpu", torch.bfloat16):
        _, codes = run_and_get_code(lambda: fn(x).backward())
    return "\n".join(codes)


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_block"])
@pytest.mark.slow
def test_no_buffer_of_an_mxfx_graph_is_reused(fmt):
    plain = _generated("inductor")
    assert "# reuse" in plain  # the graph has buffers Inductor would reuse
    code = _generated("mxfp8", options={"format": fmt})
    assert "cached_weight" in code  # the caches are op outputs in this graph
    assert "# reuse" not in code


def test_inductor_patches_only_for_graphs_calling_mxfx():
    plain = fx.symbolic_trace(nn.Linear(4, 4))
    assert backend.inductor_patches(plain) == {}
    assert backend.inductor_patches(plain, "max-autotune-no-cudagraphs").get("max_autotune") is True
