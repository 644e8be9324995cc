"""The parameter gradient a wgrad GEMM writes itself (``Policy.fuse_wgrad_accumulation``): whether it may, and
where.

Autograd accumulates a weight gradient in three trips through memory: the wgrad GEMM writes it, a cast widens it to
the FP32 main weight's dtype where the GEMM wrote BF16, and ``AccumulateGrad`` adds it into ``.grad`` once per
microbatch. A fused op instead hands its wgrad GEMM the parameter's ``.grad`` (a new one on the first microbatch)
to write or add into, and returns no gradient for the weight: ``AccumulateGrad`` then adds nothing. Its post hooks
(DDP's reducer) still run, after the op, and read the finished ``.grad``. ``docs/caches.md`` ("Weight gradients
written by their GEMM") gives the whole contract.

* :func:`unfused_reason`: why a weight's gradient must stay autograd's (hooks, not a leaf, not FP32), judged when a
  graph compiles (the op then returns its gradient) and again by every fused backward;
* :func:`target`: in a backward, where the gradient goes and whether to write or add. The weight a backward saved
  is an alias that autograd no longer connects to the parameter (a compiled backward's saved input, or a view the
  graph made of it): the parameter is found from the backward node running now, among the leaves its inputs'
  ``AccumulateGrad`` nodes hold (through view nodes), as the one whose storage region holds the weight's; the
  engine says whether it runs that node in this backward (not in ``torch.autograd.grad``, nor in
  ``backward(inputs=...)`` without the parameter). :func:`finish` sets a new ``.grad``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

CONFIG = "Policy.fuse_wgrad_accumulation"


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor  # optional: torch builds without distributed

    return isinstance(t, DTensor)


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
        return ("post-accumulate-grad hooks on the weight (register_post_accumulate_grad_hook), run by autograd's own "
                "accumulation")
    return ""


@dataclass
class Target:
    """Where one fused backward writes a weight gradient."""

    param: torch.Tensor  # the leaf parameter
    grad: torch.Tensor  # its gradient: param.grad, or a new tensor that finish() sets
    out: torch.Tensor  # the region of ``grad`` the weight covers, in the weight's shape and strides
    accumulate: bool  # add into ``out`` (False: write it, a new gradient)


VIEW_NODES = frozenset({"TransposeBackward0", "TransposeBackward1", "TBackward0", "PermuteBackward0",
                        "ViewBackward0", "UnsafeViewBackward0", "AliasBackward0", "SliceBackward0", "SelectBackward0",
                        "AsStridedBackward0"})
"""Backward nodes of views between a weight an op read and its parameter (an eager op fed ``W.transpose(-2, -1)``);
a compiled graph takes the parameter itself as its input."""
_local = threading.local()  # per backward thread: the leaves the running node reaches and the weights found (_memo)


def _memo(node) -> tuple[list[tuple[tuple[int, int, int], tuple[int, ...]]], dict]:
    """``(leaves, found)`` of the backward node ``node``: ``leaves`` lists ``(storage span of the leaf, path to its
    AccumulateGrad node)`` for every leaf input, through :data:`VIEW_NODES` (a path: the indices into
    ``next_functions`` from ``node``); ``found`` maps a weight's storage span to the path :func:`_accumulator`
    chose for it (None: no leaf holds it). Both built once per node and graph task (a graph of a whole model has an
    input per parameter and a fused op per weight), holding no tensor."""
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


def _accumulator(weight: torch.Tensor, op: str):
    """The ``AccumulateGrad`` node, among the running backward node's inputs, of the leaf parameter whose storage
    region holds ``weight``'s; None when there is none."""
    node = torch._C._current_autograd_node()
    if node is None:
        raise RuntimeError(f"{op}: runs only inside a backward pass (it writes a parameter's .grad as autograd would)")
    leaves, found = _memo(node)
    span = _span(weight)
    if span not in found:
        storage, lo, hi = span
        found[span] = next((path for (s, first, last), path in leaves if s == storage and first <= lo and hi <= last),
                           None)
    path = found[span]
    if path is None:
        return None
    fn = node
    for i in path:
        fn = fn.next_functions[i][0]
    return fn


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """``(storage, first element, last element)`` of ``t``'s region of its storage."""
    lo = t.storage_offset()
    return StorageWeakRef(t.untyped_storage()).cdata, lo, lo + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _will_accumulate(node) -> bool:
    """Whether the engine runs ``node`` (a parameter's ``AccumulateGrad``) in the backward running now."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError as e:  # torch.autograd.grad, which accumulates into no .grad
        if "autograd.grad" in str(e):
            return False
        raise


def target(weight: torch.Tensor, op: str) -> Target | None:
    """Where the gradient of ``weight`` (the tensor a backward saved: the parameter, or a view of it the forward
    read) goes in the backward running now: into the parameter's ``.grad`` (added) or a new gradient in its layout
    (written: the first microbatch, or after ``zero_grad(set_to_none=True)``). None where this backward accumulates
    nothing into the parameter (``torch.autograd.grad``, ``backward(inputs=...)`` without it), as autograd would not.

    Raises:
        RuntimeError: outside a backward; no leaf parameter behind ``weight`` among the running node's inputs; the
            parameter can no longer take a fused gradient (a hook registered after the graph compiled:
            :func:`unfused_reason`); its ``.grad`` does not fit it (dtype, shape, device, layout) or, for a weight
            that views it, has strides other than the parameter's.
    """
    node = _accumulator(weight, op)
    param = node.variable if node is not None else None
    if param is None:
        raise RuntimeError(f"{op}: the weight {tuple(weight.shape)} whose gradient its wgrad GEMM writes "
                           f"({CONFIG}=True) is no view of a leaf parameter this backward accumulates into; compile "
                           f"with fuse_wgrad_accumulation=False")
    reason = unfused_reason(param)
    if reason:
        raise RuntimeError(f"{op}: the gradient of the weight {tuple(param.shape)} is written by its wgrad GEMM "
                           f"({CONFIG}=True, decided when the graph compiled), but it now has {reason}. Register "
                           f"hooks before compiling (the compile then leaves its gradient to autograd), or compile "
                           f"with fuse_wgrad_accumulation=False")
    if not _will_accumulate(node):
        return None
    grad, whole = param.grad, weight.numel() == param.numel()
    if grad is None:  # a partial view writes only its region: the rest must be zeros
        grad = torch.empty_like(param, memory_format=torch.preserve_format) if whole else torch.zeros_like(param)
        accumulate = not whole
    else:
        if grad.dtype != param.dtype or grad.shape != param.shape or grad.device != param.device or grad.is_sparse:
            raise RuntimeError(f"{op}: the .grad of the weight {tuple(param.shape)} is a {grad.dtype} "
                               f"{tuple(grad.shape)} tensor on {grad.device} ({grad.layout}); its wgrad GEMM writes a "
                               f"dense {param.dtype} gradient of the parameter's shape and device")
        accumulate = True
    return Target(param, grad, _region(weight, param, grad, op), accumulate)


def _region(weight: torch.Tensor, param: torch.Tensor, grad: torch.Tensor, op: str) -> torch.Tensor:
    """The elements of ``grad`` that ``weight`` (``param`` or a view of it) covers, viewed as ``weight`` views
    ``param``."""
    same = (weight.shape == param.shape and weight.stride() == param.stride()
            and weight.storage_offset() == param.storage_offset())
    if same:
        return grad
    if grad.stride() != param.stride():
        raise RuntimeError(f"{op}: the .grad of the weight {tuple(param.shape)} has strides {grad.stride()}, not the "
                           f"parameter's {param.stride()}; its wgrad GEMM writes a view of it {tuple(weight.shape)} "
                           f"laid out as the parameter. Leave .grad to autograd (set it to None) or compile with "
                           f"fuse_wgrad_accumulation=False")
    offset = grad.storage_offset() + weight.storage_offset() - param.storage_offset()
    return grad.as_strided(weight.shape, weight.stride(), offset)


def finish(t: Target) -> None:
    """After the GEMM wrote ``t.out``: a new gradient becomes the parameter's ``.grad``."""
    if t.param.grad is None:
        t.param.grad = t.grad
