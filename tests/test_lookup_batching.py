"""One weight-cache lookup call per round of a compiled graph (``mxfx.post_grad.lookup_batching``)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch._inductor.utils import run_and_get_code

from mxfx.post_grad import lookup_batching
from mxfx.runtime.cache.operands import cached_weight, cached_weights
from tests.test_combine_sum import _unsort_layer


def _step(monkeypatch, batch: bool, env: str = lookup_batching.ENV):
    """A compiled training step of a linear feeding an HF-style routed layer (fp8_block, Inductor on the CPU),
    with post-grad pass switch ``env`` on (``batch``) or off: its output, the gradients and Inductor's generated
    code."""
    monkeypatch.setenv(env, "1" if batch else "0")
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(48, 128, dtype=torch.bfloat16, requires_grad=True)
    shapes = ((4, 128), (4, 256, 128), (4, 128, 128))
    params = [(torch.randn(*s) * 0.2).bfloat16().requires_grad_() for s in shapes]
    lin = torch.nn.Linear(128, 128, bias=False).bfloat16()
    fn = torch.compile(lambda x, *p: _unsort_layer(lin(x), *p), backend="mxfp8", options={"format": "fp8_block"})

    def step():
        out = fn(x, *params)
        out.float().square().sum().backward()
        return out

    out, code = run_and_get_code(step)
    return out, [t.grad for t in (x, *params, lin.weight)], "\n".join(code)


def _calls(code: str, op: str) -> int:
    return sum(1 for line in code.splitlines() if f"torch.ops.mxfx.{op}.default(" in line and " = " in line)


def test_a_graphs_forward_form_lookups_take_one_call_and_change_nothing(monkeypatch):
    """The compiled step's three weights' forward forms are looked up in one call where there were three; the dgrad
    forms keep a call each; output and gradients are bit for bit those of the unbatched graph (the same forms, read
    by the same kernels)."""
    out, grads, code = _step(monkeypatch, batch=True)
    ref_out, ref_grads, ref_code = _step(monkeypatch, batch=False)
    assert _calls(ref_code, "cached_weights") == 0
    singles = _calls(ref_code, "cached_weight")
    assert singles == 6  # forward and dgrad forms of the linear's weight and the two expert stacks
    assert _calls(code, "cached_weights") == 1
    assert _calls(code, "cached_weight") == 3
    assert torch.equal(out, ref_out)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


def _graph(*lookups):
    """A graph of placeholders ``w0``, ``w1`` and a computed ``w0 * 2``, then each lookup ``(weight, rule, form)``
    (weight: a placeholder index or "computed") with a reader of its first output."""
    g = fx.Graph()
    ws = [g.placeholder(f"w{i}") for i in range(2)]
    computed = g.call_function(operator.mul, (ws[0], 2))
    weights = [torch.randn(4, 256, 128), torch.randn(4, 256, 128)]
    reads = []
    for which, rule, form in lookups:
        w = computed if which == "computed" else ws[which]
        n = g.call_function(cached_weight, (w, rule, form))
        n.meta["val"] = list(cached_weight(weights[0 if which == "computed" else which], rule, form))
        reads.append(g.call_function(operator.getitem, (n, 0)))
    g.output(tuple(reads))
    return g, reads


def _reads(g: fx.Graph) -> list:
    """Per output: (the lookup node it reads, the index read)."""
    out = next(n for n in g.nodes if n.op == "output").args[0]
    return [(r.args[0], r.args[1]) for r in out]


def test_rounds_hold_one_form_per_weight_and_a_repeat_reads_its_first():
    """Two forms of one weight go to two calls (fp8_block's forward and source-layout dgrad forms share their
    scales: one op's outputs must not alias each other); a repeated lookup reads the first's outputs; a dgrad-side
    form and a computed weight keep their own calls."""
    g, _ = _graph(
        (0, "rceil", "block_forward"),
        (1, "rceil", "block_forward"),
        (0, "floor", "forward"),  # MXFP8's forward form: a second form of each weight
        (1, "floor", "forward"),
        (0, "rceil", "block_forward"),  # a repeat
        (0, "rceil", "block_dgrad"),
        ("computed", "rceil", "block_forward"),
    )
    assert lookup_batching.run(g) == 3  # seven calls become four: two rounds of two, the dgrad form, the computed
    g.lint()
    batched = [n for n in g.nodes if n.target is cached_weights]
    assert [n.args[2] for n in batched] == [["block_forward"] * 2, ["forward"] * 2]
    assert [len(n.meta["val"]) for n in batched] == [4, 4]
    read = _reads(g)
    assert read[0] == (batched[0], 0)
    assert read[1] == (batched[0], 2)  # w1's qdata: after w0's (qdata, scales)
    assert read[2] == (batched[1], 0) and read[3] == (batched[1], 2)
    assert read[4] == read[0]
    dgrad, computed = (n for n in g.nodes if n.target is cached_weight)
    assert read[5] == (dgrad, 0) and dgrad.args[0].name == "w0" and dgrad.args[2] == "block_dgrad"
    assert read[6] == (computed, 0) and computed.args[0].name == "mul"


def test_a_single_lookup_is_left_as_it_is():
    g, _ = _graph((0, "rceil", "block_forward"))
    before = str(g)
    assert lookup_batching.run(g) == 0
    assert str(g) == before


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # E4M3 tensors have no equality on the CPU


def test_cached_weights_is_each_lookup_in_turn_and_refuses_lists_that_do_not_pair():
    ws = [torch.randn(256, 128), torch.randn(4, 256, 128)]
    got = cached_weights(ws, ["rceil", "amax"], ["block_forward", "block_dgrad"])
    want = [*cached_weight(ws[0], "rceil", "block_forward"), *cached_weight(ws[1], "amax", "block_dgrad")]
    assert len(got) == len(want) and all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="one rule and one form per weight"):
        cached_weights(ws, ["rceil"], ["block_forward", "block_dgrad"])
    with pytest.raises(ValueError, match="at least one weight"):
        cached_weights([], [], [])
