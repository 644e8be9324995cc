"""MXFP8 format semantics of the plain-torch reference (mxfx.numerics.mx), on CPU.

Expected bytes are worked out by hand from the project's written-out conversion rules (OCP MX v1.0
§6.3 with the rceil and floor rules); torchao's ``to_mx`` is a second opinion on
normal-range data.
"""

import math

import pytest
import torch

import mxfx
from mxfx.numerics import mx as mxf

E4M3 = torch.float8_e4m3fn


def qbytes(x, rule="rceil", axis=-1):
    q, s = mxf.quantize(x, axis=axis, rule=rule)
    return q.view(torch.uint8), s.view(torch.uint8)


def block(*head, fill=0.0, dtype=torch.float32):
    """One 32-value block: ``head`` values then ``fill``."""
    return torch.tensor(list(head) + [fill] * (32 - len(head)), dtype=dtype)


def e4m3_byte(v: float) -> int:
    return torch.tensor([v]).to(E4M3).view(torch.uint8).item()


# ---- hand-computed values -------------------------------------------------------------


def test_500_block_rceil():
    q, s = qbytes(block(500.0, fill=1.0))
    assert s.tolist() == [128]  # e = 1: 500 / 2 = 250 <= 448
    assert q[0].item() == 0x78  # 250 rounds to 256 = 1.0 x 2^8 -> exponent field 15, mantissa 0
    assert q[1].item() == 0x30  # 1.0 / 2 = 0.5 = 1.0 x 2^-1 -> exponent field 6
    xh = mxf.dequantize(*mxf.quantize(block(500.0, fill=1.0)), dtype=torch.float32)
    assert xh[0].item() == 512.0 and (xh[1:] == 1.0).all()


def test_500_block_floor_saturates():
    q, s = qbytes(block(500.0, fill=1.0), rule="floor")
    assert s.tolist() == [127]  # e = floor(log2 500) - 8 = 0
    assert q[0].item() == 0x7E  # 500 saturates to 448 = 1.75 x 2^8
    xh = mxf.dequantize(*mxf.quantize(block(500.0, fill=1.0), rule="floor"), dtype=torch.float32)
    assert xh[0].item() == 448.0 and (xh[1:] == 1.0).all()


@pytest.mark.parametrize("rule", mxf.SCALE_RULES)
def test_zero_block(rule):
    q, s = qbytes(torch.zeros(2, 64), rule)
    assert (s == 0).all() and (q == 0).all()
    assert (mxf.dequantize(*mxf.quantize(torch.zeros(64))) == 0).all()


def test_negative_zero_block_keeps_sign():
    # -0.0 / 2^-127 is -0.0: payload 0x80, as torchao gives; it dequantizes to -0.0.
    q, s = qbytes(torch.full((32,), -0.0))
    assert s.tolist() == [0] and (q == 0x80).all()


def test_rceil_boundary_is_exact():
    # amax = 448 exactly fits at e = 0; the next fp32 above it needs e = 1.
    above = 448.0 * (1 + 2.0**-23)  # next fp32 above 448
    assert qbytes(block(448.0))[1].tolist() == [127]
    assert qbytes(block(above))[1].tolist() == [128]
    assert qbytes(block(above), "floor")[1].tolist() == [127]
    # floor: amax in [256, 512) -> e = 0; just below 256 -> e = -1
    assert qbytes(block(256.0), "floor")[1].tolist() == [127]
    assert qbytes(block(256.0 * (1 - 2.0**-24)), "floor")[1].tolist() == [126]


# ---- special values -------------------------------------------------------------------


@pytest.mark.parametrize("rule", mxf.SCALE_RULES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_block_is_nan(rule, bad):
    x = torch.randn(2, 64)
    x[0, 5] = bad
    q, s = qbytes(x, rule)
    assert s[0].tolist()[0] == 255  # E8M0 NaN
    assert (q[0, :32] == 0x7F).all()  # every payload byte NaN: nothing silently zero
    ref_q, ref_s = qbytes(x[:, 32:].clone(), rule)
    assert torch.equal(q[:, 32:], ref_q) and s[0, 1] == ref_s[0, 0]  # other blocks untouched
    xh = mxf.dequantize(*mxf.quantize(x, rule=rule), dtype=torch.float32)
    assert xh[0, :32].isnan().all() and not xh[0, 32:].isnan().any()


def test_tiny_block_clamps_and_uses_stored_scale():
    # amax 2^-120: ideal rceil e = ceil(-120 - log2 448) = -128 -> clamps to -127 (byte 0)
    vals = [2.0**-120, 2.0**-133, 2.0**-136, 3 * 2.0**-138, 2.0**-138, -(2.0**-126)]
    q, s = qbytes(block(*vals))
    assert s.tolist() == [0]
    # payload x * 2^127: 2^7, 2^-6 (min normal), 2^-9 (min subnormal), 1.5 x 2^-10 -> 2^-9,
    # 2^-11 -> 0, -2^1
    assert q[:6].tolist() == [0x70, 0x08, 0x01, 0x01, 0x00, 0xC0]
    xh = mxf.dequantize(*mxf.quantize(block(*vals)), dtype=torch.float32)
    assert xh[:6].tolist() == [2.0**-120, 2.0**-133, 2.0**-136, 2.0**-136, 0.0, -(2.0**-126)]


@pytest.mark.parametrize("rule", mxf.SCALE_RULES)
def test_fp32_subnormal_amax(rule):
    # every value an fp32 subnormal: e = -127, payload x * 2^127
    vals = [1.5 * 2.0**-135, 2.0**-140, 2.0**-149]
    q, s = qbytes(block(*vals), rule)
    assert s.tolist() == [0]
    assert q[:3].tolist() == [0x03, 0x00, 0x00]  # 3 x 2^-9 is subnormal mantissa 3; the rest underflow


def test_saturation():
    q, s = qbytes(block(480.0, -470.0, 460.0), "floor")  # e = 0: all three above 448
    assert s.tolist() == [127] and q[:3].tolist() == [0x7E, 0xFE, 0x7E]
    q, s = qbytes(block(480.0, -470.0, 460.0), "rceil")  # e = 1: 240, -235 -> -240, 230 -> 224
    assert s.tolist() == [128] and q[:3].tolist() == [0x77, 0xF7, 0x76]


def test_e4m3_rounds_from_exact_fp32_value():
    # 1.0625 is the midpoint of E4M3 1.0 and 1.125; just above it must round up.
    v = 1.0625 + 2.0**-20
    assert torch.tensor(v).to(torch.bfloat16).item() == 1.0625  # a bf16 detour lands on the tie
    assert e4m3_byte(1.0625) == 0x38  # ... which rounds to even: 1.0
    q, s = qbytes(block(300.0, v))
    assert s.tolist() == [127]
    assert q[1].item() == 0x39  # 1.125: rounded from the exact fp32 value


def test_ties_round_to_even():
    q, _ = qbytes(block(300.0, 1.0625, 1.1875, 17.0, 19.0))
    # 1.0625 -> 1.0 (even), 1.1875 -> 1.25 (even), 17 -> 16 (even), 19 -> 20 (even)
    assert q[1:5].tolist() == [0x38, 0x3A, 0x58, 0x5A]


# ---- axes, layouts, dtypes ------------------------------------------------------------


def oracle(x: torch.Tensor, rule: str) -> tuple[list, list]:
    """Scalar per-block oracle along the last dim (2D x), from math.frexp."""
    qs, ss = [], []
    for row in x.double().tolist():
        for j in range(0, len(row), 32):
            blk = row[j : j + 32]
            amax = max(abs(v) for v in blk)
            m, ex = math.frexp(amax)
            e = ex - 1 - 8 + (1 if rule == "rceil" and 2 * m > 1.75 else 0)
            e = max(e, -127) if amax else -127
            ss.append(e + 127)
            qs += [e4m3_byte(max(-448.0, min(448.0, v / 2.0**e))) for v in blk]
    return qs, ss


@pytest.mark.parametrize("rule", mxf.SCALE_RULES)
def test_rowwise_matches_oracle(rule):
    x = torch.randn(3, 64) * torch.tensor([[1e-3], [1.0], [1e4]])
    q, s = qbytes(x, rule)
    ref_q, ref_s = oracle(x, rule)
    assert q.flatten().tolist() == ref_q and s.flatten().tolist() == ref_s


@pytest.mark.parametrize("shape", [(64, 96), (2, 64, 32)])
def test_columnwise_is_rowwise_of_transpose(shape):
    x = torch.randn(shape) * 100
    q, s = qbytes(x, axis=-2)
    assert q.shape == x.shape and s.shape == (*shape[:-2], shape[-2] // 32, shape[-1])
    qt, st = qbytes(x.transpose(-2, -1).contiguous(), axis=-1)
    assert torch.equal(q, qt.transpose(-2, -1)) and torch.equal(s, st.transpose(-2, -1))
    ref_q, ref_s = oracle(x.transpose(-2, -1).reshape(-1, shape[-2]), "rceil")
    assert qt.flatten().tolist() == ref_q and st.flatten().tolist() == ref_s


def test_3d_rowwise_matches_2d():
    x = torch.randn(2, 5, 64)
    q, s = qbytes(x)
    q2, s2 = qbytes(x.reshape(10, 64))
    assert torch.equal(q.reshape(10, 64), q2) and torch.equal(s.reshape(10, 2), s2)


def test_noncontiguous_equals_contiguous():
    base = torch.randn(64, 128)
    for view in (base.t(), base[:, ::2], base[::2]):
        for axis in (-1, -2):
            if view.shape[axis] % 32:
                continue
            a = qbytes(view, axis=axis)
            b = qbytes(view.contiguous(), axis=axis)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_input_dtypes_agree():
    # values exact in fp16 and bf16 (8 significant bits, moderate range) give the same bytes
    x = torch.randint(-255, 256, (4, 64)).float() * 2.0 ** torch.randint(-8, 8, (4, 1)).float()
    ref = qbytes(x)
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(x.to(dt).float(), x)
        got = qbytes(x.to(dt))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_dequantize_dtypes_and_axis():
    x = torch.randn(64, 32)
    q, s = mxf.quantize(x, axis=0)
    xh = mxf.dequantize(q, s, axis=0, dtype=torch.float32)
    assert xh.dtype == torch.float32 and xh.shape == x.shape
    # within half an E4M3 step: 2^-4 relative for normals, half the smallest subnormal
    # (2^-10 x scale) for values far below their block's amax
    scale = mxf.scale_values(s).repeat_interleave(32, dim=0)
    assert ((xh - x).abs() <= torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)).all()
    assert mxf.dequantize(q, s, axis=0, dtype=torch.float16).dtype == torch.float16


# ---- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_wrong_dtype(dtype):
    with pytest.raises(
        TypeError, match=r"mxfx.quantize.*\(4, 64\).*" + str(dtype).replace(".", r"\.") + "; MXFP8 quantizes"
    ):
        mxf.quantize(torch.zeros(4, 64, dtype=dtype))


def test_axis_not_multiple_of_32():
    with pytest.raises(ValueError, match=r"\(4, 48\).*48.*multiple of 32"):
        mxf.quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match=r"\(40, 64\)"):
        mxf.quantize(torch.zeros(40, 64), axis=0)
    with pytest.raises(TypeError, match=r"axis 1.0 for shape \(4, 64\) must be an int"):
        mxf.quantize(torch.randn(4, 64), axis=1.0)


def test_unknown_rule():
    with pytest.raises(ValueError, match="rceil"):
        mxf.quantize(torch.zeros(4, 64), rule="ceil")


def test_pair_mismatch():
    q, s = mxf.quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"\(4, 3\).*\(4, 64\).*\(4, 2\)"):
        mxf.dequantize(q, torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"\(4, 64\).*float8_e4m3fn"):
        mxf.dequantize(q.float(), s)
    with pytest.raises(TypeError, match=r"\(4, 2\)"):
        mxf.dequantize(q, s.view(torch.uint8).float())
    with pytest.raises(TypeError, match=r"output dtype bfloat16 .*\(4, 64\).*torch.bfloat16"):
        mxf.dequantize(q, s, dtype="bfloat16")  # a string, not a torch.dtype


# ---- torchao agreement ----------------------------------------------------------------


@pytest.mark.parametrize("rule", mxf.SCALE_RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_torchao_to_mx(rule, dtype):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    mode = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}[rule]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 512, generator=g) * 2.0 ** torch.randint(-20, 20, (256, 1), generator=g).float()
    x = x.to(dtype)
    ao_s, ao_q = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, mode)
    q, s = mxf.quantize(x, rule=rule)
    assert torch.equal(q.view(torch.uint8), ao_q.view(torch.uint8).reshape(q.shape))
    assert torch.equal(s.view(torch.uint8), ao_s.view(torch.uint8).reshape(s.shape))


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_requantizing_dequantized_values_is_exact(rule):
    # An op that receives dequantized MX rows (after MX transport) and quantizes them again along the
    # same blocks gets the same values: no double rounding on the dispatch -> grouped GEMM path.
    # (The bytes may differ: with rceil a block whose maximum rounded down to 224 x 2^e is stored
    # again as 448 x 2^(e-1), the same value.)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(-1)
    once = mxfx.dequantize(*mxfx.quantize(x, rule=rule), dtype=torch.float32)
    twice = mxfx.dequantize(*mxfx.quantize(once, rule=rule), dtype=torch.float32)
    assert torch.equal(once, twice)


def test_public_api_under_torch_compile():
    # Inductor has no CPU code for float8_e8m0fnu scales: the public pair runs eagerly (a graph break)
    # and gives the eager bytes
    torch._dynamo.reset()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(lambda t: mxf.dequantize(*mxf.quantize(t), dtype=torch.float32))
    assert torch.equal(compiled(x), mxf.dequantize(*mxf.quantize(x), dtype=torch.float32))


def test_pair_errors_say_what_to_do():
    """Dequantizing along another axis than the pair's, or from two devices, names the op and the fix."""
    q, s = mxfx.quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"mxfx.dequantize.*\(4, 64\).*axis 0.*the axis the pair was quantized along"):
        mxfx.dequantize(q, s, axis=0)
    with pytest.raises(ValueError, match="mxfx.dequantize: qdata is on cpu but scales are on meta"):
        mxfx.dequantize(q, s.to("meta"))


def test_swiglu_quantize_reference_rejects_mismatched_shapes():
    from mxfx.kernels.mx import device_path

    with pytest.raises(ValueError, match=r"swiglu_quantize: gate of shape \(4, 32\) and up of shape \(1, 32\)"):
        device_path.swiglu_quantize(torch.randn(4, 32), torch.randn(1, 32), "rceil")
    with pytest.raises(ValueError, match=r"swiglu_quantize: gate on cpu and up on meta"):
        device_path.swiglu_quantize(torch.randn(4, 32), torch.randn(4, 32, device="meta"), "rceil")
