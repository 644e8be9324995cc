"""Form builders: the cached forms of one high-precision weight, built from it (or from forms already held).

Each MX weight has up to two derived forms, each a ``(qdata e4m3, scales uint8 E8M0)`` pair:

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
same freshness logic. The fp8_block forms are :data:`BLOCK_FORMS`.

Nothing here knows about entries or freshness (:mod:`mxfx.runtime.cache.store`): these functions
take a weight and return forms. They count their quantizations in :data:`counts`.
"""

from __future__ import annotations

from collections import Counter

import torch

from mxfx import kernels
from mxfx.numerics.mx import BLOCK_SIZE
from mxfx.kernels import block_device_path
from mxfx.kernels.views import mn_major
from mxfx.kernels.device import colwise_in_source_layout
from mxfx.numerics.layout import blocked_numel, from_blocked, is_blocked

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

_E4M3 = torch.float8_e4m3fn

counts: Counter = Counter()
"""The cache's counters (:func:`mxfx.runtime.cache.inspect.stats`): the builders here count quantizations,
the lookups of :mod:`mxfx.runtime.cache.store` count hits and rebuilds in the same object."""


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
    counts.update({f"quantize_{o}": 1 for o in want})
    counts["quantize"] += len(want)
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
        counts["quantize_block"] += 1
        counts["quantize"] += 1
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
