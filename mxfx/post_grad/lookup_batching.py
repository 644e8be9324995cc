"""One weight-cache lookup call per compiled graph: Inductor's post-grad graph gets ``mxfx::cached_weights``.

Each GEMM op looks its weight's cached form up through ``mxfx::cached_weight``, a host call in the compiled graph:
48 calls a microbatch at OLMoE's 4 layers (forward and dgrad forms), each a dispatch of its own. The lookups of a
graph read only its inputs (the parameters, or in a backward graph the parameters it was given), so they can run
together: :func:`run` replaces the lookups of forward-side forms of a graph's inputs by
``mxfx::cached_weights`` calls, one per round of distinct lookups holding at most one form per weight (usually one
call a graph), whose flat outputs the old lookups' readers take. Left where they are: the lookups of dgrad-side
forms (a step may build those at their lookup, one backward GEMM at a time, docs/caches.md: batched,
every dgrad copy of the graph would be built and live at once) and of anything but a graph input (a weight
computed in the graph, e.g. an unsharded parameter gathered inside it).

Why it keeps results: a lookup's result depends on the weight's values and version counter only, and in Inductor's
functional graph an input is not written before the graph's end (writes to inputs are applied after it), so a
lookup of an input returns the same forms at any point of the graph. The pass runs on Inductor's post-grad graphs
(:mod:`mxfx.post_grad`).

``MXFX_BATCH_LOOKUPS=0`` leaves the lookups one call each (for timing one form against the other).
"""

from __future__ import annotations

import operator

import torch.fx as fx

from mxfx.runtime.cache.forms import dgrad_side
from mxfx.runtime.cache.operands import cached_weight, cached_weights

ENV = "MXFX_BATCH_LOOKUPS"


def _lookups(graph: fx.Graph) -> list[fx.Node]:
    """The lookups of forward-side forms of graph inputs whose every reader takes one of its outputs by index."""
    return [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and n.target is cached_weight
        and len(n.args) == 3
        and not n.kwargs
        and isinstance(n.args[0], fx.Node)
        and n.args[0].op == "placeholder"
        and isinstance(n.args[2], str)
        and not dgrad_side(n.args[2])
        and isinstance(n.meta.get("val"), (list, tuple))
        and all(u.op == "call_function" and u.target is operator.getitem for u in n.users)
    ]


def _rounds(lookups: list[fx.Node]) -> tuple[list[list[fx.Node]], dict[fx.Node, fx.Node]]:
    """The distinct lookups in rounds holding at most one form per weight (two forms of one weight may share a
    tensor, e.g. fp8_block's forward and dgrad scales, and one op's outputs must not alias each other), and each
    repeated lookup (same weight, rule and form) mapped to its first."""
    first: dict[tuple, fx.Node] = {}
    repeats: dict[fx.Node, fx.Node] = {}
    rounds: list[list[fx.Node]] = []
    for n in lookups:
        key = tuple(n.args)
        if key in first:
            repeats[n] = first[key]
            continue
        first[key] = n
        slot = next((r for r in rounds if all(m.args[0] is not n.args[0] for m in r)), None)
        if slot is None:
            rounds.append(slot := [])
        slot.append(n)
    return rounds, repeats


def _retarget(graph: fx.Graph, lookup: fx.Node, source: fx.Node, offset: int) -> None:
    """Point every reader of ``lookup``'s output i at ``source``'s output ``offset + i``; erase ``lookup``."""
    for user in list(lookup.users):
        with graph.inserting_before(user):
            taken = graph.call_function(operator.getitem, (source, offset + user.args[1]))
        taken.meta.update(user.meta)
        user.replace_all_uses_with(taken)
        graph.erase_node(user)
    graph.erase_node(lookup)


def run(graph: fx.Graph) -> int:
    """Replace the lookups of ``graph``'s inputs by ``mxfx::cached_weights`` calls (module docstring): one per round
    of :func:`_rounds` with two lookups or more, placed at its first; a repeated lookup reads its first's outputs.
    Returns how many lookup calls it removed."""
    rounds, repeats = _rounds(_lookups(graph))
    where: dict[fx.Node, tuple[fx.Node, int]] = {}  # a distinct lookup -> (the node that now gives it, offset)
    removed = 0
    for lookups in rounds:
        if len(lookups) < 2:
            where[lookups[0]] = (lookups[0], 0)
            continue
        with graph.inserting_before(lookups[0]):
            batched = graph.call_function(cached_weights, tuple([n.args[i] for n in lookups] for i in range(3)))
        batched.meta["val"] = [t for n in lookups for t in n.meta["val"]]
        offset = 0
        for n in lookups:
            where[n] = (batched, offset)
            offset += len(n.meta["val"])
        removed += len(lookups) - 1
    for n, first in repeats.items():
        source, offset = where[first]
        _retarget(graph, n, source, offset)
        removed += 1
    for lookups in rounds:
        if len(lookups) >= 2:
            for n in lookups:
                _retarget(graph, n, *where[n])
    return removed
