"""MXFP8 (OCP Microscaling v1.0): an E4M3 payload and one E8M0 power-of-two scale per 32 values.

Operands are blocked along each GEMM's reduction dim (``docs/format.md``):

* forward ``Y = MX(X) . MX(W)^T``: X rowwise (along K), W rowwise (along K, the "forward" weight cache);
* dgrad ``dX = MX(dY) . MX(W)``: dY rowwise (along N), W blocked down its columns from W itself ("dgrad");
* wgrad ``dW = MX(dY)^T . MX(X)``: both blocked along tokens, zero-padded to a multiple of 32 (per expert
  group for routed experts, so no 32-block mixes two experts' rows).

An operand is ``(qdata, scales, values)``: ``values`` is its dequantization written by the same pass where
the GEMM is emulated (Hopper, CPU; :func:`mxfx.kernels.device.emulated_operand_dtype`), else None; where the
emulated GEMM reads the values alone, qdata and scales may be None. Native MX GEMMs (Blackwell) read
qdata and scales, a dense operand's scales in the blocked layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxfx.formats.base import Format, Operand, ScaleRule, register
from mxfx import kernels
from mxfx.kernels import custom_ops, mx_swiglu
from mxfx.kernels.device import emulated_operand_dtype
from mxfx.kernels.mx_gemm import (a_operand, mx_grouped_mm, mx_grouped_mm_wgrad, mx_mm, quantize_dual_operand,
                                  quantize_operand)
from mxfx.numerics import layout
from mxfx.numerics.mx import BLOCK_SIZE
from mxfx.runtime.cache import weight_operands


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """Zero-pad dim 0 to a multiple of 32 (zero rows add nothing to a token-reduction GEMM)."""
    return F.pad(t, (0, 0, 0, (-t.shape[0]) % BLOCK_SIZE))


def _token_blocked(t: torch.Tensor, offs: torch.Tensor, rule: str):
    """MX of ``t [S, D]`` blocked along tokens per expert group, each group zero-padded to 32 rows:
    ``(q [D, C], s [D, C/32], None)``."""
    dest, _, capacity = layout.group_padding(offs, t.shape[0])
    padded = t.new_zeros((capacity, t.shape[1])).index_copy(0, dest, t)
    return (*custom_ops.quantize(padded.t(), rule), None)


class MXFP8(Format):
    name = "mxfp8"
    scale_rules = (ScaleRule.RCEIL, ScaleRule.FLOOR)
    block = BLOCK_SIZE
    weight_block = (1, BLOCK_SIZE)
    feature_multiple = BLOCK_SIZE
    bytes_per_value = 1 + 1 / BLOCK_SIZE
    scale_dtype = torch.uint8
    transport = "mxfp8"
    native_archs = ("sm100", "sm120")
    dequantized_weight_forms = True
    gather_row_multiple = BLOCK_SIZE
    colour = "#9be7a0"
    description = "mxfp8: rceil/floor E8M0 scales per 32 values"

    def saved_bytes(self, numel, tokens=None, k=None):
        if tokens is not None and k is not None:  # a linear's MX wgrad pads its tokens to a multiple of 32
            numel = -(-tokens // BLOCK_SIZE) * BLOCK_SIZE * k
        return numel + numel // BLOCK_SIZE

    def input_operand(self, x, up, rule, op):
        return mx_swiglu.quantize_input(x, up, str(rule), op)

    def forward_operands(self, x, up, rule, save, tokens, offs=None, given=None):
        rule = str(rule)
        op = "mm" if offs is None else "grouped_mm"
        packed = ()
        if up is not None:  # SwiGLU quantized straight from gate and up, gate/up saved per ``save`` in the same pass
            q, s, hat, packed = mx_swiglu.quantize_input_and_pack(x, up, save, rule, op)
            a = (q, s, hat)
        elif given is not None:
            a = given
        elif tokens and offs is None:
            # rowwise for the forward and token-blocked for wgrad from one read; native dense GEMMs get both
            # scale matrices in their blocked layout (not cut to m rows: padded zero rows have scale byte 0,
            # the layout's own padding)
            m = x.shape[0]
            native = emulated_operand_dtype("mm", x.device) is None
            dual = custom_ops.quantize_dual_blocked if native else custom_ops.quantize_dual
            q, s, qt, st = dual(_pad_tokens(x), rule)
            return (q[:m], s if native else s[:m], None), (qt, st, None), packed
        else:
            a = quantize_operand(x, rule, op)
        if not tokens:
            return a, None, packed
        h = x if up is None else mx_swiglu.swiglu_fp32(x, up)
        if offs is None:
            return a, (*custom_ops.quantize(_pad_tokens(h).t(), rule), None), packed
        return a, _token_blocked(h, offs, rule), packed

    def weight_operand(self, weight, rule, orientation, keep_dequantized=False):
        return weight_operands(weight, str(rule), orientation, keep_dequantized)

    def mm(self, a, b, out_dtype):
        return mx_mm(a[0], a[1], b[0], b[1], out_dtype, b[2], a[2])

    def grouped_mm(self, a, b, offs, out_dtype):
        return mx_grouped_mm(a[0], a[1], b[0], b[1], offs, out_dtype, b[2], a[2])

    def grad_operands(self, dy, rule, rows, tokens):
        rule = str(rule)
        if tokens:  # rowwise for dgrad and token-blocked for wgrad, from one read
            m = dy.shape[0]
            q, s, hat, qt, st, hat_t = quantize_dual_operand(_pad_tokens(dy), rule)
            # the first m token rows; scales in the blocked layout (native GEMMs) stay whole
            q, s, hat = (t if t is None or t.dim() == 1 else t[:m] for t in (q, s, hat))
            return ((q, s, hat) if rows else None), (qt, st, hat_t)
        return (quantize_operand(dy, rule) if rows else None), None

    def grouped_grad_operand(self, dout, route_weight, rule):
        rule = str(rule)
        if route_weight is None:
            return quantize_operand(dout, rule, "grouped_mm"), dout
        rw = route_weight.reshape(-1)
        a = a_operand("grouped_mm", custom_ops.route_weight_quantize, custom_ops.route_weight_quantize_dequantize,
                      dout, rw, rule)  # the route-weight multiply fused into the quantize
        return a, dout.float() * rw.reshape(-1, 1).float()  # fp32: quantized once, never via bf16

    def tokens_operand(self, x, rule):
        return (*custom_ops.quantize(_pad_tokens(x).t(), str(rule)), None)

    def wgrad_mm(self, dy_tokens, x_tokens, out_dtype):
        return mx_mm(dy_tokens[0], dy_tokens[1], x_tokens[0], x_tokens[1], out_dtype, None, dy_tokens[2])

    def grouped_wgrad(self, dy, x_tokens, offs, rule, out_dtype):
        _, padded_offs, _ = layout.group_padding(offs, dy.shape[0])
        dq, ds, _ = _token_blocked(dy, offs, str(rule))
        return mx_grouped_mm_wgrad(dq, ds, x_tokens[0], x_tokens[1], padded_offs, out_dtype)

    def dequantize(self, a, dtype):
        return custom_ops.dequantize(a[0], a[1], dtype)

    def saved_rows(self, a):
        return a[0], a[1]  # not the dequantized values: the backward decodes the pair

    def swiglu_backward(self, dh, packed):
        return mx_swiglu.backward(dh, packed)

    def rows_quantize_call(self, rule, device):
        dtype = emulated_operand_dtype("grouped_mm", device)
        if dtype is None:
            return custom_ops.quantize, (str(rule),), 2
        return custom_ops.quantize_dequantize, (str(rule), dtype), 3

    def gather_forms(self, w, rule):
        q, s = kernels.quantize_lastdim(w, str(rule))
        qt, st = kernels.quantize_lastdim(w.transpose(-2, -1), str(rule))
        return {
            "forward": (q.contiguous().view(torch.uint8), s.contiguous()),
            # dgrad: W^T [..., K, N] blocked along N -> sent in W's layout: qdata [..., N, K], scales [..., N/32, K]
            # viewed as [..., N, K/32]
            "dgrad": (qt.transpose(-2, -1).contiguous().view(torch.uint8),
                      st.transpose(-2, -1).contiguous().view(w.shape[:-1] + (w.shape[-1] // BLOCK_SIZE,))),
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
            return kernels.dequantize_lastdim(*pairs["forward"], dtype)
        return kernels.dequantize_lastdim(*pairs["dgrad"], dtype).transpose(-2, -1)

    def given_input(self, given, x, up):
        if given is None:
            return None
        if not isinstance(given, (tuple, list)) or len(given) not in (2, 3):
            raise ValueError("mxfx.grouped_mm: x_mx must be (qdata, scales) or (qdata, scales, dequantized values)")
        q, s, values = (*given, None) if len(given) == 2 else given
        if not isinstance(q, torch.Tensor) or not isinstance(s, torch.Tensor) or q.dtype != torch.float8_e4m3fn:
            raise ValueError("mxfx.grouped_mm: x_mx needs x's qdata (float8_e4m3fn tensor) and scales (uint8 E8M0 tensor)")
        if values is not None and (not isinstance(values, torch.Tensor) or not values.is_floating_point()
                                   or values.element_size() < 2):
            raise TypeError(f"mxfx.grouped_mm: the values in x_mx must be the dequantized tensor (bf16/fp16/fp32), got "
                            f"{getattr(values, 'dtype', type(values).__name__)}")
        k = x.shape[-1]
        if up is not None or q.shape != x.shape or s.shape != (*x.shape[:-1], k // BLOCK_SIZE) or (
                values is not None and values.shape != x.shape):
            shapes = " / ".join(str(tuple(t.shape)) for t in given if t is not None)
            raise ValueError(f"mxfx.grouped_mm: x_mx of shapes {shapes} must be the MX pair of x {tuple(x.shape)} "
                             f"([S, K] / [S, K/32], and values [S, K] if given) and cannot be combined with a SwiGLU "
                             f"up operand")
        return q, s, values


FORMAT = register(MXFP8())
