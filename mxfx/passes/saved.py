"""Saved-activation pass: store an MX op's input for backward in MXFP8 only where that replaces BF16.

An MX linear or grouped GEMM keeps its wgrad input for backward. Packing it as
MXFP8 (33/32 bytes per value) saves memory only when no other backward
consumer keeps the same BF16 tensor alive (the recipe, "Smaller Saved Activations", "Dense and Shared-Expert Linears", "MXFP8 Activation Saving Without MXFP8 Compute"):
adding an MX copy next to a retained BF16 tensor costs 33/32 bytes more.

Rule, per MX op input ``x`` (views, ``contiguous``, ``clone`` and row gathers,
``x[idx]`` and ``index_select``, are looked through, since the partitioner
recomputes them from their base: the top-k gathered rows of a dispatch cost
nothing to keep when their tokens are kept anyway):

* its base is the output of an op whose backward reads its own output
  (``scaled_dot_product_attention``, softmax, log_softmax, sigmoid, tanh, exp,
  relu, sqrt, rsqrt, in any of their spellings): keep BF16 — this is the recipe's
  attention output projection;
* another user of the base saves it for its backward (anything but additions,
  views, casts and concatenations): keep BF16;
* several MX ops read it (q/k/v projections of one input) and one copy of it
  in its own dtype is smaller than one MX copy per op (2 bytes for BF16 vs
  n x 33/32): keep it as it is;
* it is rows gathered from fewer tokens (a dispatch's ``x[order // k]``, k
  copies of each token) and the tokens in their own dtype are smaller than an MX
  copy of the gathered rows (2 bytes vs k x 33/32): keep the tokens, which
  backward gathers again;
* the MX copy would not be smaller: a linear with MXFP8 wgrad saves its input
  blocked along tokens, zero-padded to a multiple of 32 tokens, so at a few
  tokens the copy outgrows the tensor (judged at the traced token count): keep it;
* otherwise pack MXFP8 — the QKV projection's input in the recipe.

Eligibility: floating dtype and a last dim that is a multiple of 32 (already
required of an MX op's input); integer routing indices never reach an MX op.
A policy rule with ``op="saved", precision="bf16"`` (or ``save="bf16"`` on the
op's own rule) keeps the input BF16 regardless. The decision is written into the
op's ``save`` argument and the precision map, with nominal saved bytes before
and after. A BF16 decision is a request: AOTAutograd's partitioner may still
move the backward's (bit-identical) quantize into the forward and save its MX
result where that is smaller and nothing else keeps the input alive.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.settings import settings_of
from mxfx.ops.linear import mx_linear
from mxfx.passes.fx import example_value, is_call, module_fqn, size_hint
from mxfx.policy import Policy
from mxfx.report import PrecisionMap

MX_OPS = (mx_linear, mx_grouped_mm_op)
_VIEW_METHODS = ("view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "squeeze", "unsqueeze", "t", "clone", "expand", "chunk", "split", "narrow", "index_select")
_VIEW_FNS = (torch.reshape, torch.transpose, torch.flatten, torch.permute, torch.squeeze, torch.unsqueeze, torch.chunk, torch.split, operator.getitem, torch.clone, torch.narrow, torch.index_select)
_SAVES_OUTPUT_FNS = (
    F.scaled_dot_product_attention, torch.softmax, F.softmax, torch.special.softmax, torch.log_softmax, F.log_softmax,
    torch.sigmoid, F.sigmoid, torch.special.expit, torch.tanh, F.tanh, torch.exp, torch.relu, F.relu, torch.relu_,
    F.relu_, torch.sqrt, torch.rsqrt,
)
"""Ops whose backward reads their own output (``y * (1 - y)``, ``1 - y^2``, ``y > 0``, ``0.5 / y``, ...)."""
_SAVES_OUTPUT_METHODS = ("softmax", "log_softmax", "sigmoid", "sigmoid_", "tanh", "tanh_", "exp", "exp_", "relu",
                         "relu_", "sqrt", "sqrt_", "rsqrt", "rsqrt_")
_NON_SAVING_FNS = (operator.add, operator.sub, operator.neg, torch.add, torch.sub, torch.cat, torch.stack, F.pad,
                   torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like)
_NON_SAVING_METHODS = ("add", "sub", "neg", "to", "float", "bfloat16", "half", "type", "size", "dim", "detach",
                       "new_zeros", "new_ones", "new_empty", "new_full")
"""Users whose backward keeps nothing of their input (sums, casts, shape-only factories, ``detach``)."""


def _is_view(n: fx.Node) -> bool:
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], int):
        # an element of chunk/split is a view of its base; an output of a multi-output op is a tensor of its own
        return isinstance(n.args[0], fx.Node) and _is_view(n.args[0])
    return is_call(n, _VIEW_FNS, _VIEW_METHODS)


def _base(x: fx.Node) -> fx.Node:
    while _is_view(x) and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return x


def _aliases(base: fx.Node) -> list[fx.Node]:
    out, todo = [], [base]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(u for u in n.users if _is_view(u))
    return out


def keeps_bf16_alive(x: fx.Node, op: fx.Node) -> str:
    """Why the BF16 tensor behind ``x`` stays alive for backward without ``op`` ("" if it does not)."""
    base = _base(x)
    if is_call(base, _SAVES_OUTPUT_FNS, _SAVES_OUTPUT_METHODS):
        return f"kept alive by {getattr(base.target, '__name__', base.target)} backward"
    mx_readers = 0
    for alias in _aliases(base):
        for u in alias.users:
            if _is_view(u):
                continue
            if u.op == "call_function" and u.target in MX_OPS and u.args[0] is alias:
                mx_readers += 1
            elif u.op == "output" or is_call(u, _NON_SAVING_FNS, _NON_SAVING_METHODS):
                continue
            else:
                return f"also saved by {getattr(u.target, '__name__', u.target)}"
    x_val, base_val = example_value(x), example_value(base)
    own_bytes = x_val.element_size() if x_val is not None else 2
    # rows per base row: top-k for a dispatch's gather (x[order // k]), 1 for views
    n_x = size_hint(x_val.numel()) if x_val is not None else 0  # 0 when data-dependent (expert parallel)
    n_base = size_hint(base_val.numel()) if base_val is not None else 0
    expand = n_x / n_base if n_x and n_base else 1.0
    if expand > 1 and mx_readers * expand * 33 / 32 >= own_bytes:
        return (f"rows gathered from their tokens ({expand:g} per token): keeping the {own_bytes}-byte tokens, "
                f"re-gathered in backward, is smaller than an MX copy of the gathered rows")
    if mx_readers * 33 / 32 >= own_bytes:
        return f"read by {mx_readers} MX ops: one {own_bytes}-byte copy is smaller than {mx_readers} MX copies"
    return ""


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Set ``save`` on every MX op whose input needs a BF16 copy anyway; returns how many stay MXFP8.

    Nominal saved bytes (precision map): a tensor kept in its own dtype is counted once, on
    its first MX reader, before and after (the BF16 graph saves it once too, shared); a
    packed input counts its BF16 bytes before and its MX bytes after.
    """
    packed = 0
    counted: set[fx.Node] = set()  # bases of inputs kept as they are, already counted
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in MX_OPS or node.kwargs.get("up") is not None:
            continue
        record = pm.find(node.name)
        x = example_value(node.args[0])
        numel = 1
        for d in x.shape if x is not None else ():
            numel *= size_hint(d)
        bf16_bytes = 2 * numel
        base = _base(node.args[0])
        kept_bytes = (0, 0) if base in counted else (bf16_bytes, bf16_bytes)
        if node.kwargs.get("save", "mxfp8") != "mxfp8":  # the op's own rule already keeps it BF16
            if record:
                record.saved_bytes = kept_bytes
                counted.add(base)
            continue
        mx_bytes = _mx_copy_bytes(node, x, numel)
        ds = policy.decide("saved", module_fqn(node))  # rules with op="saved"
        why = ds.reason if ds.precision != "mxfp8" else keeps_bf16_alive(node.args[0], node)
        own_bytes = numel * (x.element_size() if x is not None else 2)
        if not why and mx_bytes >= own_bytes:
            why = (f"the MX copy ({mx_bytes} bytes, tokens padded to a multiple of 32) is not smaller than the "
                   f"{own_bytes}-byte input")
        if why:
            node.kwargs = {**node.kwargs, "save": "bf16"}
            if record:
                record.saved = "bf16"
                record.add_note(why)
                record.saved_bytes = kept_bytes
                counted.add(base)
            continue
        packed += 1
        if record:
            record.saved_bytes = (bf16_bytes, mx_bytes)
    return packed


def _mx_copy_bytes(node: fx.Node, x, numel: int) -> int:
    """Bytes of the low-precision copy ``node`` would save, as its format counts them
    (:meth:`mxfx.formats.Format.saved_bytes`: the tokens of a linear whose low-precision wgrad blocks them)."""
    fmt = settings_of(node.kwargs).format
    if node.target is mx_linear and node.kwargs.get("wgrad") == "mxfp8" and x is not None and x.dim():
        k = size_hint(x.shape[-1])
        return fmt.saved_bytes(numel, numel // k if k else 0, k)
    return fmt.saved_bytes(numel)
