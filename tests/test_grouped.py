"""Grouped expert GEMM (+ SwiGLU input, + route weights) against a per-expert hand reference in every format."""

import pytest
import torch
import torch.nn.functional as F

from mxfx.numerics.layout import group_padding
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear
from tests import format_refs as refs

SIZES = [5, 0, 40, 19]  # an empty expert and groups that are not multiples of 32


def q_dq(t, axis, rule="rceil"):
    return refs.act("mxfp8", t, axis, rule)


def per_group_tokens_q_dq(fmt, t, sizes, rule):
    """``t [S, D]`` quantized along tokens within each group (as the format pads them), fp32 back."""
    out, start = [], 0
    for n in sizes:
        out.append(refs.tokens(fmt, t[start : start + n], rule))
        start += n
    return torch.cat(out)


def with_saved(fn):
    """``fn()``'s result and the tensors autograd saved for its backward while it ran."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), saved


def reference(fmt, x, up, w, rw, dout, sizes, rule, wgrad, save):
    """Forward and gradients, one expert at a time, operands quantized per docs/format.md in format ``fmt``."""
    gate32, up32 = x.float(), None if up is None else up.float()
    h = x.float() if up is None else F.silu(gate32) * up32
    hq = refs.act(fmt, h, -1, rule)  # input blocked along K (rowwise)
    y, dh, dw = [], [], []
    dy = dout.float() * (rw.float()[:, None] if rw is not None else 1)
    dyq = refs.act(fmt, dy, -1, rule)  # gradient blocked along N (rowwise)
    if wgrad == "mxfp8":
        h_w, dy_w = per_group_tokens_q_dq(fmt, h, sizes, rule), per_group_tokens_q_dq(fmt, dy, sizes, rule)
    else:  # BF16 grouped GEMM on the dequantized saved input and the bf16 gradient
        h_w, dy_w = hq.bfloat16().float(), dy.bfloat16().float()
    start = 0
    for e, n in enumerate(sizes):
        sl = slice(start, start + n)
        y.append(hq[sl] @ refs.weight(fmt, w[e], -1, rule).T)  # W[e] [N, K] along K
        dh.append(dyq[sl] @ refs.weight(fmt, w[e], -2, rule))  # W[e] along N (down its columns)
        dw.append(dy_w[sl].T @ h_w[sl])
        start += n
    y, dh, dw = torch.cat(y), torch.cat(dh), torch.stack(dw)
    drw = None
    if rw is not None:
        drw = (dout.float() * y.bfloat16().float()).sum(-1)
        y = y * rw.float()[:, None]
    if up is None:
        return y, dh, None, dw, drw
    gate_s, up_s = (
        (refs.act(fmt, gate32, -1, rule), refs.act(fmt, up32, -1, rule)) if save == "mxfp8" else (gate32, up32)
    )
    s = torch.sigmoid(gate_s)
    return y, dh * up_s * s * (1 + gate_s * (1 - s)), dh * gate_s * s, dw, drw


@pytest.mark.parametrize(
    "swiglu,routed,wgrad,save",
    [
        (False, False, "bf16", "mxfp8"),
        (False, True, "mxfp8", "bf16"),
        (True, False, "mxfp8", "mxfp8"),
        (True, True, "bf16", "bf16"),
    ],
)
@pytest.mark.parametrize("fmt", refs.FORMATS)
def test_grouped_mm_matches_per_expert_reference(fmt, swiglu, routed, wgrad, save):
    g = torch.Generator().manual_seed(1)
    s_rows, k, n, e = sum(SIZES), 128, 256, len(SIZES)
    x = torch.randn(s_rows, k, generator=g).bfloat16()
    up = torch.randn(s_rows, k, generator=g).bfloat16() if swiglu else None
    w = torch.randn(e, n, k, generator=g) * 0.1
    rw = torch.rand(s_rows, generator=g).bfloat16() if routed else None
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    dout = torch.randn(s_rows, n, generator=g).bfloat16()
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, up, w, rw)]
    y = mx_grouped_mm_op(
        leaves[0], leaves[2], offs, up=leaves[1], route_weight=leaves[3], wgrad=wgrad, save=save, format=fmt
    )
    y.backward(dout)
    ry, rdx, rdup, rdw, rdrw = reference(fmt, x, up, w, rw, dout, SIZES, "rceil", wgrad, save)
    # bf16 output and bf16 input gradients: one bf16 rounding (2^-8 relative) on top of identical MX products.
    torch.testing.assert_close(y.float(), ry, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(leaves[0].grad.float(), rdx, rtol=1e-2, atol=1e-2)
    if swiglu:
        torch.testing.assert_close(leaves[1].grad.float(), rdup, rtol=1e-2, atol=1e-2)
    # wgrad: fp32 result; bf16 grouped GEMM output rounding on the default path.
    torch.testing.assert_close(leaves[2].grad, rdw, rtol=1e-2, atol=1e-2)
    assert leaves[2].grad[1].abs().max() == 0  # the empty expert gets no gradient
    if routed:
        torch.testing.assert_close(leaves[3].grad.float(), rdrw, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt", refs.FORMATS)
@pytest.mark.parametrize("save,keeps_x", [("bf16", True), ("mxfp8", False)])
def test_mx_wgrad_saves_what_save_asks(fmt, save, keeps_x):
    """``wgrad="mxfp8"`` with ``save="bf16"`` keeps x as given (the wgrad quantizes it in backward), no 8-bit copy;
    with ``save="mxfp8"`` the token-blocked copy. Both give the same weight gradient (the same quantize of x)."""
    if fmt == "bf16_gemm" and not keeps_x:
        pytest.skip("bf16_gemm's copies are BF16: there is no 8-bit copy to look for")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(SIZES), 128, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(len(SIZES), 256, 128, generator=g) * 0.1).requires_grad_()
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    y, saved = with_saved(lambda: mx_grouped_mm_op(x, w, offs, wgrad="mxfp8", save=save, format=fmt))
    y.backward(torch.ones_like(y))
    eight_bit = [t for t in saved if t.element_size() == 1 and t.numel() >= x.numel()]
    assert any(t is x for t in saved) == keeps_x and bool(eight_bit) != keeps_x, [(t.dtype, t.shape) for t in saved]
    _, _, _, rdw, _ = reference(
        fmt, x.detach(), None, w.detach(), None, torch.ones(y.shape).bfloat16(), SIZES, "rceil", "mxfp8", save
    )
    torch.testing.assert_close(w.grad, rdw, rtol=1e-2, atol=1e-2)  # bf16 rounding of dy aside, the same products


@pytest.mark.parametrize("fmt", refs.FORMATS)
def test_route_weighted_fp32_product_from_bf16_gemm_rows(fmt):
    """``gemm_dtype`` (a combine whose product is FP32 under BF16 autocast): the GEMM's rows are BF16, the result
    their FP32 product with the route weights, and backward keeps the BF16 rows, not an FP32 copy (half the bytes
    of the routed block's largest tensor)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(SIZES), 128, generator=g).bfloat16()
    w = (torch.randn(len(SIZES), 256, 128, generator=g) * 0.1).requires_grad_()
    rw = torch.rand(sum(SIZES), generator=g).bfloat16().requires_grad_()
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    y, saved = with_saved(
        lambda: mx_grouped_mm_op(
            x, w, offs, route_weight=rw, out_dtype=torch.float32, gemm_dtype=torch.bfloat16, format=fmt
        )
    )
    rows = mx_grouped_mm_op(x, w.detach(), offs, out_dtype=torch.bfloat16, format=fmt)
    assert y.dtype == torch.float32
    assert torch.equal(y, rows.float() * rw.detach().float()[:, None])  # the same products, one FP32 multiply
    big = [t for t in saved if t.numel() == y.numel()]
    assert big and all(t.dtype == torch.bfloat16 for t in big), [(t.dtype, tuple(t.shape)) for t in saved]
    dout = torch.randn(y.shape, generator=g)
    y.backward(dout)
    # the route weights' gradient sums dout * rows in FP32: only the order of the sum may differ
    torch.testing.assert_close(rw.grad.float(), (dout * rows.float()).sum(-1).bfloat16().float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match=r"grouped_mm: gemm_dtype=torch.float32 without route_weight"):
        mx_grouped_mm_op(x, w, offs, gemm_dtype=torch.float32, format=fmt)
    for bad in (torch.int32, torch.float64):
        with pytest.raises(TypeError, match=rf"grouped_mm: gemm_dtype={bad} \(input \(64, 128\)\) must be torch"):
            mx_grouped_mm_op(x, w, offs, route_weight=rw, gemm_dtype=bad, format=fmt)
    same = mx_grouped_mm_op(x, w.detach(), offs, out_dtype=torch.bfloat16, gemm_dtype=torch.bfloat16, format=fmt)
    assert torch.equal(same, rows)  # gemm_dtype the result's own: no route weights needed


@pytest.mark.parametrize("fmt", refs.FORMATS)
def test_fp32_input_gradient_from_a_bf16_dgrad(fmt):
    """``dgrad_dtype`` (an FP32 input under BF16 autocast): x's gradient is FP32 holding the dgrad GEMM's BF16
    result, one rounding of the FP32 result the default writes; the weight's gradient does not change."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(SIZES), 128, generator=g)
    w = torch.randn(len(SIZES), 256, 128, generator=g) * 0.1
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    dout = torch.randn(sum(SIZES), 256, generator=g).bfloat16()
    grads = {}
    for dgrad_dtype in (None, torch.bfloat16):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = mx_grouped_mm_op(xl, wl, offs, out_dtype=torch.bfloat16, dgrad_dtype=dgrad_dtype, format=fmt)
        y.backward(dout)
        grads[dgrad_dtype] = (xl.grad, wl.grad)
    (dx32, dw32), (dx16, dw16) = grads[None], grads[torch.bfloat16]
    assert dx16.dtype == torch.float32 and torch.equal(dx16, dx16.bfloat16().float())  # BF16 values
    torch.testing.assert_close(dx16, dx32, rtol=2**-8, atol=0)  # one BF16 rounding (RNE: half an ulp, 2^-9)
    torch.testing.assert_close(dw16, dw32, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"grouped_mm: dgrad_dtype=torch.int8 \(input \(64, 128\)\) must be torch"):
        mx_grouped_mm_op(x, w, offs, dgrad_dtype=torch.int8, format=fmt)


def test_group_padding_never_mixes_experts():
    offs = torch.tensor([5, 5, 45, 64], dtype=torch.int32)
    dest, padded, cap = group_padding(offs, 64)
    assert padded.tolist() == [32, 32, 96, 128]
    assert cap % 32 == 0 and cap >= 128 + 32
    assert dest[:5].tolist() == [0, 1, 2, 3, 4] and dest[5].item() == 32 and dest[45].item() == 96
    blocks = dest // 32
    groups = torch.repeat_interleave(torch.arange(4), torch.tensor([5, 0, 40, 19]))
    for b in blocks.unique():
        assert groups[blocks == b].unique().numel() == 1


def test_grouped_mm_rejects_unaligned():
    with pytest.raises(ValueError, match="multiples of 32"):
        mx_grouped_mm_op(torch.randn(8, 48), torch.randn(2, 32, 48), torch.tensor([4, 8], dtype=torch.int32))


def test_grouped_wgrad_bf16_any_group_ends_and_errors():
    """Empty groups and rows past the last end: per-group dy^T x of the BF16 operands, fp32 accumulation and a
    float32 result from the GEMM itself."""
    from mxfx.kernels.common.custom_ops import hp_grouped_wgrad

    g = torch.Generator().manual_seed(3)
    dy, x = torch.randn(45, 32, generator=g), torch.randn(45, 64, generator=g)
    offs = torch.tensor([7, 7, 30, 40], dtype=torch.int32)  # an empty group; rows 40..44 belong to none
    got = hp_grouped_wgrad(dy, x, offs, torch.float32)
    starts = [0, 7, 7, 30]
    ref = torch.stack(
        [dy[a:b].bfloat16().float().t() @ x[a:b].bfloat16().float() for a, b in zip(starts, offs.tolist())]
    )
    assert got.shape == (4, 32, 64) and not got[1].any()
    # a float32 result is the FP32 GEMM of the BF16 operands itself, not a BF16 result widened (2^-9 relative):
    # only the summation order differs from the reference's
    assert got.dtype == torch.float32 and ((got - ref).norm() / ref.norm()).item() < 1e-6
    with pytest.raises(ValueError, match=r"grouped_wgrad_bf16.*\(45, 32\).*\(44, 64\)"):
        hp_grouped_wgrad(dy, x[:44], offs, torch.float32)
    with pytest.raises(ValueError, match="int32 offs"):
        hp_grouped_wgrad(dy, x, offs.long(), torch.float32)


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_block", "bf16_gemm"])
@pytest.mark.parametrize("wgrad", ["bf16", "mxfp8"])
def test_no_rows_give_an_empty_result_and_zero_weight_gradients(fmt, wgrad):
    # an expert-parallel rank can receive no rows; torch's grouped GEMM refuses an empty operand
    w = torch.randn(3, 128, 128, requires_grad=True)
    x = torch.randn(0, 128, requires_grad=True)
    y = mx_grouped_mm_op(x, w, torch.zeros(3, dtype=torch.int32), format=fmt, wgrad=wgrad)
    assert y.shape == (0, 128)
    y.sum().backward()
    assert x.grad.shape == (0, 128) and w.grad.shape == (3, 128, 128) and not w.grad.any()


def test_grouped_op_argument_errors():
    x, w = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(3, 32, 64)
    offs = torch.tensor([5, 5, 33], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"must be 3D \[E, N, K\]"):
        mx_grouped_mm_op(x, w[0], offs)
    for kw in ({"wgrad": "fp8"}, {"save": "fp4"}):
        with pytest.raises(ValueError, match=f"grouped_mm: {next(iter(kw))}=.*'mxfp8', 'bf16'"):
            mx_grouped_mm_op(x, w, offs, **kw)
    with pytest.raises(ValueError, match=r"grouped_mm: offs of shape \(3,\) has dtype torch.int64.*int32"):
        mx_grouped_mm_op(x, w, offs.long())
    with pytest.raises(TypeError, match=r"grouped_mm: offs must be an int32 tensor.*list"):
        mx_grouped_mm_op(x, w, [5, 5, 33])
    with pytest.raises(TypeError, match=r"grouped_mm: out_dtype=torch.int32 must be a floating dtype"):
        mx_grouped_mm_op(x, w, offs, out_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"grouped_mm: out_dtype=torch.float64 \(input \(40, 64\)\).*cast the result"):
        mx_grouped_mm_op(x, w, offs, out_dtype=torch.float64)
    with pytest.raises(TypeError, match=r"grouped_mm: weight \(torch.float64 \(3, 32, 64\)\) must be a bfloat16"):
        mx_grouped_mm_op(x, w.double(), offs)
    for rw in (torch.tensor([0.5]), torch.ones(40, 2)):
        with pytest.raises(ValueError, match=r"grouped_mm: route_weight of shape .* must be \[S\] or \[S, 1\]"):
            mx_grouped_mm_op(x, w, offs, route_weight=rw)
    with pytest.raises(ValueError, match=r"grouped_mm: weight of shape \(0, 32, 64\) has no experts"):
        mx_grouped_mm_op(x, w[:0], offs[:0])
    with pytest.raises(TypeError, match=r"mxfx.grouped_mm: input of shape \(40, 64\) has dtype torch.float64"):
        mx_grouped_mm_op(x.double(), w, offs)
    with pytest.raises(ValueError, match=r"mxfx.grouped_mm: scale_rule='round' is not a rule of format='mxfp8'"):
        mx_grouped_mm_op(x, w, offs, scale_rule="round")
    from mxfx.ops.linear import mx_linear

    with pytest.raises(ValueError, match="mx_linear: wgrad='fp8'.*'mxfp8', 'bf16'"):
        mx_linear(x, torch.randn(32, 64), wgrad="fp8")


def test_swiglu_grouped_compiled_equals_eager():
    """The fused SwiGLU pass writes gate's and up's saved MX pairs as separate outputs of one op: a
    compiled graph must keep both (a fake that aliased them once made backward read up's pair twice)."""
    torch.manual_seed(0)
    gu = torch.randn(64, 128).bfloat16().requires_grad_()
    w = torch.randn(2, 64, 64).requires_grad_()
    offs = torch.tensor([32, 64], dtype=torch.int32)

    def f(gu, w):
        g, u = gu.chunk(2, -1)
        return mx_grouped_mm_op(g, w, offs, up=u).float().square().sum()

    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager")):
        gu.grad = w.grad = None
        fn(gu, w).backward()
        grads.append((gu.grad.clone(), w.grad.clone()))
    for eager, compiled in zip(*grads):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_block"])
def test_ops_called_in_user_code_compile_whole_under_dynamo(fmt):
    """User code calling the public ops itself under ``torch.compile(fullgraph=True)`` (any backend: no mxfx rewrite)
    traces without a graph break, the default settings included (a Format built from dataclass defaults is an
    object Dynamo cannot create; the CPU group-ends check must not read offs values while Dynamo traces), and gives
    eager's result: the same ops run (bf16 outputs: a bound of one bf16 rounding, for GEMM kernels that may
    split their sums differently once traced)."""
    g = torch.Generator().manual_seed(0)
    sizes = [70, 0, 33, 150, 3]
    x = torch.randn(sum(sizes), 128, generator=g).bfloat16()
    w = torch.randn(len(sizes), 256, 128, generator=g) * 0.05
    rw = torch.rand(sum(sizes), 1, generator=g).bfloat16()
    lw = torch.randn(256, 128, generator=g) * 0.05
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    kw = {} if fmt == "mxfp8" else {"format": fmt}  # the default settings, or a format by name

    def fn(x, w, rw, lw):
        return mx_grouped_mm_op(x, w, offs, route_weight=rw, **kw), mx_linear(x, lw, None, **kw)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(x, w, rw, lw), fn(x, w, rw, lw)):
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)


def _mx_pairs():
    a = torch.ops.mxfx.quantize(torch.randn(64, 256), "rceil")
    b = torch.ops.mxfx.quantize(torch.randn(4, 96, 256), "rceil")
    return a, b


@pytest.mark.parametrize(
    "ends, out_dtype, match",
    [
        ([30, 10, 40, 64], torch.bfloat16, r"offs \[30, 10, 40, 64\] must be non-decreasing"),
        ([10, 30, 40, 100], torch.bfloat16, r"offs \[10, 30, 40, 100\] .* at most the 64 rows"),
        ([10, 30, 40, 64], torch.int32, r"out_dtype torch.int32 is not one of"),
    ],
)
@pytest.mark.parametrize("fake", [False, True])
def test_mx_grouped_op_refuses_bad_group_ends_and_outputs_naming_itself(ends, out_dtype, match, fake):
    """The op and its fake refuse what would give a silent wrong answer (rows of two groups mixed, rows past A,
    integer outputs) with the op's name; on the fake only what a trace can know (dtype, not offs' values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    (aq, as_), (bq, bs) = _mx_pairs()
    offs = torch.tensor(ends, dtype=torch.int32)
    if fake and out_dtype != torch.int32:
        pytest.skip("offs' values are data: a fake tensor has none")
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad():
        with pytest.raises((ValueError, TypeError), match="mxfx::grouped_mm: " + match):
            torch.ops.mxfx.grouped_mm(aq, as_, bq, bs, offs, out_dtype, False)


def test_mx_gemm_fakes_check_shapes_and_devices_as_the_ops_do():
    from torch._subclasses.fake_tensor import FakeTensorMode

    (aq, as_), (bq, bs) = _mx_pairs()
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(ValueError, match=r"mxfx::mm: A of shape \(64, 256\) and B of shape \(4, 96, 256\)"):
            torch.ops.mxfx.mm(aq, as_, bq, bs, torch.bfloat16, False)
        with pytest.raises(ValueError, match="not a multiple of 32"):
            torch.ops.mxfx.quantize(torch.empty(4, 100), "rceil")
    with pytest.raises(ValueError, match=r"mxfx::dequantize: tensors on different devices"):
        torch.ops.mxfx.dequantize(aq, as_.to("meta"), torch.float32)
