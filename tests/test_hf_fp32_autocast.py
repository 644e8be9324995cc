"""Real clients as most users run them: HF MoE models in FP32 (main weights) under BF16 autocast.

transformers then never reaches ``torch._grouped_mm`` under compile: its
``grouped_mm`` experts call the opaque ``transformers::grouped_mm_fallback``
(FP32 GEMMs), its ``batched_mm`` experts index the weights per row and ``bmm``.
Both must become MX grouped GEMMs with the SwiGLU and combine fusions, and
anything mxfx cannot convert must be reported, not skipped silently.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import mxfx
from mxfx.diagnostics import graph_breaks
from mxfx.passes import unconverted
from tests.helpers import GraphCapture, lm_loss_and_grads

T = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

# name -> (config, model class, fused SwiGLUs, fused combines); one routed MoE layer (2 grouped GEMMs) each
FAMILIES = {
    "olmoe": (
        lambda: T.OlmoeConfig(intermediate_size=64, num_experts=4, num_experts_per_tok=2, **COMMON),
        "OlmoeForCausalLM",
        1,
        1,
    ),
    "qwen2_moe": (
        lambda: T.Qwen2MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            **COMMON,
        ),
        "Qwen2MoeForCausalLM",
        2,
        1,  # routed + shared expert SwiGLU
    ),
    "qwen3_moe": (
        lambda: T.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=32, **COMMON
        ),
        "Qwen3MoeForCausalLM",
        1,
        1,
    ),
    "mixtral": (
        lambda: T.MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **COMMON),
        "MixtralForCausalLM",
        1,
        1,
    ),
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
        2,
        1,
    ),
    # expert biases (added in place after each GEMM, so no combine fusion) and a clamped SwiGLU (left as written)
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
        0,
        0,
    ),
}


def _model(name, impl):
    make_cfg, cls, *_ = FAMILIES[name]
    cfg = make_cfg()
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    return getattr(T, cls)(cfg)  # FP32 parameters


def _loss_and_grads(model, options=None):
    return lm_loss_and_grads(model, None if options is None else "mxfp8", options)


def _check(name, impl):
    model = _model(name, impl)
    _, _, n_swiglu, n_combine = FAMILIES[name]
    loss_mx, g_mx = _loss_and_grads(model, {"inner": "aot_eager"})
    pm = mxfx.last_report()
    assert pm.count("grouped_mm", True) == 2 and pm.count("grouped_mm", False) == 0, pm.to_text()
    assert pm.count("swiglu", True) == n_swiglu, pm.to_text()
    assert pm.count("combine", True) == n_combine, pm.to_text()
    assert pm.count(unconverted.KIND) == 0, pm.to_text()
    for r in pm.records:
        if r.kind == "grouped_mm":
            assert r.shapes.endswith("-> bfloat16") or r.shapes.endswith("-> float32"), r.shapes
    # The reference is the same FP32 model under autocast without mxfx (eager: transformers' own FP32 grouped
    # GEMMs, the op the pass replaces). MX rounding of every GEMM operand (E4M3: 3 mantissa bits, relative
    # step 2^-4) moves a 1-layer model's loss by well under 2% and keeps each expert weight's gradient
    # aligned (cosine > 0.97) with the exact one; a wrong expert, order or missing scale fails both.
    loss_ref, g_ref = _loss_and_grads(model)
    assert loss_mx != loss_ref
    assert abs(loss_mx - loss_ref) / loss_ref < 0.02
    experts = [n for n in g_ref if ".experts." in n and g_ref[n].dim() == 3]
    assert len(experts) == 2
    for n in experts:
        assert F.cosine_similarity(g_mx[n].flatten(), g_ref[n].flatten(), dim=0) > 0.97, n


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp32_autocast_grouped_fallback_rewritten(name):
    _check(name, "grouped_mm")


@pytest.mark.parametrize("name", ["olmoe", "gpt_oss"])  # [E, N, K] and transposed [E, K, N] weights with biases
def test_fp32_autocast_batched_mm_rewritten(name):
    _check(name, "batched_mm")


def _checkpointed_olmoe(layers: int = 2):
    """An FP32 OLMoE of ``layers`` layers with transformers' activation checkpointing on, in training mode."""
    cfg = T.OlmoeConfig(
        intermediate_size=64, num_experts=4, num_experts_per_tok=2, **{**COMMON, "num_hidden_layers": layers}
    )
    torch.manual_seed(0)
    model = T.OlmoeForCausalLM(cfg)
    model.activation_checkpointing_enable()
    return model.train()


def test_checkpointed_layers_each_keep_their_own_records():
    # Each checkpointed layer is its own subgraph, with the same node names as the other's: what a pass adds to a
    # record (the combine's output dtype, the dispatch's note) goes to that layer's record, not to the first layer's.
    before = len(mxfx.all_reports())
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        _loss_and_grads(_checkpointed_olmoe(), {"inner": "aot_eager"})
    maps = mxfx.all_reports()[before:]
    records, text = [r for pm in maps for r in pm.records], "".join(pm.to_text() for pm in maps)
    assert sum(r.kind == "combine" and r.rewritten for r in records) == 2, text
    for layer in (0, 1):
        gate_up, down = [r for r in records if r.kind == "grouped_mm" and r.module.startswith(f"model.layers.{layer}.")]
        assert "quantized before the dispatch's row gather" in gate_up.reason, text
        assert down.shapes.endswith("-> float32"), text  # the fused route-weight product, FP32 route weights


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_routed_gemms_write_bf16_under_autocast(impl):
    """Under BF16 autocast the routed GEMMs write BF16 where eager's autocast GEMMs would, though transformers'
    FP32 expert GEMM and its FP32 input make the model's own tensors FP32: the combine's FP32 product comes from the
    down projection's BF16 rows, which are what the forward hands backward (for the route weights' gradient), and
    the gate/up projection's dgrad writes the FP32 input's gradient in BF16 (widened after, as through an autocast
    GEMM's input cast). FP32 results would double the bytes of the routed block's largest tensors."""
    model = _model("olmoe", impl)
    cap = GraphCapture()
    _loss_and_grads(model, {"inner": cap})
    fw, bw = cap.forward[0], cap.backward[0]
    n_saved = len([n for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")])
    outs = list(fw.graph.output_node().args[0])
    gemm_rows = [
        n.meta["val"]
        for n in outs[len(outs) - n_saved :]
        if "grouped_mm" in str(getattr(n, "target", "")) and n.meta["val"].shape[-1] == COMMON["hidden_size"]
    ]
    assert len(gemm_rows) == 1 and gemm_rows[0].dtype == torch.bfloat16, [(v.dtype, v.shape) for v in gemm_rows]
    dgrads = [n.meta["val"] for n in bw.graph.nodes if n.op == "call_function" and "grouped_mm" in str(n.target)]
    assert len(dgrads) == 2 and all(v.dtype == torch.bfloat16 for v in dgrads), [(v.dtype, v.shape) for v in dgrads]
    assert {v.shape[-1] for v in dgrads} == {COMMON["hidden_size"], model.config.intermediate_size}


# More families, each trained for a few steps as a new user would (transformers' default experts implementation):
# name -> (config, model class). One MoE layer each; shared experts and routers as the family writes them.
MOE = dict(num_experts_per_tok=2)
TRAINED = {
    "granitemoe": (
        lambda: T.GraniteMoeConfig(intermediate_size=64, num_local_experts=4, **MOE, **COMMON),
        "GraniteMoeForCausalLM",
    ),
    "phimoe": (lambda: T.PhimoeConfig(intermediate_size=64, num_local_experts=4, **MOE, **COMMON), "PhimoeForCausalLM"),
    "glm4_moe": (
        lambda: T.Glm4MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=64,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            n_shared_experts=1,
            head_dim=32,
            **MOE,
            **COMMON,
        ),
        "Glm4MoeForCausalLM",
    ),
    "ernie4_5_moe": (
        lambda: T.Ernie4_5_MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=64,
            moe_num_experts=4,
            moe_k=2,
            moe_layer_start_index=0,
            moe_num_shared_experts=1,
            **COMMON,
        ),
        "Ernie4_5_MoeForCausalLM",
    ),
    "hunyuan_moe": (
        lambda: T.HunYuanMoEV1Config(
            intermediate_size=64, num_experts=4, moe_topk=2, num_shared_expert=1, head_dim=32, **COMMON
        ),
        "HunYuanMoEV1ForCausalLM",
    ),
    "minimax": (
        lambda: T.MiniMaxConfig(
            intermediate_size=64, num_local_experts=4, head_dim=32, layer_types=["full_attention"], **MOE, **COMMON
        ),
        "MiniMaxForCausalLM",
    ),
    "deepseek_v2": (
        lambda: T.DeepseekV2Config(
            intermediate_size=64,
            moe_intermediate_size=64,
            n_routed_experts=4,
            first_k_dense_replace=0,
            n_shared_experts=1,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_group=1,
            topk_group=1,
            **MOE,
            **COMMON,
        ),
        "DeepseekV2ForCausalLM",
    ),
    "dots1": (
        lambda: T.Dots1Config(
            intermediate_size=64,
            moe_intermediate_size=64,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            head_dim=32,
            **MOE,
            **COMMON,
        ),
        "Dots1ForCausalLM",
    ),
    "flex_olmo": (
        lambda: T.FlexOlmoConfig(
            intermediate_size=64, num_experts=4, pad_token_id=0, eos_token_id=1, bos_token_id=None, **MOE, **COMMON
        ),
        "FlexOlmoForCausalLM",
    ),
    "lfm2_moe": (
        lambda: T.Lfm2MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=64,
            num_experts=4,
            num_dense_layers=0,
            layer_types=["full_attention"],
            **MOE,
            **COMMON,
        ),
        "Lfm2MoeForCausalLM",
    ),
}
STEPS = 3
LOSS_BOUND = 0.02
"""|loss with mxfx - loss without| / loss without, at each step: MX rounding of every GEMM operand (E4M3, relative
step 2^-4) moves a 1-layer model's loss by well under 2%, and 3 AdamW steps do not pull the runs apart further."""


def _train(model, options=None) -> list[float]:
    """Losses of :data:`STEPS` AdamW steps of ``model`` on fixed ids under CPU BF16 autocast: compiled with mxfx
    when ``options`` is given, else the model itself."""
    torch._dynamo.reset()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    fn = model if options is None else torch.compile(model, backend="mxfp8", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        with torch.autocast("cpu", torch.bfloat16):
            loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(TRAINED))
def test_moe_family_trains_with_every_routed_expert_gemm_converted(name):
    make_cfg, cls = TRAINED[name]
    torch.manual_seed(0)
    model = getattr(T, cls)(make_cfg())  # FP32 parameters
    reference = copy.deepcopy(model)
    before = len(mxfx.all_reports())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _train(model, {"inner": "aot_eager"})
    maps = mxfx.all_reports()[before:]
    routed = [r for pm in maps for r in pm.records if r.kind == "grouped_mm"]
    # the routed experts' two GEMMs (gate/up and down) of the one MoE layer, converted; nothing else left unreported
    assert len(routed) == 2 and all(r.rewritten and ".experts" in r.module for r in routed), [str(pm) for pm in maps]
    assert not [w for w in caught if "not rewritten" in str(w.message) or "read by no GEMM" in str(w.message)]
    assert sum(pm.count(unconverted.KIND) for pm in maps) == 0
    expected = _train(reference)
    assert losses[0] != expected[0]  # MX rounding is on
    for got, want in zip(losses, expected):
        assert abs(got - want) / want < LOSS_BOUND, (losses, expected)
    assert losses[-1] < losses[0]  # it trains


def test_checkpointed_layers_convert_with_the_dynamo_setting_the_warning_names():
    """transformers' activation checkpointing: on torch 2.13 a context variable set inside each checkpointed layer
    breaks the graph there ("HOP: Unsafe side effect") and every layer runs eagerly; the step's warning names their
    weights, the break and the Dynamo setting (torch 2.11 keeps the layers in the graph: no warning). With that setting
    the layers are in the graph: every expert GEMM converted, no weight left unread, and it trains as the model without
    mxfx does (bound: :data:`LOSS_BOUND`)."""
    model = _checkpointed_olmoe()
    reference = copy.deepcopy(model)
    before = len(mxfx.all_reports())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(copy.deepcopy(model), {"inner": "aot_eager"})
    messages = [str(w.message) for w in caught if "read by no GEMM" in str(w.message)]
    converted = [r for pm in mxfx.all_reports()[before:] for r in pm.records if r.kind == "grouped_mm" and r.rewritten]
    if len(converted) == 4:  # torch 2.11's Dynamo keeps the checkpointed layers whole: nothing to warn about
        assert not messages, messages
    else:
        (message,) = messages
        assert "'model.layers.0.self_attn.q_proj.weight'" in message and "'HOP: Unsafe side effect' at " in message
        assert f"{graph_breaks.CHECKPOINT_SETTING} = True" in message, message

    before = len(mxfx.all_reports())
    with (
        warnings.catch_warnings(record=True) as caught,
        torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True),
    ):
        warnings.simplefilter("always")
        losses = _train(model, {"inner": "aot_eager"})
    routed = [r for pm in mxfx.all_reports()[before:] for r in pm.records if r.kind == "grouped_mm"]
    assert len(routed) == 4 and all(r.rewritten for r in routed), [str(pm) for pm in mxfx.all_reports()[before:]]
    assert {r.module for r in routed} == {f"model.layers.{i}.mlp.experts" for i in (0, 1)}
    assert not [w for w in caught if "read by no GEMM" in str(w.message)]
    expected = _train(reference)  # the same checkpointed model without mxfx
    for got, want in zip(losses, expected):
        assert abs(got - want) / want < LOSS_BOUND, (losses, expected)
    assert losses[-1] < losses[0]


def test_pass_off_reports_the_fallback_as_not_rewritten():
    model = _model("olmoe", "grouped_mm")
    _loss_and_grads(model, {"inner": "aot_eager", "passes": {"grouped_mm": False}})
    pm = mxfx.last_report()
    left = [r for r in pm.records if r.kind == unconverted.KIND]
    assert len(left) == 2 and all("transformers::grouped_mm_fallback" in r.reason for r in left), pm.to_text()


torch.library.define("mxfxtest::opaque_experts", "(Tensor x, Tensor w) -> Tensor")


@torch.library.impl("mxfxtest::opaque_experts", "CompositeExplicitAutograd")
def _opaque_experts(x, w):
    return torch.einsum("sk,enk->sn", x, w)


@torch.library.register_fake("mxfxtest::opaque_experts")
def _opaque_experts_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


class OpaqueMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)
        self.experts = torch.nn.Parameter(torch.randn(4, 64, 64) / 8)

    def forward(self, x):
        return torch.ops.mxfxtest.opaque_experts(self.proj(x), self.experts)


def test_unknown_custom_op_over_a_weight_is_reported_and_warned():
    torch._dynamo.reset()
    model = OpaqueMoE()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="mxfp8", options={"inner": "eager"})(torch.randn(32, 64))
        torch._dynamo.reset()
        torch.compile(model, backend="mxfp8", options={"inner": "eager"})(torch.randn(32, 64))
    pm = mxfx.last_report()
    rec = [r for r in pm.records if r.kind == unconverted.KIND]
    assert len(rec) == 1 and "mxfxtest::opaque_experts" in rec[0].reason and "not rewritten" in rec[0].reason
    assert "[4, 64, 64]" in rec[0].shapes
    assert pm.count("linear", True) == 1  # the known op next to it is still rewritten
    mine = [w for w in caught if "not rewritten" in str(w.message)]
    assert len(mine) == 1 and "1 op(s)" in str(mine[0].message) and "mxfxtest::opaque_experts" in str(mine[0].message)


def _fallback(x, w, offs):
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)


GROUPED_CALLS = {
    "transformers::grouped_mm_fallback": _fallback,
    "torch._grouped_mm": torch._grouped_mm,
    "torch.nn.functional.grouped_mm": F.grouped_mm,
}


class GroupedExperts(torch.nn.Module):
    """One projection as transformers writes it (the input cast to the weights' dtype), with a chosen grouped op:
    the fallback with FP32 weights, torch's grouped GEMMs with BF16 ones (they take BF16 only under compile)."""

    def __init__(self, call, dtype):
        super().__init__()
        self.call = call
        self.w = torch.nn.Parameter(torch.randn(4, 96, 64, dtype=dtype))

    def forward(self, x, offs):
        return self.call(x.to(self.w.dtype), self.w.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("op", list(GROUPED_CALLS))
def test_grouped_rewrite_is_the_same_gemm_on_mx_operands(op):
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    torch._dynamo.reset()
    mod = GroupedExperts(GROUPED_CALLS[op], torch.float32 if "::" in op else torch.bfloat16)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    offs = torch.tensor([7, 7, 30, 40], dtype=torch.int32)  # an empty group, uneven sizes
    with torch.autocast("cpu", torch.bfloat16):
        y = torch.compile(mod, backend="mxfp8", options={"inner": "aot_eager"})(x, offs)
    rec = [r for r in mxfx.last_report().records if r.kind == "grouped_mm"]
    assert len(rec) == 1 and rec[0].forward == "mxfp8" and rec[0].shapes.endswith("-> bfloat16")
    assert mxfx.last_report().count(unconverted.KIND) == 0
    assert y.dtype == torch.bfloat16  # the autocast dtype, not the replaced op's float32
    # the replaced op's per-expert products on the MX-rounded operands (x along K, each expert's W along K)
    q_dq = lambda t: mxfx.dequantize(*mxfx.quantize(t, axis=-1), axis=-1, dtype=torch.float32)  # noqa: E731
    xq, wq = q_dq(x.float()), q_dq(mod.w.detach().float())
    ref = torch.cat([xq[s:e] @ wq[g].T for g, (s, e) in enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist()))])
    # same products, fp32 accumulation in another order, then one bf16 rounding (relative 2^-8)
    torch.testing.assert_close(y.float(), ref.bfloat16().float(), rtol=2**-7, atol=1e-3)
    plain = x.float() @ mod.w.detach()[0].float().T  # ... and MX rounding is visible against the unrounded GEMM
    assert (plain[:7] - ref[:7]).abs().max() > 1e-2
