"""fp8_block: an E4M3 payload and one FP32 scale per 1x128 tile of an activation or gradient (along the GEMM's
reduction dim) and per 128x128 block of a weight; the DeepSeek-V3 / Float8BlockScaling recipe, native on Hopper
(``docs/block_format.md``, reference math :mod:`mxfx.numerics.block`).

Every GEMM is ``A @ B^T`` with both operands tiled along its reduction dim:

* forward ``Y = Q(X) . Q(W)^T``: X in 1x128 tiles along K, W in 128x128 blocks (the "forward" weight cache);
* dgrad ``dX = Q(dY) . Q(W^T)^T``: dY 1x128 along N, the same 128x128 grid read as W^T ("dgrad");
* wgrad ``dW = Q(dY^T) . Q(X^T)^T``: both operands in 1x128 tiles along the tokens (for routed experts
  restarting at every group start; for a dense linear with a symbolic token count, zero-padded per
  :func:`token_rows`).

An operand is ``(qdata float8_e4m3fn, scales float32)``. On sm90 the GEMMs are FP8 tensor-core GEMMs (cuBLAS
blockwise dense, Triton grouped), on CPU the exact FP32 decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxfx.formats.base import GEMM_OPS, Format, ScaleRule, described, register, route_weighted, stats_views
from mxfx.kernels.fp8_block import custom_ops, device_path
from mxfx.kernels.fp8_block import gemm as block_gemm
from mxfx.kernels.common import swiglu
from mxfx.kernels.common.custom_ops import swiglu_product
from mxfx.numerics.block import TILE, dequantize_128x128, dequantize_values, group_token_slots, n_tiles
from mxfx.numerics.mx import E4M3_MAX
from mxfx.runtime import cache, stats


def token_rows(m):
    """Rows of a linear's token-tiled wgrad operands for ``m`` tokens: ``m`` itself (a partial last tile needs no
    padding); for a symbolic ``m`` (dynamic shapes: a data-dependent expert split), ``m`` zero-padded to whole
    128-row tiles, at least two.

    The symbolic count is one expression for every ``m`` (``torch.sym_max``, no branch on its value): torch's
    contiguity checks ask whether each dim of a tensor is 1, and a scale dim ``ceil(m/128)`` that may be one tile
    would be guarded on, recompiling the graph whenever an expert's rows cross 128; whole tiles also make the count
    a known multiple of 16 (what the cuBLAS GEMM pads its K to). Zero rows leave each tile's amax, so the first
    ``m`` tokens' bytes, as they are, and add nothing to the wgrad's token reduction.
    """
    return TILE * torch.sym_max(2, -(-m // TILE)) if isinstance(m, torch.SymInt) else m


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """``t`` zero-padded along dim 0 to :func:`token_rows` rows; ``t`` itself for a static count."""
    m = t.shape[0]
    return F.pad(t, (0, 0, 0, token_rows(m) - m)) if isinstance(m, torch.SymInt) else t


# --- weight forms (mxfx.runtime.cache) -------------------------------------------------------------
#
# One 128x128 grid of W serves both GEMMs: "block_forward" is ``(qdata [..., N, K], scales [..., ceil(N/128),
# ceil(K/128)])``, "block_dgrad" the same qdata and scales transposed (``[..., K, N]`` contiguous): a 128x128
# block has no orientation, so the dgrad copy is W's forward grid read as W^T, quantized once.

_FORMS = {"block_forward": "forward", "block_dgrad": "dgrad"}


def _build(weight: torch.Tensor, rule: str, forms, have: dict) -> dict:
    """The forms ``forms``: the transpose of the other form where ``have`` holds it, else from one 128x128
    quantize of ``weight`` (which serves both)."""
    known = next((f for f in _FORMS if (rule, f) in have), None)
    if known is not None:
        q, s = have[(rule, known)]
        if known == "block_dgrad":
            q, s = device_path.transpose_qdata(q), s.transpose(-2, -1)
    else:
        cache.counts["quantize_block"] += 1
        cache.counts["quantize"] += 1
        q, s = device_path.quantize_128x128(weight.detach(), rule)
    out = {}
    for f in forms:
        if f == "block_forward":
            out[(rule, f)] = (q.contiguous(), s.contiguous())
        else:
            out[(rule, f)] = (device_path.transpose_qdata(q), s.transpose(-2, -1).contiguous())
    return out


def _fake(weight: torch.Tensor, form: str) -> tuple:
    *lead, n, k = weight.shape
    rows, cols = (n, k) if _FORMS[form] == "forward" else (k, n)
    q = weight.new_empty([*lead, rows, cols], dtype=torch.float8_e4m3fn)
    return q, weight.new_empty([*lead, n_tiles(rows), n_tiles(cols)], dtype=torch.float32)


def _install(weight: torch.Tensor, form: str, qdata: torch.Tensor, scales: torch.Tensor) -> tuple:
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in (qdata, scales))


FORMS = cache.register(
    cache.FormFamily(
        name="fp8_block",
        forms=tuple(_FORMS),
        dgrad_side=frozenset({"block_dgrad"}),
        rules=("rceil", "amax"),
        build=_build,
        fake=_fake,
        install=_install,
        layout=lambda weight: None,
        check=lambda weight, form: None,
    )
)


def _group_tokens_parts(x: torch.Tensor, operand, offs: torch.Tensor) -> stats.Parts:
    """Statistics parts of a grouped wgrad operand ``(qdata [K, 128 C], scales [K, C])`` of ``x [S, K]``: 1x128 tiles
    along each group's tokens, one per 128-column slot, group g's at slots ``group_tile_starts(offs)[g] + j``; the
    rows past the last group end (which no group reads) are left out."""
    q, s = operand[0], operand[1]
    column = group_token_slots(offs, int(offs[-1]))  # every token some group reads
    slot = column // TILE
    xt = x[: column.shape[0]].t()
    # a tile's scale says something when it holds a nonzero value and no value that is not finite (not an all-zero
    # tile's 1.0, nor an unused slot's)
    nonzero, nonfinite = (xt.new_zeros(s.shape).index_add_(1, slot, m.float()) for m in (xt != 0, ~torch.isfinite(xt)))
    live = (nonzero > 0) & (nonfinite == 0)
    qt = q[:, column].float()
    return stats.Parts(xt, qt * s[:, slot], qt.abs() == E4M3_MAX, torch.frexp(s[live])[1] - 1)


class FP8Block(Format):
    name = "fp8_block"
    scale_rules = (ScaleRule.RCEIL, ScaleRule.AMAX)
    block = TILE
    weight_block = (TILE, TILE)
    feature_multiple = TILE
    bytes_per_value = 1 + 4 / TILE  # E4M3 plus a 4-byte scale per 1x128 tile; its saved copies are not padded
    scale_dtype = torch.float32
    transport = "mxfp8"  # no fp8_block all-to-all kernel: expert-parallel payloads travel as MXFP8
    native_gemms = {"sm90": frozenset(GEMM_OPS)}  # cuBLAS blockwise dense, Triton grouped (FP8 tl.dot)
    gather_row_multiple = TILE
    colour = "#7fd1c7"
    description = "fp8_block: rceil/amax FP32 scales per 1x128 tile and 128x128 weight block"

    def input_operand(self, x, up, rule, op):
        rule = str(rule)
        return custom_ops.block_quantize(x, rule) if up is None else custom_ops.block_swiglu_quantize(x, up, rule)

    def check_input_operand(self, op, operand, x):
        tensors = tuple(operand) if isinstance(operand, (tuple, list)) else ()
        want = (x.shape[0], -(-x.shape[-1] // TILE))
        if not (
            len(tensors) == 2
            and all(isinstance(t, torch.Tensor) for t in tensors)
            and tensors[0].dtype == torch.float8_e4m3fn
            and tensors[0].shape == x.shape
            and tensors[1].dtype == torch.float32
            and tuple(tensors[1].shape) == want
        ):
            raise ValueError(
                f"{op}: under format='fp8_block' the rows operand of x {tuple(x.shape)} is x's 1x128 tiles (qdata "
                f"float8_e4m3fn {tuple(x.shape)}, float32 scales {want}); got {described(operand)}: make it with "
                f"the same format (mxfx.ops.linear.mx_linear_input(x, format='fp8_block'))"
            )

    def forward_operands(self, x, up, rule, save, tokens, offs=None, given=None):
        rule = str(rule)
        source = (x if up is None else swiglu_product(x, up)) if tokens else None  # the forward quantize's values
        if given is not None:  # x quantized before the dispatch's row gather (mxfx.passes.dispatch_mx); up is None
            t = self.grouped_tokens_operand(source, offs, rule) if tokens else None
            return tuple(given), t, ()
        pack = up is not None and save == "mxfp8"
        if tokens and offs is None:
            source = _pad_tokens(source)  # a symbolic count: whole tiles, no guard on "one tile" (token_rows)
        out = custom_ops.block_forward_operands(x, up, source, offs, rule, pack)  # every pair from one read
        a, rest = (out[0], out[1]), out[2:]
        t = tuple(rest[:2]) if tokens else None
        packed = tuple(rest[2 if tokens else 0 :]) if pack else ((x, up) if up is not None else ())
        return a, t, packed

    def weight_operand(self, weight, rule, orientation, keep_dequantized=False):
        return cache.weight_form(weight, str(rule), "block_" + orientation)

    def mm(self, a, b, out_dtype):
        return custom_ops.block_mm(a[0], a[1], b[0], b[1], out_dtype)

    def grouped_mm(self, a, b, offs, out_dtype):
        return custom_ops.block_grouped_mm(a[0], a[1], b[0], b[1], offs, out_dtype)

    def grouped_kernel(self, device, k, n, out_dtype):
        return block_gemm.grouped_kernel_for(device, k, n, out_dtype)

    def grad_operands(self, dy, rule, rows, tokens):
        rule = str(rule)
        padded = _pad_tokens(dy) if tokens else dy
        if rows and tokens and padded is dy:  # both tilings of dY from one read
            q, s, qt, st = custom_ops.block_quantize_dual(dy, rule)
            return (q, s), (qt, st)
        # a symbolic token count: the rows of dY as they are, its token tiles from the zero-padded copy
        dy_rows = tuple(custom_ops.block_quantize(dy, rule)) if rows else None
        return dy_rows, (tuple(custom_ops.block_quantize_tokens(padded, rule)) if tokens else None)

    def grouped_grad_operand(self, dout, route_weight, rule):
        if route_weight is None:
            return tuple(custom_ops.block_quantize(dout, str(rule))), dout
        # the route-weight multiply fused into the quantize: no product written for it
        rw = route_weight.reshape(-1)
        return tuple(custom_ops.block_route_weight_quantize(dout, rw, str(rule))), route_weighted(dout, rw)

    def route_grad_operands(self, dout, route_weight, y_unweighted, rule):
        q, s, dy, d_route_weight = custom_ops.block_route_grad_operands(
            dout, route_weight.reshape(-1), y_unweighted, str(rule)
        )
        return (q, s), dy, d_route_weight

    def grouped_grad_operands(self, dout, route_weight, offs, rule):
        rw = None if route_weight is None else route_weight.reshape(-1)
        q, s, qt, st = custom_ops.block_grouped_grad_operands(dout, rw, offs, str(rule))
        return (q, s), (qt, st)

    def tokens_operand(self, x, rule):
        return tuple(custom_ops.block_quantize_tokens(_pad_tokens(x), str(rule)))

    def wgrad_mm(self, dy_tokens, x_tokens, out_dtype):
        return custom_ops.block_mm(dy_tokens[0], dy_tokens[1], x_tokens[0], x_tokens[1], out_dtype)

    def grouped_tokens_operand(self, t, offs, rule):
        return tuple(custom_ops.block_quantize_grouped_tokens(t, offs, str(rule)))

    def grouped_wgrad(self, dy_tokens, x_tokens, offs, out_dtype):
        return custom_ops.block_grouped_wgrad(dy_tokens[0], dy_tokens[1], x_tokens[0], x_tokens[1], offs, out_dtype)

    def wgrad_mm_into(self, dy_tokens, x_tokens, out, accumulate):
        custom_ops.block_mm_into(dy_tokens[0], dy_tokens[1], x_tokens[0], x_tokens[1], out, accumulate)

    def grouped_wgrad_into(self, dy_tokens, x_tokens, offs, out, accumulate):
        custom_ops.block_grouped_wgrad_into(dy_tokens[0], dy_tokens[1], x_tokens[0], x_tokens[1], offs, out, accumulate)

    def dequantize(self, a, dtype):
        return dequantize_values(a[0], a[1], (-1,)).to(dtype)

    def saved_rows(self, a):
        return a

    def swiglu_backward(self, dh, packed):
        if len(packed) == 4:
            gq, gs, uq, us = packed
            packed = (self.dequantize((gq, gs), torch.float32), self.dequantize((uq, us), torch.float32))
        return swiglu.backward(dh, *packed)

    def rows_quantize_call(self, rule, device):
        return torch.ops.mxfx.block_quantize.default, (str(rule),), 2

    def gather_forms(self, w, rule):
        q, s = device_path.quantize_128x128(w, str(rule))
        return {"block": (q.contiguous().view(torch.uint8), s.contiguous())}

    def gather_which(self, reshards_after_forward, in_backward):
        return ("block",)  # one 128x128 grid serves forward and dgrad

    def gathered_pairs(self, which, outputs, shape):
        *lead, n, k = shape
        q = outputs[0].view(torch.float8_e4m3fn).view(shape)
        s = outputs[1].view(*lead, -1, n_tiles(k))
        return {"block_forward": (q, s), "block_dgrad": (q.transpose(-2, -1), s.transpose(-2, -1))}

    def gathered_values(self, pairs, dtype):
        return dequantize_128x128(*pairs["block_forward"], dtype)

    def quant_stats(self, source, combine, operand, rule, layout, offs=None):
        # rows [..., K] in 1x128 tiles along K, the wgrad operand of x [T, K] as x^T [K, T] in 1x128 tiles along the
        # tokens (its first T tokens: any past them are token_rows' zero padding), a weight [..., N, K] in 128x128
        # blocks; a dim that 128 does not divide ends in a shorter tile
        x = self.stats_values(source, combine, layout)
        if layout == "group_tokens":
            return _group_tokens_parts(x, operand, offs)
        q, s = operand[0], operand[1]
        if layout == "tokens":
            x = x.t()
            q, s = q[:, : x.shape[1]], s[:, : n_tiles(x.shape[1])]
        elif layout not in ("rows", "weight"):
            raise ValueError(f"mxfx.formats.fp8_block: layout={layout!r} is not valid; choose one of {stats.LAYOUTS}")
        *lead, n, k = x.shape
        if layout == "weight":
            padded = F.pad(x, (0, n_tiles(k) * TILE - k, 0, n_tiles(n) * TILE - n)).abs()
            amax = padded.reshape(*lead, n_tiles(n), TILE, n_tiles(k), TILE).amax(dim=(-3, -1))
            dq = dequantize_values(q, s, (-2, -1))
        else:
            padded = F.pad(x, (0, n_tiles(k) * TILE - k)).abs()
            amax = padded.reshape(*lead, n, n_tiles(k), TILE).amax(-1)
            dq = dequantize_values(q, s, (-1,))
        live = torch.isfinite(amax) & (amax > 0)  # an all-zero tile's scale (1.0) says nothing
        exponents = torch.frexp(s[live])[1] - 1  # floor(log2 scale): exact for rceil's powers of two
        return stats.Parts(x, dq, q.float().abs() == E4M3_MAX, exponents)

    def fused_stats(self, source, combine, operand, rule, layout, offs=None):
        # the layouts of quant_stats, the values read from their sources through strided views in the operand's
        # layout; a grouped wgrad operand through a column map: group g's tokens at columns 128 * (its first tile
        # slot) + j, so that every 128 columns are one scale slot, the rest counted nowhere; None (the reference) for
        # a token layout of a source that is not 2-D
        from mxfx.kernels.fp8_block import quant_stats as fused  # imports Triton: the CUDA / interpreter path only

        a, b, w = self.stats_sources(source, combine)
        q, s = operand[0], operand[1]
        col_map, rows_per_scale = None, TILE if layout == "weight" else 1
        if layout in ("rows", "weight"):
            a, b, w, q, s = stats_views(a, b, w, q, s)
        elif layout in ("tokens", "group_tokens"):
            if a.dim() != 2:
                return None
            tokens = a.shape[0]
            a, b, w = (None if t is None else t.t() for t in (a, b, w))
            if layout == "tokens":  # the first tokens of a zero-padded operand (token_rows)
                q, s = q[:, :tokens], s[:, : n_tiles(tokens)]
            else:
                column = group_token_slots(offs, tokens)  # -1: a row past the last group, which no group reads
                width = TILE * s.shape[1]
                col_map = torch.full((width + 1,), -1, dtype=torch.int32, device=a.device).scatter_(
                    0, torch.where(column >= 0, column, width), torch.arange(tokens, dtype=torch.int32, device=a.device)
                )[:width]
        else:
            return None
        return fused.stats_vector(a, b, w, q, s, rows_per_scale, col_map, stats.HIST_MIN, stats.HIST_BINS)

    def given_input(self, given, x, up):
        if given is None:
            return None
        if up is not None:
            raise ValueError(
                f"mxfx.grouped_mm: under format='fp8_block' x_mx (x's 1x128 tiles) cannot be combined with up; "
                f"give x {tuple(x.shape)} alone or drop x_mx"
            )
        self.check_input_operand("mxfx.grouped_mm (x_mx)", given, x)
        return tuple(given)


FORMAT = register(FP8Block())
