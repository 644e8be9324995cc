"""Grouped expert GEMM pass: any known grouped GEMM of ``x [S, K]`` by expert weights -> MX grouped GEMM; then,
under the same switch, HF's per-row batched expert GEMMs (:mod:`mxfx.passes.batched_mm`).

Pattern: a call from :data:`GROUPED_OPS`, a table of the grouped-GEMM ops that
expert code emits with their argument conventions:

* ``torch._grouped_mm(x, W_t, offs)`` and ``torch.nn.functional.grouped_mm``
  (HF transformers' ``experts_implementation="grouped_mm"`` with BF16 weights,
  torchtitan's ``GroupedExperts``);
* ``transformers::grouped_mm_fallback(x, W_t, offs)``, the opaque custom op
  HF transformers calls under ``torch.compile`` when the expert weights are not
  BF16 (FP32 main weights + autocast, the usual training recipe); its registered
  backward goes away with it.

Each is matched by what it computes, not by name alone: ``x`` a 2-D floating
input sorted by expert, ``offs`` 1-D integer with one entry per expert, a 3-D
floating weight operand ``[E, K, N]`` that walks back (through casts and a
last-two-dim transpose) to a graph input (the parameter), output ``[S, N]``, no
bias. A table op failing the check is reported with the failed condition.

Replacement: :func:`mxfx.ops.grouped_mm.mx_grouped_mm_op` on the *source*
weight ``W [E, N, K]`` (the FP32 main weight; the recipe, "Routed Experts") and the *source*
input: a ``.to(weight.dtype)`` cast in front of ``x`` (HF casts the activation
to the weight's dtype since grouped GEMMs are not autocast ops) is walked back,
so MX quantizes from the activation itself. Valid because the op computes the
same per-expert products with MX-rounded operands and fp32 accumulation.

Output dtype: under autocast, the autocast dtype (BF16), which is what
``F.linear`` returns there and what a BF16-weight model's grouped GEMM returns;
it halves the bytes of the largest routed activation against the FP32 result
of the replaced op. Outside autocast, the replaced op's own dtype. A later
combine fusion sets the down projection's dtype to that of the route-weight
product it absorbs (FP32 in HF's combine), so the top-k sum keeps its
precision. The precision map's ``shapes`` column shows the chosen ``-> dtype``. Operands of different dtypes
outside autocast are left as written: eager rejects them, and so does the compiled graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from mxfx.passes import batched_mm, columns
from mxfx.passes.expert_gemm import GROUPED_WGRAD, decide, insert_grouped
from mxfx.fx import (
    CASTS,
    erase_unused_chain,
    example_value,
    mixed_dtype_reason,
    module_fqn,
    shape_str,
    size_hint,
    weight_source,
)
from mxfx.policy import Policy
from mxfx.report import OpRecord, PrecisionMap


@dataclass(frozen=True)
class GroupedOp:
    """Argument convention of one grouped-GEMM op: positional names, in order; the weight operand is ``[E, K, N]``."""

    name: str
    args: tuple[str, ...]


GROUPED_OPS: dict[object, GroupedOp] = {
    torch._grouped_mm: GroupedOp("torch._grouped_mm", ("mat_a", "mat_b", "offs", "bias", "out_dtype")),
    "transformers::grouped_mm_fallback": GroupedOp("transformers::grouped_mm_fallback", ("mat_a", "mat_b", "offs")),
    F.grouped_mm: GroupedOp("torch.nn.functional.grouped_mm", ("mat_a", "mat_b")),
}
"""Known grouped GEMMs, by function or by custom-op qualified name (``namespace::op``)."""

_ALIASES = {"input": "mat_a", "weight": "mat_b"}  # custom-op schema names -> the table's names


def op_key(target) -> object:
    """The :data:`GROUPED_OPS` key of a call target: a custom op's ``namespace::name``, else the function."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return getattr(target, "_qualified_op_name", None) or target._schema.name
    return target


def grouped_op(node: fx.Node) -> GroupedOp | None:
    """The table entry of ``node`` if it calls a known grouped GEMM, else None."""
    if node.op != "call_function":
        return None
    try:
        return GROUPED_OPS.get(op_key(node.target))
    except TypeError:  # unhashable target
        return None


def _arguments(node: fx.Node, op: GroupedOp) -> dict:
    args = dict(zip(op.args, node.args))
    args.update({_ALIASES.get(k, k): v for k, v in node.kwargs.items()})
    return args


def _is_parameter(source) -> bool:
    return isinstance(source, fx.Node) and source.op in ("placeholder", "get_attr")


def _skip_reason(x, b, offs, out, args, source) -> str:
    if x is None or b is None or offs is None:
        return "no example value for the operands (needs x, a weight and offs)"
    if args.get("bias") is not None:
        return "grouped GEMM with bias"
    if x.dim() != 2 or b.dim() != 3:
        return f"operands of {x.dim()}D x {b.dim()}D (expected a 2D input and 3D expert weights)"
    if not (x.is_floating_point() and b.is_floating_point()):
        return f"operand dtypes {x.dtype}/{b.dtype} (MXFP8 takes floating operands)"
    if (
        offs.dim() != 1
        or offs.is_floating_point()
        or offs.is_complex()
        or size_hint(offs.shape[0]) != size_hint(b.shape[0])
    ):
        return (
            f"offs {offs.dtype}{shape_str(offs)} is not 1-D integer with one entry per expert ({size_hint(b.shape[0])})"
        )
    if size_hint(x.shape[1]) != size_hint(b.shape[1]):
        return f"input features {size_hint(x.shape[1])} do not match the weight's K {size_hint(b.shape[1])}"
    if out is not None and (out.dim() != 2 or size_hint(out.shape[1]) != size_hint(b.shape[2])):
        return f"output {shape_str(out)} is not [S, N]"
    if not _is_parameter(source):
        return "weight is computed in the graph, not a parameter"
    return ""


def input_source(x_node: fx.Node) -> fx.Node:
    """``x_node`` with single-use floating casts in front of it walked back (the activation the model cast)."""
    while (
        isinstance(x_node, fx.Node)
        and x_node.op == "call_method"
        and x_node.target in CASTS
        and len(x_node.users) == 1
        and isinstance(x_node.args[0], fx.Node)
    ):
        src = example_value(x_node.args[0])
        if src is None or not src.is_floating_point():
            break
        x_node = x_node.args[0]
    return x_node


def output_dtype(x: torch.Tensor, replaced: torch.dtype) -> torch.dtype:
    """The autocast dtype of ``x``'s device when autocast is on at compile time, else ``replaced``."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else replaced


def _kernel_note(fmt, device, b, out_dtype) -> str:
    """Which kernels the format's grouped forward (``[E, K, N]`` weight ``b`` as written) and dgrad will run, where
    it has several (:meth:`mxfx.formats.Format.grouped_kernel`); "" otherwise."""
    k, n = size_hint(b.shape[1]), size_hint(b.shape[2])
    forward, dgrad = fmt.grouped_kernel(device, k, n, out_dtype), fmt.grouped_kernel(device, n, k, out_dtype)
    if not forward:
        return ""
    return (
        f"forward and dgrad on the {forward} kernel"
        if forward == dgrad
        else f"forward on the {forward} kernel, dgrad on the {dgrad} kernel"
    )


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """The ``grouped_mm`` pass: rewrite eligible grouped GEMMs in ``gm`` in place, then HF's batched_mm experts
    (:func:`mxfx.passes.batched_mm.rewrite`); returns how many were rewritten."""
    return _rewrite_grouped(gm, policy, pm) + batched_mm.rewrite(gm, policy, pm)


def _rewrite_grouped(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    rewritten = 0
    for node in list(gm.graph.nodes):
        op = grouped_op(node)
        if op is None:
            continue
        args = _arguments(node, op)
        x_node, b_node, offs_node = args.get("mat_a"), args.get("mat_b"), args.get("offs")
        x, b, offs, out = example_value(x_node), example_value(b_node), example_value(offs_node), example_value(node)
        source, transposed = weight_source(b_node)
        module = module_fqn(node)
        shapes = f"x{shape_str(x)} w{shape_str(b)}"
        # autocast does not cover grouped GEMMs: eager rejects mixed operand dtypes in or out of it
        reason = _skip_reason(x, b, offs, out, args, source) or mixed_dtype_reason(
            op.name, {"x": x, "weight": b}, autocast_on=False
        )
        d = None
        if not reason:
            d = decide(policy, module, x, b.shape[0], b.shape[2], b.shape[1], columns.kept_dtype(out, x))
            reason = d.reason
        if reason:
            pm.add(
                OpRecord(
                    node.name,
                    "grouped_mm",
                    module,
                    shapes,
                    scale_rule="-",
                    **columns.kept_gemm(out, x, b, f"{op.name}: {reason}"),
                )
            )
            continue
        replaced = args.get("out_dtype") or (out.dtype if out is not None else x.dtype)
        out_dtype = output_dtype(x, replaced)
        x_src = input_source(x_node)
        with gm.graph.inserting_before(node):
            weight = source if transposed else gm.graph.call_method("transpose", (source, -2, -1))
            if not transposed:
                weight.meta["example_value"] = example_value(source).transpose(-2, -1)
        new = insert_grouped(gm, node, x_src, weight, offs_node, d, out_dtype)
        new.meta.update(node.meta)
        if out is not None:
            new.meta["example_value"] = out.to(out_dtype)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        erase_unused_chain(gm, b_node)
        erase_unused_chain(gm, x_node)
        shapes += f" -> {str(out_dtype).removeprefix('torch.')}"
        note = f"was {op.name}" + (f" ({str(replaced).removeprefix('torch.')} out)" if replaced != out_dtype else "")
        note = "; ".join(filter(None, (note, _kernel_note(d.settings.format, x.device, b, out_dtype))))
        pm.add(
            OpRecord(
                new.name,
                "grouped_mm",
                module,
                shapes,
                scale_rule=d.format.rule_shown(d.scale_rule),
                **columns.converted_gemm(d, out, example_value(x_src), b, GROUPED_WGRAD, note),
            )
        )
        rewritten += 1
    return rewritten
