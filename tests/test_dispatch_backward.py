"""The dispatch_backward pass and its op: the local dispatch's row gather with a scatter-free backward."""

import pytest
import torch
import torch.nn.functional as F

import mxfx
from mxfx.ops.dispatch import gather_routed_rows, token_sum
from mxfx.passes.dispatch_backward import NOTE
from tests.helpers import GraphCapture, row_scatter_adds, sorted_routing

ATEN = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_gather_routed_rows_is_the_gather_with_its_gradient(dtype, top_k):
    tokens, d = 40, 48
    perm = sorted_routing(tokens, top_k, 16, seed=top_k)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, d, generator=g).to(dtype).requires_grad_()
    d_rows = torch.randn(tokens * top_k, d, generator=g).to(dtype)
    rows = gather_routed_rows(x, perm, top_k)
    assert rows.dtype == dtype and torch.equal(rows, x.detach()[perm // top_k])
    rows.backward(d_rows)
    # each token's top_k row gradients summed: k - 1 FP32 additions (each within 2^-24 of the magnitudes summed) and
    # one rounding to x's dtype (2^-8 relative for BF16); a lost, doubled or misplaced row is off by a whole term
    index = perm // top_k
    exact = torch.zeros(tokens, d, dtype=torch.float64).index_add_(0, index, d_rows.double())
    magnitude = torch.zeros(tokens, d, dtype=torch.float64).index_add_(0, index, d_rows.double().abs())
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    assert x.grad.dtype == dtype
    assert ((x.grad.double() - exact).abs() <= unit * exact.abs() + top_k * 2.0**-24 * magnitude).all()


def test_token_sum_adds_each_tokens_rows_in_slot_order():
    # in FP32 (spacing 4 at 2^25) 2^25 + 1 and 2^25 + 2 round to 2^25: in slot order token 0's rows give
    # ((2^25 + 1) - 2^25) + 1 = 1 and token 1's ((1 + 1) + 2^25) - 2^25 = 0, where pairs summed first give 0 and 2
    big = 2.0**25
    rows = torch.tensor([[big], [1.0], [-big], [1.0], [1.0], [1.0], [big], [-big]])
    out = token_sum(rows, 4, torch.float32)
    assert out.shape == (2, 1) and out.flatten().tolist() == [1.0, 0.0]
    # float64 accumulates in float64; the rows' dtype is only read, never written
    assert token_sum(rows.double(), 2, torch.float64).dtype == torch.float64
    wide = torch.randn(6, 5, dtype=torch.bfloat16)
    expected = wide.float().view(3, 2, 5).sum(1)  # two terms: every order is the same
    assert torch.equal(token_sum(wide, 2, torch.float32), expected)
    assert token_sum(torch.empty(6, 0), 3, torch.float32).shape == (2, 0)  # no features: one empty row per token


def test_gather_routed_rows_refuses_what_is_no_dispatch():
    x, perm = torch.randn(6, 4), torch.arange(12)
    with pytest.raises(ValueError, match=r"mxfx.gather_routed_rows: perm has 12 entries; x of shape \(6, 4\)"):
        gather_routed_rows(x, perm, 3)
    with pytest.raises(ValueError, match="top_k=0 must be a positive int"):
        gather_routed_rows(x, perm, 0)
    with pytest.raises(ValueError, match=r"perm must be a 1D int32 or int64 permutation"):
        gather_routed_rows(x, perm.float(), 2)
    with pytest.raises(ValueError, match=r"x of shape \(6, 4, 1\) must be \[T, D\]"):
        gather_routed_rows(x[..., None], perm, 2)


def _layer(x, router_w, w_gate_up, w_down, topk, sort_indices=True):
    """A routed block as HF transformers writes it (its grouped experts): tokens gathered by a sort's indices."""
    weights, experts = F.linear(x, router_w).float().softmax(-1).topk(topk, dim=-1)
    flat = experts.reshape(-1)
    order = torch.sort(flat).indices if sort_indices else flat  # the expert ids themselves: not a permutation
    offs = torch.histc(flat.float(), bins=w_down.shape[0], min=-0.5, max=w_down.shape[0] - 0.5).cumsum(0).int()
    g, u = torch._grouped_mm(x[order // topk], w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w_down.transpose(-2, -1), offs=offs)
    y = y * weights.reshape(-1)[order].to(y.dtype)[:, None]
    return torch.zeros_like(x).index_add(0, order // topk, y)


def _run(options, sort_indices=True, dtype=torch.bfloat16, fmt="fp8_block", dynamic=False):
    torch.manual_seed(0)
    tokens, d, experts, topk = 48, 128, 4, 2
    x = torch.randn(tokens, d, dtype=dtype, requires_grad=True)
    shapes = ((experts, d), (experts, 256, d), (experts, d, 128))
    params = [(torch.randn(*s) * 0.2).to(dtype).requires_grad_() for s in shapes]
    torch._dynamo.reset()
    cap = GraphCapture()
    options = {"inner": cap, "format": fmt, **options}
    compiled = torch.compile(_layer, backend="mxfp8", dynamic=dynamic, options=options)
    out = compiled(x, *params, topk, sort_indices)
    out.float().square().sum().backward()
    return out.detach(), [t.grad for t in (x, *params)], cap, mxfx.last_report()


@pytest.mark.parametrize("fmt,dynamic", [("fp8_block", False), ("bf16_gemm", False), ("fp8_block", True)])
def test_dispatch_gather_gets_a_backward_without_scatter_add(fmt, dynamic):
    """Under dynamic shapes top-k is a symbolic size too (the pass takes it as one)."""
    out, grads, cap, pm = _run({}, fmt=fmt, dynamic=dynamic)
    off_out, off_grads, off_cap, off_pm = _run({"passes": {"dispatch_backward": False}}, fmt=fmt, dynamic=dynamic)
    # the dispatch gather's scatter-add is gone
    assert row_scatter_adds(off_cap.backward) >= 1 and row_scatter_adds(cap.backward) == 0
    rows = [r for r in pm.records if r.kind == "grouped_mm" and NOTE in r.reason]
    assert len(rows) == 1 and not any(NOTE in r.reason for r in off_pm.records), pm.to_text()
    # the same forward and the same gradients: x's is each token's two BF16 row gradients added, which both
    # backwards round once from the exact sum (the scatter-add adds into zeros, then once; the pass sums in FP32,
    # exactly for two BF16 terms); every other gradient is untouched by the pass
    assert torch.equal(out, off_out)
    for g, r in zip(grads, off_grads):
        assert torch.equal(g, r)


def test_a_gather_by_an_index_that_is_no_permutation_is_left_alone():
    """``x[ids // k]`` with expert ids as the index repeats tokens arbitrarily: the scatter-add is its gradient."""
    _, _, cap, pm = _run({}, sort_indices=False)
    assert row_scatter_adds(cap.backward) >= 1 and not any(NOTE in r.reason for r in pm.records), pm.to_text()


def _titan_layer(x, router_w, w_gate_up, w_down, topk):
    """A routed block as torchtitan writes it: argsort, ``// top_k``, a column index expanded over the features,
    ``torch.gather``, the route scores applied before the experts, a scatter_add combine."""
    scores, experts = F.linear(x, router_w).float().softmax(-1).topk(topk, dim=-1)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    top = scores.reshape(-1)[order]
    index = (order // topk).reshape(-1, 1).expand(-1, x.shape[-1])
    rows = torch.gather(x, dim=0, index=index)
    rows = (rows.to(torch.float32) * top.reshape(-1, 1)).to(x.dtype)
    offs = torch.histc(flat.float(), bins=w_down.shape[0], min=-0.5, max=w_down.shape[0] - 0.5).cumsum(0).int()
    g, u = torch._grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w_down.transpose(-2, -1), offs=offs)
    return torch.zeros_like(x).scatter_add(0, index, y)


def test_torchtitans_gather_form_gets_it_too():
    torch.manual_seed(0)
    tokens, d, experts, topk = 48, 128, 4, 2
    x = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
    shapes = ((experts, d), (experts, 256, d), (experts, d, 128))
    params = [(torch.randn(*s) * 0.2).bfloat16().requires_grad_() for s in shapes]

    def run(options):
        torch._dynamo.reset()
        for t in (x, *params):
            t.grad = None
        cap = GraphCapture()
        opts = {"inner": cap, "format": "fp8_block", **options}
        out = torch.compile(_titan_layer, backend="mxfp8", options=opts)(x, *params, topk)
        out.float().square().sum().backward()
        return out.detach(), [t.grad.clone() for t in (x, *params)], cap, mxfx.last_report()

    out, grads, cap, pm = run({})
    off_out, off_grads, off_cap, _ = run({"passes": {"dispatch_backward": False}})
    assert any(NOTE in r.reason for r in pm.records if r.kind == "grouped_mm"), pm.to_text()
    # torch.gather's gradient is a scatter-add too (aten.scatter_add): gone with the pass
    scatter_adds = [
        sum(1 for gm in c.backward for n in gm.graph.nodes if n.target is ATEN.scatter_add.default)
        for c in (cap, off_cap)
    ]
    assert scatter_adds[0] < scatter_adds[1], scatter_adds
    assert torch.equal(out, off_out)
    for g, r in zip(grads, off_grads):  # two BF16 terms a token: the same rounding (see the test above)
        assert torch.equal(g, r)
