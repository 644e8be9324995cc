"""Data-dependent expert splits compile as often under mxfx as without it, and a recompile-limit hit is named.

JetMoe's experts (and any per-expert loop) split the tokens by counts read on the host (``counts.tolist()``)
and run one ``F.linear`` per expert. After the first change of counts Dynamo makes them dynamic, and the graph
must then serve every split: the wgrad's token padding is one symbolic expression, with no guard on whether
an expert's rows fit one 32-row MX block or one 128-row fp8_block tile. When Dynamo does give up on a frame mxfx
converted (its recompile limit), the frame runs eagerly without mxfx's conversions: mxfx warns, naming the frame.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import mxfx  # noqa: F401  (registers the backend's warnings filter on first compile)
from mxfx.numerics.block import dequantize_1x128, quantize_1x128
from mxfx.ops.linear import mx_linear

D = 64

# expert row counts: every expert crosses the 32-row block boundary both ways (and Dynamo's 0/1 rows never occur)
SPLITS = [
    [10, 20, 30, 4],
    [40, 8, 12, 4],
    [3, 70, 9, 100],
    [33, 33, 33, 33],
    [64, 65, 2, 200],
    [5, 6, 7, 8],
    [100, 2, 50, 31],
    [31, 32, 33, 34],
]
# the same four times over: every expert crosses the 128-row tile boundary both ways
SPLITS_128 = [[4 * n for n in sizes] for sizes in SPLITS]


class LoopExperts(nn.Module):
    """Per-expert ``F.linear`` over a split of the tokens by host-side counts (JetMoe's ``ParallelExperts``)."""

    def __init__(self, n_experts: int = 4, d: int = D):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_experts, d, d) * 0.05)

    def forward(self, x, sizes: list[int]):
        return torch.cat([F.linear(xi, self.weight[i]) for i, xi in enumerate(torch.split(x, sizes))])


def _graphs_compiled(backend: str, options=None, splits=SPLITS, d: int = D) -> int:
    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(LoopExperts(d=d), backend=backend, options=options)
    for sizes in splits:
        x = torch.randn(sum(sizes), d, requires_grad=True)
        with torch.autocast("cpu", torch.bfloat16):
            model(x, sizes).float().sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("fmt,d,splits", [("mxfp8", D, SPLITS), ("fp8_block", 128, SPLITS_128)])
def test_expert_splits_compile_as_often_as_without_mxfx(fmt, d, splits):
    # Without mxfx: one graph for the first split, then one with the counts dynamic (and a third, x's rows
    # dynamic too); mxfx adds none (it used to guard on each expert's rows being one 32-row MX block, or one
    # 128-row fp8_block tile, and recompiled until Dynamo's recompile limit of 8).
    plain = _graphs_compiled("aot_eager", splits=splits, d=d)
    assert plain <= 3
    assert _graphs_compiled("mxfp8", {"inner": "aot_eager", "format": fmt}, splits, d) == plain


def test_fp8_block_padded_dynamic_wgrad_equals_the_static_one():
    """Under dynamic shapes the fp8_block wgrad reads tokens zero-padded to whole tiles (at least two): the same
    quantized values as the eager (static) path's, plus zeros. The two wgrads then differ only by the order of
    their FP32 sums over the tokens: elementwise within 2 * gamma_n * (|dY|^T |X|) of the dequantized operands
    (gamma_n = n u / (1 - n u), u = 2^-24, n the padded token count), which a wrong tile or padding exceeds."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    w = torch.randn(256, 128) * 0.05
    compiled = torch.compile(
        lambda x, w: F.linear(x, w),
        backend="mxfp8",
        dynamic=True,
        options={"inner": "aot_eager", "format": "fp8_block"},
    )
    for m, padded in ((100, 256), (300, 384)):  # one partial tile padded to two; three tiles, the last partial
        x, g = torch.randn(m, 128), torch.randn(m, 256)
        grads = []
        for fn in (compiled, lambda x, w: mx_linear(x, w, format="fp8_block")):
            weight = w.clone().requires_grad_()
            with torch.autocast("cpu", torch.bfloat16):
                y = fn(x, weight)
            (y.float() * g).sum().backward()
            grads.append(weight.grad)
        dy_q, x_q = (
            dequantize_1x128(*quantize_1x128(t, axis=0), axis=0, dtype=torch.float32) for t in (g.bfloat16(), x)
        )  # the wgrad operands' values, tiled along the tokens
        u = 2.0**-24
        bound = 2 * (padded * u / (1 - padded * u)) * (dy_q.abs().t() @ x_q.abs())
        diff = (grads[0] - grads[1]).abs()
        assert (diff <= 1.01 * bound).all(), (m, (diff - bound).max())
        assert grads[1].abs().max() > 0
    assert counters["stats"]["unique_graphs"] == 1  # one graph for both counts: the padded, symbolic path ran


def _hit_limit(options, limit: int = 2) -> list[str]:
    """Messages of the mxfx warnings while a frame with static split sizes recompiles past ``limit``."""
    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(LoopExperts(n_experts=2), backend="mxfp8", options=options)
    with (
        torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=limit),
        warnings.catch_warnings(record=True) as record,
    ):
        warnings.simplefilter("always")
        for sizes in ([32, 32], [64, 32], [32, 64], [64, 64]):  # a new graph per split: the limit is hit
            model(torch.randn(sum(sizes), D, requires_grad=True), sizes).sum().backward()
    assert counters["stats"]["unique_graphs"] == limit  # Dynamo stopped compiling: the limit was hit
    return [str(w.message) for w in record if "stopped compiling" in str(w.message)]


def test_recompile_limit_on_a_converted_frame_warns_once_naming_it():
    messages = _hit_limit({"inner": "aot_eager"})
    assert len(messages) == 1, messages
    assert "'forward' (" in messages[0] and "test_recompiles.py" in messages[0]
    assert "recompile_limit" in messages[0] and "sizes[0] == " in messages[0]


def test_recompile_limit_on_a_frame_without_converted_ops_leaves_it_to_dynamo():
    # every GEMM kept in BF16 by the policy: nothing of mxfx's is lost when the frame runs eagerly
    assert _hit_limit({"inner": "aot_eager", "rules": [{"op": "linear", "precision": "bf16"}]}) == []


@pytest.mark.parametrize("m,rows", [(1, 32), (32, 32), (33, 64), (64, 64), (65, 96)])
def test_token_rows_static(m, rows):
    from mxfx.formats.mxfp8 import token_rows

    assert token_rows(m) == rows
