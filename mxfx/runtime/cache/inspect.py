"""Inspection: counters (:func:`stats`), the memory the caches hold (:func:`persistent_bytes`), :func:`clear`."""

from __future__ import annotations

import torch

from mxfx.runtime.cache.store import _key, state


def stats() -> dict:
    """Counters since the last :func:`reset_stats`.

    Keys: ``quantize`` (orientations quantized, all paths), ``quantize_forward``,
    ``quantize_dgrad``, ``hit`` (lookups served from the cache), ``stale``
    (lookups that found no fresh caches, a weight's first lookup included, and rebuilt), ``refresh`` (weights
    rebuilt by :func:`refresh`), ``refresh_eager`` (by the optimizer hook),
    ``refresh_graph`` (inside compiled optimizer steps), ``quantize_block`` (128x128 quantizes of
    fp8_block weights, each serving both orientations), ``quantize_bf16`` (BF16 casts of bf16_gemm weights, each
    serving both orientations), ``deferred_dgrad`` (stale dgrad-side forms a
    rebuild dropped for their next lookup to build, :func:`set_dgrad_at_refresh`), ``transient_dgrad``
    (dgrad-side forms built for one GEMM and not kept, the forward forms dropped with them: one microbatch
    per step so far), ``stale_after_step`` (weights an optimizer step held without a gradient, so that it
    could not prove them fresh: marked stale by its hook and rebuilt at their next lookup, counted there as
    ``stale`` too).
    """
    keys = (
        "quantize",
        "quantize_forward",
        "quantize_dgrad",
        "quantize_block",
        "quantize_bf16",
        "hit",
        "stale",
        "refresh",
        "refresh_eager",
        "refresh_graph",
        "deferred_dgrad",
        "transient_dgrad",
        "stale_after_step",
    )
    return {k: state.stats.get(k, 0) for k in keys}


def reset_stats() -> None:
    state.stats.clear()


def persistent_bytes(weight: torch.Tensor | None = None) -> int:
    """Bytes held by weight caches: all of them, or those of ``weight`` (0 when it has none).

    With both MX forms of one rule, ``2 x 33/32`` bytes per weight value, ``33/32`` with the forward form
    alone (from a refresh to the next backward), none from a dgrad GEMM to the refresh with one microbatch
    per step (module docstring); fp8_block ``1 + 4/128**2`` bytes per value per form, its
    dgrad form the forward grid transposed into a second copy (plus, for MX, the blocked layout's
    padding of rows to 128 and scale columns to 4, where :func:`blocked_scales` holds); each
    dequantized form of ``keep_dequantized_weights`` holds 2 (where the GEMM is
    emulated, instead of the MX forms; elsewhere on top of them).
    """
    with state.lock:
        if weight is None:
            return sum(e.nbytes() for e in state.entries.values())
        entry = state.entries.get(_key(weight))
        return entry.nbytes() if entry is not None else 0


def num_entries() -> int:
    """How many weights currently have caches."""
    return len(state.entries)


def clear() -> None:
    """Drop every cache (they are rebuilt on next use)."""
    with state.lock:
        state.entries.clear()
        state.by_storage.clear()
        state.pending.clear()
