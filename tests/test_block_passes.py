"""format="fp8_block" behind the passes: the policy field, the ops against the format's reference decode, the
weight cache, and every pass on the main job's MoE model and on an HF model in FP32 under autocast."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mxfx
from mxfx.numerics import block as bf
from mxfx import formats
from mxfx.runtime import cache
from mxfx import device
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear
from mxfx.policy import Policy, Rule
from tests.helpers import lm_loss_and_grads
from tests.models import MoETransformer, tiny_config


def _decode_rows(x):
    """Reference operand: x in 1x128 tiles along its last dim, decoded exactly (float32)."""
    return bf.dequantize_values(*bf.quantize_1x128(x), (-1,))


def _decode_weight(w):
    return bf.dequantize_values(*bf.quantize_128x128(w), (-2, -1))


def _assert_gemm_of(got, a_hat, b_hat, bias=None):
    """``got`` is the FP32 GEMM ``a_hat @ b_hat^T (+ bias)`` of the decoded operands in some summation order:
    within ``(K + 1) * 2^-23 * (|a_hat| @ |b_hat|^T + |bias|)`` elementwise, what two FP32 orders of the K exact
    products (and the bias) may differ by (tests/test_block_gemm.py's bound). The order is the BLAS's choice and
    may change with the operands' layouts (the dgrad reads the forward grid transposed), so bit equality is not
    guaranteed; a wrong tile, scale or rounding moves values by E4M3 steps (2^-4 relative), far outside it."""
    ref = a_hat @ b_hat.t() + (0 if bias is None else bias)
    mag = a_hat.abs() @ b_hat.abs().t() + (0 if bias is None else bias.abs())
    err = (got - ref).abs()
    assert (err <= (a_hat.shape[-1] + 1) * 2.0**-23 * mag).all(), err.max()


# --- policy ------------------------------------------------------------------------------------


def test_policy_format_global_per_rule_and_auto(monkeypatch):
    assert Policy().decide("linear", "a").settings.format.name == "mxfp8"
    assert Policy(format="fp8_block").decide("linear", "a").settings.format.name == "fp8_block"
    p = Policy(rules=[{"op": "grouped_mm", "format": "fp8_block"}])
    assert (p.decide("linear", "a").format.name, p.decide("grouped_mm", "e").format.name) == ("mxfp8", "fp8_block")
    with pytest.raises(ValueError, match="format='fp4'"):
        Policy(format="fp4")
    with pytest.raises(ValueError, match="format"):
        Rule(format="mx")
    # floor is an MX scale rule: the decision for an fp8_block op refuses it, naming the format
    with pytest.raises(ValueError, match="scale_rule='floor' is not a rule of format='fp8_block'"):
        Policy(format="fp8_block", scale_rule="floor").decide("linear", "a")
    assert Policy(format="fp8_block", scale_rule="amax").decide("linear", "a").settings.scale_rule == "amax"
    # "auto": fp8_block where the GPU is Hopper, mxfp8 on Blackwell and CPU
    assert formats.get("auto", torch.device("cpu")).name == "mxfp8"
    assert Policy(format="auto").decide("linear", "a").format is formats.get("auto")
    for cap, fmt in (((9, 0), "fp8_block"), ((10, 0), "mxfp8"), ((12, 0), "mxfp8")):
        monkeypatch.setattr(device, "capability", lambda d, cap=cap: cap)
        assert formats.get("auto", torch.device("cuda", 0)).name == fmt


# --- ops against the reference decode ------------------------------------------------------------


def test_block_linear_swiglu_bias_and_feature_check():
    torch.manual_seed(1)
    g, u = (torch.randn(64, 128, requires_grad=True) for _ in range(2))
    w, b = torch.randn(128, 128, requires_grad=True), torch.randn(128, requires_grad=True)
    y = mx_linear(g, w, b, up=u, format="fp8_block")
    h = F.silu(g.detach()) * u.detach()
    _assert_gemm_of(y, _decode_rows(h), _decode_weight(w.detach()), b.detach())
    dy = torch.randn(64, 128)
    y.backward(dy)
    g2, u2, w2, b2 = (t.detach().clone().requires_grad_() for t in (g, u, w, b))
    F.linear(F.silu(g2) * u2, w2, b2).backward(dy)
    for got, ref in ((g.grad, g2.grad), (u.grad, u2.grad), (w.grad, w2.grad)):
        # E4M3 operands (relative step 2^-4) in three GEMMs: within 10% in norm of the exact gradients
        assert (got - ref).norm() / ref.norm() < 0.1
    assert torch.equal(b.grad, dy.sum(0))  # the bias gradient is a plain fp32 sum of dy
    with pytest.raises(ValueError, match="multiples of 128"):
        mx_linear(torch.randn(4, 96), torch.randn(128, 96), format="fp8_block")


def _saved_fp8_shapes(fn) -> list[tuple]:
    """Shapes of the E4M3 tensors autograd saves while ``fn()`` runs its forward."""
    shapes = []

    def pack(t):
        if t.dtype == torch.float8_e4m3fn:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_block_ops_name_themselves_in_their_errors():
    """The fp8_block ops check their inputs before the reference or kernel does, and say which op refused what."""
    ops = torch.ops.mxfx
    x = torch.randn(6, 128)
    with pytest.raises(
        TypeError, match=r"mxfx::block_quantize_dual \(x\): input of shape \(6, 128\) has dtype torch.int32"
    ):
        ops.block_quantize_dual(x.int(), "rceil")
    with pytest.raises(ValueError, match="mxfx::block_quantize: unknown fp8_block scale rule 'floor'"):
        ops.block_quantize(x, "floor")
    with pytest.raises(TypeError, match=r"mxfx::block_forward_operands \(up\)"):
        ops.block_forward_operands(x, x.long(), None, None, "rceil", False)
    with pytest.raises(ValueError, match=r"no features to quantize"):
        ops.block_quantize(torch.randn(6, 0), "rceil")
    with torch._subclasses.fake_tensor.FakeTensorMode():  # the fake implementations check as the ops do
        with pytest.raises(ValueError, match="mxfx::block_swiglu_quantize: up of shape"):
            ops.block_swiglu_quantize(torch.empty(4, 128), torch.empty(3, 128), "rceil")
        with pytest.raises(ValueError, match="unknown fp8_block scale rule"):
            ops.block_quantize(torch.empty(4, 128), "nope")
    with pytest.raises(ValueError, match=r"tokens_src of shape \(5, 128\) must have x's shape \(6, 128\)"):
        ops.block_forward_operands(x, None, torch.randn(5, 128), None, "rceil", False)
    with pytest.raises(ValueError, match="offs must be contiguous int32"):
        ops.block_forward_operands(x, None, x, torch.tensor([2, 6]), "rceil", False)
    with pytest.raises(
        ValueError,
        match=r"mxfx::block_quantize_grouped_tokens: offs \[2, 9\] must be non-decreasing .* at most the 6 rows",
    ):
        ops.block_quantize_grouped_tokens(x, torch.tensor([2, 9], dtype=torch.int32), "rceil")
    for fmt in ("fp8_block", "mxfp8"):  # the public op names itself, in both formats
        with pytest.raises(ValueError, match=r"mxfx.grouped_mm: offs \[4, 9\] must be non-decreasing"):
            mx_grouped_mm_op(
                torch.randn(8, 128), torch.randn(2, 128, 128), torch.tensor([4, 9], dtype=torch.int32), format=fmt
            )
    with pytest.raises(ValueError, match="needs a 2D tensor"):
        ops.block_swiglu_quantize(x[None], x[None], "rceil")


def test_block_forward_operands_takes_zero_padded_tokens():
    """The dense token-tiled operand may come from x with zero rows appended (a symbolic token count padded to whole
    tiles): its first columns are x's own token tiles, the rest zeros with scale 1; other features, or fewer rows,
    are refused."""
    x = torch.randn(6, 128)
    q, s, qt, st = torch.ops.mxfx.block_forward_operands(x, None, F.pad(x, (0, 0, 0, 250)), None, "rceil", False)
    ref_q, ref_s = bf.quantize_1x128(x.t())
    assert qt.shape == (128, 256) and st.shape == (128, 2)
    assert torch.equal(qt[:, :6].view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(st[:, :1], ref_s)
    assert not qt[:, 6:].float().any() and torch.equal(st[:, 1], torch.ones(128))
    with pytest.raises(ValueError, match=r"tokens_src of shape \(256, 256\) must have x's shape \(6, 128\)"):
        torch.ops.mxfx.block_forward_operands(x, None, torch.zeros(256, 256), None, "rceil", False)


def test_weight_cache_one_grid_for_forward_and_dgrad_per_step():
    cache.clear()
    cache.reset_stats()
    w = torch.randn(256, 128, requires_grad=True)
    x = torch.randn(32, 128, requires_grad=True)
    mx_linear(x, w, format="fp8_block").sum().backward()
    assert cache.stats().get("quantize_block") == 1  # forward and dgrad from one 128x128 quantize
    cache.set_dgrad_at_refresh(True)  # keep the forms read below (a backward drops them with one microbatch)
    qf, sf = cache.weight_form(w, "rceil", "block_forward")
    qd, sd = cache.weight_form(w, "rceil", "block_dgrad")
    assert torch.equal(qd.view(torch.uint8), qf.t().view(torch.uint8)) and torch.equal(sd, sf.t())
    with torch.no_grad():
        w.mul_(2.0)  # an optimizer step: the version counter moves
    mx_linear(x, w, format="fp8_block").sum().backward()
    assert cache.stats()["quantize_block"] == 3  # the lookups after the backward, then the changed weight
    assert torch.equal(cache.weight_form(w, "rceil", "block_forward")[1], 2 * sf)  # rceil: scales double, payload kept
    cache.set_dgrad_at_refresh(False)


def test_weight_refresh_record_names_the_format_of_the_caches():
    """A compiled optimizer step of an fp8_block model: its refresh record reads fp8_block, whether the step's policy
    says so or, compiled without options after the first forward, the caches it finds do."""

    def refresh_record(step_options, forward_first: bool):
        torch.manual_seed(0)
        lin = torch.nn.Linear(128, 128, bias=False)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        torch._dynamo.reset()
        cache.clear()
        fwd = torch.compile(lin, backend="mxfp8", options={"inner": "aot_eager", "format": "fp8_block"})
        step = torch.compile(opt.step, backend="mxfp8", options=step_options)
        if forward_first:
            fwd(torch.randn(32, 128)).sum().backward()
        else:
            lin.weight.grad = torch.ones_like(lin.weight)  # the step compiles before any cache exists
        step()
        return next(r for rep in reversed(mxfx.all_reports()) for r in rep.records if r.kind == "weight_refresh")

    own = refresh_record({"inner": "aot_eager", "format": "fp8_block"}, forward_first=False)
    assert (own.forward, own.dgrad) == ("fp8_block", "fp8_block") and "format of this policy" in own.reason
    found = refresh_record({"inner": "aot_eager"}, forward_first=True)  # the step's policy says mxfp8
    assert (found.forward, found.dgrad) == ("fp8_block", "fp8_block") and "caches held" in found.reason


def test_weight_cache_step_keeps_the_forward_grid_and_the_backward_transposes_it():
    """An optimizer step rebuilds ``block_forward`` and drops ``block_dgrad``; the next backward makes it by
    transposing the forward grid (no second 128x128 quantize), equal to a from-scratch dgrad form; with one
    microbatch per step it is not kept, and the forward grid is dropped with it until the next step."""
    cache.clear()
    cache.install()
    w = torch.randn(256, 128, requires_grad=True)
    x = torch.randn(32, 128, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    mx_linear(x, w, format="fp8_block").sum().backward()
    opt.step()
    forms = cache.entry_forms(w)
    assert set(forms) == {("rceil", "block_forward")}
    assert cache.persistent_bytes(w) == w.numel() + 4 * 2 * 1  # e4m3 payload + f32 scales [2, 1]
    cache.reset_stats()
    x.grad = None
    mx_linear(x, w, format="fp8_block").sum().backward()
    assert cache.stats()["quantize_block"] == 0 and cache.stats()["stale"] == 0
    assert cache.stats()["transient_dgrad"] == 1 and cache.entry_forms(w) == {} and cache.persistent_bytes(w) == 0
    # the dgrad GEMM read the forward grid transposed: x.grad is the reference decode's
    _assert_gemm_of(x.grad, _decode_rows(torch.ones(32, 256)), _decode_weight(w.detach().t()))
    opt.step()
    assert set(cache.entry_forms(w)) == {("rceil", "block_forward")}  # the refresh rebuilt the dropped grid


# --- passes --------------------------------------------------------------------------------------


def _moe(**kw):
    torch.manual_seed(0)
    return MoETransformer(tiny_config(**{"d_model": 128, "expert_hidden": 128, "shared_hidden": 128, **kw}))


def _loss(model, options, ids):
    torch._dynamo.reset()
    fn = torch.compile(model, backend="mxfp8", options=options)
    with torch.autocast("cpu", torch.bfloat16):
        loss = fn(ids, ids)[1]
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def test_every_pass_on_the_moe_model_with_fp8_block():
    model = _moe()
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    opts = {"format": "fp8_block", "inner": "aot_eager"}
    loss, grads = _loss(model, opts, ids)
    pm = mxfx.last_report()
    lin = [r for r in pm.records if r.kind == "linear" and r.rewritten]
    grouped = [r for r in pm.records if r.kind == "grouped_mm"]
    assert len(lin) == 5 and all((r.forward, r.dgrad, r.wgrad) == ("fp8_block",) * 3 for r in lin), pm.to_text()
    assert len(grouped) == 2 and all(
        (r.forward, r.dgrad, r.wgrad) == ("fp8_block", "fp8_block", "bf16") for r in grouped
    ), pm.to_text()
    assert all("forward and dgrad on the reference kernel" in r.reason for r in grouped), pm.to_text()  # CPU
    assert all(r.forward == "fp8_block" for r in pm.records if r.kind == "swiglu") and pm.count("swiglu", True) == 2, (
        pm.to_text()
    )
    assert [r.dgrad for r in pm.records if r.kind == "combine"] == ["fp8_block"], pm.to_text()
    assert "mxfp8" not in pm.to_text()
    # against the passes turned off (the model's own BF16 autocast GEMMs): FP8 operands move a
    # 1-layer model's loss by well under 2% and keep every gradient aligned with the BF16 one
    off = {**opts, "passes": dict.fromkeys(("linear", "grouped_mm", "swiglu", "combine", "saved"), False)}
    loss_off, grads_off = _loss(model, off, ids)
    assert loss != loss_off and abs(loss - loss_off) / loss_off < 0.02
    for n, g in grads_off.items():
        assert F.cosine_similarity(grads[n].flatten(), g.flatten(), dim=0) > 0.97, n
    # eager (the rewritten graph run as written) vs compiled through AOTAutograd: the same fp8_block ops; the
    # model's BF16 autocast ops (attention, norms) are decomposed there, whose last-bit differences can flip
    # an FP8 rounding downstream: a bound of 1% in norm, against the ~4% the FP8 rounding itself moves them
    loss_eager, grads_eager = _loss(model, {**opts, "inner": "eager"}, ids)
    torch.testing.assert_close(loss_eager, loss, rtol=1e-5, atol=0)
    for n, g in grads.items():
        assert (grads_eager[n] - g).norm() <= 1e-2 * g.norm(), n


def test_per_rule_format_and_bf16_fallback_reason():
    model = _moe(shared_hidden=96)  # the shared expert's 96 features cannot tile by 128
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match=r"\(module='\*shared\*', format='fp8_block'\) asks for fp8_block, but 3 op"):
        _loss(
            model,
            {
                "inner": "aot_eager",
                "rules": [{"op": "grouped_mm", "format": "fp8_block"}, {"module": "*shared*", "format": "fp8_block"}],
            },
            ids,
        )
    pm = mxfx.last_report()
    assert {r.forward for r in pm.records if r.kind == "grouped_mm"} == {"fp8_block"}, pm.to_text()
    attn = [r for r in pm.records if r.kind == "linear" and "attn" in r.module]
    assert attn and all(r.forward == "mxfp8" for r in attn), pm.to_text()
    shared = [r for r in pm.records if r.kind == "linear" and "shared" in r.module]
    assert shared and all(r.forward == "bf16" and "multiples of 128" in r.reason for r in shared), pm.to_text()


def test_hf_fp32_autocast_experts_with_fp8_block():
    T = pytest.importorskip("transformers")
    cfg = T.OlmoeConfig(
        vocab_size=128,
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
    )
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    model = T.OlmoeForCausalLM(cfg)  # FP32 parameters, BF16 autocast
    loss, grads = lm_loss_and_grads(model, "mxfp8", {"format": "fp8_block", "inner": "aot_eager"})
    pm = mxfx.last_report()
    grouped = [r for r in pm.records if r.kind == "grouped_mm"]
    assert len(grouped) == 2 and all(r.forward == "fp8_block" for r in grouped), pm.to_text()
    assert pm.count("swiglu", True) == 1 and pm.count("combine", True) == 1, pm.to_text()
    loss_ref, grads_ref = lm_loss_and_grads(model)  # transformers' own FP32 experts under autocast
    assert loss != loss_ref and abs(loss - loss_ref) / loss_ref < 0.02
    experts = [n for n in grads_ref if ".experts." in n and grads_ref[n].dim() == 3]
    assert len(experts) == 2
    for n in experts:
        assert F.cosine_similarity(grads[n].flatten(), grads_ref[n].flatten(), dim=0) > 0.97, n


@pytest.mark.parametrize(
    "kw",
    [
        dict(format="fp8_block", scale_rule="floor"),
        dict(scale_rule="amax"),
        dict(format="auto", scale_rule="floor"),
        dict(rules=[{"op": "linear", "format": "fp8_block", "scale_rule": "floor"}]),
    ],
)
def test_policy_rejects_a_scale_rule_of_another_format(kw):
    """At construction, not at the first compiled call: floor is MXFP8's only, amax fp8_block's only."""
    with pytest.raises(ValueError, match="is not a rule of format"):
        mxfx.Policy(**kw)
    assert mxfx.Policy(format="fp8_block", scale_rule="amax").scale_rule == "amax"


def _saved_storages(out: torch.Tensor) -> dict:
    """``{storage pointer: (bytes, dtype)}`` of every tensor the autograd graph behind ``out`` saved."""
    return {
        t.untyped_storage().data_ptr(): (t.untyped_storage().nbytes(), t.dtype)
        for t in mxfx.report.saved_for_backward(out)
    }


def test_compiled_fp8_block_swiglu_saves_fp8_gate_and_up():
    """The SwiGLU inputs of a routed block are saved as FP8 pairs in the compiled graph, not as the BF16 gate_up
    output: the quantizations are one op with the forward operand's, which the partitioner cannot move into the
    backward (it moved a lone quantize there and saved its BF16 input instead)."""
    s, d, e, h = 512, 128, 4, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s, d, generator=g).bfloat16().requires_grad_()
    w_gate_up = (torch.randn(e, 2 * h, d, generator=g) * 0.05).bfloat16().requires_grad_()
    w_down = (torch.randn(e, d, h, generator=g) * 0.05).bfloat16().requires_grad_()
    offs = torch.tensor([100, 260, 260, 512], dtype=torch.int32)

    def block(x, w_gate_up, w_down):
        gate, up = torch._grouped_mm(x, w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)

    torch._dynamo.reset()
    out = torch.compile(block, backend="mxfp8", options={"format": "fp8_block", "inner": "aot_eager"})(
        x, w_gate_up, w_down
    )
    assert mxfx.last_report().count("swiglu", True) == 1
    saved = _saved_storages(out)
    gate_up_bytes = s * 2 * h * 2
    assert not [b for b, dt in saved.values() if dt == torch.bfloat16 and b >= gate_up_bytes], saved
    assert sum(1 for b, dt in saved.values() if dt == torch.float8_e4m3fn and b == s * h) >= 2, saved  # gate, up


def _local_dispatch(x, router_w, w_gate_up, w_down):
    """A routed block with local dispatch as HF writes it: each token gathered once per expert it is routed to."""
    weights, experts = F.linear(x, router_w).float().softmax(-1).topk(2, dim=-1)
    order = experts.reshape(-1).argsort(stable=True)
    offs = torch.histc(experts.reshape(-1).float(), bins=w_down.shape[0], min=-0.5, max=w_down.shape[0] - 0.5)
    offs = offs.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x[order // 2], w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)
    y = y * weights.reshape(-1)[order].to(y.dtype)[:, None]
    return torch.zeros_like(x).index_add(0, order // 2, y)


def test_fp8_block_local_dispatch_quantizes_tokens_before_the_gather():
    """x's 1x128 tiles gathered per routed row are the tiles of the gathered rows (a tile lies in one row), so
    quantizing the tokens before the gather gives bit-identical outputs and gradients, and the BF16 gathered rows
    are not saved for backward (the partitioner recomputes the gather)."""
    g = torch.Generator().manual_seed(0)
    args = [
        (torch.randn(256, 128, generator=g)).bfloat16(),
        (torch.randn(4, 128, generator=g) * 0.1).bfloat16(),
        (torch.randn(4, 256, 128, generator=g) * 0.05).bfloat16(),
        (torch.randn(4, 128, 128, generator=g) * 0.05).bfloat16(),
    ]

    def run(dispatch: bool):
        torch._dynamo.reset()
        leaves = [a.clone().requires_grad_() for a in args]
        options = {"format": "fp8_block", "inner": "aot_eager", "passes": {"dispatch_mx": dispatch}}
        out = torch.compile(_local_dispatch, backend="mxfp8", options=options)(*leaves)
        saved = sum(b for b, _ in _saved_storages(out).values())
        out.float().square().sum().backward()
        return out.detach(), [t.grad for t in leaves], saved, mxfx.last_report()

    out, grads, saved, pm = run(True)
    out_ref, grads_ref, saved_ref, _ = run(False)
    assert any("before the dispatch's row gather" in r.reason for r in pm.records if r.kind == "grouped_mm"), (
        pm.to_text()
    )
    assert torch.equal(out, out_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    assert saved_ref - saved >= 512 * 128 * 2  # the BF16 gathered rows [512, 128]


def test_fp8_block_refuses_an_mx_pair_as_x_tiles():
    x = torch.randn(64, 128)
    w = torch.randn(2, 128, 128)
    offs = torch.tensor([30, 64], dtype=torch.int32)
    mx = (x.to(torch.float8_e4m3fn), torch.zeros(64, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"1x128 tiles.*\(64, 1\)"):
        mx_grouped_mm_op(x, w, offs, format="fp8_block", x_mx=mx)


class _TwoLinears(torch.nn.Module):
    """Two linears, optionally with a graph break between them (two graphs, one op each)."""

    def __init__(self, graph_break: bool):
        super().__init__()
        self.a, self.b, self.graph_break = torch.nn.Linear(128, 128), torch.nn.Linear(128, 128), graph_break

    def forward(self, x):
        x = self.a(x)
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.b(x)


@pytest.mark.parametrize(
    "rules,graph_break,warns",
    [
        ([], False, True),  # format="auto" on sm90: every op fp8_block, nothing the switch can act on
        ([{"module": "b", "format": "mxfp8"}], True, False),  # graph a has no MXFP8 op, graph b has: no warning
        ([{"op": "linear", "format": "mxfp8"}], False, False),
    ],
)
def test_keep_dequantized_weights_that_can_act_nowhere_warns(monkeypatch, rules, graph_break, warns):
    """keep_dequantized_weights acts on emulated MXFP8 GEMMs only. Where the policy's format and rules can put no op in
    MXFP8 on this device (format="auto" on sm90, here by a patched capability), the compile warns once that it does
    nothing; a graph without an MXFP8 op in a model whose rules put another graph's op in MXFP8 does not warn."""
    from mxfx import backend

    monkeypatch.setattr(device, "capability", lambda d=None: (9, 0))
    monkeypatch.setattr(backend, "_warned_formats", set())
    torch._dynamo.reset()
    options = {"format": "auto", "keep_dequantized_weights": True, "rules": rules, "inner": "aot_eager"}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.compile(_TwoLinears(graph_break), backend="mxfp8", options=options)(torch.randn(4, 128)).sum().backward()
    notes = [str(w.message) for w in seen if "keep_dequantized_weights=True" in str(w.message)]
    assert len(notes) == int(warns), notes
    if warns:
        assert "'auto'" in notes[0] and "fp8_block on cpu" in notes[0] and "format='mxfp8'" in notes[0]


@pytest.mark.parametrize(
    "fmt, says",
    [("fp8_block", "fused into the dgrad quantize"), ("bf16_gemm", "fused into the GEMM (its dgrad scales dY")],
)
def test_the_combine_row_says_where_the_route_weights_went(fmt, says):
    """A format that quantizes dY forms dY x route weight in its dgrad quantize; BF16 GEMMs have no quantize: the
    grouped op's dgrad scales dY itself, and the map's row says which."""
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    _loss(_moe(), {"format": fmt, "inner": "aot_eager"}, ids)
    pm = mxfx.last_report()
    (row,) = [r for r in pm.records if r.kind == "combine"]
    assert says in row.reason, pm.to_text()


class Calls(TorchDispatchMode):
    """Records the op (overload packet name) of every dispatched call while active: which kernels a backward ran."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_routed_dgrad_quantizes_dy_times_route_weights_in_one_op():
    """The routed grouped GEMM's backward makes its dgrad operand, the BF16 wgrad's dY and the route weights'
    gradient in one op (one read of dout; the product formed inside it, never in memory for the quantize): the
    1x128 quantization of the FP32 product ``dout * route_weight``, that product in BF16, and ``sum(dout * y)``
    with ``y`` the unweighted output; the gradients are those of the op with the three made apart."""
    from mxfx.formats.base import Format

    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 128, generator=g).bfloat16()
    w = torch.randn(2, 128, 128, generator=g) * 0.1
    rw = torch.rand(96, generator=g)
    offs = torch.tensor([40, 96], dtype=torch.int32)
    dout = torch.randn(96, 128, generator=g).bfloat16()

    def grads(apart: bool):
        xs, ws, rws = x.clone().requires_grad_(), w.clone().requires_grad_(), rw.clone().requires_grad_()
        y = mx_grouped_mm_op(xs, ws, offs, route_weight=rws, out_dtype=torch.float32, format="fp8_block")
        fmt = formats.get("fp8_block")
        with Calls() as calls:
            if apart:  # the format's default: the route-weight quantize, then the gradient's own reduction
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(type(fmt), "route_grad_operands", Format.route_grad_operands)
                    y.backward(dout.float())
            else:
                y.backward(dout.float())
        return calls.seen, [t.grad for t in (xs, ws, rws)]

    seen, fused = grads(apart=False)
    assert seen.count("mxfx.block_route_grad_operands") == 1, seen
    assert "mxfx.block_quantize" not in seen and "mxfx.block_route_weight_quantize" not in seen, seen
    seen, apart = grads(apart=True)
    assert seen.count("mxfx.block_route_weight_quantize") == 1, seen
    for got, want in zip(fused, apart):  # the same operands and the same FP32 reduction on the CPU: the same bits
        assert torch.equal(got, want)
    y = torch.randn(96, 128, generator=g)
    q, s, dy, d_rw = torch.ops.mxfx.block_route_grad_operands(dout.float(), rw, y, "rceil")
    rq, rs = bf.quantize_1x128(dout.float() * rw[:, None])
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert dy.dtype == torch.bfloat16 and torch.equal(dy, (dout.float() * rw[:, None]).bfloat16())
    assert torch.equal(d_rw, (dout.float() * y).sum(-1))
    with pytest.raises(ValueError, match=r"block_route_grad_operands: y \(the unweighted output\) of shape \(96, 64\)"):
        torch.ops.mxfx.block_route_grad_operands(dout, rw, y[:, :64], "rceil")
    with pytest.raises(ValueError, match=r"mxfx::block_route_grad_operands: weight must be one route weight per row"):
        torch.ops.mxfx.block_route_grad_operands(dout, rw[:50], y, "rceil")
    q, s = torch.ops.mxfx.block_route_weight_quantize(dout.float(), rw, "rceil")
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    with pytest.raises(ValueError, match=r"mxfx::block_route_weight_quantize: weight must be one route weight per row"):
        torch.ops.mxfx.block_route_weight_quantize(dout, rw[:50], "rceil")
    with pytest.raises(TypeError, match=r"block_route_weight_quantize: weight of shape \(96,\) has dtype torch.int64"):
        torch.ops.mxfx.block_route_weight_quantize(dout, rw.long(), "rceil")
    with pytest.raises(TypeError, match=r"mxfx.grouped_mm: route_weight of shape \(96,\) has dtype torch.int64"):
        mx_grouped_mm_op(x, w, offs, route_weight=rw.long(), format="fp8_block")


def test_routed_fp8_wgrad_makes_both_dy_operands_in_one_op():
    """With the routed wgrad in FP8 the backward makes dY x route weight's dgrad rows and its group-token tiles in
    one op (one read of dout, the product never in memory), and the gradients equal the same op's with the two
    quantizes made apart (the format's default composition): the same operands, so the same bits."""
    from mxfx.formats.base import Format

    g = torch.Generator().manual_seed(6)
    x = torch.randn(300, 256, generator=g).bfloat16()
    w = torch.randn(3, 128, 256, generator=g) * 0.1
    rw = torch.rand(300, generator=g)
    offs = torch.tensor([100, 100, 300], dtype=torch.int32)  # an empty group
    dout = torch.randn(300, 128, generator=g)

    def grads(split: bool):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = mx_grouped_mm_op(xs, ws, offs, route_weight=rw, out_dtype=torch.float32, format="fp8_block", wgrad="mxfp8")
        fmt = formats.get("fp8_block")
        with Calls() as calls:
            if split:  # the base class's composition: the dgrad quantize, then the group-token quantize
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(type(fmt), "grouped_grad_operands", Format.grouped_grad_operands)
                    y.backward(dout)
            else:
                y.backward(dout)
        return xs.grad, ws.grad, calls.seen

    dx, dw, seen = grads(split=False)
    assert seen.count("mxfx.block_grouped_grad_operands") == 1, seen
    # x's group-token tiles were made by the forward (saved for the FP8 wgrad): no quantize of them here
    assert "mxfx.block_route_weight_quantize" not in seen and "mxfx.block_quantize_grouped_tokens" not in seen
    dx2, dw2, seen2 = grads(split=True)
    assert "mxfx.block_grouped_grad_operands" not in seen2 and seen2.count("mxfx.block_quantize_grouped_tokens") == 1
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)
    assert dw.abs().sum() > 0 and (dw[1] == 0).all()  # the empty group's gradient is zero
    with pytest.raises(ValueError, match=r"mxfx::block_grouped_grad_operands: weight must be one route weight"):
        torch.ops.mxfx.block_grouped_grad_operands(dout, rw[:50], offs, "rceil")
    past = torch.tensor([offs[0].item(), dout.shape[0] + 1], dtype=torch.int32)  # group ends past dy's rows
    with pytest.raises(ValueError, match=rf"grad_operands: offs .* at most the {dout.shape[0]} rows of dy"):
        torch.ops.mxfx.block_grouped_grad_operands(dout, rw, past.to(offs.device), "rceil")
