"""Forms gathered by FSDP2 (:mod:`mxfx.fsdp`): installed as a weight's cache forms for one step."""

from __future__ import annotations

import torch
import weakref

from mxfx.numerics.layout import to_blocked
from mxfx.runtime.cache.forms import _E4M3, BLOCK_FORMS, _fake_form, blocked_scales, source_layout
from mxfx.runtime.cache.store import _check, _entry_for, state


def step_count() -> int:
    """The global optimizer step count (advanced by every optimizer step and by :func:`refresh` on shards)."""
    return state.step


def install_forms(weight: torch.Tensor, rule: str, pairs: dict) -> None:
    """Make ``pairs`` the cache forms of ``weight`` (``[N, K]`` or ``[E, N, K]``) for this step.

    ``pairs``: form -> ``(qdata e4m3, scales)``, any strides. MX forms (uint8 E8M0 scales): forward
    ``[..., N, K]`` / ``[..., N, K/32]``, dgrad ``[..., K, N]`` / ``[..., K, N/32]``; fp8_block forms
    (:data:`BLOCK_FORMS`, float32 scales): ``block_forward`` ``[..., N, K]`` / ``[..., N/128, K/128]``,
    ``block_dgrad`` their transposes. For forms gathered by FSDP2 (:mod:`mxfx.fsdp`): they are copied
    into the layouts the GEMM ops read (:func:`_fake_form`, blocked scales where :func:`blocked_scales`;
    contiguous for fp8_block) and stamped fresh for the current step; forms installed earlier in the
    same step (the forward form, when the backward's gather brings the dgrad form) are kept.
    """
    with state.lock, torch.no_grad():
        entry = _entry_for(weight, create=True)
        entry.weight = weakref.ref(weight)
        if entry.step != state.step or entry.source_layout != source_layout(weight):
            entry.forms.clear()
        for orientation, (q, s) in pairs.items():
            _check(weight, rule, orientation)
            if orientation in BLOCK_FORMS:
                entry.forms[(rule, orientation)] = tuple(t.clone(memory_format=torch.contiguous_format) for t in (q, s))
                continue
            qd = _fake_form(weight, orientation, _E4M3).copy_(q)
            if blocked_scales(weight):
                sc = to_blocked(s)
            else:
                sc = _fake_form(weight, orientation, torch.uint8, scales=True).copy_(s)
            entry.forms[(rule, orientation)] = (qd, sc)
        entry.source_layout = source_layout(weight)
        entry.version, entry.step, entry.gathered = weight._version, state.step, True
        state.stats["installed"] += len(pairs)
