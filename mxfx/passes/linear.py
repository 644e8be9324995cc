"""Linear pass: ``F.linear(x, W, b)`` -> :func:`mxfx.ops.linear.mx_linear`.

Pattern: any ``torch._C._nn.linear`` call in the Dynamo graph (``nn.Linear``
and ``F.linear`` both trace to it), 2D or 3D input, with or without bias.

Replacement: ``mx_linear(x, W, b, scale_rule=..., wgrad=...)`` on the parameter
itself (dtype casts in front of the weight are walked back, so the MX weight
caches derive from the FP32 main weight, the recipe, "Challenges in MXFP8 Training"), an autograd
function whose forward, dgrad and wgrad are MX GEMMs with each operand blocked
along its reduction dim. Valid because it computes the same product: only the
operands' rounding changes (to MXFP8), accumulation stays fp32, bias and output
dtype follow ``F.linear`` under autocast.

Kept as written (and reported): routers (:mod:`mxfx.passes.router`), ops a
policy rule keeps in BF16 (the vocabulary projection by default: by name, or
by a weight tied to an embedding lookup in the same graph), linears
whose in/out features are not multiples of 32, non-floating operands, operands
of different dtypes outside autocast (eager rejects them; left as written, the
compiled graph raises the same error).
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from mxfx.ops.linear import mx_linear
from mxfx.passes import columns
from mxfx.fx import (
    autocast_devices,
    erase_unused_chain,
    example_value,
    gemm_size,
    is_dtensor,
    mixed_dtype_reason,
    module_fqn,
    shape_str,
    size_hint,
    unique_stats_site,
    weight_source,
)
from mxfx.passes.router import is_router
from mxfx.policy import Policy
from mxfx.report import OpRecord, PrecisionMap

LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
DTENSOR_REASON = "DTensor operands (tensor parallel): MX GEMMs take local tensors; kept as written (BF16/FP32)"


def _operands(node: fx.Node):
    x, w, *rest = node.args
    b = rest[0] if rest else node.kwargs.get("bias")
    return x, w, b


def _skip_reason(x, w) -> str:
    if x is None or w is None:
        return "no example value for the operands"
    if is_dtensor(x) or is_dtensor(w):
        return DTENSOR_REASON
    if x.dtype not in _FLOAT or w.dtype not in _FLOAT:
        return f"operand dtypes {x.dtype}/{w.dtype}: MXFP8 takes bf16/fp16/fp32 operands (kept as written)"
    if w.dim() != 2:
        return f"weight has {w.dim()} dims"
    return ""


_EMBEDDING_FNS = (torch.nn.functional.embedding, torch.embedding)


def _tied_to_embedding(w_node) -> bool:
    """True when the linear's weight (behind casts) also feeds an embedding lookup: a tied output head."""
    source, _ = weight_source(w_node)
    return isinstance(source, fx.Node) and any(
        u.op == "call_function" and u.target in _EMBEDDING_FNS and source in u.args[:2] for u in source.users
    )


def _user_sets_precision(policy: Policy, kind: str, module: str) -> bool:
    return any(r.precision is not None and r.matches(kind, module) for r in policy.rules)


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Rewrite eligible linears in ``gm`` in place; returns how many were rewritten.

    Warns, naming the modules, when linears are kept because their operands are DTensors.
    """
    rewritten, distributed = 0, []
    autocast = autocast_devices(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in LINEAR_TARGETS:
            continue
        x_node, w_node, b_node = _operands(node)
        x, w = example_value(x_node), example_value(w_node)
        kind = "router" if is_router(node) else "linear"
        module = module_fqn(node)
        shapes = f"x{shape_str(x)} w{shape_str(w)}" + (" +bias" if b_node is not None else "")
        reason = _skip_reason(x, w) or mixed_dtype_reason(
            "F.linear", {"x": x, "weight": w, "bias": example_value(b_node)}, x.device.type in autocast[node]
        )
        macs = gemm = None
        if not reason:
            macs, gemm = gemm_size(x.shape[:-1], w.shape[0], w.shape[1])
        d = policy.decide(kind, module, macs, gemm)
        out = example_value(node)
        if not reason:
            d = d.fit(size_hint(w.shape[1]), size_hint(w.shape[0]), columns.kept_dtype(out, x))
        reason = d.reason or reason
        if not reason and _tied_to_embedding(w_node) and not _user_sets_precision(policy, kind, module):
            reason = (
                "vocabulary projection (weight tied to an embedding); a policy rule with precision='mxfp8' overrides"
            )
        if reason:
            pm.add(OpRecord(node.name, kind, module, shapes, scale_rule="-", **columns.kept_gemm(out, x, w, reason)))
            if reason == DTENSOR_REASON:
                distributed.append(module or node.name)
            continue
        kwargs = unique_stats_site(gm, d.settings.graph_kwargs(), "linear")
        source, transposed = weight_source(w_node)
        weight = w_node if transposed else source  # quantize from the parameter itself, not a cast copy
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(mx_linear, (x_node, weight, b_node), kwargs)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        if weight is not w_node:
            erase_unused_chain(gm, w_node)
        if kind == "router":
            _warn_wildcard_router(d.rule, module)
        # a high-precision wgrad multiplies dY, in the output's dtype
        pm.add(
            OpRecord(
                new.name,
                kind,
                module,
                shapes,
                scale_rule=d.format.rule_shown(d.scale_rule),
                **columns.converted_gemm(d, out, x, w, columns.ran(out)),
            )
        )
        rewritten += 1
    if distributed:
        warnings.warn(
            f"mxfx: linears left in BF16/FP32, not MXFP8 (DTensor operands, tensor parallel): {', '.join(distributed)}",
            stacklevel=2,
        )
    return rewritten


_warned_routers: set = set()


def _warn_wildcard_router(rule, module: str) -> None:
    """Warn once per rule when a module glob with wildcards, not ``op="router"``, switched a router to low precision:
    a router computed in its MoE block's own forward belongs to that block, so ``layers.*`` names it."""
    if rule is None or rule.op == "router" or rule.module is None or not any(c in rule.module for c in "*?["):
        return
    if rule in _warned_routers:
        return
    _warned_routers.add(rule)
    warnings.warn(
        f"mxfx: rule {rule.describe()} switches the router at {module!r} out of its own precision: its glob matches "
        f"the router's module. Routers keep their precision unless a rule names them; to keep it, put "
        f"{{'op': 'router', 'precision': 'bf16'}} before this rule or narrow the glob",
        stacklevel=3,
    )
