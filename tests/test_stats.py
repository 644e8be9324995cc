"""Quantization statistics (``Policy.stats``, ``mxfx.stats()``): every statistic of both formats against a plain-torch
computation on the same tensors, through the formats, the eager ops and compiled graphs (aot_eager, Inductor);
sampling switched at run time without recompiling; the graph without statistics; warnings, JSONL, TensorBoard,
the report line, the environment variable and the all-to-all payload."""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import mxfx
from mxfx import formats
from mxfx.numerics import block as block_ref
from mxfx.numerics.layout import to_blocked
from mxfx.ops.grouped_mm import mx_grouped_mm_op
from mxfx.ops.linear import mx_linear
from mxfx.kernels.common.silu import silu_fp32
from mxfx.runtime import cache, stats

from helpers import GraphCapture, load_example

pytestmark = pytest.mark.filterwarnings("ignore:mxfx. quantize site")  # the data are made to cross the thresholds

MX, BLOCK = formats.get("mxfp8"), formats.get("fp8_block")
RULES = [(MX, "rceil"), (MX, "floor"), (BLOCK, "rceil"), (BLOCK, "amax")]
IDS = [f"{f.name}-{r}" for f, r in RULES]


@pytest.fixture(autouse=True)
def _fresh_stats():
    stats.reset()
    stats.set_output(None)
    stats.set_sampling(True)
    yield
    stats.reset()
    stats.set_output(None)
    stats.set_sampling(True)


def _data(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Values that reach every statistic: normal values, blocks with one huge value over tiny ones (underflow),
    amaxes just under a power of two (floor clips them), an all-zero row (a zero block) and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[1] = 2.0**-10 * torch.randn(cols, generator=g)
    x[1, ::32] = 2.0**20  # one huge value per 32 and per 128: the rest flush to zero
    x[2] *= 1e-3
    x[2, ::32] = 1.96 * 2.0**3  # floor's scale leaves 1.96 * 2^8 > 448: clipped
    x[3] = 0.0  # all-zero blocks: no scale exponent
    x[4, ::3] = 0.0
    return x


def _decoded(x: torch.Tensor, fmt, rule: str, layout: str):
    """``(values, qdata as float32, dequantized, scale exponents of the nonzero blocks)`` of quantizing ``x`` in
    ``layout``, the values laid out as the operand."""
    x = x.detach().float()
    if layout == "tokens":
        x = F.pad(x, (0, 0, 0, (-x.shape[0]) % 32)).t() if fmt is MX else x.t()
    if fmt is MX:
        q, s = mxfx.quantize(x, -1, rule)
        e = s.view(torch.uint8).int() - 127
        dq = q.float() * torch.exp2(e.float()).repeat_interleave(32, -1)
        amax = x.abs().reshape(*x.shape[:-1], -1, 32).amax(-1)
    elif layout == "weight":
        q, s = block_ref.quantize_128x128(x, rule)
        dq = q.float() * s.repeat_interleave(128, -2).repeat_interleave(128, -1)[: x.shape[0], : x.shape[1]]
        amax = (
            F.pad(x.abs(), (0, (-x.shape[1]) % 128, 0, (-x.shape[0]) % 128))
            .reshape(s.shape[0], 128, s.shape[1], 128)
            .amax(dim=(1, 3))
        )
        e = torch.floor(torch.log2(s)).int()
    else:
        q, s = block_ref.quantize_1x128(x, -1, rule)
        dq = q.float() * s.repeat_interleave(128, -1)[:, : x.shape[1]]
        amax = F.pad(x.abs(), (0, (-x.shape[1]) % 128)).reshape(x.shape[0], -1, 128).amax(-1)
        e = torch.floor(torch.log2(s)).int()
    return x, q.float(), dq, e[amax > 0].tolist()


def _summary(x: torch.Tensor, q: torch.Tensor, dq: torch.Tensor, exps: list[int]) -> dict:
    sat = q.abs() == 448
    nonzero = x != 0
    return {
        "values": x.numel(),
        "nonzero": int(nonzero.sum()),
        "underflow_count": int((nonzero & (dq == 0)).sum()),
        "saturated_count": int(sat.sum()),
        "clipped_count": int((sat & (x.abs() > dq.abs())).sum()),
        "rms_error": math.sqrt(float(((dq.double() - x.double()) ** 2).sum() / (x.double() ** 2).sum())),
        "amax": float(x.abs().max()),
        "scale_exp_min": min(exps),
        "scale_exp_max": max(exps),
        "scale_exp_hist": {str(k): v for k, v in Counter(exps).items()},
    }


def _reference(x: torch.Tensor, fmt, rule: str, layout: str) -> dict:
    """The statistics of quantizing ``x`` in ``layout`` computed here in plain torch: the reference quantize of
    mxfx.numerics (the bytes the kernels write), decoded by hand."""
    return _summary(*_decoded(x, fmt, rule, layout))


def _grouped_tokens_reference(x: torch.Tensor, offs: list[int], fmt, rule: str) -> dict:
    """The statistics of a grouped wgrad operand of ``x [S, K]``: each expert group's rows quantized alone along its
    tokens (MXFP8 zero-padded to 32 rows, fp8_block in 1x128 tiles from the group start); the padding rows and the
    rows past the last group end counted nowhere."""
    parts, start = [], 0
    for end in offs:
        if end > start:
            values, q, dq, exps = _decoded(x[start:end], fmt, rule, "tokens")  # [K, tokens (padded)]
            parts.append((values[:, : end - start], q[:, : end - start], dq[:, : end - start], exps))
        start = end
    return _summary(*(torch.cat([p[i] for p in parts], 1) for i in range(3)), [e for p in parts for e in p[3]])


def _check(sample: dict, ref: dict) -> None:
    for key in (
        "values",
        "nonzero",
        "underflow_count",
        "saturated_count",
        "clipped_count",
        "amax",
        "scale_exp_min",
        "scale_exp_max",
        "scale_exp_hist",
    ):
        assert sample[key] == ref[key], (key, sample[key], ref[key])
    assert sample["nonfinite"] == 0
    assert sample["rms_error"] == pytest.approx(ref["rms_error"], rel=1e-6)
    assert sample["underflow"] == ref["underflow_count"] / ref["nonzero"]
    assert sample["saturation"] == ref["saturated_count"] / ref["values"]


def _sample(fmt, rule, layout, source, operand, combine="") -> dict:
    vector = stats.reduce_parts(fmt.quant_stats(source, combine, operand, rule, layout))
    return stats._sample(vector.tolist(), "s", fmt.name, rule, 0)


@pytest.mark.parametrize("fmt,rule", RULES, ids=IDS)
def test_every_statistic_of_every_operand_matches_plain_torch(fmt, rule):
    """Each layout and each way a format makes an operand (plain, fused SwiGLU, the one-read dual of forward and
    dgrad, values only where the GEMM is emulated, blocked scales of a native GEMM, the weight cache's forms)."""
    x, w = _data(48, 256), _data(128, 256, seed=1) * 0.05
    up = torch.randn(48, 256, generator=torch.Generator().manual_seed(2))
    h = silu_fp32(x) * up  # the fp32 product the fused SwiGLU quantizes read (mxfx's SiLU)
    cases = [
        ("rows", (x,), "", fmt.input_operand(x, None, rule, "mm"), x),
        ("rows", (x, up), "swiglu", fmt.input_operand(x, up, rule, "mm"), h),
        ("tokens", (x,), "", fmt.tokens_operand(x, rule), x),
        ("weight", (w,), "", fmt.weight_operand(w, rule, "forward"), w),
    ]
    a, x_tokens, _ = fmt.forward_operands(x, None, rule, "mxfp8", tokens=True)
    rows, tokens = fmt.grad_operands(x, rule, rows=True, tokens=True)  # on CPU: MXFP8's values only
    cases += [
        ("rows", (x,), "", a, x),
        ("tokens", (x,), "", x_tokens, x),
        ("rows", (x,), "", rows, x),
        ("tokens", (x,), "", tokens, x),
    ]
    if fmt is MX:
        q, s, _ = fmt.input_operand(x, None, rule, "mm")
        cases += [
            ("rows", (x,), "", (q, to_blocked(s), None), x),  # a native dense GEMM's scale layout
            ("weight", (w,), "", fmt.weight_operand(w, rule, "forward", keep_dequantized=True), w),
        ]
        assert rows[0] is None and rows[2] is not None  # the values-only path is among the cases
    for layout, source, combine, operand, values in cases:
        _check(_sample(fmt, rule, layout, source, operand, combine), _reference(values, fmt, rule, layout))
    ref = _reference(x, fmt, rule, "rows")  # the data reach every statistic
    assert ref["underflow_count"] > 0 and ref["saturated_count"] > 0 and len(ref["scale_exp_hist"]) > 3
    assert ref["clipped_count"] > 0 if rule == "floor" else rule == "amax" or ref["clipped_count"] == 0  # rceil: none


def test_nonfinite_values_are_counted_apart():
    x = _data(8, 64)
    x[0, 5] = float("inf")
    got = _sample(MX, "rceil", "rows", (x,), MX.input_operand(x, None, "rceil", "mm"))
    assert got["nonfinite"] == 32 and got["values"] == x.numel() - 32  # the inf's block dequantizes to NaN
    zeroed = x.clone()
    zeroed[0, :32] = 0.0  # the same statistics as a block that counts nowhere
    ref = _reference(zeroed, MX, "rceil", "rows")
    for key in ("nonzero", "underflow_count", "saturated_count", "amax"):
        assert got[key] == ref[key], key
    assert got["rms_error"] == pytest.approx(ref["rms_error"], rel=1e-6)


class _Lin(torch.nn.Module):
    def __init__(self, fmt):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(256, 128, bias=False)
        self.fmt = fmt

    def forward(self, x):
        return self.proj(x)


def _run_linear(mode: str, fmt, rule: str):
    """One forward/backward of a 256->128 linear in ``mode`` with statistics every step; returns its tensors."""
    model = _Lin(fmt)
    x = _data(48, 256).requires_grad_(True)
    dy = _data(48, 128, seed=3)
    if mode == "eager":
        y = mx_linear(x, model.proj.weight, format=fmt, scale_rule=rule, stats="proj", stats_every=1)
    else:
        policy = {"inner": mode, "format": fmt.name, "scale_rule": rule, "stats": {"every": 1}}
        y = torch.compile(model, backend="mxfp8", options=policy)(x)
    y.backward(dy)
    return x, model.proj.weight, dy


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("fmt,rule", [RULES[1], RULES[3]], ids=[IDS[1], IDS[3]])
@pytest.mark.slow
def test_linear_sites_eager_and_compiled(mode, fmt, rule):
    x, w, dy = _run_linear(mode, fmt, rule)
    table = mxfx.stats()
    expected = {
        "forward_x": (x, "rows"),
        "forward_w": (w, "weight"),
        "dgrad_dy": (dy, "rows"),
        "wgrad_x": (x, "tokens"),
        "wgrad_dy": (dy, "tokens"),
    }
    assert sorted(r.site for r in table.rows) == sorted(f"proj/linear/{d}" for d in expected)
    for direction, (t, layout) in expected.items():
        row = table.row(f"proj/linear/{direction}")
        assert (row.format, row.scale_rule, row.samples) == (fmt.name, rule, 1)
        _check(row.last, _reference(t, fmt, rule, layout))
    assert "proj/linear/forward_x" in str(table)


@pytest.mark.parametrize("fmt,rule", [RULES[0], RULES[2]], ids=[IDS[0], IDS[2]])
def test_token_sites_under_dynamic_shapes_read_the_static_operand(fmt, rule):
    """Under dynamic shapes a linear's token-blocked wgrad operands carry more zero tokens than a static count's
    (each format's ``token_rows``: at least two blocks or tiles); their statistics are those of the static operand
    (24 tokens: one MX block short of the symbolic count's 64, one 128-token tile short of 256)."""
    torch._dynamo.reset()
    model = _Lin(fmt)
    x = _data(24, 256).requires_grad_(True)
    dy = _data(24, 128, seed=3)
    policy = {"inner": "aot_eager", "format": fmt.name, "scale_rule": rule, "stats": {"every": 1}}
    torch.compile(model, backend="mxfp8", options=policy, dynamic=True)(x).backward(dy)
    table = mxfx.stats()
    for direction, t in (("wgrad_x", x), ("wgrad_dy", dy)):
        _check(table.row(f"proj/linear/{direction}").last, _reference(t, fmt, rule, "tokens"))


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(0.05 * _data(2 * 128, 256, seed=4).reshape(2, 128, 256))

    def forward(self, x, offs):
        return torch._grouped_mm(x.to(torch.bfloat16), self.w.to(torch.bfloat16).transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("fmt,rule", [RULES[0], RULES[2]], ids=[IDS[0], IDS[2]])
def test_grouped_sites_compiled(fmt, rule):
    model, x = _Experts(), _data(48, 256).requires_grad_(True)
    offs = torch.tensor([20, 48], dtype=torch.int32)
    policy = {"inner": "aot_eager", "format": fmt.name, "scale_rule": rule, "stats": {"every": 1, "modules": "*"}}
    y = torch.compile(model, backend="mxfp8", options=policy)(x, offs)
    dy = _data(48, 128, seed=5).to(torch.bfloat16)
    y.backward(dy)
    table = mxfx.stats()
    site = "<root>/grouped_mm/"
    assert sorted(r.site for r in table.rows) == [site + d for d in ("dgrad_dy", "forward_w", "forward_x")]
    _check(table.row(site + "forward_x").last, _reference(x, fmt, rule, "rows"))
    _check(table.row(site + "dgrad_dy").last, _reference(dy, fmt, rule, "rows"))
    # the blocks of each expert [128, 256] (rows of 32 along K, or 128x128) are those of the experts stacked
    _check(table.row(site + "forward_w").last, _reference(model.w.reshape(256, 256), fmt, rule, "weight"))


def test_grouped_eager_swiglu_and_route_weights():
    """The fused SwiGLU input and the dgrad's dY times the route weights."""
    g, up = _data(48, 256), torch.randn(48, 256)
    w = 0.05 * torch.randn(2, 128, 256, requires_grad=True)
    rw, offs = torch.rand(48), torch.tensor([20, 48], dtype=torch.int32)
    y = mx_grouped_mm_op(g, w, offs, up=up.requires_grad_(True), route_weight=rw, stats="e", stats_every=1)
    dout = _data(48, 128, seed=6)
    y.backward(dout)
    table = mxfx.stats()
    _check(table.row("e/grouped_mm/forward_x").last, _reference(silu_fp32(g) * up, MX, "rceil", "rows"))
    _check(table.row("e/grouped_mm/dgrad_dy").last, _reference(dout * rw[:, None], MX, "rceil", "rows"))


@pytest.mark.parametrize("swiglu", [False, True], ids=["x", "swiglu"])
@pytest.mark.parametrize("fmt,rule", RULES, ids=IDS)
def test_grouped_wgrad_operand_sites(fmt, rule, swiglu):
    """``wgrad="mxfp8"`` on routed experts: x's and dY's wgrad operands, blocked along each expert group's tokens,
    against the per-group reference, over groups that are not whole blocks, an empty group, a group of two 1x128
    tiles and rows past the last group end; the rows mxfx pads a group with count nowhere."""
    offs = [40, 40, 230, 280]  # 300 rows: 20 past the last group end
    x, dout = _data(300, 256), _data(300, 128, seed=5)
    x[100:104] = x[1:5]  # blocks that underflow and clip in a second group too
    up = torch.randn(300, 256, generator=torch.Generator().manual_seed(2)).requires_grad_(True) if swiglu else None
    w = (0.05 * torch.randn(4, 128, 256)).requires_grad_(True)
    rw = torch.rand(300)
    y = mx_grouped_mm_op(
        x.requires_grad_(True),
        w,
        torch.tensor(offs, dtype=torch.int32),
        up=up,
        route_weight=rw,
        format=fmt.name,
        scale_rule=rule,
        wgrad="mxfp8",
        stats="e",
        stats_every=1,
    )
    y.backward(dout)
    table = mxfx.stats()
    assert sorted(r.site for r in table.rows) == [
        f"e/grouped_mm/{d}" for d in ("dgrad_dy", "forward_w", "forward_x", "wgrad_dy", "wgrad_x")
    ]
    h = x if up is None else silu_fp32(x) * up.detach()
    dy = dout * rw[:, None]
    for direction, values in (("wgrad_x", h), ("wgrad_dy", dy)):
        row = table.row(f"e/grouped_mm/{direction}")
        assert (row.format, row.scale_rule, row.samples) == (fmt.name, rule, 1)
        assert row.last["values"] == 280 * values.shape[1]  # no padding row, no row past the last group end
        _check(row.last, _grouped_tokens_reference(values, offs, fmt, rule))
    _check(table.row("e/grouped_mm/forward_x").last, _reference(h, fmt, rule, "rows"))


@pytest.mark.parametrize("fmt,rule", [RULES[0], RULES[3]], ids=[IDS[0], IDS[3]])
def test_grouped_input_quantized_before_the_gather_is_observed_as_without_it(fmt, rule):
    """The dispatch pass quantizes the tokens before the local dispatch's row gather (``x[idx]``, each token twice);
    the grouped GEMM's ``forward_x`` is still observed, against the gathered BF16 rows, with the statistics it has
    with the pass off (quantize(x)[idx] is quantize(x[idx]) bit for bit)."""
    x0 = _data(32, 256).bfloat16()
    w0 = (0.05 * _data(2 * 128, 256, seed=4)).reshape(2, 128, 256).bfloat16()
    idx = torch.arange(64) // 2
    offs = torch.tensor([24, 64], dtype=torch.int32)

    def f(x, w):
        return torch._grouped_mm(x[idx], w.transpose(-2, -1), offs=offs)

    samples = []
    for passes in ({}, {"dispatch_mx": False}):
        stats.reset()
        torch._dynamo.reset()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        policy = {"inner": "aot_eager", "format": fmt.name, "scale_rule": rule, "passes": passes, "stats": {"every": 1}}
        torch.compile(f, backend="mxfp8", options=policy)(x, w).float().square().sum().backward()
        hoisted = [r for r in mxfx.last_report().records if "before the dispatch's row gather" in r.reason]
        assert len(hoisted) == (0 if passes else 1), mxfx.last_report().to_text()
        samples.append({r.site: r.last for r in mxfx.stats().rows})
    with_hoist, without = samples
    assert sorted(with_hoist) == sorted(without) and "<root>/grouped_mm/forward_x" in with_hoist, sorted(with_hoist)
    for site, sample in without.items():
        assert with_hoist[site] == {**sample, "rms_error": pytest.approx(sample["rms_error"], rel=1e-12)}, site
    _check(with_hoist["<root>/grouped_mm/forward_x"], _reference(x0[idx], fmt, rule, "rows"))


def test_grouped_input_given_as_a_pair_says_where_it_comes_from():
    """``x_mx_from="gather"``: x's own quantization, observed against x as if made here; ``"all_to_all"``: x is a
    received pair's dequantization, whose payload the all-to-all observes, so the op does not."""
    x, w = _data(64, 256), 0.05 * torch.randn(2, 128, 256)
    offs = torch.tensor([30, 64], dtype=torch.int32)
    pair = mxfx.quantize(x)
    pair = (pair[0], pair[1].view(torch.uint8))
    for origin in ("gather", "all_to_all"):
        stats.reset()
        mx_grouped_mm_op(x, w, offs, x_mx=pair, x_mx_from=origin, stats=origin, stats_every=1)
        sites = sorted(r.site for r in mxfx.stats().rows)
        if origin == "gather":
            assert sites == ["gather/grouped_mm/forward_w", "gather/grouped_mm/forward_x"]
            _check(mxfx.stats().row("gather/grouped_mm/forward_x").last, _reference(x, MX, "rceil", "rows"))
        else:
            assert sites == ["all_to_all/grouped_mm/forward_w"]
    for kwargs in ({"x_mx": pair}, {"x_mx_from": "gather"}, {"x_mx": pair, "x_mx_from": "received"}):
        with pytest.raises(ValueError, match=r"mxfx.grouped_mm: x_mx_from=.*'gather'.*'all_to_all'"):
            mx_grouped_mm_op(x, w, offs, **kwargs)


def test_observe_takes_group_ends_with_group_tokens_only():
    x = torch.randn(64, 64)
    operand = MX.grouped_tokens_operand(x, torch.tensor([64], dtype=torch.int32), "rceil")
    for layout, offs in (("group_tokens", None), ("rows", torch.tensor([64], dtype=torch.int32))):
        with pytest.raises(ValueError, match=rf"observe\('s'\): layout='{layout}' with offs=.*group ends"):
            stats.observe("s", "mxfp8", "rceil", layout, (x,), operand, 1, offs=offs)


def test_sampling_follows_the_step_count_without_recompiling():
    model = _Lin(MX)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager", "stats": {"every": 2}})
    sampled, graphs, recompiles = [], [], []
    for i in range(5):
        if i == 4:
            stats.set_sampling(False)  # switched off at run time: the graph's op stays, its body does nothing
        was = sum(r.samples for r in mxfx.stats().rows)
        step = cache.step_count()
        compiled(torch.randn(32, 256, requires_grad=True)).sum().backward()
        opt.step()
        opt.zero_grad()
        sampled.append((step % 2 == 0 and i < 4, sum(r.samples for r in mxfx.stats().rows) - was))
        graphs.append(counters["stats"]["unique_graphs"])
        recompiles.append(sum(counters["recompiles"].values()))
    assert all((n == 5) if want else (n == 0) for want, n in sampled), sampled  # 5 sites per sampled step
    assert sum(want for want, _ in sampled) == 2
    assert len(set(graphs)) == 1 and len(set(recompiles)) == 1, (graphs, recompiles)
    steps = {r.last["step"] for r in mxfx.stats().rows}
    assert all(s % 2 == 0 for s in steps)


def test_eager_ops_sample_once_per_sampled_step():
    """Outside the backend too: the optimizer steps advance the step count, and a site samples once per sampled step
    (the first microbatch of a step that accumulates two)."""
    w = torch.nn.Parameter(0.05 * torch.randn(128, 256))
    opt = torch.optim.SGD([w], lr=1e-3)
    every = 2
    expected, got = [], []
    for _ in range(4):
        step = cache.step_count()
        for _ in range(2):  # two microbatches
            mx_linear(torch.randn(32, 256), w, stats="m", stats_every=every).sum().backward()
        opt.step()
        opt.zero_grad()
        expected.append(1 if step % every == 0 else 0)
        got.append(mxfx.stats().row("m/linear/forward_w").samples if mxfx.stats().rows else 0)
    assert [b - a for a, b in zip([0, *got], got)] == expected and sum(expected) == 2, (expected, got)


def test_stats_off_leaves_the_graph_as_it_was(tmp_path):
    """Without ``stats`` (or with a glob that matches nothing) the rewritten graph and the ATen graphs are the same,
    with no statistics op; with it, every site is an op of the forward or backward graph."""
    torch._dynamo.utils.counters.clear()
    code, ops = {}, {}
    for name, extra in (
        ("off", {}),
        ("unmatched", {"stats": {"modules": "nothing.*"}}),
        ("on", {"stats": {"every": 3}}),
    ):
        torch._dynamo.reset()
        capture = GraphCapture()
        model = _Lin(MX)
        opts = {"inner": capture, "dump_dir": str(tmp_path / name), **extra}
        torch.compile(model, backend="mxfp8", options=opts)(torch.randn(32, 256, requires_grad=True)).sum().backward()
        code[name] = (
            next((tmp_path / name).glob("graph_*/after.py")).read_text(),
            [g.code for g in capture.forward + capture.backward],
        )
        ops[name] = sum(
            str(n.args).count("quant_stats") for g in capture.forward + capture.backward for n in g.graph.nodes
        )
    assert code["off"] == code["unmatched"]
    assert "stats = " not in code["off"][0] and ops["off"] == 0
    assert "stats = 'proj', stats_every = 3" in code["on"][0]
    assert ops["on"] == 5


def test_warns_once_per_site_and_statistic():
    x, w = _data(48, 256), 0.05 * torch.randn(128, 256)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            mx_linear(x, w, scale_rule="floor", stats="p", stats_every=1)
            mxfx.stats()
    messages = [str(c.message) for c in caught if "quantize site" in str(c.message)]
    underflow = _reference(x, MX, "floor", "rows")
    assert len(messages) == 2, messages  # forward_x: underflow and clipped, once each
    assert any(
        "p/linear/forward_x" in m and f"underflow {underflow['underflow_count'] / underflow['nonzero']:.2%}" in m
        for m in messages
    )
    assert any("clipped" in m for m in messages)


def test_jsonl_tensorboard_and_report_line(tmp_path, monkeypatch):
    scalars = []

    class Writer:
        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(stats, "_tensorboard_writer", lambda log_dir: Writer())
    model = _Lin(MX)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    policy = mxfx.Policy(inner="aot_eager", dump_dir=str(tmp_path), stats={"every": 1, "modules": "proj"})
    compiled = torch.compile(model, backend="mxfp8", options=policy)
    x = _data(32, 256).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(x).sum().backward()
        opt.step()  # the step post-hook reads the samples back and writes them
    lines = [json.loads(line) for line in (tmp_path / stats.JSONL).read_text().splitlines()]
    assert sorted(s["site"] for s in lines) == sorted(r.site for r in mxfx.stats().rows) and len(lines) == 5
    assert all(s == mxfx.stats().row(s["site"]).last for s in lines)
    fx = mxfx.stats().row("proj/linear/forward_x").last
    assert fx["underflow"] > 0.01
    assert ("mxfx_stats/proj/linear/forward_x/underflow", fx["underflow"], fx["step"]) in scalars
    report = str(mxfx.last_report())
    assert "# quantization stats" in report and "proj/linear/forward_x" in report and "underflow > 1%" in report


def test_policy_field_and_environment_variable(monkeypatch):
    assert mxfx.Policy().stats is None
    assert dict(mxfx.Policy(stats={"modules": "layers.*"}).stats) == {"every": 100, "modules": "layers.*"}
    monkeypatch.setenv("MXFX_STATS", "every=7,modules=layers.*.mlp.*")
    policy = mxfx.Policy()
    assert dict(policy.stats) == {"every": 7, "modules": "layers.*.mlp.*"}
    d = policy.decide("linear", "model.layers.0.mlp.up")
    assert (d.settings.stats, d.settings.stats_every) == ("model.layers.0.mlp.up", 7)
    assert (
        policy.decide("linear", "model.layers.0.attn.q").settings.graph_kwargs()
        == mxfx.Policy(stats=None).decide("linear", "x").settings.graph_kwargs()
    )
    assert policy.decide("linear", "model.layers.0.mlp.up", macs=1, gemm=None).stats
    monkeypatch.setenv("MXFX_STATS", "on")
    assert dict(mxfx.Policy().stats) == {"every": 100, "modules": "*"}
    for bad, match in (
        ({"every": 0}, r"stats\['every'\]=0 must be an int >= 1"),
        ({"often": 1}, r"unknown stats key\(s\) \['often'\]"),
        ({"modules": 3}, "module glob"),
        ({"modules": "  "}, r"stats\['modules'\]='  ' must be a module glob"),  # blank: would match no module
    ):
        with pytest.raises(ValueError, match=match):
            mxfx.Policy(stats=bad)
    monkeypatch.setenv("MXFX_STATS", "every")
    with pytest.raises(ValueError, match="MXFX_STATS='every'.*not key=value"):
        mxfx.Policy()
    with pytest.raises(ValueError, match="stats_every=0 must be an int >= 1"):
        mx_linear(torch.randn(4, 32), torch.randn(32, 32), stats="p", stats_every=0)


def test_environment_variable_off_and_its_errors_name_it(monkeypatch):
    for off in ("0", "off", "OFF", "false", "none"):
        monkeypatch.setenv("MXFX_STATS", off)
        assert mxfx.Policy().stats is None, off
    for bad, match in (
        ("every=0", r"MXFX_STATS='every=0': stats\['every'\]=0 must be an int >= 1"),
        ("often=3", r"MXFX_STATS='often=3': unknown stats key\(s\) \['often'\]"),
        ("every=x", r"MXFX_STATS='every=x': every='x' is not an integer"),
    ):
        monkeypatch.setenv("MXFX_STATS", bad)
        with pytest.raises(ValueError, match=match) as e:
            mxfx.Policy()
        assert "write MXFX_STATS='every=100,modules=layers.*'" in str(e.value) and "MXFX_STATS=0 (or off)" in str(
            e.value
        )


def test_environment_variable_with_a_repeated_key_is_refused(monkeypatch):
    for text, key in (("every=1,every=2", "every"), ("modules=a.*, every=3, modules=b.*", "modules")):
        monkeypatch.setenv("MXFX_STATS", text)
        with pytest.raises(ValueError, match=f"^mxfx policy: MXFX_STATS={text!r}: {key} is given twice") as e:
            mxfx.Policy()
        assert "write MXFX_STATS='every=100,modules=layers.*'" in str(e.value)


def test_an_explicit_stats_argument_wins_over_the_environment_variable(monkeypatch, tmp_path):
    """As with MXFX_POLICY (read only when the compile gives no options): a policy that sets ``stats``, None
    included, keeps it; the variable fills in the ``stats`` of a policy that leaves the field out."""
    from mxfx.policy import Policy

    monkeypatch.setenv("MXFX_STATS", "every=7")
    monkeypatch.delenv("MXFX_POLICY", raising=False)
    assert Policy(stats=None).stats is None
    assert Policy.from_options({"stats": None}).stats is None
    assert dict(Policy(stats={"every": 3}).stats) == {"every": 3, "modules": "*"}
    for policy in (
        Policy(),
        Policy.from_options({}),
        Policy.from_options(None),
        Policy(rules=[{"op": "linear", "wgrad": "bf16"}]),
    ):
        assert dict(policy.stats) == {"every": 7, "modules": "*"}
    toml = tmp_path / "policy.toml"
    toml.write_text('format = "mxfp8"\n')
    monkeypatch.setenv("MXFX_POLICY", str(toml))
    assert dict(Policy.from_options(None).stats) == {"every": 7, "modules": "*"}  # the file sets no stats
    import dataclasses

    assert dataclasses.replace(Policy(stats=None), min_size=5).stats is None  # a copy keeps what it was given
    monkeypatch.delenv("MXFX_STATS")
    assert Policy.from_options({}).stats is None


def test_a_modules_glob_matching_no_site_warns_once_and_stats_says_why(monkeypatch):
    monkeypatch.setattr(stats, "state", stats._State())  # no graph compiled with statistics yet
    assert "statistics are off" in str(mxfx.stats())
    opts = {"inner": "aot_eager", "stats": {"modules": "layers.*", "every": 1}}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):  # the same policy compiled again: judged once
            torch._dynamo.reset()
            torch.compile(_Lin(MX), backend="mxfp8", options=opts)(torch.randn(32, 256)).sum().backward()
    (message,) = [str(w.message) for w in record if "stats modules" in str(w.message)]
    assert message.startswith(
        "mxfx: policy stats modules='layers.*' matches no quantize site of the graphs compiled "
        "under this policy, so no statistics are sampled; the modules with quantize sites "
        "(converted ops) are 'proj'"
    ), message
    table = mxfx.stats()
    assert not table.rows and "matches no quantize site of the graphs compiled with it: modules='layers.*'" in str(
        table
    )
    stats.set_sampling(False)  # a glob that matches, sampling switched off: that is what stats() says
    torch._dynamo.reset()
    torch.compile(_Lin(MX), backend="mxfp8", options={**opts, "stats": {"modules": "proj"}})(torch.randn(32, 256))
    assert "sampling is switched off" in str(mxfx.stats())


def test_all_to_all_payload_sites():
    """Both directions of each transport: the combine's (route-weighted backward), the dispatch's (forward pair
    handed on to a grouped GEMM, ``return_mx``) and a plain one's."""
    import torch.distributed as dist

    from mxfx.ops.all_to_all import mx_all_to_all

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        x, rw, dy = _data(8, 64).requires_grad_(True), torch.rand(8), _data(8, 64, seed=7)
        y = mx_all_to_all(x, [8], [8], dist.group.WORLD, route_weight=rw, stats="moe/all_to_all/combine", stats_every=1)
        y.backward(dy)
        rows, _, _ = mx_all_to_all(
            x, [8], [8], dist.group.WORLD, return_mx=True, stats="moe/all_to_all/dispatch", stats_every=1
        )
        rows.backward(2 * dy)
        mx_all_to_all(x, [8], [8], dist.group.WORLD, stats="plain", stats_every=1).backward(3 * dy)
    finally:
        dist.destroy_process_group()
    table = mxfx.stats()
    assert len(table.rows) == 6
    _check(table.row("moe/all_to_all/combine_fwd").last, _reference(x, MX, "rceil", "rows"))
    _check(table.row("moe/all_to_all/combine_bwd").last, _reference(dy * rw[:, None], MX, "rceil", "rows"))
    for prefix, grad in (("moe/all_to_all/dispatch", 2 * dy), ("plain", 3 * dy)):
        _check(table.row(f"{prefix}_fwd").last, _reference(x, MX, "rceil", "rows"))
        _check(table.row(f"{prefix}_bwd").last, _reference(grad, MX, "rceil", "rows"))


def test_expert_parallel_layer_sites():
    """An expert-parallel MoE layer compiled (one rank): the four payload sites; the gate_up GEMM fed by the
    dispatch's received pair has no ``forward_x`` (its payload is ``dispatch_fwd``); with ``wgrad="mxfp8"`` both
    grouped GEMMs observe their per-group wgrad operands."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch._dynamo.reset()
        layer = load_example("ep_moe").GroupedEPMoE(64, 2, 2, 64, group=dist.group.WORLD, seed=5)
        x = torch.randn(48, 64, generator=torch.Generator().manual_seed(6)).bfloat16().requires_grad_(True)
        policy = {"inner": "aot_eager", "wgrad": "mxfp8", "stats": {"every": 1}}
        with torch._dynamo.config.patch(capture_scalar_outputs=True):  # the split sizes read from the counts
            torch.compile(layer, backend="mxfp8", options=policy)(x).float().square().sum().backward()
    finally:
        dist.destroy_process_group()
    fed = [r for r in mxfx.last_report().records if "input taken as MX from the dispatch all-to-all" in r.reason]
    assert len(fed) == 1, mxfx.last_report().to_text()
    assert sorted(r.site for r in mxfx.stats().rows) == sorted(
        [f"<root>/all_to_all/{role}_{d}" for role in ("dispatch", "combine") for d in ("fwd", "bwd")]
        + [f"<root>/grouped_mm/{d}" for d in ("forward_w", "dgrad_dy", "wgrad_x", "wgrad_dy")]
        + [f"<root>#1/grouped_mm/{d}" for d in ("forward_x", "forward_w", "dgrad_dy", "wgrad_x", "wgrad_dy")]
    )
