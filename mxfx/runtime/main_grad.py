"""The parameter gradient a wgrad GEMM writes itself (``Policy.fuse_wgrad_accumulation``): whether it may, and
where.

Autograd accumulates a weight gradient in three trips through memory: the wgrad GEMM writes it, a cast widens it to
the FP32 main weight's dtype where the GEMM wrote BF16, and ``AccumulateGrad`` adds it into ``.grad`` once per
microbatch. A fused op instead hands its wgrad GEMM the parameter's ``.grad`` (a new one on the first microbatch)
to write or add into, and returns no gradient for the weight: ``AccumulateGrad`` then adds nothing. Its post hooks
(DDP's reducer) still run, after the op, and read the finished ``.grad``. ``docs/caches.md`` ("Weight gradients
written by their GEMM") gives the whole contract.

* :func:`unfused_reason`: why a weight's gradient must stay autograd's (hooks, not a leaf, not FP32), judged when a
  graph compiles (the op then returns its gradient; :func:`judged` keeps the parameters found fit, with their op's
  module, for the messages) and again by every fused backward;
* :func:`target`: in a backward, where the gradient goes and whether to write or add. The weight a backward saved
  is an alias that autograd no longer connects to the parameter (a compiled backward's saved input, or a view the
  graph made of it): the parameter is found from the backward node running now, among the leaves its inputs'
  ``AccumulateGrad`` nodes hold (through view nodes), as the one whose storage region holds the weight's; the
  engine says whether it runs that node in this backward (not in ``backward(inputs=...)`` without the parameter;
  ``torch.autograd.grad`` of the parameter itself raises: the op returns it no gradient). :func:`finish` sets a new
  ``.grad``.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass

import torch
import torch._dynamo.compiled_autograd  # read: whether compiled autograd is on (_compiled_autograd_on)
from torch.multiprocessing.reductions import StorageWeakRef

CONFIG = "Policy.fuse_wgrad_accumulation"
_judged: dict[int, tuple[weakref.ref, str]] = {}  # id(parameter) -> (the parameter, held weakly; its op's module)


def judged(param: torch.Tensor, module: str = "") -> None:
    """Note that a compiled graph found ``param`` fit for the fused accumulation (:func:`unfused_reason`), for the
    op of ``module`` ("" when unknown)."""
    key = id(param)
    _judged[key] = (weakref.ref(param, lambda _: _judged.pop(key, None)), module)


def _module(param: torch.Tensor) -> str | None:
    """The module noted for ``param`` by :func:`judged` ("" when unknown); None when it was not judged."""
    ref, module = _judged.get(id(param), (None, None))
    return module if ref is not None and ref() is param else None


def _weight(param: torch.Tensor) -> str:
    """The weight as a message names it: its shape, and its op's module where known."""
    module = _module(param)
    return f"the weight {tuple(param.shape)}" + (f" of {module!r}" if module else "")


@functools.cache
def _dtensor_type() -> type | None:
    """torch's DTensor class; None in a torch built without distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor  # optional: torch builds without distributed

    return DTensor


def _is_dtensor(t: torch.Tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


COMPILED_AUTOGRAD = (
    "compiled autograd is on: its backward runs the op that writes .grad where it cannot find the parameter"
)


def _compiled_autograd_on() -> bool:
    """Whether compiled autograd is on: its config flag, or a context that turned it on without the flag
    (``torch._dynamo.utils.maybe_enable_compiled_autograd``, as torchtitan's trainer uses)."""
    return bool(
        torch._dynamo.config.compiled_autograd
        or getattr(torch._dynamo.compiled_autograd, "compiled_autograd_enabled", False)
    )


def graph_reason() -> str:
    """Why no weight gradient of the graph compiling now can be written by its GEMM, "" when they can: compiled
    autograd is on (:func:`_compiled_autograd_on`), whose traced backward runs that op where it cannot find the
    parameter (:func:`target` raises there)."""
    return COMPILED_AUTOGRAD if _compiled_autograd_on() else ""


def unfused_reason(weight) -> str:
    """Why the gradient of ``weight`` (the tensor a graph reads: a parameter) cannot be written by its wgrad GEMM, ""
    when it can: not a leaf tensor that requires a gradient, not float32 (the fused accumulation writes FP32 main
    gradients), a DTensor, or hooks that autograd runs only when it accumulates the gradient itself
    (``Tensor.register_hook``, ``register_post_accumulate_grad_hook``: optimizer-in-backward, some wrappers). A fake
    tensor standing for the parameter (the example inputs of DDP's split graphs) carries no hooks: its parameter is
    judged again when the backward runs."""
    if not isinstance(weight, torch.Tensor) or not (weight.is_leaf and weight.requires_grad):
        return "not a leaf parameter that requires a gradient"
    if weight.dtype != torch.float32:
        return f"a {str(weight.dtype).removeprefix('torch.')} weight (fused into FP32 main weights' gradients only)"
    if _is_dtensor(weight):
        return "a DTensor weight"
    if getattr(weight, "_backward_hooks", None):
        return "gradient hooks on the weight (Tensor.register_hook) that run before autograd accumulates it"
    if getattr(weight, "_post_accumulate_grad_hooks", None):
        return (
            "post-accumulate-grad hooks on the weight (register_post_accumulate_grad_hook), run by autograd's own "
            "accumulation"
        )
    return ""


@dataclass
class Target:
    """Where one fused backward writes a weight gradient."""

    param: torch.Tensor  # the leaf parameter
    grad: torch.Tensor  # its gradient: param.grad, or a new tensor that finish() sets
    out: torch.Tensor  # the region of ``grad`` the weight covers, in the weight's shape and strides
    accumulate: bool  # add into ``out`` (False: write it, a new gradient)


VIEW_NODES = frozenset(
    {
        "TransposeBackward0",
        "TransposeBackward1",
        "TBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "AliasBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "AsStridedBackward0",
    }
)
"""Backward nodes of views between a weight an op read and its parameter (an eager op fed ``W.transpose(-2, -1)``);
a compiled graph takes the parameter itself as its input."""
_local = threading.local()  # per backward thread: the leaves the running node reaches and the weights found (_memo)


def _memo(node) -> tuple[list[tuple[tuple[int, int, int], tuple[int, ...]]], dict]:
    """``(leaves, found)`` of the backward node ``node``: ``leaves`` lists ``(storage span of the leaf, path to its
    AccumulateGrad node)`` for every leaf input, through :data:`VIEW_NODES` (a path: the indices into
    ``next_functions`` from ``node``); ``found`` maps a weight's storage span to the path :func:`_accumulator` found
    for it (None: no leaf holds it). Both built once per node and graph task (a graph of a whole model has an input
    per parameter and a fused op per weight) and dropped at the next one; they hold numbers only, no node or
    tensor, so a finished backward keeps no parameter alive."""
    key = (torch._C._current_graph_task_id(), id(node), node._sequence_nr())  # nodes die and ids recur in a task
    memo = getattr(_local, "memo", None)
    if memo is None or memo[0] != key:
        leaves, frontier, seen = [], [(node, ())], set()
        while frontier:
            nxt = []
            for n, path in frontier:
                for i, (fn, _) in enumerate(n.next_functions):
                    if fn is None or id(fn) in seen:
                        continue
                    seen.add(id(fn))
                    leaf = getattr(fn, "variable", None)  # an AccumulateGrad node
                    if leaf is not None:
                        leaves.append((_span(leaf), (*path, i)))
                    elif fn.name() in VIEW_NODES:
                        nxt.append((fn, (*path, i)))
            frontier = nxt
        memo = _local.memo = (key, leaves, {})
    return memo[1], memo[2]


def _accumulator(node, weight: torch.Tensor):
    """The ``AccumulateGrad`` node, among the inputs of ``node`` (the backward node running now), of the leaf
    parameter whose storage region holds ``weight``'s; None when there is none."""
    leaves, found = _memo(node)
    span = _span(weight)
    if span not in found:  # searched once per weight and backward
        storage, lo, hi = span
        held = [
            (last - first, path) for (s, first, last), path in leaves if s == storage and first <= lo and hi <= last
        ]
        found[span] = min(held)[1] if held else None  # the smallest: a parameter may live inside another's storage
    path = found[span]
    if path is None:
        return None
    fn = node
    for i in path:  # a step or two (views): next_functions builds a tuple per access
        fn = fn.next_functions[i][0]
    return fn


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """``(storage, first element, last element)`` of ``t``'s region of its storage."""
    lo = t.storage_offset()
    return StorageWeakRef(t.untyped_storage()).cdata, lo, lo + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _will_accumulate(node, param: torch.Tensor, op: str) -> bool:
    """Whether the engine runs ``node`` (``param``'s ``AccumulateGrad``) in the backward running now: False in
    ``backward(inputs=...)`` without ``param`` and in ``torch.autograd.grad`` of other tensors.

    Raises:
        RuntimeError: ``torch.autograd.grad`` asks for ``param``'s gradient (the engine refuses to answer for a leaf
            it captures), which the op returns no gradient for.
    """
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError as e:
        if "autograd.grad" not in str(e):
            raise
        raise RuntimeError(
            f"{op}: torch.autograd.grad asks for the gradient of {_weight(param)}, which its wgrad "
            f"GEMM writes into .grad ({CONFIG}=True) and returns no gradient for: autograd.grad would "
            f"get None. Compile with fuse_wgrad_accumulation=False to take gradients with "
            f"torch.autograd.grad, or use loss.backward() and read .grad"
        ) from None


def target(weight: torch.Tensor, op: str) -> Target | None:
    """Where the gradient of ``weight`` (the tensor a backward saved: the parameter, or a view of it the forward
    read) goes in the backward running now: into the parameter's ``.grad`` (added) or a new gradient in its layout
    (written: the first microbatch, or after ``zero_grad(set_to_none=True)``). None where this backward accumulates
    nothing into the parameter (``torch.autograd.grad`` of other tensors, ``backward(inputs=...)`` without it), as
    autograd would not, and outside a backward (a graph's forward computing a gradient that is zero: see the code).

    Raises:
        RuntimeError: a backward under compiled autograd turned on after the graph compiled; no leaf parameter
            behind ``weight`` among the running node's inputs; the parameter cannot take a fused gradient
            (:func:`unfused_reason`: a hook registered after the graph compiled, or one on a weight the compile could
            not judge); ``torch.autograd.grad`` asks for its gradient (:func:`_will_accumulate`); its ``.grad`` does
            not fit it (dtype, shape, device, layout) or, for a weight that views it, has strides other than the
            parameter's.
    """
    running = torch._C._current_autograd_node()
    if running is None:
        if torch._C._current_graph_task_id() != -1:  # a backward runs, but no autograd node: compiled autograd's
            raise RuntimeError(
                f"{op}: the gradient of the weight {tuple(weight.shape)} is written by its wgrad GEMM ({CONFIG}=True), "
                f"but this backward runs under compiled autograd, turned on after the graph compiled: the op cannot "
                f"find the parameter. Turn compiled autograd on before the model's graph compiles (mxfx then leaves "
                f"every weight gradient to autograd), or compile with fuse_wgrad_accumulation=False"
            )
        # Not in a backward: a compiled graph's partitioner puts the op in the forward where its operands depend on
        # no tangent. A gradient is linear in the tangents, so this one is zero (the op's output reaches no
        # differentiable output; AOTAutograd traced zeros for it), and autograd would accumulate nothing.
        return None
    node = _accumulator(running, weight)
    param = node.variable if node is not None else None
    if param is None:
        raise RuntimeError(
            f"{op}: the weight {tuple(weight.shape)} whose gradient its wgrad GEMM writes "
            f"({CONFIG}=True) is neither a leaf parameter nor a view of one: it is computed from "
            f"parameters (a parametrization, a copy), so it has no .grad to write. A compiled graph "
            f"gives such an op back to autograd; this one was called eagerly or inside a higher-order "
            f"op's body the compile does not trace weights through: turn fuse_wgrad_accumulation off "
            f"for it"
        )
    reason = unfused_reason(param)
    if reason and _module(param) is not None:
        raise RuntimeError(
            f"{op}: the gradient of {_weight(param)} is written by its wgrad GEMM ({CONFIG}=True, "
            f"decided when the graph compiled, when it had no hook), but it now has {reason}: it was "
            f"registered after the graph compiled. Register it before compiling (the compile then "
            f"leaves that gradient to autograd), or compile with fuse_wgrad_accumulation=False"
        )
    if reason:
        raise RuntimeError(
            f"{op}: the gradient of {_weight(param)} is written by its wgrad GEMM ({CONFIG}=True), but "
            f"it has {reason}. No compile judged this parameter (its op reads it inside a higher-order "
            f"op's body other than activation checkpointing, or in an eager call, or the graph was "
            f"compiled for another module of its class and runs this one too), so the op kept the "
            f"fusion: remove the hook, or compile with fuse_wgrad_accumulation=False"
        )
    if not _will_accumulate(node, param, op):
        return None
    grad, whole = param.grad, weight.numel() == param.numel()
    if grad is None:  # a partial view writes only its region: the rest must be zeros
        grad = torch.empty_like(param, memory_format=torch.preserve_format) if whole else torch.zeros_like(param)
        accumulate = not whole
    else:
        if grad.dtype != param.dtype or grad.shape != param.shape or grad.device != param.device or grad.is_sparse:
            raise RuntimeError(
                f"{op}: the .grad of {_weight(param)} is a {grad.dtype} {tuple(grad.shape)} tensor on "
                f"{grad.device} ({grad.layout}); its wgrad GEMM writes a dense {param.dtype} gradient "
                f"of the parameter's shape and device. Set .grad to None (zero_grad(set_to_none=True)) "
                f"or to such a tensor before the backward, or compile with "
                f"fuse_wgrad_accumulation=False"
            )
        accumulate = True
    return Target(param, grad, _region(weight, param, grad, op), accumulate)


def _region(weight: torch.Tensor, param: torch.Tensor, grad: torch.Tensor, op: str) -> torch.Tensor:
    """The elements of ``grad`` that ``weight`` (``param`` or a view of it) covers, viewed as ``weight`` views
    ``param``."""
    same = (
        weight.shape == param.shape
        and weight.stride() == param.stride()
        and weight.storage_offset() == param.storage_offset()
    )
    if same:
        return grad
    if grad.stride() != param.stride():
        raise RuntimeError(
            f"{op}: the .grad of the weight {tuple(param.shape)} has strides {grad.stride()}, not the "
            f"parameter's {param.stride()}; its wgrad GEMM writes a view of it {tuple(weight.shape)} "
            f"laid out as the parameter. Leave .grad to autograd (set it to None) or compile with "
            f"fuse_wgrad_accumulation=False"
        )
    offset = grad.storage_offset() + weight.storage_offset() - param.storage_offset()
    return grad.as_strided(weight.shape, weight.stride(), offset)


def finish(t: Target) -> None:
    """After the GEMM wrote ``t.out``: a new gradient becomes the parameter's ``.grad``."""
    if t.param.grad is None:
        t.param.grad = t.grad
