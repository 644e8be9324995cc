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


def _check_lists(weights, rules, forms) -> None:
    if not (len(weights) == len(rules) == len(forms)) or not weights:
        raise ValueError(
            f"mxfx::cached_weights: takes one rule and one form per weight, at least one weight; got "
            f"{len(weights)} weights, {len(rules)} rules and {len(forms)} forms"
        )


def _lookups(weights, rules, forms):
    _check_lists(weights, rules, forms)
    return [t for w, r, f in zip(weights, rules, forms) for t in lookup(w, r, f)]


def _fakes(weights, rules, forms):
    _check_lists(weights, rules, forms)
    return [t for w, r, f in zip(weights, rules, forms) for t in _fake(w, r, f)]


cached_weights = library.define(
    "mxfx::cached_weights",
    "(Tensor[] weights, str[] rules, str[] forms) -> Tensor[]",
    _lookups,
    _fakes,
)
"""``mxfx::cached_weight`` of several weights in one call: the forms of ``weights[i]`` (rule ``rules[i]``, form
``forms[i]``) one after another in a flat list, each as that op returns it. One dispatch for all of a graph's
lookups (:mod:`mxfx.post_grad.lookup_batching`).

Raises:
    ValueError: lists of different lengths or empty, or what ``mxfx::cached_weight`` raises for one weight."""


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
