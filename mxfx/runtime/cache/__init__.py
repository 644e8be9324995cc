"""MXFP8 weight caches: the forward and dgrad operands derived from one high-precision weight.

The parameter (FP32 main weight, or BF16) is the only source of truth (the recipe,
"DDP Must Be MXFP8-Aware": derived representations of the FP32 main weight). Each MX weight has
up to two derived forms, each a ``(qdata e4m3, scales uint8 E8M0)`` pair:

* ``"forward"``: ``W [..., N, K]`` blocked along its last dim (K);
* ``"dgrad"``: ``W.transpose(-2, -1) [..., K, N]`` blocked along its last dim (N),
  quantized from W itself (``docs/format.md``, "GEMM operand orientation"). Where the
  GEMM is emulated (Hopper, CPU) it is stored in W's own layout (a transpose view,
  :func:`source_layout`), so one non-transposing pass writes both forms.

Where the dense GEMM runs natively (Blackwell), a 2D weight's scales are kept in the
blocked layout that GEMM reads (:func:`blocked_scales`), written by the refresh pass
itself, so no GEMM call blocks them again.

``[N, K]`` linear weights and ``[E, N, K]`` expert weights use the same rule. The
caches are plain tensors held here, never parameters: no gradients, not in
``state_dict``, invisible to the optimizer. A form is keyed by ``(rule,
orientation)``. Two more orientations hold the *dequantized* operands in BF16,
``"forward_bf16"`` and ``"dgrad_bf16"`` (the values of the MX forms, one tensor
each), for ``Policy.keep_dequantized_weights`` on GPUs without native MX GEMMs:
2 bytes per value per orientation of persistent memory, no weight dequantize
per GEMM. Where the GEMM is emulated they replace the MX forms (written straight
from the weight in one pass, :func:`weight_operands`); they are rebuilt by the
same freshness logic.

Freshness (the recipe, "Forward, Dgrad, and Wgrad Need Different Operands", "Autograd Must Carry qdata and Scales as One Value", "DDP Must Be MXFP8-Aware": quantize once after each optimizer update, reuse
across microbatches):

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
  that optimizer's parameters; a ``torch.compile(opt.step, backend="mxfp8")``
  graph rebuilds them in-graph (:mod:`mxfx.passes.weight_refresh`). Either way a
  forward never uses a stale cache: the version check catches every other path.
* **Dgrad forms at their use; nothing kept past its last use.** A refresh (and a lookup that
  finds the caches stale) rebuilds the forward-side forms and drops the stale dgrad-side ones
  (:data:`DGRAD_SIDE`), freeing their memory. The backward builds the dgrad forms from the same
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
  preserved, so neither storage nor version says anything) is stale once the count
  moved, and is rebuilt by its next lookup from the freshly gathered weight: once per
  step, reused across microbatches and the backward's re-gather.

Counters: :func:`stats` (quantizations per orientation, hits, refreshes) and
:func:`persistent_bytes` (``2 x 33/32`` bytes per value with both forms, half that between a refresh and
the next backward, plus the blocked layout's padding where scales are kept blocked).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from mxfx import kernels
from mxfx.numerics.block import SCALE_RULES as BLOCK_SCALE_RULES
from mxfx.numerics.mx import BLOCK_SIZE, SCALE_RULES
from mxfx.kernels import block_device_path
from mxfx.kernels.views import mn_major
from mxfx.kernels.device import colwise_in_source_layout
from mxfx.numerics.layout import blocked_numel, from_blocked, is_blocked, to_blocked

WEIGHT_KINDS = ("linear", "grouped_mm")
"""Precision-map kinds whose rewritten ops read weights through this cache."""

ORIENTATIONS = ("forward", "dgrad")
"""Derived forms of a weight: "forward" (W blocked along its last dim) and "dgrad" (W^T likewise)."""

DEQUANTIZED = {"forward_bf16": "forward", "dgrad_bf16": "dgrad"}
"""Dequantized BF16 forms -> the MX orientation whose values they hold."""

BLOCK_FORMS = {"block_forward": "forward", "block_dgrad": "dgrad"}
"""fp8_block forms -> the GEMM orientation they serve. One 128x128 grid of W (``mxfx.numerics.block``) serves
both: "block_forward" is ``(qdata [..., N, K], scales [..., N/128, K/128])``, "block_dgrad" the same qdata
and scales transposed (``[..., K, N]`` contiguous, ``[..., K/128, N/128]``): a 128x128 block has no
orientation, so the dgrad copy is W's forward grid read as W^T, quantized once."""

FORMS = ORIENTATIONS + tuple(DEQUANTIZED) + tuple(BLOCK_FORMS)

DGRAD_SIDE = ("dgrad", "dgrad_bf16", "block_dgrad")
"""Forms only a backward reads: a refresh drops them, their first lookup after it builds them
(:func:`set_dgrad_at_refresh`)."""

_E4M3 = torch.float8_e4m3fn
_lock = threading.RLock()
_stats: Counter = Counter()
_dgrad_at_refresh = False  # set_dgrad_at_refresh


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
    source_layout: bool | None = None  # source_layout(weight) when the forms were built: their layouts follow it
    step: int = 0  # the global step count (_step) when the forms were built
    owned: bool = False  # a step hook found it through its optimizer's parameters: refreshed there, ignores _step
    gathered: bool = False  # forms installed from an FSDP2 MX all-gather (install_forms): never built from the weight
    dgrad_seen: set = field(default_factory=set)  # dgrad-side forms built unkept since the last rebuild
    dropped: set = field(default_factory=set)  # forward-side forms the backward dropped: the next rebuild makes them
    dgrad_kept: bool = False  # a step with several microbatches was seen: keep every form (_single_use)

    def nbytes(self) -> int:
        return sum(t.nbytes for form in self.forms.values() for t in form)


_entries: dict[tuple, _Entry] = {}
_step = 0  # optimizer steps seen by the step hook, plus refresh() calls on sharded (DTensor) parameters
_by_storage: dict[int, set] = {}  # storage cdata -> keys of its entries


def _key(t: torch.Tensor) -> tuple:
    return (StorageWeakRef(t.untyped_storage()).cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _drop_storage(cdata: int) -> None:
    with _lock:
        for key in _by_storage.pop(cdata, ()):
            _entries.pop(key, None)


def _check(weight: torch.Tensor, rule: str, orientation: str) -> None:
    if orientation not in FORMS:
        raise ValueError(f"mxfx.runtime.cache: orientation={orientation!r} is not valid; choose one of {FORMS}")
    rules = BLOCK_SCALE_RULES if orientation in BLOCK_FORMS else SCALE_RULES
    if rule not in rules:
        raise ValueError(f"mxfx.runtime.cache: rule={rule!r} is not valid for {orientation!r}; choose one of {rules}")
    if weight.dim() not in (2, 3) or (orientation not in BLOCK_FORMS and (weight.shape[-1] % BLOCK_SIZE or weight.shape[-2] % BLOCK_SIZE)):
        raise ValueError(
            f"mxfx.runtime.cache: weight of shape {tuple(weight.shape)} must be [N, K] or [E, N, K] with N and K multiples "
            f"of {BLOCK_SIZE} (both orientations are blocked by {BLOCK_SIZE})"
        )
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"mxfx.runtime.cache: weight dtype {weight.dtype} is not a high-precision float (fp32/bf16/fp16)")


def source_layout(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s dgrad forms are kept in the source layout (transpose views of ``[.., N, K]``
    tensors) rather than contiguous ``[.., K, N]``: where its GEMM is emulated
    (:func:`mxfx.kernels.device.colwise_in_source_layout`)."""
    return colwise_in_source_layout(weight.device, "grouped_mm" if weight.dim() == 3 else "mm")


def _quantize(weight: torch.Tensor, rule: str, mx, hats=()) -> tuple[dict, dict]:
    """Quantize ``weight`` into the MX orientations ``mx`` (both from one read where possible).

    Returns ``(pairs, dequantized forms)``, keyed by orientation. In the source layout one pass
    writes every orientation of ``mx`` and the BF16 values of every orientation of ``hats``
    (the BF16 values alone when ``mx`` is empty); otherwise ``hats`` must be empty (the caller
    dequantizes the pairs).
    """
    w = weight.detach()
    want = set(mx) | set(hats)
    _stats.update({f"quantize_{o}": 1 for o in want})
    _stats["quantize"] += len(want)
    if source_layout(w):
        q, s, h, qt, st, ht = kernels.quantize_dual_source(
            w, rule, row="forward" in want, col="dgrad" in want,
            dequantized=torch.bfloat16 if hats else None, mx=bool(mx),
        )
        pairs = {o: p for o, p in (("forward", (q, s)), ("dgrad", (qt, st))) if o in mx}
        return pairs, {o: t for o, t in (("forward", h), ("dgrad", ht)) if o in hats}
    out = {}
    blocked = blocked_scales(w)
    if set(mx) == set(ORIENTATIONS):
        q, s, qt, st = (kernels.quantize_dual_blocked if blocked else kernels.quantize_dual)(w, rule)
        out["forward"], out["dgrad"] = (q.contiguous(), s.contiguous()), (qt.contiguous(), st.contiguous())
    else:
        for o in mx:
            src = w if o == "forward" else w.transpose(-2, -1)
            q, s = (kernels.quantize_blocked if blocked else kernels.quantize_lastdim)(src, rule)
            out[o] = (q.contiguous(), s.contiguous())
    return out, {}


def blocked_scales(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s MX forms keep their scales in the blocked layout (:mod:`mxfx.numerics.layout`, 1D): a 2D
    weight whose dense GEMM runs natively (Blackwell), which reads that layout. Stored so once per refresh,
    it saves a ``to_blocked`` per GEMM call. Expert weights keep plain scales: the grouped native operands
    lay each expert's out in their own padded layout."""
    return weight.dim() == 2 and not source_layout(weight)


def _plain_scales(qdata: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[R, K/32]`` scales of ``qdata [R, K]``, read back from the blocked layout if they are in it."""
    if is_blocked(qdata, scales):
        return from_blocked(scales, qdata.shape[0], qdata.shape[1] // BLOCK_SIZE)
    return scales


def _build(weight: torch.Tensor, rule: str, forms, have: dict | None = None) -> dict:
    """Forms ``forms`` of one rule, keyed ``(rule, form)``: the fp8_block forms by :func:`_build_block`,
    the MX and BF16 forms by :func:`_build_mx`."""
    blocks = [f for f in forms if f in BLOCK_FORMS]
    out = _build_block(weight, rule, blocks, have or {}) if blocks else {}
    mx = [f for f in forms if f not in BLOCK_FORMS]
    return {**out, **_build_mx(weight, rule, mx, have)} if mx else out


def _build_block(weight: torch.Tensor, rule: str, forms, have: dict) -> dict:
    """The fp8_block forms ``forms`` (:data:`BLOCK_FORMS`): the transpose of the other form where ``have``
    holds it, else from one 128x128 quantize of ``weight`` (which serves both)."""
    other = {"block_forward": "block_dgrad", "block_dgrad": "block_forward"}
    known = next((f for f in BLOCK_FORMS if (rule, f) in have), None)
    if known is not None:
        q, s = have[(rule, known)]
        if known == "block_dgrad":
            q, s = block_device_path.transpose_qdata(q), s.transpose(-2, -1)
    else:
        _stats["quantize_block"] += 1
        _stats["quantize"] += 1
        q, s = block_device_path.quantize_128x128(weight.detach(), rule)
    out = {}
    for f in forms:
        if f not in other:
            continue
        if f == "block_forward":
            out[(rule, f)] = (q.contiguous(), s.contiguous())
        else:
            out[(rule, f)] = (block_device_path.transpose_qdata(q), s.transpose(-2, -1).contiguous())
    return out


def _build_mx(weight: torch.Tensor, rule: str, forms, have: dict | None = None) -> dict:
    """MX and BF16 forms ``forms`` of one rule, keyed ``(rule, form)``.

    Where the GEMM is emulated (:func:`source_layout`) a dequantized form is written straight
    from the weight, without its MX form (no emulated GEMM reads both); elsewhere it is the MX
    form dequantized, and the MX form is kept too. MX pairs already in ``have`` are reused.
    """
    have = have or {}
    mx = {f for f in forms if f in ORIENTATIONS}
    hat = {DEQUANTIZED[f] for f in forms if f in DEQUANTIZED}
    direct = source_layout(weight)
    if not direct:
        mx |= hat
    pairs = {o: have[(rule, o)] for o in mx | hat if (rule, o) in have}
    mx_missing = [o for o in ORIENTATIONS if o in mx and o not in pairs]
    hat_missing = [o for o in ORIENTATIONS if o in hat and o not in pairs] if direct else []
    hats = {}
    if mx_missing or hat_missing:
        new_pairs, hats = _quantize(weight, rule, mx_missing, hat_missing)
        pairs.update(new_pairs)
    out = {(rule, o): pairs[o] for o in mx}
    for o in hat:
        if o in hats:
            out[(rule, o + "_bf16")] = (hats[o],)
        else:
            q, sc = pairs[o]
            out[(rule, o + "_bf16")] = (kernels.dequantize_lastdim(q, _plain_scales(q, sc), torch.bfloat16),)
    return out


def set_dgrad_at_refresh(enabled: bool) -> bool:
    """Choose when the dgrad-side forms (:data:`DGRAD_SIDE`) are rebuilt after a weight changed; returns the
    previous choice.

    ``False`` (the default): a refresh rebuilds the forward-side forms only and drops the stale dgrad-side
    ones; the backward builds them at their lookup, and with one microbatch per step drops every form of
    the weight there (module docstring), so a forward's peak memory holds no dgrad form and the backward's
    none of the layers it is done with. ``True``: a refresh rebuilds every form and keeps it, so each MX
    weight is read once per step (one pass writes both forms where the GEMM is emulated) instead of twice.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    global _dgrad_at_refresh
    if not isinstance(enabled, bool):
        raise TypeError(f"mxfx.runtime.cache.set_dgrad_at_refresh: enabled={enabled!r} must be True or False")
    with _lock:
        previous, _dgrad_at_refresh = _dgrad_at_refresh, enabled
    return previous


def dgrad_at_refresh() -> bool:
    """Whether a refresh rebuilds the dgrad-side forms too (:func:`set_dgrad_at_refresh`)."""
    return _dgrad_at_refresh


def _rebuild(entry: _Entry, weight: torch.Tensor, extra: tuple | None = None) -> None:
    """Rebuild the forms of ``entry`` (plus ``extra`` = (rule, orientation)) from ``weight``: every form, or,
    unless :func:`set_dgrad_at_refresh`, the forward-side ones and ``extra``, the stale dgrad-side forms
    dropped (their next lookup builds them). Forms gathered by FSDP2 cannot be built later: all rebuilt."""
    wanted = set(entry.forms) | entry.dropped | ({extra} if extra else set())
    if not (_dgrad_at_refresh or entry.gathered):
        deferred = {f for f in wanted if f[1] in DGRAD_SIDE and f != extra}
        wanted -= deferred
        _stats["deferred_dgrad"] += len(deferred)
    entry.forms.clear()  # free the stale forms before allocating the new ones
    entry.dgrad_seen.clear()
    entry.dropped.clear()
    entry.source_layout = source_layout(weight)
    for rule in sorted({r for r, _ in wanted}):
        entry.forms.update(_build(weight, rule, [f for r, f in wanted if r == rule]))


def _single_use(entry: _Entry) -> bool:
    """Whether ``entry``'s forms are dropped at the backward's first dgrad lookup (module docstring): no
    :func:`set_dgrad_at_refresh`, not gathered by FSDP2, and no step with several microbatches seen."""
    return not (_dgrad_at_refresh or entry.gathered or entry.dgrad_kept)


def _entry_for(weight: torch.Tensor, create: bool) -> _Entry | None:
    key = _key(weight)
    entry = _entries.get(key)
    if entry is not None and entry.storage.expired():  # cannot happen while the finalizer runs; belt and braces
        _drop_storage(key[0])
        entry = None
    if entry is None and create:
        storage = weight.untyped_storage()
        ref = StorageWeakRef(storage)
        entry = _Entry(ref, weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()), weight.dtype, weakref.ref(weight))
        _entries[key] = entry
        if key[0] not in _by_storage:
            _by_storage[key[0]] = set()
            weakref.finalize(storage, _drop_storage, key[0])
        _by_storage[key[0]].add(key)
    return entry


def lookup(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager body of :func:`weight_operand`: the cached pair, rebuilt first if stale. See there.

    Raises:
        RuntimeError: called while a CUDA graph is being captured (a replay would skip this freshness check).
    """
    _check(weight, rule, orientation)
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"mxfx.runtime.cache: a weight {tuple(weight.shape)} is looked up while a CUDA graph is being captured; a replay "
            f"would skip the freshness check and reuse caches of the step it was captured in. Run the mxfp8 backend "
            f"outside CUDA graphs (torchtitan: --training.disable_cuda_graphs)")
    with _lock:
        entry = _entry_for(weight, create=True)
        entry.weight = weakref.ref(weight)
        form = (rule, orientation)
        if entry.gathered and (form not in entry.forms or entry.step != _step):
            raise RuntimeError(
                f"mxfx.runtime.cache: the {orientation!r} form of a weight {tuple(weight.shape)} gathered as MX forms by FSDP2 "
                f"(mxfx.fsdp.mx_all_gather) was not gathered since the last optimizer step; its unsharded values cannot rebuild it "
                f"exactly. Keep this weight out of mx_all_gather (and Policy.keep_dequantized_weights is not "
                f"supported with it)")
        if (entry.version != weight._version or entry.source_layout != source_layout(weight)
                or (not entry.owned and entry.step != _step)):
            _rebuild(entry, weight, form)
            entry.version, entry.step = weight._version, _step
            _stats["stale"] += 1
        elif form not in entry.forms:
            built = _build(weight, rule, [orientation], have=entry.forms)
            if _single_use(entry):
                if orientation in DGRAD_SIDE and form not in entry.dgrad_seen:
                    # the step's first backward: the dgrad form serves this GEMM alone, and the forward is
                    # done with the forward forms (the next refresh rebuilds them)
                    entry.dgrad_seen.add(form)
                    _stats["transient_dgrad"] += 1
                    for f in [f for f in entry.forms if f[1] not in DGRAD_SIDE]:
                        del entry.forms[f]
                        entry.dropped.add(f)
                    return built[form]
                if entry.dgrad_seen:  # a second backward, or a forward after one: several microbatches
                    entry.dgrad_kept = True
            entry.forms.update(built)
        else:
            _stats["hit"] += 1
        return entry.forms[form]


def entry_forms(weight: torch.Tensor) -> dict:
    """The forms cached for ``weight``'s storage region now, keyed ``(rule, form)`` (empty when none): the cache
    tensors themselves, as they are, without a freshness check. For inspection and tests; treat as read-only."""
    with _lock:
        entry = _entry_for(weight, create=False)
        return dict(entry.forms) if entry is not None else {}


def cached_formats(weights) -> set[str]:
    """The formats ("mxfp8", "fp8_block") of the forms cached now for any of ``weights`` (empty when none): what a
    rebuild of their caches produces. Dequantized BF16 forms count as "mxfp8" (they hold MX values)."""
    with _lock:
        entries = [_entry_for(w, create=False) for w in weights]
        return {"fp8_block" if form in BLOCK_FORMS else "mxfp8" for e in entries if e is not None for _, form in e.forms}


def _out_shape(shape, orientation: str) -> list:
    return list(shape) if orientation == "forward" else [*shape[:-2], shape[-1], shape[-2]]


def _fake_form(weight: torch.Tensor, orientation: str, dtype: torch.dtype, scales: bool = False) -> torch.Tensor:
    """An empty tensor with the shape and strides the cache's form has (its scales when ``scales``)."""
    if orientation == "forward" or not source_layout(weight):
        shape = _out_shape(weight.shape, orientation)
        if scales and blocked_scales(weight):
            return weight.new_empty([blocked_numel(shape[0], shape[1] // BLOCK_SIZE)], dtype=dtype)
        if scales and source_layout(weight):  # quantize_dual_source's rowwise scales are MN-major
            return mn_major([*shape[:-1], shape[-1] // BLOCK_SIZE], weight)
        return weight.new_empty([*shape[:-1], shape[-1] // BLOCK_SIZE] if scales else shape, dtype=dtype)
    *lead, n, k = weight.shape
    return weight.new_empty([*lead, n // BLOCK_SIZE if scales else n, k], dtype=dtype).transpose(-2, -1)


def _check_mx_orientation(orientation: str) -> None:
    if orientation not in ORIENTATIONS:
        raise ValueError(f"mxfx.runtime.cache: orientation={orientation!r} is not valid; choose one of {ORIENTATIONS}")


@torch.library.custom_op("mxfx::cached_weight_quantize", mutates_args=())
def _cached_weight_quantize(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_mx_orientation(orientation)
    return lookup(weight, rule, orientation)


@_cached_weight_quantize.register_fake
def _(weight, rule, orientation):
    _check_mx_orientation(orientation)
    _check(weight, rule, orientation)
    return _fake_form(weight, orientation, _E4M3), _fake_form(weight, orientation, torch.uint8, scales=True)


def weight_operand(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The MX operand of a weight for one GEMM orientation, from its cache (the recipe, "Forward, Dgrad, and Wgrad Need Different Operands").

    A torch custom op (``mxfx::cached_weight_quantize``) with a fake
    implementation, so compiled graphs call it opaquely; its run-time body
    returns the cached pair when the cache is fresh (same storage region, same
    ``weight._version``), builds it when it is missing (a dgrad form after a
    refresh), and rebuilds the weight's forms when they are stale.

    Args:
        weight: the high-precision parameter (fp32 main weight, bf16 or fp16),
            ``[N, K]`` or ``[E, N, K]``, N and K multiples of 32, any strides.
        rule: scale rule, "rceil" or "floor".
        orientation: "forward": ``W`` blocked along K, returns qdata
            ``[..., N, K]`` and scales ``[..., N, K/32]``; "dgrad":
            ``W.transpose(-2, -1)`` blocked along N, returns qdata
            ``[..., K, N]`` and scales ``[..., K, N/32]``.

    Returns:
        ``(qdata float8_e4m3fn, scales uint8 E8M0)``, the cache itself: treat them
        as read-only. Contiguous where the GEMM runs natively; there the scales of a 2D weight
        are kept in the blocked layout the native GEMM reads (1D, ``blocked_numel(N, K/32)`` /
        ``blocked_numel(K, N/32)`` bytes, :func:`blocked_scales`). Where it is emulated (Hopper,
        CPU; :func:`source_layout`) one pass writes both pairs in the weight's own layout: the
        forward scales MN-major (the transpose view of a contiguous ``[..., K/32, N]`` tensor),
        the dgrad pair the transpose views of contiguous ``[..., N, K]`` / ``[..., N/32, K]``
        tensors (docs/format.md, "Scale memory layouts").

    Raises:
        ValueError: unknown rule or orientation, a weight that is not 2D/3D, has
            dims that are not multiples of 32, or is not a float of 16+ bits.
    """
    with torch.no_grad():
        return _cached_weight_quantize(weight, rule, orientation)


@torch.library.custom_op("mxfx::cached_weight_dequantized", mutates_args=())
def _cached_weight_dequantized(weight: torch.Tensor, rule: str, orientation: str) -> torch.Tensor:
    _check_mx_orientation(orientation)
    return lookup(weight, rule, orientation + "_bf16")[0]


@_cached_weight_dequantized.register_fake
def _(weight, rule, orientation):
    _check(weight, rule, orientation)
    return _fake_form(weight, orientation, torch.bfloat16)


def weight_dequantized(weight: torch.Tensor, rule: str, orientation: str) -> torch.Tensor:
    """The dequantized BF16 operand of a weight for one orientation, from its cache.

    Exactly ``dequantize(*weight_operand(weight, rule, orientation))`` in BF16, with the
    scales read back from the blocked layout where the cache keeps them so (:func:`blocked_scales`)
    (the MX values; exact except in blocks whose scale is below 2^-118, where
    BF16 flushes E4M3 subnormals), kept as the cache form
    ``(rule, orientation + "_bf16")`` and rebuilt with the weight's other forms once per
    optimizer step. For ``Policy.keep_dequantized_weights``: the emulated GEMM
    takes it instead of dequantizing the weight on every call. Costs 2 bytes
    per value per orientation of persistent memory.

    Args:
        weight: as for :func:`weight_operand`.
        rule: "rceil" or "floor".
        orientation: "forward" (``[..., N, K]``) or "dgrad" (``[..., K, N]``).

    Returns:
        bf16 tensor of the oriented shape; the cache itself: read-only.

    Raises:
        ValueError: as for :func:`weight_operand`.
    """
    with torch.no_grad():
        return _cached_weight_dequantized(weight, rule, orientation)


def weight_operands(weight: torch.Tensor, rule: str, orientation: str, keep_dequantized: bool):
    """What an MX GEMM takes of a weight: ``(qdata, scales, dequantized)``.

    ``(qdata, scales)`` from :func:`weight_operand`; ``dequantized`` is
    :func:`weight_dequantized` under ``Policy.keep_dequantized_weights``, else None.
    Where the GEMM is emulated (Hopper, CPU; :func:`source_layout`) and the BF16 form is kept,
    ``qdata`` and ``scales`` are None and the cache holds no MX form of the weight: the emulated
    GEMM reads only the BF16 values (the same values), so each step writes 8 bytes per
    parameter instead of the 10 of MX plus BF16 forms, and the cache holds 4 (against about 2
    for the MX forms alone, without the option).
    Shapes, dtypes and errors as for those two functions.
    """
    if keep_dequantized and source_layout(weight):  # emulated GEMM: the BF16 form is all it reads
        return None, None, weight_dequantized(weight, rule, orientation)
    qdata, scales = weight_operand(weight, rule, orientation)
    return qdata, scales, (weight_dequantized(weight, rule, orientation) if keep_dequantized else None)


@torch.library.custom_op("mxfx::cached_weight_block", mutates_args=())
def _cached_weight_block(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_mx_orientation(orientation)
    return lookup(weight, rule, "block_" + orientation)


@_cached_weight_block.register_fake
def _(weight, rule, orientation):
    _check_mx_orientation(orientation)
    _check(weight, rule, "block_" + orientation)
    *lead, n, k = weight.shape
    rows, cols = (n, k) if orientation == "forward" else (k, n)
    q = weight.new_empty([*lead, rows, cols], dtype=_E4M3)
    return q, weight.new_empty([*lead, -(-rows // 128), -(-cols // 128)], dtype=torch.float32)


def block_weight_operand(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8_block operand of a weight for one GEMM orientation, from its cache (:data:`BLOCK_FORMS`).

    A custom op (``mxfx::cached_weight_block``) like :func:`weight_operand`, with the same freshness: one
    128x128 quantize of the weight per optimizer step serves both orientations.

    Args:
        weight: the high-precision parameter ``[N, K]`` or ``[E, N, K]`` (fp32/bf16/fp16), any dims.
        rule: "rceil" or "amax" (``mxfx.numerics.block.SCALE_RULES``).
        orientation: "forward": qdata ``[..., N, K]``, scales ``[..., ceil(N/128), ceil(K/128)]``;
            "dgrad": qdata ``[..., K, N]``, scales ``[..., ceil(K/128), ceil(N/128)]``.

    Returns:
        ``(qdata float8_e4m3fn, scales float32)``, contiguous; the cache itself: read-only.

    Raises:
        ValueError: unknown rule or orientation, a weight that is not 2D/3D or not a float of 16+ bits.
    """
    with torch.no_grad():
        return _cached_weight_block(weight, rule, orientation)


# --- refresh -------------------------------------------------------------------------------


def _entries_on(t: torch.Tensor) -> list[_Entry]:
    """Entries whose storage is ``t``'s (a parameter or the flat buffer its weights view)."""
    keys = _by_storage.get(StorageWeakRef(t.untyped_storage()).cdata, ())
    return [_entries[k] for k in keys if k in _entries]


def _inside(entry: _Entry, t: torch.Tensor) -> bool:
    """True when ``entry``'s region lies inside contiguous ``t``'s storage span, same dtype."""
    if entry.dtype != t.dtype or not t.is_contiguous():
        return False
    lo = entry.offset
    hi = entry.offset + sum((n - 1) * s for n, s in zip(entry.shape, entry.stride))
    return t.storage_offset() <= lo and hi < t.storage_offset() + t.numel()


def _region(entry: _Entry, source: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """The entry's weight read out of ``values``, a contiguous tensor laid out like contiguous ``source``."""
    if not _inside(entry, source) or values.dtype != entry.dtype or not values.is_contiguous() or values.shape != source.shape:
        return None
    return values.as_strided(entry.shape, entry.stride, values.storage_offset() + entry.offset - source.storage_offset())


def _refresh_entry(entry: _Entry, t: torch.Tensor, force: bool) -> bool:
    """Rebuild ``entry`` (a weight stored in ``t``'s storage) now; False when it was fresh or unreadable."""
    if not (entry.forms or entry.dropped):
        return False
    w = entry.weight()
    if w is None or _key(w) != (entry.storage.cdata, entry.offset, entry.shape, entry.stride, entry.dtype):
        w = _region(entry, t, t)
    if w is None:
        entry.version = None  # cannot read it from here: the next lookup rebuilds it
        return False
    if not force and entry.version == w._version:
        return False
    _rebuild(entry, w)
    entry.version, entry.step = w._version, _step
    return True


def refresh(tensors, *, force: bool = True) -> int:
    """Rebuild, now, the caches of every weight stored in ``tensors`` (parameters or flat buffers).

    Use after writes outside any optimizer step that the version counter does not see
    (``p.data.copy_(...)``, a buffer assigned with ``p.data = ...``), and after any write
    outside an optimizer step to a parameter sharded by FSDP2; the optimizer hook and
    compiled steps call the same machinery.

    Args:
        tensors: a tensor or an iterable of tensors; the caches of every weight
            whose storage is one of theirs are rebuilt (a weight must lie inside
            the tensor's span, or be that tensor). A tensor subclass holding no weight's
            storage (an FSDP2 sharded DTensor parameter) advances the step count instead:
            every weight no step hook tracks (FSDP2's unsharded parameters) is rebuilt at
            its next lookup.
        force: rebuild even when the version counter says the cache is fresh.

    Returns:
        How many weights were rebuilt.
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    global _step
    done, sharded = 0, False
    with _lock, torch.no_grad():
        for t in tensors:
            entries = _entries_on(t)
            sharded |= not entries and type(t) not in (torch.Tensor, torch.nn.Parameter)  # a DTensor shard
            done += sum(_refresh_entry(e, t, force) for e in entries)
        _step += sharded
    _stats["refresh"] += done
    return done


def _step_post_hook(optimizer, args, kwargs) -> None:
    """Global optimizer step post-hook: rebuild the caches of the weights this optimizer holds.

    Parameters with a gradient were stepped: rebuilt unconditionally (this also
    covers optimizers that write through ``.data``). Parameters without one are
    rebuilt only if their version changed. Weights a compiled step already
    rebuilt in-graph are skipped. Advances the step count, so weights that are not
    found here (FSDP2's unsharded parameters) are rebuilt at their next lookup.
    """
    global _step
    done = 0
    with _lock, torch.no_grad():
        _step += 1
        for group in optimizer.param_groups if _entries else ():
            for p in group["params"]:
                for entry in _entries_on(p):
                    entry.owned = True
                    in_graph, entry.graph_refreshed = entry.graph_refreshed, False
                    done += _refresh_entry(entry, p, force=p.grad is not None and not in_graph)
    _stats["refresh_eager"] += done


_step_post_hook = torch.compiler.disable(_step_post_hook, recursive=True)
_hook_handle = None


def install() -> None:
    """Install the global optimizer step post-hook and the Inductor lowering (idempotent).

    Called by the mxfp8 backend when it first compiles a graph with MX weights.
    """
    global _hook_handle
    with _lock:
        if _hook_handle is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _hook_handle = register_optimizer_step_post_hook(_step_post_hook)
            _register_inductor_lowerings()


def uninstall() -> None:
    """Remove the global optimizer step post-hook (the version check still keeps forwards correct)."""
    global _hook_handle
    with _lock:
        if _hook_handle is not None:
            _hook_handle.remove()
            _hook_handle = None


def hook_installed() -> bool:
    return _hook_handle is not None


# --- refresh inside a compiled optimizer step ------------------------------------------------

_plans: dict[int, list] = {}  # plan id -> weakrefs to the parameters a compiled step updates
_pending: list[tuple[_Entry, torch.Tensor]] = []  # rebuilt in-graph, version stamped after the graph returns


def new_plan(params) -> int:
    """Register the parameters a compiled optimizer step updates; returns the plan id its refresh op carries."""
    with _lock:
        plan = len(_plans)
        _plans[plan] = [weakref.ref(p) for p in params]
        return plan


@torch.library.custom_op("mxfx::refresh_weight_caches", mutates_args=())
def _refresh_weight_caches(plan: int, values: list[torch.Tensor]) -> torch.Tensor:
    """Rebuild the caches of the plan's parameters from their updated ``values`` (same order).

    Which parameters have caches is resolved here, at run time: the step may be
    compiled before the model. Returns an empty token tensor (the op is ordered
    by an effect token so it is never dead-code eliminated).
    """
    params = _plans.get(plan)
    if params is None:
        raise RuntimeError(f"mxfx.runtime.cache: unknown refresh plan {plan}")
    if len(params) != len(values):
        raise RuntimeError(f"mxfx.runtime.cache: refresh plan {plan} has {len(params)} parameters, got {len(values)} values")
    n = 0
    with _lock, torch.no_grad():
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
                _pending.append((entry, p))
                n += 1
    _stats["refresh_graph"] += n
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
    with _lock:
        for entry, p in _pending:
            w = entry.weight()
            if w is not None and _key(w) == (entry.storage.cdata, entry.offset, entry.shape, entry.stride, entry.dtype):
                entry.version = w._version
            elif entry.shape == tuple(p.shape) and entry.offset == p.storage_offset():
                entry.version = p._version
            else:
                continue
            entry.graph_refreshed = True
        _pending.clear()


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
    for op in (torch.ops.mxfx.cached_weight_quantize.default, torch.ops.mxfx.cached_weight_dequantized.default):
        if op in lowerings:
            continue
        fallback = fallback_handler(op, add_to_fallback_set=False)

        def _lower(weight, rule, orientation, _fallback=fallback):
            outs = _fallback(weight, rule, orientation)
            for t in outs if isinstance(outs, (list, tuple)) else (outs,):
                V.graph.never_reuse_buffers.add(t.get_name())
            return outs

        register_lowering(op, type_promotion_kind=None)(_lower)


# --- inspection -----------------------------------------------------------------------------


def stats() -> dict:
    """Counters since the last :func:`reset_stats`.

    Keys: ``quantize`` (orientations quantized, all paths), ``quantize_forward``,
    ``quantize_dgrad``, ``hit`` (lookups served from the cache), ``stale``
    (lookups that found no fresh caches, a weight's first lookup included, and rebuilt), ``refresh`` (weights
    rebuilt by :func:`refresh`), ``refresh_eager`` (by the optimizer hook),
    ``refresh_graph`` (inside compiled optimizer steps), ``quantize_block`` (128x128 quantizes of
    fp8_block weights, each serving both orientations), ``deferred_dgrad`` (stale dgrad-side forms a
    rebuild dropped for their next lookup to build, :func:`set_dgrad_at_refresh`), ``transient_dgrad``
    (dgrad-side forms built for one GEMM and not kept, the forward forms dropped with them: one microbatch
    per step so far).
    """
    keys = ("quantize", "quantize_forward", "quantize_dgrad", "quantize_block", "hit", "stale", "refresh", "refresh_eager",
            "refresh_graph", "deferred_dgrad", "transient_dgrad")
    return {k: _stats.get(k, 0) for k in keys}


def reset_stats() -> None:
    _stats.clear()


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
    with _lock:
        if weight is None:
            return sum(e.nbytes() for e in _entries.values())
        entry = _entries.get(_key(weight))
        return entry.nbytes() if entry is not None else 0


def num_entries() -> int:
    """How many weights currently have caches."""
    return len(_entries)


def clear() -> None:
    """Drop every cache (they are rebuilt on next use)."""
    with _lock:
        _entries.clear()
        _by_storage.clear()
        _pending.clear()


# --- forms gathered by FSDP2 (mxfx.fsdp) ------------------------------------------------------


def step_count() -> int:
    """The global optimizer step count (advanced by every optimizer step and by :func:`refresh` on shards)."""
    return _step


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
    with _lock, torch.no_grad():
        entry = _entry_for(weight, create=True)
        entry.weight = weakref.ref(weight)
        if entry.step != _step or entry.source_layout != source_layout(weight):
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
        entry.version, entry.step, entry.gathered = weight._version, _step, True
        _stats["installed"] += len(pairs)
