"""fp8_block GEMMs on CPU: the reference decode, and the Triton grouped GEMM and quantize kernels under
``TRITON_INTERPRET=1`` (in a subprocess) against it.

Bound used throughout: the reference is an FP32 GEMM on exactly dequantized operands, whose products are
exact in FP32 (E4M3 times E4M3 times powers of two: at most 8 significant bits). A sum of K such products in
any order is within ``gamma_{K-1} * sum|a*b|`` of the exact sum (``gamma_n = n*u / (1 - n*u)``, ``u = 2^-24``),
so two FP32 summation orders differ by at most ``2 * gamma_{K-1} * sum|a*b| <= K * 2^-23 * (|A| @ |B|^T)``
elementwise (for ``K <= 4096``: then ``K(K-1)u <= 1``), plus the output cast. No other bound holds on every CPU
and GPU: the order is the BLAS's or the kernel's choice.
"""

import os
import re
import sys

import pytest
import torch

from mxfx.numerics import block as bf
from mxfx.kernels.fp8_block import gemm as block_gemm
from mxfx.kernels.fp8_block import gemm_cublas
from tests.helpers import run_interpreter_checks


def summation_bound(a, sa, b, sb, b_dims=(-2, -1)):
    """``K * 2^-23 * (|A_hat| @ |B_hat|^T)``: how far two FP32 summation orders may differ (module docstring)."""
    x = bf.dequantize_values(a, sa, (-1,)).abs()
    w = bf.dequantize_values(b, sb, b_dims).abs()
    return a.shape[-1] * 2.0**-23 * (x @ w.t())


def fp32_sums_are_exact(x: torch.Tensor, x_unit: float, w: torch.Tensor, w_unit: float) -> bool:
    """True when ``x @ w^T`` comes out exact from any FP32 GEMM: every ``x`` is a multiple of ``x_unit`` and
    every ``w`` of ``w_unit``, so every product is a multiple of ``u = x_unit * w_unit``, and each row of
    products sums in magnitude to at most ``2^24 * u``. Every partial sum, in any order and grouping, with or
    without FMA, is then an integer multiple of ``u`` of at most ``2^24 * u``: exactly representable in FP32."""
    on_grid = bool(((x.double() / x_unit) % 1 == 0).all()) and bool(((w.double() / w_unit) % 1 == 0).all())
    sums = x.double().abs() @ w.double().abs().transpose(-2, -1)
    return on_grid and float(sums.max()) <= 2.0**24 * x_unit * w_unit


def exact_operands(g: torch.Generator, m: int, w_shape: tuple[int, ...]):
    """``x [m, K]`` and ``w [..., N, K]`` (K a multiple of 128) that quantize exactly under rceil, with scales
    1/2, 1 and 2, and whose products sum exactly in FP32 (:func:`fp32_sums_are_exact` with units 2^-1 and
    2^-4): E4M3 integers in [-16, 16] (eighths for w) times a power of two per 1x128 tile (per 128x128 block
    for w), and in each tile (block) one 448 times that power, its amax. w's 448 sits one column after x's,
    so the two amaxes never multiply."""
    k = w_shape[-1]
    x = torch.randint(-16, 17, (m, k), generator=g).float()
    x[:, ::128] = 448.0
    x *= 2.0 ** torch.randint(-1, 2, (m, k // 128), generator=g).float().repeat_interleave(128, -1)
    w = torch.randint(-16, 17, w_shape, generator=g).float() / 8
    w[..., ::128, 1::128] = 448.0
    blocks = (*w_shape[:-2], -(-w_shape[-2] // 128), k // 128)
    e = torch.randint(-1, 2, blocks, generator=g).float().repeat_interleave(128, -2).repeat_interleave(128, -1)
    w *= 2.0 ** e[..., : w_shape[-2], :]
    assert fp32_sums_are_exact(x, 2.0**-1, w, 2.0**-4)
    return x, w


def test_dense_reference_is_the_float64_product_of_exact_operands():
    # Exact operands whose FP32 GEMM is exact in any summation order: the reference decode (dequantize, FP32
    # GEMM) then equals the float64 product bit for bit, on any CPU.
    x, w = exact_operands(torch.Generator().manual_seed(0), 64, (384, 384))
    a, sa = bf.quantize_1x128(x)
    b, sb = bf.quantize_128x128(w)
    assert set(sa.unique().tolist()) == {0.5, 1.0, 2.0} and set(sb.unique().tolist()) == {0.5, 1.0, 2.0}
    assert torch.equal(bf.dequantize_1x128(a, sa, dtype=torch.float32), x)
    assert torch.equal(bf.dequantize_values(b, sb, (-2, -1)), w)
    ref = (x.double() @ w.double().t()).float()  # exact in float64, and representable in FP32 (above)
    assert torch.equal(block_gemm.scaled_mm(a, sa, b, sb, torch.float32), ref)
    # the same B as 1x128 tiles (wgrad's form) gives the same values
    b1, sb1 = bf.quantize_1x128(w)
    assert torch.equal(bf.dequantize_1x128(b1, sb1, dtype=torch.float32), w)
    assert torch.equal(block_gemm.scaled_mm(a, sa, b1, sb1, torch.float32), ref)


def test_grouped_reference_matches_dense_per_group():
    # exact operands (exact_operands): every summation order gives the same sums, so the grouped and the dense
    # references must agree bit for bit however the BLAS blocks rows of different counts and alignments
    g = torch.Generator().manual_seed(1)
    sizes = [5, 0, 17, 40]
    x, w = exact_operands(g, sum(sizes) + 3, (4, 192, 256))
    a, sa = bf.quantize_1x128(x)
    b, sb = bf.quantize_128x128(w)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = block_gemm.grouped_mm(a, sa, b, sb, offs, torch.float32)
    start = 0
    for e, n in enumerate(sizes):
        rows = slice(start, start + n)
        assert torch.equal(out[rows], block_gemm.scaled_mm(a[rows], sa[rows], b[e], sb[e], torch.float32))
        assert torch.equal(out[rows], (x[rows].double() @ w[e].double().t()).float())
        start += n
    assert (out[start:] == 0).all()  # rows past offs[-1]


def test_grouped_token_tiles_restart_at_each_group():
    g = torch.Generator().manual_seed(5)
    sizes = [130, 0, 5, 256]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes) + 2, 64, generator=g)
    q, s = bf.quantize_1x128_grouped_tokens(x, offs)
    slots = bf.group_tile_capacity(x.shape[0], 4)
    assert s.shape == (slots, 64) and q.shape == (128 * slots, 64)
    assert bf.group_tile_starts(offs).tolist() == [0, 2, 2, 3]
    written = torch.zeros(q.shape[0], dtype=torch.bool)
    for (start, end), slot in (((0, 130), 0), ((130, 135), 2), ((135, 391), 3)):
        rq, rs = bf.quantize_1x128(x[start:end], axis=0)
        rows = slice(128 * slot, 128 * slot + end - start)  # each tile in a 128-row slot of its own
        assert torch.equal(q[rows].view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(s[slot : slot + rs.shape[0]], rs)
        written[rows] = True
    assert (s[5:] == 1.0).all() and (q[~written].view(torch.uint8) == 0).all()  # +0 in the rest of every slot
    assert bf.group_token_slots(offs, x.shape[0]).tolist() == [*range(130), *range(256, 261), *range(384, 640), -1, -1]
    # the wgrad reference: per group dY^T X of the dequantized tiles
    dy = torch.randn(x.shape[0], 32, generator=g)
    dq, ds = bf.quantize_1x128_grouped_tokens(dy, offs)
    out = block_gemm.grouped_wgrad(dq.t().contiguous(), ds.t(), q.t().contiguous(), s.t(), offs)
    assert out.shape == (4, 32, 64) and (out[1] == 0).all()
    xh = bf.dequantize_1x128(*bf.quantize_1x128(x[135:391], axis=0), axis=0, dtype=torch.float32)
    dh = bf.dequantize_1x128(*bf.quantize_1x128(dy[135:391], axis=0), axis=0, dtype=torch.float32)
    bound = xh.shape[0] * 2.0**-23 * (dh.abs().t() @ xh.abs())  # two FP32 summation orders (module docstring)
    assert ((out[3] - dh.t() @ xh).abs() <= bound).all()


def test_errors_name_the_problem():
    a, sa = bf.quantize_1x128(torch.randn(8, 256))
    b, sb = bf.quantize_128x128(torch.randn(2, 64, 256))
    with pytest.raises(ValueError, match=r"grouped_mm: offs must be contiguous int32 of shape \(2,\)"):
        block_gemm.grouped_mm(a, sa, b, sb, torch.tensor([4, 8]))
    with pytest.raises(ValueError, match=r"A of shape \(8, 256\) needs scales of shape \(8, 2\)"):
        block_gemm.grouped_mm(a, sa[:, :1], b, sb, torch.tensor([4, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"non-decreasing"):
        block_gemm.grouped_mm(a, sa, b, sb, torch.tensor([6, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        block_gemm.scaled_mm(a.float(), sa, b[0], sb[0])
    with pytest.raises(ValueError, match=r"\(1, 2\) or \(64, 2\)"):
        block_gemm.scaled_mm(a, sa, b[0], sb[0, :, :1].repeat(1, 2).repeat(2, 1))


def test_route_grad_launch_shape_is_checked_before_launch():
    """A rows or warps Triton would reject (or compile wrongly) is refused by name, before any kernel runs."""
    pytest.importorskip("triton")
    from mxfx.kernels.fp8_block import quantize as bq

    x = torch.zeros(64, 128, dtype=torch.bfloat16)
    for rows, warps in ((48, 4), (0, 4), (2048, 4), (32, 3), (32.0, 4)):
        with pytest.raises(
            ValueError, match=rf"route_grad_operands_1x128: rows must be .* rows={rows!r}, warps={warps}"
        ):
            bq.route_grad_operands_1x128(x, torch.ones(64), x, rows=rows, warps=warps)


def test_a_triton_function_given_cpu_tensors_says_where_the_cpu_path_is():
    """Without the interpreter, a Triton quantize of CPU tensors is refused by kernel name, pointing at the CPU
    reference, not left to Triton's driver error."""
    pytest.importorskip("triton")
    from mxfx.kernels.common import launch
    from mxfx.kernels.fp8_block import quantize as bq

    if launch.INTERPRETED:
        pytest.skip("Triton's interpreter takes CPU tensors")
    x = torch.zeros(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"Triton kernel _route_grad_kernel got a cpu tensor \(64, 128\).*device_path"):
        bq.route_grad_operands_1x128(x, torch.ones(64), x)
    with pytest.raises(ValueError, match=r"route weight per row"):
        bq.route_grad_operands_1x128(x, torch.ones(64, dtype=torch.float64), x)
    with pytest.raises(ValueError, match=r"rows=True"):
        bq.route_grad_operands_1x128(x, torch.ones(64), x, rows=True)


# ---- Triton interpreter ------------------------------------------------------------------


def _interpreter_checks():
    from mxfx.kernels.fp8_block import grouped_gemm_triton as block_grouped

    from mxfx.kernels.fp8_block import quantize as block_quantize

    g = torch.Generator().manual_seed(0)
    # unequal and empty groups, rows past offs[-1], K not a multiple of 128 (masked K), N with a partial
    # 128-column scale block, forward (W) and dgrad (W^T as a view and as a copy sharing the scales)
    for sizes, k, n in (([70, 0, 33, 150, 3], 384, 192), ([0, 41, 0], 200, 128)):
        s = sum(sizes) + 5
        x = torch.randn(s, k, generator=g) * 3
        w = torch.randn(len(sizes), n, k, generator=g) * 0.05
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        a, sa = bf.quantize_1x128(x)
        b, sb = bf.quantize_128x128(w)
        ref = block_gemm.reference_grouped_mm(a, sa, b, sb, offs, torch.float32)
        for out_dtype in (torch.float32, torch.bfloat16):
            out = block_grouped.grouped_mm(a, sa, b, sb, offs, out_dtype)
            _check_grouped(out, ref, a, sa, b, sb, sizes, out_dtype)
        # dgrad: dX = dY W, B = W^T [G, K, N] reads the same 128x128 scales transposed
        dy = torch.randn(s, n, generator=g)
        a2, sa2 = bf.quantize_1x128(dy)
        bt, sbt = b.transpose(1, 2), sb.transpose(1, 2)
        ref2 = block_gemm.reference_grouped_mm(a2, sa2, bt, sbt, offs, torch.float32)
        for operand in ((bt, sbt), (bt.contiguous(), sbt.contiguous())):
            out = block_grouped.grouped_mm(a2, sa2, *operand, offs, torch.float32)
            _check_grouped(out, ref2, a2, sa2, bt, sbt, sizes, torch.float32)
    _interpreter_wgrad_checks(block_grouped, block_quantize)
    _interpreter_quantize_checks(block_quantize)
    _interpreter_transpose_checks()
    print("block interpreter checks passed")


def _interpreter_transpose_checks():
    """The payload transpose, byte for byte: tiles cut at both edges, a batch, a non-contiguous input, NaN bytes."""
    from mxfx.kernels.common import transpose

    g = torch.Generator().manual_seed(7)
    for shape in ((70, 130), (3, 64, 200), (1, 1)):
        q = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        for src in (q, q.transpose(-2, -1)):
            out = transpose.transpose_lastdims(src)
            assert out.is_contiguous() and out.dtype == src.dtype
            assert torch.equal(out.view(torch.uint8), src.view(torch.uint8).transpose(-2, -1)), shape


def token_scales(scales, offs):
    """Per-token scales ``[S, K]`` of a group-token-tiled scale grid ``[capacity, K]``."""
    starts = bf.group_tile_starts(offs).tolist()
    rows, start = [], 0
    for g, end in enumerate(offs.tolist()):
        rows += [starts[g] + (t - start) // 128 for t in range(start, end)]
        start = end
    return scales[rows]


def _interpreter_wgrad_checks(block_grouped, bq):
    g = torch.Generator().manual_seed(3)
    sizes = [70, 0, 200, 129, 3]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), 128, generator=g) * 3
    dy = torch.randn(sum(sizes), 64, generator=g)
    (xq, xs), (dq, ds) = (bf.quantize_1x128_grouped_tokens(t, offs) for t in (x, dy))
    # the kernel's quantize: transposed qdata, the same scales (qdata but for the interpreter's carries)
    q, s = bq.quantize_1x128_grouped_tokens(x, offs)
    scaled = torch.zeros(xq.shape)
    scaled[bf.group_token_slots(offs, x.shape[0])] = x / token_scales(xs, offs)  # in the operand's slot layout
    _same((q, s), (xq.t(), xs.t()), scaled.t())
    a, sa, b, sb = dq.t().contiguous(), ds.t(), xq.t().contiguous(), xs.t()
    out = block_grouped.grouped_wgrad(a, sa, b, sb, offs)  # contiguous: the tiles through TMA descriptors
    assert torch.equal(block_grouped.grouped_wgrad(dq.t(), sa, xq.t(), sb, offs), out)  # strided: pointer loads
    ref = block_gemm.reference_grouped_wgrad(a, sa, b, sb, offs)
    rows = bf.group_token_slots(offs, sum(sizes))  # each token's row in the slot layout
    dh, xh = (bf.dequantize_values(t[rows], token_scales(sc, offs), (-1,)).abs() for t, sc in ((dq, ds), (xq, xs)))
    start = 0
    for e, end in enumerate(offs.tolist()):
        bound = (end - start) * 2.0**-23 * (dh[start:end].t() @ xh[start:end])  # module docstring, K = tokens
        assert ((out[e] - ref[e]).abs() <= bound).all(), e
        start = end
    # a routed gradient's two operands from one read: the rows (dgrad) and the group-token tiles (wgrad) of
    # dy * route formed in fp32; K = 320 (a partial tile), 60 rows past the last group end (row tiles only)
    dy = torch.randn(sum(sizes) + 60, 320, generator=g) * 5
    route = 2.0 ** torch.randint(-3, 4, (dy.shape[0],), generator=g).float()
    route[9] = 0.0
    for w in (None, route):
        v = dy if w is None else dy * w[:, None]
        q, s, qt, st = bq.quantize_1x128_grouped_dual(dy, offs, route=w)
        ref = bf.quantize_1x128(v)
        _same((q, s), ref, v / ref[1].repeat_interleave(128, 1)[:, :320])
        tq, ts = bf.quantize_1x128_grouped_tokens(v, offs)
        scaled = torch.zeros(tq.shape)
        scaled[bf.group_token_slots(offs, sum(sizes))] = v[: sum(sizes)] / token_scales(ts, offs)
        _same((qt, st), (tq.t(), ts.t()), scaled.t())
    q, s, qt, st = bq.quantize_1x128_grouped_dual(dy, offs[:0])  # no group: rows only, every slot unused
    _same((q, s), bf.quantize_1x128(dy), dy / bf.quantize_1x128(dy)[1].repeat_interleave(128, 1)[:, :320])
    assert not qt.view(torch.uint8).any() and (st == 1).all()
    # into a given gradient (strided, as a parameter's .grad may be): written, then added by the epilogue itself
    grad = torch.full((len(sizes), 128, 64), float("nan")).transpose(1, 2)
    assert block_grouped.grouped_wgrad(a, sa, b, sb, offs, out=grad) is grad
    assert torch.equal(grad, out)  # the same sums, stored where asked (empty group 1: zeros over the NaNs)
    prior = torch.randn(len(sizes), 64, 128, generator=g)
    grad.copy_(prior)
    block_grouped.grouped_wgrad(a, sa, b, sb, offs, out=grad, accumulate=True)
    assert torch.equal(grad, prior + out)  # one FP32 add of the finished sum to what was there


def _check_grouped(out, ref, a, sa, b, sb, sizes, out_dtype):
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        bound = summation_bound(a[rows], sa[rows], b[e], sb[e])
        if out_dtype != torch.float32:
            # the bf16 output cast: the interpreter truncates (one ulp, 2^-7 relative); GPUs round (half that)
            bound = bound + ref[rows].abs() * 2.0**-7
        err = (out[rows].float() - ref[rows]).abs()
        assert (err <= bound).all(), (sizes, e, (err - bound).max().item())
        start += size
    assert (out[start:] == 0).all()


def _same(got, want, scaled=None):
    """Bitwise equal pairs. With ``scaled`` (the exact quotients x / s), qdata may differ only where the
    interpreter's E4M3 rounding fails: a value that rounds up onto a power of two (the carry into the next
    binade) comes out a factor 2 off there (``mxfx.kernels.common.e4m3_triton.HW_E4M3_CONVERSION``), and E4M3 subnormals
    (below 2^-6) may round the wrong way; compiled kernels round in hardware and the GPU test compares every
    byte."""
    q, s = got
    rq, rs = want
    assert q.shape == rq.shape and s.shape == rs.shape, (q.shape, rq.shape, s.shape, rs.shape)
    assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s.nan_to_num(), rs.nan_to_num()), "scales differ"
    # NaN payloads compare as NaN: the interpreter's NaN byte may carry a sign (the GPU test wants 0x7F)
    differ = (q.view(torch.uint8) != rq.view(torch.uint8)) & ~(q.float().isnan() & rq.float().isnan())
    if scaled is not None:
        r = rq.float().abs()
        carry = (torch.frexp(r)[0] == 0.5) & (scaled.abs() < r)
        differ &= ~(carry | (scaled.abs() < 2.0**-6))
    assert not differ.any(), f"qdata differs at {differ.nonzero()[:4].tolist()}"


def _exact(shape, tiles, seed, specials=True):
    """Data whose quantization is exact under both rules: E4M3 values times 2^e per tile (``tiles`` gives
    the tile's extent per dim), each tile holding 448 x 2^e, plus special tiles (zero, NaN, Inf, tiny)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8)
    bits |= torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
    v = bits.view(torch.float8_e4m3fn).float().clamp(-440, 440)
    grid = [-(-n // t) for n, t in zip(shape, tiles)]
    e = torch.randint(-20, 20, grid, generator=g).float()
    for d, t in enumerate(tiles):
        e = e.repeat_interleave(t, dim=d)
    e = e[tuple(slice(0, n) for n in shape)]
    v[tuple(slice(None, None, t) for t in tiles)] = 448.0  # one per tile, at its first corner
    x = v * 2.0**e
    if not specials:
        return x
    flat = x.view(-1, shape[-1])
    flat[0, :] = 0.0  # zero tiles
    flat[1, 3] = float("nan")
    flat[2, -1] = float("inf")
    flat[3] = 1.5 * 2.0**-120  # tiny tiles: the 2^-126 scale floor, payload 96 (normal in bf16: the interpreter
    # flushes 16-bit subnormals)
    return x


def _interpreter_quantize_checks(bq):
    from mxfx.kernels.common.silu import silu_fp32

    g = torch.Generator().manual_seed(1)
    for rule in bf.SCALE_RULES:
        x = _exact((70, 320), (1, 128), seed=2)  # K = 320: a partial last tile
        _same(bq.quantize_1x128(x, rule), bf.quantize_1x128(x, rule=rule))
        _same(bq.quantize_1x128(x.bfloat16(), rule), bf.quantize_1x128(x.bfloat16(), rule=rule))
        xr = torch.randn(40, 256, generator=g) * 30  # rounding: scales bitwise, qdata but for carries
        ref = bf.quantize_1x128(xr, rule=rule)
        _same(bq.quantize_1x128(xr, rule), ref, xr / ref[1].repeat_interleave(128, 1))
        # columnwise (along tokens, for wgrad): qdata transposed [K, T], scales [K, ceil(T/128)]
        xt = _exact((96, 300), (1, 128), seed=3).t()  # a transposed view: tiles along its tokens
        _same(bq.quantize_1x128_colwise(xt, rule), bf.quantize_1x128(xt.t(), rule=rule))
        w = _exact((2, 200, 260), (1, 128, 128), seed=4, specials=False)
        w[0, :128, :128] = 0.0
        w[0, :128, 128:256] = 1.5 * 2.0**-120
        w[1, 5, 7], w[1, 150, 259] = float("nan"), float("-inf")
        _same(bq.quantize_128x128(w, rule), bf.quantize_128x128(w, rule=rule))
        # SwiGLU: gates >= 100 have silu(g) = g exactly in fp32, so the product of exact data is exact; the
        # flush band gives -0. The SiLU's own rounding is compared on the GPU.
        up = _exact((40, 256), (1, 128), seed=5)
        gate = torch.full_like(up, 128.0)
        gate[5, :128] = -90.0  # flush band: the tile is all -0 (scale 1)
        want = bf.quantize_1x128(silu_fp32(gate) * up, rule=rule)
        _same(bq.swiglu_quantize_1x128(gate, up, rule), want)
        # the same product with the pairs of gate and up themselves, from one read
        saved = bq.swiglu_quantize_1x128_save(gate, up, rule)
        _same(saved[:2], want)
        _same(saved[2:4], bf.quantize_1x128(gate, rule=rule))
        _same(saved[4:], bf.quantize_1x128(up, rule=rule))
        # route-weighted rows: powers of two times exact data stay exact in fp32; a zero weight zeroes its tiles
        rw = 2.0 ** torch.randint(-3, 4, (70,), generator=g).float()
        rw[9] = 0.0
        _same(bq.route_weight_quantize_1x128(x, rw, rule), bf.quantize_1x128(x * rw[:, None], rule=rule))
        # the same pair with dy in BF16 and the route weights' gradient, from one read of dout (finite: the
        # gradient sums compared with a bound); the sums' fp32 order is the kernel's: 2^-24 of the magnitudes a term
        dout = x.clone()
        dout[1, 3], dout[2, -1] = 0.0, 0.0
        y = torch.randint(-3, 4, dout.shape, generator=g).float()
        q, s_, dy, d_rw = bq.route_grad_operands_1x128(dout, rw, y, rule)
        _same((q, s_), bf.quantize_1x128(dout * rw[:, None], rule=rule))
        assert dy.dtype == torch.bfloat16 and torch.equal(dy, (dout * rw[:, None]).bfloat16())
        terms = dout.double() * y.double()
        bound = terms.shape[1] * 2.0**-24 * terms.abs().sum(-1)
        assert d_rw.dtype == torch.float32 and ((d_rw.double() - terms.sum(-1)).abs() <= bound).all()
        # another launch shape (64 rows a program: a partial second one; 2 warps): the same values
        q2, s2, dy2, d_rw2 = bq.route_grad_operands_1x128(dout, rw, y, rule, rows=64, warps=2)
        _same((q2, s2), (q, s_))
        assert torch.equal(dy2, dy) and ((d_rw2.double() - terms.sum(-1)).abs() <= bound).all()
        # the rows gathered by the kernel from a token gradient (a combine's backward): the same values
        tokens, index = dout[::2].clone(), torch.arange(dout.shape[0]) // 2  # each token twice, as top-2 routing
        qg, sg, dyg, d_rwg = bq.route_grad_operands_1x128(tokens, rw, y, rule, rows_of=index)
        want = bq.route_grad_operands_1x128(tokens[index], rw, y, rule)
        _same((qg, sg), want[:2])
        assert torch.equal(dyg, want[2]) and torch.equal(d_rwg, want[3])
        # both 1x128 tilings of one [T, K] from one read; partial tiles along both dims
        xd = torch.randn(200, 320, generator=g) * 7
        q, s, qt, st = bq.quantize_1x128_dual(xd, rule)
        for got, src in (((q, s), xd), ((qt, st), xd.t())):
            ref = bf.quantize_1x128(src, rule=rule)
            _same(got, ref, src / ref[1].repeat_interleave(128, 1)[:, : src.shape[1]])


BACKGROUND_JOBS = {"interpreter": lambda environ: run_interpreter_checks(__file__, environ)}  # tests/conftest.py


def test_triton_interpreter(session_job):
    session_job(
        "test_block_gemm:interpreter"
    )  # run_interpreter_checks in a fresh process, from the start of the session


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    _interpreter_checks()


# ---- sm90 code generation (no GPU: Triton's bundled ptxas) -------------------------------


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](...)`` records the launch instead of running it."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            from tests.sass import Launch

            self.seen.append(Launch(self.kernel, grid, args, kwargs))

        return record


def _sm90_launches(monkeypatch, module, name, fn, *args, **kwargs):
    pytest.importorskip("triton")
    from tests import sass

    if sass.missing():
        pytest.skip(sass.missing())

    seen = []
    kernel = getattr(module, name)
    monkeypatch.setattr(module, name, _Recorder(kernel.kernel if isinstance(kernel, _Recorder) else kernel, seen))
    fn(*args, **kwargs)
    return [sass.compile_sm90(launch) for launch in seen]


def test_grouped_kernel_compiles_to_fp8_wgmma(monkeypatch):
    """For sm90 the grouped GEMM's ``tl.dot`` is an E4M3 x E4M3 warpgroup MMA (QGMMA) with FP32 accumulation,
    in the autotuned configs' tile: FP8 tensor cores, not an upcast to BF16."""
    from mxfx.kernels.fp8_block import grouped_gemm_triton as block_grouped

    s, k, n, g = 512, 512, 256, 4
    a, sa = torch.zeros(s, k, dtype=torch.float8_e4m3fn), torch.ones(k // 128, s).t()
    b, sb = torch.zeros(g, n, k, dtype=torch.float8_e4m3fn), torch.ones(g, n // 128, k // 128)
    offs = torch.tensor([100, 100, 300, 512], dtype=torch.int32)
    cfg = block_grouped.CONFIGS[0]
    config = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    (c,) = _sm90_launches(
        monkeypatch, block_grouped, "_kernel", block_grouped.grouped_mm, a, sa, b, sb, offs, config=config
    )
    mmas = set(re.findall(r"\b([HQ]GMMA\.[0-9x]+\.F32\.[A-Z0-9]+\.[A-Z0-9]+)", c.sass))
    assert mmas and all(m.endswith("E4M3.E4M3") for m in mmas), mmas
    # K-major operands (weights and their dgrad copies, quantized activations) are read by TMA; a transposed
    # view (not K-major) falls back to pointer loads and still runs FP8 MMAs
    assert "UTMALDG" in c.sass
    bt, sbt = b.transpose(1, 2), sb.transpose(1, 2)
    (v,) = _sm90_launches(
        monkeypatch,
        block_grouped,
        "_kernel",
        block_grouped.grouped_mm,
        a[:, :256],
        sa[:, :2],
        bt,
        sbt,
        offs,
        config=config,
    )
    assert "UTMALDG" not in v.sass and any(m.startswith("QGMMA") for m in re.findall(r"\b([HQ]GMMA\S*)", v.sass))


def test_grouped_wgrad_kernel_compiles_to_fp8_wgmma_without_spills(monkeypatch):
    """For sm90 the grouped wgrad (its default tile, writing into a gradient) is E4M3 warpgroup MMAs on tiles that
    TMA loads (the slot layout makes every token tile whole and 128-aligned), or pipelined async copies for a
    strided operand, with no register spilled."""
    from mxfx.kernels.fp8_block import grouped_gemm_triton as block_grouped

    n, k, g, slots = 256, 384, 4, 12
    a, sa = torch.zeros(n, 128 * slots, dtype=torch.float8_e4m3fn), torch.ones(slots, n).t()
    b, sb = torch.zeros(k, 128 * slots, dtype=torch.float8_e4m3fn), torch.ones(slots, k).t()
    offs = torch.tensor([100, 100, 300, 512], dtype=torch.int32)
    grad = torch.zeros(g, n, k)
    for a_, b_, load in ((a, b, "UTMALDG"), (a.t().contiguous().t(), b, "LDGSTS")):
        (c,) = _sm90_launches(
            monkeypatch,
            block_grouped,
            "_grouped_wgrad_kernel",
            block_grouped.grouped_wgrad,
            a_,
            sa,
            b_,
            sb,
            offs,
            out=grad,
            accumulate=True,
            config=block_grouped.WGRAD_CONFIG,  # the GPU's tile (CPU tensors would take the interpreter's)
        )
        mmas = set(re.findall(r"\b([HQ]GMMA\.[0-9x]+\.F32\.[A-Z0-9]+\.[A-Z0-9]+)", c.sass))
        assert mmas and all(m.endswith("E4M3.E4M3") for m in mmas), mmas
        assert load in c.sass, load
        assert c.counts.get("LDL", 0) == 0 and c.counts.get("STL", 0) == 0, "registers spilled to local memory"


def test_quantize_kernels_compile_for_sm90(monkeypatch):
    from mxfx.kernels.fp8_block import quantize as bq

    x = torch.zeros(256, 384, dtype=torch.bfloat16)
    for fn, args in (
        (bq.quantize_1x128, (x,)),
        (bq.quantize_1x128_colwise, (x,)),
        (bq.quantize_128x128, (x,)),
        (bq.swiglu_quantize_1x128, (x, x)),
        (bq.route_weight_quantize_1x128, (x, torch.ones(256))),
        (bq.route_grad_operands_1x128, (x, torch.ones(256), x)),
        (bq.quantize_1x128, (x.float(), "amax")),
        (bq.quantize_1x128_grouped_tokens, (x, torch.tensor([100, 256], dtype=torch.int32))),
    ):
        kernel = {bq.quantize_128x128: "_weight_quantize_kernel", bq.route_grad_operands_1x128: "_route_grad_kernel"}
        kernel = kernel.get(fn, "_quantize_kernel")
        (c,) = _sm90_launches(monkeypatch, bq, kernel, fn, *args)
        assert c.counts.get("STG", 0) > 0, fn.__name__


def test_gathered_route_grad_kernel_compiles_for_sm90_without_spills(monkeypatch):
    """The route-gradient kernel reading its rows from a token gradient by index: one sm90 kernel, its four
    outputs stored, within the register file."""
    from mxfx.kernels.fp8_block import quantize as bq

    x = torch.zeros(256, 384, dtype=torch.bfloat16)
    rows_of = torch.zeros(256, dtype=torch.int64)
    (c,) = _sm90_launches(
        monkeypatch, bq, "_route_grad_kernel", bq.route_grad_operands_1x128, x[:8], torch.ones(256), x, rows_of=rows_of
    )
    assert c.counts.get("STG", 0) > 0
    assert c.counts.get("LDL", 0) == 0 and c.counts.get("STL", 0) == 0, "registers spilled to local memory"


def test_dual_quantize_kernels_compile_for_sm90_without_spills(monkeypatch):
    """Both tilings from one read, dense and grouped with route weights: one sm90 kernel each, storing four
    outputs, within the register file (a spill would put every tile through local memory)."""
    from mxfx.kernels.fp8_block import quantize as bq

    x = torch.zeros(256, 384, dtype=torch.bfloat16)
    offs = torch.tensor([100, 256], dtype=torch.int32)
    for fn, args, kw in (
        (bq.quantize_1x128_dual, (x,), {}),
        (bq.quantize_1x128_grouped_dual, (x, offs), {"route": torch.ones(256)}),
    ):
        (c,) = _sm90_launches(monkeypatch, bq, "_dual_kernel", fn, *args, **kw)
        assert c.counts.get("STG", 0) > 0, fn.__name__
        assert c.counts.get("LDL", 0) == 0 and c.counts.get("STL", 0) == 0, (fn.__name__, c.registers)


def test_weight_quantize_compiles_once_per_process():
    """Triton compiles a kernel once per specialization of its launch (each int argument equal to 1 or a multiple of
    16 or neither, tensors 16-byte aligned or not). The weights of a model differ in their 128x128 scale grids
    (K/128 = 16, 8, 3, 1; 2D and 3D): their quantize launches specialize alike, one compile for all of them. The
    activation quantizes stay specialized on their sizes (a token count that is a multiple of 16 writes the
    transposed qdata with wide stores): 1000 and 1024 tokens are two."""
    from mxfx.kernels.fp8_block import quantize as bq
    from tests import sass

    def key(fn, *args):
        (launch,) = sass.captured_launches([bq], fn, *args)
        return launch.kernel, repr(sass.specialize(launch.kernel, launch.args, launch.kwargs))

    weights = (torch.zeros(256, 2048), torch.zeros(256, 1024), torch.zeros(4, 128, 384), torch.zeros(128, 128))
    assert len({key(bq.quantize_128x128, w) for w in weights}) == 1
    x = torch.zeros(1024, 256, dtype=torch.bfloat16)
    assert key(bq.quantize_1x128_colwise, x[:1000]) != key(bq.quantize_1x128_colwise, x)


def test_weight_quantize_unspecialized_scale_strides_cost_nothing(monkeypatch):
    """The weight quantize left unspecialized on its scale strides compiles, for sm90, to the code of the fully
    specialized kernel but for the address of its one scale (an integer multiply-add more, its column stride no
    longer the constant 1): the same global memory instructions, 128-bit loads and stores."""
    from mxfx.kernels.fp8_block import quantize as bq

    w = torch.zeros(256, 1024)
    (plain,) = _sm90_launches(monkeypatch, bq, "_weight_quantize_kernel", bq.quantize_128x128, w)
    monkeypatch.setattr(bq, "_weight_quantize_kernel", bq._quantize_kernel)
    (specialized,) = _sm90_launches(monkeypatch, bq, "_weight_quantize_kernel", bq.quantize_128x128, w)
    assert plain.memory == specialized.memory and plain.memory["LDG.E.128"] > 0
    issued = lambda c: c.total - c.counts["NOP"]  # noqa: E731  (NOPs pad the code's alignment, never run)
    assert abs(issued(plain) - issued(specialized)) <= 2, (
        plain.counts - specialized.counts,
        specialized.counts - plain.counts,
    )


def test_grouped_wgrad_kernel_compiles_to_fp8_wgmma(monkeypatch):
    from mxfx.kernels.fp8_block import grouped_gemm_triton as block_grouped

    s, n, k = 512, 256, 256
    a, b = torch.zeros(n, s, dtype=torch.float8_e4m3fn), torch.zeros(k, s, dtype=torch.float8_e4m3fn)
    cap = bf.group_tile_capacity(s, 2)
    sa, sb = torch.ones(cap, n).t(), torch.ones(cap, k).t()
    offs = torch.tensor([200, 512], dtype=torch.int32)
    (c,) = _sm90_launches(
        monkeypatch,
        block_grouped,
        "_grouped_wgrad_kernel",
        block_grouped.grouped_wgrad,
        a,
        sa,
        b,
        sb,
        offs,
        config=block_grouped.WGRAD_CONFIG,
    )
    mmas = set(re.findall(r"\b([HQ]GMMA\.[0-9x]+\.F32\.[A-Z0-9]+\.[A-Z0-9]+)", c.sass))
    assert mmas and all(m.endswith("E4M3.E4M3") for m in mmas), mmas


def test_bench_gemm_cpu_smoke(monkeypatch, tmp_path):
    """bench/gemm.py end to end on the CPU reference paths (toy shapes; the numbers mean nothing here)."""
    import runpy

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("MXFX_BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench/gemm.py", "--device", "cpu", "--quick", "--models", "olmoe"])
    monkeypatch.syspath_prepend(os.path.join(root, "bench"))
    runpy.run_path(os.path.join(root, "bench", "gemm.py"), run_name="__main__")
    text = (tmp_path / "gemm.md").read_text()
    # one dense shape, and the model's two projections (gate/up, down) with equal and skewed groups
    assert text.count("| forward |") == 5 and text.count("| wgrad |") == 5, text
    assert text.count("skewed") == 6, text


def _fake_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=None, **_):
    """``torch.nn.functional.scaled_mm``'s blockwise contract on sm90, as measured against the reference decode
    on an H200 (torch 2.11): 1x128 scales ``[rows, ceil(K/128)]`` with strides ``(1, rows)``; B's 128x128 scales
    ``[round_up(ceil(K/128), 4), ceil(N/128)]`` with strides ``(1, round_up(ceil(K/128), 4))`` (the padded grid
    transposed; unpadded, cuBLAS gave wrong sums); decoded in float32."""
    (m, k), n = a.shape, b.shape[1]
    kt = -(-k // 128)
    ST = torch.nn.functional.ScalingType
    assert recipe_a == ST.BlockWise1x128
    assert a.stride() == (k, 1) and b.stride() == (1, k) and k % 16 == 0 and n % 16 == 0
    assert scale_a.shape == (m, kt) and (scale_a.stride() == (1, m) or kt == 1), (scale_a.shape, scale_a.stride())
    if recipe_b == ST.BlockWise128x128:
        l4 = -(-kt // 4) * 4
        assert scale_b.shape == (l4, -(-n // 128)), scale_b.shape
        assert scale_b.stride(0) == 1 and (scale_b.stride(1) == l4 or scale_b.shape[1] == 1), scale_b.stride()
        b_hat = bf.dequantize_values(b.t(), scale_b.t()[:, :kt], (-2, -1))
    else:
        assert recipe_b == ST.BlockWise1x128
        assert scale_b.shape == (n, kt) and (scale_b.stride() == (1, n) or kt == 1), (scale_b.shape, scale_b.stride())
        b_hat = bf.dequantize_values(b.t(), scale_b, (-1,))
    return (bf.dequantize_values(a, scale_a, (-1,)) @ b_hat.t()).to(output_dtype)


@pytest.mark.parametrize("m,n,k", [(200, 200, 640), (64, 384, 4096), (3, 17, 100)])
def test_cublas_wrapper_builds_the_checked_scale_layouts(monkeypatch, m, n, k):
    """The dense GPU path's operand and scale layouts (padding to 16, column-major 1x128 scales, the padded
    128x128 row stride when ceil(K/128) is not a multiple of 4) against torch's checks, on CPU tensors."""
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", _fake_scaled_mm)
    g = torch.Generator().manual_seed(6)
    a, sa = bf.quantize_1x128(torch.randn(m, k, generator=g))
    for b, sb in (
        bf.quantize_128x128(torch.randn(n, k, generator=g)),
        bf.quantize_1x128(torch.randn(n, k, generator=g)),
    ):
        out = gemm_cublas.mm(a, sa, b, sb, torch.float32)
        assert out.shape == (m, n)
        bound = summation_bound(a, sa, b, sb, (-1,) if bf.tiled_rows(b, sb) else (-2, -1))
        assert ((out - block_gemm.reference_mm(a, sa, b, sb, torch.float32)).abs() <= bound).all()


def test_cublas_wrapper_guards_nothing_on_a_symbolic_row_count(monkeypatch):
    """Traced with a symbolic M (a data-dependent expert split under dynamic shapes; on CUDA the dense GEMM's body
    enters the graph), the padding of M to a multiple of 16 is one expression: no guard on whether an expert's rows
    are a multiple of 16, so no recompile when they cross one. On CPU tensors, the stand-in for cuBLAS checking
    the layouts it receives."""
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", torch.compiler.disable(_fake_scaled_mm))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    mm = torch.compile(lambda a, sa, b, sb: gemm_cublas.mm(a, sa, b, sb, torch.float32), backend="eager", dynamic=True)
    g = torch.Generator().manual_seed(7)
    b, sb = bf.quantize_128x128(torch.randn(256, 384, generator=g))
    graphs = []
    for m in (100, 112, 130, 144):  # M's padding to 16: some, none, some, none
        a, sa = bf.quantize_1x128(torch.randn(m, 384, generator=g))
        out = mm(a, sa.t().contiguous().t(), b, sb)
        assert out.shape == (m, 256)
        assert (
            (out - block_gemm.reference_mm(a, sa, b, sb, torch.float32)).abs() <= summation_bound(a, sa, b, sb)
        ).all()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [graphs[0]] * 4, graphs


def test_grouped_wgrad_refuses_group_ends_its_operands_were_not_made_with():
    """On the host the reference reads ``offs``: group ends that are decreasing, or whose tiles do not fit the
    operands' slots, raise naming the op (they would read other groups' tiles), as does the quantize."""
    offs = torch.tensor([100, 300], dtype=torch.int32)
    x = torch.randn(300, 64)
    q, s = bf.quantize_1x128_grouped_tokens(x, offs)  # 3 tiles in 5 slots
    a, sa = q.t().contiguous(), s.t()
    assert block_gemm.grouped_wgrad(a, sa, a, sa, offs).shape == (2, 64, 64)
    for bad in ([300, 100], [1, 2, 3, 4, 5, 300]):
        with pytest.raises(ValueError, match=r"mxfx.block_gemm.grouped_wgrad: offs \["):
            block_gemm.grouped_wgrad(a, sa, a, sa, torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"quantize_1x128_grouped_tokens: offs \[100, 900\] .* at most the 300 rows"):
        bf.quantize_1x128_grouped_tokens(x, torch.tensor([100, 900], dtype=torch.int32))
