"""The precision map states what ran: each column the dtype from the graph's own example values (autocast
regions, FP32 models, FP32 fallbacks) or ``-`` where no backward runs; the saved pass packs only where its
format's copy is smaller, and says why in that format's terms."""

import warnings

import pytest
import torch
import torch.nn as nn

import mxfx
from mxfx.report import OpRecord, PrecisionMap

EAGER = {"inner": "eager"}


def _columns(record) -> tuple:
    return record.forward, record.dgrad, record.wgrad, record.saved


def _by_module(kind="linear") -> dict:
    return {r.module: r for r in mxfx.last_report().records if r.kind == kind}


def test_fp32_model_without_autocast_is_mapped_and_warned_as_fp32():
    """Linears kept as written in an FP32 model without autocast run in FP32 (their output says so): the map says
    fp32, the first without a dgrad (its input needs no gradient), and the warning says they stay in FP32."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(100, 60), nn.ReLU(), nn.Linear(60, 100))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.compile(model, backend="mxfp8", options=EAGER)(torch.randn(32, 100))
    assert y.dtype == torch.float32
    records = _by_module()
    assert _columns(records["0"]) == ("fp32", "-", "fp32", "fp32")
    assert _columns(records["2"]) == ("fp32",) * 4
    (message,) = [str(w.message) for w in caught if "converted no op" in str(w.message)]
    assert "all stay in FP32" in message and "BF16:" not in message


class _Router(nn.Module):
    """A router whose logits are computed with autocast off on FP32 operands, next to an expert-sized linear."""

    def __init__(self, autocast_off: bool):
        super().__init__()
        self.autocast_off = autocast_off
        self.gate, self.up = nn.Linear(64, 4, bias=False), nn.Linear(64, 64)

    def forward(self, x):
        with torch.autocast("cpu", enabled=not self.autocast_off):
            logits = self.gate(x.float())
        weights, _ = logits.softmax(-1).topk(2, -1)
        return self.up(x) * weights.sum(-1, keepdim=True).to(x.dtype)


@pytest.mark.parametrize("autocast_off,ran", [(True, "fp32"), (False, "bf16")])
def test_router_kept_as_written_is_mapped_in_the_dtype_it_ran(autocast_off, ran):
    torch._dynamo.reset()
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        torch.compile(_Router(autocast_off), backend="mxfp8", options=EAGER)(x)
    (router,) = [r for r in mxfx.last_report().records if r.kind == "router"]
    assert not router.rewritten and _columns(router) == (ran,) * 4, router
    # the rule's precision='bf16' means "as written": the reason says so beside the columns' dtype
    assert router.reason == "kept as written by default rule (op='router', precision='bf16')", router.reason


class _NoGradBranch(nn.Module):
    """Two MX-sized linears and one kept as written (40 features) on the same input, two of them under no_grad."""

    def __init__(self):
        super().__init__()
        self.frozen_path, self.kept, self.trained = nn.Linear(64, 64), nn.Linear(64, 40), nn.Linear(64, 64)

    def forward(self, x):
        with torch.no_grad():
            t = self.frozen_path(x)
            k = self.kept(x)
        return self.trained(x) + t + k.sum(-1, keepdim=True)


def test_ops_under_no_grad_in_a_training_graph_have_no_backward():
    """Under torch.no_grad() inside a training graph, converted and kept ops alike run forward only: no
    dgrad/wgrad/saved and no saved bytes, while the trained linear beside them keeps its backward."""
    torch._dynamo.reset()
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        y = torch.compile(_NoGradBranch(), backend="mxfp8", options=EAGER)(x)
    y.float().sum().backward()
    records = _by_module()
    assert _columns(records["frozen_path"]) == ("mxfp8", "-", "-", "-")
    assert records["frozen_path"].saved_bytes == (0, 0) and "torch.no_grad()" in records["frozen_path"].reason
    assert _columns(records["kept"]) == ("bf16", "-", "-", "-")
    assert _columns(records["trained"]) == ("mxfp8",) * 4
    # only the trained linear saves its input: 32 x 64 values, BF16 as written, one MX copy packed
    assert mxfx.last_report().saved_bytes() == (32 * 64 * 2, 32 * 64 * 33 // 32)


class _Combine(nn.Module):
    """An expert down projection, then the combine's multiply by FP32 route weights (an FP32 product, as HF's)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 64, 64) * 0.1)

    def forward(self, h, offs, rw):
        y = torch._grouped_mm(h, self.w.to(torch.bfloat16).transpose(-2, -1), offs=offs)
        return y * rw.unsqueeze(-1)


def test_combine_row_states_the_fp32_multiply():
    """The fused route-weight multiply runs in FP32 (weigh_rows), and the unweighted output kept for the
    route-weight gradient has the product's dtype: FP32 here, as the op's output."""
    torch._dynamo.reset()
    h = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    offs, rw = torch.tensor([16, 40], dtype=torch.int32), torch.rand(40, requires_grad=True)
    y = torch.compile(_Combine(), backend="mxfp8", options=EAGER)(h, offs, rw)
    (combine,) = [r for r in mxfx.last_report().records if r.kind == "combine"]
    assert y.dtype == torch.float32 and _columns(combine) == ("fp32", "mxfp8", "-", "fp32"), combine


def test_hf_fp32_fallback_kept_by_a_rule_is_mapped_fp32():
    """transformers' grouped-GEMM FP32 fallback (FP32 main weights under autocast) kept by a precision='bf16' rule
    runs in FP32, and the map says so."""
    T = pytest.importorskip("transformers")
    cfg = T.OlmoeConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
    )
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    model = T.OlmoeForCausalLM(cfg)
    torch._dynamo.reset()
    options = {"inner": "eager", "rules": [{"op": "grouped_mm", "precision": "bf16"}]}
    with torch.autocast("cpu", torch.bfloat16):
        torch.compile(model, backend="mxfp8", options=options)(torch.randint(0, 128, (2, 16)))
    grouped = [r for r in mxfx.last_report().records if r.kind == "grouped_mm"]
    assert len(grouped) == 2 and all(not r.rewritten and "grouped_mm_fallback" in r.reason for r in grouped), grouped
    assert all(_columns(r) == ("fp32",) * 4 for r in grouped), grouped


# --- the saved pass ---------------------------------------------------------------------------------


def _packing(tokens: int, options=None) -> PrecisionMap:
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.GELU(), nn.Linear(96, 64, bias=False))
    with torch.autocast("cpu", torch.bfloat16):
        torch.compile(model, backend="mxfp8", options={**EAGER, **(options or {})})(torch.randn(2, tokens // 2, 64))
    return mxfx.last_report()


def test_few_tokens_pack_only_copies_smaller_than_the_input_kept():
    """At 14 tokens the MX copies are padded to 32 tokens. The first linear's input is the FP32 model input, which
    it would keep in FP32 (3584 bytes): its 2112-byte copy is packed, though larger than the 1792 BF16 bytes the
    op as written saves. GELU's BF16 output (2688 bytes) is kept: its copy (3168 bytes) is not smaller, and the
    reason says so. The summary counts what is saved, the growth over the ops as written included."""
    pm = _packing(14, {"fuse_wgrad_accumulation": False})  # no wgrad note in the reasons
    first, second = (r for r in pm.records if r.kind == "linear")
    assert (first.saved, second.saved) == ("mxfp8", "bf16")
    assert first.saved_bytes == (14 * 64 * 2, 32 * 64 * 33 // 32) and first.reason == ""
    assert second.saved_bytes == (14 * 96 * 2, 14 * 96 * 2)
    assert (
        "the mxfp8 copy (3168 bytes, 14 tokens zero-padded to a multiple of 32) is not smaller than the "
        "2688-byte bf16 input kept as it is"
    ) in second.reason, second
    assert pm.saved_bytes() == (14 * (64 + 96) * 2, 2112 + 2688)
    assert "4480 B as written -> 4800 B (7.1% more, nominal)" in pm.summary()


def test_enough_tokens_pack_the_first_input():
    """At 64 tokens the first linear's MX copy (2 tokens blocks of 32) is smaller than its BF16 input: packed."""
    pm = _packing(64)
    first = next(r for r in pm.records if r.kind == "linear")
    assert first.saved == "mxfp8" and first.saved_bytes == (64 * 64 * 2, 64 * 64 * 33 // 32)


def test_summary_names_growth_as_growth():
    """Nominal saved bytes that grow read "more", never as a negative "less"."""
    pm = PrecisionMap()
    rec = OpRecord("n", "linear", "m", "x", "mxfp8", "mxfp8", "mxfp8", "mxfp8", "rceil", saved_bytes=(4480, 4800))
    pm.records.append(rec)
    assert "4480 B as written -> 4800 B (7.1% more, nominal)" in pm.summary()


def test_a_format_without_scales_shows_no_scale_rule():
    """bf16_gemm has no scales: its rows show no scale rule ("-"), in the records and in the printed map; an MXFP8
    row shows the rule its scales follow."""
    pm = _packing(64, {"format": "bf16_gemm"})
    rows = [r for r in pm.records if r.kind == "linear"]
    assert [r.scale_rule for r in rows] == ["-", "-"] and all(r.rewritten for r in rows), rows
    assert not [line for line in str(pm).splitlines() if "linear" in line and "rceil" in line], str(pm)
    assert [r.scale_rule for r in _packing(64).records if r.kind == "linear"] == ["rceil", "rceil"]


def test_saved_reasons_speak_of_the_ops_format():
    """bf16_gemm: a BF16 copy of a BF16 input saves nothing, and the reason names bf16_gemm, without token padding
    (only MXFP8's token-blocked wgrad copy pads); three converted readers of one input, each quantizing it itself
    (no shared quantize), name their format's copies."""
    pm = _packing(14, {"format": "bf16_gemm"})
    second = [r for r in pm.records if r.kind == "linear"][1]
    assert second.saved == "bf16" and "the bf16_gemm copy (2688 bytes) is not smaller" in second.reason, second
    assert "padded" not in second.reason and "MX" not in second.reason

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(128, 128, bias=False) for _ in range(3))

        def forward(self, x):
            return self.q(x) + self.k(x) + self.v(x)

    torch._dynamo.reset()
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        torch.compile(
            QKV(),
            backend="mxfp8",
            options={
                **EAGER,
                "format": "fp8_block",
                "passes": {"shared_quantize": False},
                "fuse_wgrad_accumulation": False,  # no wgrad note in the reasons
            },
        )(x)
    reasons = {r.reason for r in mxfx.last_report().records if r.kind == "linear"}
    assert reasons == {
        "read by 3 converted ops: one 2-byte copy is smaller than 3 fp8_block copies (1.03125 bytes a value)"
    }


def _backward_receives(cap) -> list[tuple[torch.dtype, tuple, int]]:
    """``(dtype, shape, bytes)`` of each tensor the captured backward graphs receive from their forward (what
    autograd keeps alive between them; tangents left out)."""
    out = []
    for g in cap.backward:
        for n in g.graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder" and isinstance(v, torch.Tensor) and not n.name.startswith("tangents"):
                out.append((v.dtype, tuple(v.shape), v.numel() * v.element_size()))
    return out


_NO_OP_CASTS = {
    "float": lambda t: t.float(),
    "to_dtype": lambda t: t.to(torch.float32),
    "to_own_dtype": lambda t: t.to(t.dtype),
    "type": lambda t: t.type(torch.float32),
    "_to_copy": lambda t: torch.ops.aten._to_copy.default(t, dtype=torch.float32),
    "convert_element_type": lambda t: torch.ops.prims.convert_element_type.default(t, torch.float32),
}


class _SavedBeside(nn.Module):
    """A converted 64->64 linear and a 64->4 one kept as written (4 features: no MX block) on the same FP32 tokens,
    one of them reading them through ``cast``: the kept linear saves what it reads for its weight gradient."""

    def __init__(self, cast, cast_for: str):
        super().__init__()
        self.cast, self.cast_for = cast, cast_for
        self.gate, self.up = nn.Linear(64, 4, bias=False), nn.Linear(64, 64, bias=False)

    def forward(self, x):
        gate_in, up_in = (self.cast(x), x) if self.cast_for == "gate" else (x, self.cast(x))
        return self.up(up_in) * self.gate(gate_in).sum(-1, keepdim=True)


@pytest.mark.parametrize("cast_for", ["gate", "up"])
@pytest.mark.parametrize("cast", list(_NO_OP_CASTS), ids=list(_NO_OP_CASTS))
def test_a_no_op_cast_is_the_tensor_it_casts(cast, cast_for):
    """A cast to the dtype a tensor already has is that tensor (or a copy the partitioner makes from it): the FP32
    tokens the kept linear saves are the converted linear's input too, so an MX copy beside them would add its
    bytes. Kept as they are, counted once, and the backward receives no E4M3 qdata."""
    from tests.helpers import GraphCapture

    torch._dynamo.reset()
    torch.manual_seed(0)
    cap = GraphCapture()
    y = torch.compile(_SavedBeside(_NO_OP_CASTS[cast], cast_for), backend="mxfp8", options={"inner": cap})(
        torch.randn(32, 64)
    )
    y.sum().backward()
    up = _by_module()["up"]
    assert up.saved == "fp32" and "also saved by linear" in up.reason, up
    assert up.saved_bytes == (0, 0)  # the kept linear saves those tokens either way: the converted op adds nothing
    received = _backward_receives(cap)
    assert not [r for r in received if r[0] == torch.float8_e4m3fn], received
    assert (torch.float32, (32, 64), 32 * 64 * 4) in received, received


class _DetachedScale(nn.Module):
    """A converted 64->64 linear beside ``w * x.detach()``: the multiply saves the detached tokens (the same storage
    as x) for w's gradient."""

    def __init__(self):
        super().__init__()
        self.up, self.w = nn.Linear(64, 64, bias=False), nn.Parameter(torch.ones(64))

    def forward(self, x):
        return self.up(x) + self.w * x.detach()


def test_a_detached_tensor_that_another_op_saves_keeps_its_base():
    torch._dynamo.reset()
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        torch.compile(_DetachedScale(), backend="mxfp8", options=EAGER)(x)
    up = _by_module()["up"]
    assert up.saved == "bf16" and up.reason.startswith("also saved by mul"), up
    assert up.saved_bytes == (0, 0), up  # kept anyway: the linear adds no bytes


def test_a_cast_that_changes_the_dtype_is_a_tensor_of_its_own():
    """The kept linear reads an FP32 cast of BF16 tokens (a new tensor, under autocast cast back to a BF16 copy):
    the BF16 tokens themselves are not kept for it, so the converted linear's MX copy replaces them."""
    torch._dynamo.reset()
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with torch.autocast("cpu", torch.bfloat16):
        torch.compile(_SavedBeside(lambda t: t.float(), "gate"), backend="mxfp8", options=EAGER)(x)
    up = _by_module()["up"]
    assert up.saved == "mxfp8" and up.saved_bytes == (32 * 64 * 2, 32 * 64 * 33 // 32), up


def test_fp32_example_moe_keeps_the_tokens_its_router_saves():
    """The main job's MoE layer run in FP32 (its reference arm's dtype): the router's ``x.float()`` changes nothing,
    and the router's FP32 GEMM saves the tokens for its weight gradient; the shared expert's gate and up read the
    same tokens, so they keep them (counted once) instead of packing two MX copies beside them."""
    from tests.helpers import GraphCapture
    from tests.models import MoE, tiny_config

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MoE(tiny_config())
    for p in layer.parameters():
        nn.init.normal_(p, std=0.1)
    cap = GraphCapture()
    y = torch.compile(layer, backend="mxfp8", options={"inner": cap})(torch.randn(2, 32, 64, requires_grad=True))
    y.sum().backward()
    records = _by_module()
    gate, up = records["shared_gate"], records["shared_up"]
    assert (gate.saved, up.saved) == ("fp32", "fp32"), (gate, up)
    assert "also saved by linear" in gate.reason and "also saved by linear" in up.reason
    assert (gate.saved_bytes, up.saved_bytes) == ((0, 0), (0, 0))  # the router saves them either way
    # the tokens reach the backward in FP32, and no E4M3 copy of them does: the [64, 64] E4M3 qdata the backward
    # receives are the shared SwiGLU's gate and up, packed for its backward, and shared_down's token-blocked input
    # (with shared_gate and shared_up packing their copies too, five)
    received = _backward_receives(cap)
    assert (torch.float32, (64, 64), 64 * 64 * 4) in received, received
    assert [r[1] for r in received if r[0] == torch.float8_e4m3fn and r[1] == (64, 64)] == [(64, 64)] * 3, received


@pytest.mark.parametrize("tokens,k,packed", [(14, 64, True), (7, 256, False)])
def test_fp32_input_under_autocast_is_judged_by_its_own_bytes(tokens, k, packed):
    """Under BF16 autocast a linear as written saves a BF16 cast of its FP32 input, but the converted linear that
    keeps its input keeps the FP32 tensor itself: the MX copy (qdata and E8M0 scales, tokens zero-padded to 32) is
    packed where it is smaller than those FP32 bytes (14 x 64: 2112 < 3584, though more than the 1792 BF16 bytes)
    and kept where it is not (7 x 256: 8448 >= 7168), and the map counts the bytes the backward receives."""
    from tests.helpers import GraphCapture

    torch._dynamo.reset()
    cap = GraphCapture()
    with torch.autocast("cpu", torch.bfloat16):
        y = torch.compile(  # unfused: the backward receives the saved input only, not the weight whose .grad it adds to
            nn.Linear(k, 64, bias=False), backend="mxfp8", options={"inner": cap, "fuse_wgrad_accumulation": False}
        )(torch.randn(tokens, k))
    y.float().sum().backward()
    (rec,) = [r for r in mxfx.last_report().records if r.kind == "linear"]
    fp32_bytes, copy_bytes = tokens * k * 4, 32 * k + 32 * k // 32  # E4M3 qdata + one E8M0 scale per 32 values
    received = _backward_receives(cap)
    assert rec.saved_bytes == (tokens * k * 2, copy_bytes if packed else fp32_bytes), rec
    assert sum(n for *_, n in received) == rec.saved_bytes[1], received
    if packed:
        assert rec.saved == "mxfp8" and (torch.float8_e4m3fn, (k, 32), 32 * k) in received, (rec, received)
    else:
        assert rec.saved == "fp32" and received == [(torch.float32, (tokens, k), fp32_bytes)], received
        assert (
            f"the mxfp8 copy ({copy_bytes} bytes, {tokens} tokens zero-padded to a multiple of 32) is not smaller "
            f"than the {fp32_bytes}-byte fp32 input kept as it is"
        ) in rec.reason, rec


def _checkpointed_by_closure(orig):
    return lambda x: torch.utils.checkpoint.checkpoint(orig, x, use_reentrant=False)


def _checkpointed_by_default(orig):
    return lambda x, orig=orig: torch.utils.checkpoint.checkpoint(orig, x, use_reentrant=False)


@pytest.mark.parametrize("override", [_checkpointed_by_closure, _checkpointed_by_default])
def test_a_block_whose_forward_is_overridden_per_instance_keeps_its_modules_names(override):
    """``blk.forward = lambda x: checkpoint(orig, x)`` with ``orig`` the block's bound forward: Dynamo reaches the
    block's modules through the closure (``layers.0.forward.__closure__[0].cell_contents.__self__.proj``); the map
    names them as ``named_modules()`` does, so rules written for ``layers.0.proj`` match."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, x):
            return torch.relu(self.proj(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Model()
    for blk in model.layers:
        blk.forward = override(blk.forward)
    compiled = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(torch.randn(32, 64)).sum().backward()
    modules = {r.module for r in mxfx.last_report().records if r.kind == "linear"}
    assert modules == {"layers.0.proj", "layers.1.proj"}, mxfx.last_report().to_text()


@pytest.mark.parametrize("options", [{}, {"save": "bf16"}])
def test_saved_bytes_as_written_do_not_depend_on_the_save_policy(options):
    """An input another op's backward keeps alive (ReLU's output) costs the linear reading it no bytes of its own,
    whether the policy would have packed it or keeps every input as it is: the "as written" side is the same."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    compiled = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager", **options})
    compiled(torch.randn(80, 64, requires_grad=True)).sum().backward()
    pm = mxfx.last_report()
    assert "saved inputs of converted ops 20480 B as written" in pm.summary()  # the first linear's FP32 input
    (second,) = [r for r in pm.records if r.module == "2"]
    assert "kept alive by relu backward" in second.reason and second.saved_bytes == (0, 0)
