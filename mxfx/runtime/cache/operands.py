"""The weight operand the GEMM ops read: the op ``mxfx::cached_weight`` over :func:`store.lookup`.

Compiled graphs call it opaquely (its fake implementation gives the form's shapes and strides, from the form's
family); its run-time body returns the cached form when it is fresh and rebuilds it when it is not.
"""

from __future__ import annotations

import torch

from mxfx import library
from mxfx.runtime.cache.forms import check, family_of
from mxfx.runtime.cache.store import lookup


def _fake(weight, rule, form):
    check(weight, rule, form)
    return list(family_of(form).fake(weight, form))


cached_weight = library.define(
    "mxfx::cached_weight",
    "(Tensor weight, str rule, str form) -> Tensor[]",
    lambda weight, rule, form: list(lookup(weight, rule, form)),
    _fake,
)
"""The op over :func:`store.lookup`, called for each weight operand of each GEMM (:mod:`mxfx.library`)."""


def weight_form(weight: torch.Tensor, rule: str, form: str) -> tuple[torch.Tensor, ...]:
    """A weight's cached form (the recipe, "Forward, Dgrad, and Wgrad Need Different Operands"): the tensors a GEMM
    reads of it for one orientation, e.g. an MXFP8 ``(qdata, scales)`` pair (:mod:`mxfx.runtime.cache.forms`).

    A torch op (``mxfx::cached_weight``, :mod:`mxfx.library`) with a fake implementation, so compiled graphs call
    it opaquely; its run-time body returns the cached form when the cache is fresh (same storage region, same
    ``weight._version``, same step for weights no optimizer holds), builds it when it is missing (a dgrad form
    after a refresh), and rebuilds the weight's forms when they are stale.

    Args:
        weight: the high-precision parameter (fp32 main weight, bf16 or fp16), ``[N, K]`` or ``[E, N, K]``, any
            strides.
        rule: a scale rule of the form's format (string value).
        form: a registered form name (the format modules document theirs).

    Returns:
        The cache's tensors themselves: treat them as read-only.

    Raises:
        ValueError: unknown form or rule, a weight that is not 2D/3D, not a float of 16+ bits, or whose dims the
            form's blocks cannot tile.
    """
    with torch.no_grad():
        return tuple(cached_weight(weight, rule, form))
