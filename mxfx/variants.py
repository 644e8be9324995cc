"""One compiled graph per policy decision when several blocks of a model run through one Dynamo graph.

Dynamo compiles the code of identical blocks once and runs every block of that kind through the graph, their
parameters being graph inputs: under per-block compile (``torch.compile(block)``), and under a whole-model compile
whose forward a graph break cuts inside a layer (each layer's call is then a frame of the same code). A policy
rule naming one of those blocks (``layers.0.*``) decides differently for it than for the others, and the one
graph, named after the block compiled first, would run that block's decisions for all of them.

:func:`groups` sorts the blocks sharing a graph by the decisions the policy makes for the graph's ops under each
block's names; the backend rewrites and compiles the graph once per group, named from the group's first block,
and :func:`by_place` returns the callable Dynamo runs: it picks the variant of the block whose parameter a call
passes (by identity, looked up in the model when first seen). Blocks the policy decides alike share a variant,
so a policy without per-block rules compiles each graph once, as before.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
import weakref
from typing import Callable

import torch

from mxfx.names import Place, parameters_by_name
from mxfx.policy import OP_KINDS, Policy


def _decisions(policy: Policy, modules: list[str], prefix: str) -> tuple:
    """What ``policy`` decides for every op kind in each of ``modules`` (graph-relative names) named behind
    ``prefix``; statistics sites compared by whether they are on (their names are the modules' own)."""
    out = []
    for module in modules:
        full = (prefix + module).rstrip(".")
        for kind in OP_KINDS:
            try:
                d = policy.decide(kind, full)
            except ValueError as e:  # raised again, for an op that exists, when the graph is rewritten
                out.append(str(e))
                continue
            out.append(dataclasses.replace(d, stats=bool(d.stats)))
    return tuple(out)


def groups(policy: Policy, modules: set[str], place: Place) -> list[list[str]]:
    """The prefixes of ``place`` (its own, then the blocks sharing its graph) grouped by equal decisions of
    ``policy`` for a graph with the graph-relative module names ``modules``; ``place``'s own group first."""
    listed = sorted(modules)
    by_key: dict[tuple, list[str]] = {}
    for prefix in (place.prefix, *place.shared):
        by_key.setdefault(_decisions(policy, listed, prefix), []).append(prefix)
    return list(by_key.values())


def graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of Dynamo's graph module ``gm`` that a pass may rewrite on its own: graph and subgraphs copied, node
    metadata shared, and the attributes Dynamo sets on the graph module and its placeholders kept
    (``_param_name_to_source``, ``_dynamo_source``: by them AOTAutograd tells parameters from activations, which
    decides, e.g., whether an op that reads only weights runs in the forward or the backward)."""
    new = copy.deepcopy(gm)
    for key, value in gm.__dict__.items():
        new.__dict__.setdefault(key, value)
    placeholders = lambda g: [n for n in g.graph.nodes if n.op == "placeholder"]  # noqa: E731
    for old, copied in zip(placeholders(gm), placeholders(new), strict=True):
        if hasattr(old, "_dynamo_source"):
            copied._dynamo_source = old._dynamo_source
    return new


def by_place(root: torch.nn.Module, index: int, name: str, variants: dict[str, Callable]) -> Callable:
    """The compiled callable for a graph whose argument ``index`` is the parameter named ``name`` (graph-relative)
    of the block it runs: ``variants`` maps each block's prefix to the compiled variant of its group, the first
    entry being the block the graph was compiled for. A call runs the variant of the block whose parameter it
    passes; a parameter of no listed block (the model changed since) runs the first variant, with a warning."""
    root_ref = weakref.ref(root)
    default = next(iter(variants.values()))
    known: dict[int, tuple[weakref.ref, Callable]] = {}  # id(parameter) -> (the parameter, its variant)
    warned = []

    def refresh() -> None:
        model = root_ref()
        held = parameters_by_name(model) if model is not None else {}
        known.clear()
        for prefix, fn in variants.items():
            p = held.get(prefix + name)
            if p is not None:
                known[id(p)] = (weakref.ref(p), fn)

    def pick(t: torch.Tensor) -> Callable:
        hit = known.get(id(t))
        if hit is None or hit[0]() is not t:
            refresh()
            hit = known.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        if not warned:
            warned.append(True)
            first = next(iter(variants)).rstrip(".")
            warnings.warn(
                f"mxfx: a graph compiled for {first} and the blocks of its kind ran with a parameter "
                f"{name!r} of none of them; it runs {first}'s decisions",
                stacklevel=3,
            )
        return default

    def run(*args):  # Dynamo calls a backend's result with the graph's inputs as arguments
        return pick(args[index])(*args)

    refresh()
    return run
