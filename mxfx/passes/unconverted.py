"""Unconverted-weight report: ops that read a weight mxfx would convert but that no pass rewrote.

Runs last and rewrites nothing. An op is reported when one of its operands
walks back (through casts, views, transposes and indexing) to a parameter that
is a floating tensor of 2 or more dims, the op is not an mxfx op nor one a pass
already recorded (kept routers, the vocabulary projection, skipped GEMMs), and
it is either

* a GEMM mxfx has no pattern for here (``mm``, ``bmm``, ``matmul`` / ``@``,
  ``einsum``, ``addmm``, ``baddbmm``, a linear or grouped GEMM left over), or
* an opaque custom op (``torch.ops.<namespace>.<op>`` outside ``aten``/``prims``/``mxfx``),
  whose body mxfx cannot see.

Each becomes a precision-map record of kind ``"not_rewritten"`` naming the op,
the parameter and the reason (:func:`op_of` reads the op back); :mod:`mxfx.diagnostics.coverage`
warns once per model with their count and op names (a silent FP32/BF16 GEMM is the
failure this exists to prevent), for the ops whose weight the policy would convert
(:func:`would_convert`): a weight the op's format cannot tile (``[256, 8]`` under
MXFP8's 32-blocks), that a rule keeps, or whose pass the policy switches off is named in the map with that
reason only.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from mxfx.fx import CASTS, example_value, module_fqn, shape_str
from mxfx.policy import Policy
from mxfx.report import OpRecord, PrecisionMap

KIND = "not_rewritten"

GEMM_FUNCTIONS = {
    torch.mm: "torch.mm",
    torch.bmm: "torch.bmm",
    torch.matmul: "torch.matmul",
    operator.matmul: "@",
    torch.einsum: "torch.einsum",
    torch.addmm: "torch.addmm",
    torch.baddbmm: "torch.baddbmm",
    torch.addbmm: "torch.addbmm",
    torch._C._nn.linear: "F.linear",
    F.linear: "F.linear",
    torch._grouped_mm: "torch._grouped_mm",
    F.grouped_mm: "torch.nn.functional.grouped_mm",
}
PASS_OF = {"F.linear": "linear", "torch._grouped_mm": "grouped_mm", "torch.nn.functional.grouped_mm": "grouped_mm"}
"""GEMMs a pass would rewrite: where that pass is switched off (``Policy.passes``) the report says so."""
GEMM_METHODS = ("mm", "bmm", "matmul", "__matmul__", "addmm", "baddbmm")
_PASS_THROUGH_METHODS = (
    *CASTS,
    "transpose",
    "t",
    "permute",
    "view",
    "reshape",
    "expand",
    "unsqueeze",
    "squeeze",
    "flatten",
    "__getitem__",
    "chunk",
    "split",
    "narrow",
    "select",
    "unbind",
)
_PASS_THROUGH_FUNCTIONS = (
    operator.getitem,
    torch.transpose,
    torch.permute,
    torch.reshape,
    torch.unsqueeze,
    torch.squeeze,
    torch.t,
    torch.flatten,
    torch.chunk,
    torch.split,
    torch.narrow,
    torch.select,
    torch.unbind,
)
_PASS_THROUGH_ATTRIBUTES = ("T", "mT", "H", "mH")
"""Transposes read as attributes (``w.T``): Dynamo records them as ``getattr(w, "T")``."""
_OWN_NAMESPACES = ("aten", "prims", "mxfx")
_PREFIX = "not rewritten: "


def _op_name(node: fx.Node) -> str | None:
    """A printable name for a GEMM or opaque custom op at ``node``; None for any other op."""
    if node.op == "call_method" and node.target in GEMM_METHODS:
        return f"Tensor.{node.target}"
    if node.op != "call_function":
        return None
    t = node.target
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = getattr(t, "_qualified_op_name", None) or t._schema.name
        return None if qualified.split("::")[0] in _OWN_NAMESPACES else qualified
    try:
        return GEMM_FUNCTIONS.get(t)
    except TypeError:  # unhashable target
        return None


def parameter_behind(arg) -> fx.Node | None:
    """The >=2-D floating parameter ``arg`` reads, through casts, views, transposes and indexing; else None."""
    seen = 0
    while isinstance(arg, fx.Node) and seen < 16:
        val = example_value(arg)
        if arg.op in ("placeholder", "get_attr"):
            ok = isinstance(val, torch.nn.Parameter) and val.is_floating_point() and val.dim() >= 2
            return arg if ok else None
        passes = (
            (arg.op == "call_method" and arg.target in _PASS_THROUGH_METHODS)
            or (arg.op == "call_function" and arg.target in _PASS_THROUGH_FUNCTIONS)
            or (
                arg.op == "call_function"
                and arg.target is getattr
                and arg.args[1:2] in [(a,) for a in _PASS_THROUGH_ATTRIBUTES]
            )
        )
        if not passes or not arg.args:
            return None
        arg, seen = arg.args[0], seen + 1
    return None


def operands(node: fx.Node):
    """The arguments of ``node``, members of list arguments one by one."""
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Record every op reading a convertible weight that no pass rewrote or recorded; returns how many."""
    recorded = {r.node for r in pm.records}
    found = []
    for node in gm.graph.nodes:
        if node.name in recorded:
            continue
        name = _op_name(node)
        if name is None:
            continue
        params = [p for p in map(parameter_behind, operands(node)) if p is not None]
        if not params:
            continue
        p = params[0]
        off = PASS_OF.get(name)
        if off is not None and not policy.pass_enabled(off):
            why = f"the {off!r} {_SWITCHED_OFF} (passes={{{off!r}: False}}); it runs in the model's precision"
        elif "::" in name:
            why = (
                "opaque custom op: mxfx cannot see which GEMMs it runs; "
                "register its pattern or keep the weight out of it"
            )
        else:
            why = "GEMM over a parameter that no mxfx pattern matches; it runs in the model's precision"
        refused = _refused(policy, module_fqn(node), example_value(p))
        if refused:
            why += f"; {_ANYWAY}: {refused}"
        pm.add(
            OpRecord(
                node.name,
                KIND,
                module_fqn(node),
                f"w{shape_str(example_value(p))}",
                "-",
                "-",
                "-",
                "-",
                "-",
                f"{_PREFIX}{name}: {why}",
            )
        )
        found.append(name)
    return len(found)


_ANYWAY = "the policy would not convert this weight anyway"
_SWITCHED_OFF = "pass is switched off"


def _refused(policy: Policy, module: str, weight) -> str:
    """Why ``policy`` would not convert ``weight`` (``[.., A, B]``) in ``module`` even in an op it rewrites: a rule
    keeps the module's GEMMs, or A and B are not multiples of the format's ``feature_multiple``; "" when it would
    convert it."""
    decision = policy.decide("grouped_mm" if weight.dim() == 3 else "linear", module)
    if decision.precision != "mxfp8":
        return decision.reason
    a, b = weight.shape[-2:]
    fmt = decision.format
    if fmt.unfit_reason(a, b):
        return f"its dims {a} and {b} are not both multiples of {fmt.feature_multiple} ({fmt.feature_multiple_source})"
    return ""


def would_convert(record: OpRecord) -> bool:
    """Whether the policy would convert the weight of ``not_rewritten`` record ``record`` had a pass rewritten its
    op: its format tiles the weight, no rule keeps the module and the policy does not switch off the op's pass."""
    return _ANYWAY not in record.reason and not switched_off(record)


def switched_off(record: OpRecord) -> bool:
    """Whether ``not_rewritten`` record ``record`` is an op whose pass the policy switches off (``Policy.passes``)."""
    return _SWITCHED_OFF in record.reason


def op_of(record: OpRecord) -> str:
    """The op a ``not_rewritten`` record names (``"torch.mm"``, ``"mxfx_test::experts"``)."""
    return record.reason[len(_PREFIX) :].split(": ", 1)[0] if record.reason.startswith(_PREFIX) else record.reason
