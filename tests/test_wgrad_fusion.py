"""The weight gradient written once: under BF16 autocast with FP32 main weights, each converted op's weight gradient
leaves its wgrad GEMM in FP32 (no cast after it in the compiled backward), for every format, on the main job's MoE
model (tests/models.py) compiled with ``backend="mxfp8"`` and the graphs captured after AOTAutograd.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from tests.helpers import GraphCapture
from tests.models import MoETransformer, tiny_config

FORMATS = ("mxfp8", "fp8_block", "bf16_gemm")
MX_WEIGHTS = ("attn.qkv.weight", "attn.o_proj.weight", "moe.shared_gate.weight", "moe.shared_up.weight",
              "moe.shared_down.weight", "moe.gate_up_proj", "moe.down_proj")
"""The weights the compiled model's converted ops read: the dense linears and the routed experts (the router and
lm_head stay as written, their BF16 autocast GEMMs widened by autograd as in eager)."""
VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.t.default,
         torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.alias.default}
CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


def _model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(tiny_config(d_model=128, expert_hidden=128, shared_hidden=128))


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
    grads = next(n for n in bw.graph.nodes if n.op == "output").args[0]
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
    _, grads = _backward_graph(fmt, **({"wgrad": wgrad} if wgrad else {}))
    widened = {}
    for name in MX_WEIGHTS:
        node = _producer(grads[f"layers.0.{name}"])
        assert node.meta["val"].dtype == torch.float32, (name, node.meta["val"].dtype)
        if node.target in CASTS and node.args[0].meta["val"].dtype == torch.bfloat16:
            widened[name] = str(_producer(node.args[0]).target)
    assert not widened, f"{fmt}: weight gradients widened from BF16 after their GEMM: {widened}"
