"""The weight gradient written once, on the main job's MoE model (tests/models.py) compiled with ``backend="mxfp8"``
under BF16 autocast with FP32 main weights:

* each converted op's weight gradient leaves its wgrad GEMM in FP32 (no cast after it in the compiled backward),
  for every format;
* with ``fuse_wgrad_accumulation`` the wgrad GEMMs write ``.grad`` themselves: the compiled backward returns no
  gradient for those weights and no ``AccumulateGrad`` adds one (profiled), the gradients equal autograd's
  accumulation (frozen weights, clipping, a transposed expert stack), weights with hooks keep autograd's
  accumulation, and a backward that accumulates into no such weight (``torch.autograd.grad`` of other tensors,
  ``backward(inputs=...)``) leaves its ``.grad`` alone. tests/test_accumulation.py runs the accumulation cases
  (microbatches, ``zero_grad``, the step's cache refresh, DDP and FSDP2) both ways.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, profile

import mxfx
from mxfx.kernels.common import custom_ops as common_ops
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear
from mxfx.passes.wgrad_accumulation import FUSED_NOTE, UNFUSED_NOTE
from tests.helpers import GraphCapture
from tests.models import MoETransformer, tiny_config

FORMATS = ("mxfp8", "fp8_block", "bf16_gemm")
MX_WEIGHTS = (
    "attn.qkv.weight",
    "attn.o_proj.weight",
    "moe.shared_gate.weight",
    "moe.shared_up.weight",
    "moe.shared_down.weight",
    "moe.gate_up_proj",
    "moe.down_proj",
)
"""The weights the compiled model's converted ops read: the dense linears and the routed experts (the router and
lm_head stay as written, their BF16 autocast GEMMs widened by autograd as in eager)."""
VIEWS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.alias.default,
}
CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


FUSE_RTOL = 1e-6
"""Relative Frobenius error allowed between a weight's gradient accumulated by its fused wgrad GEMM and by autograd
over the same microbatches: the same FP32 terms, summed in another order (the GEMM adds its partial sums into
``.grad``); tests/test_accumulation.py's ``ACCUM_RTOL``, for the same reasons. A microbatch lost or counted twice,
or a gradient in the wrong layout, is off by tens of percent."""


def _model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(tiny_config(d_model=128, expert_hidden=128, shared_hidden=128))


def _ids(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(10 + i))


def _microbatches(run, n: int) -> None:
    for i in range(n):
        with torch.autocast("cpu", torch.bfloat16):
            loss = run(_ids(i), _ids(i))[1]
        (loss / n).backward()


def _compiled(model, fuse: bool, fmt: str = "mxfp8"):
    return torch.compile(
        model, backend="mxfp8", options={"inner": "aot_eager", "format": fmt, "fuse_wgrad_accumulation": fuse}
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _notes(pm) -> list[tuple[str, str]]:
    """What the precision map says of each converted GEMM's weight gradient: ``(module, "fused" | "autograd" | "")``
    ("": no note, a frozen weight's GEMM), sorted."""
    return sorted(
        (r.module, "fused" if FUSED_NOTE in r.reason else "autograd" if UNFUSED_NOTE in r.reason else "")
        for r in pm.records
        if r.kind in ("linear", "grouped_mm") and r.rewritten
    )


def _backward_graph(fmt: str, **options) -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """One microbatch of the compiled model: its backward graph, and the node that graph returns as the gradient of
    each parameter (by the parameter's name)."""
    model, capture, inputs = _model(), GraphCapture(), []

    def inner(gm, example_inputs):
        inputs.extend(example_inputs)
        return capture(gm, example_inputs)

    run = torch.compile(model, backend="mxfp8", options={"inner": inner, "format": fmt, **options})
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", torch.bfloat16):
        loss = run(ids, ids)[1]
    loss.backward()
    (bw,) = capture.backward
    grads = next(n for n in bw.graph.nodes if n.op == "output").args[0][: len(inputs)]
    names = {id(p): n for n, p in model.named_parameters()}
    return bw, {names[id(t)]: g for t, g in zip(inputs, grads, strict=True) if id(t) in names}


def _producer(node: fx.Node) -> fx.Node:
    """The node that computes ``node``'s values: views walked back."""
    while node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
    return node


@pytest.mark.parametrize("fmt,wgrad", [(f, None) for f in FORMATS] + [("mxfp8", "bf16")])
def test_weight_gradients_leave_their_gemm_in_fp32(fmt, wgrad):
    """No cast from BF16 turns a converted op's weight gradient into the FP32 main weight's dtype: the wgrad GEMM
    (or its op) writes FP32 itself, also the dense linears' high-precision wgrad (``wgrad="bf16"``). Before: the
    routed experts' BF16 grouped wgrad (every format), and the dense high-precision wgrads (bf16_gemm's, any
    format's under ``wgrad="bf16"``: an FP32 GEMM that the forward's autocast turned BF16), were BF16 results
    widened by a ``_to_copy`` in the graph."""
    _, grads = _backward_graph(fmt, fuse_wgrad_accumulation=False, **({"wgrad": wgrad} if wgrad else {}))
    widened = {}
    for name in MX_WEIGHTS:
        node = _producer(grads[f"layers.0.{name}"])
        assert node.meta["val"].dtype == torch.float32, (name, node.meta["val"].dtype)
        if node.target in CASTS and node.args[0].meta["val"].dtype == torch.bfloat16:
            widened[name] = str(_producer(node.args[0]).target)
    assert not widened, f"{fmt}: weight gradients widened from BF16 after their GEMM: {widened}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_backward_graph_returns_no_weight_gradient(fmt):
    """Fused, the compiled backward returns None for each converted op's weight (``AccumulateGrad`` gets nothing to
    add) and calls ``mxfx::wgrad_into_grad`` once per weight, with no effect token (Inductor's FX graph cache
    refuses graphs holding one; tests/test_compile_cache.py)."""
    bw, grads = _backward_graph(fmt, fuse_wgrad_accumulation=True)
    returned = {name: grads[f"layers.0.{name}"] for name in MX_WEIGHTS}
    assert all(g is None for g in returned.values()), returned
    assert grads["lm_head.weight"] is not None and grads["layers.0.moe.gate.weight"] is not None  # kept as written
    calls = [
        n for n in bw.graph.nodes if n.op == "call_function" and n.target is torch.ops.mxfx.wgrad_into_grad.default
    ]
    assert len(calls) == len(MX_WEIGHTS), bw.print_readable(print_output=False)
    assert not any(n.target is torch.ops.higher_order.with_effects for n in bw.graph.nodes)


def _accumulate_grad_adds(prof, shapes: set) -> int:
    """``aten::add_`` calls of ``AccumulateGrad`` on a tensor of one of ``shapes``."""

    def under_accumulate_grad(e) -> bool:
        while e is not None:
            if e.name == "torch::autograd::AccumulateGrad":
                return True
            e = e.cpu_parent
        return False

    return sum(
        1
        for e in prof.events()
        if e.name == "aten::add_" and e.input_shapes and tuple(e.input_shapes[0]) in shapes and under_accumulate_grad(e)
    )


def test_no_separate_add_of_a_fused_weight_gradient():
    """Profiled second microbatch (``.grad`` exists): autograd's accumulation adds each converted weight's gradient
    with an ``AccumulateGrad`` ``add_`` (7); fused, none remains and ``mxfx::wgrad_into_grad`` runs once per weight.
    The other weights' ``add_`` (embedding, norms, router, lm_head) run either way."""
    counts = {}
    for fuse in (False, True):
        model = _model()
        run = _compiled(model, fuse)
        shapes = {tuple(model.get_parameter(f"layers.0.{n}").shape) for n in MX_WEIGHTS}
        others = {tuple(p.shape) for p in model.parameters()} - shapes
        _microbatches(run, 1)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            _microbatches(run, 1)
        ops = sum(1 for e in prof.events() if e.name == "mxfx::wgrad_into_grad")
        counts[fuse] = (_accumulate_grad_adds(prof, shapes), ops, _accumulate_grad_adds(prof, others))
    assert counts[False][:2] == (len(MX_WEIGHTS), 0), counts
    assert counts[True][:2] == (0, len(MX_WEIGHTS)), counts
    assert counts[True][2] == counts[False][2] > 0, counts


def test_frozen_weights_and_clipping_as_autograd():
    """Two weights frozen, three microbatches, then ``clip_grad_norm_``: the fused gradients equal autograd's within
    :data:`FUSE_RTOL` (clipping reads the finished ``.grad``), the frozen weights have none, and the first
    microbatch wrote each fused gradient where ``.grad`` was None (``zero_grad(set_to_none=True)``)."""
    frozen = ("layers.0.attn.qkv.weight", "layers.0.moe.down_proj")
    grads = {}
    for fuse in (False, True):
        model = _model()
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)
        run = _compiled(model, fuse)
        model.zero_grad(set_to_none=True)
        _microbatches(run, 3)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
        grads[fuse] = {n: p.grad for n, p in model.named_parameters()}
        if fuse:  # the frozen weights' GEMMs (qkv, one of the experts') have no wgrad to note
            notes = [note for _, note in _notes(mxfx.last_report())]
            assert sorted(notes) == ["", ""] + ["fused"] * (len(MX_WEIGHTS) - 2), notes
    for name, grad in grads[False].items():
        if name in frozen:
            assert grad is None and grads[True][name] is None, name
        else:
            assert _rel(grads[True][name], grad) <= FUSE_RTOL, name


def test_hooks_keep_autograd_accumulation():
    """Weights with a post-accumulate-grad hook or a gradient hook when the graph compiles keep autograd's
    accumulation (noted in the precision map; their hooks run each microbatch, their gradients as without the
    fusion), the others are fused; a hook registered on a fused weight after the compile raises in the backward,
    naming it."""
    calls = []
    model = _model()
    o_proj, shared_up = model.layers[0].attn.o_proj.weight, model.layers[0].moe.shared_up.weight
    o_proj.register_post_accumulate_grad_hook(lambda p: calls.append("o_proj"))
    shared_up.register_hook(lambda g: calls.append("shared_up"))
    run = _compiled(model, True)
    _microbatches(run, 2)
    notes = _notes(mxfx.last_report())
    kept = [module for module, note in notes if note == "autograd"]
    assert kept == ["layers.0.attn.o_proj", "layers.0.moe.shared_up"], notes
    assert [note for _, note in notes].count("fused") == len(MX_WEIGHTS) - 2, notes
    assert sorted(calls) == ["o_proj", "o_proj", "shared_up", "shared_up"], calls
    reference = _model()
    _microbatches(_compiled(reference, False), 2)
    for name, p in model.named_parameters():
        assert _rel(p.grad, reference.get_parameter(name).grad) <= FUSE_RTOL, name
    model.layers[0].moe.shared_down.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(RuntimeError, match=r"weight \(128, 128\).*register_post_accumulate_grad_hook"):
        _microbatches(run, 1)


def test_compiled_autograd_keeps_autograds_accumulation():
    """Under compiled autograd (``torch._dynamo.config.compiled_autograd``) the traced backward leaves out the op that
    writes ``.grad``, so every converted op returns its gradient to autograd (its record says why) and the
    gradients of a backward compiled with it equal the unfused ones; a fused op there would leave them None."""
    model, reference = _model(), _model()

    def step(m, fuse):
        @torch.compile(
            backend="mxfp8", options={"inner": "aot_eager", "format": "fp8_block", "fuse_wgrad_accumulation": fuse}
        )
        def run(ids):
            with torch.autocast("cpu", torch.bfloat16):
                loss = m(ids, ids)[1]
            loss.backward()

        run(_ids(0))

    with torch._dynamo.config.patch(compiled_autograd=True):
        n_maps = len(mxfx.report.all_reports())
        step(model, True)  # the forward's graph, then compiled autograd's backward graph (no converted op of its own)
        notes = [r for pm in mxfx.report.all_reports()[n_maps:] for r in pm.records]
        torch._dynamo.reset()
        step(reference, False)
    torch._dynamo.reset()
    fused = [r for r in notes if r.kind in ("linear", "grouped_mm") and r.rewritten]
    assert fused and all("compiled autograd" in r.reason and UNFUSED_NOTE in r.reason for r in fused), fused
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert _rel(p.grad, reference.get_parameter(name).grad) <= FUSE_RTOL, name


def _mlp_grads(fuse: bool, around_compile, around_backward) -> list:
    """The weight gradients of a small MLP compiled with the fusion on or off, its compile and backward each run
    inside a context manager factory (compiled autograd turned on there or not)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    run = torch.compile(
        mlp, backend="mxfp8", options={"inner": "aot_eager", "format": "fp8_block", "fuse_wgrad_accumulation": fuse}
    )
    with around_compile():
        with torch.autocast("cpu", torch.bfloat16):
            loss = run(torch.randn(64, 128, generator=torch.Generator().manual_seed(1))).float().square().mean()
        with around_backward():
            loss.backward()
    torch._dynamo.reset()
    return [mlp[0].weight.grad, mlp[2].weight.grad]


def test_compiled_autograd_turned_on_by_a_context_keeps_autograds_accumulation():
    """torchtitan turns compiled autograd on with a context around forward and backward (no config flag): the
    compile sees it and gives every weight gradient back to autograd; the gradients equal the unfused ones."""
    from contextlib import nullcontext

    from torch._dynamo.utils import maybe_enable_compiled_autograd

    on = lambda: maybe_enable_compiled_autograd(True)  # noqa: E731
    fused, unfused = _mlp_grads(True, on, nullcontext), _mlp_grads(False, on, nullcontext)
    for got, want in zip(fused, unfused):
        assert got is not None and _rel(got, want) <= FUSE_RTOL


def test_compiled_autograd_turned_on_after_the_compile_raises():
    """Turned on only after the graph compiled, compiled autograd runs the fused op where it cannot find the
    parameter: it raises naming both ways out, where it would otherwise leave the gradients None."""
    torch._dynamo.reset()
    mlp = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    run = torch.compile(mlp, backend="mxfp8", options={"inner": "aot_eager", "fuse_wgrad_accumulation": True})
    x = torch.randn(64, 128)
    with torch.autocast("cpu", torch.bfloat16):
        run(x).float().square().mean().backward()  # compiled with compiled autograd off
    with torch._dynamo.config.patch(compiled_autograd=True):
        with torch.autocast("cpu", torch.bfloat16):
            loss = run(x).float().square().mean()
        with pytest.raises(RuntimeError, match="compiled autograd.*before the model's graph compiles"):
            torch.compile(lambda t: t.backward(), backend="eager")(loss)
    torch._dynamo.reset()


class _Nested(torch.nn.Module):
    """Two parameters, one a view of the other's first rows (its own leaf): each linear's gradient is its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.big = torch.nn.Parameter(torch.randn(256, 128) * 0.05)
        self.small = torch.nn.Parameter(self.big.data[:128])
        self.out = torch.nn.Linear(256, 128)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(torch.nn.functional.linear(x, self.big))) + torch.nn.functional.linear(
            x, self.small
        )


def test_a_parameter_inside_another_ones_storage_gets_its_own_gradient():
    """The fused wgrad finds the parameter from the storage region its weight covers: the smallest leaf holding it,
    not a larger one around it."""
    grads = []
    for fuse in (True, False):
        torch._dynamo.reset()
        model = _Nested()
        run = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager", "fuse_wgrad_accumulation": fuse})
        with torch.autocast("cpu", torch.bfloat16):
            run(torch.randn(64, 128, generator=torch.Generator().manual_seed(2))).float().square().mean().backward()
        grads.append((model.big.grad, model.small.grad))
    torch._dynamo.reset()
    for got, want in zip(*grads):
        assert got is not None and _rel(got, want) <= FUSE_RTOL


torch.library.define("mxfxwg::no_derivative", "(Tensor x) -> Tensor")


@torch.library.impl("mxfxwg::no_derivative", "CompositeExplicitAutograd")
def _no_derivative(x):
    return x * 2


@torch.library.register_fake("mxfxwg::no_derivative")
def _no_derivative_fake(x):
    return torch.empty_like(x)


def test_a_gradient_that_reaches_no_tangent_is_not_written():
    """A converted linear whose output reaches only an op without a derivative: AOTAutograd traces zeros for its
    gradient, so its fused wgrad depends on no tangent and the partitioner runs it in the forward, where it writes
    nothing (the gradient is zero; autograd would leave ``.grad`` None) instead of failing the forward."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    run = torch.compile(
        lambda x: torch.ops.mxfxwg.no_derivative(lin(x)),
        backend="mxfp8",
        options={"inner": "aot_eager", "fuse_wgrad_accumulation": True},
    )
    x = torch.randn(8, 64)
    # MXFP8 operands (E4M3: 3 mantissa bits, each value within 1/16 relative): a few percent in the Frobenius norm;
    # a forward that failed or returned another product is off by far more
    assert _rel(run(x), torch.ops.mxfxwg.no_derivative(lin(x))) < 0.1
    assert lin.weight.grad is None


def test_backward_that_accumulates_nothing_leaves_fused_grads_alone():
    """``torch.autograd.grad`` and ``backward(inputs=[...])`` without the fused weights accumulate nothing into their
    ``.grad``, fused as with autograd (the embedding's gradient still comes back, and only it is accumulated);
    the fused weights keep no ``.grad``."""
    model = _model()
    run = _compiled(model, True)
    embed, qkv = model.embed.weight, model.layers[0].attn.qkv.weight

    def loss():
        with torch.autocast("cpu", torch.bfloat16):
            return run(_ids(0), _ids(0))[1]

    (g,) = torch.autograd.grad(loss(), [embed])
    assert g.abs().sum() > 0 and all(p.grad is None for p in model.parameters())
    loss().backward(inputs=[embed])
    assert _rel(embed.grad, g) <= FUSE_RTOL
    assert all(p.grad is None for p in model.parameters() if p is not embed)
    assert qkv.grad is None


def test_autograd_grad_of_a_fused_weight_raises_naming_it():
    """``torch.autograd.grad`` of a fused weight would get None (its GEMM writes ``.grad`` and returns autograd no
    gradient): the backward raises, naming the weight and the setting to turn off, and touches no ``.grad``."""
    model = _model()
    run = _compiled(model, True)
    qkv = model.layers[0].attn.qkv.weight
    with torch.autocast("cpu", torch.bfloat16):
        loss = run(_ids(0), _ids(0))[1]
    with pytest.raises(
        RuntimeError,
        match=r"torch.autograd.grad asks for the gradient of the weight \(384, 128\) "
        r"of 'layers.0.attn.qkv'.*fuse_wgrad_accumulation=False",
    ):
        torch.autograd.grad(loss, [qkv], allow_unused=True)
    assert all(p.grad is None for p in model.parameters())


class _StackedExperts(torch.nn.Module):
    """Expert weights stored ``[E, K, N]`` (as ``torch._grouped_mm`` takes them): the converted op reads a transpose
    of the parameter, so the fused wgrad writes ``.grad`` through that view."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 128, 256) / 16)

    def forward(self, x, offs):
        return torch._grouped_mm(x.bfloat16(), self.w.to(torch.bfloat16), offs=offs)


@pytest.mark.parametrize("fmt", ("mxfp8", "fp8_block"))
def test_transposed_expert_stack(fmt):
    """A ``[E, K, N]`` expert stack, two microbatches, low-precision and BF16 wgrads: the fused ``.grad`` (written
    through the transpose the graph reads, then added into) equals autograd's within :data:`FUSE_RTOL`, compiled,
    and eager through ``mx_grouped_mm_op`` fed ``w.transpose(-2, -1)``."""
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(1))
    offs = torch.tensor([0, 128, 128, 256], dtype=torch.int32)  # two groups of 128 tokens, two empty
    for wgrad in ("mxfp8", "bf16"):
        grads = {}
        for fuse in (False, True):
            compiled, eager = _StackedExperts(), _StackedExperts()
            opts = {"inner": "aot_eager", "format": fmt, "wgrad": wgrad, "fuse_wgrad_accumulation": fuse}
            run = torch.compile(compiled, backend="mxfp8", options=opts)
            for i in range(2):
                (run(x * (i + 1), offs).float().square().mean()).backward()
                y = mx_grouped_mm_op(
                    x * (i + 1),
                    eager.w.transpose(-2, -1),
                    offs,
                    format=fmt,
                    wgrad=wgrad,
                    fuse_wgrad_accumulation=fuse,
                    out_dtype=torch.bfloat16,
                )
                y.float().square().mean().backward()
            grads[fuse] = compiled.w.grad, eager.w.grad
        assert _notes(mxfx.last_report()) == [("", "fused")]
        for got, want in zip(grads[True], grads[False], strict=True):
            assert got.stride() == want.stride() and _rel(got, want) <= FUSE_RTOL, (wgrad, _rel(got, want))


def _wgrad_cases(fmt_name: str, device: str = "cpu"):
    """``(name, gemm(out_dtype), into(out, accumulate))`` of every wgrad GEMM an op of format ``fmt_name`` runs: the
    format's dense and grouped ones on its token-blocked operands, and the high-precision ones (groups: 96 and 160
    tokens, one empty group)."""
    fmt = mxfx.formats.get(fmt_name)
    g = torch.Generator().manual_seed(5)
    dy, x = torch.randn(256, 128, generator=g).to(device), torch.randn(256, 256, generator=g).to(device)
    offs = torch.tensor([96, 96, 256], dtype=torch.int32, device=device)
    dy_t, x_t = fmt.grad_operands(dy, "rceil", rows=False, tokens=True)[1], fmt.tokens_operand(x, "rceil")
    dy_g, x_g = (fmt.grouped_tokens_operand(t, offs, "rceil") for t in (dy, x))
    hp_dy = dy.bfloat16()
    return [
        ("dense", lambda dt: fmt.wgrad_mm(dy_t, x_t, dt), lambda o, a: fmt.wgrad_mm_into(dy_t, x_t, o, a)),
        (
            "grouped",
            lambda dt: fmt.grouped_wgrad(dy_g, x_g, offs, dt),
            lambda o, a: fmt.grouped_wgrad_into(dy_g, x_g, offs, o, a),
        ),
        (
            "hp dense",
            lambda dt: common_ops.hp_mm_transposed(hp_dy.t(), x.t(), dt),
            lambda o, a: common_ops.hp_mm_into(hp_dy, x, o, a),
        ),
        (
            "hp grouped",
            lambda dt: common_ops.hp_grouped_wgrad(dy, x, offs, dt),
            lambda o, a: common_ops.hp_grouped_wgrad_into(dy, x, offs, o, a),
        ),
    ]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                reason="needs an sm90+ CUDA GPU",
            ),
        ),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_wgrad_into_equals_the_gemm(fmt, device):
    """Each wgrad GEMM's ``_into`` form: written into a NaN-filled gradient (a new one: nothing of it read, an empty
    group zeroed) it is the GEMM's float32 result, added into a gradient it is that gradient plus the result (an
    empty group left as it was), within :data:`FUSE_RTOL` (the same FP32 sums in another order)."""
    for name, gemm, into in _wgrad_cases(fmt, device):
        want = gemm(torch.float32)
        # on CUDA torch's BF16 GEMMs (the high-precision ones and bf16_gemm's) round their result to BF16 before
        # widening (relative error up to 2^-9 each); the fused epilogues do not
        bf16_out = name.startswith("hp") or fmt == "bf16_gemm"
        rtol = 2.0**-8 if device == "cuda" and bf16_out else FUSE_RTOL
        out = torch.full_like(want, float("nan"))
        into(out, False)
        assert _rel(out, want) <= rtol, (name, _rel(out, want))
        base = torch.randn(want.shape, generator=torch.Generator().manual_seed(6)).to(device)
        out = base.clone()
        into(out, True)
        assert _rel(out, base + want) <= rtol, (name, _rel(out, base + want))
        if name.endswith("grouped"):
            assert torch.equal(out[1], base[1]), name  # the empty group


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_weight_computed_from_parameters_keeps_autograds_accumulation(fmt):
    """A linear whose weight the graph computes (``weight_norm``'s ``g * v / |v|``) has no ``.grad`` of its own to
    write: its op returns the gradient to autograd, the map says why, and the parameters' gradients over two
    microbatches equal the unfused run's within :data:`FUSE_RTOL` (the backward raised before)."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(8))
    grads = {}
    for fuse in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(128, 128, bias=False), torch.nn.GELU(), torch.nn.Linear(128, 128, bias=False)
        )
        torch.nn.utils.parametrizations.weight_norm(model[0])
        run = torch.compile(
            model, backend="mxfp8", options={"inner": "aot_eager", "format": fmt, "fuse_wgrad_accumulation": fuse}
        )
        for i in range(2):
            with torch.autocast("cpu", torch.bfloat16):
                run(x * (i + 1)).float().square().mean().backward()
        grads[fuse] = {n: p.grad.clone() for n, p in model.named_parameters()}
        if fuse:
            reasons = [r.reason for r in mxfx.last_report().records if r.kind == "linear" and r.rewritten]
            assert any("computed in the graph" in r for r in reasons), reasons
    for name, want in grads[False].items():
        assert _rel(grads[True][name], want) <= FUSE_RTOL, name


class _Checkpointed(torch.nn.Module):
    """A linear before an activation-checkpointed block of two: the block's ops sit in the checkpoint's body."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(128, 128)
        self.block = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 128))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, self.inp(x), use_reentrant=False)


def _checkpointed_grads(model, fuse: bool) -> dict[str, torch.Tensor]:
    run = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager", "fuse_wgrad_accumulation": fuse})
    for i in range(2):
        with torch.autocast("cpu", torch.bfloat16):
            run(torch.randn(64, 128, generator=torch.Generator().manual_seed(i))).float().square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_a_hooked_weight_inside_activation_checkpointing_keeps_autograds_accumulation():
    """A gradient hook registered before compiling, on a weight read inside a checkpointed region, gives that
    weight back to autograd (the backward raised before, telling to register the hook before compiling, as was
    done): the hook runs each microbatch and every gradient equals the unfused run's within :data:`FUSE_RTOL`."""
    calls = []
    model = _Checkpointed()
    model.block[0].weight.register_hook(lambda g: calls.append(1))
    grads = _checkpointed_grads(model, True)
    assert len(calls) == 2
    want = _checkpointed_grads(_Checkpointed(), False)
    for name, g in want.items():
        assert _rel(grads[name], g) <= FUSE_RTOL, name


def test_ops_inside_activation_checkpointing_say_how_their_wgrad_accumulates():
    """The precision map's rows of the checkpointed region's ops say what their wgrad does as the outer graph's
    rows do: the hooked weight's op that autograd accumulates it, and why; the other's that its GEMM writes .grad."""
    model = _Checkpointed()
    model.block[0].weight.register_hook(lambda g: g)
    _checkpointed_grads(model, True)
    notes = {r.module: r.reason for r in mxfx.last_report().records if r.kind == "linear"}
    assert FUSED_NOTE in notes["inp"] and FUSED_NOTE in notes["block.2"], notes
    assert f"{UNFUSED_NOTE}: " in notes["block.0"] and "hook" in notes["block.0"], notes


def test_each_fused_backward_error_says_its_cause_and_fix():
    """A hook registered after the compile on a fused weight (inside the checkpointed region): the error names the
    weight's module and says the hook came after the compile; a ``.grad`` of another dtype: the error says to set
    it to None; a weight computed from a parameter in an eager call: the error says it has no ``.grad``."""
    model = _Checkpointed()
    run = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager", "fuse_wgrad_accumulation": True})
    x = torch.randn(64, 128)

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            run(x).float().sum().backward()

    step()
    model.inp.weight.grad_dtype = None  # torch allows a .grad of another dtype only so
    model.inp.weight.grad = torch.zeros(128, 128, dtype=torch.bfloat16)
    with pytest.raises(
        RuntimeError,
        match=r"\.grad of the weight \(128, 128\) of 'inp' is a torch.bfloat16.*"
        r"Set \.grad to None",
    ):
        step()
    model.zero_grad()
    model.block[2].weight.register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match=r"weight \(128, 128\) of 'block.2'.*registered after the graph compiled"):
        step()
    w = torch.nn.Parameter(torch.randn(128, 128))
    out = mx_linear(torch.randn(64, 128), w * 2, fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match=r"neither a leaf parameter nor a view of one: it is computed"):
        out.sum().backward()


@pytest.mark.parametrize(
    "change, match",
    [
        ({"out": torch.zeros(3, 8, 8)}, r"out must be \[G, N, K\] = \[2, 8, 8\]"),  # one group too many: not silent
        ({"x": torch.randn(19, 8)}, "same tokens S"),
        ({"offs": torch.tensor([5, 20])}, "int32 offs"),
        ({"offs": torch.tensor([12, 5], dtype=torch.int32)}, "non-decreasing"),
        ({"offs": torch.tensor([5, 21], dtype=torch.int32)}, "non-decreasing .* at most the 20 rows of dy"),
        ({"dy": torch.randn(20, 8).to(torch.int32)}, "floating dy, x and out"),
    ],
)
def test_grouped_wgrad_into_refuses_operands_that_do_not_pair_up(change, match):
    """The grouped BF16 wgrad into a gradient checks its operands on every device (the CPU reference as the GPU
    kernels), naming the op and the shapes, instead of leaving a block unwritten or failing deep in a GEMM."""
    args = {
        "dy": torch.randn(20, 8),
        "x": torch.randn(20, 8),
        "offs": torch.tensor([5, 20], dtype=torch.int32),
        "out": torch.zeros(2, 8, 8),
    }
    args.update(change)
    with pytest.raises(ValueError, match=f"mxfx.grouped_wgrad_into: .*{match}"):
        common_ops.hp_grouped_wgrad_into(args["dy"], args["x"], args["offs"], args["out"], False)
