"""Form families: what the weight cache asks of a format to build, lay out and check a weight's cached forms.

A form is one derived representation of a high-precision weight ``[N, K]`` or ``[E, N, K]`` (the FP32 main
weight): a tuple of tensors, e.g. an MXFP8 ``(qdata, scales)`` pair blocked for the forward GEMM, or its
BF16 values. Each format registers one :class:`FormFamily` naming its forms (names are unique across
families) and the functions that make them (:mod:`mxfx.formats.mxfp8`, :mod:`mxfx.formats.fp8_block`).

Nothing here knows about entries or freshness (:mod:`mxfx.runtime.cache.store`) nor about any format's
layout: these functions route a request to the family that owns the form. Builders count their
quantizations in :data:`counts`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

counts: Counter = Counter()
"""The cache's counters (:func:`mxfx.runtime.cache.inspect.stats`): the family builders count quantizations,
the lookups of :mod:`mxfx.runtime.cache.store` count hits and rebuilds in the same object."""


@dataclass(frozen=True)
class FormFamily:
    """One format's weight forms.

    Attributes:
        name: the format's name (what :func:`mxfx.runtime.cache.cached_formats` reports).
        forms: form names this family builds; ``dgrad_side``: those only a backward reads (a refresh drops
            them and their first lookup builds them, :func:`mxfx.runtime.cache.set_dgrad_at_refresh`).
        rules: scale rules (string values) its forms take.
        build: ``(weight, rule, forms, have) -> {(rule, form): tuple of tensors}``: the forms ``forms`` of
            ``weight``, reusing forms in ``have`` (same keys) where that is cheaper; counts in :data:`counts`.
        fake: ``(weight, form) -> tuple of tensors``: empty tensors with the shapes, dtypes and strides the
            form has (the fake implementation of the cache op).
        install: ``(weight, form, qdata, scales) -> tuple``: a pair gathered by FSDP2, in the form's layout.
        layout: ``(weight) -> hashable``: the layout the forms of ``weight`` are built in on its device (the
            cache rebuilds a weight whose layout changed).
        check: ``(weight, form) -> None``: raise ValueError naming the shape when the family cannot build it.
    """

    name: str
    forms: tuple[str, ...]
    dgrad_side: frozenset
    rules: tuple[str, ...]
    build: Callable[..., dict]
    fake: Callable[..., tuple]
    install: Callable[..., tuple]
    layout: Callable[[torch.Tensor], object]
    check: Callable[[torch.Tensor, str], None]


_families: dict[str, FormFamily] = {}  # form name -> the family that builds it
_registered: list[FormFamily] = []  # each family once, in registration order (every lookup reads their layouts)


def register(family: FormFamily) -> FormFamily:
    """Make ``family``'s forms buildable by the cache; returns it.

    Raises:
        ValueError: a form name another family already registered.
    """
    taken = [f for f in family.forms if f in _families]
    if taken:
        raise ValueError(f"mxfx.runtime.cache: forms {taken} of {family.name} are already registered")
    for f in family.forms:
        _families[f] = family
    _registered.append(family)
    return family


def all_forms() -> tuple[str, ...]:
    """Every registered form name."""
    return tuple(_families)


def family_of(form: str) -> FormFamily:
    """The family that builds ``form``.

    Raises:
        ValueError: an unknown form, listing the registered ones.
    """
    family = _families.get(form)
    if family is None:
        raise ValueError(f"mxfx.runtime.cache: form={form!r} is not valid; choose one of {all_forms()}")
    return family


def check(weight: torch.Tensor, rule: str, form: str) -> None:
    """Raise ValueError unless ``form`` of ``weight`` with scale rule ``rule`` can be built (naming what fails)."""
    family = family_of(form)
    if rule not in family.rules:
        raise ValueError(f"mxfx.runtime.cache: rule={rule!r} is not valid for {form!r}; choose one of {family.rules}")
    if weight.dim() not in (2, 3):
        raise ValueError(f"mxfx.runtime.cache: weight of shape {tuple(weight.shape)} must be [N, K] or [E, N, K]")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"mxfx.runtime.cache: weight dtype {weight.dtype} is not a high-precision float (fp32/bf16/fp16)"
        )
    family.check(weight, form)


def build(weight: torch.Tensor, rule: str, forms, have: dict | None = None) -> dict:
    """Forms ``forms`` of one rule, keyed ``(rule, form)``, each built by its family (from ``have`` where it can)."""
    out, have = {}, have or {}
    for family in {id(f): f for f in map(family_of, forms)}.values():
        out.update(family.build(weight, rule, [f for f in forms if f in family.forms], have))
    return out


def layout_key(weight: torch.Tensor) -> tuple:
    """The layouts every family builds ``weight``'s forms in now (a change means the cached forms are stale)."""
    return tuple(f.layout(weight) for f in _registered)


def dgrad_side(form: str) -> bool:
    """Whether only a backward reads ``form``."""
    return form in family_of(form).dgrad_side
