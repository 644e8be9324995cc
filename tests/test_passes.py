"""One section per graph pass of ``mxfx/passes/``: the pass matched (precision map or op count in the
graphs the inner compiler receives), and the rewritten graph gives the result of the same compile with that
pass turned off, within a stated bound.

All sections run one training step of the main job's model (attention, shared expert, 4 routed experts top-2,
bf16 autocast on CPU) through ``inner=GraphCapture`` (aot_autograd, no code generation) on the same weights
and tokens. Bounds:

* shared_quantize: bit for bit (the same quantize of the same tensor, made once);
* fusion passes (swiglu, combine, dispatch_mx, saved): the same MX GEMMs with an operand formed in fp32
  instead of after a bf16 rounding, or saved as MX instead of bf16; a product rounded to bf16 first (2^-9
  relative) can land on the other side of an E4M3 rounding boundary (2^-4 steps), so a few values move by one
  E4M3 step: loss within 1e-3 relative, gradients within 5e-2 in relative norm;
* rewriting passes (linear, grouped_mm) against BF16: both operands quantized to E4M3 (each value within 2^-4
  relative), so loss within 2e-2 relative and gradients within 0.15 in relative norm, and not equal (the pass
  changed something).

all_to_all needs a process group: its section is ``tests/test_distributed.py``
(``test_ep_all_to_all_mxfp8_matches_single_process``: matched count, and MXFP8 against BF16 transport).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import mxfx
from tests.helpers import GraphCapture, count_calls
from tests.models import MoETransformer, tiny_config

OPS = torch.ops.mxfx


def _step(passes: dict | None = None, n_experts: int = 4, **policy):
    """One step of the small model: ``(loss, grads by name, report records, captured graphs)``."""
    torch.manual_seed(0)
    model = MoETransformer(tiny_config(n_experts=n_experts))
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    cap = GraphCapture()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="mxfp8", options={"inner": cap, "passes": passes or {}, **policy})
    with torch.autocast("cpu", torch.bfloat16):
        _, loss = compiled(idx, idx)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, mxfx.last_report().records, cap


@pytest.fixture(scope="module")
def all_on():
    return _step()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _close(on, off, loss_bound, grad_bound):
    (loss_on, g_on, _, _), (loss_off, g_off, _, _) = on, off
    assert abs(loss_on - loss_off) / abs(loss_off) < loss_bound, (loss_on, loss_off)
    assert g_on.keys() == g_off.keys()
    worst = max(_rel(g_on[n], g_off[n]) for n in g_on)
    assert worst < grad_bound, worst
    return worst


def _kinds(records, kind):
    return [r for r in records if r.kind == kind and r.rewritten]


# --- the pipeline ------------------------------------------------------------------------------------------


def test_every_pass_module_runs_once_in_the_order_of_the_policy_switches():
    """The one list of passes, :data:`mxfx.policy.PASSES`: the pipeline runs its names in its order, then
    ``unconverted``; every module of ``mxfx/passes/`` with a ``run`` is a pass of it (a pass module left out of
    the list would never run), each switched by its own name."""
    from mxfx import passes
    from mxfx.policy import PASSES, Policy

    assert [name for name, _ in passes.PIPELINE] == [*PASSES, "unconverted"]
    runs = {name: run for name, run in passes.PIPELINE}
    for info in pkgutil.iter_modules(passes.__path__):
        module = importlib.import_module(f"mxfx.passes.{info.name}")
        if hasattr(module, "run"):
            assert runs.get(info.name) is module.run, info.name
    with pytest.raises(ValueError, match="'batched_mm' is not valid"):
        Policy(passes={"batched_mm": False})  # no switch of its own: it runs under grouped_mm's


# --- linear ------------------------------------------------------------------------------------------------


def test_linear_pass(all_on):
    records, cap = all_on[2], all_on[3]
    assert {r.module for r in _kinds(records, "linear")} == {
        "layers.0.attn.qkv",
        "layers.0.attn.o_proj",
        "layers.0.moe.shared_gate",
        "layers.0.moe.shared_up",
        "layers.0.moe.shared_down",
    }
    assert count_calls(cap.forward, OPS.mm.default) == 5
    off = _step({"linear": False})
    assert not _kinds(off[2], "linear") and count_calls(off[3].forward, OPS.mm.default) == 0
    left = [r for r in off[2] if r.kind == "not_rewritten"]  # reported, with the switch as the reason
    assert left and all("the 'linear' pass is switched off" in r.reason for r in left), [r.reason for r in left]
    worst = _close(all_on, off, 2e-2, 0.15)
    assert worst > 0  # MX GEMMs moved the gradients


# --- grouped_mm --------------------------------------------------------------------------------------------


def test_grouped_mm_pass(all_on):
    assert len(_kinds(all_on[2], "grouped_mm")) == 2  # gate_up and down of the routed experts
    assert count_calls(all_on[3].forward, OPS.grouped_mm.default) == 2
    off = _step({"grouped_mm": False})
    assert not _kinds(off[2], "grouped_mm") and count_calls(off[3].forward, OPS.grouped_mm.default) == 0
    left = [r for r in off[2] if r.kind == "not_rewritten"]
    assert len(left) == 2 and all("the 'grouped_mm' pass is switched off" in r.reason for r in left)
    assert _close(all_on, off, 2e-2, 0.15) > 0


# --- swiglu ------------------------------------------------------------------------------------------------


def test_swiglu_pass(all_on):
    assert len(_kinds(all_on[2], "swiglu")) == 2  # routed and shared SwiGLU, fused into their GEMM's quantize
    assert count_calls(all_on[3].forward, OPS.swiglu_quantize_dequantize_save.default) == 2
    off = _step({"swiglu": False})
    assert (
        not _kinds(off[2], "swiglu") and count_calls(off[3].forward, OPS.swiglu_quantize_dequantize_save.default) == 0
    )
    _close(all_on, off, 1e-3, 5e-2)


def test_swiglu_row_shows_the_consumers_scale_rule():
    """The product is quantized by its consumer GEMM, so the row reads the consumer's scale rule, not the policy's."""
    records = _step(rules=[{"op": "grouped_mm", "scale_rule": "floor"}])[2]
    rules = {r.node: r.scale_rule for r in records if r.kind in ("grouped_mm", "linear")}
    rows = _kinds(records, "swiglu")
    assert sorted(r.scale_rule for r in rows) == ["floor", "rceil"]  # routed (grouped consumer), shared (linear)
    assert all(r.scale_rule == rules[r.node] for r in rows)


# --- combine -----------------------------------------------------------------------------------------------


def test_combine_pass(all_on):
    assert len(_kinds(all_on[2], "combine")) == 1
    assert count_calls(all_on[3].backward, OPS.route_weight_quantize_dequantize.default) == 1
    off = _step({"combine": False})
    assert not _kinds(off[2], "combine")
    assert count_calls(off[3].backward, OPS.route_weight_quantize_dequantize.default) == 0
    _close(all_on, off, 1e-3, 5e-2)


# --- dispatch_mx -------------------------------------------------------------------------------------------


def _hoisted(records) -> list[str]:
    return [r.reason for r in records if r.kind == "grouped_mm" and "before the dispatch's row gather" in r.reason]


def test_dispatch_mx_pass(all_on):
    """The routed gate_up GEMM's operand is made from the 64 tokens, not from their 128 gathered copies."""
    assert len(_hoisted(all_on[2])) == 1 and "(64 rows, not 128)" in _hoisted(all_on[2])[0]
    made = [
        n.args[0].meta["val"].shape[0]
        for g in all_on[3].forward
        for n in g.graph.nodes
        if n.target is OPS.quantize_dequantize.default
    ]
    assert 64 in made and 128 not in made, made
    off = _step({"dispatch_mx": False})
    assert not _hoisted(off[2])
    assert 128 in [
        n.args[0].meta["val"].shape[0]
        for g in off[3].forward
        for n in g.graph.nodes
        if n.target is OPS.quantize_dequantize.default
    ]
    _close(all_on, off, 1e-3, 5e-2)


# --- shared_quantize ---------------------------------------------------------------------------------------


def test_shared_quantize_pass(all_on):
    """The shared expert's gate and up projections read one input: one quantize of it, its rows alone (the router's
    FP32 GEMM keeps that input alive, so both keep it as it is too); the fused qkv linear reads its input alone. The
    loss and every gradient are those without the pass, bit for bit: the same quantize of the same tensor. Attention
    blocks with separate q, k and v projections: ``tests/test_shared_quantize.py``."""
    note = "input quantized once for shared_gate, shared_up"
    assert [r.module for r in _kinds(all_on[2], "linear") if note in r.reason] == [
        "layers.0.moe.shared_gate",
        "layers.0.moe.shared_up",
    ]
    off = _step({"shared_quantize": False})
    assert not [r for r in off[2] if "quantized once" in r.reason]
    assert torch.equal(all_on[0], off[0]) and all_on[1].keys() == off[1].keys()
    assert all(torch.equal(all_on[1][n], off[1][n]) for n in off[1])


# --- saved -------------------------------------------------------------------------------------------------


def test_saved_pass(all_on):
    saved = {r.module: r.saved for r in _kinds(all_on[2], "linear")}
    assert saved["layers.0.attn.qkv"] == "mxfp8" and saved["layers.0.attn.o_proj"] == "bf16"  # attention keeps it
    off = _step({"saved": False})
    assert {r.module: r.saved for r in _kinds(off[2], "linear")}["layers.0.attn.o_proj"] == "mxfp8"
    _close(all_on, off, 1e-3, 5e-2)


# --- weight_refresh ----------------------------------------------------------------------------------------


def test_weight_refresh_pass():
    """A compiled optimizer step gets the cache refresh in its graph; the next forward then reads caches of the
    updated weights, exactly as when the refresh runs from the step hook (pass off): bit-equal losses."""

    def run(on: bool):
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 64, bias=False)
        opt = torch.optim.SGD(lin.parameters(), lr=0.5)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
        torch._dynamo.reset()
        fwd = torch.compile(lin, backend="mxfp8", options={"inner": "aot_eager"})
        step = torch.compile(
            opt.step, backend="mxfp8", options={"inner": "aot_eager", "passes": {"weight_refresh": on}}
        )
        losses = []
        for _ in range(2):
            loss = fwd(x).square().mean()
            loss.backward()
            step()
            opt.zero_grad()
            losses.append(loss.detach())
        records = [r for rep in mxfx.all_reports() for r in rep.records if r.kind == "weight_refresh" and r.rewritten]
        return torch.stack(losses), records

    before = len(mxfx.all_reports())
    on, on_records = run(True)
    assert on_records, "the weight_refresh pass did not match the compiled optimizer step"
    off, _ = run(False)
    assert len(mxfx.all_reports()) > before
    assert torch.equal(on, off) and on[0] != on[1]  # the second step saw the updated weight either way


def test_wildcard_rule_switching_a_router_warns_once():
    """The example's router is computed in its MoE block's forward, so its module is ``layers.0.moe``: a ``layers.*``
    rule names it and switches it to MXFP8 (documented), with a warning naming the rule; a rule for op="router"
    first keeps it BF16 with no warning."""
    import warnings

    from mxfx.passes import linear

    linear._warned_routers.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        records = _step(n_experts=32, rules=[{"module": "layers.*", "precision": "mxfp8"}])[2]  # router 64->32
    routers = [r for r in records if r.kind == "router"]
    assert routers and all(r.rewritten for r in routers)
    said = [str(w.message) for w in record if "switches the router" in str(w.message)]
    assert len(said) == 1 and "layers.0.moe" in said[0] and "'op': 'router'" in said[0], said
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        records = _step(
            n_experts=32, rules=[{"op": "router", "precision": "bf16"}, {"module": "layers.*", "precision": "mxfp8"}]
        )[2]
    assert all(not r.rewritten for r in records if r.kind == "router")
    assert not [w for w in record if "switches the router" in str(w.message)]
