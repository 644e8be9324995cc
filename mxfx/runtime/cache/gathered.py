"""Forms gathered by FSDP2 (:mod:`mxfx.fsdp`): installed as a weight's cache forms for one step."""

from __future__ import annotations

import torch
import weakref

from mxfx.runtime.cache.forms import check, family_of, layout_key
from mxfx.runtime.cache.store import _entry_for, state


def step_count() -> int:
    """The global optimizer step count (advanced by every optimizer step and by :func:`refresh` on shards)."""
    return state.step


def install_forms(weight: torch.Tensor, rule: str, pairs: dict) -> None:
    """Make ``pairs`` the cache forms of ``weight`` (``[N, K]`` or ``[E, N, K]``) for this step.

    ``pairs``: form -> ``(qdata e4m3, scales)``, any strides, in the orientation of the form (the format modules
    document theirs). For forms gathered by FSDP2 (:mod:`mxfx.fsdp`): each is copied into the layout the GEMM
    reads (its family's ``install``) and stamped fresh for the current step; forms installed earlier in the
    same step (the forward form, when the backward's gather brings the dgrad form) are kept.
    """
    with state.lock, torch.no_grad():
        entry = _entry_for(weight, create=True)
        entry.weight = weakref.ref(weight)
        if entry.step != state.step or entry.source_layout != layout_key(weight):
            entry.forms.clear()
        for form, (q, s) in pairs.items():
            check(weight, rule, form)
            entry.forms[(rule, form)] = family_of(form).install(weight, form, q, s)
        entry.source_layout = layout_key(weight)
        entry.version, entry.step, entry.gathered = weight._version, state.step, True
        state.stats["installed"] += len(pairs)
