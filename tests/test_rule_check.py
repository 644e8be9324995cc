"""Policy rules: a module glob matches a name or a dotted suffix of it, and the modules inside; a rule matching no
module warns once, judged over all graphs compiled under the policy: when a whole-model graph compiles, else at the
first optimizer step (per-block compile) or at exit; a rule asking for low precision an op cannot take warns."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxfx
import mxfx.fsdp
from mxfx.diagnostics import rule_check
from mxfx.policy import Rule


class Mlp(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.add_module(name, nn.Linear(64, 64))
        self.name = name

    def forward(self, x):
        return torch.relu(getattr(self, self.name)(x))


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Mlp("up"), Mlp("proj")])  # two kinds of block

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class HFLike(nn.Module):
    """Module names as a Hugging Face model spells them: model.layers.0.up, model.layers.1.proj."""

    def __init__(self):
        super().__init__()
        self.model = Inner()

    def forward(self, x):
        return self.model(x)


def _step(model, compiled, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as during_forward:
        warnings.simplefilter("always")
        compiled(x).sum().backward()
    opt.step()
    return [w for w in during_forward if "policy rule" in str(w.message)]


def _rule_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "policy rule" in str(w.message)]


def _per_block_judged(model, options) -> list[str]:
    """Compile each of ``model.layers`` on its own under ``options`` and train one step: the rule warnings, all
    issued at the optimizer step (none during the forward and backward, when not every graph is known yet)."""
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend="mxfp8", options=options)
    with pytest.warns(UserWarning, match="policy rule") as record:
        early = _step(model, model, torch.randn(4, 64))
    assert not early, "judged before the optimizer step"
    return _rule_warnings(record)


def test_glob_matches_name_or_dotted_suffix():
    rule = Rule(module="layers.0.*", precision="bf16")
    assert rule.matches_module("layers.0.up") and rule.matches_module("model.layers.0.up")
    assert not rule.matches_module("model.layers.10.up") and not rule.matches_module("model.xlayers.0.up")
    assert Rule(module="lm_head", precision="bf16").matches_module("model.lm_head") and not Rule(
        module="lm_head", precision="bf16"
    ).matches_module("lm_head_norm")


def test_whole_model_readme_rule_works_on_hf_names_and_unmatched_rule_warns_at_compile():
    model = HFLike()
    options = {
        "inner": "aot_eager",
        "rules": [{"module": "layers.0.*", "precision": "bf16"}, {"module": "blocks.*", "wgrad": "bf16"}],
    }
    with warnings.catch_warnings(record=True) as at_step:
        warnings.simplefilter("always")
        early = _step(model, torch.compile(model, backend="mxfp8", options=options), torch.randn(4, 64))
    (message,) = _rule_warnings(early)  # the whole model is one graph: judged when it compiles, in the forward
    assert not _rule_warnings(at_step), "warned again at the optimizer step"
    by_module = {r.module: r for r in mxfx.last_report().records}
    assert by_module["model.layers.0.up"].forward == "fp32" and by_module["model.layers.1.proj"].forward == "mxfp8"
    assert "(module='blocks.*', wgrad='bf16')" in message and "'model.layers.0.up'" in message


def test_per_block_compile_judges_all_blocks_together():
    """Block 0's graph has no 'proj': judged per graph, the 'proj' rule would warn; over both blocks it must not."""
    model = Inner()
    options = {
        "inner": "aot_eager",
        "rules": [{"module": "proj", "precision": "bf16"}, {"module": "layers.2.*", "precision": "bf16"}],
    }
    messages = _per_block_judged(model, options)
    assert len(messages) == 1 and "(module='layers.2.*', precision='bf16')" in messages[0], messages
    # the names of both graphs, named from the model being called around the blocks
    assert "'layers.1.proj'" in messages[0] and "'layers.0.up'" in messages[0]
    assert [pm.records[0].forward for pm in mxfx.all_reports()[-2:]] == ["mxfp8", "fp32"]  # the 'proj' rule applied
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a later step does not warn again
        rule_check.judge_pending()
        _step(model, model, torch.randn(4, 64))


def test_a_rule_deciding_an_fsdp_all_gather_is_matched():
    """Only block 0 is compiled; block 1 runs eagerly (as a router FSDP2 shards as its own unit does). A rule for
    block 1 matches no module of the graphs; once ``mx_all_gather`` has decided block 1's all-gather form under
    the policy, the rule did change something and is not warned about."""
    for glob, gather in (("proj", False), ("*.proj", True)):  # two policies: each judged once
        model = Inner()
        # min_size: no weight takes an FSDP-only MXFP8 form here (the model is never sharded)
        options = {"inner": "aot_eager", "min_size": 10**12, "rules": [{"module": glob, "precision": "bf16"}]}
        if gather:
            forms = mxfx.fsdp.mx_all_gather(model, options, world_size=1)
            assert forms["layers.1.proj.weight"].startswith("high precision"), forms
        model.layers[0] = torch.compile(model.layers[0], backend="mxfp8", options=options)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            _step(model, model, torch.randn(4, 64))
        messages = [m for m in _rule_warnings(record) if "matches no module" in m]
        assert len(messages) == (0 if gather else 1), messages


def test_inference_whole_model_is_judged_at_compile():
    """No optimizer step: a whole-model graph is judged when it compiles, not at exit (nor under the next model)."""
    model = Inner()
    options = {"inner": "aot_eager", "rules": [{"module": "head", "precision": "bf16"}]}
    with (
        torch.no_grad(),
        pytest.warns(UserWarning, match=r"policy rules\[0\] \(module='head', precision='bf16'\) matches no"),
    ):
        torch.compile(model, backend="mxfp8", options=options)(torch.randn(4, 64))


def test_per_block_inference_is_judged_at_exit():
    """Blocks compiled on their own inside an eager model are not judged at compile (block 0's graph has no 'proj');
    without an optimizer step, the exit hook (judge_pending, registered with atexit) judges them together."""
    model = Inner()
    options = {
        "inner": "aot_eager",
        "rules": [{"module": "proj", "precision": "bf16"}, {"module": "stem", "wgrad": "bf16"}],
    }
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend="mxfp8", options=options)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(4, 64))
    with pytest.warns(UserWarning, match="policy rule") as record:
        rule_check.judge_pending()
    messages = [
        m for m in _rule_warnings(record) if "'stem'" in m or "'proj'" in m
    ]  # other tests' policies may wait too
    assert len(messages) == 1 and "(module='stem', wgrad='bf16') matches no module" in messages[0], messages


def test_rule_naming_a_module_covers_the_modules_inside_it():
    assert Rule(module="layers.0.mlp", precision="bf16").matches_module("model.layers.0.mlp.experts")
    assert Rule(module="layers.*.mlp", precision="bf16").matches_module("model.layers.3.mlp.gate")
    assert not Rule(module="layers.1", precision="bf16").matches_module("model.layers.10.up")
    assert not Rule(module="layers.1.*", precision="bf16").matches_module("model.layers.10.up")
    assert not Rule(module="mlp", precision="bf16").matches_module("layers.0.mlp_norm")
    # the default vocabulary-projection rules name the head itself, not modules inside one of that name
    assert mxfx.Policy().decide("linear", "encoder.layer.0.output.dense").precision == "mxfp8"
    assert mxfx.Policy().decide("linear", "model.lm_head").precision == "bf16"
    model = HFLike()
    options = {"inner": "aot_eager", "rules": [{"module": "model.layers.0", "precision": "bf16"}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rule matches: no "matches no module" warning
        torch.compile(model, backend="mxfp8", options=options)(torch.randn(4, 64))
    by_module = {r.module: r for r in mxfx.last_report().records}
    assert by_module["model.layers.0.up"].forward == "fp32" and by_module["model.layers.1.proj"].forward == "mxfp8"
    assert "(module='model.layers.0', precision='bf16')" in by_module["model.layers.0.up"].reason


class Uneven(nn.Module):
    """``up`` 64->64 is eligible; ``odd`` 64->40 and ``tail`` 40->64 are not (40 is not a multiple of 32)."""

    def __init__(self):
        super().__init__()
        self.up, self.odd, self.tail = nn.Linear(64, 64), nn.Linear(64, 40), nn.Linear(40, 64)

    def forward(self, x):
        return self.tail(self.odd(self.up(x)))


def _compile_warnings(options) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.compile(Uneven(), backend="mxfp8", options=options)(torch.randn(4, 64))
    return [str(w.message) for w in record if "asks for" in str(w.message)]


def test_rule_asking_for_low_precision_warns_when_the_shape_refuses_it():
    options = {
        "inner": "aot_eager",
        "rules": [{"module": "odd", "precision": "mxfp8", "wgrad": "mxfp8"}, {"module": "up", "format": "fp8_block"}],
    }
    messages = _compile_warnings(options)
    by_module = {r.module: r for r in mxfx.last_report().records}
    assert [by_module[m].forward for m in ("up", "odd", "tail")] == ["fp32"] * 3  # kept as written: FP32 model
    assert len(messages) == 2, messages  # not 'tail': only the default rules would convert it
    odd, up = sorted(messages, key=lambda m: "'up'" in m)
    assert "(module='odd', precision='mxfp8', wgrad='mxfp8') asks for mxfp8" in odd
    assert "odd (linear x[4, 64] w[40, 64] +bias): features 64->40 are not multiples of 32" in odd and "pad" in odd
    assert "(module='up', format='fp8_block') asks for fp8_block" in up and "not multiples of 128" in up
    assert not any("tail" in m for m in messages)


def test_policy_wide_fp8_block_is_said_once_and_not_as_a_rule():
    """A policy-wide format="fp8_block" whose tiles refuse every op (up, odd, tail: 64 and 40 features) is said once,
    by the model's coverage warning: not also as a rule whose module glob could be narrowed."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.compile(Uneven(), backend="mxfp8", options={"inner": "aot_eager", "format": "fp8_block"})(
            torch.randn(4, 64)
        )
    messages = [str(w.message) for w in record if str(w.message).startswith("mxfx")]
    assert len(messages) == 1, messages
    assert "converted no op (policy format 'fp8_block'): its 3 GEMM op(s)" in messages[0]
    assert (
        "features 64->40 are not multiples of 128" in messages[0]
        and "a rule with format='mxfp8' takes them" in messages[0]
    )
    assert "module glob" not in messages[0] and "asks for" not in messages[0]


class Gated(Uneven):
    """``odd`` and ``tail`` pad to 32-blocks; ``gate`` 64->1 is narrower than one block."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 1)

    def forward(self, x):
        return super().forward(x) * torch.sigmoid(self.gate(x))


def test_a_rule_over_a_narrow_gate_does_not_tell_to_pad_it():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.compile(Gated(), backend="mxfp8", options={"inner": "aot_eager", "rules": [{"precision": "mxfp8"}]})(
            torch.randn(4, 64)
        )
    (message,) = [str(w.message) for w in record if "asks for" in str(w.message)]
    assert (
        "policy rules[0] (precision='mxfp8') asks for mxfp8, but 3 op(s) it matches stay FP32" in message
    )  # an FP32 model, no autocast
    assert (
        "gate (linear x[4, 64] w[1, 64] +bias): features 64->1 are not multiples of 32 (mxfp8 blocks); the GEMM is "
        "narrower than one block (1 output feature), too narrow to pad"
    ) in message
    assert "pad their features to a multiple of 32" in message  # for odd and tail
    assert message.endswith(
        "'gate' is narrower than one block, too narrow to convert: narrow the rule's module glob "
        "to leave it out, or drop the rule."
    ), message
    assert "pad the" not in message.split("gate (linear")[1].split(". To convert")[0]  # not the gate


def test_rule_errors_name_the_rule_by_index_and_text():
    from mxfx.policy import Policy

    keep = {"module": "lm_head", "precision": "bf16"}
    for rule, head, what in (
        (
            {"module": "x", "op": "lin", "precision": "bf16"},
            "(module='x', op='lin', precision='bf16')",
            "op='lin' is not valid",
        ),
        ({"module": "x", "prec": "bf16"}, "(module='x', prec='bf16')", "unknown rule key(s) ['prec']"),
        (
            {"module": "x", "precision": "bf16", "wgrad": "mxfp8"},
            "(module='x', precision='bf16', wgrad='mxfp8')",
            "keeps its ops as the model wrote them (precision='bf16'), so wgrad would do nothing",
        ),
        (
            {"module": "x", "format": "fp8_block", "scale_rule": "floor"},
            "(module='x', scale_rule='floor', format='fp8_block')",
            "scale_rule='floor' is not a rule of format='fp8_block'",
        ),
    ):
        with pytest.raises(ValueError) as e:
            Policy(rules=[keep, rule])
        assert str(e.value).startswith(f"mxfx policy: rules[1] {head}: {what}"), str(e.value)


def test_rule_asking_for_low_precision_warns_below_min_size_once():
    options = {
        "inner": "aot_eager",
        "min_size": 10**9,
        "rules": [{"module": "up", "precision": "mxfp8", "save": "mxfp8"}],
    }
    (message,) = _compile_warnings(options)
    assert "up (linear x[4, 64] w[64, 64] +bias): GEMM of 16384 MACs is below min_size 1000000000" in message
    assert "min_size=0 on the rule" in message
    assert not _compile_warnings(options)  # once per rule and op


def test_a_block_rule_does_not_switch_the_router_or_head():
    """A rule for a whole block or for every op leaves the ops the default rules keep (routers, the vocabulary
    projection) as they are; a rule naming them (op kind, or their own module) changes them."""
    from mxfx.policy import Policy

    block = Policy(rules=[{"module": "layers.0", "precision": "mxfp8"}])
    assert block.decide("router", "model.layers.0.mlp.gate").precision == "bf16"
    assert block.decide("linear", "model.layers.0.mlp.up").precision == "mxfp8"
    assert block.requesting_rule("router", "model.layers.0.mlp.gate") is None  # so no "stays BF16" warning
    every = Policy(rules=[{"precision": "mxfp8"}])
    assert every.decide("linear", "m.lm_head").precision == "bf16"
    assert (
        Policy(rules=[{"op": "router", "precision": "mxfp8"}]).decide("router", "model.layers.0.mlp.gate").precision
        == "mxfp8"
    )
    assert (
        Policy(rules=[{"module": "mlp.gate", "precision": "mxfp8"}])
        .decide("router", "model.layers.0.mlp.gate")
        .precision
        == "mxfp8"
    )
    assert (
        Policy(rules=[{"module": "lm_head", "precision": "mxfp8"}]).decide("linear", "m.lm_head").precision == "mxfp8"
    )
    # a BF16 block rule still keeps everything in it, router included
    assert (
        Policy(rules=[{"module": "layers.0", "precision": "bf16"}]).decide("linear", "layers.0.mlp.up").precision
        == "bf16"
    )


@pytest.mark.parametrize(
    "rule, what",
    [
        ({"module": "layers.0"}, "sets nothing"),
        ({"op": "linear"}, "sets nothing"),
        ({"module": "x", "precision": "bf16", "wgrad": "mxfp8"}, "wgrad would do nothing"),
        ({"precision": "bf16", "format": "fp8_block"}, "format would do nothing"),
    ],
)
def test_a_rule_that_would_do_nothing_is_refused(rule, what):
    from mxfx.policy import Policy

    with pytest.raises(ValueError, match=what):
        Policy(rules=[rule])


class GluBlock(nn.Module):
    """A dense block as models spell it: a norm (no GEMM), an attention-like projection and a SwiGLU MLP."""

    def __init__(self, glu: bool = True):
        super().__init__()
        self.input_layernorm, self.attn = nn.LayerNorm(64), nn.Linear(64, 64)
        self.gate, self.down = nn.Linear(64, 64), nn.Linear(64, 64)
        self.up = nn.Linear(64, 64) if glu else None  # every parameter in the graph: a whole forward, judged at compile
        self.glu = glu

    def forward(self, x):
        x = x + self.attn(self.input_layernorm(x))
        h = F.silu(self.gate(x)) * self.up(x) if self.glu else torch.relu(self.gate(x))
        return x + self.down(h)


class GluModel(nn.Module):
    def __init__(self, glu=(True, True)):
        super().__init__()
        self.layers = nn.ModuleList([GluBlock(g) for g in glu])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _compile_rule_warnings(model, rules) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.compile(model, backend="mxfp8", options={"inner": "aot_eager", "rules": rules})(torch.randn(4, 64))
    return _rule_warnings(record)


def test_rule_for_a_module_without_a_gemm_warns_at_compile():
    """The norm module exists (no "matches no module" warning), but holds no op a rule decides."""
    (message,) = _compile_rule_warnings(GluModel(), [{"module": "layers.0.input_layernorm", "precision": "mxfp8"}])
    assert message.startswith(
        "mxfx: policy rules[0] (module='layers.0.input_layernorm', precision='mxfp8') matches "
        "module 'layers.0.input_layernorm', but there is no op a rule decides"
    ), message
    assert "so it changes nothing. Op kinds found there: none." in message
    assert "Ops a rule decides are in 'layers.0', 'layers.0.attn', 'layers.0.down'" in message  # swiglu, linears
    assert "point the module glob there, or drop the rule." in message and "matches no module" not in message
    assert all(r.forward == "mxfp8" for r in mxfx.last_report().records if r.kind == "linear")  # nothing changed


def test_rule_for_an_op_kind_its_module_lacks_warns_once():
    """op='swiglu' on the attention projection, and on a block without SwiGLU (layer 1 uses ReLU)."""
    rules = [
        {"module": "attn", "op": "swiglu", "precision": "bf16"},
        {"module": "layers.1", "op": "swiglu", "save": "bf16"},
    ]
    attn, dense = _compile_rule_warnings(GluModel(glu=(True, False)), rules)
    assert (
        "(module='attn', op='swiglu', precision='bf16') matches modules 'layers.0.attn', 'layers.1.attn', "
        "but there is no swiglu op there, so it changes nothing. Op kinds found there: linear, saved."
    ) in attn
    assert "The swiglu ops are in 'layers.0': point the module glob there, or set op to a kind found there" in attn
    assert "(module='layers.1', op='swiglu', save='bf16') matches module 'layers.1', but there is no swiglu op" in dense
    swiglu = [r for r in mxfx.last_report().records if r.kind == "swiglu"]
    assert [(r.module, r.forward) for r in swiglu] == [("layers.0", "mxfp8")]  # the rules changed nothing
    rules = [{"module": "attn", "op": "grouped_mm", "precision": "bf16"}]
    (message,) = _compile_rule_warnings(GluModel(), rules)
    assert "The graphs compiled under this policy have no grouped_mm op at all; drop the rule." in message


def test_rule_matching_an_op_in_any_graph_does_not_warn():
    """Per-block compile: block 0's graph has no SwiGLU and no 'up', block 1's has both; judged over both at the
    optimizer step, the rules for them matched and do not warn, while the norm rule (no op in any graph) does."""
    model = GluModel(glu=(False, True))
    options = {
        "inner": "aot_eager",
        "rules": [
            {"op": "swiglu", "save": "bf16"},
            {"module": "up", "op": "linear", "wgrad": "bf16"},
            {"module": "input_layernorm", "precision": "bf16"},
        ],
    }
    messages = [
        m for m in _per_block_judged(model, options) if "input_layernorm" in m or "op='swiglu'" in m or "'up'" in m
    ]
    assert len(messages) == 1, messages
    assert (
        "(module='input_layernorm', precision='bf16') matches modules 'layers.0.input_layernorm', "
        "'layers.1.input_layernorm', but there is no op"
    ) in messages[0]
    by_kind_module = {(r.kind, r.module): r for r in mxfx.last_report().records}
    # applied: gate and up kept as they are, a high-precision wgrad, both FP32 in this FP32 model
    assert (
        by_kind_module["swiglu", "layers.1"].saved == "fp32" and by_kind_module["linear", "layers.1.up"].wgrad == "fp32"
    )


def test_keep_dequantized_weights_with_only_fp8_block_is_refused():
    """keep_dequantized_weights serves emulated MX GEMMs only: with every op in fp8_block it would do nothing."""
    from mxfx.policy import Policy

    with pytest.raises(ValueError, match="keep_dequantized_weights=True would do nothing"):
        Policy(format="fp8_block", keep_dequantized_weights=True)
    mixed = Policy(format="fp8_block", keep_dequantized_weights=True, rules=[{"module": "attn", "format": "mxfp8"}])
    assert mixed.decide("linear", "layers.0.attn.qkv").keep_dequantized_weights


def test_a_rule_setting_a_field_its_op_kind_never_reads_is_refused():
    """Each op kind reads some rule fields (:data:`mxfx.policy.KIND_FIELDS`): a rule for that kind setting another
    one would change nothing and is refused, naming the rule, the field, the kind, what it reads and who reads the
    field. A rule that can match several kinds (no ``op``) may set any field some kind reads."""
    from mxfx.policy import KIND_FIELDS, Policy

    keep = {"module": "lm_head", "precision": "bf16"}
    with pytest.raises(ValueError) as e:
        Policy(rules=[keep, {"op": "all_to_all", "wgrad": "bf16"}])
    assert str(e.value) == (
        "mxfx policy: rules[1] (op='all_to_all', wgrad='bf16'): sets wgrad, which all_to_all ops never read (they "
        "read precision, scale_rule, format), so it would do nothing; drop it, or set it with a rule for the op kinds "
        "that read it (linear, grouped_mm, router)"
    ), str(e.value)
    with pytest.raises(
        ValueError,
        match=r"^mxfx policy: rules\[0\] \(op='saved', save='bf16'\): sets save, which "
        r"saved ops never read \(they read precision\)",
    ):
        Policy(rules=[{"op": "saved", "save": "bf16"}])
    with pytest.raises(
        ValueError,
        match=r"rules\[0\] \(module='mlp', op='swiglu', format='fp8_block'\): sets format, "
        r"which swiglu ops never read \(they read precision, save\)",
    ):
        Policy(rules=[{"module": "mlp", "op": "swiglu", "format": "fp8_block"}])
    with pytest.raises(
        ValueError,
        match=r"^mxfx policy: rule \(op='all_to_all', min_size=0\) sets min_size, which "
        r"all_to_all ops never read",
    ):
        Rule(op="all_to_all", min_size=0)
    # fields the kind reads, and rules with no op kind, stay valid
    Policy(
        rules=[
            {"op": "all_to_all", "scale_rule": "floor"},
            {"op": "swiglu", "save": "bf16"},
            {"op": "saved", "precision": "bf16"},
            {"op": "linear", "wgrad": "bf16", "min_size": 10},
            {"op": "grouped_mm", "save": "bf16", "format": "fp8_block", "scale_rule": "amax"},
            {"module": "layers.*", "wgrad": "bf16", "min_size": 10, "save": "bf16"},
        ]
    )
    assert KIND_FIELDS["linear"] == KIND_FIELDS["grouped_mm"] == KIND_FIELDS["router"]


def test_a_weight_refresh_rule_says_where_the_refresh_is_set():
    """The cache refresh of a compiled optimizer step reads no rule field: a rule for it is refused, saying what
    sets the caches it rebuilds and how the step's compile turns it off, not just "drop the rule"."""
    from mxfx.policy import Policy

    with pytest.raises(ValueError) as e:
        Policy(rules=[{"op": "weight_refresh", "format": "fp8_block"}])
    message = str(e.value)
    assert message.startswith(
        "mxfx policy: rules[0] (op='weight_refresh', format='fp8_block'): is for "
        "weight_refresh, which reads no rule field"
    ), message
    assert (
        "drop it. The refresh runs in the compiled optimizer step (torch.compile(opt.step, backend='mxfp8')) and "
        "rebuilds each weight's caches in the format and scale_rule its ops were given"
    ) in message
    assert "options={'passes': {'weight_refresh': False}}" in message


@pytest.mark.parametrize(
    "options, what",
    [
        ({"format": "bf16_gemm", "scale_rule": "floor"}, "scale_rule='floor' would do nothing: format='bf16_gemm'"),
        ({"format": "bf16_gemm", "scale_rule": "amax"}, "scale_rule='amax' would do nothing"),
        (
            {"rules": [{"format": "bf16_gemm", "scale_rule": "floor"}]},
            "rules[0] (scale_rule='floor', format='bf16_gemm'): scale_rule='floor' would do nothing",
        ),
        (  # the rule's format is the policy's
            {"format": "bf16_gemm", "rules": [{"op": "linear", "scale_rule": "rceil"}]},
            "rules[0] (op='linear', scale_rule='rceil'): scale_rule='rceil' would do nothing",
        ),
    ],
)
def test_a_scale_rule_for_a_format_without_scales_is_refused(options, what):
    """bf16_gemm has no scales: a scale rule given for it would change nothing, so it is refused (as
    keep_dequantized_weights is), naming the rule; the format alone, or as one rule's, is fine."""
    with pytest.raises(ValueError, match=re.escape(what)):
        mxfx.Policy(**options)
    mxfx.Policy(format="bf16_gemm")
    mxfx.Policy(format="fp8_block", rules=[{"op": "linear", "format": "bf16_gemm"}])


def test_a_transport_without_an_all_to_all_warns():
    """``transport`` sets the precision of expert-parallel all-to-alls; a model without one gets told it does
    nothing (as a rule matching no op is)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        options = {"inner": "aot_eager", "transport": {"dispatch_fwd": "bf16"}}
        torch.compile(GluModel(), backend="mxfp8", options=options)(torch.randn(4, 64))
    (message,) = [str(w.message) for w in record if "transport" in str(w.message)]
    assert message.startswith("mxfx: policy transport={'dispatch_fwd': 'bf16'} sets the precision of") and (
        "have none (no dispatch or combine across ranks), so it changes nothing; drop it" in message
    )
