"""All-to-all pass: expert-parallel dispatch/combine -> :func:`mxfx.ops.all_to_all.mx_all_to_all`.

Pattern (functional collectives in the Dynamo graph, seen on torch 2.13 and 2.11):

* ``_c10d_functional.all_to_all_single(x, out_splits, in_splits, group)`` then
  ``_c10d_functional.wait_tensor``. torch 2.13 records this for
  ``funcol.all_to_all_single``, ``funcol.all_to_all_single_autograd`` and for
  ``torch.distributed.all_to_all_single(out, x, ...)`` (plus ``out = x.new_empty(...)``
  and ``out.copy_(wait)``, folded so that later reads of ``out`` read the result).
* ``_c10d_functional_autograd.all_to_all_single(...)`` then a
  ``higher_order.autograd_function_apply`` whose forward body is only the
  ``wait_tensor``, read through ``getitem(..., 0)``: what torch 2.11's
  ``all_to_all_single_autograd`` records.

Split sizes may be unbacked SymInts (``counts.tolist()`` under
``capture_scalar_outputs``); they are passed through unchanged, so one graph
serves every routing outcome.

Roles: an all-to-all whose splits are an earlier one's swapped (``out == in'``,
``in == out'``) is that one's **combine**; every other one is a **dispatch**.
Forward precision comes from ``policy.transport[role + "_fwd"]``, backward from
``role + "_bwd"`` (all MXFP8 by default, the recipe, "Routed Experts"); the precision map shows
the backward transport in its ``dgrad`` column.

Replacement: ``mx_all_to_all(x, out_splits, in_splits, group, forward=, backward=)``.
Valid because it moves the same rows along the same route; only their rounding
changes (each row becomes ``dequantize(quantize(row))``, blocks of 32 along the
hidden dim), and its backward is the reverse route, as the original's.

Kept as written (and reported): non-floating payloads (split counts, indices),
rows whose hidden size is not a multiple of 32, all-to-alls a policy rule keeps
in BF16, and collectives whose wait is in another graph (e.g. split off by
DDP's graph optimizer) or whose consumer is not recognised.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mxfx.ops.all_to_all import mx_all_to_all
from mxfx.passes import columns
from mxfx.fx import example_value, is_call, module_fqn, shape_str, unique_stats_site
from mxfx.policy import Policy
from mxfx.report import OpRecord, PrecisionMap

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def _op_and_default(namespace: str, name: str) -> tuple:
    ns = getattr(torch.ops, namespace, None)
    packet = getattr(ns, name, None) if ns is not None else None
    if packet is None:
        return ()
    return (packet, packet.default)


A2A_TARGETS = (
    *_op_and_default("_c10d_functional", "all_to_all_single"),
    *_op_and_default("_c10d_functional_autograd", "all_to_all_single"),
)
WAIT_TARGETS = _op_and_default("_c10d_functional", "wait_tensor")
_GRAD_MODE = (torch._C._set_grad_enabled,)


def _is_autograd_apply(node: fx.Node) -> bool:
    """``torch.ops.higher_order.autograd_function_apply`` (Dynamo's form of an autograd.Function)."""
    name = getattr(node.target, "name", None)
    return node.op == "call_function" and callable(name) and name() == "autograd_function_apply"


def _body_is_wait(gm: fx.GraphModule, body: fx.Node) -> bool:
    """True when an autograd_function_apply forward body only waits on its input (torch 2.11's wrapper)."""
    if body.op != "get_attr":
        return False
    sub = getattr(gm, body.target, None)
    if not isinstance(sub, fx.GraphModule):
        return False
    calls = [n for n in sub.graph.nodes if n.op == "call_function" and n.target not in _GRAD_MODE]
    return len(calls) == 1 and calls[0].target in WAIT_TARGETS


def _results(gm: fx.GraphModule, a2a: fx.Node):
    """The nodes carrying the received rows, and the nodes to erase; or a reason it is not recognised."""
    users = list(a2a.users)
    if not users:
        return None, "no wait_tensor in this graph (the wait was split into another graph); kept as written"
    if len(users) != 1:
        return None, f"{len(users)} consumers of the collective; kept as written"
    (user,) = users
    if user.op == "output":
        return None, "the wait_tensor is in another graph (split by DDP's graph optimizer?); kept as written"
    if user.target in WAIT_TARGETS:
        return ([user], [user]), ""
    if _is_autograd_apply(user):
        bodies = [a for a in user.args if isinstance(a, fx.Node) and a.op == "get_attr"]
        getitems = list(user.users)
        if (
            bodies
            and _body_is_wait(gm, bodies[0])
            and all(g.target is operator.getitem and g.args[1] == 0 for g in getitems)
        ):
            return (getitems, [*getitems, user, *bodies]), ""
        return None, "autograd_function_apply around the collective is not a plain wait; kept as written"
    return None, f"collective consumed by {user.target}; kept as written"


_EMPTY_FN = (torch.empty, torch.empty_like)
_EMPTY_METHODS = ("new_empty",)


def _fold_inplace_copy(gm: fx.GraphModule, received: fx.Node) -> None:
    """``out = x.new_empty(...); out.copy_(received)`` (how ``dist.all_to_all_single`` traces) -> ``received``.

    Valid when ``out`` is a fresh empty buffer read only after the copy: every
    later read sees exactly the received rows. Keeps the graph functional, so a
    dead-code pass cannot drop the unused-result ``copy_``.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for copy in list(received.users):
        if not (
            copy.op == "call_method" and copy.target == "copy_" and len(copy.args) == 2 and copy.args[1] is received
        ):
            continue
        out = copy.args[0]
        if copy.users or not isinstance(out, fx.Node) or not is_call(out, _EMPTY_FN, _EMPTY_METHODS):
            continue
        if any(u is not copy and order[u] < order[copy] for u in out.users):
            continue
        copy.replace_all_uses_with(received)
        gm.graph.erase_node(copy)
        out.replace_all_uses_with(received)
        gm.graph.erase_node(out)


def _split_key(splits) -> tuple:
    return tuple(s if isinstance(s, fx.Node) else int(s) for s in splits)


def _module_of(node: fx.Node, result: fx.Node) -> str:
    return module_fqn(node) or module_fqn(result)


def run(gm: fx.GraphModule, policy: Policy, pm: PrecisionMap) -> int:
    """Rewrite eligible all-to-alls in ``gm`` in place; returns how many were rewritten."""
    rewritten = 0
    dispatches: list[tuple[tuple, tuple]] = []  # (out_key, in_key) of earlier unpaired dispatches
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in A2A_TARGETS:
            continue
        x_node, out_splits, in_splits, group = (list(node.args) + [None] * 4)[:4]
        x = example_value(x_node)
        found, reason = _results(gm, node)
        results, dead = found if found else ([], [])
        module = _module_of(node, results[0]) if results else module_fqn(node)

        role = "dispatch"
        if out_splits is not None and in_splits is not None:
            key = (_split_key(out_splits), _split_key(in_splits))
            swapped = (key[1], key[0])
            if x is not None and x.dtype in _FLOAT and swapped in dispatches:
                dispatches.remove(swapped)
                role = "combine"
            elif x is not None and x.dtype in _FLOAT:
                dispatches.append(key)
        shapes = f"{role} x{shape_str(x)}"

        if not reason:
            if x is None:
                reason = "no example value for the payload; kept as written"
            elif x.dtype not in _FLOAT:
                reason = f"{x.dtype} payload (split metadata or indices); kept as written"
            elif not isinstance(group, str):
                reason = f"group {group!r} is not a registered group name; kept as written"
        fwd = policy.transport_precision(f"{role}_fwd")
        bwd = policy.transport_precision(f"{role}_bwd")
        if not reason and fwd != "mxfp8" and bwd != "mxfp8":
            reason = f"policy transport keeps {role}_fwd and {role}_bwd as written"
        d = None
        if not reason:  # the decision names the transport format (and judges its scale rule)
            d = policy.decide("all_to_all", module)
            reason = d.reason
        if not reason and (x.dim() < 2 or not isinstance(x.shape[-1], int) or x.shape[-1] % d.format.block):
            reason = (
                f"hidden size {x.shape[-1] if x.dim() else '?'} is not a multiple of {d.format.block} "
                f"({d.format.name} blocks); rows travel as written, in {columns.ran(x).upper()}"
            )
        out = example_value(results[0]) if results else None
        if reason:
            shapes = shapes if x is None or x.dtype in _FLOAT else f"x{shape_str(x)}"
            p = columns.ran(x)
            pm.add(
                OpRecord(
                    node.name,
                    "all_to_all",
                    module,
                    shapes,
                    scale_rule="-",
                    **columns.gemm_columns(out, x, None, p, p, "-", "-", reason),
                )
            )
            continue

        last = results[0]
        kwargs = {"forward": fwd, "backward": bwd, "scale_rule": d.scale_rule.value}
        if d.stats:  # sites <module>/all_to_all/<role>_fwd and _bwd
            site = unique_stats_site(gm, {"stats": d.stats}, f"all_to_all/{role}")["stats"]
            kwargs.update(stats=f"{site}/all_to_all/{role}", stats_every=d.stats_every)
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(mx_all_to_all, (x_node, list(out_splits), list(in_splits), group), kwargs)
        new.meta.update(last.meta)
        for r in results:
            r.replace_all_uses_with(new)
        for n in dead:
            if not n.users:
                gm.graph.erase_node(n)
        gm.graph.erase_node(node)
        _fold_inplace_copy(gm, new)
        fwd, bwd = (d.shown(p, columns.ran(x)) for p in (fwd, bwd))  # "bf16": the payload as it is
        note = "" if fwd == bwd else f"forward {fwd}, backward {bwd} (policy transport)"
        pm.add(
            OpRecord(
                new.name,
                "all_to_all",
                module,
                shapes,
                scale_rule=d.format.rule_shown(d.scale_rule),
                **columns.gemm_columns(out, x, None, fwd, bwd, "-", "-", note),
            )
        )
        rewritten += 1
    if rewritten:
        gm.delete_all_unused_submodules()
    return rewritten
