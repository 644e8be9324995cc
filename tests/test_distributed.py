"""Distributed tests on CPU (gloo): MXFP8 expert-parallel all-to-all, and DDP under ``backend="mxfp8"``.

The worker cases (``TWO_RANKS``, ``FOUR_RANKS``) run in one launch of 2 (4) Python processes shared
with the other distributed test files (``two_ranks`` and ``four_ranks`` in tests/conftest.py:
``python tests/test_distributed.py CASE,CASE,... RANK WORLD PORTS``, :func:`tests.helpers.run_worker`),
one case after the other, with a time limit; each test reads the line its case prints on success and
shows the output otherwise. A worker case asserts; a failure prints ``CASE <name> FAILED``. Bytes are
counted at the process group: the workers run a gloo group wrapped in a Python ``ProcessGroup`` that
records every tensor handed to the all-to-all (tests/counting_pg.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import load_example, run_worker

TWO_RANKS = ["ep", "ddp", "dispatch_mx", "combine_rw"]
FOUR_RANKS = ["ep"]


# --------------------------------------------------------------------------- tests


def _ep_ok(log: str, world: int) -> None:
    """Outputs/grads equal the single-process reference with the same MX rounding; one graph;
    bytes = 33/32 per value."""
    assert sum(line.startswith("EP OK") for line in log.splitlines()) == world, log


def test_ep_all_to_all_mxfp8_matches_single_process_2_ranks(two_ranks):
    _ep_ok(two_ranks, 2)


def test_ep_all_to_all_mxfp8_matches_single_process_4_ranks(four_ranks):
    _ep_ok(four_ranks, 4)


def test_ddp_compiled_mxfp8_matches_single_process(two_ranks):
    """DDP (graph split at bucket boundaries) + backend="mxfp8" trains like one process on the global batch."""
    assert two_ranks.count("DDP OK") == 2, two_ranks


def test_dispatched_mx_rows_feed_grouped_gemm_without_requantizing(two_ranks):
    """Received MX pairs go straight into the grouped GEMM: same bits as DQ->Q, one quantize fewer per dispatch."""
    assert two_ranks.count("DISPATCH_MX OK") == 2, two_ranks


def test_combine_route_weights_fused_into_backward_transport(two_ranks):
    """torchtitan-style ``back.float() * w`` after the combine: dOut * w is formed inside the transport quantize."""
    assert two_ranks.count("COMBINE_RW OK") == 2, two_ranks


def test_pass_keeps_collective_whose_wait_is_in_another_graph():
    """A collective split from its wait (as DDP's graph optimizer can do) is kept and reported, not broken."""
    import torch.fx as fx

    from mxfx.passes import all_to_all as a2a_pass
    from mxfx.policy import Policy
    from mxfx.report import PrecisionMap

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.zeros(4, 64, dtype=torch.bfloat16)
    a2a = g.call_function(torch.ops._c10d_functional.all_to_all_single.default, (x, [2, 2], [2, 2], "0"))
    g.output((a2a,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    pm = PrecisionMap()
    assert a2a_pass.run(gm, Policy(), pm) == 0
    (rec,) = pm.records
    assert rec.kind == "all_to_all" and rec.forward == "bf16" and "another graph" in rec.reason  # the payload's dtype


def test_policy_transport_is_validated():
    from mxfx.policy import Policy

    p = Policy.from_options({"transport": {"dispatch_bwd": "bf16"}})
    assert p.transport_precision("dispatch_bwd") == "bf16" and p.transport_precision("combine_fwd") == "mxfp8"
    with pytest.raises(ValueError, match="dispatch_fwd"):
        Policy(transport={"dispatch": "bf16"})
    with pytest.raises(ValueError, match="mxfp8"):
        Policy(transport={"combine_bwd": "fp8"})


def test_mx_all_to_all_rejects_unblockable_rows():
    from mxfx.ops.all_to_all import mx_all_to_all

    with pytest.raises(ValueError, match="multiple of 32"):
        mx_all_to_all(torch.zeros(4, 48), [4], [4], "0")
    with pytest.raises(ValueError, match="forward"):
        mx_all_to_all(torch.zeros(4, 64), [4], [4], "0", forward="fp8")
    with pytest.raises(ValueError, match=r"route_weight of shape \(4, 2\)"):
        mx_all_to_all(torch.zeros(4, 64), [4], [4], "0", route_weight=torch.ones(4, 2))
    with pytest.raises(ValueError, match="return_mx"):
        mx_all_to_all(torch.zeros(4, 64), [4], [4], "0", route_weight=torch.ones(4, 1), return_mx=True)


# --------------------------------------------------------------------------- worker side


class _QDQRows(torch.autograd.Function):
    """Single-process stand-in for an MXFP8 all-to-all: each row becomes dequantize(quantize(row)), both ways."""

    @staticmethod
    def forward(ctx, x):
        import mxfx

        return mxfx.dequantize(*mxfx.quantize(x), dtype=x.dtype)

    @staticmethod
    def backward(ctx, g):
        import mxfx

        return mxfx.dequantize(*mxfx.quantize(g.contiguous()), dtype=g.dtype)


def _routes(world: int, e_local: int):
    """Tokens per rank and two routing outcomes (expert index per token, top-1)."""
    n_exp = world * e_local
    if world == 2:  # rank 0 sends [3, 6] rows, rank 1 [2, 4]; expert 1 receives none
        a = [[0, 0, 0, 2, 2, 2, 2, 3, 3], [0, 0, 2, 2, 2, 3]]
    else:
        g = torch.Generator().manual_seed(7)
        allowed = torch.tensor([e for e in range(n_exp) if e != 1])
        a = [allowed[torch.randint(len(allowed), (6 + r,), generator=g)].tolist() for r in range(world)]
    # everything to rank 0's experts: zero-row sends to every other rank, ranks >= 1 receive nothing
    b = [[1 - (i % 2) for i in range(len(rows))] for rows in a]
    return [torch.tensor(r) for r in a], [torch.tensor(r) for r in b]


def _worker_ep(rank: int, world: int):
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import mxfx

    ex = load_example("ep_moe")
    from tests import counting_pg

    log: list = []  # (collective, dtype, bytes sent) of every collective, tests/counting_pg.py
    counting_pg.register(log)
    dist.init_process_group(counting_pg.BACKEND, rank=rank, world_size=world)
    torch._dynamo.config.capture_scalar_outputs = True
    D, E_LOCAL = 64, 2
    n_exp = world * E_LOCAL

    class ScaleExperts(ex.EPMoE):
        """Experts that scale each row elementwise: row-exact, so results can be compared bit for bit."""

        def __init__(self, group, d, a2a=None):
            super().__init__(d, n_exp, 1, 32, group=group, seed=3)
            g = torch.Generator().manual_seed(4)
            full = torch.rand(n_exp, d, generator=g) + 0.5
            r = dist.get_rank(group) if group is not None else 0
            self.scale = torch.nn.Parameter(full[r * self.e_local : (r + 1) * self.e_local].clone())
            self._a2a = a2a

        def expert(self, e, x):
            return x * self.scale[e]

        def all_to_all(self, x, out_splits, in_splits):
            if self.group is None:
                return _QDQRows.apply(x) if self._a2a != "plain" else x
            if self._a2a is None or self._a2a == "plain":
                return super().all_to_all(x, out_splits, in_splits)
            return self._a2a(x, out_splits, in_splits, self.group)

    def data(idx_per_rank, d):
        xs = [
            torch.randn(len(i), d, generator=torch.Generator().manual_seed(10 + r)) for r, i in enumerate(idx_per_rank)
        ]
        ws = [
            torch.rand(len(i), 1, generator=torch.Generator().manual_seed(20 + r)) + 0.5
            for r, i in enumerate(idx_per_rank)
        ]
        return xs, ws

    def step(layer, x, idx, w):
        x = x.clone().requires_grad_(True)
        y = layer.route(x, idx.unsqueeze(-1), w)
        return y, x

    def check_against_reference(layer, ref, idx_per_rank, d, what):
        xs, ws = data(idx_per_rank, d)
        y, x = step(layer, xs[rank], idx_per_rank[rank], ws[rank])
        g_out = torch.linspace(-2, 3, y.numel()).view_as(y)
        fwd_log = [(dtype, n) for c, dtype, n in log if c == "all_to_all"]
        log.clear()
        y.backward(g_out)
        bwd_log = [(dtype, n) for c, dtype, n in log if c == "all_to_all"]
        log.clear()
        # single-process reference on the global batch
        ref.zero_grad()
        yr, xr = step(ref, torch.cat(xs), torch.cat(idx_per_rank), torch.cat(ws))
        gr = torch.cat([torch.linspace(-2, 3, len(i) * d).view(len(i), d) for i in idx_per_rank])
        yr.backward(gr)
        lo = sum(len(i) for i in idx_per_rank[:rank])
        mine = slice(lo, lo + len(idx_per_rank[rank]))
        assert torch.equal(y, yr[mine]), f"{what}: output differs by {(y - yr[mine]).abs().max()}"
        assert torch.equal(x.grad, xr.grad[mine]), f"{what}: x.grad differs by {(x.grad - xr.grad[mine]).abs().max()}"
        s_ref = ref.scale.grad[rank * E_LOCAL : (rank + 1) * E_LOCAL]
        # expert weight grads sum their rows in a different order than the reference (fp32 rounding only)
        torch.testing.assert_close(layer.scale.grad, s_ref, rtol=1e-5, atol=1e-6, msg=f"{what}: scale.grad")
        layer.zero_grad()
        return fwd_log, bwd_log

    ref = ScaleExperts(None, D)
    opts = {"inner": "aot_eager", "passes": {"linear": False}}
    layer = ScaleExperts(dist.group.WORLD, D)
    layer.route = torch.compile(layer.route, backend="mxfp8", options=opts)
    route_a, route_b = _routes(world, E_LOCAL)
    counters.clear()
    n_reports = len(mxfx.all_reports())
    for name, routes in (("routes A", route_a), ("routes B", route_b)):
        fwd_log, bwd_log = check_against_reference(layer, ref, routes, D, name)
        counts = torch.bincount(torch.cat(routes), minlength=n_exp)
        sent = len(routes[rank])
        recv = int(counts[rank * E_LOCAL : (rank + 1) * E_LOCAL].sum())
        row = lambda n: [(torch.uint8, n * D), (torch.uint8, n * D // 32)]  # noqa: E731  qdata, scales
        meta = [(torch.int64, n_exp * 8)]  # the counts exchange: split metadata
        assert fwd_log == meta + row(sent) + row(recv), f"{name}: forward sent {fwd_log}"  # dispatch, combine
        assert bwd_log == row(sent) + row(recv), f"{name}: backward sent {bwd_log}"  # combine bwd, dispatch bwd
        payload = sum(b for _, b in fwd_log + bwd_log) - n_exp * 8
        assert payload * 32 == 2 * (sent + recv) * D * 33, payload  # 33/32 bytes per value, all four directions
    graphs = mxfx.all_reports()[n_reports:]
    assert counters["stats"]["unique_graphs"] == 1 and len(graphs) == 1, (counters["stats"], len(graphs))
    pm = graphs[0]
    roles = sorted(r.shapes.split()[0] for r in pm.records if r.kind == "all_to_all" and r.rewritten)
    assert roles == ["combine", "dispatch"], pm.to_text()
    assert pm.count("all_to_all", rewritten=False) == 1, pm.to_text()  # the int64 counts exchange
    if rank == 0:
        print(pm.to_text())

    if world == 2:
        import torch.distributed._functional_collectives as funcol

        class _FromTorchTensor(torch.autograd.Function):  # torch 2.11's wrapper around the autograd collective
            @staticmethod
            def forward(ctx, t):
                return funcol._maybe_wrap_tensor(t)

            @staticmethod
            def backward(ctx, g):
                return g

        def a2a_211(x, out_splits, in_splits, group):
            name = funcol._resolve_group_name(group)
            t = torch.ops._c10d_functional_autograd.all_to_all_single(x, out_splits, in_splits, name)
            return _FromTorchTensor.apply(t)

        def a2a_inplace(x, out_splits, in_splits, group):
            out = x.new_empty(sum(out_splits), x.shape[1])
            dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
            return out

        for name, fn in (("torch 2.11 autograd form", a2a_211), ("dist.all_to_all_single", a2a_inplace)):
            layer = ScaleExperts(dist.group.WORLD, D, a2a=fn)
            layer.route = torch.compile(layer.route, backend="mxfp8", options=opts)
            n_reports = len(mxfx.all_reports())
            try:
                check_against_reference(layer, ref, route_a, D, name)
            except Exception as e:
                raise AssertionError(
                    f"{name}: " + "\n".join(r.to_text() for r in mxfx.all_reports()[n_reports:])
                ) from e
            pm = mxfx.last_report()
            assert pm.count("all_to_all", rewritten=True) == 2, f"{name}:\n{pm.to_text()}"

        # hidden size 48: rows stay as written, with a note in the precision map
        ref48, layer48 = ScaleExperts(None, 48, a2a="plain"), ScaleExperts(dist.group.WORLD, 48)
        layer48.route = torch.compile(layer48.route, backend="mxfp8", options=opts)
        check_against_reference(layer48, ref48, route_a, 48, "hidden 48")
        pm = mxfx.last_report()
        notes = [r.reason for r in pm.records if r.kind == "all_to_all" and not r.rewritten]
        kept = "not a multiple of 32 (mxfp8 blocks); rows travel as written, in FP32"  # an FP32 payload
        assert pm.count("all_to_all", rewritten=True) == 0 and sum(kept in n for n in notes) == 2, pm.to_text()
    dist.destroy_process_group()
    print("EP OK")


def _worker_ddp(rank: int, world: int):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import mxfx

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch._dynamo.config.optimize_ddp = True
    steps, per_rank, lr = 3, 32, 0.1

    class MLP(torch.nn.Module):
        # a user module, not nn.Sequential: Dynamo skips frames of torch.nn's own modules when they
        # are entered from DDP's (untraced) forward, and would compile nothing
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(64, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 32)

        def forward(self, x):
            return self.c(torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x)))))

    def model():
        torch.manual_seed(0)
        return MLP()

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(world * per_rank, 64, generator=g) for _ in range(steps)]
    ts = [torch.randn(world * per_rank, 32, generator=g) for _ in range(steps)]
    opts = {"inner": "aot_eager"}

    def train(m, compiled, shard):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        for x, t in zip(xs, ts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(compiled(x[shard]), t[shard]).backward()
            opt.step()

    # single process on the global batch, same MX rounding
    ref = model()
    train(ref, torch.compile(ref, backend="mxfp8", options=opts), slice(None))
    torch._dynamo.reset()

    m = model()
    # 1 MiB buckets (DDP's graph optimizer wants none smaller than its 1 MiB first bucket): the
    # 1 MiB middle weight fills one, so the graph is split at bucket boundaries
    ddp = DDP(m, bucket_cap_mb=1)
    n_reports = len(mxfx.all_reports())
    train(m, torch.compile(ddp, backend="mxfp8", options=opts), slice(rank * per_rank, (rank + 1) * per_rank))
    graphs = mxfx.all_reports()[n_reports:]
    assert len(graphs) > 1, f"DDP's graph optimizer did not split the graph ({len(graphs)} graph)"
    assert sum(pm.count("linear", rewritten=True) for pm in graphs) == 3, "\n".join(pm.to_text() for pm in graphs)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        # Tolerance: the token-blocked MX wgrad sums each rank's 32 tokens and then all-reduces, the
        # reference sums 64 tokens in one GEMM (fp32 summation order); MX blocks and power-of-two loss
        # scaling (1/32 vs 1/64, then /2 in the all-reduce) are otherwise identical.
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if rank == 0:
        diff = max((p - q).abs().max().item() for p, q in zip(m.parameters(), ref.parameters()))
        print(
            f"DDP: max |param - reference| {diff:.2e}; {len(graphs)} graphs;", "; ".join(pm.summary() for pm in graphs)
        )
    dist.destroy_process_group()
    print("DDP OK")


def _pass_on_off(layer, x, pass_name: str, ops: tuple, phase: str, note: str):
    """Run ``layer`` compiled with ``pass_name`` on and off (compile warmed first).

    Checks that exactly one all-to-all record of the precision map carries ``note`` with the
    pass on and none with it off. Returns, keyed by on/off: ``(y, x.grad, {param name: grad})``
    and the number of calls of the ``ops`` in the timed run's ``phase`` ("forward" or "backward").
    """
    from torch.profiler import profile

    import mxfx

    results, counts = {}, {}
    for on in (True, False):
        torch._dynamo.reset()
        fn = torch.compile(layer, backend="mxfp8", options={"inner": "aot_eager", "passes": {pass_name: on}})
        fn(x.clone().requires_grad_(True)).float().sum().backward()  # compile forward and backward
        pm = mxfx.last_report()
        noted = [r for r in pm.records if r.kind == "all_to_all" and note in r.reason]
        assert len(noted) == (1 if on else 0), pm.to_text()
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        with profile() as fwd:
            y = fn(xi)
        with profile() as bwd:
            y.float().square().sum().backward()
        prof = fwd if phase == "forward" else bwd
        counts[on] = sum(e.count for e in prof.key_averages() if e.key in ops)
        results[on] = (y, xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()})
        layer.zero_grad()
    return results, counts


def _ep_layer(rank: int, world: int, seed: int, tokens: int):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch._dynamo.config.capture_scalar_outputs = True
    layer = load_example("ep_moe").GroupedEPMoE(64, 2 * world, 2, 64, group=dist.group.WORLD, seed=seed)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed + 1 + rank)).bfloat16()
    return layer, x


def _worker_dispatch_mx(rank: int, world: int):
    import torch.distributed as dist

    layer, x = _ep_layer(rank, world, seed=5, tokens=48)
    results, quantizes = _pass_on_off(
        layer, x, "dispatch_mx", ("mxfx::quantize", "mxfx::quantize_dequantize"), "forward", "directly (no DQ->Q)"
    )
    (y1, dx1, g1), (y0, dx0, g0) = results[True], results[False]
    for name, a, b in [("output", y1, y0), ("x.grad", dx1, dx0), *((f"{n}.grad", g1[n], g0[n]) for n in g0)]:
        assert torch.equal(a, b), f"{name}: differs by {(a.float() - b.float()).abs().max()}"
    # forward quantize passes: dispatch + gate_up input (with its dequantized form for the emulated GEMM) +
    # combine, minus the gate_up input when fed MX (SwiGLU->down is a swiglu_quantize, not counted)
    assert quantizes[False] - quantizes[True] == 1, quantizes
    # received row counts are data-dependent: a min_size cannot judge them and must not drop the GEMMs to BF16
    import mxfx

    torch._dynamo.reset()
    torch.compile(layer, backend="mxfp8", options={"inner": "aot_eager", "min_size": 1})(x)
    grouped = [r for r in mxfx.last_report().records if r.kind == "grouped_mm"]
    assert len(grouped) == 2 and all(r.forward == "mxfp8" for r in grouped), mxfx.last_report().to_text()
    dist.destroy_process_group()
    print("DISPATCH_MX OK")


def _worker_combine_rw(rank: int, world: int):
    import torch.distributed as dist

    layer, x = _ep_layer(rank, world, seed=7, tokens=40)
    results, rw_quantizes = _pass_on_off(
        layer,
        x,
        "combine",
        ("mxfx::route_weight_quantize",),
        "backward",
        "route-weight multiply fused into the combine",
    )
    assert rw_quantizes == {True: 1, False: 0}, rw_quantizes
    (y1, dx1, g1), (y0, dx0, g0) = results[True], results[False]
    assert torch.equal(y1, y0), "forward: the fused op computes the same fp32 product"
    # The route-weight gradient sum(dOut * rows) is the same computation either way.
    assert _rel(g1["router.weight"], g0["router.weight"]) < 1e-5
    # Unfused, dOut * w is rounded to BF16 before its E4M3 quantize; fused, it is quantized from
    # fp32. The two differ only where that BF16 rounding moves a value across an E4M3 rounding
    # boundary (a few % of elements, by one E4M3 step), so a few 1e-2 relative at most.
    rel = (_rel(dx1, dx0), _rel(g1["down"], g0["down"]), _rel(g1["gate_up"], g0["gate_up"]))
    assert all(0 < r < 3e-2 for r in rel), rel
    dist.destroy_process_group()
    print("COMBINE_RW OK")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


WORKERS = {"ep": _worker_ep, "ddp": _worker_ddp, "dispatch_mx": _worker_dispatch_mx, "combine_rw": _worker_combine_rw}

if __name__ == "__main__":
    run_worker(WORKERS)
