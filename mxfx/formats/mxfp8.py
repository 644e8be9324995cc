"""MXFP8 (OCP Microscaling v1.0): an E4M3 payload and one E8M0 power-of-two scale per 32 values.

Operands are blocked along each GEMM's reduction dim (``docs/format.md``):

* forward ``Y = MX(X) . MX(W)^T``: X rowwise (along K), W rowwise (along K, the "forward" weight cache);
* dgrad ``dX = MX(dY) . MX(W)``: dY rowwise (along N), W blocked down its columns from W itself ("dgrad");
* wgrad ``dW = MX(dY)^T . MX(X)``: both blocked along tokens, zero-padded to a multiple of 32 (per expert
  group for routed experts, so no 32-block mixes two experts' rows; :func:`token_rows` for a dense linear).

Which GEMMs run natively is :attr:`MXFP8.native_gemms` (Blackwell); the others are emulated. An operand is
``(qdata, scales, values)``: ``values`` is its dequantization written by the same pass where the GEMM is emulated
(Hopper, CPU; in :meth:`MXFP8.values_dtype`), else None; where the emulated GEMM reads the values alone, qdata and
scales may be None. Native MX GEMMs read qdata and scales, a dense operand's scales in the blocked layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxfx.formats.base import GEMM_OPS, Format, Operand, ScaleRule, described, register, route_weighted, stats_views
from mxfx.kernels.mx import custom_ops, device_path
from mxfx.kernels.mx import swiglu_operand
from mxfx.kernels.mx.custom_ops import mx_grouped_mm, mx_grouped_mm_wgrad, mx_mm
from mxfx.kernels.mx.custom_ops import grouped_wgrad_into as mx_grouped_wgrad_into, mm_into as mx_mm_into
from mxfx.kernels.mx.gemm import emulation_dtype
from mxfx.kernels.mx.operands import a_operand, quantize_dual_operand, quantize_operand
from mxfx.kernels.mx.views import mn_major
from mxfx.kernels.common import swiglu
from mxfx.kernels.common.custom_ops import swiglu_product
from mxfx.numerics.layout import blocked_numel, from_blocked, group_padding, is_blocked, padded_group_ends, to_blocked
from mxfx.numerics.mx import BLOCK_SIZE, E4M3_MAX, E8M0_BIAS, dequantize_lastdim, quantize_blocks
from mxfx.runtime import cache, stats


def token_rows(m):
    """Rows of a linear's token-blocked wgrad operands for ``m`` tokens: ``m`` rounded up to whole 32-row blocks;
    for a symbolic ``m`` (dynamic shapes: a data-dependent expert split), at least two blocks.

    The symbolic count is one expression for every ``m`` (``torch.sym_max``, no branch on its value): torch's
    contiguity checks ask whether each dim of a tensor is 1, and a scale dim that may be one block (``m <= 32``)
    would be guarded on, recompiling the graph whenever an expert's rows cross 32.
    """
    rows = m + (-m) % BLOCK_SIZE
    return torch.sym_max(2 * BLOCK_SIZE, rows) if isinstance(m, torch.SymInt) else rows


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """Zero-pad dim 0 to :func:`token_rows` rows (zero rows add nothing to a token-reduction GEMM)."""
    return F.pad(t, (0, 0, 0, token_rows(t.shape[0]) - t.shape[0]))


# --- weight forms (mxfx.runtime.cache) -------------------------------------------------------------
#
# Up to four forms per weight and scale rule, each rebuilt once per optimizer step:
#
# * "forward": ``(qdata [..., N, K], scales [..., N, K/32])``, W blocked along K;
# * "dgrad": ``(qdata [..., K, N], scales [..., K, N/32])``, W^T blocked along N, quantized from W itself
#   (``docs/format.md``, "GEMM operand orientation");
# * "forward_bf16", "dgrad_bf16": ``(values bf16,)`` of those two, for ``Policy.keep_dequantized_weights``.
#
# Where the GEMM is emulated (Hopper, CPU; :func:`source_layout`) the dgrad forms stay in W's own layout
# (transpose views of ``[..., N, K]`` tensors) and one non-transposing pass writes every form asked for;
# a BF16 form is then written straight from W, without its MX form (no emulated GEMM reads both). Where
# the dense GEMM runs natively (Blackwell) a 2D weight's scales are kept in the blocked layout that GEMM
# reads (:func:`blocked_scales`), written by the refresh pass itself.

_PAIRS = ("forward", "dgrad")
_VALUES = {"forward_bf16": "forward", "dgrad_bf16": "dgrad"}


def source_layout(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s dgrad forms are kept in the source layout (transpose views of ``[.., N, K]``
    tensors) rather than contiguous ``[.., K, N]``: where its GEMM is emulated. Native MX GEMMs read the
    columnwise operand as a contiguous (K-major) tensor, so it is stored transposed; emulated GEMMs read either
    orientation at the same cost, so it stays the transpose view (no transpose in its quantize or dequantize)."""
    return not FORMAT.runs_natively("grouped_mm" if weight.dim() == 3 else "mm", weight.device)


def blocked_scales(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s MX forms keep their scales in the blocked layout (:mod:`mxfx.numerics.layout`, 1D): a
    2D weight whose dense GEMM runs natively (Blackwell), which reads that layout. Expert weights keep plain
    scales: the grouped native operands lay each expert's out in their own padded layout."""
    return weight.dim() == 2 and not source_layout(weight)


def _plain_scales(qdata: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[R, K/32]`` scales of ``qdata [R, K]``, read back from the blocked layout if they are in it."""
    if is_blocked(qdata, scales):
        return from_blocked(scales, qdata.shape[0], qdata.shape[1] // BLOCK_SIZE)
    return scales


def _quantize_weight(weight: torch.Tensor, rule: str, pairs, values=()) -> tuple[dict, dict]:
    """``weight`` quantized into the orientations ``pairs`` (both from one read where possible): ``(pairs,
    BF16 values)`` keyed by orientation. In the source layout one pass also writes the BF16 values of the
    orientations ``values`` (the values alone when ``pairs`` is empty); elsewhere ``values`` must be empty."""
    w = weight.detach()
    want = set(pairs) | set(values)
    cache.counts.update({f"quantize_{o}": 1 for o in want})
    cache.counts["quantize"] += len(want)
    if source_layout(w):
        q, s, h, qt, st, ht = device_path.quantize_dual_source(
            w,
            rule,
            row="forward" in want,
            col="dgrad" in want,
            dequantized=torch.bfloat16 if values else None,
            mx=bool(pairs),
        )
        return (
            {o: p for o, p in (("forward", (q, s)), ("dgrad", (qt, st))) if o in pairs},
            {o: t for o, t in (("forward", h), ("dgrad", ht)) if o in values},
        )
    out = {}
    blocked = blocked_scales(w)
    if set(pairs) == set(_PAIRS):
        q, s, qt, st = (device_path.quantize_dual_blocked if blocked else device_path.quantize_dual)(w, rule)
        out["forward"], out["dgrad"] = (q.contiguous(), s.contiguous()), (qt.contiguous(), st.contiguous())
    else:
        for o in pairs:
            src = w if o == "forward" else w.transpose(-2, -1)
            q, s = (device_path.quantize_blocked if blocked else device_path.quantize_lastdim)(src, rule)
            out[o] = (q.contiguous(), s.contiguous())
    return out, {}


def _build(weight: torch.Tensor, rule: str, forms, have: dict) -> dict:
    """The forms ``forms`` of one rule, keyed ``(rule, form)``, reusing MX pairs in ``have``."""
    pairs_wanted = {f for f in forms if f in _PAIRS}
    values_wanted = {_VALUES[f] for f in forms if f in _VALUES}
    direct = source_layout(weight)
    if not direct:
        pairs_wanted |= values_wanted  # BF16 values are the MX pairs dequantized
    pairs = {o: have[(rule, o)] for o in pairs_wanted | values_wanted if (rule, o) in have}
    pairs_missing = [o for o in _PAIRS if o in pairs_wanted and o not in pairs]
    values_missing = [o for o in _PAIRS if o in values_wanted and o not in pairs] if direct else []
    values = {}
    if pairs_missing or values_missing:
        new_pairs, values = _quantize_weight(weight, rule, pairs_missing, values_missing)
        pairs.update(new_pairs)
    out = {(rule, o): pairs[o] for o in pairs_wanted}
    for o in values_wanted:
        if o in values:
            out[(rule, o + "_bf16")] = (values[o],)
        else:
            q, sc = pairs[o]
            out[(rule, o + "_bf16")] = (device_path.dequantize_lastdim(q, _plain_scales(q, sc), torch.bfloat16),)
    return out


def _fake_tensor(weight: torch.Tensor, orientation: str, dtype: torch.dtype, scales: bool = False) -> torch.Tensor:
    """An empty tensor with the shape and strides of the ``orientation`` form's qdata (its scales when ``scales``,
    or its BF16 values with ``dtype=torch.bfloat16``)."""
    if orientation == "forward" or not source_layout(weight):
        shape = (
            list(weight.shape) if orientation == "forward" else [*weight.shape[:-2], weight.shape[-1], weight.shape[-2]]
        )
        if scales and blocked_scales(weight):
            return weight.new_empty([blocked_numel(shape[0], shape[1] // BLOCK_SIZE)], dtype=dtype)
        if scales and source_layout(weight):  # quantize_dual_source's rowwise scales are MN-major
            return mn_major([*shape[:-1], shape[-1] // BLOCK_SIZE], weight)
        return weight.new_empty([*shape[:-1], shape[-1] // BLOCK_SIZE] if scales else shape, dtype=dtype)
    *lead, n, k = weight.shape
    return weight.new_empty([*lead, n // BLOCK_SIZE if scales else n, k], dtype=dtype).transpose(-2, -1)


def _fake(weight: torch.Tensor, form: str) -> tuple:
    if form in _VALUES:
        return (_fake_tensor(weight, _VALUES[form], torch.bfloat16),)
    return _fake_tensor(weight, form, torch.float8_e4m3fn), _fake_tensor(weight, form, torch.uint8, scales=True)


def _install(weight: torch.Tensor, form: str, qdata: torch.Tensor, scales: torch.Tensor) -> tuple:
    """A gathered pair copied into the layout of the cache's form (blocked scales where :func:`blocked_scales`)."""
    q = _fake_tensor(weight, form, torch.float8_e4m3fn).copy_(qdata)
    if blocked_scales(weight):
        return q, to_blocked(scales)
    return q, _fake_tensor(weight, form, torch.uint8, scales=True).copy_(scales)


def _check_weight(weight: torch.Tensor, form: str) -> None:
    if weight.shape[-1] % BLOCK_SIZE or weight.shape[-2] % BLOCK_SIZE:
        raise ValueError(
            f"mxfx.runtime.cache: weight of shape {tuple(weight.shape)} must be [N, K] or [E, N, K] with N "
            f"and K multiples of {BLOCK_SIZE} (both orientations are blocked by {BLOCK_SIZE})"
        )


FORMS = cache.register(
    cache.FormFamily(
        name="mxfp8",
        forms=(*_PAIRS, *_VALUES),
        dgrad_side=frozenset({"dgrad", "dgrad_bf16"}),
        rules=("rceil", "floor"),
        build=_build,
        fake=_fake,
        install=_install,
        layout=source_layout,
        check=_check_weight,
    )
)


class MXFP8(Format):
    name = "mxfp8"
    scale_rules = (ScaleRule.RCEIL, ScaleRule.FLOOR)
    block = BLOCK_SIZE
    weight_block = (1, BLOCK_SIZE)
    feature_multiple = BLOCK_SIZE
    token_multiple = BLOCK_SIZE  # the wgrad blocks X along tokens
    bytes_per_value = 1 + 1 / BLOCK_SIZE
    scale_dtype = torch.uint8
    transport = "mxfp8"
    native_gemms = {
        "sm100": frozenset(GEMM_OPS),  # data-center Blackwell: torch._scaled_mm / _scaled_grouped_mm
        "sm120": frozenset({"mm"}),  # RTX Blackwell: dense only (torch's MX grouped kernel is sm100's)
    }
    dequantized_weight_forms = True
    gather_row_multiple = BLOCK_SIZE
    colour = "#9be7a0"
    description = "mxfp8: rceil/floor E8M0 scales per 32 values"

    def values_dtype(self, op: str, device: torch.device) -> torch.dtype | None:
        """The dtype GEMM ``op`` reads its operands in where it is emulated on ``device`` (fp32 on CPU, bf16 on
        CUDA: :func:`mxfx.kernels.mx.gemm.emulation_dtype`), None where it runs natively. A quantize pass making an
        operand of an emulated GEMM writes its dequantized values in this dtype too, so that no dequantize pass
        follows."""
        return None if self.runs_natively(op, device) else emulation_dtype(device)

    def input_operand(self, x, up, rule, op):
        return swiglu_operand.quantize_input(x, up, str(rule), self.values_dtype(op, x.device))

    def check_input_operand(self, op, operand, x):
        tensors = tuple(operand) if isinstance(operand, (tuple, list)) else ()
        if not (
            len(tensors) == 3
            and isinstance(tensors[0], torch.Tensor)
            and tensors[0].dtype == torch.float8_e4m3fn
            and tensors[0].shape == x.shape
            and isinstance(tensors[1], torch.Tensor)
            and tensors[1].dtype == torch.uint8
        ):
            raise ValueError(
                f"{op}: under format='mxfp8' the rows operand of x {tuple(x.shape)} is (qdata float8_e4m3fn "
                f"{tuple(x.shape)}, uint8 E8M0 scales, dequantized values or None); got {described(operand)}: make "
                f"it with the same format (mxfx.ops.linear.mx_linear_input(x, format='mxfp8'))"
            )

    def forward_operands(self, x, up, rule, save, tokens, offs=None, given=None):
        rule = str(rule)
        op = "mm" if offs is None else "grouped_mm"
        packed = ()
        if up is not None:  # SwiGLU quantized straight from gate and up, gate/up saved per ``save`` in the same pass
            values = self.values_dtype(op, x.device)
            q, s, hat, packed = swiglu_operand.quantize_input_and_pack(x, up, save, rule, values)
            a = (q, s, hat)
        elif given is not None:
            a = given
        elif tokens and offs is None:
            # rowwise for the forward and token-blocked for wgrad from one read; native dense GEMMs get both
            # scale matrices in their blocked layout (not cut to m rows: padded zero rows have scale byte 0,
            # the layout's own padding)
            m = x.shape[0]
            native = self.runs_natively("mm", x.device)
            dual = custom_ops.quantize_dual_blocked if native else custom_ops.quantize_dual
            q, s, qt, st = dual(_pad_tokens(x), rule)
            return (q[:m], s if native else s[:m], None), (qt, st, None), packed
        else:
            a = quantize_operand(x, rule, self.values_dtype(op, x.device))
        if not tokens:
            return a, None, packed
        h = x if up is None else swiglu_product(x, up)  # the fp32 values the fused forward quantize read
        if offs is None:
            return a, (*custom_ops.quantize(_pad_tokens(h).t(), rule), None), packed
        return a, self.grouped_tokens_operand(h, offs, rule), packed

    def weight_operand(self, weight, rule, orientation, keep_dequantized=False):
        # (qdata, scales, BF16 values or None); under keep_dequantized_weights an emulated GEMM reads the values
        # alone, so the cache holds no MX pair of the weight (8 bytes written per parameter per step, not 10)
        rule, values = str(rule), orientation + "_bf16"
        if keep_dequantized and source_layout(weight):
            return None, None, cache.weight_form(weight, rule, values)[0]
        q, s = cache.weight_form(weight, rule, orientation)
        return q, s, (cache.weight_form(weight, rule, values)[0] if keep_dequantized else None)

    def _native(self, op: str, a: Operand) -> bool:
        return self.runs_natively(op, (a[0] if a[0] is not None else a[2]).device)

    def mm(self, a, b, out_dtype):
        return mx_mm(a[0], a[1], b[0], b[1], out_dtype, self._native("mm", a), b[2], a[2])

    def grouped_mm(self, a, b, offs, out_dtype):
        return mx_grouped_mm(a[0], a[1], b[0], b[1], offs, out_dtype, self._native("grouped_mm", a), b[2], a[2])

    def grad_operands(self, dy, rule, rows, tokens):
        rule = str(rule)
        if tokens:  # rowwise for dgrad and token-blocked for wgrad, from one read
            m = dy.shape[0]
            q, s, hat, qt, st, hat_t = quantize_dual_operand(_pad_tokens(dy), rule, self.values_dtype("mm", dy.device))
            # the first m token rows; scales in the blocked layout (native GEMMs) stay whole
            q, s, hat = (t if t is None or t.dim() == 1 else t[:m] for t in (q, s, hat))
            return ((q, s, hat) if rows else None), (qt, st, hat_t)
        return (quantize_operand(dy, rule, self.values_dtype("mm", dy.device)) if rows else None), None

    def grouped_grad_operand(self, dout, route_weight, rule):
        rule = str(rule)
        values = self.values_dtype("grouped_mm", dout.device)
        if route_weight is None:
            return quantize_operand(dout, rule, values), dout
        rw = route_weight.reshape(-1)
        a = a_operand(
            values, custom_ops.route_weight_quantize, custom_ops.route_weight_quantize_dequantize, dout, rw, rule
        )  # the route-weight multiply fused into the quantize
        return a, route_weighted(dout, rw)  # fp32: quantized once, never via bf16

    def tokens_operand(self, x, rule):
        return (*custom_ops.quantize(_pad_tokens(x).t(), str(rule)), None)

    def wgrad_mm(self, dy_tokens, x_tokens, out_dtype):
        return mx_mm(
            dy_tokens[0],
            dy_tokens[1],
            x_tokens[0],
            x_tokens[1],
            out_dtype,
            self._native("mm", dy_tokens),
            None,
            dy_tokens[2],
        )

    def grouped_tokens_operand(self, t, offs, rule):
        # each group zero-padded to 32 rows (group_padding): (q [D, C], s [D, C/32], None)
        dest, _, capacity = group_padding(offs, t.shape[0])
        padded = t.new_zeros((capacity, t.shape[1])).index_copy(0, dest, t)
        return (*custom_ops.quantize(padded.t(), str(rule)), None)

    def grouped_wgrad(self, dy_tokens, x_tokens, offs, out_dtype):
        padded_offs = padded_group_ends(offs).to(torch.int32)
        native = self.runs_natively("grouped_mm_wgrad", dy_tokens[0].device)
        return mx_grouped_mm_wgrad(dy_tokens[0], dy_tokens[1], x_tokens[0], x_tokens[1], padded_offs, out_dtype, native)

    def wgrad_mm_into(self, dy_tokens, x_tokens, out, accumulate):
        mx_mm_into(
            dy_tokens[0],
            dy_tokens[1],
            x_tokens[0],
            x_tokens[1],
            out,
            accumulate,
            self._native("mm", dy_tokens),
            dy_tokens[2],
        )

    def grouped_wgrad_into(self, dy_tokens, x_tokens, offs, out, accumulate):
        padded_offs = padded_group_ends(offs).to(torch.int32)
        native = self.runs_natively("grouped_mm_wgrad", dy_tokens[0].device)
        mx_grouped_wgrad_into(
            dy_tokens[0], dy_tokens[1], x_tokens[0], x_tokens[1], padded_offs, out, accumulate, native
        )

    def dequantize(self, a, dtype):
        return custom_ops.dequantize(a[0], a[1], dtype)

    def saved_rows(self, a):
        return a[0], a[1]  # not the dequantized values: the backward decodes the pair

    def swiglu_backward(self, dh, packed):
        return swiglu.backward(dh, *swiglu_operand.unpack(packed))

    def rows_quantize_call(self, rule, device):
        dtype = self.values_dtype("grouped_mm", device)
        if dtype is None:
            return custom_ops.quantize, (str(rule),), 2
        return custom_ops.quantize_dequantize, (str(rule), dtype), 3

    def gather_forms(self, w, rule):
        q, s = device_path.quantize_lastdim(w, str(rule))
        qt, st = device_path.quantize_lastdim(w.transpose(-2, -1), str(rule))
        return {
            "forward": (q.contiguous().view(torch.uint8), s.contiguous()),
            # dgrad: W^T [..., K, N] blocked along N -> sent in W's layout: qdata [..., N, K], scales [..., N/32, K]
            # viewed as [..., N, K/32]
            "dgrad": (
                qt.transpose(-2, -1).contiguous().view(torch.uint8),
                st.transpose(-2, -1).contiguous().view(w.shape[:-1] + (w.shape[-1] // BLOCK_SIZE,)),
            ),
        }

    def gather_which(self, reshards_after_forward, in_backward):
        if not reshards_after_forward:
            return ("forward", "dgrad")  # gathered once per step: both forms
        return ("dgrad",) if in_backward else ("forward",)

    def gathered_pairs(self, which, outputs, shape):
        *lead, n, k = shape
        pairs = {}
        for i, o in enumerate(which):
            q, s = outputs[2 * i].view(torch.float8_e4m3fn).view(shape), outputs[2 * i + 1]
            if o == "forward":
                pairs[o] = (q, s.view(*lead, n, k // BLOCK_SIZE))
            else:
                pairs[o] = (q.transpose(-2, -1), s.reshape(*lead, n // BLOCK_SIZE, k).transpose(-2, -1))
        return pairs

    def gathered_values(self, pairs, dtype):
        if "forward" in pairs:
            return device_path.dequantize_lastdim(*pairs["forward"], dtype)
        return device_path.dequantize_lastdim(*pairs["dgrad"], dtype).transpose(-2, -1)

    def quant_stats(self, source, combine, operand, rule, layout, offs=None):
        # every layout is blocked along its last dim: rows [..., K], a weight [..., N, K] along K, the wgrad
        # operand of x [M, K] as it is made, the tokens zero-padded to a multiple of 32 and transposed [K, M'] (a
        # symbolic M's operand has more zero tokens, token_rows: only the first M' are read here), and a grouped
        # wgrad operand of x [S, K] as grouped_tokens_operand makes it, [K, C], of which the columns of x's rows are
        # kept (not the rows padding each group, nor the scratch block of the rows past the last end)
        x = self.stats_values(source, combine, layout)
        if layout == "tokens":
            x = _pad_tokens(x).t()
        elif layout == "group_tokens":
            dest, _, capacity = group_padding(offs, x.shape[0])
            dest = dest[: int(offs[-1])]  # the rows some group reads
            x = x[: dest.shape[0]]
            dq, saturated, exponents = self._decode(
                x.new_zeros(capacity, x.shape[1]).index_copy(0, dest, x).t(), operand, rule
            )
            return stats.Parts(x, dq[:, dest].t(), saturated[:, dest].t(), exponents)
        elif layout not in ("rows", "weight"):
            raise ValueError(f"mxfx.formats.mxfp8: layout={layout!r} is not valid; choose one of {stats.LAYOUTS}")
        return stats.Parts(x, *self._decode(x, operand, rule, layout == "tokens"))

    def fused_stats(self, source, combine, operand, rule, layout, offs=None):
        # every layout: the operand's region blocked along its last dim, the values read from their sources through
        # strided views in that layout (tokens: x^T, the zero tokens up to a multiple of 32 counted as the
        # reference counts them; group_tokens: x^T read through a column map of the padded operand, its padding
        # columns and scratch block counted nowhere); None (the reference) for a token layout of a source that is
        # not 2-D and for blocked scales of an operand that is not
        from mxfx.kernels.mx import quant_stats as fused  # imports Triton: the CUDA / interpreter path only

        a, b, w = self.stats_sources(source, combine)
        q, s, values = (*operand, None, None, None)[:3]
        if q is None or s is None:
            q = s = None
        cols = col_map = None
        if layout in ("rows", "weight"):
            blocked = s is not None and s.dim() == 1
            a, b, w, q, values, *rest = stats_views(a, b, w, q, values, *(() if blocked or s is None else (s,)))
            s = rest[0] if rest else s
            if blocked and q.dim() != 2:
                return None
        elif layout in ("tokens", "group_tokens"):
            if a.dim() != 2:
                return None
            rows = a.shape[0]
            a, b, w = (None if t is None else t.t() for t in (a, b, w))
            if layout == "tokens":
                cols = rows + (-rows) % BLOCK_SIZE
            else:
                dest, _, capacity = group_padding(offs, rows)
                read = torch.arange(rows, device=a.device) < offs[-1]  # the rows some group reads
                col_map = torch.full((capacity + 1,), -1, dtype=torch.int32, device=a.device).scatter_(
                    0, torch.where(read, dest, capacity), torch.arange(rows, dtype=torch.int32, device=a.device)
                )
                col_map = col_map[:capacity]
        else:
            return None
        return fused.stats_vector(a, b, w, q, s, values, str(rule), cols, col_map, stats.HIST_MIN, stats.HIST_BINS)

    def _decode(self, x, operand, rule, first_columns=False):
        """``(dequantized, saturated, exponents of the live blocks)`` of ``operand``, made from ``x`` blocked along
        its last dim; ``first_columns``: the operand may be wider than ``x`` (token_rows' padding), read its first
        columns."""
        q, s, values = (*operand, None, None, None)[:3]
        if q is None or s is None:  # an emulated GEMM's values alone: the reference's bytes (its kernels' too)
            q, s, _ = quantize_blocks(x, str(rule))
        elif is_blocked(q, s):  # a native dense GEMM's scale layout
            s = from_blocked(s, q.shape[0], q.shape[1] // BLOCK_SIZE)
        if first_columns:
            cols = x.shape[-1]
            q, s, values = q[:, :cols], s[:, : cols // BLOCK_SIZE], (None if values is None else values[:, :cols])
        dq = values.float() if values is not None else dequantize_lastdim(q, s, torch.float32)
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE).abs().amax(-1)
        live = torch.isfinite(blocks) & (blocks > 0)  # an all-zero block's scale says nothing
        return dq, q.float().abs() == E4M3_MAX, s.to(torch.int32)[live] - E8M0_BIAS

    def given_input(self, given, x, up):
        if given is None:
            return None
        if not isinstance(given, (tuple, list)) or len(given) not in (2, 3):
            raise ValueError("mxfx.grouped_mm: x_mx must be (qdata, scales) or (qdata, scales, dequantized values)")
        q, s, values = (*given, None) if len(given) == 2 else given
        if not isinstance(q, torch.Tensor) or not isinstance(s, torch.Tensor) or q.dtype != torch.float8_e4m3fn:
            raise ValueError(
                "mxfx.grouped_mm: x_mx needs x's qdata (float8_e4m3fn tensor) and scales (uint8 E8M0 tensor)"
            )
        if values is not None and (
            not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.element_size() < 2
        ):
            raise TypeError(
                f"mxfx.grouped_mm: the values in x_mx must be the dequantized tensor (bf16/fp16/fp32), got "
                f"{getattr(values, 'dtype', type(values).__name__)}"
            )
        k = x.shape[-1]
        if (
            up is not None
            or q.shape != x.shape
            or s.shape != (*x.shape[:-1], k // BLOCK_SIZE)
            or (values is not None and values.shape != x.shape)
        ):
            shapes = " / ".join(str(tuple(t.shape)) for t in given if t is not None)
            raise ValueError(
                f"mxfx.grouped_mm: x_mx of shapes {shapes} must be the MX pair of x {tuple(x.shape)} "
                f"([S, K] / [S, K/32], and values [S, K] if given) and cannot be combined with a SwiGLU "
                f"up operand"
            )
        return q, s, values


FORMAT = register(MXFP8())
