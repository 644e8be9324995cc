"""bf16_gemm: BF16 GEMMs from BF16 copies of the FP32 main weights, no scales.

What autocast does for a linear, made explicit and cached: each weight is cast to BF16 once per optimizer step (the
weight cache, forms "bf16_forward" and its transpose view "bf16_dgrad"), activations and gradients are cast to BF16
per GEMM, products accumulate in FP32 and the wgrad GEMMs write the FP32 gradient themselves (on CUDA the routed
one through a BF16 grouped GEMM widened inside its op: :func:`mxfx.kernels.common.custom_ops.hp_grouped_wgrad`). It is
what a policy asks for where it wants BF16 GEMMs that autocast cannot reach (transformers' FP32 grouped-GEMM fallback
for routed experts with FP32 main weights), and the fair BF16 baseline of the low-precision formats: same recipe,
same caches.

``precision="bf16"`` is another thing: the op is left exactly as the model wrote it. An operand is ``(values bf16,)``.
"""

from __future__ import annotations

import torch

from mxfx.formats.base import GEMM_OPS, Format, ScaleRule, described, register, route_weighted
from mxfx.kernels.common import swiglu
from mxfx.kernels.common.custom_ops import hp_grouped_wgrad, hp_grouped_wgrad_into, hp_mm_into, hp_mm_transposed
from mxfx.kernels.common.silu import swiglu_fp32
from mxfx.runtime import cache, stats

_BF16 = torch.bfloat16


# --- weight forms (mxfx.runtime.cache) -------------------------------------------------------------
#
# "bf16_forward": ``(W.to(bf16) [..., N, K],)``; "bf16_dgrad": its transpose view ``[..., K, N]`` (no second copy).


def _build(weight: torch.Tensor, rule: str, forms, have: dict) -> dict:
    forward = have.get((rule, "bf16_forward"))
    if forward is None:
        cache.counts["quantize_bf16"] += 1
        cache.counts["quantize"] += 1
        # a fresh copy even of a contiguous BF16 weight: the cache op returns no view of its input
        forward = (torch.empty_like(weight, dtype=_BF16, memory_format=torch.contiguous_format).copy_(weight.detach()),)
    return {(rule, f): forward if f == "bf16_forward" else (forward[0].transpose(-2, -1),) for f in forms}


def _fake(weight: torch.Tensor, form: str) -> tuple:
    w = weight.new_empty(weight.shape, dtype=_BF16)
    return (w if form == "bf16_forward" else w.transpose(-2, -1),)


def _install(weight, form, qdata, scales):
    raise RuntimeError(
        "mxfx.formats.bf16_gemm: weights are not gathered in this format (FSDP2 gathers them as parameters)"
    )


FORMS = cache.register(
    cache.FormFamily(
        name="bf16_gemm",
        forms=("bf16_forward", "bf16_dgrad"),
        dgrad_side=frozenset({"bf16_dgrad"}),
        rules=tuple(r.value for r in ScaleRule),
        build=_build,
        fake=_fake,
        install=_install,
        layout=lambda weight: None,
        check=lambda weight, form: None,
    )
)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b^T`` of BF16 operands with FP32 accumulation. On the CPU the GEMM itself reads BF16 (a BF16 result,
    widened): an FP32 GEMM of their upcasts would let Inductor fold each cast away, and the operands would not be
    BF16 at all."""
    if a.device.type == "cpu":
        return torch.mm(a, b.t()).to(out_dtype)
    return hp_mm_transposed(a, b, out_dtype)


class BF16Gemm(Format):
    name = "bf16_gemm"
    scale_rules = ()  # no scales: any rule is accepted and changes nothing
    block = 1
    weight_block = (1, 1)
    feature_multiple = 8  # 16-byte aligned rows, as CUDA's grouped GEMM needs
    feature_multiple_from = "BF16 GEMM alignment: 16-byte rows"  # no blocks
    bytes_per_value = 2.0
    scale_dtype = _BF16
    transport = "mxfp8"  # the expert-parallel all-to-all is decided by Policy.transport
    gather_row_multiple = 0  # FSDP2 gathers these weights as parameters
    native_gemms = {arch: frozenset(GEMM_OPS) for arch in ("sm80", "sm90", "sm100", "sm120")}  # BF16 tensor cores
    colour = "#f2c57c"
    description = "bf16_gemm: BF16 GEMMs from BF16 copies of the FP32 main weights, no scales"

    def input_operand(self, x, up, rule, op):
        # a SwiGLU product with mxfx's fp32 SiLU, as the other formats' fused SwiGLU quantizes form it
        return ((x if up is None else swiglu_fp32(x, up)).to(_BF16),)

    def check_input_operand(self, op, operand, x):
        tensors = tuple(operand) if isinstance(operand, (tuple, list)) else ()
        if not (len(tensors) == 1 and isinstance(tensors[0], torch.Tensor) and tensors[0].dtype == _BF16):
            raise ValueError(
                f"{op}: under format='bf16_gemm' the rows operand of x {tuple(x.shape)} is (x in bfloat16,); got "
                f"{described(operand)}: make it with the same format "
                f"(mxfx.ops.linear.mx_linear_input(x, format='bf16_gemm'))"
            )
        if tensors[0].shape != x.shape:
            raise ValueError(f"{op}: the rows operand {tuple(tensors[0].shape)} is not of x's shape {tuple(x.shape)}")

    def forward_operands(self, x, up, rule, save, tokens, offs=None, given=None):
        a = self.input_operand(x, up, rule, "mm")
        return a, (a if tokens else None), (() if up is None else (x, up))

    def weight_operand(self, weight, rule, orientation, keep_dequantized=False):
        if weight.dtype == _BF16:  # already the operand: no copy to cache (and an op may not return its input)
            w = weight.detach().contiguous()  # as the cached copy would be (no copy for a contiguous weight)
            return (w if orientation == "forward" else w.transpose(-2, -1),)
        return cache.weight_form(weight, str(rule), "bf16_" + orientation)

    def mm(self, a, b, out_dtype):
        return _mm(a[0], b[0], out_dtype)

    def grouped_mm(self, a, b, offs, out_dtype):
        # torch's grouped GEMM: rows past offs[-1] are left unwritten (the other formats write zeros there)
        if a[0].shape[0] == 0:  # no rows, which torch's grouped GEMM refuses
            return a[0].new_empty((0, b[0].shape[-2]), dtype=out_dtype)
        return torch._grouped_mm(a[0], b[0].transpose(-2, -1), offs).to(out_dtype)

    def grad_operands(self, dy, rule, rows, tokens):
        a = (dy.to(_BF16),) if rows or tokens else None
        return (a if rows else None), (a if tokens else None)

    def grouped_grad_operand(self, dout, route_weight, rule):
        dy = route_weighted(dout, route_weight)
        return (dy.to(_BF16),), dy

    def tokens_operand(self, x, rule):
        return (x.to(_BF16),)

    def wgrad_mm(self, dy_tokens, x_tokens, out_dtype):
        # the weight gradient in out_dtype (FP32 for an FP32 main weight) from the GEMM itself, on the CPU too
        return hp_mm_transposed(dy_tokens[0].t(), x_tokens[0].t(), out_dtype)

    def grouped_tokens_operand(self, t, offs, rule):
        return (t.to(_BF16),)

    def grouped_wgrad(self, dy_tokens, x_tokens, offs, out_dtype):
        return hp_grouped_wgrad(dy_tokens[0], x_tokens[0], offs, out_dtype)

    def wgrad_mm_into(self, dy_tokens, x_tokens, out, accumulate):
        hp_mm_into(dy_tokens[0], x_tokens[0], out, accumulate)

    def grouped_wgrad_into(self, dy_tokens, x_tokens, offs, out, accumulate):
        hp_grouped_wgrad_into(dy_tokens[0], x_tokens[0], offs, out, accumulate)

    def dequantize(self, a, dtype):
        return a[0].to(dtype)

    def saved_rows(self, a):
        return a

    def swiglu_backward(self, dh, packed):
        return swiglu.backward(dh, *packed)

    def rows_quantize_call(self, rule, device):
        return None  # a BF16 copy made before a row gather saves nothing

    def quant_stats(self, source, combine, operand, rule, layout, offs=None):
        # the operand is the values' BF16 copy in their own layout; a grouped one's rows past the last group end
        # (which no group reads) are left out
        x, dq = self.stats_values(source, combine, layout), operand[0].float()
        if layout == "group_tokens":
            x, dq = x[: int(offs[-1])], dq[: int(offs[-1])]
        return stats.Parts(x, dq, torch.zeros_like(x, dtype=torch.bool), x.new_empty(0, dtype=torch.int32))

    def given_input(self, given, x, up):
        if given is not None:
            raise ValueError(
                f"mxfx.grouped_mm: format='bf16_gemm' takes no quantized rows (x_mx); got "
                f"{type(given).__name__} for x {tuple(x.shape)}"
            )
        return None


FORMAT = register(BF16Gemm())
