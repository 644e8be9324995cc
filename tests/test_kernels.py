"""MX kernels (mxfx.kernels) against the plain-torch reference (mxfx.numerics.mx), bit for bit.

* CPU: device-path selection falls back to the reference and never imports Triton.
* CUDA (skipped without a GPU): every Triton kernel against the CPU reference.
* Triton interpreter (skipped without ``import triton``): small shapes on CPU
  tensors, in a subprocess with ``TRITON_INTERPRET=1``. The interpreter's
  fp32 -> fp8 cast does not round to nearest even (Triton 3.6 and 3.9 round half up and
  drop the carry into the exponent; values that underflow are wrong too) and it
  flushes bf16 subnormals when widening to fp32, so these inputs are exactly
  representable after scaling; they check indexing, scales, special blocks and layouts.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mxfx.numerics import mx as mxf
from mxfx.kernels.common import launch
from mxfx.kernels.mx import device_path
from mxfx.numerics.layout import to_blocked
from tests.helpers import run_interpreter_checks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape and bytes; NaNs match NaNs whatever their sign or payload bits."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() and a.dtype.itemsize > 1:
        nan_a, nan_b = a.isnan(), b.isnan()
        if not torch.equal(nan_a, nan_b):
            return False
        a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
    return torch.equal(a.view(ints), b.view(ints))


def assert_same(got, ref):
    assert len(got) == len(ref), f"{len(got)} outputs, expected {len(ref)}"
    for i, (g, r) in enumerate(zip(got, ref)):
        assert same_bits(g, r), (
            f"output {i}: {(g.cpu().view(torch.uint8) != r.cpu().view(torch.uint8)).sum()} bytes differ"
        )


def special_rows(x: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """``x`` with special first blocks in its first rows: NaN, +Inf, -Inf, zeros, tiny, +/-big.

    The tiny block holds the dtype's subnormals (k x 2^-133, or k x 2^-24 in fp16, k < 16:
    exact after scaling). ``exact`` leaves out the big values, whose blocks round.
    """
    x = x.clone()
    tiny = 2.0**-24 if x.dtype == torch.float16 else 2.0**-133
    big = 60000.0 if x.dtype == torch.float16 else 3e38
    specials = [float("nan"), float("inf"), float("-inf"), "zero", "tiny"] + ([] if exact else [big, -big])
    for i, v in enumerate(specials[: x.shape[-2]]):
        blk = x[..., i, :32]
        if v == "zero":
            blk.zero_()
        elif v == "tiny":
            blk.copy_((tiny * (torch.arange(32) % 16).float()).to(x.dtype))
        else:
            blk[..., 3] = v
    return x


def rand(shape, dtype, device="cuda", scale_rows=True):
    x = torch.randn(shape, dtype=torch.float32)
    if scale_rows:  # a wide exponent range across rows
        x = x * 2.0 ** torch.randint(-30, 30, (*shape[:-1], 1)).float()
    return x.to(dtype).to(device)


# ---- CPU ------------------------------------------------------------------------------

# The modules of mxfx.kernels that hold no Triton code: the packages, launching, the SiLU reference, the shared ops
# and high-precision GEMMs, and each format's device path, argument checks, views, custom ops, GEMMs (the choice, the
# emulation or reference, the native calls through torch) and operands.
TORCH_ONLY_KERNEL_MODULES = (
    "mxfx.kernels",
    "mxfx.kernels.common",
    "mxfx.kernels.mx",
    "mxfx.kernels.fp8_block",
    "mxfx.kernels.common.launch",
    "mxfx.kernels.common.kernel_keys",  # reads kernel sources; imports nothing of Triton
    "mxfx.kernels.common.silu",
    "mxfx.kernels.common.swiglu",
    "mxfx.kernels.common.gemm",
    "mxfx.kernels.common.custom_ops",
    "mxfx.kernels.mx.device_path",
    "mxfx.kernels.mx.checks",
    "mxfx.kernels.mx.views",
    "mxfx.kernels.mx.custom_ops",
    "mxfx.kernels.mx.gemm",
    "mxfx.kernels.mx.gemm_blackwell",
    "mxfx.kernels.mx.operands",
    "mxfx.kernels.mx.swiglu_operand",
    "mxfx.kernels.fp8_block.device_path",
    "mxfx.kernels.fp8_block.custom_ops",
    "mxfx.kernels.fp8_block.gemm",
    "mxfx.kernels.fp8_block.gemm_cublas",
)


def test_cpu_path_never_loads_triton_kernels():
    """Importing mxfx and running its ops on CPU tensors imports no Triton kernel module of mxfx (torch's Dynamo
    imports Triton itself where it is installed)."""
    code = (
        "import sys, torch, mxfx; from mxfx.kernels.mx import device_path as d;"
        "from mxfx.kernels.common import custom_ops;"
        "x = torch.randn(64, 64); d.quantize_lastdim(x, 'rceil'); d.quantize_blocked(x, 'rceil');"
        "custom_ops.swiglu_product(x, x);"
        f"bad = [m for m in sys.modules if m.startswith('mxfx.kernels') and m not in {TORCH_ONLY_KERNEL_MODULES!r}];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_cpu_quantize_dual_source_reference_and_errors():
    """The CPU path: the reference values, the columnwise outputs in x's layout, and clear errors."""
    x = special_rows(rand((96, 64), torch.bfloat16, device="cpu"))
    check_dual_source(
        device_path.quantize_dual_source(x, "floor", dequantized=torch.float32), x, "floor", torch.float32
    )
    check_dequantized_only(device_path.quantize_dual_source, x, "rceil", torch.bfloat16)
    with pytest.raises(ValueError, match=r"no output \(mx=False, dequantized=None\)"):
        device_path.quantize_dual_source(x, "rceil", mx=False)
    with pytest.raises(TypeError, match=r"quantize_dual_source: output dtype torch.int32 for x of shape \(96, 64\)"):
        device_path.quantize_dual_source(x, "rceil", dequantized=torch.int32)
    with pytest.raises(ValueError, match=r"2D \[M, K\].*\(64,\)"):
        device_path.quantize_dual_source(x[0], "rceil")
    with pytest.raises(ValueError, match="at least one orientation"):
        device_path.quantize_dual_source(x, "rceil", row=False, col=False)


def test_cpu_quantize_blocked_reference():
    x = torch.randn(3, 100, 64)
    q, b = device_path.quantize_blocked(x, "rceil")
    rq, rs = mxf.quantize_lastdim(x, "rceil")
    assert same_bits(q, rq) and torch.equal(b, to_blocked(rs.reshape(300, 2)))
    from torch._subclasses.fake_tensor import FakeTensorMode

    import mxfx.kernels.mx.custom_ops  # noqa: F401  (registers the ops)

    for shape in ((64, 0), (0, 64), (0, 0), (2, 64, 0), (1, 0, 96)):  # no rows or no columns: as the fake says
        q, b = device_path.quantize_blocked(torch.zeros(shape), "rceil")
        with FakeTensorMode() as mode:
            fq, fb = torch.ops.mxfx.quantize_blocked(mode.from_tensor(torch.zeros(shape)), "rceil")
        assert (q.shape, b.shape, q.dtype) == (fq.shape, fb.shape, fq.dtype) and b.numel() == 0, shape


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_dispatch_errors_name_op_and_shape(device):
    with pytest.raises(ValueError, match=r"mxfx.quantize.*\(4, 48\)"):
        device_path.quantize_lastdim(torch.zeros(4, 48, device=device), "rceil")
    with pytest.raises(TypeError, match=r"mxfx.quantize.*\(4, 64\).*float64"):
        device_path.quantize_lastdim(torch.zeros(4, 64, dtype=torch.float64, device=device), "rceil")
    with pytest.raises(ValueError, match=r"quantize_dual.*\(40, 64\) \(M = 40 is not\); pad M .*token dim"):
        device_path.quantize_dual(torch.zeros(40, 64, device=device), "rceil")
    with pytest.raises(ValueError, match=r"quantize_dual.*\(64, 48\) \(K = 48 is not\); pad K to a multiple of 32$"):
        device_path.quantize_dual(torch.zeros(64, 48, device=device), "rceil")
    q, s = device_path.quantize_lastdim(torch.zeros(4, 64, device=device), "rceil")
    with pytest.raises(ValueError, match=r"mxfx.dequantize.*\(4, 1\)"):
        device_path.dequantize_lastdim(q, s[:, :1], torch.bfloat16)
    # the same checks on every device: rank, non-tensors, output dtypes (custom ops included)
    with pytest.raises(ValueError, match=r"quantize_dual: needs a 2D \[M, K\] or 3D.*\(2, 2, 64, 64\)"):
        device_path.quantize_dual(torch.zeros(2, 2, 64, 64, device=device), "rceil")
    with pytest.raises(TypeError, match=r"quantize_dual: expected a torch.Tensor, got list"):
        device_path.quantize_dual([[1.0] * 32] * 32, "rceil")
    with pytest.raises(ValueError, match=r"quantize_dual_source: needs a 2D.*\(64,\); reshape it"):
        device_path.quantize_dual_source(torch.zeros(64, device=device), "rceil")
    with pytest.raises(TypeError, match=r"mxfx.dequantize: output dtype torch.int32 for qdata of shape \(4, 64\)"):
        torch.ops.mxfx.dequantize(q, s, torch.int32)
    with pytest.raises(TypeError, match=r"mxfx.quantize_dequantize: output dtype torch.int32 for input of shape"):
        device_path.quantize_dequantize(torch.zeros(4, 64, device=device), "rceil", torch.int32)


# ---- CUDA -----------------------------------------------------------------------------

ROW_SHAPES = [(96, 64), (97, 256), (1, 32), (300, 2048), (3, 7, 160)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@cuda
@pytest.mark.parametrize("rule", mxf.SCALE_RULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_quantize_rowwise(shape, dtype, rule):
    x = special_rows(rand(shape, dtype))
    assert_same(device_path.quantize_lastdim(x, rule), mxf.quantize_lastdim(x.cpu(), rule))


@cuda
@pytest.mark.parametrize("rule", mxf.SCALE_RULES)
@pytest.mark.parametrize("shape", [(96, 64), (256, 160), (2, 64, 96), (4096, 512), (64, 100)])
def test_quantize_columnwise(shape, rule):
    x = special_rows(rand(shape, torch.bfloat16).transpose(-2, -1)).transpose(-2, -1)
    xt = x.transpose(-2, -1)  # blocks down dim -2 of x, output [.., K, M]
    assert_same(device_path.quantize_lastdim(xt, rule), mxf.quantize_lastdim(xt.cpu(), rule))


@cuda
def test_quantize_noncontiguous_views():
    base = rand((128, 512), torch.bfloat16)
    for view in (base[:, ::2], base[::3], base[:, 64:192], base.view(4, 32, 512)[:, 5:20]):
        assert_same(device_path.quantize_lastdim(view, "rceil"), mxf.quantize_lastdim(view.contiguous().cpu(), "rceil"))


@cuda
def test_quantize_no_recompile_per_token_count():
    from mxfx.kernels.mx import quantize as tq

    x = rand((4096, 256), torch.bfloat16)
    device_path.quantize_lastdim(x[:96], "rceil")
    caches = getattr(tq._quantize_kernel, "device_caches", None)
    if not caches:
        pytest.skip("Triton's kernel cache layout changed")
    before = sum(len(c[0]) for c in caches.values())
    for m in (97, 1000, 1, 4095, 3333):
        assert_same(device_path.quantize_lastdim(x[:m], "rceil"), mxf.quantize_lastdim(x[:m].cpu(), "rceil"))
    assert sum(len(c[0]) for c in caches.values()) == before


@cuda
@pytest.mark.parametrize("rule", mxf.SCALE_RULES)
@pytest.mark.parametrize("shape", [(96, 64), (256, 1024), (2, 64, 96), (32, 4096)])
def test_quantize_dual(shape, rule):
    x = special_rows(rand(shape, torch.bfloat16))
    got = device_path.quantize_dual(x, rule)
    xc = x.cpu()
    ref = (*mxf.quantize_lastdim(xc, rule), *mxf.quantize_lastdim(xc.transpose(-2, -1), rule))
    assert_same(got, ref)


@cuda
def test_quantize_dual_strided_and_errors():
    x = rand((128, 512), torch.float32)[:, ::2]
    xc = x.cpu()
    assert_same(
        device_path.quantize_dual(x, "rceil"),
        (*mxf.quantize_lastdim(xc, "rceil"), *mxf.quantize_lastdim(xc.t(), "rceil")),
    )
    with pytest.raises(ValueError, match=r"quantize_dual.*\(96, 48\)"):
        device_path.quantize_dual(rand((96, 48), torch.bfloat16), "rceil")


def dual_source_ref(x, rule, dtype=None):
    """The reference of ``quantize_dual_source``: ``quantize_lastdim`` of x and of its transpose."""
    x = x.cpu()
    out = []
    for src in (x, x.transpose(-2, -1)):
        q, s = mxf.quantize_lastdim(src, rule)
        out += [q, s] + ([] if dtype is None else [mxf.dequantize_lastdim(q, s, dtype)])
    return out


def check_dequantized_only(fn, x, rule, dtype):
    """``mx=False``: no MX pair comes back, the dequantized values equal the reference, in x's layout."""
    q_row, s_row, h_row, q_col, s_col, h_col = fn(x, rule, dequantized=dtype, mx=False)
    assert (q_row, s_row, q_col, s_col) == (None,) * 4
    ref = dual_source_ref(x, rule, dtype)
    assert_same([h_row, h_col], [ref[2], ref[5]])
    assert h_col.transpose(-2, -1).is_contiguous(), h_col.stride()


def check_dual_source(got, x, rule, dtype=None):
    """Values bit-exact against the reference, and the columnwise outputs in x's layout."""
    q_row, s_row, h_row, q_col, s_col, h_col = got
    if dtype is None:
        assert h_row is None and h_col is None
    outs = [q_row, s_row] + ([] if dtype is None else [h_row]) + [q_col, s_col] + ([] if dtype is None else [h_col])
    assert_same(outs, dual_source_ref(x, rule, dtype))
    for t in (q_col, s_col) + (() if dtype is None else (h_col,)):
        assert t.transpose(-2, -1).is_contiguous() and t.stride()[-2] == 1, t.stride()


@cuda
@pytest.mark.parametrize("rule", mxf.SCALE_RULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(96, 64), (256, 1056), (2, 64, 96), (32, 4096), (4096, 288)])
def test_quantize_dual_source(shape, dtype, rule):
    x = special_rows(rand(shape, dtype))
    check_dual_source(device_path.quantize_dual_source(x, rule), x, rule)
    check_dual_source(device_path.quantize_dual_source(x, rule, dequantized=torch.bfloat16), x, rule, torch.bfloat16)
    check_dequantized_only(device_path.quantize_dual_source, x, rule, torch.bfloat16)


@cuda
def test_quantize_dual_source_one_orientation_strided_and_errors():
    x = rand((128, 512), torch.float32)[:, ::2]
    got = device_path.quantize_dual_source(x, "floor", row=False, dequantized=torch.float32)
    assert got[:3] == (None, None, None)
    tq, ts = mxf.quantize_lastdim(x.cpu().t(), "floor")
    assert_same(got[3:], (tq, ts, mxf.dequantize_lastdim(tq, ts, torch.float32)))
    rq, rs = mxf.quantize_lastdim(x.cpu(), "rceil")
    got = device_path.quantize_dual_source(x, "rceil", col=False)
    assert_same(got[:2], (rq, rs)) and got[3:] == (None, None, None)
    with pytest.raises(ValueError, match=r"quantize_dual_source.*\(96, 48\)"):
        device_path.quantize_dual_source(rand((96, 48), torch.bfloat16), "rceil")


@cuda
@pytest.mark.parametrize("shape", [(64, 96), (2, 256, 160)])
def test_dequantize_source_layout_keeps_it(shape):
    """A columnwise pair in the source layout dequantizes to the same values, in the same layout."""
    x = special_rows(rand(shape, torch.bfloat16))
    q_col, s_col = device_path.quantize_dual_source(x, "rceil", row=False)[3:5]
    out = device_path.dequantize_lastdim(q_col, s_col, torch.bfloat16)
    assert out.stride() == q_col.stride()
    ref_q, ref_s = mxf.quantize_lastdim(x.cpu().transpose(-2, -1), "rceil")
    assert same_bits(out, mxf.dequantize_lastdim(ref_q, ref_s, torch.bfloat16))


@cuda
@pytest.mark.parametrize("shape", [(96, 64), (300, 1056), (2, 130, 64)])
def test_quantize_blocked(shape):
    x = rand(shape, torch.bfloat16)
    q, b = device_path.quantize_blocked(x, "rceil")
    rq, rs = mxf.quantize_lastdim(x.cpu(), "rceil")
    assert same_bits(q, rq) and torch.equal(b.cpu(), to_blocked(rs.reshape(-1, rs.shape[-1])))


@cuda
def test_blocked_scales_unpadded_every_byte_written():
    """Where the blocked layout has no padding (rows a multiple of 128, scale columns of 4) the scale buffer is
    not zero-filled first: every byte must come from the kernel. Cached GPU memory is poisoned with 0xAB first,
    so a byte the kernel missed would show as 0xAB instead of the reference scale."""
    x = special_rows(rand((256, 512), torch.bfloat16))  # row scales [256, 16], column scales [512, 8]
    xc = x.cpu()
    rq, rs = mxf.quantize_lastdim(xc, "rceil")
    cq, cs = mxf.quantize_lastdim(xc.t(), "rceil")
    x3 = special_rows(rand((2, 128, 256), torch.bfloat16))  # per batch: [128, 8] and [256, 4] scale matrices
    r3q, r3s = mxf.quantize_lastdim(x3.cpu(), "rceil")
    c3q, c3s = mxf.quantize_lastdim(x3.cpu().transpose(-2, -1), "rceil")
    stack = lambda t: torch.stack([to_blocked(m) for m in t])  # noqa: E731
    for run, want in (
        (lambda: device_path.quantize_blocked(x, "rceil"), (rq, to_blocked(rs))),
        (lambda: device_path.quantize_dual_blocked(x, "rceil"), (rq, to_blocked(rs), cq, to_blocked(cs))),
        (lambda: device_path.quantize_dual_blocked(x3, "rceil"), (r3q, stack(r3s), c3q, stack(c3s))),
    ):
        torch.cuda.empty_cache()
        poison = [torch.full((1 << 20,), 0xAB, dtype=torch.uint8, device="cuda") for _ in range(8)]
        del poison
        assert_same(run(), want)


@cuda
@pytest.mark.parametrize("cvt", [0, 1, 2, 3])
def test_conversion_forms_give_the_same_bytes(monkeypatch, cvt):
    """Every combination of the conversion forms (``mx_block.CONVERT_*``: E4M3 bytes four to a register, bf16 widened
    a register pair at a time), forced into every kernel that takes them, gives the reference bytes; the kernels'
    own choices are speed choices only."""
    from mxfx.kernels.mx import blocks as mx_block

    monkeypatch.setattr(mx_block, "CONVERSION_OVERRIDE", cvt)
    x = special_rows(rand((256, 512), torch.bfloat16))
    g, u = rand((256, 512), torch.bfloat16, scale_rows=False) * 4, x
    xc = x.cpu()
    row, col = mxf.quantize_lastdim(xc, "rceil"), mxf.quantize_lastdim(xc.t(), "rceil")
    assert_same(device_path.quantize_lastdim(x, "rceil"), row)
    assert_same(device_path.quantize_lastdim(x.t(), "rceil"), col)
    assert_same(device_path.quantize_dual(x, "rceil"), (*row, *col))
    assert_same(device_path.quantize_dual_blocked(x, "rceil"), (row[0], to_blocked(row[1]), col[0], to_blocked(col[1])))
    assert_same(device_path.quantize_blocked(x, "rceil"), (row[0], to_blocked(row[1])))
    assert_same(device_path.quantize_dequantize(x, "rceil", torch.bfloat16), with_values(row, torch.bfloat16))
    check_dual_source(
        device_path.quantize_dual_source(x, "rceil", dequantized=torch.bfloat16), x, "rceil", torch.bfloat16
    )
    check_dual_source(
        device_path.quantize_dual_source(x.float(), "floor", dequantized=torch.bfloat16),
        x.float(),
        "floor",
        torch.bfloat16,
    )
    got = device_path.swiglu_quantize(g, u, "rceil")
    assert_same(got, swiglu_ref(g, u, "rceil"))
    assert_same(
        device_path.swiglu_quantize(g, u, "rceil", torch.bfloat16, save_inputs=True),
        with_saved_inputs(with_values(got, torch.bfloat16), g, u, "rceil"),
    )


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(96, 64), (300, 2048), (2, 5, 96)])
def test_dequantize(shape, dtype):
    q = torch.randint(0, 256, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN bytes included
    s = torch.randint(0, 256, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8)
    s.view(-1)[:4] = torch.tensor([0, 255, 254, 1], dtype=torch.uint8)
    got = device_path.dequantize_lastdim(q.cuda(), s.cuda(), dtype)
    assert same_bits(got, mxf.dequantize_lastdim(q, s, dtype))
    got_t = device_path.dequantize_lastdim(
        q.cuda().transpose(0, -2)[..., :32], s.cuda().transpose(0, -2)[..., :1], dtype
    )
    assert same_bits(got_t, mxf.dequantize_lastdim(q.transpose(0, -2)[..., :32], s.transpose(0, -2)[..., :1], dtype))


@cuda
def test_quantize_dequantize_strided():
    x = special_rows(rand((128, 256), torch.bfloat16))
    for view in (x.t(), x[:, ::2], x[:, 32:96]):
        rq, rs = mxf.quantize_lastdim(view.cpu(), "rceil")
        got = device_path.quantize_dequantize(view, "rceil", torch.bfloat16)
        assert_same(got, (rq, rs, mxf.dequantize_lastdim(rq, rs, torch.bfloat16)))


@cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(96, 64), (300, 2048), (2, 5, 96)])
def test_quantize_dequantize(shape, out_dtype):
    x = special_rows(rand(shape, torch.bfloat16))
    got = device_path.quantize_dequantize(x, "rceil", out_dtype)
    rq, rs = mxf.quantize_lastdim(x.cpu(), "rceil")
    assert_same(got, (rq, rs, mxf.dequantize_lastdim(rq, rs, out_dtype)))


FLUSH_GATE = -87.3365478515625  # largest fp32 gate with 1 + expf(-g) > 2^126 (bits 0xC2AEAC50)


def swiglu_ref(g, u, rule):
    """quantize(silu(g) * u) with the SiLU mxfx documents: F.silu, except -0 for finite g <= FLUSH_GATE."""
    g = g.float()
    silu = torch.where((g <= FLUSH_GATE) & g.isfinite(), torch.full_like(g, -0.0), F.silu(g))
    return mxf.quantize_lastdim(silu * u.float(), rule)


def test_silu_fp32_flush_band():
    """mxfx's SiLU reference: F.silu above the flush gate, -0 from it down for finite gates, F.silu's
    NaN at -Inf; its flush constant is the fp32 just below which expf(-g) exceeds 2^126."""
    from mxfx.kernels.common.silu import SILU_FLUSH_GATE, silu_fp32

    t = torch.tensor([SILU_FLUSH_GATE])
    above = torch.nextafter(t, torch.tensor([0.0]))
    assert float(torch.exp(-t)) > 2.0**126 >= float(torch.exp(-above))
    g = torch.cat([above, t, torch.tensor([-88.0, -1e38, -float("inf"), -0.0, 0.0, 3.0, float("inf"), float("nan")])])
    got, ref = silu_fp32(g), F.silu(g)
    assert got[0] == ref[0] and got[0] < 0  # the last gate kept: a normal fp32 about -1.1e-36
    assert torch.equal(got[1:4].view(torch.int32), torch.full((3,), -0.0).view(torch.int32))
    assert got[4].isnan() and got[9].isnan() and torch.equal(got[5:9].view(torch.int32), ref[5:9].view(torch.int32))


def with_values(pair, dtype):
    """A reference MX pair plus its dequantized values: what the ``dequantized=`` forms return."""
    return (*pair, mxf.dequantize_lastdim(pair[0].cpu(), pair[1].cpu(), dtype))


def test_cpu_fused_quantize_dequantized_forms():
    """SwiGLU and route-weight quantize with ``dequantized=``: the pair, plus its values, on the CPU path."""
    g, u, w = torch.randn(40, 64) * 3, special_rows(torch.randn(40, 64)), torch.rand(40)
    assert_same(
        device_path.swiglu_quantize(g, u, "floor", torch.bfloat16),
        with_values(swiglu_ref(g, u, "floor"), torch.bfloat16),
    )
    ref = mxf.quantize_lastdim(u * w[:, None], "rceil")
    assert_same(device_path.route_weight_quantize(u, w, "rceil", torch.float32), with_values(ref, torch.float32))
    with pytest.raises(TypeError, match=r"route_weight_quantize: output dtype torch.int8 for dy of shape \(40, 64\)"):
        device_path.route_weight_quantize(u, w, "rceil", torch.int8)
    with pytest.raises(ValueError, match=r"route_weight_quantize: expected dy \[S, D\].*\(40, 64\).*\(20,\)"):
        device_path.route_weight_quantize(u, w[:20], "rceil")
    with pytest.raises(TypeError, match="swiglu_quantize"):
        device_path.swiglu_quantize([1.0], u, "rceil", torch.bfloat16)
    assert_same(
        device_path.swiglu_quantize(g, u, "rceil", save_inputs=True),
        with_saved_inputs(swiglu_ref(g, u, "rceil"), g, u, "rceil"),
    )


def with_saved_inputs(out, g, u, rule):
    """What ``save_inputs=True`` appends: the rowwise MX pairs of gate and of up."""
    return (*out, *mxf.quantize_lastdim(g, rule), *mxf.quantize_lastdim(u, rule))


@cuda
@pytest.mark.parametrize("rule", mxf.SCALE_RULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(96, 64), (300, 1408), (2, 33, 128)])
def test_swiglu_quantize(shape, dtype, rule):
    g, u = rand(shape, dtype, scale_rows=False) * 4, special_rows(rand(shape, dtype))
    got = device_path.swiglu_quantize(g, u, rule)
    assert_same(got, swiglu_ref(g, u, rule))  # torch's CUDA silu: the same fp32 arithmetic
    assert_same(device_path.swiglu_quantize(g, u, rule, torch.bfloat16), with_values(got, torch.bfloat16))
    assert_same(device_path.swiglu_quantize(g, u, rule, save_inputs=True), with_saved_inputs(got, g, u, rule))
    assert_same(
        device_path.swiglu_quantize(g, u, rule, torch.float32, save_inputs=True),
        with_saved_inputs(with_values(got, torch.float32), g, u, rule),
    )
    # against the CPU path: its expf may differ from CUDA's by an ulp, which moves an E4M3 rounding or a
    # block's scale now and then; a handful of bytes, never a pattern
    q_cpu, s_cpu = swiglu_ref(g.cpu(), u.cpu(), rule)
    q_diff = int((got[0].cpu().view(torch.uint8) != q_cpu.view(torch.uint8)).sum())
    s_diff = int((got[1].cpu() != s_cpu).sum())
    assert q_diff <= max(4, 1e-4 * q_cpu.numel()) and s_diff <= max(2, 1e-3 * s_cpu.numel()), (q_diff, s_diff)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_swiglu_silu_every_gate(dtype):
    """The kernel's SiLU on every bf16 and fp16 gate, and for fp32 on dense sweeps across exp's overflow
    (-100..10), over huge negative gates (-1 .. -1e38, where a SiLU that is not ~0 would show) and on
    2^18 random bit patterns, with up = 1 so that the MX input is the SiLU itself: bytes equal
    quantize(silu(g)) with F.silu's values in the flush band replaced by -0 (``mxfx.kernels.common.silu``), Inf
    and NaN gates included (``bench/probes/silu_exhaustive.py`` compares the SiLU alone with that rule on
    all 2^32 fp32 inputs). Blocks of gates in (-88.7, -87.3] are where a kernel without the flush differs:
    bf16 has -87.5, -88 and -88.5 there, and the fp32 sweeps hold the band's edges."""
    if dtype == torch.float32:
        gen = torch.Generator().manual_seed(0)
        bits = torch.randint(-(2**31), 2**31, (2**18,), generator=gen, dtype=torch.int64).to(torch.int32)
        g = torch.cat([torch.linspace(-100, 10, 2**16), -torch.logspace(0, 38, 2**14), bits.view(torch.float32)])
        g = g.to("cuda").reshape(-1, 32)
    else:
        g = torch.arange(-(2**15), 2**15, device="cuda").to(torch.int16).view(dtype).reshape(-1, 32)
    u = torch.ones_like(g)
    for rule in mxf.SCALE_RULES:
        ref = swiglu_ref(g, u, rule)
        plain = mxf.quantize_lastdim(F.silu(g.float()), rule)  # without the flush
        assert not torch.equal(ref[0].view(torch.uint8), plain[0].view(torch.uint8))  # the band is exercised
        assert_same(device_path.swiglu_quantize(g, u, rule), ref)
        assert_same(
            device_path.swiglu_quantize(g, u, rule, torch.bfloat16, save_inputs=True),
            with_saved_inputs(with_values(ref, torch.bfloat16), g, u, rule),
        )


def test_swiglu_product_cpu_reference_and_errors():
    """``mxfx::swiglu_product``, the values a SwiGLU's wgrad operand is quantized from: on the CPU the fused
    quantize's own product (quantized, its bytes), flush band included; clear errors for mismatched inputs."""
    from mxfx.kernels.common.custom_ops import swiglu_product

    g = torch.cat([torch.randn(31, 64) * 4, torch.full((1, 64), -88.0)])  # a row in the SiLU's flush band
    u = torch.randn(32, 64).to(torch.bfloat16)
    p = swiglu_product(g, u)
    assert p.dtype == torch.float32 and p.is_contiguous() and torch.equal(p[-1], torch.full((64,), -0.0))
    assert_same(mxf.quantize_lastdim(p, "rceil"), device_path.swiglu_quantize(g, u, "rceil"))
    assert torch.equal(swiglu_product(g.t(), u.t()), p.t())
    with pytest.raises(ValueError, match=r"swiglu_product: gate of shape \(32, 64\) and up of shape \(32, 32\)"):
        swiglu_product(g, u[:, :32])
    with pytest.raises(TypeError, match=r"swiglu_product: gate \(torch.float32\) and up \(torch.int32\)"):
        swiglu_product(g, u.int())


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_swiglu_product_kernel_is_the_fused_product(dtype):
    """The product kernel (the wgrad operands' values) computes mxfx's SiLU times up in fp32 as the fused SwiGLU
    quantizes do, bit for bit: equal to torch's CUDA silu with mxfx's flush, on every bf16/fp16 gate or fp32 sweeps
    across the flush band, with ordinary ups; quantized, it is the fused kernel's output; strided gate/up (halves of
    one gate_up tensor, a transposed view, a 3D batch) give the same values."""
    from mxfx.kernels.common.custom_ops import swiglu_product

    if dtype == torch.float32:
        g = torch.cat([torch.linspace(-100, 10, 2**16), -torch.logspace(0, 38, 2**14)]).to("cuda").reshape(-1, 64)
    else:
        g = torch.arange(-(2**15), 2**15, device="cuda").to(torch.int16).view(dtype).reshape(-1, 64)
    u = torch.randn(g.shape, generator=torch.Generator().manual_seed(2)).to("cuda", dtype)
    p = swiglu_product(g, u)
    gf = g.float()
    want = torch.where((gf <= FLUSH_GATE) & gf.isfinite(), torch.full_like(gf, -0.0), F.silu(gf)) * u.float()
    assert same_bits(p, want)
    for rule in mxf.SCALE_RULES:
        assert_same(device_path.quantize_lastdim(p, rule), device_path.swiglu_quantize(g, u, rule))
    gu = torch.cat([g, u], dim=-1)
    assert same_bits(swiglu_product(gu[:, :64], gu[:, 64:]), p)
    assert same_bits(swiglu_product(g.t(), u.t()), p.t())
    assert same_bits(swiglu_product(g.reshape(4, -1, 64), u.reshape(4, -1, 64)), p.reshape(4, -1, 64))


@cuda
def test_swiglu_quantize_fused_gate_up():
    gu = rand((3, 100, 2 * 512), torch.bfloat16, scale_rows=False) * 3
    g, u = gu.chunk(2, dim=-1)
    assert_same(device_path.swiglu_quantize(g, u, "rceil"), swiglu_ref(g, u, "rceil"))
    g2, u2 = gu[..., ::2], gu[..., 1::2]  # interleaved halves
    assert_same(device_path.swiglu_quantize(g2, u2, "rceil"), swiglu_ref(g2, u2, "rceil"))
    assert_same(
        device_path.swiglu_quantize(g, u, "rceil", torch.float32), with_values(swiglu_ref(g, u, "rceil"), torch.float32)
    )
    for gate, up in ((g, u), (g2, u2)):  # the saved pairs of strided halves come out contiguous
        got = device_path.swiglu_quantize(gate, up, "rceil", torch.bfloat16, save_inputs=True)
        assert_same(
            got, with_saved_inputs(with_values(swiglu_ref(gate, up, "rceil"), torch.bfloat16), gate, up, "rceil")
        )
        assert all(t.is_contiguous() for t in got)


@cuda
@pytest.mark.parametrize("h", [96, 512, 1408])  # tiles of blocks within one row (512) or across rows (96, 1408)
def test_swiglu_quantize_block_streams(h):
    gu = rand((2, 70, 2 * h), torch.bfloat16, scale_rows=False) * 3
    g, u = gu[..., :h], gu[..., h:]
    for gate, up in ((g, u), (g, u.contiguous()), (g.contiguous(), u)):  # halves, or one half and a contiguous partner
        ref = swiglu_ref(gate, up, "floor")
        assert_same(device_path.swiglu_quantize(gate, up, "floor"), ref)
        assert_same(
            device_path.swiglu_quantize(gate, up, "floor", torch.bfloat16, save_inputs=True),
            with_saved_inputs(with_values(ref, torch.bfloat16), gate, up, "floor"),
        )


@cuda
@pytest.mark.parametrize("w_shape", ["s", "s1"])
@pytest.mark.parametrize("shape", [(96, 64), (1000, 2048)])
@pytest.mark.parametrize("dy_dtype", [torch.bfloat16, torch.float32])  # fp32: the EP combine's backward gradient
def test_route_weight_quantize(shape, w_shape, dy_dtype):
    dy = special_rows(rand(shape, dy_dtype))
    w = torch.rand(shape[0], device="cuda")
    w = w if w_shape == "s" else w[:, None]
    ref = mxf.quantize_lastdim(dy.cpu().float() * w.cpu().float().reshape(-1, 1), "rceil")
    assert_same(device_path.route_weight_quantize(dy, w, "rceil"), ref)
    assert_same(device_path.route_weight_quantize(dy, w, "rceil", torch.bfloat16), with_values(ref, torch.bfloat16))
    assert_same(
        device_path.route_weight_quantize(dy, w.bfloat16(), "rceil"),
        mxf.quantize_lastdim(dy.cpu().float() * w.cpu().bfloat16().float().reshape(-1, 1), "rceil"),
    )


# ---- scale layouts (mxfx.kernels.mx.views) ------------------------------------------------


def layout_cases():
    """``(op name, args, expected scale strides)``: every kernel op whose scale layout depends on its
    input's strides. Row-major for inputs with unit stride along K (or copied first, the 4D transpose),
    MN-major (storage [.., K/32, R]) for inputs strided along K and for both outputs of the dual quantize."""
    x = exact_input((96, 128))
    x3 = exact_input((2, 64, 96), seed=1)
    x4 = exact_input((2, 3, 64, 32), seed=2).transpose(-2, -1)
    w = 2.0 ** torch.randint(-3, 3, (128,)).float()
    return [
        ("quantize", (x, "rceil"), [(4, 1)]),
        ("quantize", (x[:, :64], "rceil"), [(2, 1)]),
        ("quantize", (x.t(), "floor"), [(1, 128)]),
        ("quantize", (x3.transpose(-2, -1), "rceil"), [(192, 1, 96)]),
        ("quantize", (x4, "rceil"), [(192, 64, 2, 1)]),
        ("quantize_dequantize", (x.t(), "rceil", torch.float32), [(1, 128)]),
        ("route_weight_quantize", (x.t(), w, "rceil"), [(1, 128)]),
        ("quantize_dual", (x, "rceil"), [(1, 96), (1, 128)]),
        ("quantize_dual", (x3, "floor"), [(192, 1, 64), (192, 1, 96)]),
        ("quantize_dual_blocked", (x, "rceil"), [(1,), (1,)]),  # 96 rows and 3 scale columns: padded tiles
        ("quantize_dual_blocked", (x3, "floor"), [(512, 1), (512, 1)]),
    ]


def scale_outputs(name, out):
    """The scale tensors among an op's outputs."""
    return [out[1], out[3]] if name.startswith("quantize_dual") else [out[1]]


def check_layouts(run):
    """``run(name, args)`` (the implementation under test) gives the CPU path's bytes and strides."""
    for name, args, _ in layout_cases():
        want = getattr(device_path, "quantize_lastdim" if name == "quantize" else name)(*args)
        got = run(name, args)
        assert_same(got, want)
        for i, (g, r) in enumerate(zip(got, want)):
            assert g.stride() == r.stride(), (name, i, g.stride(), r.stride())


def test_cpu_scale_layouts_and_fakes_agree():
    """The CPU path lays out scales as documented, and every op's fake says the same strides (Inductor
    trusts the fake: a wrong one would make compiled code read scales in the wrong order)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import mxfx.kernels.mx.custom_ops  # noqa: F401  (registers the ops)

    for name, args, strides in layout_cases():
        real = getattr(torch.ops.mxfx, name)(*args)
        assert [s.stride() for s in scale_outputs(name, real)] == strides, name
        ref = mxf.quantize_lastdim(
            args[0] * (args[1][:, None] if name == "route_weight_quantize" else 1),
            args[-1] if name == "route_weight_quantize" else args[1],
        )
        if name == "quantize_dual_blocked":  # per batch, the blocked layout of the reference scales
            ref = (
                ref[0],
                torch.stack([to_blocked(m) for m in ref[1].reshape(-1, *ref[1].shape[-2:])]).reshape(real[1].shape),
            )
        assert_same(real[:2], ref)
        with FakeTensorMode() as mode:
            fake = getattr(torch.ops.mxfx, name)(
                *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            )
        assert [t.stride() for t in fake] == [t.stride() for t in real], name
    q_row, s_row, _, q_col, s_col, _ = device_path.quantize_dual_source(exact_input((96, 128)), "rceil")
    assert s_row.stride() == (1, 96) and s_col.stride() == (1, 128) and q_col.stride() == (1, 128)
    empty = torch.ops.mxfx.quantize_dual_blocked(torch.zeros(0, 32, 64), "rceil")  # no batch: empty, as the fake
    assert [tuple(t.shape) for t in empty] == [(0, 32, 64), (0, 512), (0, 64, 32), (0, 512)]
    for shape in ((0, 64), (32, 0), (2, 0, 64), (2, 32, 0)):  # no rows or no columns: empty layouts, as the fake
        real = torch.ops.mxfx.quantize_dual_blocked(torch.zeros(shape), "rceil")
        with FakeTensorMode() as mode:
            fake = torch.ops.mxfx.quantize_dual_blocked(mode.from_tensor(torch.zeros(shape)), "rceil")
        assert [t.shape for t in real] == [t.shape for t in fake] and real[1].numel() == real[3].numel() == 0, shape
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="scalar cannot be block-quantized"):
        torch.ops.mxfx.quantize(mode.from_tensor(torch.tensor(1.0)), "rceil")


def test_cpu_reference_path_traces_every_view():
    """Dynamo traces the layout rules on views whose leading dims do not merge (decided from strides,
    not from a failing view) and gives eager's bytes and strides."""
    views = [
        torch.randn(3, 2, 64).permute(1, 0, 2),
        torch.randn(2, 64, 5).transpose(-2, -1),
        torch.randn(2, 2, 64, 3).transpose(-2, -1),
        torch.randn(64, 2, 3).permute(1, 2, 0),
    ]
    fn = torch.compile(
        lambda x: device_path.quantize_dequantize(x, "rceil", torch.float32), backend="eager", fullgraph=True
    )
    for x in views:
        got, want = fn(x), device_path.quantize_dequantize(x, "rceil", torch.float32)
        assert_same(got, want)
        assert [t.stride() for t in got] == [t.stride() for t in want], x.shape


@cuda
def test_scale_layouts_match_cpu_path():
    """Triton kernels write every scale layout of the CPU path, bit for bit; MN-major scales dequantize."""

    def run(name, args):
        fn = getattr(device_path, "quantize_lastdim" if name == "quantize" else name)
        return fn(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))

    check_layouts(run)
    q, s, qt, st = run("quantize_dual", (exact_input((96, 128)), "rceil"))
    for pair in ((q, s), (qt, st)):
        assert same_bits(
            device_path.dequantize_lastdim(*pair, torch.float32),
            mxf.dequantize_lastdim(*(t.cpu() for t in pair), torch.float32),
        )


# ---- Triton interpreter on CPU --------------------------------------------------------


def exact_input(shape, seed=0):
    """Data that quantizes without rounding along both of its last two dims.

    E4M3 values times 2^e with one e per 32x32 tile, and the tile's diagonal in
    [256, 448], so every 32-block of a row or a column has its amax there.
    """
    g = torch.Generator().manual_seed(seed)
    *lead, m, n = shape
    bits = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8)
    bits |= torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
    v = bits.view(torch.float8_e4m3fn).float()
    diag = torch.eye(32, dtype=torch.bool).repeat(m // 32, n // 32)
    v[..., diag] = 448.0 - 32.0 * torch.randint(0, 6, v[..., diag].shape, generator=g).float()
    e = torch.randint(-40, 40, (*lead, m // 32, n // 32), generator=g).float()
    return v * 2.0 ** e.repeat_interleave(32, -2).repeat_interleave(32, -1)


def _interpreter_checks():
    """Run under TRITON_INTERPRET=1 by the test below; raises on the first mismatch."""
    from mxfx.kernels.mx import dequantize

    from mxfx.kernels.mx import dual
    from mxfx.kernels.mx import quantize

    base = exact_input((96, 128))
    x = special_rows(base, exact=True)
    xc = x.clone()
    xc[4] = base[4]  # the tiny row's values would round to zero in column blocks
    for rule, dt in (("rceil", torch.bfloat16), ("floor", torch.float32)):
        if True:
            # the interpreter flushes bf16 subnormals when widening: tiny row in fp32 only
            xd, xcd = (x if dt == torch.float32 else xc).to(dt), xc.to(dt)
            assert_same(quantize.quantize_lastdim(xd, rule), mxf.quantize_lastdim(xd, rule))
            assert_same(quantize.quantize_lastdim(xcd.t(), rule), mxf.quantize_lastdim(xcd.t(), rule))
            ref = (*mxf.quantize_lastdim(xcd, rule), *mxf.quantize_lastdim(xcd.t(), rule))
            assert_same(dual.quantize_dual(xcd, rule), ref)
            check_dual_source(dual.quantize_dual_source(xcd, rule, dequantized=torch.float32), xcd, rule, torch.float32)
            check_dequantized_only(dual.quantize_dual_source, xcd, rule, torch.float32)
    x3 = exact_input((2, 64, 96), seed=1)
    assert_same(
        quantize.quantize_lastdim(x3.transpose(-2, -1), "rceil"), mxf.quantize_lastdim(x3.transpose(-2, -1), "rceil")
    )
    assert_same(
        dual.quantize_dual(x3, "rceil"),
        (*mxf.quantize_lastdim(x3, "rceil"), *mxf.quantize_lastdim(x3.transpose(-2, -1), "rceil")),
    )
    x3b = x3.to(torch.bfloat16)  # K = 96: the dequantized pass's (32, 128) tile runs masked
    check_dual_source(dual.quantize_dual_source(x3b, "rceil", dequantized=torch.bfloat16), x3b, "rceil", torch.bfloat16)
    for x3 in (exact_input((1, 64, 128), seed=2), exact_input((2, 64, 128), seed=3)):  # even tiles, one or two matrices
        assert_same(
            dual.quantize_dual(x3, "floor"),
            (*mxf.quantize_lastdim(x3, "floor"), *mxf.quantize_lastdim(x3.transpose(-2, -1), "floor")),
        )
    for x3 in (exact_input((128, 256), seed=4), exact_input((2, 128, 128), seed=5)):  # blocked, no padding
        (rq, rs), (cq, cs) = mxf.quantize_lastdim(x3, "rceil"), mxf.quantize_lastdim(x3.transpose(-2, -1), "rceil")
        got = dual.quantize_dual_blocked(x3.to(torch.bfloat16), "rceil")
        blocked = [
            torch.stack([to_blocked(m) for m in t.reshape(-1, *t.shape[-2:])]).reshape(g.shape)
            for t, g in ((rs, got[1]), (cs, got[3]))
        ]
        assert_same(got, (rq, blocked[0], cq, blocked[1]))
    x = xc  # 16-bit subnormal outputs are flushed by the interpreter too
    rq, rs = mxf.quantize_lastdim(x, "rceil")
    q, b = quantize.quantize_blocked(x[:50], "rceil")
    assert same_bits(q, rq[:50]) and torch.equal(b, to_blocked(rs[:50]))
    for shape in ((64, 0), (0, 64), (2, 64, 0)):  # empty inputs: empty qdata and an empty layout, no launch
        eq, eb = quantize.quantize_blocked(torch.zeros(shape), "rceil")
        assert eq.shape == shape and eq.dtype == torch.float8_e4m3fn and eb.shape == (0,), shape
    try:
        quantize.quantize_blocked(torch.tensor(1.0), "rceil")
        raise AssertionError("a 0-D input was accepted")
    except ValueError as e:
        assert "scalar cannot be block-quantized" in str(e), e
    assert_same(
        quantize.quantize_dequantize(x, "rceil", torch.bfloat16),
        (rq, rs, mxf.dequantize_lastdim(rq, rs, torch.bfloat16)),
    )
    w = 2.0 ** torch.randint(-3, 3, (96,)).float()
    assert_same(quantize.route_weight_quantize(x, w, "rceil"), mxf.quantize_lastdim(x * w[:, None], "rceil"))
    assert_same(
        quantize.route_weight_quantize(x, w, "rceil", torch.float32),
        with_values(mxf.quantize_lastdim(x * w[:, None], "rceil"), torch.float32),
    )
    for dt in DTYPES:
        assert same_bits(dequantize.dequantize_lastdim(rq, rs, dt), mxf.dequantize_lastdim(rq, rs, dt))
    # strided layouts: row slices (2D tiles) and a transpose through the generic kernel
    assert_same(quantize.quantize_lastdim(x[:, :64], "rceil"), mxf.quantize_lastdim(x[:, :64], "rceil"))
    assert same_bits(
        dequantize.dequantize_lastdim(rq[:, :64], rs[:, :2], torch.float32),
        mxf.dequantize_lastdim(rq[:, :64], rs[:, :2], torch.float32),
    )
    tq, ts = mxf.quantize_lastdim(x.t(), "floor")
    assert_same(
        quantize.quantize_dequantize(x.t(), "floor", torch.float32),
        (tq, ts, mxf.dequantize_lastdim(tq, ts, torch.float32)),
    )
    # a columnwise pair in the source layout: its own kernel, same values, same layout
    sq, ss = (t.t().contiguous().t() for t in (tq, ts))
    out = dequantize.dequantize_lastdim(sq, ss, torch.float32)
    assert out.stride() == sq.stride() and same_bits(out, mxf.dequantize_lastdim(tq, ts, torch.float32))
    from mxfx.kernels.mx import quantize as tq

    kernel_of = {
        "quantize": tq.quantize_lastdim,
        "quantize_dequantize": tq.quantize_dequantize,
        "route_weight_quantize": tq.route_weight_quantize,
        "quantize_dual": dual.quantize_dual,
        "quantize_dual_blocked": dual.quantize_dual_blocked,
    }
    check_layouts(lambda name, args: kernel_of[name](*args))
    q, s = dual.quantize_dual(x, "rceil")[:2]  # MN-major scales read through their strides
    assert same_bits(dequantize.dequantize_lastdim(q, s, torch.float32), mxf.dequantize_lastdim(q, s, torch.float32))
    _interpreter_swiglu_checks()


def _interpreter_swiglu_checks():
    """SwiGLU under the interpreter, whose expf and E4M3 rounding are numpy's: the product is not compared
    with the CPU path (the GPU tests do that), but every input layout must give the same bytes as contiguous
    gate/up (block streams of gate_up halves, within one row or across rows, mixed with a contiguous
    partner, 2D tiles for a transposed view), and the saved pairs of exactly representable gate/up equal the
    reference quantize."""
    from mxfx.kernels.mx import swiglu

    for shape in ((4, 0), (0, 64), (2, 0, 64)):  # nothing to read: empty outputs, no launch
        empty = torch.zeros(shape)
        out = swiglu.swiglu_quantize(empty, empty, "rceil", torch.float32, save_inputs=True)
        assert [tuple(t.shape) for t in out] == [shape, (*shape[:-1], shape[-1] // 32), shape] + [
            shape,
            (*shape[:-1], shape[-1] // 32),
        ] * 2
    # mxfx's SiLU flush band (mxfx.kernels.common.silu): a block of gates at or below -87.3365 gives -0 throughout,
    # where F.silu's values (down to 2^-128) would fill the payload at the smallest scale
    band = torch.tensor([-87.3365478515625, -87.5, -88.0, -88.5, -100.0, -1e38, -3.4e38, -1e10] * 4).reshape(1, 32)
    q, s = swiglu.swiglu_quantize(band, torch.ones_like(band), "rceil")
    assert torch.equal(q.view(torch.uint8), torch.full((1, 32), 0x80, dtype=torch.uint8)) and int(s) == 0
    plain = mxf.quantize_lastdim(F.silu(band), "rceil")[0].view(torch.uint8)
    assert not torch.equal(plain, q.view(torch.uint8))  # without the flush the block is not all -0
    # rows of 3 and 16 blocks: tiles across rows, and tiles within one row; 3 rows of 3 blocks: the contiguous
    # stream's last tile is partial (masked), 64 rows: every tile full (no masks, swiglu.STREAM_EVEN)
    for rows, h in ((64, 96), (64, 512), (3, 96)):
        gu = exact_input((64, 2 * h), seed=h)[:rows]
        g, u = gu[:, :h], gu[:, h:]
        for dequantized, save in ((None, False), (torch.float32, True)):
            ref = swiglu.swiglu_quantize(g.contiguous(), u.contiguous(), "rceil", dequantized, save_inputs=save)
            for gate, up in ((g, u), (g, u.contiguous()), (g.contiguous(), u), (g.t().contiguous().t(), u)):
                assert_same(swiglu.swiglu_quantize(gate, up, "rceil", dequantized, save_inputs=save), ref)
            if save:
                assert same_bits(ref[2], mxf.dequantize_lastdim(ref[0], ref[1], torch.float32))
                assert_same(ref[3:], (*mxf.quantize_lastdim(g, "rceil"), *mxf.quantize_lastdim(u, "rceil")))
    # the wgrad operands' product kernel: the fused kernel's SiLU and multiply (its quantize gives the fused bytes),
    # the same values from strided gate/up and from a 3D batch
    from mxfx.kernels.common import silu_triton
    from mxfx.kernels.mx import quantize

    for rows, h in ((64, 96), (3, 512)):
        gu = exact_input((64, 2 * h), seed=h)[:rows]
        g, u = gu[:, :h], gu[:, h:]
        p = silu_triton.swiglu_product(g.contiguous(), u.contiguous())
        assert p.dtype == torch.float32 and p.shape == (rows, h)
        for gate, up in ((g, u), (g.t().contiguous().t(), u)):
            assert same_bits(silu_triton.swiglu_product(gate, up), p)
        assert_same(quantize.quantize_lastdim(p, "rceil"), swiglu.swiglu_quantize(g, u, "rceil"))
    gu3 = exact_input((2, 64, 192), seed=7)
    p3 = silu_triton.swiglu_product(gu3[..., :96], gu3[..., 96:])
    assert same_bits(
        p3,
        silu_triton.swiglu_product(gu3[..., :96].reshape(128, 96), gu3[..., 96:].reshape(128, 96)).reshape(2, 64, 96),
    )
    assert silu_triton.swiglu_product(torch.zeros(0, 64), torch.zeros(0, 64)).shape == (0, 64)  # no launch


BACKGROUND_JOBS = {"interpreter": lambda environ: run_interpreter_checks(__file__, environ)}  # tests/conftest.py


def test_triton_interpreter(session_job):
    session_job("test_kernels:interpreter")  # run_interpreter_checks in a fresh process, from the start of the session


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    _interpreter_checks()
    print("interpreter checks passed")


@pytest.mark.parametrize(
    "value, opaque",
    [(None, False), ("0", False), ("off", False), ("1", True), ("True", True), ("yes", True), ("maybe", None)],
)
def test_opaque_kernels_switch(monkeypatch, value, opaque):
    from mxfx.kernels.common.launch import opaque_kernels

    if value is None:
        monkeypatch.delenv("MXFX_OPAQUE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("MXFX_OPAQUE_KERNELS", value)
    if opaque is None:
        with pytest.raises(ValueError, match="MXFX_OPAQUE_KERNELS='maybe'"):
            opaque_kernels()
    else:
        assert opaque_kernels() is opaque


@pytest.mark.parametrize(
    "kernels, env, opaque", [("opaque", "0", True), ("inductor", "1", False), (None, "1", True), (None, None, False)]
)
def test_policy_kernels_choose_for_the_inner_compile(monkeypatch, kernels, env, opaque):
    """``Policy(kernels=...)`` decides how the MX ops' kernels enter the graph while the inner compiler traces it
    (the choice is also in the compile-cache key), over ``MXFX_OPAQUE_KERNELS``; left out, the variable decides;
    outside the compile, the variable alone."""
    import mxfx
    from mxfx import cache_key
    from mxfx.kernels.common.launch import opaque_kernels

    if env is None:
        monkeypatch.delenv("MXFX_OPAQUE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("MXFX_OPAQUE_KERNELS", env)
    seen = []

    def inner(gm, example_inputs):
        seen.append((opaque_kernels(), cache_key.trace_key().endswith(f"opaque_kernels={int(opaque)}")))
        return gm.forward

    torch._dynamo.reset()
    lin = torch.nn.Linear(64, 64)
    torch.compile(lin, backend="mxfp8", options={"inner": inner, "kernels": kernels})(torch.randn(32, 64))
    assert seen == [(opaque, True)]
    assert opaque_kernels() is (env == "1")  # the compile's choice ends with it
    with pytest.raises(ValueError, match=r"kernels='fast' is not valid; choose one of 'inductor', 'opaque', 'auto'"):
        mxfx.Policy(kernels="fast")


@pytest.mark.parametrize("rows, opaque", [(32768, True), (8192, True), (1024, False), (64, False)])
def test_auto_kernel_launch_weighs_the_graphs_gemms(monkeypatch, rows, opaque):
    """``kernels="auto"`` (the default) keeps the ops opaque in a graph whose GEMMs' GPU time hides the custom ops'
    host time (a 4096x4096 linear over 32768 or 8192 rows: 0.43 ms of host time against 5.5 or 1.37 ms of GEMM), and
    launches them from Inductor's code in a graph of smaller GEMMs (1024 rows: 0.17 ms); the policy's explicit
    choice wins over it."""
    from mxfx.kernels.common.launch import opaque_kernels

    monkeypatch.delenv("MXFX_OPAQUE_KERNELS", raising=False)
    seen = []

    class Stop(Exception):
        pass

    def inner(gm, example_inputs):
        seen.append(opaque_kernels())
        raise Stop  # the choice is made: nothing needs to run

    for kernels, expect in ((None, opaque), ("auto", opaque), ("inductor", False)):
        torch._dynamo.reset()
        lin = torch.nn.Linear(4096, 4096, bias=False, dtype=torch.bfloat16)
        x = torch.randn(rows, 4096, dtype=torch.bfloat16)
        with pytest.raises(Exception, match="Stop"):
            torch.compile(lin, backend="mxfp8", options={"inner": inner, "kernels": kernels})(x)
        assert seen.pop() is expect, kernels


def test_launch_cost_choice():
    """:func:`mxfx.policy.launch_cost.choose` at its boundary: host time per converted GEMM against its share of 6
    FLOPs per forward MAC at the assumed rate; a GEMM of unknown size adds host time only."""
    from mxfx.policy import launch_cost

    # MACs whose GPU time's share equals the host time
    even = launch_cost.OPAQUE_HOST_S_PER_GEMM * launch_cost.GEMM_FLOPS / (6 * launch_cost.HOST_SHARE)
    assert launch_cost.choose([int(even * 1.01)])[0] == "opaque"
    assert launch_cost.choose([int(even * 0.99)])[0] == "inductor"
    assert launch_cost.choose([int(even * 1.01), None])[0] == "inductor"
    mode, why = launch_cost.choose([int(even * 4), None])
    assert mode == "opaque" and "(2 converted GEMMs)" in why
    host_ms = 2 * launch_cost.OPAQUE_HOST_S_PER_GEMM * 1e3
    gpu_ms = 6 * int(even * 4) / launch_cost.GEMM_FLOPS * 1e3
    assert f"extra host time {host_ms:.3g} ms <= {launch_cost.HOST_SHARE:g} x GEMM GPU time {gpu_ms:.3g} ms" in why
    assert f"{host_ms / 2:.3g} ms > {launch_cost.HOST_SHARE:g} x" in launch_cost.choose([int(even * 0.99)])[1]
    assert launch_cost.choose([int(even * 4), -(10**15), float("nan")])[0] == "opaque"  # nonsense counts: no GPU time


def test_traced_path_calls_the_ops_own_body(monkeypatch):
    """Each MX op callers use runs its custom op, or (when a CUDA graph is traced) the op's body: the
    same function with the same arguments. Forced to the body on CPU, every op gives the op's bytes."""
    from mxfx.kernels.common import launch
    from mxfx.kernels.common.custom_ops import swiglu_product
    from mxfx.kernels.mx import custom_ops

    g = torch.Generator().manual_seed(4)
    x, u = torch.randn(64, 96, generator=g), torch.randn(64, 96, generator=g)
    w, rw = torch.randn(3, 32, 96, generator=g), torch.rand(64, generator=g)
    offs = torch.tensor([20, 20, 64], dtype=torch.int32)

    def run_all():
        q, s = custom_ops.quantize(x, "rceil")
        wq, ws = custom_ops.quantize(w, "rceil")
        qt, st = custom_ops.quantize(x.t().contiguous(), "rceil")
        return [
            q,
            s,
            custom_ops.dequantize(q, s, torch.float32),
            *custom_ops.quantize_dual(x, "floor"),
            *custom_ops.quantize_dequantize(x, "rceil", torch.float32),
            *custom_ops.swiglu_quantize(x, u, "rceil"),
            *custom_ops.route_weight_quantize(x, rw, "rceil"),
            *custom_ops.quantize_blocked(x, "rceil"),
            custom_ops.mx_mm(q, s, wq[0], ws[0], torch.float32, False),
            custom_ops.mx_grouped_mm(q, s, wq, ws, offs, torch.float32, False),
            custom_ops.mx_grouped_mm_wgrad(
                qt[:32], st[:32], qt, st, torch.tensor([32, 32, 96], dtype=torch.int32), torch.float32, False
            ),
            swiglu_product(x, u),
        ]

    ops = run_all()
    monkeypatch.setattr(launch, "inline_in_graph", lambda t: True)
    bodies = run_all()
    assert len(ops) == len(bodies) == 20
    for a, b in zip(ops, bodies):
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
            b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
        )


def test_kernels_are_keyed_and_kept_as_inductors_unless_the_user_chose(monkeypatch, tmp_path):
    """Triton keys a compiled kernel by its ptxas and keeps it in its cache folder: mxfx's own compiles take torch's
    ptxas and Inductor's folder for the device, as Inductor's compiles do, so a warm process finds them; a
    ``TRITON_PTXAS_PATH`` or ``TRITON_CACHE_DIR`` already set stays."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    torch_ptxas = os.path.join(os.path.dirname(torch.__file__), "bin", "ptxas")
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    launch.key_kernels_as_inductor(torch.device("cuda", 3))
    shipped = os.path.isfile(torch_ptxas) and os.access(torch_ptxas, os.X_OK)
    assert os.environ.get("TRITON_PTXAS_PATH") == (torch_ptxas if shipped else None)
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(cache_dir(), "triton", "3") == str(tmp_path / "triton" / "3")
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/cuda/bin/ptxas")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/data/triton")
    launch.key_kernels_as_inductor(torch.device("cuda", 0))
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/cuda/bin/ptxas"
    assert os.environ["TRITON_CACHE_DIR"] == "/data/triton"
