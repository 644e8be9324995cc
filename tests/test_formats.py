"""The Format abstraction: behaviour shared by every format, each rule x format combination judged in one place,
and no code outside mxfx/formats deciding by a format's identity."""

import re
from pathlib import Path

import pytest
import torch

import mxfx
from mxfx import formats
from mxfx.formats import ScaleRule
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear
from mxfx.policy import Policy

FORMATS = [formats.get(n) for n in formats.NAMES]
PACKAGE = Path(__file__).resolve().parents[1] / "mxfx"


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd saves (tensors other than the parameters themselves)."""

    def __init__(self, exclude):
        self.nbytes, ptrs = 0, {t.data_ptr() for t in exclude}

        def pack(t):
            if t.data_ptr() not in ptrs:
                self.nbytes += t.numel() * t.element_size()
            return t

        super().__init__(pack, lambda t: t)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("save", ["mxfp8", "bf16"])
def test_frozen_weight_saves_and_computes_no_wgrad(fmt, save):
    """A frozen weight (requires_grad=False) with a low-precision wgrad: nothing is saved or quantized for a weight
    gradient, in every format (MXFP8 saved 67,584 bytes of token-blocked X for it before the one autograd op), and
    the input gradient equals that of the same op with a trainable weight."""
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) / 16
    kw = dict(format=fmt.name, wgrad="mxfp8", save=save)
    xf = x.clone().requires_grad_()
    with (frozen := _SavedBytes([xf, w])):
        y = mx_linear(xf, w, **kw)
    assert frozen.nbytes == 0  # the weight is a parameter saved by reference; X needs saving only for a wgrad
    y.square().sum().backward()
    assert w.grad is None

    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    with (trained := _SavedBytes([xt, wt])):
        yt = mx_linear(xt, wt, **kw)
    assert trained.nbytes > 0 if save == "mxfp8" else trained.nbytes == 0  # save="bf16" keeps X by reference
    yt.square().sum().backward()
    assert torch.equal(y, yt) and torch.equal(xf.grad, xt.grad) and wt.grad is not None


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("wgrad", ["mxfp8", "bf16"])
def test_grouped_frozen_experts_and_inputs_without_grad(fmt, wgrad, monkeypatch):
    """Grouped GEMM: a frozen expert stack keeps nothing for a wgrad; an input without grad runs no dgrad GEMM; the
    gradients that are asked for match those of the op computing everything (same operands, same kernels)."""
    calls = []
    real = type(fmt).grouped_mm
    monkeypatch.setattr(type(fmt), "grouped_mm", lambda self, *a: calls.append(1) or real(self, *a))
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(320, 256, generator=g), torch.randn(3, 128, 256, generator=g) / 16
    offs = torch.tensor([100, 100, 320], dtype=torch.int32)  # an empty group, unaligned ends
    kw = dict(format=fmt.name, wgrad=wgrad, save="mxfp8")
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    mx_grouped_mm_op(xa, wa, offs, **kw).square().sum().backward()

    xf = x.clone().requires_grad_()
    with (frozen := _SavedBytes([xf, w, offs])):
        y = mx_grouped_mm_op(xf, w, offs, **kw)
    assert frozen.nbytes == 0
    y.square().sum().backward()
    assert torch.equal(xf.grad, xa.grad)

    wn = w.clone().requires_grad_()
    calls.clear()
    mx_grouped_mm_op(x, wn, offs, **kw).square().sum().backward()
    assert len(calls) == 1  # the forward GEMM; no dgrad for an input without grad
    assert torch.equal(wn.grad, wa.grad)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_format_facts_agree_with_its_operands(fmt):
    """A format's stated bytes per value and feature multiple are what its operands hold and what its ops accept."""
    k = n = 2 * max(fmt.feature_multiple, 32)
    x = torch.randn(4 * fmt.block, k)
    a = fmt.input_operand(x, None, "rceil", "mm")
    saved = fmt.saved_rows(a)
    assert saved[0].dtype == (torch.float8_e4m3fn if fmt.low_precision else torch.bfloat16)
    assert saved[-1].dtype == fmt.scale_dtype  # the scales (the BF16 values themselves for a format without scales)
    held = sum(t.numel() * t.element_size() for t in saved)
    assert held == pytest.approx(x.numel() * fmt.bytes_per_value) == fmt.saved_bytes(x.numel())
    assert fmt.unfit_reason(k, n) == "" and fmt.unfit_reason(k + fmt.feature_multiple // 2, n)
    with pytest.raises(
        ValueError,
        match=rf"mxfx.mx_linear: format='{fmt.name}' needs in/out features that are "
        rf"multiples of {fmt.feature_multiple}",
    ):
        mx_linear(torch.randn(8, k), torch.randn(n + fmt.feature_multiple // 2, k), format=fmt.name)


# A gate and an up (fp32 bits) whose FP32 SwiGLU product is an E4M3 rounding tie under mxfx's SiLU (g / (1 + exp(-g)),
# the fused kernels' and the CPU reference's): -0.2265625 exactly, which rounds to even; the same product formed
# as g * sigmoid(g) * up is one ulp larger in magnitude and rounds the other way.
_TIE_GATE, _TIE_UP = -1071559020, 1067094497


def _swiglu_tie(rows: int, k: int, row: int, col: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero fp32 gate and up ``[rows, k]`` holding the tie pair at ``(row, col)``, and ordinary values elsewhere in
    other columns (so that row and token blocks hold more than one value)."""
    g = torch.randn(rows, k, generator=torch.Generator().manual_seed(5))
    u = torch.randn(rows, k, generator=torch.Generator().manual_seed(6))
    g[:, col], u[:, col] = 0.0, 0.0
    g[row, col] = torch.tensor(_TIE_GATE, dtype=torch.int32).view(torch.float32)
    u[row, col] = torch.tensor(_TIE_UP, dtype=torch.int32).view(torch.float32)
    return g, u


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "grouped"])
def test_swiglu_forward_and_wgrad_operands_from_one_product(fmt, grouped):
    """A SwiGLU input's forward operand (quantized by the fused SwiGLU kernel) and its token-blocked wgrad operand
    are quantized from one FP32 product, bit for bit: each equals the operand the format makes of that product given
    as a plain input. Before, the wgrad operand was quantized from g * sigmoid(g) * up, another FP32 product, which
    at this input rounds to another E4M3 byte."""
    k = max(fmt.feature_multiple, 32)
    g, u = _swiglu_tie(64, k, row=5, col=3)
    offs = (
        torch.tensor([24, 24, 64], dtype=torch.int32) if grouped else None
    )  # an empty group; group ends not 32-aligned
    a, tokens, _ = fmt.forward_operands(g, u, "rceil", "bf16", True, offs=offs)
    h = torch.nn.functional.silu(g) * u  # mxfx's SiLU is F.silu outside its flush band (gates <= -87.3), on the CPU
    assert h[5, 3].item() == -0.2265625
    a_ref, tokens_ref, _ = fmt.forward_operands(h, None, "rceil", "bf16", True, offs=offs)
    for got, want in zip(a[:2], a_ref[:2]):  # qdata and scales of the forward operand
        assert torch.equal(_bytes(got), _bytes(want))
    for got, want in zip(tokens[:2], tokens_ref[:2]):  # and of the wgrad operand
        assert torch.equal(_bytes(got), _bytes(want))


def test_amax_with_fp8_block_judges_the_all_to_all_transport():
    """fp8_block with the amax rule: the expert-parallel all-to-all travels in MXFP8, which has no amax rule. The
    decision for the all-to-all names that at compile time, with the rules that combined and a fix; before, it
    validated and the first call failed inside mxfx.mx_all_to_all."""
    policy = Policy(format="fp8_block", scale_rule="amax")
    assert policy.decide("grouped_mm", "layers.0.experts").scale_rule is ScaleRule.AMAX
    with pytest.raises(
        ValueError,
        match=r"scale_rule='amax' is not a rule of format='mxfp8'.*all_to_all op of module "
        r"'layers.0.moe'.*transport format.*policy-wide format='fp8_block'",
    ):
        policy.decide("all_to_all", "layers.0.moe")
    fixed = Policy(format="fp8_block", scale_rule="amax", rules=[{"op": "all_to_all", "scale_rule": "rceil"}])
    d = fixed.decide("all_to_all", "layers.0.moe")
    assert (d.format.name, d.scale_rule) == ("mxfp8", ScaleRule.RCEIL)
    assert (
        Policy(format="fp8_block", scale_rule="amax", transport={"dispatch_fwd": "bf16"})
        .decide("grouped_mm", "x")
        .format.name
        == "fp8_block"
    )


def test_rule_and_format_from_different_rules_fail_per_module():
    """Fields are settled per module by the first rule that sets each: a floor rule and an fp8_block rule only meet
    for modules both match. The policy builds; the decision for such a module fails naming both rules."""
    policy = Policy(rules=[{"module": "a*", "scale_rule": "floor"}, {"module": "*b", "format": "fp8_block"}])
    assert policy.decide("linear", "ax").scale_rule is ScaleRule.FLOOR
    assert policy.decide("linear", "xb").format.name == "fp8_block"
    with pytest.raises(
        ValueError,
        match=r"scale_rule='floor' is not a rule of format='fp8_block'.*module 'ab'.*"
        r"rules\[1\] \(module='\*b', format='fp8_block'\).*rules\[0\] \(module='a\*', "
        r"scale_rule='floor'\)",
    ):
        policy.decide("linear", "ab")
    with pytest.raises(
        ValueError,
        match=r"rules\[0\] \(module='a\*', scale_rule='amax'\): scale_rule='amax' is not a "
        r"rule of format='mxfp8', which the rule inherits from the policy-wide format",
    ):
        Policy(rules=[{"module": "a*", "scale_rule": "amax"}])  # judged where one rule fixes both


def test_a_rule_inheriting_a_scale_rule_its_format_lacks_says_so():
    """A rule that sets format='mxfp8' under the policy-wide scale_rule='amax' (fp8_block's) inherits 'amax': the error
    names the rule by its index, says the scale rule is inherited, and gives the rule with scale_rule='rceil'."""
    with pytest.raises(ValueError) as e:
        Policy(
            format="fp8_block",
            scale_rule="amax",
            rules=[{"module": "down", "precision": "bf16"}, {"module": "up", "format": "mxfp8"}],
        )
    message = str(e.value)
    assert message.startswith(
        "mxfx policy: rules[1] (module='up', format='mxfp8'): its format='mxfp8' does not take "
        "scale_rule='amax', which the rule inherits from the policy-wide scale_rule"
    ), message
    assert message.endswith("e.g. {'module': 'up', 'format': 'mxfp8', 'scale_rule': 'rceil'}"), message
    fixed = Policy(
        format="fp8_block", scale_rule="amax", rules=[{"module": "up", "format": "mxfp8", "scale_rule": "rceil"}]
    )
    assert (fixed.decide("linear", "up").format.name, fixed.decide("linear", "up").scale_rule) == (
        "mxfp8",
        ScaleRule.RCEIL,
    )


def test_bf16_gemm_is_native_wherever_bf16_tensor_cores_are(monkeypatch):
    """BF16 GEMMs run on tensor cores on Ampere/Ada, Hopper and Blackwell: a graph of bf16_gemm ops on a (faked) GPU of
    each gets no "emulated" note, while MXFP8 on sm90 still does; "auto" picks a low-precision format, never
    bf16_gemm."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from mxfx import backend, report
    from mxfx import device as devices

    with FakeTensorMode():
        x = torch.empty(4, 64, device="cuda")

    def notes(fmt: str, cap) -> list[str]:
        monkeypatch.setattr(devices, "capability", lambda device: cap)
        monkeypatch.setattr(backend, "_warned_formats", set())
        pm = report.PrecisionMap()
        pm.add(report.OpRecord("mm", "linear", "up", "x[4, 64] w[64, 64]", fmt, fmt, fmt, fmt, "rceil"))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            backend._warn_format_notes(pm, [x], Policy())
        return [str(w.message) for w in record]

    for cap in ((8, 0), (8, 9), (9, 0), (10, 0), (12, 0)):
        assert not notes("bf16_gemm", cap), cap
    (note,) = notes("mxfp8", (9, 0))
    assert "mxfp8 has no tensor cores on sm90" in note
    cuda = torch.device("cuda")
    picked = {}
    for cap in ((8, 0), (9, 0), (10, 0)):
        monkeypatch.setattr(devices, "capability", lambda device, cap=cap: cap)
        picked[cap] = formats.get("auto", cuda).name
    assert picked == {(8, 0): "mxfp8", (9, 0): "fp8_block", (10, 0): "mxfp8"}


def test_unknown_format_and_auto():
    with pytest.raises(
        ValueError, match=r"format='nvfp4' is not valid; choose one of 'mxfp8', 'fp8_block', 'bf16_gemm', 'auto'"
    ):
        formats.get("nvfp4")
    assert formats.get("auto", torch.device("cpu")) is formats.DEFAULT
    assert formats.get(formats.get("fp8_block")) is formats.get("fp8_block")


# Patterns of code that decides by a format's identity: comparing a format's name or a format-valued field with a
# literal, a format name as a dict key, or a type check against a format class. Display strings are fine.
_IDENTITY = [
    re.compile(r"""(format|fmt|\.name)\w*\s*(==|!=)\s*["'](mxfp8|fp8_block)["']"""),
    re.compile(r"""["'](mxfp8|fp8_block)["']\s*(==|!=)\s*\w*(format|fmt)"""),
    re.compile(r"""\{\s*["'](mxfp8|fp8_block)["']\s*:"""),
    re.compile(r"""isinstance\([^)]*(MXFP8|FP8Block)\b"""),
    re.compile(r"""kwargs\.get\(\s*["']format["']"""),
]


def test_no_code_outside_the_formats_decides_by_format_identity():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "formats":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in _IDENTITY):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_bf16_gemm_routed_experts_from_fp32_weights_cast_once_per_step():
    """BF16 GEMMs as a product path: a policy rule with format='bf16_gemm' on the routed experts of an FP32 model
    under autocast runs them as BF16 grouped GEMMs whose weights are cast once per optimizer step (the cache's
    counter: one cast per expert weight per step, whatever the microbatches), and the precision map says so;
    precision='bf16' keeps the model's own ops and says 'bf16'. Losses of the two stay within 2% (BF16 GEMMs both,
    from the same weights; they differ in where the casts round)."""
    from mxfx.runtime import cache
    from tests.models import MoETransformer, tiny_config

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = {}
    for name, rule in (
        ("cast", {"op": "grouped_mm", "format": "bf16_gemm"}),
        ("as_written", {"op": "grouped_mm", "precision": "bf16"}),
    ):
        torch._dynamo.reset()
        cache.clear()
        torch.manual_seed(0)
        model = MoETransformer(tiny_config())
        cm = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager", "rules": [rule]})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        casts = []
        for step in range(3):
            cache.reset_stats()
            for _ in range(3):  # microbatches
                with torch.autocast("cpu", torch.bfloat16):
                    loss = cm(ids, ids)[1]
                (loss / 3).backward()
            opt.step()  # its hook casts the weights again for the next step
            opt.zero_grad()
            casts.append(cache.stats().get("quantize_bf16", 0))
        losses[name] = loss.item()
        grouped = [r for r in mxfx.last_report().records if r.kind == "grouped_mm"]
        assert len(grouped) == 2, grouped
        if name == "cast":
            assert all(r.forward == r.dgrad == "bf16_gemm" and r.rewritten for r in grouped), grouped
            assert casts[1:] == [2, 2], casts  # gate_up and down, once per step (the first step builds them twice)
        else:
            assert all(r.forward == "bf16" and not r.rewritten for r in grouped), grouped
            assert casts == [0, 0, 0]
    assert abs(losses["cast"] - losses["as_written"]) < 0.02 * losses["as_written"], losses


def test_bf16_gemm_takes_bf16_weights_as_they_are():
    """A BF16 weight is already bf16_gemm's operand: the ops read it without a cached copy (a copy would be the
    weight itself, which a custom op may not return) and give torch's own BF16 GEMMs' results."""
    from mxfx.runtime import cache

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g).bfloat16().requires_grad_()
    w = torch.randn(2, 256, 128, generator=g).bfloat16().requires_grad_()
    lw = torch.randn(256, 128, generator=g).bfloat16().requires_grad_()
    offs = torch.tensor([30, 64], dtype=torch.int32)
    cache.clear()
    y = mx_grouped_mm_op(x, w, offs, format="bf16_gemm") + mx_linear(x, lw, None, format="bf16_gemm").sum()
    y.float().square().sum().backward()
    assert not cache.entry_forms(w) and not cache.entry_forms(lw)
    grads = [t.grad for t in (x, w, lw)]
    for t in (x, w, lw):
        t.grad = None
    ref = torch._grouped_mm(x, w.transpose(-2, -1), offs) + (x @ lw.t()).sum()
    ref.float().square().sum().backward()
    # the same BF16 GEMMs; the wgrads' FP32 results and sums may be ordered otherwise: one BF16 rounding apart
    for got, want in zip(grads, (x.grad, w.grad, lw.grad)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=1e-3)


def test_precision_map_of_a_frozen_weight_has_no_wgrad():
    """A frozen linear weight is rewritten (forward and dgrad in the format) and the map says it has no wgrad and
    saves nothing for one, as the op does."""
    lin = torch.nn.Linear(256, 256, bias=False).requires_grad_(False)
    x = torch.randn(64, 256, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(lin, backend="mxfp8", options={"inner": "aot_eager"})(x).sum().backward()
    (record,) = [r for r in mxfx.last_report().records if r.kind == "linear"]
    assert (record.forward, record.dgrad, record.wgrad, record.saved) == ("mxfp8", "mxfp8", "-", "-"), record
    assert "frozen weight" in record.reason and x.grad is not None
