"""Full module names under per-block compile: where a compiled graph sits in the whole model.

``torch.compile(block)`` (torchtitan compiles each transformer block on its own) hands the backend
a graph whose module names are relative to the block (``attention.wq``), while policy rules are
written against the whole model's ``named_modules()`` (``layers.3.attention.wq``). After
:func:`name_modules` ``(model)``, the backend finds the block's place from its parameters, which
arrive in the graph as placeholders holding the real tensors: the full name of one of them, minus
its block-relative name, is the prefix of every module of that graph (:func:`graph_prefix`).

Dynamo compiles the code of identical blocks once and runs every block of that kind through the
same graph (its parameters are graph inputs), so the graph carries the first compiled block's
names; :func:`graph_place` also returns the places of the blocks sharing it, so that a rule
deciding differently for one of them is reported (``mxfx.rule_check.warn_shared_graph_rules``).
Activation-checkpoint wrappers are left out of names (``mxfx.passes.fx.strip_wrappers``).

The roots are held weakly and their parameters are looked up when a graph is compiled, so
parameters replaced after registration (FSDP2's ``fully_shard`` and its unsharded parameters
during forward, ``load_state_dict(assign=True)``) are still found.
"""

from __future__ import annotations

import sys
import weakref

import torch

from mxfx.passes.fx import strip_wrappers

_roots: weakref.WeakSet = weakref.WeakSet()


def name_modules(model: torch.nn.Module) -> torch.nn.Module:
    """Register ``model`` as a root whose ``named_modules()`` spell the names policy rules match,
    for graphs compiled from any of its submodules. Returns ``model`` (for chaining).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"mxfx.name_modules: expected an nn.Module, got {type(model).__name__}")
    _roots.add(model)
    return model


def graph_prefix(params: dict[str, torch.Tensor]) -> str:
    """The full-name prefix (``"layers.3."``, or ``""``) of a graph whose parameter placeholders are
    ``params`` (graph-relative dotted name -> the real tensor). ``""`` when no registered root holds
    one of them (the graph's own names are then the full names, as for a whole-model compile).
    """
    return graph_place(params)[0]


def graph_place(params: dict[str, torch.Tensor]) -> tuple[str, list[str]]:
    """``(prefix, shared)``: the graph's prefix (:func:`graph_prefix`) and the prefixes of the other
    modules of the registered root of the same class as the module at ``prefix`` (``["layers.1.",
    ...]``), which per-block compile runs through the same graph. ``("", [])`` when no root holds
    one of ``params``.
    """
    if not params or not _roots:
        return "", []
    by_id = {id(t): rel for rel, t in params.items()}
    for root in list(_roots):
        for full, p in root.named_parameters(remove_duplicate=False):
            rel = by_id.get(id(p))
            full = strip_wrappers(full)
            if rel is not None and (full == rel or full.endswith("." + rel)):
                prefix = full[: len(full) - len(rel)]
                return prefix, _same_class(root, prefix)
    return "", []


def _same_class(root: torch.nn.Module, prefix: str) -> list[str]:
    """Prefixes of the modules of ``root`` of the class of the (outermost) module named ``prefix``, but it."""
    if not prefix:
        return []
    modules: dict[str, torch.nn.Module] = {}
    for name, m in root.named_modules():
        modules.setdefault(strip_wrappers(name), m)  # a wrapper comes before the module it wraps
    block = modules.get(prefix.rstrip("."))
    if block is None:
        return []
    return [n + "." for n, m in modules.items() if type(m) is type(block) and n + "." != prefix]


_MODULE_CALLS = (torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__)


def running_modules():
    """The modules whose call is running around the caller, innermost first, each once. Only the ``self`` of
    ``nn.Module`` call frames is read (reading a frame's locals keeps them alive until the frame returns, which a
    module call soon does)."""
    seen = set()
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_locals.get("self") if frame.f_code in _MODULE_CALLS else None
        if isinstance(module, torch.nn.Module) and id(module) not in seen:
            seen.add(id(module))
            yield module
        frame = frame.f_back


def whole_forward(params: dict[str, torch.Tensor]) -> bool:
    """Whether a graph with parameter placeholders ``params`` (graph-relative name -> real tensor) is the whole
    forward of the module being called: no module whose call is running around the compile has one of its
    parameters and a parameter outside it, and one of them has all of them.

    False for a block compiled on its own inside an eager model (the model's call is running and holds the
    other blocks), for each graph of a forward split by graph breaks, and for a graph without parameter
    placeholders (:func:`running_modules`).
    """
    graph = {id(t) for t in params.values() if isinstance(t, torch.nn.Parameter)}
    if not graph:
        return False
    covered = False
    for module in running_modules():
        held = {id(p) for p in module.parameters()}
        if held & graph:
            if held - graph:
                return False
            covered = covered or held >= graph
    return covered
