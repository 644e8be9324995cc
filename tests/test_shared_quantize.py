"""The shared_quantize pass (``mxfx/passes/shared_quantize.py``): q, k and v projections of one input quantize it
once, and save one copy of it.

The graphs are captured with AOTAutograd's common-subexpression pass off (``torch._functorch.config.cse``): on the
CPU the quantizes are opaque custom ops that it would merge, hiding the three; on a GPU they are traced kernels
it never merges, which is the graph this pass is for. Against the graph without the pass, outputs and every
gradient are bit for bit equal: each linear would make the same operands of the same tensor with the same rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxfx
from mxfx.ops.linear import mx_linear, mx_linear_input
from tests.helpers import GraphCapture

FORMATS = ("mxfp8", "fp8_block")
OFF = {"shared_quantize": False}
D, HEADS, TOKENS = 128, 4, 64  # 128: fp8_block's feature multiple


class Attention(nn.Module):
    """A pre-norm attention block with separate q, k and v projections of the normalized input."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, t, HEADS, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o_proj(o.transpose(1, 2).reshape(b, t, D))


class Capture(GraphCapture):
    """:class:`GraphCapture` that also keeps the rewritten graphs the inner compiler receives."""

    def __init__(self):
        super().__init__()
        self.rewritten: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.rewritten.append(gm)
        return super().__call__(gm, example_inputs)


def _shared(cap: Capture) -> list[torch.fx.Node]:
    """The shared quantizes (``mx_linear_input`` calls) of the rewritten graphs."""
    return [n for g in cap.rewritten for n in g.graph.find_nodes(op="call_function", target=mx_linear_input)]


def _quantize_ops(graphs) -> list[tuple[str, int]]:
    """``(name, tensors made)`` of each mxfx quantize op in ``graphs`` (an op making a low-precision operand of an
    activation or gradient; a dual quantize makes two operands' tensors)."""
    return [
        (n.target.name(), len(n.meta["val"]))
        for g in graphs
        for n in g.graph.nodes
        if n.op == "call_function"
        and getattr(n.target, "namespace", "") == "mxfx"
        and ("quantize" in n.target.name() or "forward_operands" in n.target.name())
    ]


def _quantizes(graphs) -> int:
    return len(_quantize_ops(graphs))


def _fp8_saved(cap) -> int:
    """Bytes of the float8 tensors the backward graphs receive from their forward (the saved low-precision copies)."""
    return sum(
        v.numel()
        for g in cap.backward
        for n in g.graph.nodes
        if n.op == "placeholder" and isinstance(v := n.meta.get("val"), torch.Tensor) and v.dtype == torch.float8_e4m3fn
    )


def _run(fmt: str, dtype: torch.dtype, passes=None, grad: bool = True, **policy):
    """One forward and backward of :class:`Attention`: FP32 weights and input under BF16 autocast (the normalized
    input is FP32, as in Hugging Face models with FP32 main weights) for ``dtype=torch.float32``, else a BF16 block
    and input without autocast. Returns ``(output, gradients by name, captured graphs, precision map)``."""
    torch.manual_seed(0)
    model = Attention().to(dtype)
    x = torch.randn(2, TOKENS // 2, D, dtype=dtype, requires_grad=grad)
    cap = Capture()
    torch._dynamo.reset()
    options = {"inner": cap, "format": fmt, "passes": passes or {}, **policy}
    with torch._functorch.config.patch(cse=False), torch.set_grad_enabled(grad):
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.float32):
            out = torch.compile(model, backend="mxfp8", options=options)(x)
        if grad:
            out.float().square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if grad:
        grads["x"] = x.grad
    return out.detach(), grads, cap, mxfx.last_report()


def _equal(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and len(a[1]) > 1
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def _linears(pm) -> dict:
    return {r.module: r for r in pm.records if r.kind == "linear"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-autocast", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_qkv_input_quantized_once_bit_identical(fmt, dtype):
    """One quantize of the normalized input where there were three (and o_proj's own), the same output and
    gradients bit for bit, one saved copy for three readers, and the sharing in the precision map.

    FP32 input: without the pass each projection packs its own copy (3 x 1.03 bytes a value beat the 4-byte
    input); with it they pack one. BF16 input: without the pass three copies outweigh the 2-byte input, which is
    kept and quantized along tokens in backward by each projection (3 more quantizes there); with it one copy
    beats it, made in the forward's quantize."""
    on, off = _run(fmt, dtype), _run(fmt, dtype, OFF)
    _equal(on, off)
    assert (len(_shared(on[2])), len(_shared(off[2]))) == (1, 0)
    assert (_quantizes(on[2].forward), _quantizes(off[2].forward)) == (2, 4)
    copy = TOKENS * D  # e4m3 bytes of one token-blocked copy of the normalized input (64 tokens: no padding)
    if dtype == torch.float32:
        assert _quantizes(off[2].backward) == _quantizes(on[2].backward)
        assert (_fp8_saved(on[2]), _fp8_saved(off[2])) == (copy, 3 * copy)
    else:
        assert _quantizes(off[2].backward) == _quantizes(on[2].backward) + 3
        assert (_fp8_saved(on[2]), _fp8_saved(off[2])) == (copy, 0)

    records = _linears(on[3])
    note = "input quantized once for q_proj, k_proj, v_proj"
    assert all(note in records[m].reason for m in ("q_proj", "k_proj", "v_proj")), on[3].to_text()
    assert note not in records["o_proj"].reason
    fmt_copy = mxfx.formats.get(fmt).saved_bytes(TOKENS * D, TOKENS, D)
    assert records["q_proj"].saved == fmt and records["q_proj"].saved_bytes[1] == fmt_copy
    for m in ("k_proj", "v_proj"):  # the shared copy counted once, on the first reader
        assert records[m].saved_bytes == (0, 0) and "copy is the one q_proj saves" in records[m].reason
    assert not any("input quantized once" in r.reason for r in off[3].records)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_projection_kept_in_bf16_by_a_rule_leaves_the_others_sharing(fmt):
    """q_proj kept as written by a policy rule: k and v share one quantize, q reads the BF16 input itself."""
    rules = [{"module": "q_proj", "precision": "bf16"}]
    on, off = _run(fmt, torch.float32, rules=rules), _run(fmt, torch.float32, OFF, rules=rules)
    _equal(on, off)
    assert (_quantizes(on[2].forward), _quantizes(off[2].forward)) == (2, 3)
    records = _linears(on[3])
    assert not records["q_proj"].rewritten and "quantized once" not in records["q_proj"].reason
    assert all("input quantized once for k_proj, v_proj" in records[m].reason for m in ("k_proj", "v_proj"))


def test_only_linears_of_one_scale_rule_share():
    """A projection quantized with another scale rule makes its own operand: k and v share, q does not."""
    rules = [{"module": "q_proj", "scale_rule": "floor"}]
    on, off = _run("mxfp8", torch.float32, rules=rules), _run("mxfp8", torch.float32, OFF, rules=rules)
    _equal(on, off)
    assert (_quantizes(on[2].forward), _quantizes(off[2].forward)) == (3, 4)
    records = _linears(on[3])
    assert "quantized once" not in records["q_proj"].reason and "once for k_proj, v_proj" in records["k_proj"].reason


@pytest.mark.parametrize("fmt", FORMATS)
def test_readers_keeping_the_input_share_the_rows_alone(fmt):
    """Every projection keeps its input as it is (a saved rule): the shared quantize makes the rows alone, no
    token-blocked copy that nothing would read; one projection keeping it: the other two still save one copy."""
    keep_all = [{"op": "saved", "precision": "bf16"}]
    on, off = _run(fmt, torch.float32, rules=keep_all), _run(fmt, torch.float32, OFF, rules=keep_all)
    _equal(on, off)
    assert _fp8_saved(on[2]) == _fp8_saved(off[2]) == 0
    made = [_quantize_ops(on[2].forward), _quantize_ops(off[2].forward)]
    # the shared quantize and o_proj's, of the same ops as the rows-only quantizes of the unshared graph: no dual
    # quantize making a token-blocked copy nothing reads
    assert (len(made[0]), len(made[1])) == (2, 4) and set(made[0]) == set(made[1]), made

    keep_k = [{"op": "saved", "module": "k_proj", "precision": "bf16"}]
    on, off = _run(fmt, torch.float32, rules=keep_k), _run(fmt, torch.float32, OFF, rules=keep_k)
    _equal(on, off)
    assert (_fp8_saved(on[2]), _fp8_saved(off[2])) == (TOKENS * D, 2 * TOKENS * D)
    records = _linears(on[3])
    assert records["k_proj"].saved == "fp32" and records["v_proj"].saved_bytes == (0, 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_inference_graph_shares_the_rows(fmt):
    """Under ``torch.no_grad()`` the shared quantize makes the rows alone; the output is the unshared one."""
    on, off = _run(fmt, torch.float32, grad=False), _run(fmt, torch.float32, OFF, grad=False)
    assert torch.equal(on[0], off[0])
    assert (_quantizes(on[2].forward), _quantizes(off[2].forward)) == (2, 4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_symbolic_token_counts(fmt):
    """Under dynamic shapes the shared quantize pads a symbolic token count as each linear would: its example
    value is made (Dynamo's way, through the Python dispatcher), and outputs and gradients at 48 and 80 tokens
    equal the unshared graph's bit for bit."""
    results = []
    for passes in (OFF, {}):
        torch.manual_seed(0)
        model, cap = Attention(), Capture()
        torch._dynamo.reset()
        compiled = torch.compile(
            model, backend="mxfp8", dynamic=True, options={"inner": cap, "format": fmt, "passes": passes}
        )
        for tokens in (48, 80):
            x = torch.randn(2, tokens, D, requires_grad=True, generator=torch.Generator().manual_seed(tokens))
            with torch.autocast("cpu", torch.bfloat16):
                out = compiled(x)
            out.float().square().sum().backward()
            results.append((out.detach(), x.grad, *(p.grad.clone() for p in model.parameters())))
        shared = _shared(cap)
        assert len(shared) == (1 if passes == {} else 0)
        for node in shared:
            rows = node.meta["example_value"][0][0]
            assert isinstance(rows, torch.Tensor) and isinstance(rows.shape[0], torch.SymInt)
    for off, on in zip(results[:2], results[2:]):
        assert all(torch.equal(a, b) for a, b in zip(off, on))


def test_hf_olmoe_attention_shares_its_input_quantize():
    """A Hugging Face OLMoE layer (tiny config): q_proj, k_proj and v_proj of the attention share one quantize."""
    transformers = pytest.importorskip("transformers")
    config = transformers.OlmoeConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.OlmoeForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.autocast("cpu", torch.bfloat16):
        torch.compile(model, backend="mxfp8", options={"inner": "aot_eager"})(input_ids=ids, labels=ids).loss.backward()
    noted = sorted(
        r.module.rsplit(".", 1)[-1]
        for r in mxfx.last_report().records
        if "input quantized once for q_proj, k_proj, v_proj" in r.reason
    )
    assert noted == ["k_proj", "q_proj", "v_proj"], mxfx.last_report().to_text()


def test_x_mx_errors_name_what_to_do():
    """An ``x_mx`` without the token-blocked operand a low-precision wgrad reads, or made of other rows, is refused."""
    x = torch.randn(64, 64)
    w = torch.randn(32, 64, requires_grad=True)
    with pytest.raises(ValueError, match=r"holds no token-blocked operand.*mx_linear_input\(x, tokens=True\)"):
        mx_linear(x, w, x_mx=mx_linear_input(x))
    with pytest.raises(ValueError, match=r"x_mx must be the pair .* of x \(64, 64\) \(64 rows\)"):
        mx_linear(x, w, x_mx=mx_linear_input(x[:32], tokens=True))
    a = mx_linear_input(x, tokens=True)
    assert torch.equal(mx_linear(x, w, x_mx=a), mx_linear(x, w))


@pytest.mark.parametrize(("made", "used"), [("mxfp8", "fp8_block"), ("fp8_block", "mxfp8"), ("fp8_block", "bf16_gemm")])
def test_an_x_mx_made_in_another_format_is_named(made, used):
    x, w = torch.randn(8, 128), torch.randn(128, 128)
    with pytest.raises(
        ValueError, match=rf"mx_linear \(x_mx\): under format='{used}' the rows operand of x \(8, 128\)"
    ):
        mx_linear(x, w, x_mx=mx_linear_input(x, format=made), format=used)
