"""Full module names for graphs traced from a block: where a compiled graph sits in the whole model.

``torch.compile(block)`` (torchtitan compiles each transformer block on its own), and a graph break inside a
layer of ``torch.compile(model)`` (the layer's forward becomes a frame of its own), hand the backend graphs whose
module names are relative to the block (``attention.wq``), while policy rules are written against the whole
model's ``named_modules()`` (``layers.3.attention.wq``). The backend finds the block's place from its parameters,
which arrive in the graph as placeholders holding the real tensors: the full name of one of them in the model,
minus its block-relative name, is the prefix of every module of that graph (:func:`graph_place`). The model is
one registered with :func:`name_modules`, else the one whose call is running around the compile
(``mxfx.diagnostics.coverage.model_of``).

Dynamo compiles the code of identical blocks once and runs every block of that kind through the same graph
(its parameters are graph inputs); :func:`graph_place` also returns the places of those blocks, so that the
backend can compile a variant for the blocks the policy decides differently for (:mod:`mxfx.variants`).
Activation-checkpoint and ``torch.compile`` wrappers are left out of names (``mxfx.fx.strip_wrappers``).

The roots are held weakly and their parameters are looked up when a graph is compiled, so
parameters replaced after registration (FSDP2's ``fully_shard`` and its unsharded parameters
during forward, ``load_state_dict(assign=True)``) are still found.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch

from mxfx.fx import strip_wrappers

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


def roots() -> list[torch.nn.Module]:
    """The models registered with :func:`name_modules` that are alive."""
    return list(_roots)


@dataclass(frozen=True)
class Place:
    """Where a compiled graph sits in a model: ``root`` (the model, or None), the full-name ``prefix`` of the
    module the graph's names start from (``"layers.3."``, or ``""``), and ``shared``: the prefixes of the other
    modules of ``root`` that Dynamo may run through the same graph (``["layers.0.", "layers.1.", ...]``: the same
    module of each other block of the running block's class, :func:`_same_class`)."""

    root: torch.nn.Module | None = None
    prefix: str = ""
    shared: tuple[str, ...] = ()


def graph_place(params: dict[str, torch.Tensor], running: torch.nn.Module | None = None) -> Place:
    """The :class:`Place` of a graph whose parameter placeholders are ``params`` (graph-relative dotted name -> the
    real tensor): found in the registered roots, else in ``running`` (the model whose call is running around the
    compile, ``mxfx.diagnostics.coverage.model_of``), so that a graph cut out of a layer by a graph break, or a block
    compiled
    on its own inside the model, is named from the model. ``Place()`` (the graph's own names are the full names)
    when neither holds one of ``params``.
    """
    if not params:
        return Place()
    by_id = {id(t): rel for rel, t in params.items()}
    for root in [*_roots, *([running] if running is not None else [])]:
        for full, p in root.named_parameters(remove_duplicate=False):
            rel = by_id.get(id(p))
            full = strip_wrappers(full)
            if rel is not None and (full == rel or full.endswith("." + rel)):
                prefix = full[: len(full) - len(rel)]
                return Place(root, prefix, tuple(_same_class(root, prefix)))
    return Place()


def parameters_by_name(root: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of ``root`` by full name, wrappers left out (:func:`strip_wrappers`)."""
    return {strip_wrappers(full): p for full, p in root.named_parameters(remove_duplicate=False)}


def _same_class(root: torch.nn.Module, prefix: str) -> list[str]:
    """Prefixes of the other modules of ``root`` that Dynamo may run through the graph of the module named ``prefix``.
    The graph is code of the innermost module of ``root`` whose call is running around the compile and that holds
    that module (:func:`running_modules`): its forward, or a frame resumed in it, where the module is ``self`` or
    reached from it (the linear after a graph break, on the resumed frame's stack). Every other module of that
    running module's class runs the code, reaching the module at the same place in it: ``layers.1.mlp.`` for
    ``layers.0.mlp.`` under ``layers.0``; none for a module of the model's own forward. With no module of ``root``
    running, the module itself is taken as the running one."""
    if not prefix:
        return []
    modules: dict[str, torch.nn.Module] = {}
    for name, m in root.named_modules():
        modules[strip_wrappers(name)] = m  # the module a wrapper wraps comes after it: the innermost stays
    target = modules.get(prefix.rstrip("."))
    if target is None:
        return []
    running = {id(m) for m in running_modules()}
    holders = {strip_wrappers(n) for n, m in root.named_modules() if id(m) in running}
    holders = [n for n in holders if not n or prefix.startswith(n + ".")]
    frame = max(holders, key=len) if holders else prefix.rstrip(".")
    inner = prefix[len(frame) + 1 :] if frame else prefix  # the module's name inside the running one, with its dot
    out = []
    for n, m in modules.items():
        other = (n + "." + inner) if n else inner
        if n != frame and type(m) is type(modules[frame]) and type(modules.get(other.rstrip("."))) is type(target):
            out.append(other)
    return out


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
