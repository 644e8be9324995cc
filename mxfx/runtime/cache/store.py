"""Cache entries: one per weight (storage region), their identity, their freshness and the lookup.

Freshness (the recipe, "Forward, Dgrad, and Wgrad Need Different Operands", "Autograd Must Carry qdata and Scales as One
Value", "DDP Must Be MXFP8-Aware": quantize once after each optimizer update, reuse across microbatches):

* **Identity.** An entry belongs to one storage region: the storage (held through
  :class:`~torch.multiprocessing.reductions.StorageWeakRef`, which pins the
  storage's address while the entry exists, so a freed-and-reallocated tensor can
  never hit a dead entry) plus offset, shape, stride and dtype. A ``weakref.finalize``
  on the storage drops the entries (and their memory) when the storage dies.
* **Staleness.** Every lookup compares the weight's ``_version`` with the version
  the caches were built at. The counter is shared by views and ``detach()`` and is
  bumped by in-place optimizer updates, ``load_state_dict``'s ``copy_``, in-place
  edits under ``no_grad`` and writes through views of a flat buffer; reading it is
  a host-side integer read (no device sync, no recompilation: it happens inside
  the opaque op :func:`weight_operand`). Writes through ``.data`` (or to a tensor
  made with ``p.data = other``) do not bump the weight's counter: call
  :func:`refresh` after them.
* **Refresh at the step boundary.** An eager ``optimizer.step()`` triggers a global
  step post-hook (:func:`install`) that rebuilds the caches on the storages of
  that optimizer's parameters that have a gradient; a ``torch.compile(opt.step, backend="mxfp8")``
  graph rebuilds them in-graph (:mod:`mxfx.passes.weight_refresh`). The caches of
  the optimizer's parameters without a gradient cannot be proven fresh (the step
  may have written them through a flat buffer their ``.data`` views, or through
  ``.data``): the hook marks them stale and their next lookup rebuilds them. Weights
  no stepping optimizer holds follow the step count (below). So after any optimizer
  step the next forward reads the weights as they are then, whoever wrote them and
  through whichever view; between steps the version check catches in-place writes
  to the weight itself, and :func:`refresh` the rest.
* **Dgrad forms at their use; nothing kept past its last use.** A refresh (and a lookup that
  finds the caches stale) rebuilds the forward-side forms and drops the stale dgrad-side ones
  (each family's ``dgrad_side`` forms), freeing their memory. The backward builds the dgrad forms from the same
  weight (fresh by the same checks). While each step has run one microbatch, a weight's first
  dgrad lookup of a step builds its dgrad form for that one GEMM and drops the forward forms too:
  the forward is done with them and the next refresh rebuilds them, so from its backward's dgrad
  GEMM to the refresh a weight holds no cache (a weight whose backward runs no dgrad GEMM, its
  input needing no gradient, keeps its forward forms). Once a step shows several microbatches (a
  second dgrad lookup, or a forward lookup after the backward dropped the forms: gradient
  accumulation, or an evaluation between a backward and its step), every form is kept from its
  first build of each step on and later microbatches reuse it: once per step again (that first
  step builds the forms twice). This switch is per weight and for the rest of the process
  (:func:`clear` resets it). A forward's peak memory then holds no dgrad form, and the backward's
  holds the forms of the layers it has not reached yet. The cost: where one pass writes both MX
  forms (the emulated GEMM's source layout) the weight is read twice per step instead of once;
  fp8_block's dgrad form is the forward form transposed, made before the forward form is dropped.
  :func:`set_dgrad_at_refresh` rebuilds both at the refresh and keeps them instead. Forms gathered
  by FSDP2 are never dropped.
* **Step count for weights no optimizer holds.** Every optimizer step also advances a
  global step count. An entry that no step hook has found through its optimizer's
  parameters (an FSDP2 unsharded parameter: the optimizer holds the sharded DTensor,
  and FSDP refills the unsharded storage at each unshard with its version counter
  preserved, so neither storage nor version says anything; a model weight that a
  wrapper writes after stepping FP32 copies in an inner optimizer) is stale once the count
  moved, and is rebuilt by its next lookup from the weight as it is then: once per
  step, reused across microbatches and the backward's re-gather.

The mutable state shared by the modules of this package lives in one object, :data:`state`
(``store.state.step``, ``store.state.entries``, ...).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from mxfx.runtime.cache.forms import build, check, counts, dgrad_side, family_of, layout_key

WEIGHT_KINDS = ("linear", "grouped_mm")
"""Precision-map kinds whose rewritten ops read weights through this cache."""


@dataclass(eq=False)
class _Entry:
    """The caches of one weight (one storage region)."""

    storage: StorageWeakRef
    offset: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    weight: weakref.ref  # the last tensor object seen for this region (for its version counter)
    version: int | None = None  # weight._version the forms were built at; None: stale
    forms: dict = field(default_factory=dict)  # (rule, orientation) -> (qdata, scales), or (bf16,) for DEQUANTIZED
    graph_refreshed: bool = False  # rebuilt by a compiled step since the last eager step hook
    source_layout: tuple | None = None  # forms.layout_key(weight) when the forms were built: their layouts follow it
    step: int = 0  # the global step count (state.step) when the forms were built
    owned: bool = False  # a step hook found it through its optimizer's parameters: refreshed there, ignores state.step
    gathered: bool = False  # forms installed from an FSDP2 MX all-gather (install_forms): never built from the weight
    dgrad_seen: set = field(default_factory=set)  # dgrad-side forms built unkept since the last rebuild
    dropped: set = field(default_factory=set)  # forward-side forms the backward dropped: the next rebuild makes them
    dgrad_kept: bool = False  # a step with several microbatches was seen: keep every form (_single_use)

    def nbytes(self) -> int:
        return sum(t.nbytes for form in self.forms.values() for t in form)


@dataclass(eq=False)
class _State:
    """Everything the cache modules share and change (one object, so every module sees reassignments)."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    stats: Counter = field(default_factory=lambda: counts)  # one Counter with the form builders' (forms.counts)
    entries: dict = field(default_factory=dict)  # _key(weight) -> _Entry
    by_storage: dict = field(default_factory=dict)  # storage cdata -> keys of its entries
    step: int = 0  # optimizer steps seen by the step hook, plus refresh() calls on sharded (DTensor) parameters
    dgrad_at_refresh: bool = False  # set_dgrad_at_refresh
    hook_handle: object = None  # the global optimizer step post-hook (mxfx.runtime.cache.refreshing.install)
    plans: dict = field(default_factory=dict)  # plan id -> weakrefs to the parameters a compiled step updates
    pending: list = field(default_factory=list)  # (entry, parameter) rebuilt in-graph, stamped after the graph returns


state = _State()


def _key(t: torch.Tensor) -> tuple:
    return (StorageWeakRef(t.untyped_storage()).cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _drop_storage(cdata: int) -> None:
    with state.lock:
        for key in state.by_storage.pop(cdata, ()):
            state.entries.pop(key, None)


def set_dgrad_at_refresh(enabled: bool) -> bool:
    """Choose when the dgrad-side forms (each family's ``dgrad_side`` forms) are rebuilt after a weight changed; returns
    the previous choice.

    ``False`` (the default): a refresh rebuilds the forward-side forms only and drops the stale dgrad-side
    ones; the backward builds them at their lookup, and with one microbatch per step drops every form of
    the weight there (module docstring), so a forward's peak memory holds no dgrad form and the backward's
    none of the layers it is done with. ``True``: a refresh rebuilds every form and keeps it, so each MX
    weight is read once per step (one pass writes both forms where the GEMM is emulated) instead of twice.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"mxfx.runtime.cache.set_dgrad_at_refresh: enabled={enabled!r} must be True or False")
    with state.lock:
        previous, state.dgrad_at_refresh = state.dgrad_at_refresh, enabled
    return previous


def dgrad_at_refresh() -> bool:
    """Whether a refresh rebuilds the dgrad-side forms too (:func:`set_dgrad_at_refresh`)."""
    return state.dgrad_at_refresh


def _rebuild(entry: _Entry, weight: torch.Tensor, extra: tuple | None = None) -> None:
    """Rebuild the forms of ``entry`` (plus ``extra`` = (rule, orientation)) from ``weight``: every form, or,
    unless :func:`set_dgrad_at_refresh`, the forward-side ones and ``extra``, the stale dgrad-side forms
    dropped (their next lookup builds them). Forms gathered by FSDP2 cannot be built later: all rebuilt."""
    wanted = set(entry.forms) | entry.dropped | ({extra} if extra else set())
    if not (state.dgrad_at_refresh or entry.gathered):
        deferred = {f for f in wanted if dgrad_side(f[1]) and f != extra}
        wanted -= deferred
        state.stats["deferred_dgrad"] += len(deferred)
    entry.forms.clear()  # free the stale forms before allocating the new ones
    entry.dgrad_seen.clear()
    entry.dropped.clear()
    entry.source_layout = layout_key(weight)
    for rule in sorted({r for r, _ in wanted}):
        entry.forms.update(build(weight, rule, [f for r, f in wanted if r == rule]))


def _single_use(entry: _Entry) -> bool:
    """Whether ``entry``'s forms are dropped at the backward's first dgrad lookup (module docstring): no
    :func:`set_dgrad_at_refresh`, not gathered by FSDP2, and no step with several microbatches seen."""
    return not (state.dgrad_at_refresh or entry.gathered or entry.dgrad_kept)


def _entry_for(weight: torch.Tensor, create: bool) -> _Entry | None:
    key = _key(weight)
    entry = state.entries.get(key)
    if entry is not None and entry.storage.expired():  # cannot happen while the finalizer runs; belt and braces
        _drop_storage(key[0])
        entry = None
    if entry is None and create:
        storage = weight.untyped_storage()
        ref = StorageWeakRef(storage)
        entry = _Entry(
            ref, weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()), weight.dtype, weakref.ref(weight)
        )
        state.entries[key] = entry
        if key[0] not in state.by_storage:
            state.by_storage[key[0]] = set()
            weakref.finalize(storage, _drop_storage, key[0])
        state.by_storage[key[0]].add(key)
    return entry


def lookup(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager body of :func:`weight_operand`: the cached pair, rebuilt first if stale. See there.

    Raises:
        RuntimeError: called while a CUDA graph is being captured (a replay would skip this freshness check).
    """
    check(weight, rule, orientation)
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"mxfx.runtime.cache: a weight {tuple(weight.shape)} is looked up while a CUDA graph is being captured; "
            f"a replay would skip the freshness check and reuse caches of the step it was captured in. "
            f"Run the mxfp8 backend outside CUDA graphs (torchtitan: --training.disable_cuda_graphs)"
        )
    with state.lock:
        entry = _entry_for(weight, create=True)
        entry.weight = weakref.ref(weight)
        form = (rule, orientation)
        if entry.gathered and (form not in entry.forms or entry.step != state.step):
            raise RuntimeError(
                f"mxfx.runtime.cache: the {orientation!r} form of a weight {tuple(weight.shape)} gathered as MX forms "
                f"by FSDP2 (mxfx.fsdp.mx_all_gather) was not gathered since the last optimizer step; its unsharded "
                f"values cannot rebuild it exactly. Keep this weight out of mx_all_gather "
                f"(and Policy.keep_dequantized_weights is not supported with it)"
            )
        if (
            entry.version != weight._version
            or entry.source_layout != layout_key(weight)
            or (not entry.owned and entry.step != state.step)
        ):
            _rebuild(entry, weight, form)
            entry.version, entry.step = weight._version, state.step
            state.stats["stale"] += 1
        elif form not in entry.forms:
            built = build(weight, rule, [orientation], have=entry.forms)
            if _single_use(entry):
                if dgrad_side(orientation) and form not in entry.dgrad_seen:
                    # the step's first backward: the dgrad form serves this GEMM alone, and the forward is
                    # done with the forward forms (the next refresh rebuilds them)
                    entry.dgrad_seen.add(form)
                    state.stats["transient_dgrad"] += 1
                    for f in [f for f in entry.forms if not dgrad_side(f[1])]:
                        del entry.forms[f]
                        entry.dropped.add(f)
                    return built[form]
                if entry.dgrad_seen:  # a second backward, or a forward after one: several microbatches
                    entry.dgrad_kept = True
            entry.forms.update(built)
        else:
            state.stats["hit"] += 1
        return entry.forms[form]


def entry_forms(weight: torch.Tensor) -> dict:
    """The forms cached for ``weight``'s storage region now, keyed ``(rule, form)`` (empty when none): the cache
    tensors themselves, as they are, without a freshness check. For inspection and tests; treat as read-only."""
    with state.lock:
        entry = _entry_for(weight, create=False)
        return dict(entry.forms) if entry is not None else {}


def cached_formats(weights) -> set[str]:
    """The formats ("mxfp8", "fp8_block") of the forms cached now for any of ``weights`` (empty when none): what a
    rebuild of their caches produces. Dequantized BF16 forms count as "mxfp8" (they hold MX values)."""
    with state.lock:
        entries = [_entry_for(w, create=False) for w in weights]
        return {family_of(form).name for e in entries if e is not None for _, form in e.forms}


def _entries_on(t: torch.Tensor) -> list[_Entry]:
    """Entries whose storage is ``t``'s (a parameter or the flat buffer its weights view)."""
    keys = state.by_storage.get(StorageWeakRef(t.untyped_storage()).cdata, ())
    return [state.entries[k] for k in keys if k in state.entries]


def _inside(entry: _Entry, t: torch.Tensor) -> bool:
    """True when ``entry``'s region lies inside contiguous ``t``'s storage span, same dtype."""
    if entry.dtype != t.dtype or not t.is_contiguous():
        return False
    lo = entry.offset
    hi = entry.offset + sum((n - 1) * s for n, s in zip(entry.shape, entry.stride))
    return t.storage_offset() <= lo and hi < t.storage_offset() + t.numel()


def _region(entry: _Entry, source: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """The entry's weight read out of ``values``, a contiguous tensor laid out like contiguous ``source``."""
    if (
        not _inside(entry, source)
        or values.dtype != entry.dtype
        or not values.is_contiguous()
        or values.shape != source.shape
    ):
        return None
    return values.as_strided(
        entry.shape, entry.stride, values.storage_offset() + entry.offset - source.storage_offset()
    )
