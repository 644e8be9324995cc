"""The combine_sum pass and its op: each token's top-k expert rows summed with a gather on both sides."""

import pytest
import torch
import torch.nn.functional as F

import mxfx
from mxfx.ops.combine import sum_routed_rows
from mxfx.passes.combine_sum import NOTE
from tests.helpers import GraphCapture, row_scatter_adds, sorted_routing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_sum_routed_rows_is_the_combine_with_a_gather_for_its_gradient(dtype, top_k):
    tokens, d = 40, 48
    perm = sorted_routing(tokens, top_k, 16, seed=top_k)
    g = torch.Generator().manual_seed(2)
    y = torch.randn(tokens * top_k, d, generator=g).to(dtype).requires_grad_()
    d_out = torch.randn(tokens, d, generator=g).to(dtype)
    out = sum_routed_rows(y, perm, top_k)
    # each token's top_k rows: k - 1 FP32 additions (each within 2^-24 of the magnitudes summed) and one rounding
    # to y's dtype (2^-8 relative for BF16); a lost, doubled or misplaced row is off by a whole term
    index = perm // top_k
    exact = torch.zeros(tokens, d, dtype=torch.float64).index_add_(0, index, y.detach().double())
    magnitude = torch.zeros(tokens, d, dtype=torch.float64).index_add_(0, index, y.detach().double().abs())
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    assert out.dtype == dtype and out.shape == (tokens, d)
    assert ((out.double() - exact).abs() <= unit * exact.abs() + top_k * 2.0**-24 * magnitude).all()
    out.backward(d_out)
    assert y.grad.dtype == dtype and torch.equal(y.grad, d_out[index])  # row j gets its token's gradient


def test_sum_routed_rows_refuses_what_is_no_combine():
    y, perm = torch.randn(12, 4), torch.arange(12)
    with pytest.raises(ValueError, match=r"mxfx.sum_routed_rows: y of shape \(12, 4\) and perm of 10 entries"):
        sum_routed_rows(y, perm[:10], 2)
    with pytest.raises(ValueError, match=r"must both hold T \* top_k rows \(top_k=5\)"):
        sum_routed_rows(y, perm, 5)
    with pytest.raises(ValueError, match="top_k=0 must be a positive int"):
        sum_routed_rows(y, perm, 0)
    with pytest.raises(ValueError, match=r"perm must be a 1D int32 or int64 permutation"):
        sum_routed_rows(y, perm.float(), 2)
    with pytest.raises(ValueError, match=r"y must be \[T \* top_k, D\] rows of float16, .* got torch.int64"):
        sum_routed_rows(perm[:, None], perm, 2)
    with pytest.raises(ValueError, match=r"dequantize FP8 rows first\), got torch.float8_e4m3fn"):
        sum_routed_rows(y.to(torch.float8_e4m3fn), perm, 2)
    with pytest.raises(ValueError, match=r"perm must be a 1D int32 or int64 permutation on cpu, got torch.int16"):
        sum_routed_rows(y, perm.short(), 2)
    with pytest.raises(TypeError, match=r"mxfx.sum_routed_rows: takes tensors, got list rows"):
        sum_routed_rows(y.tolist(), perm, 2)
    with pytest.raises(TypeError, match=r"got Tensor rows and a list perm"):
        sum_routed_rows(y, perm.tolist(), 2)


def test_sum_routed_rows_sums_float64_in_float64_and_a_non_permutation_the_same_way_each_time():
    perm = torch.tensor([1, 0, 3, 2])
    y = torch.tensor([[1.0], [2.0**-40], [3.0], [-3.0]], dtype=torch.float64)
    assert sum_routed_rows(y, perm, 2).tolist() == [[1.0 + 2.0**-40], [0.0]]  # float32 would lose 2^-40
    broken = torch.tensor([0, 2, 2, 3])  # no permutation: slot 1 never written (zeros: the first row)
    first = sum_routed_rows(y, broken, 2)
    assert all(torch.equal(sum_routed_rows(y, broken, 2), first) for _ in range(20))


def _experts(x, router_w, w_gate_up, w_down, topk, order_of):
    """Route, sort by expert (``order_of`` makes the order from the flat expert ids), run the experts: the sorted
    rows, each weighted by its route weight, and the order."""
    weights, experts = F.linear(x, router_w).float().softmax(-1).topk(topk, dim=-1)
    flat = experts.reshape(-1)
    order = order_of(flat)
    offs = torch.histc(flat.float(), bins=w_down.shape[0], min=-0.5, max=w_down.shape[0] - 0.5).cumsum(0).int()
    g, u = torch._grouped_mm(x[order // topk], w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w_down.transpose(-2, -1), offs=offs)
    return y * weights.reshape(-1)[order].to(y.dtype)[:, None], order


def _sorted(flat):
    return torch.sort(flat).indices


def _index_add_layer(x, *params, topk=2, order_of=_sorted, into=None):
    """HF transformers' older blocks: a scatter-add of the rows into zeros by ``order // topk``."""
    y, order = _experts(x, *params, topk, order_of)
    base = torch.zeros_like(x) if into is None else into(x)
    return base.index_add(0, order // topk, y)


def _unsort_layer(x, *params, topk=2, order_of=_sorted, inverse="setitem"):
    """HF transformers' grouped experts: the rows put back in pair order, then each token's rows summed."""
    y, order = _experts(x, *params, topk, order_of)
    if inverse == "setitem":
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.size(0), device=order.device)
    elif inverse == "argsort":
        inv = order.argsort()
    else:  # the order itself: rows permuted again, not put back (not a combine)
        inv = order
    return y[inv].view(x.shape[0], topk, x.shape[1]).sum(dim=1).to(x.dtype)


def _unsort_layer_last_but_one(x, *params, topk=2):
    """As :func:`_unsort_layer`, summing over dim -2 (the k axis counted from the end)."""
    y, order = _experts(x, *params, topk, _sorted)
    return y[order.argsort()].view(x.shape[0], topk, x.shape[1]).sum(-2).to(x.dtype)


def _titan_layer(x, *params, topk=2, order_of=_sorted):
    """torchtitan: a scatter_add of the rows into zeros by the token index as an expanded column."""
    y, order = _experts(x, *params, topk, lambda flat: torch.argsort(flat, stable=True))
    index = (order // topk).reshape(-1, 1).expand(-1, x.shape[-1])
    return torch.zeros_like(x).scatter_add(0, index, y)


def _run(layer, options, dynamic=False, fmt="fp8_block", **kw):
    torch.manual_seed(0)
    tokens, d, experts = 48, 128, 4
    x = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
    shapes = ((experts, d), (experts, 256, d), (experts, d, 128))
    params = [(torch.randn(*s) * 0.2).bfloat16().requires_grad_() for s in shapes]
    torch._dynamo.reset()
    cap = GraphCapture()
    opts = {"inner": cap, "format": fmt, **options}
    out = torch.compile(lambda *a: layer(*a, **kw), backend="mxfp8", dynamic=dynamic, options=opts)(x, *params)
    out.float().square().sum().backward()
    return out.detach(), [t.grad for t in (x, *params)], cap, mxfx.last_report()


@pytest.mark.parametrize(
    "layer, kw, where",
    [
        (_index_add_layer, {}, "forward"),
        (_titan_layer, {}, "forward"),
        (_unsort_layer, {}, "backward"),
        (_unsort_layer, {"inverse": "argsort"}, "backward"),
        (_unsort_layer_last_but_one, {}, "backward"),
    ],
    ids=[
        "hf index_add",
        "torchtitan scatter_add",
        "hf grouped: setitem inverse",
        "hf grouped: argsort inverse",
        "hf grouped: sum over dim -2",
    ],
)
@pytest.mark.parametrize("dynamic", [False, True])
def test_each_spelling_of_the_combine_sums_with_gathers(layer, kw, where, dynamic):
    """The scatter-add (in the forward, or the gather's gradient in the backward) is gone; the record of the down
    projection says so; the forward and every gradient equal the unrewritten graph's: two BF16 rows a token, whose
    FP32 sum is exact and rounded once either way, and the rows' gradient is a copy of the tokens' in both."""
    out, grads, cap, pm = _run(layer, {}, dynamic=dynamic, **kw)
    off_out, off_grads, off_cap, off_pm = _run(layer, {"passes": {"combine_sum": False}}, dynamic=dynamic, **kw)
    graphs = {"forward": "forward", "backward": "backward"}[where]
    assert row_scatter_adds(getattr(off_cap, graphs)) >= 1
    assert row_scatter_adds(getattr(cap, graphs)) < row_scatter_adds(getattr(off_cap, graphs))
    noted = [r for r in pm.records if r.kind == "grouped_mm" and NOTE in r.reason]
    assert len(noted) == 1 and not any(NOTE in r.reason for r in off_pm.records), pm.to_text()
    assert torch.equal(out, off_out)
    for g, r in zip(grads, off_grads):
        assert torch.equal(g, r)


def test_the_compiled_combine_matches_eager():
    """The graph with the pass and mxfx's BF16 GEMMs (``bf16_gemm``: the passes run, nothing is quantized) against
    the layer run eagerly: BF16 roundings in another order only (relative norm; 2^-8 a rounding)."""
    out, grads, _, pm = _run(_unsort_layer, {}, fmt="bf16_gemm")
    assert any(NOTE in r.reason for r in pm.records), pm.to_text()
    torch.manual_seed(0)
    tokens, d, experts = 48, 128, 4
    x = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
    shapes = ((experts, d), (experts, 256, d), (experts, d, 128))
    params = [(torch.randn(*s) * 0.2).bfloat16().requires_grad_() for s in shapes]
    eager = _unsort_layer(x, *params)
    eager.float().square().sum().backward()
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(out, eager.detach()) < 2**-6
    for g, r in zip(grads, (x.grad, *(p.grad for p in params))):
        assert rel(g, r) < 2**-6


@pytest.mark.parametrize(
    "layer, kw",
    [
        (_index_add_layer, {"order_of": lambda flat: flat}),  # expert ids: tokens repeat arbitrarily
        (_index_add_layer, {"into": lambda x: x * 2}),  # summed into the tokens, not into zeros
        (_unsort_layer, {"inverse": "none"}),  # rows gathered by the sort's order again, not by its inverse
    ],
    ids=["index not a permutation", "into non-zeros", "no inverse"],
)
def test_what_is_no_combine_sum_is_left_alone(layer, kw):
    _, _, cap, pm = _run(layer, {}, **kw)
    assert not any(NOTE in r.reason for r in pm.records), pm.to_text()
    assert row_scatter_adds(cap.forward) + row_scatter_adds(cap.backward) >= 1


def _edited_index(x, *params, topk=2):
    y, order = _experts(x, *params, topk, _sorted)
    index = order // topk
    index[:3] = 0  # an in-place edit: the first rows go to token 0, so the sum is no combine of a permutation
    return torch.zeros_like(x).index_add(0, index, y)


def _edited_inverse(x, *params, topk=2):
    y, order = _experts(x, *params, topk, _sorted)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.size(0), device=order.device)
    inv.clamp_(max=5)
    return y[inv].view(x.shape[0], topk, x.shape[1]).sum(dim=1)


def _narrow_scatter(x, *params, topk=2):
    y, order = _experts(x, *params, topk, _sorted)
    index = (order // topk).reshape(-1, 1).expand(-1, x.shape[-1] // 2)  # scatters the left half of each row
    return torch.zeros_like(x).scatter_add(0, index, y)


def _edited_through(view):
    """A layer whose sort order is edited in place through ``view(order)`` before the combine reads it."""

    def layer(x, *params, topk=2):
        y, order = _experts(x, *params, topk, _sorted)
        view(order).zero_()
        return torch.zeros_like(x).index_add(0, order // topk, y)

    return layer


def _rows_edited_after_gather(x, *params, topk=2):
    y, order = _experts(x, *params, topk, _sorted)
    gathered = y[order.argsort()]
    y.mul_(2)  # after the gather: eager's gathered rows are the ones before it
    return gathered.view(x.shape[0], topk, x.shape[1]).sum(1)


@pytest.mark.parametrize(
    "layer",
    [
        _edited_index,
        _edited_inverse,
        _narrow_scatter,
        _edited_through(lambda o: torch.as_strided(o, (5,), (1,))),
        _edited_through(lambda o: torch.t(o)[:5]),
        _edited_through(lambda o: torch.movedim(o, 0, 0)[:5]),
        _edited_through(lambda o: o.unfold(0, 2, 2)[:3]),
        _edited_through(lambda o: torch.tensor_split(o, 4)[0]),
        _rows_edited_after_gather,
    ],
    ids=[
        "index edited",
        "inverse edited",
        "narrow scatter",
        "through torch.as_strided",
        "through torch.t",
        "through torch.movedim",
        "through unfold",
        "through torch.tensor_split",
        "rows edited after the gather",
    ],
)
def test_an_index_written_in_place_or_narrower_than_the_rows_is_no_combine(layer):
    """Where the graph edits the index (or a view of it, by any view op) in place, edits the rows after gathering
    them, or scatters only some columns, the sum is left as written: the result is eager's (mxfx's BF16 GEMMs;
    forward only: autograd refuses the narrow scatter)."""
    torch.manual_seed(0)
    tokens, d, experts = 48, 128, 4
    x = torch.randn(tokens, d, dtype=torch.bfloat16)
    params = [(torch.randn(*s) * 0.2).bfloat16() for s in ((experts, d), (experts, 256, d), (experts, d, 128))]
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(layer, backend="mxfp8", options={"format": "bf16_gemm"})(x, *params)
        eager = layer(x, *params)
    assert not any(NOTE in r.reason for r in mxfx.last_report().records), mxfx.last_report().to_text()
    assert ((out.float() - eager.float()).norm() / eager.float().norm()).item() < 2**-6
