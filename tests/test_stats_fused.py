"""The fused statistics kernels (:meth:`mxfx.formats.base.Format.fused_stats`:
``mxfx.kernels.{mx,fp8_block}.quant_stats`` with ``mxfx.kernels.common.quant_stats``) against the plain-torch
reference (``reduce_parts`` of ``quant_stats``), for both formats, their scale rules and every layout they cover,
on data reaching every statistic (zeros, values that flush to zero, payloads at and above E4M3's 448, fp32
subnormals, magnitudes whose squares overflow fp32), shapes that are not whole blocks, and each form of operand the
formats make.

* CUDA (skipped without a GPU): the samples :meth:`~mxfx.formats.base.Format.stats_vector` gives, which come from
  the fused kernels there, with no host sync.
* Triton's interpreter on CPU (a fresh process, ``--interpret``): :meth:`fused_stats` of operands made on CPU.
  The interpreter's SiLU is numpy's, not libdevice's, so SwiGLU sources there are gates whose SiLU is exact in
  fp32 (>= 100: the gate itself; the flush band: -0); its widening flushes bf16 subnormals, so its sources are fp32.
* The dispatch on CPU, and the kernels compiled for sm90 without a GPU (Triton's bundled ptxas).

Comparison: counts, amax, the exponent range and histogram exactly; the fp64 sums of squares to a relative 1e-9
(summed in another order than torch's).
"""

from __future__ import annotations

import sys

import pytest
import torch

from mxfx import formats
from mxfx.formats import base
from mxfx.numerics.layout import to_blocked
from mxfx.numerics.mx import dequantize_lastdim
from mxfx.runtime import stats
from tests.helpers import run_interpreter_checks

MX, BLOCK, BF16 = formats.get("mxfp8"), formats.get("fp8_block"), formats.get("bf16_gemm")
RULES = [(MX, "rceil"), (MX, "floor"), (BLOCK, "rceil"), (BLOCK, "amax")]
IDS = [f"{f.name}-{r}" for f, r in RULES]
EXACT = [0, 1, 2, 3, 4, 5, 8, 9, 10]  # the counts, amax, exp_min, exp_max (then the histogram)
SUMS = [6, 7]  # err_sq, ref_sq

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def data(rows: int, cols: int, seed: int = 0, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """``[rows, cols]`` (rows >= 8) of normal values, and rows that reach every statistic: all zeros, values that
    flush to zero next to a large one per 32, amaxes just under a power of two (floor clips them), every third
    value zero, payloads at 448 with values above it, fp32 subnormals, magnitudes of 1e30."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[0] = 0.0
    x[1] = 2.0**-10 * torch.randn(cols, generator=g)
    x[1, ::32] = 2.0**20
    x[2] *= 1e-3
    x[2, ::32] = 1.96 * 2.0**3
    x[3, ::3] = 0.0
    x[4] = 448.0 * torch.randn(cols, generator=g).sign()
    x[4, ::7] = 480.0
    x[5] = 1e-40 * torch.randn(cols, generator=g)
    x[6] *= 1e30
    return x.to(device=device, dtype=dtype)


def gates(shape, device="cpu", exact: bool = False) -> torch.Tensor:
    """SwiGLU gates: random, or (``exact``) gates whose mxfx SiLU is exact in fp32 on any implementation: 128 (its
    SiLU is 128) and -90 (in the flush band: -0)."""
    g = torch.Generator().manual_seed(7)
    if not exact:
        return (4 * torch.randn(shape, generator=g)).to(device)
    return torch.where(torch.rand(shape, generator=g) < 0.8, 128.0, -90.0).to(device)


def cases(fmt, rule: str, device="cpu", interpreter: bool = False, dtype=torch.float32):
    """``(label, layout, source, combine, operand, offs)``: every layout and operand form ``fmt`` makes on
    ``device``, at shapes that are not whole blocks. ``interpreter``: SwiGLU gates whose SiLU is exact, and no bf16
    subnormals among the values an operand holds (the module docstring says why)."""
    k = 96 if fmt is MX else 200  # MX: 3 blocks (not one 128-wide tile); fp8_block: a partial 1x128 tile
    x = data(37, k, device=device, dtype=dtype)
    x3 = data(48, k, seed=1, device=device, dtype=dtype).reshape(2, 24, k)  # (MX only)
    up = data(37, k, seed=2, device=device, dtype=dtype)
    g = gates((37, k), device, interpreter).to(dtype)
    xt = data(45, 128, seed=3, device=device, dtype=dtype)  # tokens: 45 (MX pads to 64; fp8_block: partial tile)
    w = data(200, 256, seed=4, device=device) * 0.05 if fmt is BLOCK else data(64, 96, seed=4, device=device)
    w3 = (
        data(400, 260, seed=5, device=device).reshape(2, 200, 260)
        if fmt is BLOCK
        else data(128, 96, seed=5, device=device).reshape(2, 64, 96)
    )
    xs = data(300, 128, seed=6, device=device, dtype=dtype)
    offs = torch.tensor([100, 100, 231, 290], dtype=torch.int32, device=device)  # an empty group, rows past the end
    rw = torch.rand(37, generator=torch.Generator().manual_seed(8)).to(device)
    out = [
        ("rows", "rows", (x,), "", fmt.input_operand(x, None, rule, "mm")),
        ("rows swiglu", "rows", (g, up), "swiglu", fmt.input_operand(g, up, rule, "mm")),
        ("rows route weight", "rows", (x, rw), "route_weight", fmt.grouped_grad_operand(x, rw, rule)[0]),
        ("tokens", "tokens", (xt,), "", fmt.tokens_operand(xt, rule)),
        ("weight", "weight", (w,), "", fmt.weight_operand(w, rule, "forward")),
        ("weight 3-D", "weight", (w3,), "", fmt.weight_operand(w3, rule, "forward")),
        ("group tokens", "group_tokens", (xs,), "", fmt.grouped_tokens_operand(xs, offs, rule)),
    ]
    gs = gates(xs.shape, device, interpreter).to(dtype)
    h = fmt.stats_values((gs, xs), "swiglu")
    out.append(("group tokens swiglu", "group_tokens", (gs, xs), "swiglu", fmt.grouped_tokens_operand(h, offs, rule)))
    h = fmt.stats_values((g, up), "swiglu")
    out.append(("tokens swiglu", "tokens", (g, up), "swiglu", fmt.tokens_operand(h, rule)))
    a, x_tokens, _ = fmt.forward_operands(xt, None, rule, "mxfp8", tokens=True)
    rows, tokens = fmt.grad_operands(xt, rule, rows=True, tokens=True)
    out += [
        ("forward rows (dual)", "rows", (xt,), "", a),
        ("forward tokens (dual)", "tokens", (xt,), "", x_tokens),
        ("dgrad rows", "rows", (xt,), "", rows),
        ("wgrad tokens", "tokens", (xt,), "", tokens),
    ]
    if fmt is MX:  # fp8_block's rows operands are made of 2-D tensors
        out.append(("rows 3-D", "rows", (x3,), "", fmt.input_operand(x3, None, rule, "mm")))
        q, s = fmt.input_operand(x, None, rule, "mm")[:2]
        values = dequantize_lastdim(q, s, torch.float32 if device == "cpu" else torch.bfloat16)
        w3v = w3.clone()
        if interpreter:  # the BF16 weight form: no fp32 subnormals, which would dequantize to bf16 subnormals
            w3v[0, 5] = 1.0
        out += [
            ("rows, blocked scales", "rows", (x,), "", (q, to_blocked(s), None)),
            ("rows, values alone", "rows", (x,), "", (None, None, values)),
            ("rows, pair and values", "rows", (x,), "", (q, s, values)),
            (
                "weight, values alone",
                "weight",
                (w3v,),
                "",
                fmt.weight_operand(w3v, rule, "forward", keep_dequantized=True),
            ),
        ]
    return [
        (label, layout, source, combine, operand, offs if layout == "group_tokens" else None)
        for label, layout, source, combine, operand in out
    ]


def reference(fmt, rule, layout, source, combine, operand, offs) -> torch.Tensor:
    return stats.reduce_parts(fmt.quant_stats(source, combine, operand, rule, layout, offs))


def assert_same_sample(got: torch.Tensor, ref: torch.Tensor, label: str) -> None:
    got, ref = got.cpu(), ref.cpu()
    assert got.dtype == torch.float64 and got.shape == ref.shape, (label, got.dtype, got.shape)
    fields = dict(zip(stats._FIELDS, zip(got.tolist(), ref.tolist())))
    assert torch.equal(got[EXACT], ref[EXACT]), (label, fields)
    assert torch.equal(got[len(stats._FIELDS) :], ref[len(stats._FIELDS) :]), (label, "histogram")
    assert torch.allclose(got[SUMS], ref[SUMS], rtol=1e-9, atol=0.0), (label, fields)


def reaches_every_statistic(vectors) -> None:
    """The cases' data make every count nonzero somewhere (clipped: under floor and amax)."""
    total = torch.stack([v.cpu() for v in vectors]).sum(0)
    names = dict(zip(stats._FIELDS, total.tolist()))
    assert all(names[k] > 0 for k in ("values", "nonzero", "underflow", "saturated")), names


# ---- CUDA ---------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,rule", RULES, ids=IDS)
def test_fused_samples_match_the_reference_on_cuda(fmt, rule, dtype, monkeypatch):
    """On CUDA every covered operand's sample comes from the fused kernel (no host sync) and equals the reference's."""
    monkeypatch.setenv(stats.FUSED_ENV, "1")
    seen = []
    for label, layout, source, combine, operand, offs in cases(fmt, rule, "cuda", dtype=dtype):
        ref = reference(fmt, rule, layout, source, combine, operand, offs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert fmt.fused_stats(source, combine, operand, rule, layout, offs) is not None, label
            got = fmt.stats_vector(source, combine, operand, rule, layout, offs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got.is_cuda
        assert_same_sample(got, ref, label)
        seen.append(ref)
    reaches_every_statistic(seen)


@cuda
@pytest.mark.parametrize("fmt,rule", RULES, ids=IDS)
def test_nonfinite_values_on_cuda(fmt, rule, monkeypatch):
    monkeypatch.setenv(stats.FUSED_ENV, "1")
    x = data(40, 256, device="cuda")
    x[7, 5], x[9, 130] = float("inf"), float("nan")
    operand = fmt.input_operand(x, None, rule, "mm")
    got = fmt.stats_vector((x,), "", operand, rule, "rows")
    assert_same_sample(got, reference(fmt, rule, "rows", (x,), "", operand, None), "nonfinite")
    assert got[5] > 0


# ---- CPU: dispatch, codegen -------------------------------------------------------------------


def test_cpu_samples_come_from_the_reference():
    x = data(37, 256)
    for fmt, rule in RULES:
        operand = fmt.input_operand(x, None, rule, "mm")
        assert torch.equal(
            fmt.stats_vector((x,), "", operand, rule, "rows"), reference(fmt, rule, "rows", (x,), "", operand, None)
        )
    assert BF16.fused_stats((x,), "", BF16.input_operand(x, None, "rceil", "mm"), "rceil", "rows") is None


def test_dispatch_takes_the_fused_kernel_where_it_covers_the_operand(monkeypatch):
    """Where Triton serves the tensor and ``MXFX_STATS_FUSED`` is unset or ``1``: the format's fused sample, the
    reference where it answers None; ``0``/``off``, the reference; a bad switch value raises."""
    x = data(37, 256)
    operand = MX.input_operand(x, None, "rceil", "mm")
    ref = reference(MX, "rceil", "rows", (x,), "", operand, None)
    sentinel = torch.full_like(ref, 7.0)
    monkeypatch.setattr(base.devices, "triton_available", lambda t: True)
    monkeypatch.setattr(type(MX), "fused_stats", lambda self, *args: sentinel if args[4] == "rows" else None)
    monkeypatch.delenv(stats.FUSED_ENV, raising=False)
    assert MX.stats_vector((x,), "", operand, "rceil", "rows") is sentinel  # the default
    monkeypatch.setenv(stats.FUSED_ENV, "0")
    assert torch.equal(MX.stats_vector((x,), "", operand, "rceil", "rows"), ref)
    monkeypatch.setenv(stats.FUSED_ENV, "1")
    assert MX.stats_vector((x,), "", operand, "rceil", "rows") is sentinel
    tokens = MX.tokens_operand(x, "rceil")
    assert torch.equal(
        MX.stats_vector((x,), "", tokens, "rceil", "tokens"), reference(MX, "rceil", "tokens", (x,), "", tokens, None)
    )
    monkeypatch.setenv(stats.FUSED_ENV, "off")
    assert torch.equal(MX.stats_vector((x,), "", operand, "rceil", "rows"), ref)
    monkeypatch.setenv(stats.FUSED_ENV, "maybe")
    with pytest.raises(ValueError, match=stats.FUSED_ENV):
        MX.stats_vector((x,), "", operand, "rceil", "rows")


def test_the_kernels_sample_layout_is_the_references():
    pytest.importorskip("triton")
    from mxfx.kernels.common import quant_stats

    assert quant_stats.FIELDS == stats._FIELDS and len(quant_stats.FIELDS) <= quant_stats.PARTIAL_WIDTH
    assert stats.HIST_BINS & (stats.HIST_BINS - 1) == 0  # tl.histogram's bins: a power of two


def _sm90_launches():
    """The launches of one sample per kernel configuration, captured on CPU tensors (not run)."""
    from mxfx.kernels.common import quant_stats as common
    from mxfx.kernels.fp8_block import quant_stats as block_stats
    from mxfx.kernels.mx import quant_stats as mx_stats
    from mxfx.numerics import block as bf
    from mxfx.numerics import mx as mxf
    from tests import sass

    x = torch.randn(256, 512, dtype=torch.bfloat16)
    q, s = mxf.quantize_lastdim(x, "rceil")
    offs = torch.tensor([100, 256], dtype=torch.int32)
    configs = [
        (mx_stats.stats_vector, (x, None, None, q, s, None, "rceil")),
        (mx_stats.stats_vector, (x, x, None, q, to_blocked(s), x, "floor")),
        (
            mx_stats.stats_vector,
            (x.t(), None, x.t(), None, None, x.t(), "rceil", None, torch.arange(256, dtype=torch.int32)),
        ),
        (block_stats.stats_vector, (x, None, None, *bf.quantize_1x128(x))),
        (block_stats.stats_vector, (x, x, None, *bf.quantize_128x128(x), 128)),
        (
            block_stats.stats_vector,
            (
                x.t(),
                None,
                None,
                *bf.quantize_1x128_grouped_tokens(x, offs),  # qdata [128 * slots, K]: 512 columns
                1,
                torch.full((512,), -1, dtype=torch.int32).index_put_(  # each column's token, -1: padding
                    (bf.group_token_slots(offs, 256),), torch.arange(256, dtype=torch.int32)
                ),
            ),
        ),
    ]
    out = []
    for fn, args in configs:
        fixed = list(args)
        if fn is block_stats.stats_vector and len(fixed) > 6:  # grouped: qdata [K, 128 * slots], scales [K, slots]
            fixed[3], fixed[4] = fixed[3].t(), fixed[4].t()
        out += sass.captured_launches([mx_stats, block_stats, common], fn, *fixed)
    return out


def test_kernels_compile_for_sm90():
    """Every configuration compiles for sm90 with Triton's bundled ptxas (no GPU), without local-memory spills."""
    pytest.importorskip("triton")
    sass = pytest.importorskip("tests.sass")
    if sass.missing():
        pytest.skip(sass.missing())
    launches = _sm90_launches()
    assert len(launches) == 12  # a statistics launch and a finishing one per configuration
    for launch in launches:
        c = sass.compile_sm90(launch)
        assert c.counts.get("LDL", 0) == 0 and c.counts.get("STL", 0) == 0, (launch.kernel.fn.__name__, c.registers)


# ---- Triton interpreter on CPU ------------------------------------------------------------------


def _interpreter_checks():
    """Run under TRITON_INTERPRET=1 by the test below; raises on the first mismatch."""
    import numpy

    from mxfx.kernels.fp8_block import quant_stats as block_stats
    from mxfx.kernels.mx import quant_stats as mx_stats

    numpy.seterr(over="ignore")  # the interpreter's expf of the flush band's gates overflows to inf, as it should
    seen = []
    for fmt, rule in RULES:
        for label, layout, source, combine, operand, offs in cases(fmt, rule, interpreter=True):
            got = fmt.fused_stats(source, combine, operand, rule, layout, offs)
            assert got is not None, (fmt.name, label)
            ref = reference(fmt, rule, layout, source, combine, operand, offs)
            assert_same_sample(got, ref, f"{fmt.name} {rule} {label}")
            seen.append(ref)
        x = data(40, 256)
        x[7, 5], x[9, 130] = float("inf"), float("nan")
        operand = fmt.input_operand(x, None, rule, "mm")
        got = fmt.fused_stats((x,), "", operand, rule, "rows")
        assert_same_sample(got, reference(fmt, rule, "rows", (x,), "", operand, None), f"{fmt.name} {rule} nonfinite")
        assert got[5] > 0
    reaches_every_statistic(seen)
    # nothing to read: zero counts, amax 0, no exponent
    empty = torch.zeros(0, 64)
    q, s = MX.input_operand(empty, None, "rceil", "mm")[:2]
    got = mx_stats.stats_vector(empty, None, None, q, s, None, "rceil")
    assert torch.equal(got, reference(MX, "rceil", "rows", (empty,), "", (q, s, None), None))
    # several loop steps per program, the last program's past the last tile: 51 tiles over 4 programs
    from mxfx.kernels.common import quant_stats as common

    most, common.MAX_PROGRAMS = common.MAX_PROGRAMS, 4
    try:
        big = data(520, 384, seed=9)
        for fmt, rule in (RULES[1], RULES[3]):
            operand = fmt.input_operand(big, None, rule, "mm")
            assert_same_sample(
                fmt.fused_stats((big,), "", operand, rule, "rows"),
                reference(fmt, rule, "rows", (big,), "", operand, None),
                f"{fmt.name} many tiles",
            )
    finally:
        common.MAX_PROGRAMS = most
    try:
        mx_stats.stats_vector(empty, None, None, q, s[:, :1], None, "rceil")
        raise AssertionError("scales of another shape were accepted")
    except ValueError as e:
        assert "scales" in str(e), e
    try:
        block_stats.stats_vector(
            torch.zeros(4, 128), None, None, torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.ones(4, 2), 64
        )
        raise AssertionError("rows_per_scale=64 was accepted")
    except ValueError as e:
        assert "rows_per_scale" in str(e), e


BACKGROUND_JOBS = {"interpreter": lambda environ: run_interpreter_checks(__file__, environ)}  # tests/conftest.py


def test_triton_interpreter(session_job):
    session_job(
        "test_stats_fused:interpreter"
    )  # run_interpreter_checks in a fresh process, from the start of the session


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    _interpreter_checks()
    print("interpreter checks passed")
