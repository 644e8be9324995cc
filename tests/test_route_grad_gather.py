"""A routed GEMM's output gradient read from its tokens (``mxfx.post_grad.route_grad_gather``): the rewrite of
Inductor's post-grad graph, and a compiled step with it and without."""

from __future__ import annotations

import torch
import torch.fx as fx
from mxfx.post_grad import route_grad_gather
from tests.test_lookup_batching import _step

_ROUTE_GRAD = torch.ops.mxfx.block_route_grad_operands.default
_GATHERED = torch.ops.mxfx.block_route_grad_operands_gathered.default


def _graph(index_dtype=torch.int64, gather_read_again=False):
    """``block_route_grad_operands(g[index], w, y, "rceil")`` over placeholders ``g [8, 128]``, ``index [16]``,
    ``w [16]``, ``y [16, 128]``, its four outputs returned (and the gathered rows, where read again)."""
    g = fx.Graph()
    vals = (torch.randn(8, 128), torch.randint(0, 8, (16,), dtype=index_dtype), torch.rand(16), torch.randn(16, 128))
    src, index, w, y = (g.placeholder(name) for name in ("g", "index", "w", "y"))
    for node, val in zip((src, index, w, y), vals):
        node.meta["val"] = val
    rows = g.call_function(torch.ops.aten.index.Tensor, (src, [index]))
    rows.meta["val"] = vals[0][vals[1]]
    op = g.call_function(_ROUTE_GRAD, (rows, w, y, "rceil"))
    op.meta["val"] = _ROUTE_GRAD(rows.meta["val"], vals[2], vals[3], "rceil")
    outs = [g.call_function(lambda t, i: t[i], (op, i)) for i in range(4)]
    g.output((*outs, rows) if gather_read_again else tuple(outs))
    return g, vals


def test_the_op_of_gathered_rows_becomes_the_gathered_op_with_the_same_values():
    for index_dtype in (torch.int64, torch.int32):
        g, vals = _graph(index_dtype)
        want = fx.GraphModule(torch.nn.Module(), g)(*vals)
        assert route_grad_gather.run(g) == 1
        g.lint()
        targets = [n.target for n in g.nodes if n.op == "call_function"]
        assert _GATHERED in targets and _ROUTE_GRAD not in targets
        assert torch.ops.aten.index.Tensor not in targets  # the gathered rows are no longer written out
        got = fx.GraphModule(torch.nn.Module(), g)(*vals)
        for a, b in zip(got, want):
            a, b = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (a, b))
            assert torch.equal(a, b)


def test_gathered_rows_read_elsewhere_stay_and_other_graphs_are_left_alone():
    g, _ = _graph(gather_read_again=True)
    assert route_grad_gather.run(g) == 1
    assert torch.ops.aten.index.Tensor in [n.target for n in g.nodes]
    g = fx.Graph()  # the op of rows that are no gather: nothing to do
    rows, w, y = (g.placeholder(n) for n in ("rows", "w", "y"))
    g.output(g.call_function(_ROUTE_GRAD, (rows, w, y, "rceil")))
    before = str(g)
    assert route_grad_gather.run(g) == 0 and str(g) == before


def test_a_compiled_step_reads_the_token_gradient_and_computes_the_same(monkeypatch):
    """The combine's backward gathers each token's gradient to its rows; with the rewrite the route-gradient op
    reads them from the tokens. Output and gradients are bit for bit those of the step without it: the same rows,
    elementwise values of the same formula (Inductor's CPU kernels are built without floating-point contraction)
    and the same op after them; no sum changes its order."""
    out, grads, code = _step(monkeypatch, True, route_grad_gather.ENV)
    ref_out, ref_grads, ref_code = _step(monkeypatch, False, route_grad_gather.ENV)
    assert "mxfx.block_route_grad_operands.default(" in ref_code
    assert "mxfx.block_route_grad_operands_gathered.default(" in code
    assert "mxfx.block_route_grad_operands.default(" not in code
    assert torch.equal(out, ref_out)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)
