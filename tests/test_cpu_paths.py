"""The CPU reference paths take shortcuts that must not change a value.

* ``mxfx.numerics.mx.quantize_blocks`` blocks down dim -2 in x's own layout (no transpose) and writes
  the dequantized values from the same pass: bit-identical to ``quantize_lastdim`` of the transpose
  and to ``dequantize_lastdim`` of the pair (special blocks included).
* ``mxfx::grouped_wgrad_bf16`` runs in FP32 on CPUs without native BF16 GEMMs: the same sums as the
  BF16 GEMM up to summation order (BF16 operands are exact in FP32, accumulation is FP32 either way),
  so the BF16 results agree to one BF16 rounding step.
"""

import pytest
import torch

from mxfx.numerics import mx as mxf
from mxfx.kernels.common import custom_ops as common_ops
from mxfx.kernels.common import gemm as common_gemm


def _special(x: torch.Tensor) -> torch.Tensor:
    """``x [64, 96]`` with a zero column block, a NaN, an Inf and a tiny block, all down dim 0."""
    x = x.clone()
    x[:32, 0] = 0
    x[5, 1] = float("nan")
    x[40, 2] = float("-inf")
    x[32:, 3] = 1e-40
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_quantize_blocks_columnwise_equals_lastdim_of_transpose(dtype, rule):
    x = _special(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    q, s, h = mxf.quantize_blocks(x, rule, dim=-2, dequantized=torch.float32)
    q_ref, s_ref = mxf.quantize_lastdim(x.t(), rule)
    assert q.shape == x.shape and s.shape == (2, 96) and q.is_contiguous() and s.is_contiguous()
    assert torch.equal(q.t().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.t(), s_ref)
    h_ref = mxf.dequantize_lastdim(q_ref, s_ref, torch.float32)
    assert torch.equal(h.t().nan_to_num(123.0), h_ref.nan_to_num(123.0)) and torch.equal(h.isnan().t(), h_ref.isnan())
    assert (s_ref == 255).any() and (s_ref == 0).any()  # the special blocks are in play


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_quantize_blocks_values_equal_dequantize(rule):
    x = _special(torch.randn(64, 96, generator=torch.Generator().manual_seed(1))).t().contiguous()
    q, s, h = mxf.quantize_blocks(x, rule, dequantized=torch.bfloat16)
    assert torch.equal(h.float().nan_to_num(7.0), mxf.dequantize_lastdim(q, s, torch.bfloat16).float().nan_to_num(7.0))
    assert h.isnan().sum() == 64  # the blocks holding the NaN and the Inf, and only they


def test_grouped_wgrad_bf16_fp32_path_matches_bf16_gemm(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    dy, x = torch.randn(200, 64, generator=gen), torch.randn(200, 96, generator=gen)
    offs = torch.tensor([30, 30, 101, 180], dtype=torch.int32)  # an empty group, rows past the last end
    monkeypatch.setattr(common_gemm, "native_bf16_matmul", lambda device: True)
    native = common_ops.hp_grouped_wgrad(dy, x, offs, torch.bfloat16)
    monkeypatch.setattr(common_gemm, "native_bf16_matmul", lambda device: False)
    fp32 = common_ops.hp_grouped_wgrad(dy, x, offs, torch.bfloat16)
    assert fp32.dtype == torch.bfloat16 and fp32.shape == (4, 64, 96)
    assert not fp32[1].any()  # the empty group
    # one BF16 rounding step apart at most (the two sum in different orders before rounding)
    torch.testing.assert_close(fp32.float(), native.float(), rtol=2**-7, atol=0)
    assert (fp32 == native).float().mean() > 0.9
