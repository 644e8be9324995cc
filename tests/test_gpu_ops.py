"""MX autograd ops on CUDA (Triton kernels, Hopper emulated GEMMs) against the same ops on CPU.

Both devices quantize bit-identically; the GEMMs differ only in summation order and in
the emulation dtype (bf16 on CUDA, fp32 on CPU), hence the bf16-level tolerances.
"""

import copy

import pytest
import torch

from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(fn, tensors, device):
    leaves = [t.detach().to(device).requires_grad_(t.requires_grad) if t is not None else None for t in tensors]
    out = fn(*leaves)
    # A fixed cotangent, identical on both devices: a loss like out.square() would hand each device a
    # gradient that already differs at bf16 level, and re-quantizing that to MXFP8 flips E4M3 roundings
    # (rms ~ sqrt(2^-9 * 2^-4) ~ 1.1%), which measures the inputs, not the op.
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, out.dtype)
    out.backward(cot)
    return [out.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves if t is not None and t.requires_grad]


def _close(a, b):
    # A value sitting on an E4M3 rounding boundary may flip by one ulp (12.5%) between the bf16
    # (CUDA) and fp32 (CPU) emulation paths; compare whole tensors by relative norm.
    names = ["output"] + [f"grad {i}" for i in range(len(a) - 1)]
    for name, x, y in zip(names, a, b):
        err = ((x - y).norm() / y.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.3e} between CUDA and CPU"


@cuda
@pytest.mark.parametrize("wgrad", ["mxfp8", "bf16"])
def test_linear_cuda_matches_cpu(wgrad):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 256, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(512, 256, generator=g) * 0.05).requires_grad_()
    b = torch.randn(512, generator=g).requires_grad_()
    fn = lambda x, w, b: mx_linear(x, w, b, wgrad=wgrad)  # noqa: E731
    _close(_run(fn, (x, w, b), "cuda"), _run(fn, (x, w, b), "cpu"))


@cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("swiglu,wgrad", [(False, "bf16"), (True, "bf16"), (True, "mxfp8")])
def test_grouped_cuda_matches_cpu(swiglu, wgrad, compiled):
    g = torch.Generator().manual_seed(0)
    sizes = [70, 0, 33, 150, 3]  # not multiples of 8: CUDA's grouped GEMM alignment must be handled
    s, k, n = sum(sizes), 128, 256
    x = torch.randn(s, k, generator=g).bfloat16().requires_grad_()
    up = torch.randn(s, k, generator=g).bfloat16().requires_grad_() if swiglu else None
    w = (torch.randn(len(sizes), n, k, generator=g) * 0.05).requires_grad_()
    rw = torch.rand(s, 1, generator=g).bfloat16().requires_grad_()
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)

    def fn(x, up, w, rw):
        return mx_grouped_mm_op(x, w, offs.to(x.device), up=up, route_weight=rw, wgrad=wgrad)

    # compiled: Inductor lays out the backward's intermediates itself (where an unaligned routed wgrad
    # once tripped CUDA's grouped-GEMM alignment assert); the kernels are traced into the graph
    torch._dynamo.reset()
    cuda_fn = torch.compile(fn, fullgraph=True) if compiled else fn
    _close(_run(cuda_fn, (x, up, w, rw), "cuda"), _run(fn, (x, up, w, rw), "cpu"))


@cuda
@pytest.mark.parametrize("fmt_name", ["mxfp8", "fp8_block"])
@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "grouped"])
def test_swiglu_operands_from_one_product_compiled(fmt_name, grouped):
    """Compiled on CUDA (the kernels traced into the graph), a SwiGLU input's forward operand and its token-blocked
    wgrad operand are quantized from one FP32 product: each equals, bit for bit, the operand the format makes in
    eager code of that product (``mxfx::swiglu_product``) given as a plain input. 2^24 values, so that a product
    one ulp off anywhere (Inductor's own SiLU, or ``g * sigmoid(g) * up``) moves an E4M3 rounding at a few of them."""
    from mxfx import formats
    from mxfx.kernels.common.custom_ops import swiglu_product

    fmt = formats.get(fmt_name)
    gen = torch.Generator().manual_seed(0)
    rows, k = 8192, 2048
    g, u = (torch.randn(rows, k, generator=gen) * 3).cuda(), torch.randn(rows, k, generator=gen).cuda()
    offs = torch.tensor([1000, 1000, 5003, rows], dtype=torch.int32, device="cuda") if grouped else None

    def operands(g, u):
        a, tokens, _ = fmt.forward_operands(g, u, "rceil", "bf16", True, offs=offs)
        return (*a[:2], *tokens[:2])

    torch._dynamo.reset()
    got = torch.compile(operands)(g, u)
    a, tokens, _ = fmt.forward_operands(swiglu_product(g, u), None, "rceil", "bf16", True, offs=offs)
    for x, y in zip(got, (*a[:2], *tokens[:2])):
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y)


@cuda
@pytest.mark.parametrize("rows,end", [(263, 0), (263, 37), (263, 200), (263, 263), (9000, 100), (9000, 0)])
def test_zero_rows_past_end_writes_only_the_tail(rows, end):
    from mxfx.kernels.common.zero_rows import zero_rows_past_end_

    out = torch.randn(rows, 1030, device="cuda", dtype=torch.bfloat16)  # 9000 rows: more tiles than programs
    before = out.clone()
    offs = torch.tensor([0, min(end, 20), end], dtype=torch.int32, device="cuda")
    zero_rows_past_end_(out, offs)
    assert torch.equal(out[:end], before[:end])
    assert not out[end:].any()


class _Block(torch.nn.Module):
    """A dense SwiGLU MLP and routed SwiGLU experts on tokens already sorted by expert, no scatter:
    every op is deterministic on CUDA (the MoE combine's index_add is not), so a difference between two
    compiles comes from the compiles, not from atomics."""

    def __init__(self, d=128, h=256, experts=4):
        super().__init__()
        self.gate = torch.nn.Linear(d, h, bias=False)
        self.up = torch.nn.Linear(d, h, bias=False)
        self.down = torch.nn.Linear(h, d, bias=False)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * h, d) * d**-0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, d, h) * h**-0.5)

    def forward(self, x, offs, route_weight):
        x = x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        gu = torch._grouped_mm(x.to(torch.bfloat16), self.gate_up_proj.to(torch.bfloat16).transpose(-2, -1), offs=offs)
        g, u = gu.chunk(2, dim=-1)
        h = (torch.nn.functional.silu(g) * u).contiguous()
        y = torch._grouped_mm(h, self.down_proj.to(torch.bfloat16).transpose(-2, -1), offs=offs)
        return (y * route_weight[:, None]).float().square().mean()


@cuda
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.slow
def test_compiled_cuda_graph_launches_mx_kernels_itself(monkeypatch, dynamic):
    """Traced on CUDA, the MX ops go into the graph as Triton kernels that Inductor launches from its own
    code: the generated code calls no mxfx:: custom op except the weight-cache lookups, and loss and
    gradients match those of the same model compiled with the opaque custom ops.

    Not bit for bit: the two graphs differ around the MX ops, so Inductor fuses the surrounding fp32
    reductions (the route-weight gradient, the loss) differently and may pick other GEMM configs; a
    last-bit change upstream can flip an E4M3 rounding of a later quantize (one step is 6-12% of
    that value), which stays far below 1e-2 of a gradient's norm. The forward loss is checked to
    1e-5 relative."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = _Block().cuda()
    x = torch.randn(200, 128, device="cuda")
    offs = torch.tensor([64, 64, 150, 200], dtype=torch.int32, device="cuda")
    route_weight = torch.rand(200, device="cuda", dtype=torch.bfloat16)

    def step(opaque: bool):
        monkeypatch.setenv("MXFX_OPAQUE_KERNELS", "1" if opaque else "0")
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        compiled = torch.compile(m, backend="mxfp8", dynamic=dynamic)

        def run():
            with torch.autocast("cuda", torch.bfloat16):
                loss = compiled(x, offs, route_weight)
            loss.backward()
            return loss

        loss, code = run_and_get_code(run)
        return loss.detach(), [p.grad for p in m.parameters()], "\n".join(code)

    loss_i, grads_i, code_i = step(opaque=False)
    loss_o, grads_o, code_o = step(opaque=True)
    assert "mxfx.quantize" in code_o and "mxfx.mm" in code_o  # the opaque arm really holds the custom ops
    for op in (
        "quantize",
        "quantize_dual",
        "quantize_dequantize",
        "dequantize",
        "swiglu_quantize",
        "mm",
        "grouped_mm",
        "quantize_dual_dequantized",
        "swiglu_quantize_dequantize",
        "route_weight_quantize_dequantize",
        "swiglu_quantize_save",
        "swiglu_quantize_dequantize_save",
        "swiglu_product",
    ):
        assert f"torch.ops.mxfx.{op}.default" not in code_i, op
    assert "cached_weight" in code_i  # the cache lookup stays an op: it holds Python state
    assert ((loss_i - loss_o).abs() / loss_o.abs()).item() < 1e-5
    for gi, go in zip(grads_i, grads_o):
        assert gi is not None and ((gi - go).norm() / go.norm()).item() < 1e-2
