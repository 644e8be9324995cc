"""Shared-quantize pass: linears reading one input quantize it once.

Pattern (after the linear pass): two or more ``mx_linear`` calls reading the same input node ``x`` (no SwiGLU
``up``, no ``x_mx`` yet), in a low-precision format, with the same format, scale rule and ``save``: the q, k and v
projections of an attention block. A fused qkv linear is one call: nothing to share.

Replacement: one ``mx_linear_input(x, tokens=..., format=..., scale_rule=...)`` before the first of them, handed to
each as ``x_mx``: x's rows operand (1x32 MX blocks or 1x128 tiles along K) and, where some reader's wgrad reads it
(:func:`mxfx.passes.saved.reads_tokens`), its token-blocked operand, from the same read. Valid because each linear
would make those operands itself from the same tensor with the same format and rule: the same bytes, so outputs
and gradients are bit for bit those of the unshared graph. Gradients still flow through ``x`` into each linear's
dgrad; the operands are made from ``x.detach()``.

Why: on the CPU the quantizes are opaque custom ops, and AOTAutograd's common-subexpression pass merges the
identical ones; on a GPU their kernels are traced into the graph and each writes fresh buffers, so nothing merges
them and x is quantized, and its token-blocked copy saved, once per reader. The saved pass then counts the shared
copy once for all its readers (:mod:`mxfx.passes.saved`) and, where none of them keeps it, has the shared quantize
make the rows alone. The precision map notes the sharing on each reader.
"""

from __future__ import annotations

import torch.fx as fx

from mxfx.ops.linear import mx_linear, mx_linear_input
from mxfx.ops.settings import settings_of
from mxfx.fx import fill_example_value, module_fqn
from mxfx.passes.saved import reads_tokens
from mxfx.policy import Policy
from mxfx.report import PrecisionMap


def _key(node: fx.Node) -> tuple | None:
    """What readers of one input must agree on to share its quantize; None for a linear that cannot share."""
    if node.op != "call_function" or node.target is not mx_linear or not isinstance(node.args[0], fx.Node):
        return None
    if node.kwargs.get("up") is not None or node.kwargs.get("x_mx") is not None:
        return None
    settings = settings_of(node.kwargs)
    if not settings.format.low_precision:  # nothing quantized (bf16_gemm)
        return None
    return node.args[0], settings.format.name, settings.scale_rule.value, settings.save


def _names(readers: list[fx.Node]) -> str:
    """The readers' modules, without the part of their names they all share (``q_proj, k_proj, v_proj``)."""
    names = [module_fqn(n) or n.name for n in readers]
    parts = [name.split(".") for name in names]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    return ", ".join(".".join(p[common:]) for p in parts)


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Give linears of one input, format, scale rule and ``save`` one quantize of it; returns how many quantizes
    were shared (one per group of readers)."""
    groups: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        key = _key(node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    shared = 0
    for (x, fmt, rule, _), readers in groups.items():
        if len(readers) < 2:
            continue
        tokens = any(reads_tokens(n) for n in readers)
        with gm.graph.inserting_before(readers[0]):
            operands = gm.graph.call_function(
                mx_linear_input, (x,), {"tokens": tokens, "format": fmt, "scale_rule": rule}
            )
        fill_example_value(operands)  # the saved pass reads it: a reader of x with no backward
        note = f"input quantized once for {_names(readers)}"
        for n in readers:
            n.kwargs = {**n.kwargs, "x_mx": operands}
            record = pm.find(n.name)
            if record:
                record.add_note(note)
        shared += 1
    return shared
