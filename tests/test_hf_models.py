"""Real clients: tiny bf16 MoE models of HF transformers compiled with backend="mxfp8".

The counts come from the final forward/backward ATen graphs the inner compiler
receives, not from mxfx's own report.
"""

import types

import pytest
import torch
import torch.nn.functional as F

import mxfx
from mxfx.passes.combine_sum import NOTE as COMBINE_SUM_NOTE
from tests.helpers import GraphCapture, count_calls, lm_loss_and_grads

T = pytest.importorskip("transformers")

OPS = torch.ops.mxfx
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

# name -> (config, model class, MX linears, fused SwiGLUs, fused combines); one routed MoE layer (2 grouped GEMMs) each.
MODELS = {
    "olmoe": (
        lambda: T.OlmoeConfig(intermediate_size=64, num_experts=4, num_experts_per_tok=2, **COMMON),
        "OlmoeForCausalLM",
        4,
        1,
        1,
    ),
    "mixtral": (
        lambda: T.MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **COMMON),
        "MixtralForCausalLM",
        4,
        1,
        1,
    ),
    "qwen3_moe": (
        lambda: T.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=32, **COMMON
        ),
        "Qwen3MoeForCausalLM",
        4,
        1,
        1,
    ),
    # q_a, q_b, kv_a, kv_b, o + shared gate/up/down; routed and shared SwiGLU fused
    "deepseek_v3": (
        lambda: T.DeepseekV3Config(
            intermediate_size=64,
            moe_intermediate_size=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=0,
            n_shared_experts=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=32,
            **COMMON,
        ),
        "DeepseekV3ForCausalLM",
        8,
        2,
        1,
    ),
    # clamped SwiGLU variant left alone (never mis-matched); an in-place expert bias sits between
    # the down projection and the route-weight multiply, so the combine is not fused
    "gpt_oss": (
        lambda: T.GptOssConfig(
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=32,
            layer_types=["full_attention"],
            **COMMON,
        ),
        "GptOssForCausalLM",
        4,
        0,
        0,
    ),
}


def _model(name):
    make_cfg, cls, *_ = MODELS[name]
    torch.manual_seed(0)
    return getattr(T, cls)(make_cfg()).to(torch.bfloat16)


def _loss_and_grads(model, backend, options=None):
    """BF16 model, no autocast: ``(loss, every gradient flattened into one fp32 vector)``."""
    loss, grads = lm_loss_and_grads(model, backend, options, seq=16, autocast=False)
    return loss, torch.cat([g.flatten() for g in grads.values()])


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_moe_graph_counts_and_closeness(name):
    model = _model(name)
    _, _, n_linear, n_swiglu, n_combine = MODELS[name]
    cap = GraphCapture()
    loss_mx, g_mx = _loss_and_grads(model, "mxfp8", {"inner": cap})
    assert len(cap.forward) == 1 and len(cap.backward) == 1  # one graph, no breaks
    fw, bw = cap.forward, cap.backward
    assert count_calls(fw, OPS.mm.default) == n_linear
    assert count_calls(fw, OPS.grouped_mm.default) == 2
    # one pass per SwiGLU: the GEMM operand, its values (emulated on CPU) and the saved gate/up pairs
    assert count_calls(fw, OPS.swiglu_quantize_dequantize_save.default) == n_swiglu
    assert count_calls(fw, torch.ops.aten._grouped_mm.default) == 0  # no BF16 expert GEMM left
    assert count_calls(bw, OPS.mm.default) == 2 * n_linear  # dgrad + MX wgrad of every dense linear
    assert count_calls(bw, OPS.grouped_mm.default) == 2  # expert dgrads
    assert (
        count_calls(bw, OPS.grouped_wgrad_bf16.default) == 2
    )  # routed wgrad in BF16 (the recipe, "Kernel Problems and Fusions" (Table 25))
    assert count_calls(bw, torch.ops.aten._grouped_mm.default) == 0
    assert count_calls(bw, OPS.route_weight_quantize_dequantize.default) == n_combine  # combine backward fused
    # the combine's token sum (HF's rows put back in pair order, then summed) has a gather for its backward
    assert sum(COMBINE_SUM_NOTE in r.reason for r in mxfx.last_report().records) == 1
    loss_bf16, g_bf16 = _loss_and_grads(model, None)  # the BF16 model itself, uncompiled
    assert loss_mx != loss_bf16
    assert abs(loss_mx - loss_bf16) / loss_bf16 < 0.02
    assert F.cosine_similarity(g_mx, g_bf16, dim=0) > 0.98


# ---- a hand-written MX reference of the recipe for OLMoE, run eagerly ----


def q_dq(t, axis=-1):
    q, s = mxfx.quantize(t, axis=axis)
    return mxfx.dequantize(q, s, axis=axis, dtype=torch.float32)


def tokens_q_dq(t):  # blocked along tokens, zero-padded to 32
    return q_dq(F.pad(t, (0, 0, 0, (-t.shape[0]) % 32)), 0)[: t.shape[0]]


class RefLinear(torch.autograd.Function):
    """Dense linear: fwd X.W^T and dgrad dY.W blocked along their reductions; wgrad MX along tokens."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (q_dq(x) @ q_dq(w).T).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = (q_dq(dy) @ q_dq(w, 0)).to(x.dtype)
        dyp, xp = (F.pad(t.float(), (0, 0, 0, (-t.shape[0]) % 32)) for t in (dy, x))
        return dx, (q_dq(dyp, 0).T @ q_dq(xp, 0)).to(w.dtype)


class RefExpertGemm(torch.autograd.Function):
    """One expert's GEMM: MX fwd/dgrad, BF16 wgrad on the dequantized input, optional route weight.

    Outputs of both GEMMs are rounded to bf16 (the model's dtype) before anything else reads them:
    the route weight multiplies the bf16 output, the SwiGLU backward reads a bf16 dgrad."""

    @staticmethod
    def forward(ctx, h, w, rw):
        ctx.save_for_backward(h, w, rw)
        y = (q_dq(h) @ q_dq(w).T).bfloat16().float()
        return y if rw is None else y * rw.float()[:, None]

    @staticmethod
    def backward(ctx, dout):
        h, w, rw = ctx.saved_tensors
        dy = dout.float() if rw is None else dout.float() * rw.float()[:, None]
        dh = (q_dq(dy) @ q_dq(w, 0)).bfloat16().float()
        dw = (dy.bfloat16().float().T @ q_dq(h).bfloat16().float()).bfloat16().float()
        drw = None if rw is None else (dout.float() * (q_dq(h) @ q_dq(w).T).bfloat16().float()).sum(-1)
        return dh, dw, drw


class RefSwiGLU(torch.autograd.Function):
    """silu(g) * u in fp32; backward from gate/up saved in MXFP8."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return F.silu(g.float()) * u.float()

    @staticmethod
    def backward(ctx, dh):
        g, u = (q_dq(t) for t in ctx.saved_tensors)
        s = torch.sigmoid(g)
        return (dh * u * s * (1 + g * (1 - s))).bfloat16(), (dh * g * s).bfloat16()


def ref_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    for e in range(self.num_experts):
        tok, pos = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        gu = RefExpertGemm.apply(hidden_states[tok], self.gate_up_proj[e].float(), None).bfloat16()
        g, u = gu.chunk(2, dim=-1)
        y = RefExpertGemm.apply(RefSwiGLU.apply(g, u), self.down_proj[e].float(), top_k_weights[tok, pos])
        out = out.index_add(0, tok, y)
    return out.to(hidden_states.dtype)


class RefLinearMode(torch.overrides.TorchFunctionMode):
    """Routes every eligible F.linear (not the router, not lm_head) to RefLinear."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and not any(args[1] is k for k in self.keep):
            x, w = args[0], args[1]
            return RefLinear.apply(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
        return func(*args, **kwargs)


def test_olmoe_matches_hand_written_mx_reference():
    model = _model("olmoe")
    loss_mx, g_mx = _loss_and_grads(model, "mxfp8", {"inner": "aot_eager"})
    loss_bf16, g_bf16 = _loss_and_grads(model, None)
    layer = model.model.layers[0]
    experts = layer.mlp.experts
    experts.forward = types.MethodType(ref_experts_forward, experts)
    with RefLinearMode(keep=(layer.mlp.gate.weight, model.lm_head.weight)):
        loss_ref, g_ref = _loss_and_grads(model, None)
    # Same MX operands; differences are summation order and bf16 rounding of outputs.
    assert abs(loss_mx - loss_ref) < 2e-3
    err = (g_mx - g_ref).norm() / g_ref.norm()
    assert err < 1e-2
    # ... and the comparison can tell MX from BF16.
    assert (g_bf16 - g_ref).norm() / g_ref.norm() > 2 * err
