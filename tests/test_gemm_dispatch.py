"""GEMM dispatch by architecture: native Blackwell operands, selection, Hopper's dequantized-weight
option, min_size="auto".

The native Blackwell calls (``torch._scaled_mm`` / ``torch._scaled_grouped_mm``
with MXFP8 scales) cannot run on CPU, so the native branch is verified up to the
call: its operands are compared with torchao's reference layouts and a hand-built
tile, and the native torch ops are replaced by pure-torch decoders that check what
the real ops check (dtypes, strides, scale sizes), undo the blocked layout with
torchao's ``from_blocked``, dequantize and multiply. The native branch run through
those decoders must equal the emulated branch, padding and slicing included.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torchao.prototype.moe_training.kernels.mxfp8.quant import (
    torch_to_blocked_2d_K_groups,
    torch_to_blocked_2d_M_groups,
    torch_to_blocked_per_group_3d,
)
from torchao.prototype.mx_formats.utils import from_blocked as ao_from_blocked
from torchao.prototype.mx_formats.utils import to_blocked as ao_to_blocked

from mxfx.runtime import cache
from mxfx.policy import crossover
from mxfx.numerics import layout
from mxfx.formats.mxfp8 import FORMAT as MXFP8
from mxfx import device as mx_device
from mxfx.kernels.mx import custom_ops
from mxfx.kernels.mx import gemm
from mxfx.kernels.mx import gemm_blackwell
from mxfx.kernels.mx import operands
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear
from mxfx.policy import Policy

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def ceil(n, m):
    return -(-n // m) * m


def mx(shape, seed=0, scale=1.0):
    torch.manual_seed(seed)
    return custom_ops.quantize(torch.randn(shape) * scale, "rceil")


def deq(q, s_bytes):
    """Independent dequantize: e4m3 payload x 2^(byte - 127), block 32 along the last dim."""
    return q.float() * torch.exp2(s_bytes.float() - 127).repeat_interleave(32, -1)


# --- pure-torch stand-ins for the native ops ----------------------------------------------------

calls = {"mm": 0, "grouped": 0}


def fake_scaled_mm(mat_a, mat_b, scale_a, scale_b, out_dtype=None, **kw):
    """What ``torch._scaled_mm`` computes for the MXFP8 recipe, from exactly its arguments."""
    calls["mm"] += 1
    (m, k), (k2, n) = mat_a.shape, mat_b.shape
    assert k == k2 and mat_a.dtype == E4M3 and mat_b.dtype == E4M3
    assert mat_a.stride(1) == 1 and mat_b.stride(0) == 1, "A row-major, B column-major"
    assert n % 16 == 0 and k % 32 == 0
    assert scale_a.dtype == E8M0 and scale_b.dtype == E8M0
    assert scale_a.numel() == ceil(m, 128) * ceil(k // 32, 4) and scale_b.numel() == ceil(n, 128) * ceil(k // 32, 4)
    sa = ao_from_blocked(scale_a.view(torch.uint8).reshape(-1), m, k // 32)
    sb = ao_from_blocked(scale_b.view(torch.uint8).reshape(-1), n, k // 32)
    return (deq(mat_a, sa) @ deq(mat_b.t(), sb).t()).to(out_dtype)


def fake_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, **kw):
    """``torch._scaled_grouped_mm`` for MXFP8, 2D x 3D (groups along M) and 2D x 2D (groups along K)."""
    calls["grouped"] += 1
    assert mat_a.dtype == E4M3 and mat_b.dtype == E4M3 and scale_a.dtype == E8M0 and scale_b.dtype == E8M0
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    sa_raw = scale_a.view(torch.uint8).reshape(-1)
    if mat_b.dim() == 3:  # out = A[grp] @ B[e]
        e, k, n = mat_b.shape
        kb, kb4 = k // 32, ceil(k // 32, 4)
        assert all(x % 32 == 0 for x in ends), "token groups padded to 32"
        assert mat_b.stride(1) == 1, "B per-expert column-major"
        out = torch.zeros(mat_a.shape[0], n)
        row = 0  # first scale row of the group: earlier groups rounded up to 128
        for g, (s, t) in enumerate(zip(starts, ends)):
            if t > s:
                region = sa_raw[row * kb4 : (row + ceil(t - s, 128)) * kb4]
                sa = ao_from_blocked(region, t - s, kb)
                sb = ao_from_blocked(scale_b[g].view(torch.uint8), n, kb)
                out[s:t] = deq(mat_a[s:t], sa) @ deq(mat_b[g].t(), sb).t()
            row += ceil(t - s, 128)
        return out.to(out_dtype)
    n, t_all = mat_a.shape
    k = mat_b.shape[1]
    assert mat_b.stride(0) == 1
    out = torch.zeros(len(ends), n, k)
    sb_raw = scale_b.view(torch.uint8).reshape(-1)
    col = 0
    for g, (s, t) in enumerate(zip(starts, ends)):
        cols = (t - s) // 32
        if cols:
            sa = ao_from_blocked(sa_raw[ceil(n, 128) * col : ceil(n, 128) * (col + ceil(cols, 4))], n, cols)
            sb = ao_from_blocked(sb_raw[ceil(k, 128) * col : ceil(k, 128) * (col + ceil(cols, 4))], k, cols)
            out[g] = deq(mat_a[:, s:t], sa) @ deq(mat_b[s:t].t(), sb).t()
        col += ceil(cols, 4)
    return out.to(out_dtype)


@pytest.fixture
def native(monkeypatch):
    """Pretend to be a B200 (capability 10.0) with the native ops replaced by the decoders."""
    monkeypatch.setattr(mx_device, "capability", lambda device: (10, 0))
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm)
    calls.update(mm=0, grouped=0)
    return calls


# --- selection ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cap, mm, grouped",
    [
        ((10, 0), "native", "native"),
        ((10, 3), "native", "native"),
        ((12, 0), "native", "emulated"),
        ((9, 0), "emulated", "emulated"),
        ((8, 0), "emulated", "emulated"),
        (None, "emulated", "emulated"),
    ],
)
def test_selection_by_capability(monkeypatch, cap, mm, grouped):
    """The MXFP8 format owns which of its GEMMs run natively per architecture (``MXFP8.native_gemms``)."""
    monkeypatch.setattr(mx_device, "capability", lambda device: cap)
    dev = torch.device("cpu")
    kind = {True: "native", False: "emulated"}
    assert kind[MXFP8.runs_natively("mm", dev)] == mm
    assert kind[MXFP8.runs_natively("grouped_mm", dev)] == grouped
    assert kind[MXFP8.runs_natively("grouped_mm_wgrad", dev)] == grouped
    assert MXFP8.native_archs == ("sm100", "sm120")
    with pytest.raises(ValueError, match=r"op='bogus' is not a GEMM op"):
        MXFP8.runs_natively("bogus", dev)


def test_cpu_selects_emulation_without_patching():
    assert mx_device.arch_of(mx_device.capability(torch.device("cpu"))) == "cpu"
    assert not MXFP8.runs_natively("mm", torch.device("cpu"))


def test_native_branch_calls_native_op_only_on_blackwell(monkeypatch, native):
    (aq, as_), (bq, bs) = mx((64, 64), 1), mx((32, 64), 2)
    MXFP8.mm((aq, as_, None), (bq, bs, None), torch.float32)
    assert native["mm"] == 1
    monkeypatch.setattr(mx_device, "capability", lambda device: (9, 0))
    MXFP8.mm((aq, as_, None), (bq, bs, None), torch.float32)
    assert native["mm"] == 1  # Hopper: emulated, the native op is not called


@pytest.mark.parametrize(
    "cap, op, fused",
    [
        ((9, 0), "mm", True),
        (None, "grouped_mm", True),
        ((10, 0), "mm", False),
        ((12, 0), "grouped_mm", True),
        ((12, 0), "mm", False),
    ],
)
def test_quantize_operand_writes_dequantized_form_where_emulated(monkeypatch, cap, op, fused):
    """The Hopper path's one-pass activation quantize: where the GEMM is emulated, the quantize pass also
    returns dequant(qdata, scales) in the emulation dtype, and a GEMM reading it equals one dequantizing A."""
    from mxfx.numerics import mx as mxf

    monkeypatch.setattr(mx_device, "capability", lambda device: cap)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    q, s, x_hat = MXFP8.input_operand(x, None, "rceil", op)
    rq, rs = mxf.quantize_lastdim(x, "rceil")
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    if not fused:
        assert x_hat is None  # native MX GEMM: nothing to dequantize
        return
    assert torch.equal(x_hat, mxf.dequantize_lastdim(rq, rs, torch.float32))  # fp32: CPU's emulation dtype
    bq, bs = mx((32, 96), 2)
    ref = custom_ops.mx_mm(q, s, bq, bs, torch.float32, False)  # the emulated GEMM itself, on CPU
    assert torch.equal(custom_ops.mx_mm(q, s, bq, bs, torch.float32, False, None, x_hat), ref)
    x_hat_read = custom_ops.mx_mm(q, s, bq, bs, torch.float32, False, None, 2 * x_hat)
    assert not torch.equal(x_hat_read, ref)  # x_hat is what it reads


# --- dense operands ----------------------------------------------------------------------------


def test_native_mm_operands_layout():
    m, k, n = 200, 96, 72  # M not a multiple of 128, K/32 = 3 not a multiple of 4, N not of 16
    (aq, as_), (bq, bs) = mx((m, k), 1), mx((n, k), 2)
    o = gemm_blackwell.native_mm_operands(aq, as_, bq, bs)
    assert o.mat_a.dtype == E4M3 and o.mat_a.shape == (m, k) and o.mat_a.is_contiguous()
    assert o.mat_b.shape == (k, 80) and o.mat_b.stride() == (1, k), "B^T column-major, N padded to 16"
    assert torch.equal(o.mat_b.t()[:n].view(torch.uint8), bq.view(torch.uint8))
    assert not o.mat_b.t()[n:].view(torch.uint8).any(), "padding rows are zero"
    assert o.cols == n and o.scale_a.dtype == E8M0
    # the blocked scales equal torchao's to_blocked
    assert torch.equal(o.scale_a.view(torch.uint8), ao_to_blocked(as_))
    b_pad = torch.cat([bs, bs.new_zeros(80 - n, k // 32)])
    assert torch.equal(o.scale_b.view(torch.uint8), ao_to_blocked(b_pad))


def test_native_mm_operands_take_blocked_scales():
    """Scales the dual pass wrote blocked (quantize_dual_blocked) give the operands of plain scales: A from 64
    padded token rows used for its first 50 (the zero rows' scale byte 0 is the layout's padding), B of 40
    rows (N padded to 48 for qdata, to 128 for scales)."""
    x = torch.cat([torch.randn(50, 96), torch.zeros(14, 96)])
    w = torch.cat([torch.randn(40, 96), torch.zeros(24, 96)])
    (aq, as_, *_), (bq, bs, *_) = custom_ops.quantize_dual(x, "rceil"), custom_ops.quantize_dual(w, "rceil")
    (aq2, as2, *_), (bq2, bs2, *_) = (
        custom_ops.quantize_dual_blocked(x, "rceil"),
        custom_ops.quantize_dual_blocked(w, "rceil"),
    )
    assert layout.is_blocked(aq2, as2) and not layout.is_blocked(aq, as_)
    want = gemm_blackwell.native_mm_operands(aq[:50], as_[:50], bq[:40], bs[:40])
    got = gemm_blackwell.native_mm_operands(aq2[:50], as2, bq2[:40], bs2)
    for field in ("mat_a", "mat_b", "scale_a", "scale_b"):
        assert torch.equal(getattr(got, field).view(torch.uint8), getattr(want, field).view(torch.uint8)), field
    assert got.cols == want.cols == 40
    with pytest.raises(ValueError, match=r"do not pair up"):  # blocked scales of the wrong size are not taken
        gemm_blackwell.native_mm_operands(aq2[:50], as2[:-4], bq2[:40], bs2)


def test_blocked_tile_by_hand():
    """One 128x4 tile: scale (32 g + i, c) sits at byte i*16 + g*4 + c (cuBLAS 1D block scaling layout)."""
    s = torch.arange(128 * 4, dtype=torch.int32).reshape(128, 4).remainder(251).to(torch.uint8)
    q = torch.zeros(128, 128).to(E4M3)
    o = gemm_blackwell.native_mm_operands(q, s, q[:32], s[:32])
    got = o.scale_a.view(torch.uint8)
    for r in range(128):
        g, i = divmod(r, 32)
        for c in range(4):
            assert got[i * 16 + g * 4 + c] == s[r, c]


@pytest.mark.parametrize("m, k, n", [(200, 96, 72), (128, 256, 64), (5, 32, 32)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_native_mm_decoded_equals_emulation(native, m, k, n, out_dtype):
    (aq, as_), (bq, bs) = mx((m, k), 3, 4.0), mx((n, k), 4, 0.1)
    emulated = gemm._emulated_mm(aq, as_, bq, bs, out_dtype)
    got = custom_ops.mx_mm(aq, as_, bq, bs, out_dtype, True)
    assert native["mm"] == 1 and got.shape == (m, n) and got.dtype == out_dtype
    torch.testing.assert_close(got, emulated, rtol=1e-5, atol=1e-5)


def test_native_mm_operand_errors():
    (aq, as_), (bq, bs) = mx((8, 64)), mx((32, 96))
    with pytest.raises(ValueError, match="must be"):
        gemm_blackwell.native_mm_operands(aq, as_, bq, bs)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        gemm_blackwell.native_mm_operands(aq.float(), as_, bq, bs)


# --- grouped operands --------------------------------------------------------------------------

OFFS = [(0, 40, 40, 200, 263), (0, 40, 40, 200, 250)]  # uneven, an empty group, a group of 0, rows past the end


@pytest.mark.parametrize("ends", OFFS)
def test_native_grouped_operands_match_torchao(ends):
    s, k, n, e = 263, 128, 96, len(ends)
    offs = torch.tensor(ends, dtype=torch.int32)
    (aq, as_), (bq, bs) = mx((s, k), 5), mx((e, n, k), 6)
    o = gemm_blackwell.native_grouped_mm_operands(aq, as_, bq, bs, offs)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert torch.equal(o.offs, torch.cumsum((sizes + 31) // 32 * 32, 0).to(torch.int32))
    # qdata rows land at their padded rows, padding rows are zero
    real = o.rows[: ends[-1]]
    assert torch.equal(o.mat_a.view(torch.uint8)[real], aq.view(torch.uint8)[: ends[-1]])
    mask = torch.ones(o.mat_a.shape[0], dtype=torch.bool)
    mask[real] = False
    assert not o.mat_a.view(torch.uint8)[mask][: int(o.offs[-1]) - ends[-1]].any()
    # A scales: torchao's per-group blocked layout (groups on 128-row tile boundaries)
    ref, _ = torch_to_blocked_2d_M_groups(as_[: ends[-1]], offs)
    used = int(sum(ceil(int(x), 128) for x in sizes))
    assert torch.equal(o.scale_a.view(torch.uint8)[:used], ref[:used])
    assert not o.scale_a.view(torch.uint8)[used:].any()
    # B scales: per-expert blocked
    assert torch.equal(o.scale_b.view(torch.uint8), torch_to_blocked_per_group_3d(bs))
    assert o.mat_b.shape == (e, k, n) and o.mat_b.stride(1) == 1


@pytest.mark.parametrize("ends", OFFS)
def test_native_grouped_decoded_equals_emulation(native, ends):
    s, k, n, e = 263, 96, 64, len(ends)
    offs = torch.tensor(ends, dtype=torch.int32)
    (aq, as_), (bq, bs) = mx((s, k), 7), mx((e, n, k), 8, 0.1)
    emulated = gemm._emulated_grouped_mm(aq, as_, bq, bs, offs, torch.float32)
    got = custom_ops.mx_grouped_mm(aq, as_, bq, bs, offs, torch.float32, True)
    assert native["grouped"] == 1 and got.shape == (s, n)
    torch.testing.assert_close(got, emulated, rtol=1e-5, atol=1e-5)
    assert not got[ends[-1] :].any()


def test_k_groups_layout_matches_torchao():
    n, cols = 200, 23
    s = torch.randint(1, 255, (n, cols), dtype=torch.uint8)
    scale_offs = torch.tensor([5, 5, 12, 23], dtype=torch.int32)
    ref, _ = torch_to_blocked_2d_K_groups(s, scale_offs)
    assert torch.equal(gemm_blackwell.k_groups_blocked(s, scale_offs), ref)


def test_native_wgrad_decoded_equals_emulation(native):
    n, k, t = 64, 96, 256
    offs = torch.tensor([64, 64, 160, 256], dtype=torch.int32)  # multiples of 32, one empty group
    (aq, as_), (bq, bs) = mx((n, t), 9), mx((k, t), 10)
    emulated = gemm._emulated_grouped_wgrad(aq, as_, bq, bs, offs, torch.float32)
    got = custom_ops.mx_grouped_mm_wgrad(aq, as_, bq, bs, offs, torch.float32, True)
    assert native["grouped"] == 1 and got.shape == (4, n, k)
    torch.testing.assert_close(got, emulated, rtol=1e-5, atol=1e-5)


def test_native_ops_through_autograd(native, monkeypatch):
    """mx_linear forward+backward on the native branch equals the emulated branch (operands, slicing, wgrad);
    the native GEMMs take their blocked scales from the dual passes themselves, and the weight's from its
    cache, which keeps them blocked (``mxfx.formats.mxfp8.blocked_scales``): no GEMM call blocks scales itself."""
    import mxfx
    from mxfx.numerics import layout

    blocked_passes, per_call_blocking = [], []
    dual_blocked, to_blocked = custom_ops.quantize_dual_blocked, layout.to_blocked
    monkeypatch.setattr(
        custom_ops, "quantize_dual_blocked", lambda *a: blocked_passes.append(a[0].shape) or dual_blocked(*a)
    )
    monkeypatch.setattr(layout, "to_blocked", lambda s: per_call_blocking.append(s.shape) or to_blocked(s))
    torch.manual_seed(11)
    w = torch.randn(64, 96, requires_grad=True)
    x = torch.randn(50, 96, requires_grad=True)
    y = mx_linear(x, w)
    y.square().sum().backward()
    got = (y.detach(), x.grad, w.grad)
    assert native["mm"] == 3  # forward, dgrad, wgrad
    assert blocked_passes == [(64, 96), (64, 64)]  # forward x, backward dY (both 50 tokens padded to 64)
    assert per_call_blocking == []
    for orientation, src in (("forward", w), ("dgrad", w.t())):
        q, s = cache.weight_form(w, "rceil", orientation)
        rq, rs = mxfx.quantize(src.detach().contiguous(), rule="rceil")
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(
            s, to_blocked(rs.view(torch.uint8))
        )
    mx_device.capability, saved = (lambda device: None), mx_device.capability
    try:
        x.grad = w.grad = None
        y = mx_linear(x, w)
        y.square().sum().backward()
    finally:
        mx_device.capability = saved
    for a, b in zip(got, (y.detach(), x.grad, w.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# --- keep_dequantized_weights -------------------------------------------------------------------


@pytest.fixture
def keep_every_form():
    """These tests read from the cache the forms a backward used: keep every form (by default a weight's
    forms are dropped at its backward with one microbatch per step, mxfx.runtime.cache)."""
    previous = cache.set_dgrad_at_refresh(True)
    yield
    cache.set_dgrad_at_refresh(previous)


def _linear_grads(keep):
    torch.manual_seed(12)
    w = torch.randn(64, 96, requires_grad=True)
    x = torch.randn(40, 96, requires_grad=True)
    y = mx_linear(x, w, keep_dequantized_weights=keep)
    y.square().sum().backward()
    return y.detach(), x.grad, w.grad, cache.persistent_bytes(w)


def _grouped_grads(keep):
    torch.manual_seed(13)
    w = torch.randn(3, 64, 96, requires_grad=True)
    x = torch.randn(70, 96, requires_grad=True)
    offs = torch.tensor([20, 20, 70], dtype=torch.int32)
    y = mx_grouped_mm_op(x, w, offs, keep_dequantized_weights=keep)
    y.square().sum().backward()
    return y.detach(), x.grad, w.grad, cache.persistent_bytes(w)


@pytest.mark.parametrize("run", [_linear_grads, _grouped_grads])
def test_keep_dequantized_weights_identical(run, keep_every_form):
    *off, bytes_off = run(False)
    *on, bytes_on = run(True)
    for a, b in zip(off, on):
        assert torch.equal(a, b)
    numel = off[2].numel()
    assert bytes_off == 2 * numel * 33 // 32, "the forward and dgrad MX forms"
    assert bytes_on == 2 * 2 * numel, "emulated GEMMs: a bf16 forward and a bf16 dgrad form, no MX form"


def test_keep_dequantized_weights_cache_forms_and_refresh(keep_every_form):
    w = torch.randn(64, 96)
    fwd, dgrad = cache.weight_form(w, "rceil", "forward_bf16")[0], cache.weight_form(w, "rceil", "dgrad_bf16")[0]
    assert fwd.dtype == torch.bfloat16 and fwd.shape == (64, 96) and dgrad.shape == (96, 64)
    assert torch.equal(fwd.float(), custom_ops.dequantize(*cache.weight_form(w, "rceil", "forward"), torch.float32))
    assert torch.equal(dgrad.float(), custom_ops.dequantize(*cache.weight_form(w, "rceil", "dgrad"), torch.float32))
    with torch.no_grad():
        w.mul_(2)  # bumps the version: the dequantized forms are rebuilt with the MX forms
    assert torch.equal(cache.weight_form(w, "rceil", "forward_bf16")[0], (fwd.float() * 2).bfloat16())
    # every form rebuilt at the first lookup after the change (keep_every_form: set_dgrad_at_refresh)
    assert cache.persistent_bytes(w) == w.numel() * 2 * 33 // 32 + 4 * w.numel(), "all forms rebuilt..."
    assert torch.equal(cache.weight_form(w, "rceil", "dgrad_bf16")[0], (dgrad.float() * 2).bfloat16())
    assert torch.equal(custom_ops.dequantize(*cache.weight_form(w, "rceil", "dgrad"), torch.float32), dgrad.float() * 2)
    assert cache.persistent_bytes(w) == w.numel() * 2 * 33 // 32 + 4 * w.numel(), "... dgrad forms at their lookups"
    w2 = torch.randn(64, 96)
    cache.weight_form(w2, "rceil", "dgrad_bf16")[0]
    assert cache.persistent_bytes(w2) == 2 * w2.numel(), "emulated: a dequantized form alone, no MX form"
    with pytest.raises(ValueError, match="form='forward_bf16_bf16' is not valid"):
        cache.weight_form(w, "rceil", "forward_bf16_bf16")


def test_keep_dequantized_weights_compiled(keep_every_form):
    """The option threads through the backend into compiled graphs (custom-op args) with identical results."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 96, bias=False)
            self.b = torch.nn.Linear(96, 64, bias=False)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(14)
    model, x = M(), torch.randn(48, 64)
    results = []
    for keep in (False, True):
        torch._dynamo.reset()
        cache.clear()
        compiled = torch.compile(
            model, backend="mxfp8", options={"keep_dequantized_weights": keep, "inner": "aot_eager"}
        )
        y = compiled(x)
        y.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append(
            (y.detach(), grads, cache.persistent_bytes(model.a.weight), cache.persistent_bytes(model.b.weight))
        )
        model.zero_grad(set_to_none=True)
    (y0, g0, a0, b0), (y1, g1, a1, b1) = results
    assert torch.equal(y0, y1) and all(torch.equal(u, v) for u, v in zip(g0, g1))
    assert a0 == model.a.weight.numel() * 33 // 32, "first layer: no dgrad (its input needs no grad), forward MX form"
    assert a1 == 2 * model.a.weight.numel(), "... or its forward bf16 form alone"
    assert b1 == 2 * 2 * model.b.weight.numel(), "second layer: forward and dgrad bf16 forms, no MX form"


def test_dual_operand_values_only_where_emulated():
    """Emulated GEMMs get both orientations as dequantized values alone (one pass, no MX pair); a GEMM
    given A or B that way equals the one given the pairs; native GEMMs get the pairs and refuse None."""
    from mxfx.numerics import mx as mxf
    from mxfx.numerics.layout import to_blocked

    torch.manual_seed(15)
    x, w = torch.randn(64, 96), torch.randn(32, 96)
    rq, rs = mxf.quantize_lastdim(x, "rceil")
    cq, cs = mxf.quantize_lastdim(x.t(), "rceil")
    q, s, h, qt, st, ht = operands.quantize_dual_operand(x, "rceil", torch.float32)  # emulated (CPU: fp32 values)
    assert (q, s, qt, st) == (None,) * 4
    assert torch.equal(h, mxf.dequantize_lastdim(rq, rs, torch.float32))
    assert torch.equal(ht, mxf.dequantize_lastdim(cq, cs, torch.float32)) and ht.shape == (96, 64)
    wq, ws = mxf.quantize_lastdim(w, "rceil")
    w_hat = mxf.dequantize_lastdim(wq, ws, torch.bfloat16)
    ref = custom_ops.mx_mm(rq, rs, wq, ws, torch.float32, False)
    assert torch.equal(custom_ops.mx_mm(None, None, wq, ws, torch.float32, False, None, h), ref)
    assert torch.equal(custom_ops.mx_mm(None, None, None, None, torch.float32, False, w_hat, h), ref)
    with pytest.raises(ValueError, match=r"A has neither an MX pair .* nor dequantized values.*a_dequantized"):
        custom_ops.mx_mm(None, None, wq, ws, torch.float32, False)
    with pytest.raises(ValueError, match=r"B has neither an MX pair"):
        custom_ops.mx_mm(rq, rs, wq, None, torch.float32, False)  # qdata without its scales
    with pytest.raises(ValueError, match=r"a_dequantized of shape \(64, 64\) is not the dequantization of A's qdata"):
        custom_ops.mx_mm(rq, rs, wq, ws, torch.float32, False, None, h[:, :64])
    with pytest.raises(ValueError, match=r"A of shape \(64, 64\) and B of shape \(32, 96\) must share their last"):
        custom_ops.mx_mm(None, None, wq, ws, torch.float32, False, None, h[:, :64])
    with pytest.raises(TypeError, match=r"a_dequantized of shape \(64, 96\) has dtype torch.float8_e4m3fn"):
        custom_ops.mx_mm(rq, rs, wq, ws, torch.float32, False, None, rq)  # qdata passed as values
    with pytest.raises(ValueError, match=r"A of shape \(2, 64, 96\) and B of shape \(32, 96\) must be 2D and 2D"):
        custom_ops.mx_mm(None, None, wq, ws, torch.float32, False, None, h.expand(2, 64, 96))
    q, s, h, qt, st, ht = operands.quantize_dual_operand(x, "rceil", None)  # native
    assert h is None and ht is None
    for got, want in ((q, rq), (s, to_blocked(rs)), (qt, cq), (st, to_blocked(cs))):  # dense: scales blocked
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="native MX GEMMs need B's MX pair"):
        gemm_blackwell.native_mm_operands(rq, rs, None, None)


# --- min_size="auto" ---------------------------------------------------------------------------


def _table(path):
    def pts(ratios):
        return [
            {"M": m, "bf16_fwd_ms": 1.0, "mx_fwd_ms": 1.0, "bf16_fwdbwd_ms": r, "mx_fwdbwd_ms": 1.0} for m, r in ratios
        ]

    table = {
        "capability": [9, 0],
        "families": [
            {"name": "1024->1024", "K": 1024, "N": 1024, "points": pts([(128, 0.5), (8192, 0.9), (32768, 1.1)])},
            {"name": "4096->4096", "K": 4096, "N": 4096, "points": pts([(128, 0.5), (8192, 1.3), (32768, 1.6)])},
        ],
    }
    path.write_text(json.dumps(table))


def test_min_size_auto_reads_table(tmp_path, monkeypatch):
    _table(tmp_path / "crossover_mxfp8_sm90.json")
    monkeypatch.setattr(crossover, "DATA_DIR", str(tmp_path))
    monkeypatch.setattr(crossover, "_capability", lambda: (9, 0))
    p = Policy(min_size="auto")
    d = p.decide("linear", "layers.0.attn.qkv", 1, gemm=(100, 1024, 1024))
    assert d.precision == "bf16" and "1024->1024 M=128" in d.reason
    assert p.decide("linear", "x", 1, gemm=(30000, 1000, 1100)).precision == "mxfp8"  # nearest: 1024 family, M=32768
    assert p.decide("linear", "x", 1, gemm=(6000, 1024, 1024)).precision == "bf16"  # M=8192 point: 0.9x
    assert p.decide("linear", "x", 1, gemm=(6000, 3500, 4096)).precision == "mxfp8"  # 4096 family
    assert p.decide("linear", "x").precision == "mxfp8"  # no shape known: rewritten
    assert Policy(min_size=0).decide("linear", "x", 1, gemm=(100, 1024, 1024)).precision == "mxfp8"


def test_min_size_auto_reads_the_table_of_the_ops_format(tmp_path, monkeypatch):
    """One format's crossover says nothing of another's costs: an fp8_block op never reads mxfp8's table. Without
    its own it warns (naming its format and the command that measures one) and is rewritten; with one, it reads
    it. A BF16 format (bf16_gemm) has no crossover with BF16: its ops are rewritten without a table."""
    _table(tmp_path / "crossover_mxfp8_sm90.json")  # says BF16 at M=128 of the 1024 family
    monkeypatch.setattr(crossover, "DATA_DIR", str(tmp_path))
    monkeypatch.setattr(crossover, "_capability", lambda: (9, 0))
    monkeypatch.setattr(crossover, "_warned", set())
    gemm = (100, 1024, 1024)
    assert Policy(min_size="auto").decide("linear", "x", 1, gemm=gemm).precision == "bf16"
    block = Policy(min_size="auto", format="fp8_block")
    with pytest.warns(UserWarning, match=r"no fp8_block crossover table .* bench/crossover.py --format fp8_block"):
        d = block.decide("linear", "x", 1, gemm=gemm)
    assert d.precision == "mxfp8" and d.format.name == "fp8_block"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Policy(min_size="auto", format="bf16_gemm").decide("linear", "x", 1, gemm=gemm).precision == "mxfp8"
    _table(tmp_path / "crossover_fp8_block_sm90.json")
    d = block.decide("linear", "x", 1, gemm=gemm)
    assert d.precision == "bf16" and "1024->1024 M=128 fp8_block" in d.reason, d.reason


def test_min_size_auto_without_table_warns_once(tmp_path, monkeypatch):
    monkeypatch.setattr(crossover, "DATA_DIR", str(tmp_path))
    monkeypatch.setattr(crossover, "_capability", lambda: (10, 0))
    monkeypatch.setattr(crossover, "_warned", set())
    p = Policy(min_size="auto")
    with pytest.warns(UserWarning, match="no mxfp8 crossover table"):
        assert p.decide("linear", "x", 1, gemm=(128, 1024, 1024)).precision == "mxfp8"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert p.decide("grouped_mm", "x", 1, gemm=(128, 1024, 1024)).precision == "mxfp8"


def test_min_size_validation():
    with pytest.raises(ValueError, match="auto"):
        Policy(min_size="fast")
    with pytest.raises(ValueError, match="keep_dequantized_weights"):
        Policy(keep_dequantized_weights="yes")


@pytest.mark.parametrize("op", ["mm", "grouped_mm", "grouped_mm_wgrad"])
def test_native_gemm_elsewhere_than_blackwell_is_refused_by_name(op):
    """``native=True`` on CPU operands (or a Hopper GPU) raises naming the op and the way out, not torch's own
    error from inside ``torch._scaled_mm``."""
    from mxfx.kernels.mx import gemm as mx_gemm

    q = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    s = torch.full((32, 2), 127, dtype=torch.uint8)
    offs = torch.tensor([32], dtype=torch.int32)
    args = {
        "mm": (q, s, q, s, torch.bfloat16, True),
        "grouped_mm": (q, s, q.view(1, 32, 64), s.view(1, 32, 2), offs, torch.bfloat16, True),
        "grouped_mm_wgrad": (q, s, q, s, torch.tensor([64], dtype=torch.int32), torch.bfloat16, True),
    }[op]
    with pytest.raises(ValueError, match=rf"mxfx::{op}: native=True .* sm100 or sm120 GPU; .* on cpu .*native=False"):
        getattr(mx_gemm, op)(*args)
    assert getattr(mx_gemm, op)(*args[:-1], False).dtype == torch.bfloat16  # the emulation runs
