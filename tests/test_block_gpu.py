"""fp8_block on the GPU (skips without CUDA): cuBLAS dense and Triton grouped GEMMs against the reference
decode, the Triton quantize kernels against the CPU reference bit for bit, and the profiler's kernel names
(an FP8 GEMM ran, no dequantize + BF16 GEMM stood in).

GEMM bound: the reference is an FP32 GEMM of exactly dequantized operands. Hopper's FP8 tensor cores add
products in a narrower accumulator inside each 128-K step (DeepSeek-V3 measured about 2^-14 relative), and the
kernels promote to FP32 every 128; we allow ``2^-10 * (|A| @ |B|^T)`` for that and the FP32 summation order,
plus half a bf16 ulp (2^-8 relative) for the output cast.
"""

import copy
import re

import pytest
import torch

from mxfx.numerics import block as bf
from mxfx.kernels.fp8_block import gemm as block_gemm
from mxfx.kernels.common.silu import silu_fp32

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm90+ CUDA GPU"
)

FP8_GEMM_NAME = re.compile(r"qq|e4m3|f8|fp8", re.I)
"""cuBLAS names its FP8 GEMM kernels by operand types: ``nvjet_sm90_qqtst_...`` (q: E4M3), ``..._e4m3...``;
its BF16 ones ``nvjet_sm90_tst_...``."""


def _check(out, a, sa, b, sb, b_dims, ref):
    x = bf.dequantize_values(a.cpu(), sa.cpu(), (-1,)).abs()
    w = bf.dequantize_values(b.cpu(), sb.cpu(), b_dims).abs()
    bound = 2.0**-10 * (x @ w.transpose(-2, -1)) + ref.abs() * 2.0**-8
    err = (out.float().cpu() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3e}"


def _cpu(*ts):
    return [t.cpu() for t in ts]


@pytest.mark.parametrize("m,n,k", [(256, 384, 640), (200, 256, 4096)])  # K/128 = 5: the padded B-scale stride
def test_dense_forward_and_dgrad_match_reference(m, n, k):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g) * 2
    w = torch.randn(n, k, generator=g) * 0.02
    a, sa = bf.quantize_1x128(x.cuda())
    b, sb = bf.quantize_128x128(w.cuda())
    out = block_gemm.scaled_mm(a, sa, b, sb)
    ref = block_gemm.reference_mm(*_cpu(a, sa, b, sb), torch.float32)
    _check(out, a, sa, b, sb, (-2, -1), ref)
    # dgrad: dX = dY W, the weight's transpose with its 128x128 scales transposed (rceil: orientation-free)
    dy = torch.randn(m, n, generator=g)
    a2, sa2 = bf.quantize_1x128(dy.cuda())
    bt, sbt = b.t().contiguous(), sb.t().contiguous()
    out = block_gemm.scaled_mm(a2, sa2, bt, sbt)
    _check(out, a2, sa2, bt, sbt, (-2, -1), block_gemm.reference_mm(*_cpu(a2, sa2, bt, sbt), torch.float32))


def test_dense_wgrad_1x128_both_operands():
    from mxfx.kernels.fp8_block import quantize as bq

    g = torch.Generator().manual_seed(1)
    t, n, k = 640, 256, 384  # dW [N, K] = dY^T [N, T] X [T, K], both tiled along the tokens T
    dy = torch.randn(t, n, generator=g).cuda().bfloat16()
    x = torch.randn(t, k, generator=g).cuda().bfloat16()
    a, sa = bq.quantize_1x128_colwise(dy)
    b, sb = bq.quantize_1x128_colwise(x)
    out = block_gemm.scaled_mm(a, sa, b, sb)
    _check(out, a, sa, b, sb, (-1,), block_gemm.reference_mm(*_cpu(a, sa, b, sb), torch.float32))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_grouped_forward_and_dgrad_match_reference(out_dtype):
    g = torch.Generator().manual_seed(2)
    sizes = [300, 0, 129, 1000, 7, 0]
    s, k, n = sum(sizes) + 11, 512, 384
    x = torch.randn(s, k, generator=g)
    w = torch.randn(len(sizes), n, k, generator=g) * 0.05
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).cuda()
    a, sa = bf.quantize_1x128(x.cuda())
    b, sb = bf.quantize_128x128(w.cuda())
    out = block_gemm.grouped_mm(a, sa, b, sb, offs, out_dtype)
    ref = block_gemm.reference_grouped_mm(*_cpu(a, sa, b, sb, offs), torch.float32)
    _check_groups(out, ref, a, sa, b, sb, sizes)
    dy = torch.randn(s, n, generator=g)
    a2, sa2 = bf.quantize_1x128(dy.cuda())
    bt, sbt = b.transpose(1, 2).contiguous(), sb.transpose(1, 2).contiguous()
    out = block_gemm.grouped_mm(a2, sa2, bt, sbt, offs, out_dtype)
    _check_groups(
        out, block_gemm.reference_grouped_mm(*_cpu(a2, sa2, bt, sbt, offs), torch.float32), a2, sa2, bt, sbt, sizes
    )


def test_grouped_wgrad_matches_reference():
    from mxfx.kernels.fp8_block import quantize as bq

    g = torch.Generator().manual_seed(5)
    sizes = [300, 0, 129, 1000, 7]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), 384, generator=g).bfloat16()
    dy = torch.randn(sum(sizes), 256, generator=g).bfloat16()
    (xq, xs), (dq, ds) = (bq.quantize_1x128_grouped_tokens(t.cuda(), offs.cuda()) for t in (x, dy))
    for got, t in (((xq, xs), x), ((dq, ds), dy)):  # bit-exact against the CPU reference, transposed
        rq, rs = bf.quantize_1x128_grouped_tokens(t, offs)
        _same(got, (rq.t(), rs.t()))
    # dY's dgrad rows and wgrad tiles from one read, times the route weights (fp32 products, so bit-exact),
    # with 50 rows past the last group end (row tiles only)
    tail = torch.cat([dy, torch.randn(50, 256, generator=g).bfloat16()])
    route = torch.rand(tail.shape[0], generator=g)
    for w in (None, route):
        v = tail.float() if w is None else tail.float() * w[:, None]
        q, s, qt, st = bq.quantize_1x128_grouped_dual(tail.cuda(), offs.cuda(), route=None if w is None else w.cuda())
        _same((q, s), bf.quantize_1x128(v))
        rq, rs = bf.quantize_1x128_grouped_tokens(v, offs)
        _same((qt, st), (rq.t(), rs.t()))
    out = block_gemm.grouped_wgrad(dq, ds, xq, xs, offs.cuda())
    ref = block_gemm.reference_grouped_wgrad(*_cpu(dq, ds, xq, xs), offs, torch.float32)
    start = 0
    for e, end in enumerate(offs.tolist()):
        dh = bf.dequantize_1x128(*bf.quantize_1x128(dy[start:end].float(), axis=0), axis=0, dtype=torch.float32)
        xh = bf.dequantize_1x128(*bf.quantize_1x128(x[start:end].float(), axis=0), axis=0, dtype=torch.float32)
        bound = 2.0**-10 * (dh.abs().t() @ xh.abs())
        assert ((out[e].cpu() - ref[e]).abs() <= bound).all(), e
        start = end
    # into a strided gradient by the kernel's epilogue: the same sums written, then one FP32 add onto what was there
    grad = torch.full((len(sizes), 384, 256), float("nan"), device="cuda").transpose(1, 2)
    block_gemm.grouped_wgrad(dq, ds, xq, xs, offs.cuda(), out=grad)
    assert torch.equal(grad, out)
    prior = torch.randn(grad.shape, device="cuda")
    grad.copy_(prior)
    block_gemm.grouped_wgrad(dq, ds, xq, xs, offs.cuda(), out=grad, accumulate=True)
    assert torch.equal(grad, prior + out)


def _check_groups(out, ref, a, sa, b, sb, sizes):
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        _check(out[rows], a[rows], sa[rows], b[e], sb[e], (-2, -1), ref[rows])
        start += size
    assert (out[start:] == 0).all()


def _same(got, want):
    q, s = (t.cpu() for t in got)
    rq, rs = want
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s.nan_to_num(), rs.nan_to_num())


@pytest.mark.parametrize("rule", bf.SCALE_RULES)
def test_quantize_kernels_bit_exact(rule):
    from mxfx.kernels.fp8_block import quantize as bq

    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 640, generator=g) * torch.logspace(-30, 30, 300).unsqueeze(1)
    x[0, :128], x[1, 5], x[2, 200], x[3, :] = 0.0, float("nan"), float("-inf"), 1e-40
    for dt in (torch.float32, torch.bfloat16):
        xd = x.to(dt)
        _same(bq.quantize_1x128(xd.cuda(), rule), bf.quantize_1x128(xd, rule=rule))
        _same(bq.quantize_1x128_colwise(xd.cuda(), rule), bf.quantize_1x128(xd.t(), rule=rule))
        q, sc, qt, st = bq.quantize_1x128_dual(xd.cuda(), rule)  # both tilings from one read
        _same((q, sc), bf.quantize_1x128(xd, rule=rule))
        _same((qt, st), bf.quantize_1x128(xd.t(), rule=rule))
    w = torch.randn(3, 384, 200, generator=g) * 0.02
    _same(bq.quantize_128x128(w.cuda(), rule), bf.quantize_128x128(w, rule=rule))
    gate = (torch.randn(64, 512, generator=g) * 4).bfloat16()
    up = torch.randn(64, 512, generator=g).bfloat16()
    # the product formed on the GPU: mxfx's SiLU is CUDA's F.silu (libdevice expf),
    # which CPU's may differ from by an ulp
    want = tuple(t.cpu() for t in bf.quantize_1x128(silu_fp32(gate.cuda()) * up.cuda().float(), rule=rule))
    saved = bq.swiglu_quantize_1x128_save(gate.cuda(), up.cuda(), rule)
    for got in (bq.swiglu_quantize_1x128(gate.cuda(), up.cuda(), rule), saved[:2]):
        if rule == "rceil":
            _same(got, want)
        else:
            _same_up_to_an_ulp_of_amax(got, want)
    _same(saved[2:4], bf.quantize_1x128(gate, rule=rule))  # the SwiGLU inputs' own pairs
    _same(saved[4:], bf.quantize_1x128(up, rule=rule))
    # route-weighted rows (the grouped dgrad's dY): the product formed in fp32 on the GPU, as the reference forms it
    dy = torch.randn(300, 384, generator=g).bfloat16()
    rw = torch.rand(300, generator=g)
    want = bf.quantize_1x128(dy.float() * rw[:, None], rule=rule)
    _same(bq.route_weight_quantize_1x128(dy.cuda(), rw.cuda(), rule), want)
    # the same pair with dY in BF16 and the route weights' gradient from one read, the rows as they are and
    # gathered by the kernel from each token's gradient (top-3: every token read three times)
    y = torch.randn(300, 384, generator=g).bfloat16()
    tokens, index = dy[:100].contiguous(), torch.arange(300) % 100
    for rows, got in (
        (dy, bq.route_grad_operands_1x128(dy.cuda(), rw.cuda(), y.cuda(), rule)),
        (tokens[index], bq.route_grad_operands_1x128(tokens.cuda(), rw.cuda(), y.cuda(), rule, rows_of=index.cuda())),
    ):
        _same(got[:2], bf.quantize_1x128(rows.float() * rw[:, None], rule=rule))
        assert torch.equal(got[2].cpu(), (rows.float() * rw[:, None]).bfloat16())
        terms = rows.double() * y.double()
        bound = terms.shape[1] * 2.0**-24 * terms.abs().sum(-1)  # the kernel's FP32 sum, in its own order
        assert ((got[3].cpu().double() - terms.sum(-1)).abs() <= bound).all()


def _same_up_to_an_ulp_of_amax(got, want):
    """amax/448 scales carry the last bit of a tile's largest |value|: where the kernel's fused SiLU and F.silu
    differ by an ulp on that value (H200, torch 2.11: about half the tiles of this test), the scale moves by an
    ulp and the tile's codes may move by one. Every other tile is bit-exact."""
    q, s = (t.cpu() for t in got)
    rq, rs = want
    same = s == rs
    ulp = (rs.abs().view(torch.int32) + 1).view(torch.float32) - rs.abs()
    assert ((s - rs).abs() <= ulp).all(), (s[~same][:4], rs[~same][:4])
    tile_same = same.repeat_interleave(128, dim=1)[:, : q.shape[1]]
    assert torch.equal(q.view(torch.uint8)[tile_same], rq.view(torch.uint8)[tile_same])
    codes = (q.view(torch.uint8).int() - rq.view(torch.uint8).int()).abs()
    assert (codes[~tile_same] <= 1).all()


def _kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_profiler_shows_fp8_gemm_kernels():
    """The dense fp8_block GEMMs run a cuBLAS FP8 kernel and the grouped one its FP8 kernel; no BF16 GEMM
    kernel (the one ``torch.mm`` on bf16 runs at the same shape) and no dequantize stands in."""
    g = torch.Generator().manual_seed(4)
    m, n, k = 512, 512, 1024
    a, sa = bf.quantize_1x128(torch.randn(m, k, generator=g).cuda())
    b, sb = bf.quantize_128x128(torch.randn(n, k, generator=g).cuda())
    bf16_names = set(
        _kernels(
            lambda: (
                torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                @ torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            )
        )
    )
    block_gemm.scaled_mm(a, sa, b, sb)  # warm-up: layouts, cuBLAS handles
    dense = _kernels(lambda: block_gemm.scaled_mm(a, sa, b, sb))
    gemms = [name for name in dense if FP8_GEMM_NAME.search(name)]
    assert gemms, f"no FP8 GEMM kernel among {dense}"
    assert not (set(dense) & {name for name in bf16_names if "gemm" in name.lower() or "nvjet" in name}), dense
    offs = torch.tensor([100, 100, 512], dtype=torch.int32, device="cuda")
    bg, sbg = bf.quantize_128x128(torch.randn(3, n, k, generator=g).cuda())
    block_gemm.grouped_mm(a, sa, bg, sbg, offs)  # warm-up: autotuning
    grouped = _kernels(lambda: block_gemm.grouped_mm(a, sa, bg, sbg, offs))
    # one launch of the FP8 kernel mxfx picks (the sm90 one after its tile schedule), nothing else
    expected = {"sm90 warp-specialized": ["_schedule_kernel", "_grouped_kernel"], "Triton": ["_grouped_body"]}
    assert grouped == expected[block_gemm.grouped_kernel_name(a, bg, torch.bfloat16)], grouped
    print("dense kernels:", dense, "| grouped:", grouped)


def test_payload_transpose_matches_torch_byte_for_byte():
    """The dgrad weight copy's transpose kernel on the GPU: an expert stack with edges cut at both tile sides,
    and a transposed (non-contiguous) input."""
    from mxfx.kernels.common import transpose

    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (5, 200, 130), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn).cuda()
    for src in (q, q.transpose(-2, -1)):
        out = transpose.transpose_lastdims(src)
        assert out.is_contiguous() and out.shape == src.transpose(-2, -1).shape
        assert torch.equal(out.view(torch.uint8), src.view(torch.uint8).transpose(-2, -1))


class _Block(torch.nn.Module):
    """A dense GELU MLP (the attention projections' case: linears with an FP8 wgrad) and routed SwiGLU experts on
    tokens already sorted by expert (deterministic on CUDA: no scatter), FP32 parameters, sizes multiples of 128."""

    def __init__(self, d=128, h=256, experts=4):
        super().__init__()
        self.up = torch.nn.Linear(d, h, bias=False)
        self.down = torch.nn.Linear(h, d, bias=False)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * h, d) * d**-0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, d, h) * h**-0.5)

    def forward(self, x, offs, route_weight):
        x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        gu = torch._grouped_mm(x.to(torch.bfloat16), self.gate_up_proj.to(torch.bfloat16).transpose(-2, -1), offs=offs)
        g, u = gu.chunk(2, dim=-1)
        y = torch._grouped_mm(
            torch.nn.functional.silu(g) * u, self.down_proj.to(torch.bfloat16).transpose(-2, -1), offs=offs
        )
        return (y * route_weight[:, None]).float().square().mean()


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.slow
def test_compiled_fp8_block_launches_its_kernels_itself(monkeypatch, dynamic):
    """Traced on CUDA, the fp8_block quantize kernels enter the graph through ``wrap_triton`` and the dense
    GEMMs as ``_scaled_mm``, launched by Inductor's own code: no ``mxfx::block_*`` quantize op is left, only the
    grouped GEMMs and float32-output (wgrad) dense GEMMs stay ops (and, not in this model, a dense SwiGLU's
    operands with an FP8 wgrad, which no single kernel writes). Loss and gradients match the opaque compile
    (bounds as in the MX test of tests/test_gpu_ops.py: the graphs around the ops differ, so Inductor may fuse
    the fp32 reductions differently), and the routed SwiGLU still saves gate and up as FP8 pairs, not its BF16
    input."""
    from torch._inductor.utils import run_and_get_code

    import mxfx

    torch.manual_seed(0)
    model = _Block().cuda()
    s, h = 256, 256
    x = torch.randn(s, 128, device="cuda")
    offs = torch.tensor([64, 64, 200, s], dtype=torch.int32, device="cuda")
    route_weight = torch.rand(s, device="cuda", dtype=torch.bfloat16)

    def step(opaque: bool):
        # chosen by the policy, over the environment variable set the other way
        monkeypatch.setenv("MXFX_OPAQUE_KERNELS", "0" if opaque else "1")
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        options = {"format": "fp8_block", "kernels": "opaque" if opaque else "inductor"}
        compiled = torch.compile(m, backend="mxfp8", dynamic=dynamic, options=options)
        saved = {}

        def run():
            with torch.autocast("cuda", torch.bfloat16):
                loss = compiled(x, offs, route_weight)
            saved["tensors"] = mxfx.report.saved_for_backward(loss)
            loss.backward()
            return loss

        loss, code = run_and_get_code(run)
        mode = "opaque" if opaque else "inductor"
        assert f"kernels {mode} (policy kernels='{mode}')" in mxfx.report.last_report().summary()
        return loss.detach(), [p.grad for p in m.parameters()], "\n".join(code), saved["tensors"]

    loss_i, grads_i, code_i, saved_i = step(opaque=False)
    loss_o, grads_o, code_o, _ = step(opaque=True)
    assert "mxfx.block_forward_operands" in code_o and "mxfx.block_mm" in code_o  # the opaque arm holds the ops
    # the routed dgrad's dY, its BF16 copy and the route weights' gradient: one op from one read of dY
    assert "mxfx.block_route_grad_operands" in code_o
    # a symbolic token count pads the dense wgrad operand's tokens (token_rows), a pair the dual kernel does not
    # write: that linear's forward operands stay the one opaque op, its quantizes still never separate ops
    inlined = (
        "block_quantize",
        "block_swiglu_quantize",
        "block_route_weight_quantize",
        "block_route_grad_operands",
        "block_quantize_tokens",
        "block_quantize_dual",
    )
    for op in inlined if dynamic else (*inlined, "block_forward_operands"):
        assert f"torch.ops.mxfx.{op}.default" not in code_i, op
    assert "_scaled_mm" in code_i and code_i.count("mxfx.block_mm.default") < code_o.count("mxfx.block_mm.default")
    assert "mxfx.block_grouped_mm" in code_i
    fp8 = [t for t in saved_i if t.dtype == torch.float8_e4m3fn and t.numel() == s * h]
    bf16_gate_up = [t for t in saved_i if t.dtype == torch.bfloat16 and t.numel() >= s * 2 * h]
    assert len(fp8) >= 2 and not bf16_gate_up, [(t.dtype, tuple(t.shape)) for t in saved_i]
    assert ((loss_i - loss_o).abs() / loss_o.abs()).item() < 1e-5
    for gi, go in zip(grads_i, grads_o):
        assert gi is not None and ((gi - go).norm() / go.norm()).item() < 1e-2
