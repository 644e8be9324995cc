"""Saved-activation pass: store a converted op's input for backward as its format's copy only where that is smaller.

A converted linear or grouped GEMM keeps its wgrad input for backward, either as a copy in the op's format
(:meth:`mxfx.formats.Format.saved_bytes`: 33/32 bytes a value for MXFP8, 1 + 4/128 for fp8_block, 2 for
bf16_gemm) or as the input itself. The copy saves memory only when no other backward consumer keeps the same
tensor alive (the recipe, "Smaller Saved Activations", "Dense and Shared-Expert Linears", "MXFP8 Activation
Saving Without MXFP8 Compute"): a copy next to a retained tensor costs its bytes on top.

Rule, per converted op input ``x`` (views, ``contiguous``, ``clone``, row gathers,
``x[idx]`` and ``index_select``, and casts to the dtype a tensor already has, ``x.float()`` of an FP32 ``x``,
``x.to(x.dtype)``, ``_to_copy`` or ``convert_element_type`` to the same dtype, are looked through, both from
``x`` up to its base and from the base down to its other readers: they are that tensor, or a copy the
partitioner recomputes from it; the top-k gathered rows of a dispatch cost nothing to keep when their tokens
are kept anyway. A cast that changes the dtype makes a tensor of its own):

* the op saves nothing (no gradient flows through it, under ``torch.no_grad()``, or its weight is frozen):
  left alone, counted nowhere;
* its base is the output of an op whose backward reads its own output
  (``scaled_dot_product_attention``, softmax, log_softmax, sigmoid, tanh, exp,
  relu, sqrt, rsqrt, in any of their spellings): keep it — this is the recipe's
  attention output projection;
* another user of the base or of an alias of it (a view, ``detach``) saves it for its backward (anything but
  additions, casts that change the dtype, concatenations and ops with no backward through them), as the
  router's FP32 GEMM saves ``x.float()`` of FP32 tokens, or ``w * x.detach()`` saves ``x``: keep it;
* several converted ops read it and one copy of it in its own dtype is smaller than
  one format copy per op (2 bytes for BF16 vs n x 33/32 for MXFP8): keep it as it
  is. Readers given one shared quantize of it (q/k/v projections,
  :mod:`mxfx.passes.shared_quantize`) save one copy together and count as one;
* it is rows gathered from fewer tokens (a dispatch's ``x[order // k]``, k
  copies of each token) and the tokens in their own dtype are smaller than a format
  copy of the gathered rows (2 bytes vs k x 33/32): keep the tokens, which
  backward gathers again;
* the copy (qdata and scales, as :meth:`mxfx.formats.Format.saved_bytes` counts them) would not be strictly
  smaller than the input kept as it is, in its own dtype (an FP32 input under BF16 autocast is kept in FP32,
  not as the BF16 cast the op as written saves): keep it. A linear whose low-precision wgrad blocks its input
  along tokens pads them to the format's ``token_multiple`` (32 for MXFP8), so at a few tokens the copy
  outgrows the tensor (judged at the traced token count);
* otherwise pack — the QKV projection's input in the recipe.

Eligibility: floating dtype and a last dim that is a multiple of the format's block (already
required of a converted op's input); integer routing indices never reach one.
A policy rule with ``op="saved", precision="bf16"`` (or ``save="bf16"`` on the
op's own rule) keeps the input as it is regardless. The decision is written into the
op's ``save`` argument and the precision map (the format's name, or the kept input's dtype), with nominal saved
bytes before and after. A shared quantize none of whose readers then saves its token-blocked copy makes the rows
alone (``tokens=False``). A keep decision is a request: AOTAutograd's partitioner may still
move the backward's (bit-identical) quantize into the forward and save its result
where that is smaller and nothing else keeps the input alive.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from mxfx.formats import Format
from mxfx.ops.dispatch import gather_routed_rows
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.settings import settings_of
from mxfx.ops.linear import mx_linear, mx_linear_input
from mxfx.passes.columns import needs_grad, ran
from mxfx.fx import example_value, fill_example_value, is_call, module_fqn, size_hint
from mxfx.policy import Policy
from mxfx.report import PrecisionMap

MX_OPS = (mx_linear, mx_grouped_mm_op)
_VIEW_METHODS = (
    "view",
    "reshape",
    "transpose",
    "permute",
    "contiguous",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "t",
    "clone",
    "expand",
    "chunk",
    "split",
    "narrow",
    "index_select",
    "view_as",
    "reshape_as",
    "expand_as",
    "select",
    "unbind",
    "movedim",
    "detach",
)
_VIEW_FNS = (
    torch.reshape,
    torch.transpose,
    torch.flatten,
    torch.permute,
    torch.squeeze,
    torch.unsqueeze,
    torch.chunk,
    torch.split,
    operator.getitem,
    torch.clone,
    torch.narrow,
    torch.index_select,
    torch.select,
    torch.unbind,
    torch.movedim,
    torch.detach,
    gather_routed_rows,  # the dispatch's row gather with its scatter-free backward (mxfx.passes.dispatch_backward)
)
_CAST_METHODS = ("to", "float", "double", "bfloat16", "half", "type")
_CAST_FNS = (
    torch.Tensor.to,
    torch.Tensor.float,
    torch.Tensor.double,
    torch.Tensor.bfloat16,
    torch.Tensor.half,
    torch.Tensor.type,
)
_CAST_OPS = (torch.ops.aten._to_copy, torch.ops.aten.to, torch.ops.prims.convert_element_type)
"""Casts in any spelling (Tensor methods, ATen/prims ops by packet): an alias where they keep dtype and device."""
_SAVES_OUTPUT_FNS = (
    F.scaled_dot_product_attention,
    torch.softmax,
    F.softmax,
    torch.special.softmax,
    torch.log_softmax,
    F.log_softmax,
    torch.sigmoid,
    F.sigmoid,
    torch.special.expit,
    torch.tanh,
    F.tanh,
    torch.exp,
    torch.relu,
    F.relu,
    torch.relu_,
    F.relu_,
    torch.sqrt,
    torch.rsqrt,
)
"""Ops whose backward reads their own output (``y * (1 - y)``, ``1 - y^2``, ``y > 0``, ``0.5 / y``, ...)."""
_SAVES_OUTPUT_METHODS = (
    "softmax",
    "log_softmax",
    "sigmoid",
    "sigmoid_",
    "tanh",
    "tanh_",
    "exp",
    "exp_",
    "relu",
    "relu_",
    "sqrt",
    "sqrt_",
    "rsqrt",
    "rsqrt_",
)
_NON_SAVING_FNS = (
    operator.add,
    operator.sub,
    operator.neg,
    torch.add,
    torch.sub,
    torch.cat,
    torch.stack,
    F.pad,
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    mx_linear_input,
)
_NON_SAVING_METHODS = (
    "add",
    "sub",
    "neg",
    "to",
    "float",
    "double",
    "bfloat16",
    "half",
    "type",
    "size",
    "dim",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
)
"""Users whose backward keeps nothing of their input (sums, casts that change the dtype, shape-only factories, the
shared quantize of a linear input: it reads ``x.detach()``).
``detach`` is an alias (the same storage, :func:`_is_view`): what its readers save keeps the tensor alive (``w *
x.detach()``); a reader with no backward through it (the dispatch's pre-gather quantize of the tokens) saves
nothing."""


def _is_noop_cast(n: fx.Node) -> bool:
    """Whether ``n`` casts its input to the dtype and device it already has (``x.float()`` of an FP32 ``x``,
    ``x.to(x.dtype)``, ``_to_copy``/``convert_element_type`` to the same dtype), as the graph's example values say:
    its result is its input, or a copy of it the partitioner recomputes. False without both example values."""
    if n.op == "call_function":
        if n.target not in _CAST_FNS and getattr(n.target, "overloadpacket", n.target) not in _CAST_OPS:
            return False
    elif not is_call(n, (), _CAST_METHODS):
        return False
    src, out = example_value(n.args[0] if n.args else None), example_value(n)
    return src is not None and out is not None and (src.dtype, src.device) == (out.dtype, out.device)


def _is_view(n: fx.Node) -> bool:
    """Whether ``n`` is its first argument looked at another way (a view, ``contiguous``, ``clone``, a
    row gather, an element of ``chunk``/``split``/``unbind``) or a cast that changes nothing (:func:`_is_noop_cast`)."""
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], int):
        # an element of chunk/split is a view of its base; an output of a multi-output op is a tensor of its own
        return isinstance(n.args[0], fx.Node) and _is_view(n.args[0])
    return is_call(n, _VIEW_FNS, _VIEW_METHODS) or _is_noop_cast(n)


def _base(x: fx.Node) -> fx.Node:
    while _is_view(x) and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return x


def _aliases(base: fx.Node) -> list[fx.Node]:
    """``base`` and every node that is it looked at another way (:func:`_is_view`), transitively."""
    out, todo = [], [base]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(u for u in n.users if _is_view(u) and u.args and u.args[0] is n)  # not x.to(y) for y
    return out


def saves_input(node: fx.Node) -> bool:
    """Whether converted op ``node`` keeps something of its input for a wgrad: a gradient flows through it (not
    under ``torch.no_grad()``) and its weight takes one (not frozen), as the graph's example values say."""
    return needs_grad(example_value(node)) and needs_grad(example_value(node.args[1]))


def reads_tokens(node: fx.Node) -> bool:
    """Whether converted linear ``node`` saves its input's token-blocked copy for a low-precision wgrad, as its
    keyword arguments and the graph's example values say (what :func:`mxfx.ops.linear.mx_linear` keeps)."""
    kwargs = node.kwargs
    return kwargs.get("wgrad", "mxfp8") == "mxfp8" and kwargs.get("save", "mxfp8") == "mxfp8" and saves_input(node)


def _copy_of(node: fx.Node):
    """What converted op ``node``'s saved copy is made by: the shared quantize it is given
    (:mod:`mxfx.passes.shared_quantize`), else the op itself."""
    given = node.kwargs.get("x_mx")
    return given if node.target is mx_linear and isinstance(given, fx.Node) else node


def _has_backward(n: fx.Node) -> bool:
    """Whether node ``n`` takes part in a backward, as its example value says: a tensor, or one of a tuple's,
    requires grad (True where the value is not known)."""
    val = n.meta.get("example_value", n.meta.get("val"))
    tensors = [t for t in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(t, torch.Tensor)]
    return not tensors or any(t.requires_grad for t in tensors)


_ALIVE_ANYWAY = ("kept alive by ", "also saved by ")
"""How :func:`keeps_input_alive` begins where another op saves the tensor anyway."""


def keeps_input_alive(x: fx.Node, op: fx.Node, fmt: Format) -> str:
    """Why the tensor behind ``x`` stays alive for backward without ``op``, or why one copy of it in its own dtype
    is smaller than the copies of format ``fmt`` its converted readers would save ("" if neither)."""
    base = _base(x)
    if is_call(base, _SAVES_OUTPUT_FNS, _SAVES_OUTPUT_METHODS):
        return f"kept alive by {getattr(base.target, '__name__', base.target)} backward"
    readers, copies = 0, set()
    for alias in _aliases(base):
        for u in alias.users:
            if _is_view(u):
                continue
            if u.op == "call_function" and u.target in MX_OPS and u.args[0] is alias:
                if saves_input(u):  # a reader without a backward keeps no copy
                    readers += 1
                    copies.add(_copy_of(u))
            elif u.op == "output" or is_call(u, _NON_SAVING_FNS, _NON_SAVING_METHODS):
                continue
            elif not _has_backward(u):  # no backward through it (torch.no_grad(), a detached input): saves nothing
                continue
            else:
                return f"also saved by {getattr(u.target, '__name__', u.target)}"
    x_val, base_val = example_value(x), example_value(base)
    own_bytes = x_val.element_size() if x_val is not None else 2
    # rows per base row: top-k for a dispatch's gather (x[order // k]), 1 for views
    n_x = size_hint(x_val.numel()) if x_val is not None else 0  # 0 when data-dependent (expert parallel)
    n_base = size_hint(base_val.numel()) if base_val is not None else 0
    expand = n_x / n_base if n_x and n_base else 1.0
    copy = fmt.bytes_per_value
    if expand > 1 and readers * expand * copy >= own_bytes:
        return (
            f"rows gathered from their tokens ({expand:g} per token): keeping the {own_bytes}-byte tokens, "
            f"re-gathered in backward, is smaller than a {fmt.name} copy of the gathered rows "
            f"({copy:g} bytes a value)"
        )
    if len(copies) > 1 and len(copies) * copy >= own_bytes:
        shared = "" if len(copies) == readers else f" saving {len(copies)} copies"
        return (
            f"read by {readers} converted ops{shared}: one {own_bytes}-byte copy is smaller than {len(copies)} "
            f"{fmt.name} copies ({copy:g} bytes a value)"
        )
    return ""


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Set ``save`` on every converted op whose input needs no copy of its format; returns how many are packed.

    Nominal saved bytes (precision map), ``(before, after)``: before, what the op as written saves (its input's
    values in the dtype the op computes in: BF16 under autocast); after, what the converted op saves: its input
    in its own dtype where kept as it is (an FP32 input under autocast: FP32), its format's copy (qdata and
    scales, tokens padded) where packed. An input kept as it is counts once, on its first converted reader (the
    graph as written saves it once too, shared); one that another op saves anyway counts nothing after, and
    before only the cast the op as written saves beside it (a BF16 copy under autocast); an op with nothing to
    save (no backward, frozen weight) counts nothing. Readers of one shared quantize that pack count its copy
    once, before and after, on the first of them (the graph as written saves their one input once too). Packing
    happens only where the copy is strictly smaller than the input kept as it is.
    """
    packed = 0
    counted: set[fx.Node] = set()  # bases of inputs kept as they are, already counted
    copies: dict[tuple, str] = {}  # (shared quantize, wgrad) -> the module whose record counts its copy
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in MX_OPS or node.kwargs.get("up") is not None:
            continue
        if not saves_input(node):
            continue
        record = pm.find(node.name)
        x = example_value(node.args[0])
        numel = 1
        for d in x.shape if x is not None else ():
            numel *= size_hint(d)
        out = example_value(node)
        written_bytes = numel * (out.element_size() if out is not None else 2)  # the op as written saves X so
        own_bytes = numel * (x.element_size() if x is not None else 2)  # X kept as it is: what the op then saves
        base = _base(node.args[0])
        kept_bytes = (0, 0) if base in counted else (written_bytes, own_bytes)
        kept = ran(x)
        fmt = settings_of(node.kwargs).format
        if node.kwargs.get("save", "mxfp8") != "mxfp8":  # the op's own rule already keeps it as it is
            if record:
                alive = keeps_input_alive(node.args[0], node, fmt)
                if alive.startswith(_ALIVE_ANYWAY):  # counted as below: no bytes of its own
                    record.add_note(alive)
                    if base not in counted:
                        kept_bytes = (0 if written_bytes == own_bytes else written_bytes, 0)
                record.saved_bytes = kept_bytes
                counted.add(base)
            continue
        copy_bytes, padded = _copy_bytes(node, x, numel, fmt)
        ds = policy.decide("saved", module_fqn(node))  # rules with op="saved"
        why = ds.reason if ds.precision != "mxfp8" else keeps_input_alive(node.args[0], node, fmt)
        copy = f"the {fmt.name} copy ({copy_bytes} bytes{padded})"
        if not why and copy_bytes >= own_bytes:
            why = f"{copy} is not smaller than the {own_bytes}-byte {kept} input kept as it is"
        if why:
            node.kwargs = {**node.kwargs, "save": "bf16"}
            if record:
                record.saved = kept
                record.add_note(why)
                if why.startswith(_ALIVE_ANYWAY) and base not in counted:  # saved beside by another op: no bytes
                    kept_bytes = (0 if written_bytes == own_bytes else written_bytes, 0)  # of its own, as written
                record.saved_bytes = kept_bytes
                counted.add(base)
            continue
        packed += 1
        copy_key = (_copy_of(node), node.kwargs.get("wgrad"))  # readers of a shared quantize save one copy of it
        if copy_key in copies:
            if record:
                record.saved_bytes = (0, 0)
                record.add_note(f"its {fmt.name} copy is the one {copies[copy_key]} saves")
            continue
        copies[copy_key] = module_fqn(node) or node.name
        if record:
            record.saved_bytes = (written_bytes, copy_bytes)
    for operands in gm.graph.find_nodes(op="call_function", target=mx_linear_input):
        if operands.kwargs.get("tokens") and not any(reads_tokens(u) for u in operands.users):
            operands.kwargs = {**operands.kwargs, "tokens": False}  # no reader saves the token-blocked copy
            operands.meta.pop("example_value", None)
            fill_example_value(operands)
    return packed


def _copy_bytes(node: fx.Node, x, numel: int, fmt: Format) -> tuple[int, str]:
    """``(bytes, how)``: the bytes of the copy of its input ``node`` would save in format ``fmt``, as the format
    counts them (:meth:`mxfx.formats.Format.saved_bytes`: the tokens of a linear whose low-precision wgrad blocks
    them are padded to ``fmt.token_multiple``), and a note saying so where that padding adds bytes ("" else)."""
    if node.target is mx_linear and node.kwargs.get("wgrad") == "mxfp8" and x is not None and x.dim():
        k = size_hint(x.shape[-1])
        tokens = numel // k if k else 0
        n = fmt.saved_bytes(numel, tokens, k)
        padded = -tokens % fmt.token_multiple
        return n, (f", {tokens} tokens zero-padded to a multiple of {fmt.token_multiple}" if padded else "")
    return fmt.saved_bytes(numel), ""
