"""The linear op and pass: numerics against a hand-written reference in every format, graph counts, exceptions."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxfx
from mxfx.ops.linear import mx_linear
from tests import format_refs as refs
from tests.helpers import GraphCapture, count_calls

MX_MM = torch.ops.mxfx.mm.default


def q_dq(t: torch.Tensor, axis: int, rule: str) -> torch.Tensor:
    """Quantize along ``axis`` with the public MXFP8 reference, dequantize to fp32."""
    return refs.act("mxfp8", t, axis, rule)


def reference_linear(fmt, x, w, b, dy, rule, wgrad, save):
    """Forward and the three gradients written out per the operand orientations of docs/format.md, with format
    ``fmt``'s blocks (tests/format_refs.py)."""
    y = refs.act(fmt, x, -1, rule) @ refs.weight(fmt, w, -1, rule).T + b  # X and W blocked along K
    dx = refs.act(fmt, dy, -1, rule) @ refs.weight(fmt, w, -2, rule)  # dY along N; W along N, i.e. down its columns
    if wgrad == "mxfp8":  # both blocked along tokens (zero-padded where the format pads them)
        dw = refs.tokens(fmt, dy, rule).T @ refs.tokens(fmt, x, rule)
    elif save == "mxfp8":  # BF16-precision GEMM on the dequantized saved (rowwise) input
        dw = dy.T @ refs.act(fmt, x, -1, rule)
    else:  # on the input itself, saved by reference
        dw = dy.T @ x
    return y, dx, dw, dy.sum(0)


@pytest.mark.parametrize("fmt,rule", [(f, r) for f in refs.FORMATS for r in refs.RULES[f]])
@pytest.mark.parametrize("wgrad,save", [("mxfp8", "mxfp8"), ("mxfp8", "bf16"), ("bf16", "mxfp8"), ("bf16", "bf16")])
def test_linear_matches_hand_reference(fmt, rule, wgrad, save):
    g = torch.Generator().manual_seed(0)
    m, k, n = 200, 256, 384  # 200 tokens: MXFP8's wgrad pads them to 224, fp8_block's last token tile is partial
    x = torch.randn(m, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g)
    dy = torch.randn(m, n, generator=g)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = mx_linear(xr, wr, br, format=fmt, scale_rule=rule, wgrad=wgrad, save=save)
    y.backward(dy)
    ry, rdx, rdw, rdb = reference_linear(fmt, x, w, b, dy, rule, wgrad, save)
    # Same dequantized operands, fp32 GEMMs on both sides: equal up to summation order (K <= 384 terms of
    # magnitude ~1, so well inside 1e-4 relative).
    tol = refs.OUT_RTOL[fmt]
    for got, want in ((y, ry), (xr.grad, rdx), (wr.grad, rdw), (br.grad, rdb)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    # ... and genuinely quantized: not the plain fp32 linear.
    assert (y - F.linear(x, w, b)).abs().max() > 1e-3


def test_mx_linear_autocast_dtypes_and_3d():
    x = torch.randn(2, 24, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        y = mx_linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 24, 32)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    ref = (q_dq(x.detach().reshape(-1, 64), -1, "rceil") @ q_dq(w.detach(), -1, "rceil").T).to(torch.bfloat16)
    torch.testing.assert_close(y.reshape(-1, 32), ref, rtol=0, atol=0)
    # x's gradient: the dgrad GEMM's BF16 result widened, as F.linear's autocast input cast gives it (dY = ones,
    # exact in MXFP8, so the dgrad is each column sum of the quantized weight, rounded once to BF16; the FP32 sum's
    # order is the GEMM's, hence a bound of one BF16 rounding, not equality)
    dx = q_dq(w.detach().t().contiguous(), -1, "rceil").sum(-1).expand_as(x.grad)  # W [N, K] along N: ones . W
    assert torch.equal(x.grad, x.grad.bfloat16().float())
    torch.testing.assert_close(x.grad, dx, rtol=2**-8, atol=1e-6)


def test_mx_linear_rejects_unaligned_features():
    with pytest.raises(ValueError, match=r"multiples of 32"):
        mx_linear(torch.randn(4, 48), torch.randn(32, 48))


def test_mx_linear_names_a_weight_bias_or_input_dtype_it_cannot_take():
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    with pytest.raises(
        ValueError, match=r"mx_linear: weight must be a floating \[N, K\].*got torch.float32 \(1, 32, 64\)"
    ):
        mx_linear(x, w[None])
    with pytest.raises(ValueError, match=r"mx_linear: weight must be .*got list"):
        mx_linear(x, [w])
    with pytest.raises(ValueError, match=r"bias must be a floating \[N\] = \[32\] tensor .*got torch.float32 \(7,\)"):
        mx_linear(x, w, torch.randn(7))
    with pytest.raises(ValueError, match=r"bias must be .*got torch.int64 \(32,\)"):
        mx_linear(x, w, torch.zeros(32, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"input_dtype='bf16' \(input \(4, 64\)\) must be torch.bfloat16"):
        mx_linear(x, w, input_dtype="bf16")
    with pytest.raises(TypeError, match=r"mx_linear: input \(torch.float32 \(4, 64\)\) and weight \(torch.float64"):
        mx_linear(x, w.double())
    with pytest.raises(TypeError, match=r"mx_linear: input \(torch.float64 \(4, 64\)\) and weight"):
        mx_linear(x.double(), w)


def test_a_bias_gradient_comes_back_in_the_bias_dtype_not_the_weights():
    # a bias kept in FP32 beside a BF16 weight: its gradient (a sum over rows) is not rounded through BF16
    x, w = torch.randn(8, 64), torch.randn(32, 64, dtype=torch.bfloat16)
    b = torch.randn(32, requires_grad=True)
    dy = torch.randn(8, 32) * 1.001
    mx_linear(x, w, b).backward(dy)
    assert b.grad.dtype == torch.float32
    torch.testing.assert_close(b.grad, dy.sum(0), rtol=1e-6, atol=1e-6)  # BF16 rounding would be off by ~2^-9


def test_a_bias_of_shape_1_by_n_gets_its_gradient_in_its_shape():
    """``F.linear`` broadcasts a ``[1, N]`` bias; mx_linear adds it as ``[N]`` and its gradient (the output
    gradient's sum over rows) comes back ``[1, N]``: eager in FP32 equal up to summation order; compiled under BF16
    autocast within a BF16 rounding of uncompiled autocast's (whose bias gradient is summed in BF16)."""
    x, w = torch.randn(8, 64), torch.randn(32, 64)
    b = torch.randn(1, 32, requires_grad=True)
    dy = torch.randn(8, 32)
    mx_linear(x, w, b).backward(dy)
    assert b.grad.shape == (1, 32)
    torch.testing.assert_close(b.grad, dy.sum(0, keepdim=True), rtol=1e-6, atol=1e-6)
    model = nn.Linear(64, 32)
    model.bias = nn.Parameter(torch.randn(1, 32))
    with torch.autocast("cpu", torch.bfloat16):
        model(x).float().backward(dy)
    want, model.bias.grad = model.bias.grad, None
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager"})
    with torch.autocast("cpu", torch.bfloat16):
        compiled(x).float().backward(dy)
    assert model.bias.grad.shape == (1, 32)
    torch.testing.assert_close(model.bias.grad, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


class Block(nn.Module):
    """Attention-like projections, a router, an unaligned linear and a vocabulary projection."""

    def __init__(self, d=64, vocab=256):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d)
        self.gate = nn.Linear(d, 32, bias=False)  # router: eligible by shape, kept by graph structure
        self.odd = nn.Linear(d, 40)  # 40 features: kept BF16
        self.lm_head = nn.Linear(d, vocab, bias=False)  # vocabulary projection: kept by policy

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + self.o_proj(F.silu(q) * k + v)
        probs = self.gate(h).float().softmax(dim=-1)
        weights, _ = probs.topk(2, dim=-1)
        h = h * weights.sum(-1, keepdim=True).to(h.dtype)
        return self.lm_head(h).float().logsumexp(-1).mean() + self.odd(h).float().mean()


ELIGIBLE = 2  # qkv, o_proj


def _run(model, x, backend="mxfp8", options=None):
    compiled = (
        torch.compile(model, backend=backend, options=options) if options else torch.compile(model, backend=backend)
    )
    x = x.clone().requires_grad_()  # so the first linear has a dgrad too
    with torch.autocast("cpu", torch.bfloat16):
        loss = compiled(x)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def test_graph_counts_router_and_vocab_stay_bf16():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 48, 64)
    cap = GraphCapture()
    _run(model, x, options={"inner": cap, "fuse_wgrad_accumulation": False})
    assert count_calls(cap.forward, MX_MM) == ELIGIBLE
    assert count_calls(cap.backward, MX_MM) == 2 * ELIGIBLE  # dgrad + wgrad per linear (autograd accumulates)
    # router, unaligned and vocabulary linears stay plain GEMMs in the forward graph
    plain = count_calls(cap.forward, torch.ops.aten.mm.default) + count_calls(cap.forward, torch.ops.aten.addmm.default)
    assert plain == 3
    report = mxfx.last_report()
    kept = {r.module: r.reason for r in report.records if not r.rewritten}
    assert set(kept) == {"gate", "odd", "lm_head"}
    assert "router" in kept["gate"] and "lm_head" in kept["lm_head"] and "multiples of 32" in kept["odd"]


class _Top1(nn.Module):
    """Switch-style top-1 routing, written three ways, beside a projection followed by a max-pool."""

    def __init__(self, select):
        super().__init__()
        self.router, self.proj, self.pool_proj, self.select = (
            nn.Linear(64, 32, bias=False),
            nn.Linear(64, 64),
            nn.Linear(64, 64),
            select,
        )

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        if self.select == "argmax":
            idx = probs.argmax(-1, keepdim=True)
        elif self.select == "max":
            idx = torch.max(probs, dim=-1, keepdim=True).indices
        else:
            idx = probs.sort(dim=-1, descending=True).indices[:, :1]
        pooled = self.pool_proj(x).max(dim=0).values  # max straight on a projection: not a router
        return self.proj(x) * idx.to(x.dtype) + pooled


@pytest.mark.parametrize("select", ["argmax", "max", "sort"])
def test_top1_routers_are_detected(select):
    torch._dynamo.reset()
    torch.compile(_Top1(select), backend="mxfp8", options={"inner": "eager"})(torch.randn(32, 64))
    kinds = {r.module: (r.kind, r.forward) for r in mxfx.last_report().records}
    assert kinds["router"] == ("router", "fp32")  # kept as written, in an FP32 model
    assert kinds["proj"] == ("linear", "mxfp8") and kinds["pool_proj"] == ("linear", "mxfp8")


class _RouterShapes(nn.Module):
    """Routers with a learned logit bias and a temperature buffer, beside linears that only look alike:
    a hand-written SiLU whose output later reaches a router, a sigmoid gate followed by a max-pool, and
    a classifier's argmax."""

    def __init__(self):
        super().__init__()
        lin = lambda: nn.Linear(64, 64, bias=False)  # noqa: E731
        (
            self.biased,
            self.tempered,
            self.silu_head,
            self.silu_proj,
            self.gated,
            self.pooled,
            self.classifier,
            self.router,
        ) = (lin(), lin(), lin(), lin(), lin(), lin(), lin(), lin())
        self.logit_bias = nn.Parameter(torch.zeros(64))
        self.register_buffer("temperature", torch.tensor(0.7))

    def forward(self, x):
        sel = F.softmax(self.biased(x) + self.logit_bias, -1).topk(2).values.sum()
        sel = sel + F.softmax(self.tempered(x) / self.temperature, -1).topk(2).values.sum()
        h = self.silu_head(x)
        y = x + self.silu_proj(h * torch.sigmoid(h))
        sel = sel + F.softmax(self.router(y), -1).topk(2).values.sum()
        pooled = (self.pooled(x) * torch.sigmoid(self.gated(x))).max(dim=0).values.sum()
        return sel + pooled + self.classifier(x).argmax(-1).sum()


class _NoisyTopK(nn.Module):
    """Noisy top-k gating (Shazeer et al. 2017): logits plus learned-scale Gaussian noise, then softmax/topk."""

    def __init__(self):
        super().__init__()
        self.router, self.w_noise, self.proj = (
            nn.Linear(64, 8, bias=False),
            nn.Linear(64, 8, bias=False),
            nn.Linear(64, 64),
        )

    def forward(self, x):
        logits = self.router(x)
        noisy = logits + torch.randn_like(logits) * F.softplus(self.w_noise(x))
        return self.proj(x) * F.softmax(noisy, -1).topk(2).values.sum(-1, keepdim=True)


def test_noisy_topk_router_is_detected():
    torch._dynamo.reset()
    torch.compile(_NoisyTopK(), backend="mxfp8", options={"inner": "eager"})(torch.randn(32, 64))
    kinds = {r.module: r.kind for r in mxfx.last_report().records}
    assert kinds["router"] == "router" and kinds["proj"] == "linear", kinds


def test_router_detection_walks_only_through_per_expert_operands():
    torch._dynamo.reset()
    torch.compile(_RouterShapes(), backend="mxfp8", options={"inner": "eager"})(torch.randn(32, 64))
    kinds = {r.module: r.kind for r in mxfx.last_report().records}
    assert kinds["biased"] == kinds["tempered"] == kinds["router"] == "router", kinds
    for name in ("silu_head", "silu_proj", "gated", "pooled", "classifier"):
        assert kinds[name] == "linear", (name, kinds)


def test_policy_wgrad_bf16_and_module_rule():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 48, 64)
    cap = GraphCapture()
    opts = {"inner": cap, "wgrad": "bf16", "rules": [{"module": "o_proj", "precision": "bf16"}]}
    _run(model, x, options=opts)
    assert count_calls(cap.forward, MX_MM) == 1  # only qkv
    assert count_calls(cap.backward, MX_MM) == 1  # qkv dgrad; its wgrad is BF16
    assert count_calls(cap.backward, torch.ops.mxfx.quantize_dual.default) == 0  # dY of qkv: rowwise only
    # dY: one pass writes its MX pair and the dequantized form the emulated dgrad GEMM reads
    assert count_calls(cap.backward, torch.ops.mxfx.quantize_dequantize.default) == 1
    assert count_calls(cap.backward, torch.ops.mxfx.quantize.default) == 0
    assert count_calls(cap.backward, torch.ops.mxfx.dequantize.default) == 1  # BF16 wgrad: the saved MX copy of X
    assert count_calls(cap.backward, torch.ops.mxfx.cached_weight.default) == 1  # the dgrad weight (mxfx.runtime.cache)


@pytest.mark.slow
def test_compiled_inductor_equals_eager_rewrite_and_differs_from_bf16():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 48, 64)
    loss_c, grads_c = _run(model, x, options={"inner": "inductor"})
    loss_e, grads_e = _run(model, x, options={"inner": "eager"})
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        loss_b = model(x).float()  # the BF16 model, uncompiled
    # Same MX ops on both sides; Inductor may reorder bf16 elementwise math: bf16-rounding tolerance.
    torch.testing.assert_close(loss_c, loss_e, rtol=2e-2, atol=2e-2)
    for name in grads_c:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=5e-2, atol=5e-3)
    assert loss_c != loss_b  # MXFP8 rounding is visible
    assert abs(loss_c - loss_b) / abs(loss_b) < 0.05  # ... but small


def test_floor_rule_reaches_the_graph():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 48, 64)
    r1, _ = _run(model, x, options={"inner": "eager", "scale_rule": "rceil"})
    r2, _ = _run(model, x, options={"inner": "eager", "scale_rule": "floor"})
    assert r1 != r2
    assert {r.scale_rule for r in mxfx.last_report().records if r.rewritten} == {"floor"}


class CastWeight(nn.Module):
    """A model that casts its FP32 weight itself before the linear."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) * 0.1)

    def forward(self, x):
        return F.linear(x, self.w.to(torch.bfloat16))


def test_weight_casts_are_walked_back_to_the_parameter(tmp_path):
    m, x = CastWeight(), torch.randn(8, 64).bfloat16()
    y = torch.compile(m, backend="mxfp8", options={"inner": "eager", "dump_dir": str(tmp_path)})(x)
    after = (tmp_path / f"graph_{mxfx.last_report().graph_id:03d}" / "after.py").read_text()
    assert "mx_linear(l_x_, l_self_parameters_w_," in after  # the parameter itself
    assert "= l_self_parameters_w_.to(" not in after  # the BF16 copy of the weight is gone
    # quantized from the FP32 parameter: equal to the reference on the FP32 weight
    ref = (q_dq(x.float(), -1, "rceil") @ q_dq(m.w.detach(), -1, "rceil").T).to(torch.bfloat16)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


class TiedHead(nn.Module):
    """A language model head that shares its weight with the embedding, under a non-standard name."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.mix = nn.Linear(64, 64)
        self.head = nn.Linear(64, 128, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.mix(self.emb(idx))).float().logsumexp(-1).mean()


def test_tied_output_head_stays_bf16_unless_a_rule_says_otherwise():
    m, idx = TiedHead(), torch.randint(0, 128, (2, 16))
    torch.compile(m, backend="mxfp8", options={"inner": "eager"})(idx)
    kept = {r.module: r.reason for r in mxfx.last_report().records if not r.rewritten}
    assert set(kept) == {"head"} and "tied to an embedding" in kept["head"]
    torch._dynamo.reset()
    torch.compile(m, backend="mxfp8", options={"inner": "eager", "rules": [{"module": "head", "precision": "mxfp8"}]})(
        idx
    )
    assert mxfx.last_report().count("linear", rewritten=True) == 2


class _CastSwiGLU(nn.Module):
    """SwiGLU whose product the model casts before the down projection (no autocast)."""

    def __init__(self, to: torch.dtype, param_dtype: torch.dtype):
        super().__init__()
        self.to_dtype = to
        self.gate = nn.Linear(64, 128, bias=False).to(param_dtype)
        self.up = nn.Linear(64, 128, bias=False).to(param_dtype)
        self.down = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        h = (F.silu(self.gate(x)) * self.up(x)).to(self.to_dtype)
        return F.linear(h, self.down.weight.to(self.to_dtype))


@pytest.mark.parametrize("to,param_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_fused_swiglu_keeps_the_dtype_the_model_cast_to(to, param_dtype):
    torch.manual_seed(0)
    model, x = _CastSwiGLU(to, param_dtype), torch.randn(32, 64).to(param_dtype)
    ref = model(x)
    compiled = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager"})
    y = compiled(x)
    assert any(r.kind == "swiglu" and r.rewritten for r in mxfx.last_report().records)
    assert y.dtype == ref.dtype == to
    # MXFP8 rounding of three GEMM inputs: a few % relative error, well under 10%
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert 0 < rel < 0.1, rel
    y.float().sum().backward()
    assert model.gate.weight.grad.dtype == param_dtype and torch.isfinite(model.gate.weight.grad).all()


@pytest.mark.parametrize(
    "act", [F.relu, torch.relu, nn.ReLU(), F.sigmoid, torch.special.expit, F.tanh, lambda t: t.relu_()]
)
def test_output_saving_activation_is_not_packed_twice(act):
    """ReLU's, sigmoid's and tanh's backward read their own output, so the next linear's input stays alive
    in BF16 anyway: packing an MX copy next to it would add memory, and the precision map must not claim a
    saving. Every spelling Dynamo records counts."""

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

        def forward(self, x):
            return self.b(act(self.a(x)))

    torch.manual_seed(0)
    model = MLP()
    torch.compile(model, backend="mxfp8", options={"inner": "aot_eager"})(torch.randn(32, 64)).sum().backward()
    saved = {r.module: r.saved for r in mxfx.last_report().records if r.kind == "linear"}
    assert saved == {"a": "mxfp8", "b": "fp32"}  # b's input kept as it is (FP32 model)


def test_few_tokens_keep_the_input_when_the_padded_mx_copy_is_larger():
    """The MXFP8 wgrad copy is blocked along tokens, zero-padded to 32: at 8 tokens it would be larger than the
    FP32 input, so the pass keeps the input; at 48 tokens it packs, and the map counts the padded bytes against
    the FP32 input the op as written saves."""

    def saved_of(tokens):
        torch._dynamo.reset()
        lin = nn.Linear(64, 64)
        x = torch.randn(tokens, 64, dtype=torch.bfloat16, requires_grad=True)
        torch.compile(lambda t: lin(t.float()), backend="mxfp8", options={"inner": "eager", "wgrad": "mxfp8"})(x)
        (rec,) = [r for r in mxfx.last_report().records if r.kind == "linear"]
        return rec

    few, many = saved_of(8), saved_of(48)
    assert few.saved == "fp32" and "8 tokens zero-padded to a multiple of 32" in few.reason
    assert many.saved == "mxfp8" and many.saved_bytes == (4 * 48 * 64, 64 * 64 * 33 // 32)
