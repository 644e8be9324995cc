"""Refresh inside a compiled optimizer step (:mod:`mxfx.passes.weight_refresh`), and the Inductor lowering
of the cache ops.

A ``torch.compile(opt.step, backend="mxfp8")`` graph calls ``mxfx::refresh_weight_caches`` with the updated
parameter values; :func:`after_step` stamps the rebuilt entries fresh once the graph returned.
"""

from __future__ import annotations

import weakref

import torch

from mxfx.runtime.cache import operands  # noqa: F401  (registers the mxfx::cached_weight(s) ops lowered here)
from mxfx.runtime.cache.store import _entries_on, _key, _rebuild, _region, state


def new_plan(params) -> int:
    """Register the parameters a compiled optimizer step updates; returns the plan id its refresh op carries."""
    with state.lock:
        plan = len(state.plans)
        state.plans[plan] = [weakref.ref(p) for p in params]
        return plan


@torch.library.custom_op("mxfx::refresh_weight_caches", mutates_args=())
def _refresh_weight_caches(plan: int, values: list[torch.Tensor]) -> torch.Tensor:
    """Rebuild the caches of the plan's parameters from their updated ``values`` (same order).

    Which parameters have caches is resolved here, at run time: the step may be
    compiled before the model. Returns an empty token tensor (the op is ordered
    by an effect token so it is never dead-code eliminated).
    """
    params = state.plans.get(plan)
    if params is None:
        raise RuntimeError(f"mxfx.runtime.cache: unknown refresh plan {plan}")
    if len(params) != len(values):
        raise RuntimeError(
            f"mxfx.runtime.cache: refresh plan {plan} has {len(params)} parameters, got {len(values)} values"
        )
    n = 0
    with state.lock, torch.no_grad():
        for ref, value in zip(params, values):
            p = ref()
            if p is None:
                continue
            for entry in _entries_on(p):
                if not (entry.forms or entry.dropped):
                    continue
                w = _region(entry, p, value)
                if w is None:  # layout we cannot map: leave it to the version check
                    entry.version = None
                    continue
                _rebuild(entry, w)
                entry.version = None  # stamped by stamp_pending() once the parameter holds ``value``
                state.pending.append((entry, p))
                n += 1
    state.stats["refresh_graph"] += n
    return values[0].new_empty(0) if values else torch.empty(0)


@_refresh_weight_caches.register_fake
def _(plan, values):
    return values[0].new_empty(0) if values else torch.empty(0)


def _register_effect() -> None:
    from torch._library.effects import EffectType

    _refresh_weight_caches.register_effect(EffectType.ORDERED)


_register_effect()


def stamp_pending() -> None:
    """After a compiled step returned (its parameters now hold the new values): mark in-graph rebuilds fresh."""
    with state.lock:
        for entry, p in state.pending:
            w = entry.weight()
            if w is not None and _key(w) == (entry.storage.cdata, entry.offset, entry.shape, entry.stride, entry.dtype):
                entry.version = w._version
            elif entry.shape == tuple(p.shape) and entry.offset == p.storage_offset():
                entry.version = p._version
            else:
                continue
            entry.graph_refreshed = True
        state.pending.clear()


def after_step(compiled):
    """Wrap a compiled optimizer-step graph so in-graph rebuilds are stamped fresh when it returns."""

    def run(*args):
        out = compiled(*args)
        stamp_pending()
        return out

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run


# --- Inductor ---------------------------------------------------------------------------------


def _register_inductor_lowerings() -> None:
    """The cache pair is owned by this module: Inductor must never reuse or write into its buffers."""
    try:
        from torch._inductor.lowering import fallback_handler, lowerings, register_lowering
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - inductor unavailable
        return
    for op in (torch.ops.mxfx.cached_weight.default, torch.ops.mxfx.cached_weights.default):
        if op in lowerings:
            continue
        fallback = fallback_handler(op, add_to_fallback_set=False)

        def _lower(*args, _fallback=fallback):
            outs = _fallback(*args)
            for t in outs if isinstance(outs, (list, tuple)) else (outs,):
                V.graph.never_reuse_buffers.add(t.get_name())
            return outs

        register_lowering(op, type_promotion_kind=None)(_lower)
