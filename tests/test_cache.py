"""Weight caches (mxfx.runtime.cache): quantize once per optimizer step, refreshed on every path that
changes a weight."""

import gc
import io

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import torch.nn as nn

import mxfx
from mxfx.runtime import cache
from mxfx.numerics.layout import to_blocked
from mxfx.formats.mxfp8 import FORMAT as MXFP8

D, H, OUT = 64, 96, 32
OPTS = {"inner": "aot_eager"}


class MLP(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.up = nn.Linear(D, H, dtype=dtype)
        self.down = nn.Linear(H, OUT, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


N_WEIGHTS = 2


pytestmark = pytest.mark.usefixtures("fresh_weight_cache")


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return MLP(dtype)


def _x(seed=1, dtype=torch.float32):
    return torch.randn(48, D, generator=torch.Generator().manual_seed(seed), dtype=dtype, requires_grad=True)


def _fresh_output(model, x, options=OPTS):
    """Output of a new model built from ``model``'s current weights (its caches built from scratch)."""
    fresh = MLP(next(model.parameters()).dtype)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        return torch.compile(fresh, backend="mxfp8", options=options)(x)


def _train_microbatches(cm, x, n):
    for _ in range(n):
        cm(x).float().sum().backward()


def _assert_fresh_and_not_stale(cm, model, x, before):
    """The compiled model's output equals a fresh model of the current weights and differs from the old ones.

    Returns the cache counters as they were right after the compiled model's forward.
    """
    with torch.no_grad():
        y = cm(x)
    stats = cache.stats()
    torch.testing.assert_close(y, _fresh_output(model, x), rtol=0, atol=0)
    assert (y - before).abs().max() > 1e-3  # a stale cache would have reproduced ``before``
    return stats


# --- the op ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 96), (3, 64, 96)])
def test_weight_operand_orientations_and_reuse(shape):
    cache.set_dgrad_at_refresh(
        True
    )  # keep every form: reuse across orientations (the default drops them in a backward)
    w = torch.randn(shape)
    q, s = cache.weight_form(w, "rceil", "forward")
    rq, rs = mxfx.quantize(w, axis=-1, rule="rceil")
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs.view(torch.uint8))
    qt, st = cache.weight_form(w, "rceil", "dgrad")
    rqt, rst = mxfx.quantize(w.transpose(-2, -1).contiguous(), axis=-1, rule="rceil")
    assert qt.shape == (*shape[:-2], shape[-1], shape[-2]) and st.shape == (*shape[:-2], shape[-1], shape[-2] // 32)
    assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8)) and torch.equal(st, rst.view(torch.uint8))
    assert cache.stats()["quantize"] == 2
    q2, _ = cache.weight_form(w, "rceil", "forward")
    assert q2 is q and cache.stats()["quantize"] == 2 and cache.stats()["hit"] == 1
    # floor is its own form of the same weight
    cache.weight_form(w, "floor", "forward")
    assert cache.stats()["quantize"] == 3 and cache.num_entries() == 1


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("shape", [(64, 96), (3, 64, 96)])
def test_dgrad_form_layout_follows_the_gemm_path(monkeypatch, shape, native):
    """Emulated GEMMs keep the dgrad forms in the source layout (transpose views of [.., N, K]), as their
    fakes say; a native MX GEMM path keeps them contiguous [.., K, N], a 2D weight's scales in the blocked
    layout. One refresh builds the BF16 forms in the same pass, equal to dequantizing the MX forms."""
    from mxfx import device as mx_device

    if native:  # pretend the GEMMs of this device run natively (the layout choice only; nothing is multiplied)
        monkeypatch.setattr(mx_device, "capability", lambda device: (10, 0))
    w = torch.randn(shape)
    qt, st = cache.weight_form(w, "rceil", "dgrad")
    dq = cache.weight_form(w, "rceil", "dgrad_bf16")[0]
    with FakeTensorMode() as mode:
        fw = mode.from_tensor(w)
        fakes = (
            *torch.ops.mxfx.cached_weight(fw, "rceil", "dgrad"),
            torch.ops.mxfx.cached_weight(fw, "rceil", "dgrad_bf16")[0],
        )
    for got, fake in zip((qt, st, dq), fakes):
        assert got.shape == fake.shape and got.stride() == fake.stride(), (got.stride(), fake.stride())
        assert got.is_contiguous() == native
    rqt, rst = mxfx.quantize(w.transpose(-2, -1).contiguous(), axis=-1, rule="rceil")
    want_st = rst.view(torch.uint8)
    if native and w.dim() == 2:  # a native dense GEMM's weight keeps its scales blocked (blocked_scales)
        want_st = to_blocked(want_st)
    assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8)) and torch.equal(st, want_st)
    assert torch.equal(dq, mxfx.dequantize(rqt, rst, dtype=torch.bfloat16))
    before = cache.stats()["quantize"]
    with torch.no_grad():
        w.add_(1.0)  # a new version: the refresh rebuilds MX and BF16 forms
    q2, _ = cache.weight_form(w, "rceil", "dgrad")
    dq2 = cache.weight_form(w, "rceil", "dgrad_bf16")[0]
    assert cache.stats()["quantize"] == before + 1 and torch.equal(
        dq2, mxfx.dequantize(*mxfx.quantize(w.transpose(-2, -1).contiguous(), rule="rceil"), dtype=torch.bfloat16)
    )
    q, s = cache.weight_form(w, "rceil", "forward")
    with FakeTensorMode() as mode:
        fakes = torch.ops.mxfx.cached_weight(mode.from_tensor(w), "rceil", "forward")
    for got, fake in zip((q, s), fakes):  # forward scales: MN-major where emulated, blocked for a native 2D weight
        assert got.shape == fake.shape and got.stride() == fake.stride(), (
            got.shape,
            fake.shape,
            got.stride(),
            fake.stride(),
        )
    assert s.dim() == (1 if native and w.dim() == 2 else w.dim())


def test_weight_form_errors_for_unknown_forms_and_fp64():
    with pytest.raises(
        ValueError,
        match=r"form='wgrad' is not valid; choose one of \('forward', 'dgrad', 'forward_bf16', "
        r"'dgrad_bf16', 'block_forward', 'block_dgrad', 'bf16_forward', 'bf16_dgrad'\)",
    ):
        cache.weight_form(torch.randn(64, 64), "rceil", "wgrad")
    with pytest.raises(ValueError, match=r"rule='amax' is not valid for 'forward'"):
        cache.weight_form(torch.randn(64, 64), "amax", "forward")
    with pytest.raises(ValueError, match="float64 is not a high-precision float"):
        cache.weight_form(torch.randn(64, 64, dtype=torch.float64), "rceil", "dgrad")


def test_weight_operand_errors():
    with pytest.raises(ValueError, match="form"):
        cache.weight_form(torch.randn(64, 64), "rceil", "wgrad")
    with pytest.raises(ValueError, match="rule"):
        cache.weight_form(torch.randn(64, 64), "ceil", "forward")
    with pytest.raises(ValueError, match="multiples of 32"):
        cache.weight_form(torch.randn(40, 64), "rceil", "forward")
    with pytest.raises(ValueError, match="high-precision"):
        cache.weight_form(torch.zeros(64, 64, dtype=torch.int32), "rceil", "forward")


def test_memory_and_entries_die_with_the_parameter():
    model, x = _model(), _x()
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    _train_microbatches(cm, x, 2)  # a second microbatch keeps the dgrad forms too
    per_weight = {n: cache.persistent_bytes(p) for n, p in model.named_parameters()}
    assert per_weight["up.weight"] == 2 * H * D * 33 // 32 and per_weight["down.weight"] == 2 * OUT * H * 33 // 32
    assert per_weight["up.bias"] == 0
    assert cache.persistent_bytes() == sum(per_weight.values())
    assert cache.num_entries() == N_WEIGHTS
    del model, cm
    torch._dynamo.reset()
    gc.collect()
    assert cache.num_entries() == 0 and cache.persistent_bytes() == 0
    # A new model whose weights may reuse the freed memory never hits the dead entries.
    model2, before = _model(seed=5), cache.stats()["quantize"]
    with torch.no_grad():
        y = torch.compile(model2, backend="mxfp8", options=OPTS)(x)
    assert cache.stats()["quantize"] == before + N_WEIGHTS
    torch.testing.assert_close(y, _fresh_output(model2, x), rtol=0, atol=0)


# --- once per step, accumulation -------------------------------------------------------------


@pytest.mark.parametrize("at_refresh", [False, True], ids=["dgrad_at_first_use", "dgrad_at_refresh"])
def test_one_quantize_per_weight_per_orientation_per_step(at_refresh):
    cache.set_dgrad_at_refresh(at_refresh)
    model, x = _model(), _x()
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    n_micro = 4
    for step in range(3):
        cache.reset_stats()
        _train_microbatches(cm, x, n_micro)
        during = cache.stats()
        opt.step()
        opt.zero_grad()
        after = cache.stats()
        # The step's hook rebuilds the forward form of each weight once, and the dgrad form too, or drops it.
        assert after["quantize_forward"] - during["quantize_forward"] == N_WEIGHTS
        assert after["quantize_dgrad"] - during["quantize_dgrad"] == (N_WEIGHTS if at_refresh else 0)
        assert after["deferred_dgrad"] - during["deferred_dgrad"] == (0 if at_refresh else N_WEIGHTS)
        assert after["refresh_eager"] == N_WEIGHTS
        if step == 0:  # first use: the forward form built once; the dgrad form built for the first microbatch
            # alone, then again and kept by the second (several microbatches seen), read by the other two
            # (the first backward dropped the forward form too: the second forward builds it again)
            assert during["quantize_forward"] == (1 if at_refresh else 2) * N_WEIGHTS
            assert during["quantize_dgrad"] == (1 if at_refresh else 2) * N_WEIGHTS
        elif at_refresh:  # built by the previous step's hook: the microbatches only read them
            assert during["quantize"] == 0 and during["hit"] == 2 * N_WEIGHTS * n_micro
        else:  # forward forms from the hook; dgrad forms built by the first backward, read by the other three
            assert during["quantize_forward"] == 0 and during["quantize_dgrad"] == N_WEIGHTS
            assert during["hit"] == 2 * N_WEIGHTS * n_micro - N_WEIGHTS


@pytest.mark.parametrize("compiled_step", [False, True])
def test_one_microbatch_per_step_keeps_no_dgrad_form(compiled_step):
    """With one microbatch per step the backward builds each dgrad form for its GEMM and does not keep it, and
    drops the forward form: past its backward a weight holds no cache, the refresh rebuilds the forward form,
    each form is still quantized once per step, and training is bit-identical to keeping both forms."""
    runs = {}
    for at_refresh in (False, True):
        cache.clear()
        cache.set_dgrad_at_refresh(at_refresh)
        model, x = _model(), _x()
        cm = torch.compile(model, backend="mxfp8", options=OPTS)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True)
        step = torch.compile(opt.step, backend="mxfp8", options=OPTS) if compiled_step else opt.step
        for i in range(3):
            cache.reset_stats()
            _train_microbatches(cm, x, 1)
            stats = cache.stats()
            assert cache.persistent_bytes() == _mx_bytes(model, 2 if at_refresh else 0)  # the backward dropped them
            assert stats["transient_dgrad"] == (0 if at_refresh else N_WEIGHTS)
            assert stats["quantize_forward"] == (N_WEIGHTS if i == 0 else 0)  # later: built by the refresh
            assert stats["quantize_dgrad"] == (N_WEIGHTS if i == 0 or not at_refresh else 0)
            step()
            opt.zero_grad()
            assert cache.persistent_bytes() == _mx_bytes(model, 2 if at_refresh else 1)
        runs[at_refresh] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(runs[False], runs[True]):
        assert torch.equal(a, b)


def _mx_bytes(model, forms):
    """Persistent bytes of ``forms`` MX forms (33/32 bytes per value each) of every weight of ``model``."""
    return forms * sum(p.numel() for p in model.parameters() if p.dim() == 2) * 33 // 32


@pytest.mark.parametrize("compiled_step", [False, True])
def test_refresh_keeps_forward_forms_and_the_backward_builds_dgrad_forms(compiled_step):
    """After an optimizer step (eager hook or in-graph refresh) a weight holds its forward form only; the
    next backward builds the dgrad form once (a second microbatch reuses it), bit-identical to a dgrad form
    built from scratch, and the training matches building both at the refresh."""
    runs = {}
    for at_refresh in (False, True):
        cache.clear()
        cache.set_dgrad_at_refresh(at_refresh)
        model, x = _model(), _x()
        cm = torch.compile(model, backend="mxfp8", options=OPTS)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True)
        step = torch.compile(opt.step, backend="mxfp8", options=OPTS) if compiled_step else opt.step
        _train_microbatches(cm, x, 2)  # two microbatches: the dgrad forms are kept
        assert cache.persistent_bytes() == _mx_bytes(model, 2)
        for _ in range(2):
            step()
            opt.zero_grad()
            assert cache.persistent_bytes() == _mx_bytes(model, 2 if at_refresh else 1)
            if not at_refresh:
                assert {f for p in model.parameters() for _, f in cache.entry_forms(p)} == {"forward"}
            cache.reset_stats()
            with torch.no_grad():
                cm(x)  # a forward alone builds nothing more
            assert cache.persistent_bytes() == _mx_bytes(model, 2 if at_refresh else 1)
            _train_microbatches(cm, x, 2)
            assert cache.persistent_bytes() == _mx_bytes(model, 2)
            stats = cache.stats()
            assert stats["quantize_forward"] == 0 and stats["stale"] == 0
            assert stats["quantize_dgrad"] == (0 if at_refresh else N_WEIGHTS)  # once per step, 2 microbatches
        for p in (model.up.weight, model.down.weight):
            qt, st = cache.entry_forms(p)[("rceil", "dgrad")]
            rqt, rst = mxfx.quantize(p.detach().transpose(-2, -1).contiguous(), axis=-1, rule="rceil")
            assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8)) and torch.equal(st, rst.view(torch.uint8))
        runs[at_refresh] = [p.detach().clone() for p in model.parameters()] + [
            p.grad.clone() for p in model.parameters()
        ]
    for a, b in zip(runs[False], runs[True]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("keep_dequantized", [False, True])
def test_refresh_drops_dgrad_side_forms_of_every_kind(keep_dequantized):
    """``refresh()`` keeps the forward-side forms (MX, BF16) and drops the dgrad-side ones; their lookup
    rebuilds them from the current weight, equal to the forms of a fresh cache."""
    w = torch.randn(3, 64, 96)
    kinds = ("_bf16",) if keep_dequantized else ("",)
    for o in ("forward", "dgrad", "forward", "dgrad"):  # a second microbatch: every form kept
        MXFP8.weight_operand(w, "rceil", o, keep_dequantized)
    assert {f for _, f in cache.entry_forms(w)} == {"forward" + k for k in kinds} | {"dgrad" + k for k in kinds}
    w.data.mul_(-0.5)
    assert cache.refresh(w) == 1 and cache.stats()["deferred_dgrad"] == 1
    assert {f for _, f in cache.entry_forms(w)} == {"forward" + k for k in kinds}
    assert cache.persistent_bytes(w) == w.numel() * (2 if keep_dequantized else 33 / 32)
    got = {o: MXFP8.weight_operand(w, "rceil", o, keep_dequantized) for o in ("forward", "dgrad")}
    fresh = w.detach().clone()
    for o in ("forward", "dgrad"):
        for a, b in zip(got[o], MXFP8.weight_operand(fresh, "rceil", o, keep_dequantized)):
            assert (a is None and b is None) or torch.equal(a.float(), b.float())  # exact: e4m3/bf16/u8 in fp32


def test_set_dgrad_at_refresh_rejects_non_bool():
    with pytest.raises(TypeError, match="set_dgrad_at_refresh: enabled=1 must be True or False"):
        cache.set_dgrad_at_refresh(1)
    assert cache.dgrad_at_refresh() is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_accumulate_in_parameter_dtype(dtype):
    model, x = _model(dtype=dtype), torch.ones(48, D, dtype=dtype)
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    cm(x).float().sum().backward()
    one = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _train_microbatches(cm, x, 2)
    for n, p in model.named_parameters():
        assert p.grad.dtype == dtype
        torch.testing.assert_close(p.grad, 2 * one[n], rtol=0, atol=0)


# --- refresh paths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9, foreach=True),
        lambda p: torch.optim.Adam(p, lr=0.05, foreach=True),
        lambda p: torch.optim.AdamW(p, lr=0.05, foreach=False),
        lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),  # fused does not bump _version: the hook is the path
    ],
    ids=["sgd", "adam", "adamw_loop", "adamw_fused"],
)
def test_eager_step_hook_refreshes(make_opt):
    model, x = _model(), _x()
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    opt = make_opt(model.parameters())
    _train_microbatches(cm, x, 2)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with torch.no_grad():
        before = cm(x)
    opt.step()
    assert cache.stats()["refresh_eager"] == N_WEIGHTS
    q = cache.stats()["quantize"]
    stats = _assert_fresh_and_not_stale(cm, model, x, before)
    assert stats["quantize"] == q  # the forward read the caches the hook built


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.5, foreach=True),
        lambda p: torch.optim.AdamW(p, lr=0.05, foreach=True),
    ],
    ids=["sgd", "adamw"],
)
def test_compiled_step_refreshes_in_graph_without_the_hook(make_opt):
    model, x = _model(), _x()
    opt = make_opt(model.parameters())
    step = torch.compile(opt.step, backend="mxfp8", options=OPTS)  # compiled before the model has caches
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    _train_microbatches(cm, x, 2)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with torch.no_grad():
        before = cm(x)
    cache.uninstall()
    cache.reset_stats()
    step()
    report = mxfx.last_report()
    assert report.count("weight_refresh", True) == 1
    assert cache.stats()["refresh_graph"] == N_WEIGHTS and cache.stats()["refresh_eager"] == 0
    # Fresh after the step: the forward reads the in-graph caches, no re-quantization...
    stats = _assert_fresh_and_not_stale(cm, model, x, before)
    assert stats["quantize"] == N_WEIGHTS and stats["stale"] == 0  # forward forms; dgrad forms wait for a backward
    # ... and again on the next step (the compiled step is reused).
    _train_microbatches(cm, x, 1)
    with torch.no_grad():
        before = cm(x)
    cache.reset_stats()
    step()
    stats = _assert_fresh_and_not_stale(cm, model, x, before)
    assert stats["refresh_graph"] == N_WEIGHTS and stats["stale"] == 0 and stats["quantize"] == N_WEIGHTS


def test_compiled_step_with_hook_refreshes_once():
    model, x = _model(), _x()
    opt = torch.optim.Adam(model.parameters(), lr=0.05, foreach=True)
    step = torch.compile(opt.step, backend="mxfp8", options=OPTS)
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    _train_microbatches(cm, x, 2)  # two microbatches keep the dgrad forms: the refresh drops them
    cache.reset_stats()
    step()
    assert cache.stats()["refresh_graph"] == N_WEIGHTS and cache.stats()["refresh_eager"] == 0
    assert cache.stats()["quantize"] == N_WEIGHTS and cache.stats()["deferred_dgrad"] == N_WEIGHTS


def test_compiled_step_default_pipeline_updates_parameters():
    """No pass may drop the step's in-place updates (an unconditional dead-code elimination did)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    w = model.up.weight.detach().clone()
    torch.compile(opt.step, backend="mxfp8", options={"inner": "aot_eager"})()
    assert not torch.equal(model.up.weight, w)


@pytest.mark.slow
def test_compiled_step_inductor():
    model, x = _model(), _x()
    opts = {**OPTS, "inner": "inductor"}
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True)
    cm = torch.compile(model, backend="mxfp8", options=opts)
    step = torch.compile(opt.step, backend="mxfp8", options=opts)
    _train_microbatches(cm, x, 2)
    with torch.no_grad():
        before = cm(x)
    cache.uninstall()
    cache.reset_stats()
    step()
    assert cache.stats()["refresh_graph"] == N_WEIGHTS
    with torch.no_grad():
        y = cm(x)
    assert cache.stats()["quantize"] == N_WEIGHTS and cache.stats()["stale"] == 0  # the forward forms, in-graph
    torch.testing.assert_close(y, _fresh_output(model, x, {**OPTS, "inner": "eager"}), rtol=0, atol=0)
    assert (y - before).abs().max() > 1e-3
    # The Inductor backward builds the dgrad forms (in the layout its graph was compiled for).
    x.grad, stats = None, cache.stats()
    cm(x).float().sum().backward()
    assert cache.stats()["quantize_dgrad"] - stats["quantize_dgrad"] == N_WEIGHTS
    assert cache.stats()["stale"] == stats["stale"]
    fresh, x2 = MLP(), x.detach().clone().requires_grad_()
    fresh.load_state_dict(model.state_dict())
    torch.compile(fresh, backend="mxfp8", options={**OPTS, "inner": "eager"})(x2).float().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_load_state_dict_and_manual_edits_are_seen():
    model, x = _model(), _x()
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    with torch.no_grad():
        before = cm(x)
    model.load_state_dict(_model(seed=7).state_dict())
    cache.reset_stats()
    assert _assert_fresh_and_not_stale(cm, model, x, before)["stale"] == N_WEIGHTS
    with torch.no_grad():
        before = cm(x)
        model.up.weight.mul_(-2)  # manual in-place edit
    _assert_fresh_and_not_stale(cm, model, x, before)
    with torch.no_grad():
        before = cm(x)
        model.down.weight.detach()[:, :32].zero_()  # through a view
    _assert_fresh_and_not_stale(cm, model, x, before)


def test_untracked_data_write_needs_refresh():
    """``p.data`` writes bypass the version counter: mxfx.runtime.cache.refresh() rebuilds the caches."""
    model, x = _model(), _x()
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    with torch.no_grad():
        before = cm(x)
    model.up.weight.data.mul_(-1)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), before, rtol=0, atol=0)  # documented limitation
    assert cache.refresh(model.parameters()) == N_WEIGHTS
    _assert_fresh_and_not_stale(cm, model, x, before)
    assert cache.refresh(model) == N_WEIGHTS  # a module stands for its parameters
    with pytest.raises(TypeError, match=r"mxfx.refresh: takes a module, a tensor or an iterable .* got a str"):
        cache.refresh(["up.weight"])


def _flat_model():
    """MLP whose parameters are views of one flat buffer, stepped through that buffer."""
    model = _model()
    params = list(model.parameters())
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
    offset = 0
    for name, p in list(model.named_parameters()):
        mod, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(mod, attr, nn.Parameter(flat.detach()[offset : offset + p.numel()].view_as(p)))
        offset += p.numel()
    return model, flat


def _flat_grad(model, flat):
    flat.grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad()


@pytest.mark.parametrize("hook", [True, False])
def test_flat_buffer_optimizer(hook):
    model, flat = _flat_model()
    x = _x()
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    opt = torch.optim.SGD([flat], lr=0.5, foreach=True)
    _train_microbatches(cm, x, 2)
    _flat_grad(model, flat)
    with torch.no_grad():
        before = cm(x)
    if not hook:
        cache.uninstall()
    opt.step()  # writes the weights through the flat buffer's storage
    assert cache.stats()["refresh_eager"] == (N_WEIGHTS if hook else 0)
    _assert_fresh_and_not_stale(cm, model, x, before)


def test_checkpoint_roundtrip_rebuilds_caches():
    model, x = _model(), _x()
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_microbatches(cm, x, 1)
    opt.step()
    sd = model.state_dict()
    assert set(sd) == {n for n, _ in model.named_parameters()}  # no cache tensors
    assert all(t.dtype == torch.float32 for t in sd.values())
    buf = io.BytesIO()
    torch.save({"model": sd, "opt": opt.state_dict()}, buf)
    assert buf.tell() < 4 * sum(p.numel() for p in model.parameters()) * 3 + 8192  # weights + 2 moments, no caches
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = _model(seed=3)
    cresumed = torch.compile(resumed, backend="mxfp8", options=OPTS)
    with torch.no_grad():
        stale = cresumed(x)  # builds caches from the seed-3 weights
    resumed.load_state_dict(ckpt["model"])
    q = cache.stats()["quantize"]
    with torch.no_grad():
        y, y_ref = cresumed(x), cm(x)
    assert cache.stats()["quantize"] == q + N_WEIGHTS  # rebuilt from the loaded weights (forward orientation)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    assert (y - stale).abs().max() > 1e-3


@pytest.mark.parametrize("compiled_step", [False, True])
def test_params_made_views_of_a_flat_buffer_with_data_assignment(compiled_step):
    """Megatron-style: ``p.data = flat[a:b].view(...)`` (each weight keeps its own version counter, which the
    optimizer's writes to ``flat`` never bump); the step hook, or the compiled step, still refreshes them."""
    model, x = _model(), _x()
    params = list(model.parameters())
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
    offset = 0
    for p in params:
        p.data = flat.detach()[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    opt = torch.optim.AdamW([flat], lr=0.05, foreach=True)
    step = torch.compile(opt.step, backend="mxfp8", options=OPTS) if compiled_step else opt.step
    versions = [p._version for p in params]
    for _ in range(2):
        _train_microbatches(cm, x, 1)
        _flat_grad(model, flat)
        with torch.no_grad():
            before = cm(x)
        step()
        assert [p._version for p in params] == versions  # the weights' own counters never moved
        _assert_fresh_and_not_stale(cm, model, x, before)


@pytest.mark.parametrize("form", ["bf16_forward", "bf16_dgrad"])
def test_a_bf16_weights_cached_form_is_a_copy_not_a_view(form):
    """The cache op declares no aliasing of its input: even a contiguous BF16 weight's BF16 form is its own storage
    (a view would let functionalization treat the weight's later updates as unrelated to the form)."""
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    (out,) = torch.ops.mxfx.cached_weight(w, "rceil", form)
    assert out.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    torch.testing.assert_close(out if form == "bf16_forward" else out.t(), w, rtol=0, atol=0)
