"""The MoE rewrite on the main job's model: counts, the attention saved-input rule, saved bytes, special graphs."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxfx
from tests.helpers import GraphCapture, count_calls
from tests.models import MoE, MoETransformer, tiny_config

OPS = torch.ops.mxfx
E4M3 = torch.float8_e4m3fn


def _cfg(**kw):
    return tiny_config(**kw)


def _train_step(model, backend, options, *inputs):
    torch._dynamo.reset()
    compiled = (
        torch.compile(model, backend=backend, options=options) if options else torch.compile(model, backend=backend)
    )
    with torch.autocast("cpu", torch.bfloat16):
        out = compiled(*inputs)
    loss = out[1] if isinstance(out, tuple) else out.float().square().mean()
    loss.backward()
    return loss.detach()


def _saved_bytes(cap: GraphCapture) -> int:
    """Bytes of tensors the forward graph hands to backward (its outputs past the user outputs), one per storage:
    views of one tensor (an input reshaped for each linear that keeps it) hold its bytes once."""
    fw, bw = cap.forward[0], cap.backward[0]
    n_saved = len([n for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")])
    outs = list(fw.graph.output_node().args[0])
    storages = {}
    for n in outs[len(outs) - n_saved :]:
        v = n.meta.get("val") if hasattr(n, "meta") else None
        if (
            isinstance(v, torch.Tensor)
            and v.is_floating_point()
            or (isinstance(v, torch.Tensor) and v.dtype == torch.uint8)
        ):
            key = v.untyped_storage()._cdata  # fake tensors share their base's storage as real ones do
            storages[key] = max(storages.get(key, 0), v.numel() * v.element_size())
    return sum(storages.values())


def test_main_model_counts_and_attention_saved_rule():
    torch.manual_seed(0)
    model = MoETransformer(_cfg())
    idx = torch.randint(0, 256, (2, 32))
    cap = GraphCapture()
    _train_step(model, "mxfp8", {"inner": cap}, idx, idx)
    fw, bw = cap.forward, cap.backward
    assert count_calls(fw, OPS.mm.default) == 5  # qkv, o_proj, shared gate/up/down; router and lm_head stay
    assert count_calls(fw, OPS.grouped_mm.default) == 2
    # routed and shared SwiGLU fused (emulated: + values), writing the saved gate/up pairs too
    assert count_calls(fw, OPS.swiglu_quantize_dequantize_save.default) == 2
    assert count_calls(bw, OPS.route_weight_quantize_dequantize.default) == 1
    report = {(r.module, r.kind): r for r in mxfx.last_report().records}
    # The recipe's attention rule: the QKV input is saved as MXFP8, the output projection's stays BF16
    # because attention backward keeps that activation alive anyway.
    assert report[("layers.0.attn.qkv", "linear")].saved == "mxfp8"
    assert report[("layers.0.attn.o_proj", "linear")].saved == "bf16"
    # ... checked on what the backward graph actually receives: the token-blocked E4M3 copy of the
    # qkv input [d, tokens] and, for o_proj, the BF16 attention output [tokens, d].
    bw_inputs = [
        n.meta["val"]
        for n in bw[0].graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    assert any(v.dtype == E4M3 and tuple(v.shape) == (64, 64) for v in bw_inputs)
    fw_gm = fw[0]
    o_proj_in = [n for n in fw_gm.graph.nodes if n.target is OPS.mm.default][1].args[0]  # o_proj's rowwise qdata
    assert o_proj_in is not None
    assert any(v.dtype == torch.bfloat16 and tuple(v.shape) in ((64, 64), (2, 32, 64)) for v in bw_inputs)


def _activation_bytes(layer, backend_for) -> float:
    """Saved bytes that grow with the batch (activations, not weights): difference of two batch sizes."""
    sizes = []
    for batch in (2, 4):
        torch.manual_seed(0)
        x = torch.randn(batch, 64, 128, requires_grad=True)
        cap = GraphCapture()
        backend, options = backend_for(cap)
        _train_step(layer, backend, options, x)
        sizes.append(_saved_bytes(cap))
    return sizes[1] - sizes[0]


def test_moe_layer_saved_activation_bytes_at_least_40_percent_below_bf16():
    torch.manual_seed(0)
    layer = MoE(_cfg(d_model=128, expert_hidden=128, shared_hidden=128, n_experts=8))
    bf16 = _activation_bytes(layer, lambda cap: (cap, None))  # the capture alone: plain BF16 aot_autograd
    mx = _activation_bytes(layer, lambda cap: ("mxfp8", {"inner": cap}))
    assert mx <= 0.6 * bf16, (bf16, mx)


class _SetitemExperts(nn.Module):
    """In-place writes with no users (``operator.setitem``) next to a grouped GEMM."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 64, 64) * 0.1)

    def forward(self, x, offs):
        buf = x.new_empty(x.shape[0], 64)
        buf[:, :32] = x[:, :32]
        buf[:, 32:] = x[:, 32:] * 2
        return torch._grouped_mm(buf, self.w.to(torch.bfloat16).transpose(-2, -1), offs=offs).float().sum()


def test_grouped_rewrite_keeps_inplace_writes():
    torch.use_deterministic_algorithms(True, warn_only=True)
    old = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = True  # a dropped write would read NaN
    try:
        m, x = _SetitemExperts(), torch.randn(40, 64).bfloat16()
        offs = torch.tensor([16, 40], dtype=torch.int32)
        out = torch.compile(m, backend="mxfp8", options={"inner": "aot_eager"})(x, offs)
        ref = torch.compile(m, backend="mxfp8", options={"inner": "eager"})(x, offs)
        assert torch.isfinite(out) and torch.equal(out, ref)
        assert mxfx.last_report().count("grouped_mm", rewritten=True) == 1
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = old
        torch.use_deterministic_algorithms(False)


class _MaskedCombine(nn.Module):
    """Down projection, sentinel-row zeroing, then the route-weight multiply (HF transformers 5.17)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 64, 64) * 0.1)

    def forward(self, h, offs, rw, mask):
        y = torch._grouped_mm(h, self.w.to(torch.bfloat16).transpose(-2, -1), offs=offs)
        y = y.masked_fill(mask, 0.0)
        return (y * rw.unsqueeze(-1)).float().square().sum()


def test_combine_fuses_through_row_fills():
    m, h = _MaskedCombine(), torch.randn(40, 64).bfloat16().requires_grad_()
    offs, rw = torch.tensor([16, 40], dtype=torch.int32), torch.rand(40).bfloat16().requires_grad_()
    mask = (torch.arange(40) >= 37).unsqueeze(-1)
    cap = GraphCapture()
    out = torch.compile(m, backend="mxfp8", options={"inner": cap})(h, offs, rw, mask)
    out.backward()
    assert count_calls(cap.backward, OPS.route_weight_quantize_dequantize.default) == 1  # emulated: + values
    grads = (h.grad.clone(), rw.grad.clone())
    h.grad = rw.grad = None
    torch._dynamo.reset()
    ref = torch.compile(m, backend="mxfp8", options={"inner": "eager", "passes": {"combine": False}})(h, offs, rw, mask)
    ref.backward()
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=0)  # same MX products, bf16 output rounding
    assert ((grads[0] - h.grad).float().norm() / h.grad.float().norm()) < 2e-2  # fp32 vs bf16 dY before dgrad quantize
    torch.testing.assert_close(grads[1], rw.grad, rtol=2e-2, atol=1e-2)
    assert rw.grad[37:].abs().max() == 0  # masked rows contribute nothing


def test_inference_and_checkpointed_graphs():
    torch.manual_seed(0)
    lin_a, lin_b = nn.Linear(64, 64), nn.Linear(64, 64)

    def f(x):
        h = torch.utils.checkpoint.checkpoint(lambda t: F.silu(lin_a(t)), x, use_reentrant=False)
        return lin_b(h).sum()

    x = torch.randn(40, 64, requires_grad=True)
    cap = GraphCapture()
    loss = torch.compile(f, backend="mxfp8", options={"inner": cap, "fuse_wgrad_accumulation": False})(x)
    loss.backward()
    assert count_calls(cap.forward, OPS.mm.default) == 2  # the checkpointed linear is rewritten too
    assert count_calls(cap.backward, OPS.mm.default) == 5  # 2 x (dgrad + wgrad) + the recomputed forward
    eager = torch.compile(f, backend="mxfp8", options={"inner": "eager"})(x)
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-4)
    torch._dynamo.reset()
    cap = GraphCapture()
    with torch.no_grad():
        out = torch.compile(f, backend="mxfp8", options={"inner": cap})(x)
    assert count_calls(cap.forward, OPS.mm.default) == 2 and not cap.backward
    assert count_calls(cap.forward, OPS.quantize_dual.default) == 0  # nothing prepared for a backward
    torch.testing.assert_close(out, loss.detach(), rtol=1e-5, atol=1e-4)


def test_precision_map_picture(tmp_path):
    torch.manual_seed(0)
    model = MoE(_cfg())
    torch.compile(model, backend="mxfp8", options={"inner": "eager", "dump_dir": str(tmp_path)})(torch.randn(1, 32, 64))
    html = (tmp_path / f"graph_{mxfx.last_report().graph_id:03d}" / "precision.html").read_text()
    assert html.count("<tr>") == len(mxfx.last_report().records) + 1
    assert "#9be7a0" in html and "grouped_mm" in html


def _routed_layer(x, router_w, w_gate_up, w_down, topk):
    """The routed block as HF transformers writes it: each token gathered once per chosen expert."""
    weights, experts = F.linear(x, router_w).float().softmax(-1).topk(topk, dim=-1)
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    offs = (
        torch.histc(flat.float(), bins=w_down.shape[0], min=-0.5, max=w_down.shape[0] - 0.5).cumsum(0).to(torch.int32)
    )
    g, u = torch._grouped_mm(x[order // topk], w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w_down.transpose(-2, -1), offs=offs)
    y = y * weights.reshape(-1)[order].to(y.dtype)[:, None]
    return torch.zeros_like(x).index_add(0, order // topk, y)


def test_local_dispatch_quantized_before_its_row_gather():
    torch.manual_seed(0)
    tokens, d, experts, topk = 48, 64, 4, 2
    x = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
    params = [
        (torch.randn(*s) * 0.2).bfloat16().requires_grad_() for s in ((experts, d), (experts, 128, d), (experts, d, 64))
    ]

    def run(options):
        torch._dynamo.reset()
        for t in (x, *params):
            t.grad = None
        out = torch.compile(_routed_layer, backend="mxfp8", options=options)(x, *params, topk)
        out.float().square().sum().backward()
        return out.detach(), [t.grad.clone() for t in (x, *params)]

    cap = GraphCapture()
    out, grads = run({"inner": cap})
    # The gate_up GEMM's operand is made from the tokens (48 rows), not from their 96 gathered copies.
    fw = cap.forward[0].graph.nodes
    made = [n.args[0].meta["val"].shape[0] for n in fw if n.target is OPS.quantize_dequantize.default]
    assert made == [tokens], made
    notes = [r.reason for r in mxfx.last_report().records if r.kind == "grouped_mm" and "row gather" in r.reason]
    assert len(notes) == 1 and f"({tokens} rows, not {tokens * topk})" in notes[0], notes
    # quantize(x)[idx] == quantize(x[idx]): the hoist changes no bit of the output or of any gradient.
    ref_out, ref_grads = run({"inner": "aot_eager", "passes": {"dispatch_mx": False}})
    assert torch.equal(out, ref_out)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


@pytest.mark.parametrize("copies,saved", [(2, "bf16"), (1, "mxfp8")])
def test_local_dispatch_hoist_keeps_the_saved_precision(copies, saved):
    """What the gathered rows save does not depend on the hoist (its ``detach`` keeps nothing alive): with k
    copies of each token, keeping the BF16 tokens (2 bytes) beats an MX copy of the rows (k x 33/32 bytes)
    from k = 2; a permutation (k = 1) packs MXFP8. The expert weight gradient is the same to the bit."""
    torch.manual_seed(1)
    x0, w0 = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(2, 64, 64)
    idx = torch.arange(32 * copies) // copies
    offs = torch.tensor([16 * copies, 32 * copies], dtype=torch.int32)

    def f(x, w):
        return torch._grouped_mm(x[idx], w.to(torch.bfloat16).transpose(-2, -1), offs=offs)

    got = []
    for passes in ({}, {"dispatch_mx": False}):
        torch._dynamo.reset()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        torch.compile(f, backend="mxfp8", options={"inner": "aot_eager", "passes": passes})(
            x, w
        ).float().square().sum().backward()
        rec = next(r for r in mxfx.last_report().records if r.kind == "grouped_mm")
        got.append((rec.saved, rec.reason, x.grad, w.grad))
    assert got[0][0] == got[1][0] == saved, got[0][:2]
    if saved == "bf16":
        assert "re-gathered in backward" in got[0][1] and "re-gathered in backward" in got[1][1]
    assert torch.equal(got[0][2], got[1][2]) and torch.equal(got[0][3], got[1][3])


def test_grouped_mm_rejects_x_mx_that_is_not_the_pair_of_x():
    from mxfx.ops.grouped_mm import mx_grouped_mm_op

    x, w = torch.randn(64, 64).bfloat16(), torch.randn(2, 32, 64)
    offs = torch.tensor([32, 64], dtype=torch.int32)
    q, s = mxfx.quantize(x)
    with pytest.raises(ValueError, match=r"x_mx of shapes .* must be the MX pair of x \(64, 64\)"):
        mx_grouped_mm_op(x, w, offs, x_mx=(q, s, x[:32]))
    with pytest.raises(ValueError, match=r"x_mx must be \(qdata, scales\)"):
        mx_grouped_mm_op(x, w, offs, x_mx=(q,))
    with pytest.raises(ValueError, match=r"x_mx needs x's qdata \(float8_e4m3fn tensor\) and scales"):
        mx_grouped_mm_op(x, w, offs, x_mx=(None, s))
    with pytest.raises(TypeError, match=r"values in x_mx must be the dequantized tensor .* got torch.float8_e4m3fn"):
        mx_grouped_mm_op(x, w, offs, x_mx=(q, s, q))
    # a well-formed triple gives what the pair gives
    hat = mxfx.dequantize(q, s, dtype=torch.float32)
    pair = mx_grouped_mm_op(x, w, offs, x_mx=(q, s.view(torch.uint8)), x_mx_from="gather")
    assert torch.equal(mx_grouped_mm_op(x, w, offs, x_mx=(q, s.view(torch.uint8), hat), x_mx_from="gather"), pair)
