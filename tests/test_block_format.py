"""fp8_block format semantics of the plain-torch reference (mxfx.numerics.block), on CPU.

The oracle below is written from docs/block_format.md in Python float64 and integer math (its own
E4M3 rounding, no torch casts), one tile at a time; hand-worked bytes cover the special cases.
"""

import math

import pytest
import torch

from mxfx.numerics import block as bf

E4M3 = torch.float8_e4m3fn
NAN_BYTE = 0x7F


def fl32(v: float) -> float:
    """Round a float64 to the nearest float32 (ties to even), as a Python float."""
    return torch.tensor(v, dtype=torch.float64).to(torch.float32).item()


def e4m3_value(v: float) -> float:
    """E4M3 round-to-nearest-even of float ``v``, saturating at 448, by integer math on the grid step."""
    if v == 0:
        return v
    a = min(abs(v), 448.0)
    e = max(math.frexp(a)[1] - 1, -6)  # binade exponent; below 2^-6 the subnormal step 2^-9 holds
    step = 2.0 ** (e - 3)
    r = round(a / step) * step  # Python's round is half-to-even; a / step is exact (power of two)
    return math.copysign(min(r, 448.0), v)


def oracle_scale(values: list[float], rule: str) -> float:
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return math.nan
    amax = max(abs(v) for v in values)
    if amax == 0:
        return 1.0
    if rule == "rceil":
        e = math.ceil(math.log2(amax / 448.0))  # float64 log2 of an exact quotient; fixed up below
        while amax / 2.0**e > 448.0:
            e += 1
        while amax / 2.0 ** (e - 1) <= 448.0:
            e -= 1
        return 2.0 ** max(e, -126)
    return max(fl32(amax / 448.0), 2.0**-126)


def oracle_tile(values: list[float], rule: str) -> tuple[list[float], float]:
    """(payload values, scale) of one tile by the written rules."""
    s = oracle_scale(values, rule)
    if math.isnan(s):
        return [math.nan] * len(values), s
    return [e4m3_value(fl32(v / s)) for v in values], s


def check_rows(x: torch.Tensor, rule: str):
    """Compare quantize_1x128 along the last dim of 2D ``x`` with the oracle, tile by tile."""
    q, s = bf.quantize_1x128(x, rule=rule)
    qv, sv = q.double().tolist(), s.double().tolist()
    for r, row in enumerate(x.double().tolist()):
        for t in range(0, len(row), 128):
            want_q, want_s = oracle_tile(row[t : t + 128], rule)
            got_s = sv[r][t // 128]
            assert got_s == want_s or (math.isnan(got_s) and math.isnan(want_s)), (r, t, got_s, want_s)
            got_q = qv[r][t : t + 128]
            for g, w in zip(got_q, want_q):
                assert (g == w and math.copysign(1, g) == math.copysign(1, w)) or (math.isnan(g) and math.isnan(w))


def tile(*head, fill=0.0, n=128):
    return torch.tensor(list(head) + [fill] * (n - len(head)), dtype=torch.float32)


def qbytes(x, rule="rceil"):
    q, s = bf.quantize_1x128(x, rule=rule)
    return q.view(torch.uint8), s


# ---- hand-worked values ---------------------------------------------------------------


def test_500_tile_rceil_and_amax():
    q, s = qbytes(tile(500.0, fill=1.0))
    assert s.tolist() == [2.0] and q[0].item() == 0x78 and q[1].item() == 0x30  # 250 -> 256; 0.5
    q, s = qbytes(tile(500.0, fill=1.0), "amax")
    assert s.item() == fl32(500 / 448)
    assert q[0].item() == 0x7E  # 500 / s rounds to 448 (clamped if the quotient lands above it)
    x_hat = bf.dequantize_1x128(*bf.quantize_1x128(tile(500.0, fill=1.0), rule="amax"), dtype=torch.float32)
    assert x_hat[0].item() == fl32(448 * s.item())


@pytest.mark.parametrize("rule", bf.SCALE_RULES)
def test_zero_tile_scale_one_and_signed_zeros(rule):
    x = torch.zeros(2, 256)
    x[1, :128] = -0.0
    q, s = qbytes(x, rule)
    assert (s == 1.0).all()
    assert (q[0] == 0).all() and (q[1, :128] == 0x80).all() and (q[1, 128:] == 0).all()


@pytest.mark.parametrize("rule", bf.SCALE_RULES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_tile_is_nan(rule, bad):
    x = torch.randn(2, 256)
    x[0, 5] = bad
    q, s = qbytes(x, rule)
    assert s[0, 0].isnan() and (q[0, :128] == NAN_BYTE).all()
    assert not s[0, 1].isnan() and not s[1].isnan().any()
    x_hat = bf.dequantize_1x128(*bf.quantize_1x128(x, rule=rule), dtype=torch.float32)
    assert x_hat[0, :128].isnan().all() and not x_hat[0, 128:].isnan().any() and not x_hat[1].isnan().any()


def test_rceil_boundary_is_exact():
    above = 448.0 * (1 + 2.0**-23)
    assert qbytes(tile(448.0))[1].item() == 1.0
    assert qbytes(tile(above))[1].item() == 2.0
    assert qbytes(tile(224.0))[1].item() == 0.5  # amax 224 fits 448 at 2^-1


@pytest.mark.parametrize("rule", bf.SCALE_RULES)
def test_tiny_tile_scale_is_smallest_normal(rule):
    vals = [2.0**-120, 2.0**-130, 2.0**-135, 3 * 2.0**-137, 2.0**-137, -(2.0**-126)]
    q, s = qbytes(tile(*vals), rule)
    assert s.item() == 2.0**-126  # never a subnormal float32 scale
    # payload x * 2^126: 2^6, 2^-4, 2^-9 (min subnormal), 1.5 x 2^-10 -> 2^-9 (tie to even: 2 x 2^-10),
    # 2^-11 -> 0, -1
    assert q[:6].tolist() == [0x68, 0x18, 0x01, 0x01, 0x00, 0xB8]


def test_saturation_amax_rule_rounding():
    # fl32(amax / 448) can round below the exact quotient, putting amax / s just above 448: clamps to 448
    found = 0
    for amax in torch.linspace(449, 2000, 2000).tolist():
        s = fl32(amax / 448)
        if fl32(fl32(amax) / s) > 448:
            q, got_s = qbytes(tile(fl32(amax)), "amax")
            assert got_s.item() == s and q[0].item() == 0x7E
            found += 1
    assert found  # the case exists in the range


def test_ties_round_to_even_from_fp32():
    q, s = qbytes(tile(300.0, 1.0625, 1.1875, 17.0, 19.0, 1.0625 + 2.0**-20))
    assert s.item() == 1.0
    assert q[1:6].tolist() == [0x38, 0x3A, 0x58, 0x5A, 0x39]


def test_partial_tile_equals_zero_padding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 200, generator=g) * 10
    q, s = bf.quantize_1x128(x)
    assert q.shape == (3, 200) and s.shape == (3, 2)
    qp, sp = bf.quantize_1x128(torch.nn.functional.pad(x, (0, 56)))
    assert torch.equal(q.view(torch.uint8), qp[:, :200].view(torch.uint8)) and torch.equal(s, sp)


# ---- oracle on many magnitudes ----------------------------------------------------------


@pytest.mark.parametrize("rule", bf.SCALE_RULES)
def test_rowwise_matches_oracle(rule):
    g = torch.Generator().manual_seed(1)
    mags = torch.tensor([[1e-38], [3e-30], [1e-3], [1.0], [7e3], [1e30], [3e38 / 448]])
    x = torch.randn(7, 300, generator=g) * mags
    x[2, 7] = 1.0625 * x[2].abs().max()  # a value off the grid near the top
    x[4, 130:135] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, float("nan")])
    check_rows(x, rule)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_match_oracle(dtype):
    x = (torch.randn(4, 256, generator=torch.Generator().manual_seed(2)) * 50).to(dtype)
    check_rows(x.float(), "rceil")
    a, b = bf.quantize_1x128(x), bf.quantize_1x128(x.float())
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_columnwise_is_rowwise_of_transpose():
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(3)) * 3
    q, s = bf.quantize_1x128(x, axis=0)
    assert q.shape == (300, 64) and s.shape == (3, 64)
    qt, st = bf.quantize_1x128(x.t().contiguous())
    assert torch.equal(q.view(torch.uint8), qt.t().view(torch.uint8)) and torch.equal(s, st.t())
    x_hat = bf.dequantize_1x128(q, s, axis=0, dtype=torch.float32)
    assert torch.equal(x_hat, bf.dequantize_1x128(qt, st, dtype=torch.float32).t())


@pytest.mark.parametrize("rule", bf.SCALE_RULES)
def test_128x128_matches_oracle(rule):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(2, 136, 260, generator=g) * torch.tensor([1e-3, 5.0]).view(2, 1, 1)
    w[1, 130, 10] = float("inf")
    q, s = bf.quantize_128x128(w, rule)
    assert q.shape == w.shape and s.shape == (2, 2, 3)
    qv = q.double()
    for b in range(2):
        for i in range(2):
            for j in range(3):
                blk = w[b, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                want_q, want_s = oracle_tile(blk.double().flatten().tolist(), rule)
                got_s = s[b, i, j].item()
                assert got_s == want_s or (math.isnan(got_s) and math.isnan(want_s))
                got = qv[b, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].flatten().tolist()
                assert all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(got, want_q))
    x_hat = bf.dequantize_128x128(q, s, dtype=torch.float32)
    assert x_hat[1, 128:, 0:128].isnan().all() and not x_hat[1, :128].isnan().any()


def test_128x128_rceil_is_orientation_free():
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(5)) * 0.02
    q, s = bf.quantize_128x128(w)
    qt, st = bf.quantize_128x128(w.t())
    assert torch.equal(q.t().view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s.t(), st)


def test_roundtrip_error_bound():
    # rceil: |x_hat - x| <= half an E4M3 step: 2^-4 relative for normals, 2^-10 x scale below them
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(6)) * 100
    q, s = bf.quantize_1x128(x)
    x_hat = bf.dequantize_1x128(q, s, dtype=torch.float32)
    scale = s.repeat_interleave(128, dim=1)
    assert ((x_hat - x).abs() <= torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)).all()


# ---- errors ---------------------------------------------------------------------------


def test_errors_name_op_and_shape():
    with pytest.raises(TypeError, match=r"quantize_1x128.*\(4, 64\).*float64; fp8_block quantizes bfloat16"):
        bf.quantize_1x128(torch.zeros(4, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"quantize_1x128: needs a tensor with at least 1 dims, got shape \(\)"):
        bf.quantize_1x128(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"grouped_tokens: needs a tensor with at least 2 dims, got shape \(64,\)"):
        bf.quantize_1x128_grouped_tokens(torch.zeros(64), torch.tensor([64], dtype=torch.int32))
    with pytest.raises(ValueError, match="rceil, amax"):
        bf.quantize_1x128(torch.zeros(4, 64), rule="floor")
    with pytest.raises(ValueError, match=r"quantize_128x128.*\(64,\)"):
        bf.quantize_128x128(torch.zeros(64))
    q, s = bf.quantize_1x128(torch.randn(4, 200))
    with pytest.raises(ValueError, match=r"scales of shape \(4, 1\).*\(4, 200\).*\(4, 2\)"):
        bf.dequantize_1x128(q, s[:, :1])
    with pytest.raises(TypeError, match=r"scales of shape \(4, 2\).*float32"):
        bf.dequantize_1x128(q, s.double())
    with pytest.raises(TypeError, match=r"qdata of shape \(4, 200\).*float8_e4m3fn"):
        bf.dequantize_1x128(q.float(), s)


@pytest.mark.parametrize("rule", bf.SCALE_RULES)
def test_rceil_retiling_is_exact(rule):
    # a 128x128-quantized weight, dequantized and quantized again in 1x128 tiles along either dim: rceil keeps
    # every value (power-of-two scales, finer tiles); amax rounds a second time
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(7)) * torch.logspace(-3, 3, 384)
    once = bf.dequantize_128x128(*bf.quantize_128x128(w, rule), dtype=torch.float32)
    same = True
    for axis in (-1, -2):
        twice = bf.dequantize_1x128(*bf.quantize_1x128(once, axis=axis, rule=rule), axis=axis, dtype=torch.float32)
        same &= torch.equal(once, twice)
    assert same == (rule == "rceil")
