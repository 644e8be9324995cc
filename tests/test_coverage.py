"""What a compiled model leaves unconverted is said once per model (mxfx.diagnostics.coverage): layers whose shapes do
not fit,
MoE experts no compiled graph saw, and every model's complete list, whatever names an earlier model shared."""

import warnings

import pytest
import torch
import torch.nn as nn

import mxfx

OPTS = {"inner": "aot_eager"}


def _mxfx_warnings(fn, *args) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args)
    return [str(w.message) for w in caught if str(w.message).startswith("mxfx")]


def _compile_and_run(model, x, options=OPTS):
    torch._dynamo.reset()
    torch.compile(model, backend="mxfp8", options=options)(x).float().sum().backward()


class Narrow(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(100, 60)

    def forward(self, x):
        return self.proj(x)


class Partly(nn.Module):
    """``up`` fits MXFP8's 32-blocks; ``out`` (256 -> 40) does not."""

    def __init__(self):
        super().__init__()
        self.up, self.out = nn.Linear(256, 256), nn.Linear(256, 40)

    def forward(self, x):
        return self.out(torch.relu(self.up(x)))


def test_a_model_that_converts_nothing_says_so_once():
    model = Narrow()
    messages = _mxfx_warnings(_compile_and_run, model, torch.randn(8, 100))
    (message,) = [m for m in messages if "converted no op" in m]
    assert "model Narrow" in message and "its 1 GEMM op(s) all stay in FP32" in message
    assert "features 100->60 are not multiples of 32" in message and "'proj'" in message
    assert mxfx.last_report().count("linear", rewritten=True) == 0
    assert not _mxfx_warnings(_compile_and_run, model, torch.randn(8, 100))  # the same model: said once


def test_layers_whose_shapes_do_not_fit_are_counted_and_named():
    model = Partly()
    messages = _mxfx_warnings(_compile_and_run, model, torch.randn(64, 256))
    (message,) = [m for m in messages if "shapes do not fit" in m]
    assert "model Partly: 1 of its 2 GEMM op(s) stay in FP32" in message
    assert "features 256->40 are not multiples of 32" in message and "'out'" in message and "'up'" not in message
    assert mxfx.last_report().count("linear", rewritten=True) == 1
    # a rule keeping it in BF16 on purpose is an answer: no warning
    kept = {**OPTS, "rules": [{"module": "out", "precision": "bf16"}]}
    assert not [m for m in _mxfx_warnings(_compile_and_run, Partly(), torch.randn(64, 256), kept) if "fit" in m]


class Gates(nn.Module):
    """Two projections narrower than any block beside a wide one: ``in_proj_ba`` 128->8 and a 1-output gate 128->1."""

    def __init__(self):
        super().__init__()
        self.up, self.in_proj_ba, self.gate = nn.Linear(128, 128), nn.Linear(128, 8), nn.Linear(128, 1)

    def forward(self, x):
        h = self.up(x)
        return h * torch.sigmoid(self.gate(h)) + self.in_proj_ba(h).sum(-1, keepdim=True)


def test_each_module_is_named_with_its_own_shape_and_gates_are_not_told_to_pad():
    messages = _mxfx_warnings(_compile_and_run, Gates(), torch.randn(16, 128))
    (message,) = [m for m in messages if "shapes do not fit" in m]
    assert (
        "1 x features 128->8 are not multiples of 32 (mxfp8 blocks); the GEMM is narrower than one block (8 output "
        "features), too narrow to pad: it stays as the model wrote it ('in_proj_ba')"
    ) in message
    assert (
        "1 x features 128->1 are not multiples of 32 (mxfp8 blocks); the GEMM is narrower than one block (1 output "
        "feature), too narrow to pad: it stays as the model wrote it ('gate')"
    ) in message
    assert "pad the features" not in message and "'up'" not in message


class MatmulWeight(nn.Module):
    """A weight used through ``@`` (no mxfx pattern): ``[256, n]``."""

    def __init__(self, n: int):
        super().__init__()
        self.up, self.w = nn.Linear(256, 256), nn.Parameter(torch.randn(256, n) / 16)

    def forward(self, x):
        return self.up(x) @ self.w


def test_a_weight_no_format_tiles_is_not_called_one_mxfx_would_convert():
    """``[256, 8]``: 8 is no multiple of MXFP8's 32, so the policy would not convert it even in an op a pass rewrites;
    the map says so and no warning calls it convertible. ``[256, 64]`` would be converted: that one is warned."""
    messages = _mxfx_warnings(_compile_and_run, MatmulWeight(8), torch.randn(64, 256))
    assert not [m for m in messages if "not rewritten" in m or "would convert" in m], messages
    (record,) = [r for r in mxfx.last_report().records if r.kind == "not_rewritten"]
    assert record.reason.endswith(
        "the policy would not convert this weight anyway: its dims 256 and 8 are not both "
        "multiples of 32 (mxfp8 blocks)"
    ), record.reason
    messages = _mxfx_warnings(_compile_and_run, MatmulWeight(64), torch.randn(64, 256))
    (message,) = [m for m in messages if "not rewritten" in m]
    assert "model MatmulWeight: 1 op(s) read a weight mxfx would convert but were not rewritten (@)" in message


class LoopExperts(nn.Module):
    """Experts applied one by one over views of a stacked weight, with a graph break before the loop: the views
    reach the resumed graph as plain tensors (Dbrx's pattern), or the whole forward runs eagerly."""

    def __init__(self, eager: bool):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 64, 64) / 8)
        self.eager = eager

    def forward(self, x):
        if self.eager:
            return _eager_experts(x, self.w1)
        ws = self.w1.unbind(0)
        torch._dynamo.graph_break()
        return sum(x @ w.T for w in ws)


@torch.compiler.disable
def _eager_experts(x, w1):
    return sum(x @ w.T for w in w1.unbind(0))


class LoopMoE(nn.Module):
    def __init__(self, eager: bool):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.experts = LoopExperts(eager)

    def forward(self, x):
        return self.experts(self.proj(x))


@pytest.mark.parametrize("eager", [False, True], ids=["graph_break", "eager_fallback"])
def test_experts_no_compiled_graph_read_are_named_at_the_step(eager):
    model = LoopMoE(eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = len(mxfx.all_reports())
    compiled = _mxfx_warnings(_compile_and_run, model, torch.randn(32, 64))
    assert not [m for m in compiled if "expert" in m]  # not the whole forward: judged at the step
    assert sum(pm.count("linear", rewritten=True) for pm in mxfx.all_reports()[before:]) == 1  # proj
    messages = _mxfx_warnings(opt.step)
    (message,) = [m for m in messages if "read by no GEMM" in m]
    assert "model LoopMoE: 1 weight(s) were read by no GEMM" in message and "'experts.w1'" in message
    assert "proj" not in message  # converted, in a compiled graph
    # the break: torch._dynamo.graph_break() at its line, or the call of the torch.compiler.disable'd function
    line = LoopExperts.forward.__code__.co_firstlineno + (2 if eager else 4)
    assert f"test_coverage.py:{line}" in message, message
    assert not _mxfx_warnings(opt.step)  # once


def test_experts_in_the_graph_are_not_named():
    """The same loop without the break: the GEMMs over the weight's views are in the graph (reported as not
    rewritten there), so the weight is not among those no graph read."""

    class InGraph(LoopExperts):
        def forward(self, x):
            return sum(x @ w.T for w in self.w1.unbind(0))

    model = LoopMoE(False)
    model.experts = InGraph(False)
    messages = _mxfx_warnings(_compile_and_run, model, torch.randn(32, 64))  # the whole forward: judged at compile
    (message,) = [m for m in messages if "were not rewritten" in m]
    assert "model LoopMoE: 4 op(s)" in message and "(@)" in message
    assert not [m for m in messages if "read by no GEMM" in m]


def test_dbrx_experts_outside_the_graph_are_named():
    """Dbrx loops over its experts in Python (graph breaks): its expert weights reach no compiled GEMM; the first
    optimizer step names them (FP32 without autocast: transformers' own eager loop rejects BF16 autocast there)."""
    T = pytest.importorskip("transformers")
    cfg = T.DbrxConfig(
        d_model=64,
        n_heads=2,
        n_layers=1,
        max_seq_len=64,
        vocab_size=128,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    )
    torch.manual_seed(0)
    model = T.DbrxForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    before = len(mxfx.all_reports())

    def run():
        torch._dynamo.reset()
        torch.compile(model, backend="mxfp8", options=OPTS)(input_ids=ids, labels=ids).loss.backward()

    assert not [m for m in _mxfx_warnings(run) if "expert" in m]
    assert not [r for pm in mxfx.all_reports()[before:] for r in pm.records if ".experts" in r.module]
    (message,) = [m for m in _mxfx_warnings(torch.optim.SGD(model.parameters(), lr=0.1).step) if "read by no GEMM" in m]
    assert "model DbrxForCausalLM: 3 weight(s)" in message and "Graph breaks Dynamo recorded" in message
    assert all(f"'transformer.blocks.0.ffn.experts.mlp.{w}'" in message for w in ("w1", "v1", "w2")), message


class HandWrittenMoE(nn.Module):
    """Experts as a first-time user writes them: a loop over the experts, ``torch.where`` for each one's rows,
    ``x[rows] @ w[e].T`` and ``index_add_``; nothing is named "expert". ``torch.where``'s data-dependent output
    shape breaks the graph inside the loop, so Dynamo runs this forward eagerly."""

    def __init__(self, d: int = 64, hidden: int = 64, n: int = 4):
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.w_in = nn.Parameter(torch.randn(n, hidden, d) / 8)
        self.w_out = nn.Parameter(torch.randn(n, d, hidden) / 8)

    def forward(self, x):
        top, idx = self.router(x).softmax(-1).topk(2, -1)
        out = torch.zeros_like(x)
        for e in range(self.w_in.shape[0]):
            rows, slot = torch.where(idx == e)
            h = torch.relu(x[rows] @ self.w_in[e].T)
            out.index_add_(0, rows, (h @ self.w_out[e].T) * top[rows, slot, None])
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.proj = nn.Embedding(128, 64), nn.Linear(64, 64)
        self.moe, self.head = HandWrittenMoE(), nn.Linear(64, 128)

    def forward(self, ids):
        x = self.proj(self.embed(ids))
        return self.head(x + self.moe(x))


def test_weights_no_compiled_graph_read_are_named_whatever_their_names():
    """The weights of a hand-written MoE whose forward ran eagerly are named at the step, by their names, with the
    break that sent it there (its reason and line); the embedding, in a graph and no GEMM's weight, is not."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(0))
    compiled = _mxfx_warnings(_compile_and_run, model, ids)
    assert not [m for m in compiled if "read by no GEMM" in m]  # not the whole forward: judged at the step
    (message,) = [m for m in _mxfx_warnings(opt.step) if "read by no GEMM" in m]
    # the router's nn.Linear runs in the eager frame too: the graph after it (head's, resumed) reads head's weight only
    assert "model Net: 3 weight(s)" in message and "'moe.w_in', 'moe.w_out', 'moe.router.weight'" in message, message
    line = HandWrittenMoE.forward.__code__.co_firstlineno + 4  # rows, slot = torch.where(idx == e)
    assert f"'Dynamic shape operator' at {__file__}:{line}" in message, message
    assert "embed" not in message and "'proj" not in message and "head" not in message


def test_weights_outside_the_compiled_blocks_are_not_named():
    """Only blocks are compiled (torchtitan's per-block compile): the head, run eagerly by design, is not named;
    the hand-written experts of a compiled block, which its break left eager, are."""
    model = Net()
    model.proj, model.moe = (torch.compile(m, backend="mxfp8", options=OPTS) for m in (model.proj, model.moe))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch._dynamo.reset()
    _mxfx_warnings(lambda: model(torch.randint(0, 128, (64,))).float().sum().backward())
    (message,) = [m for m in _mxfx_warnings(opt.step) if "read by no GEMM" in m]
    assert "'moe.w_in'" in message and "head" not in message and "embed" not in message, message


def test_weights_a_rule_keeps_are_not_named():
    """The same eager MoE with a rule keeping its router as written: the router's GEMM running eagerly changes
    nothing the user asked for (FSDP2 runs a router sharded as its own unit eagerly), so only the experts are named."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(0))
    options = {**OPTS, "rules": [{"module": "moe.router", "precision": "bf16"}]}
    _mxfx_warnings(_compile_and_run, model, ids, options)
    (message,) = [m for m in _mxfx_warnings(opt.step) if "read by no GEMM" in m]
    assert "model Net: 2 weight(s)" in message and "'moe.w_in', 'moe.w_out'" in message, message
    assert "router" not in message


def test_weights_swapped_after_the_compile_are_known_by_name():
    """FSDP2 registers other parameter objects on a module than the ones a graph read (unsharded while it runs,
    sharded after): a weight is known by its name in the model, so one the graph read is not called unread when
    the module holds another object under that name at the step."""
    model = LoopMoE(eager=False)
    model.experts = nn.Linear(64, 64)
    torch._dynamo.reset()
    for name in ("proj", "experts"):  # per-block compile, as FSDP2 users do
        setattr(model, name, torch.compile(getattr(model, name), backend="mxfp8", options=OPTS))
    _mxfx_warnings(lambda: model(torch.randn(32, 64)).sum().backward())
    for module in (model.proj, model.experts):  # what FSDP2 does between the forward and the step
        module.weight = nn.Parameter(module.weight.detach().clone())
        module.weight.grad = torch.zeros_like(module.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not [m for m in _mxfx_warnings(opt.step) if "read by no GEMM" in m]
    assert len([pm for pm in mxfx.all_reports() if pm.count("linear", rewritten=True)]) >= 2  # both were converted


def test_passes_the_policy_switches_off_are_not_warned_about():
    """``passes={"linear": False}``: the linears stay as written because the user asked; the map says so and no
    warning calls the model unconverted or its GEMMs convertible."""
    options = {**OPTS, "passes": {"linear": False}}
    messages = _mxfx_warnings(_compile_and_run, Partly(), torch.randn(64, 256), options)
    assert not messages, messages
    left = [r for r in mxfx.last_report().records if r.kind == "not_rewritten"]
    assert len(left) == 2 and all("the 'linear' pass is switched off" in r.reason for r in left), left
    messages = _mxfx_warnings(_compile_and_run, Partly(), torch.randn(64, 256), OPTS)  # switched on: 'out' is said
    assert [m for m in messages if "1 of its 2 GEMM op(s)" in m], messages


class Uneven2(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.odd = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.odd(self.up(x))


class Uneven4(Uneven2):
    """Two more layers, and the first model's module names."""

    def __init__(self):
        super().__init__()
        self.tail, self.extra = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.extra(self.tail(super().forward(x)))


def test_a_second_model_gets_its_complete_warning():
    """fp8_block's 128-tiles refuse every 64-feature layer: the second model, which shares two module names with the
    first, is told about all four of its layers, not the two the first did not have."""
    fp8_block = {**OPTS, "format": "fp8_block"}
    first = _mxfx_warnings(_compile_and_run, Uneven2(), torch.randn(4, 64), fp8_block)
    assert [m for m in first if "converted no op (policy format 'fp8_block'): its 2 GEMM op(s)" in m]
    second = _mxfx_warnings(_compile_and_run, Uneven4(), torch.randn(4, 64), fp8_block)
    (message,) = [m for m in second if "converted no op" in m]
    assert "its 4 GEMM op(s)" in message and "4 x features 64->64 are not multiples of 128" in message
    assert "('up', 'odd', 'tail', 'extra')" in message


torch.library.define("mxfxcov::opaque", "(Tensor x, Tensor w) -> Tensor")


@torch.library.impl("mxfxcov::opaque", "CompositeExplicitAutograd")
def _opaque(x, w):
    return x @ w.T


@torch.library.register_fake("mxfxcov::opaque")
def _opaque_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


class Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        return torch.ops.mxfxcov.opaque(self.proj(x), self.w)


def test_ops_not_rewritten_are_warned_for_every_model():
    def run(model):
        torch._dynamo.reset()
        torch.compile(model, backend="mxfp8", options=OPTS)(torch.randn(8, 64))

    for model in (Opaque(), Opaque()):
        (message,) = [m for m in _mxfx_warnings(run, model) if "not rewritten" in m]
        assert "model Opaque: 1 op(s)" in message and "mxfxcov::opaque" in message


def test_the_shape_hint_names_the_dtype_the_kept_op_runs_in():
    """A GEMM whose features do not fit stays as the model wrote it: in FP32 in an FP32 model without autocast,
    in BF16 under BF16 autocast; the hint says which, not BF16 for both."""
    messages = _mxfx_warnings(_compile_and_run, Partly(), torch.randn(64, 256))
    (message,) = [m for m in messages if "shapes do not fit" in m]
    assert "features 256->40 are not multiples of 32 (mxfp8 blocks); pad the features or keep it in FP32" in message
    assert "BF16" not in message
    with torch.autocast("cpu", dtype=torch.bfloat16):
        messages = _mxfx_warnings(_compile_and_run, Partly(), torch.randn(64, 256))
    (message,) = [m for m in messages if "shapes do not fit" in m]
    assert "stay in BF16" in message and "pad the features or keep it in BF16" in message
    # where the dtype is not known (FSDP2's gather forms, before any forward): as the model wrote it
    from mxfx.policy import Policy

    reason = Policy().decide("linear", "out").fit(256, 40).reason
    assert reason.endswith("pad the features or keep it as the model wrote it"), reason


def test_bf16_gemm_names_its_alignment_not_blocks():
    """bf16_gemm has no scale blocks: its multiple of 8 is the BF16 GEMM's 16-byte row alignment, and its texts
    say so (the block formats still say blocks)."""
    opts = {**OPTS, "format": "bf16_gemm"}
    messages = _mxfx_warnings(_compile_and_run, Narrow(), torch.randn(8, 100), opts)
    (message,) = [m for m in messages if "converted no op" in m]
    assert "features 100->60 are not multiples of 8 (BF16 GEMM alignment: 16-byte rows)" in message
    assert "blocks" not in message
    _mxfx_warnings(_compile_and_run, MatmulWeight(12), torch.randn(64, 256), opts)
    (record,) = [r for r in mxfx.last_report().records if r.kind == "not_rewritten"]
    assert record.reason.endswith(
        "its dims 256 and 12 are not both multiples of 8 (BF16 GEMM alignment: 16-byte rows)"
    ), record.reason
    from mxfx import formats
    from mxfx.ops.linear import mx_linear

    with pytest.raises(
        ValueError,
        match=r"format='bf16_gemm' needs in/out features that are multiples of 8 \(BF16 "
        r"GEMM alignment: 16-byte rows\), got 100->60",
    ):
        mx_linear(torch.randn(4, 100), torch.randn(60, 100), format="bf16_gemm")
    assert formats.get("mxfp8").unfit_reason(100, 60) == "features 100->60 are not multiples of 32 (mxfp8 blocks)"


class TopLevelLoopMoE(nn.Module):
    """A hand-written MoE compiled as the model itself: its forward loops over the experts with ``torch.where``
    (a data-dependent shape) per expert, so Dynamo skips the whole frame and no graph reaches the backend."""

    def __init__(self, d: int = 64, n: int = 4):
        super().__init__()
        self.proj, self.router = nn.Linear(d, d), nn.Linear(d, n, bias=False)
        self.w = nn.Parameter(torch.randn(n, d, d) / 8)

    def forward(self, x):
        x = self.proj(x)
        top = self.router(x).argmax(-1)
        out = torch.zeros(x.shape[0], self.w.shape[-1])
        for e in range(self.w.shape[0]):
            idx = torch.where(top == e)[0]
            out.index_add_(0, idx, (x[idx] @ self.w[e]).float())
        return out


def _train_two_steps(model, opt) -> list[str]:
    compiled = torch.compile(model, backend="mxfp8", options=OPTS)
    torch._dynamo.reset()

    def steps():
        for _ in range(2):
            with torch.autocast("cpu", torch.bfloat16):
                compiled(torch.randn(32, 64)).float().sum().backward()
            opt.step()
            opt.zero_grad()

    return _mxfx_warnings(steps)


@pytest.fixture
def watched():
    handle = mxfx.watch_steps()
    yield
    handle.remove()


def test_a_model_dynamo_skips_whole_is_named_at_the_first_step(watched):
    """FP32 parameters under BF16 autocast, two steps: no graph reaches the backend (no precision map), and the
    first optimizer step names the weights it stepped (the router's gets no gradient through argmax), once."""
    model = TopLevelLoopMoE()
    before = len(mxfx.all_reports())
    messages = _train_two_steps(model, torch.optim.SGD(model.named_parameters(), lr=0.1))
    assert len(mxfx.all_reports()) == before
    (message,) = [m for m in messages if "no graph compiled by the mxfp8 backend took" in m]
    assert "SGD stepped 2 weight(s)" in message and "'w', 'proj.weight'" in message, message
    assert "Dynamo compiled no graph of it" in message and "fullgraph=True" in message
    # without names from the optimizer: a model registered with mxfx.name_modules names them
    model = mxfx.name_modules(TopLevelLoopMoE())
    (message,) = [
        m for m in _train_two_steps(model, torch.optim.SGD(model.parameters(), lr=0.1)) if "no graph compiled" in m
    ]
    assert "'w', 'proj.weight'" in message, message


def test_an_id_a_dead_graph_input_had_does_not_count_as_the_new_weight_taken(watched):
    """Graphs record the ids of the tensors they take; once such a tensor dies its id may be a new weight's. A
    model no graph took is still named at its first step when its weights' ids are among those recorded (as if
    earlier graphs' dead inputs had had them)."""
    from mxfx.diagnostics import coverage

    model = TopLevelLoopMoE()
    ids = {id(p) for p in model.parameters()} - coverage._anonymous.inputs
    coverage._anonymous.inputs.update(ids)
    try:
        messages = _train_two_steps(model, torch.optim.SGD(model.named_parameters(), lr=0.1))
    finally:
        coverage._anonymous.inputs.difference_update(ids)
    (message,) = [m for m in messages if "no graph compiled by the mxfp8 backend took" in m]
    assert "'w', 'proj.weight'" in message, message


def test_eager_training_beside_the_backend_is_not_warned_about_unless_watched():
    """The check is on request: a model trained eagerly in a process that loaded the backend (a reference arm
    beside a compiled one) gets no warning; under :func:`mxfx.watch_steps` it is named, and after the handle's
    ``remove()`` it is not."""
    torch._dynamo.lookup_backend("mxfp8")

    def eager_step(model):
        opt = torch.optim.SGD(model.named_parameters(), lr=0.1)

        def step():
            model(torch.randn(8, 64)).sum().backward()
            opt.step()

        return [m for m in _mxfx_warnings(step) if "no graph compiled" in m]

    assert eager_step(nn.Sequential(nn.Linear(64, 64))) == []
    handle = mxfx.watch_steps()
    try:
        assert mxfx.watch_steps() is handle  # registered once
        (message,) = eager_step(nn.Sequential(nn.Linear(64, 64)))
        assert "'0.weight'" in message, message
    finally:
        handle.remove()
    assert eager_step(nn.Sequential(nn.Linear(64, 64))) == []


def test_a_model_a_graph_reached_is_not_called_skipped(watched):
    model = Partly()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _compile_and_run(model, torch.randn(64, 256))
    assert not [m for m in _mxfx_warnings(opt.step) if "no graph compiled" in m]


class Between(nn.Module):
    """A loop over ``nn.Linear`` experts (``torch.where`` per expert: Dynamo skips the frame) between two linears of
    the compiled model: the linear after it is called on the resumed graph's stack, where its parameters' names are
    relative to it (``weight``) and every ``nn.Linear`` of the model has a parameter of that name."""

    def __init__(self, d: int = 64, n: int = 4):
        super().__init__()
        self.pre, self.post = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n))

    def loop(self, x):
        top = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = torch.where(top == e)[0]
            out = out.index_add(0, rows, expert(x[rows]))
        return out

    def forward(self, x):
        return self.post(self.loop(self.pre(x)))


def test_a_linear_on_the_resumed_stack_reads_only_its_own_weight():
    """The graph after the loop is ``post``'s and no other linear's: the experts it never read are named."""
    model = Between()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _mxfx_warnings(_compile_and_run, model, torch.randn(32, 64))
    (message,) = [m for m in _mxfx_warnings(opt.step) if "read by no GEMM" in m]
    assert "model Between: 4 weight(s)" in message, message
    assert all(f"'experts.{e}.weight'" in message for e in range(4)) and "'pre" not in message, message
    assert f"'Dynamic shape operator' at {__file__}" in message, message


class Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint`` (its ops sit in the region's body graph)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("wrap", ["checkpoint", "checkpoint_wrapper"])
def test_weights_read_inside_a_checkpointed_region_are_not_named(wrap):
    """Every GEMM of the checkpointed layer is in the graph (converted, or the router kept in FP32 on purpose): the
    body's ops read the weights through the region's operands, and none is called unread, though body and outer
    graph share node names (the router's ``logits`` and the head's)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from tests.models import MoETransformer, tiny_config

    torch.manual_seed(0)
    model = MoETransformer(tiny_config())
    model.layers = nn.ModuleList(
        (Checkpointed if wrap == "checkpoint" else checkpoint_wrapper)(b) for b in model.layers
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))

    def step():
        torch._dynamo.reset()
        with torch.autocast("cpu", torch.bfloat16):
            torch.compile(model, backend="mxfp8", options=OPTS)(idx)[0].float().sum().backward()
        opt.step()

    messages = _mxfx_warnings(step)
    records = mxfx.last_report().records
    assert any(r.kind == "router" and ".moe" in r.module for r in records), mxfx.last_report().to_text()
    assert not [m for m in messages if "read by no GEMM" in m], messages
