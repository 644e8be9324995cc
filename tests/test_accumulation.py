"""Gradient accumulation at the recipe's operating point: several microbatches per optimizer step, FP32 main weights
under BF16 autocast, for both formats (``format="mxfp8"``, ``"fp8_block"``), on the main job's MoE model (routed
experts, a shared expert, dense linears; tests/models.py) compiled with ``backend="mxfp8"`` (inner ``aot_eager``).

One process: the accumulated gradients are the sum of the microbatches' own; each weight is quantized once per
optimizer step whatever the microbatch count, and the caches a step leaves are those of the updated weights. Every
case runs with autograd accumulating the weight gradients and with the wgrad GEMMs writing them into ``.grad``
(``fuse_wgrad_accumulation``, ``fused`` in the test ids).
Two processes (gloo, the ``TWO_RANKS`` worker cases of the shared launch, :func:`tests.helpers.run_worker`): DDP
``no_sync()`` and FSDP2 ``set_requires_gradient_sync(False)`` over the first N-1 microbatches give one process's
gradients of the concatenated data, reduce only in the synced microbatch, and quantize each weight once per step
on each rank.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import mxfx
from mxfx.numerics import block as bf
from mxfx.passes.wgrad_accumulation import FUSED_NOTE
from mxfx.runtime import cache
from tests.helpers import run_worker
from tests.models import MoETransformer, tiny_config

FORMATS = ("mxfp8", "fp8_block")
FUSE = pytest.mark.parametrize("fuse", [False, True], ids=["autograd", "fused"])
N_MICRO = 4
BATCH, SEQ = 2, 64  # 128 tokens a microbatch: whole 1x128 fp8_block tiles and 32-token MX blocks along the tokens
N_MX_WEIGHTS = 7  # qkv, o_proj, shared_gate/up/down (dense), gate_up_proj, down_proj (routed); router, lm_head kept
ACCUM_RTOL = 1e-6
"""Relative Frobenius error allowed between an accumulated gradient and the exact sum of its microbatches' gradients.
Each microbatch runs the same ops on the same operands either way (no step between them, so the same weight forms):
only FP32 rounding differs, that of the N-1 additions into ``p.grad`` (at most (N-1) * 2^-24 ~ 1.8e-7 of the sum of
magnitudes per element), plus, where a backward reduction's order is not fixed run to run, the microbatch's own
(Inductor's scatter-add for the embedding: measured 4e-9; ``aot_eager`` reproduces every gradient bit for bit).
1e-6 leaves room for sums a few times smaller than their magnitudes. A microbatch dropped or counted twice moves
the sum by about 1/N = 25%, one run on other weight forms by FP8 rounding steps."""


def _model() -> MoETransformer:
    """Width 128: every GEMM tiles by fp8_block's 128 as well as by MXFP8's 32."""
    torch.manual_seed(0)
    return MoETransformer(tiny_config(d_model=128, expert_hidden=128, shared_hidden=128))


def _ids(count: int, batch: int = BATCH, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, SEQ), generator=g) for _ in range(count)]


def _microbatch(run, ids: torch.Tensor, n: int) -> None:
    """One microbatch of ``n``: forward under BF16 autocast, backward of the mean next-byte loss divided by ``n``."""
    with torch.autocast("cpu", torch.bfloat16):
        loss = run(ids, ids)[1]
    (loss / n).backward()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _assert_mx_ops(pm, fmt: str, fuse: bool) -> None:
    """The compiled graph runs the dense linears and both routed-expert GEMMs in ``fmt``, their wgrads writing
    ``.grad`` themselves where ``fuse``."""
    linear = [r for r in pm.records if r.kind == "linear" and r.rewritten]
    grouped = [r for r in pm.records if r.kind == "grouped_mm"]
    assert len(linear) == 5 and all(r.forward == fmt for r in linear), pm.to_text()
    assert len(grouped) == 2 and all(r.forward == fmt for r in grouped), pm.to_text()
    assert all((FUSED_NOTE in r.reason) == fuse for r in linear + grouped), pm.to_text()


def _fresh_form(fmt: str, w: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Form ``form`` of ``w`` (rule rceil) quantized now by the format's reference function."""
    w = w.detach()
    if fmt == "mxfp8":
        return mxfx.quantize(w if form == "forward" else w.transpose(-2, -1).contiguous(), axis=-1, rule="rceil")
    q, s = bf.quantize_128x128(w, "rceil")  # one 128x128 grid; the dgrad form is it transposed
    return (q, s) if form == "block_forward" else (q.transpose(-2, -1), s.transpose(-2, -1))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = (t.view(torch.uint8) if t.element_size() == 1 else t for t in (a, b))
    return a.shape == b.shape and torch.equal(a, b)


def _stale_forms(fmt: str, model) -> list[str]:
    """Names (``param/form``) of the forms cached now that differ from a fresh quantize of their weight as it is now."""
    return [
        f"{name}/{form}"
        for name, p in model.named_parameters()
        for (rule, form), cached in cache.entry_forms(p).items()
        if not all(_same_bits(a, b) for a, b in zip(cached, _fresh_form(fmt, p, form), strict=True))
    ]


def _forms_snapshot(model) -> dict:
    return {
        (n, k): tuple(t.clone() for t in f)
        for n, p in model.named_parameters()
        for k, f in cache.entry_forms(p).items()
    }


pytestmark = pytest.mark.usefixtures("fresh_weight_cache")


# --- one process ----------------------------------------------------------------------------------


@FUSE
@pytest.mark.parametrize("fmt", FORMATS)
def test_accumulated_gradients_are_the_sum_of_the_microbatches(fmt, fuse):
    """N=4 microbatches into no gradient (``zero_grad(set_to_none=True)``, on fresh caches: the step that switches
    them to keeping every form) and into zeroed gradients (``set_to_none=False``, caches kept) give, for every
    parameter, the sum of the 4 gradients each microbatch gives alone from no gradient, within :data:`ACCUM_RTOL`
    (fused: the first microbatch's GEMM writes a new ``.grad`` or adds into the zeros, later ones add into it)."""
    model, batches = _model(), _ids(N_MICRO)
    opts = {"inner": "aot_eager", "format": fmt, "fuse_wgrad_accumulation": fuse}
    run = torch.compile(model, backend="mxfp8", options=opts)

    def accumulate(set_to_none: bool):
        """Gradients after the first microbatch and after all of them."""
        model.zero_grad(set_to_none=set_to_none)
        for p in model.parameters():
            assert (p.grad is None) if set_to_none else (p.grad is not None and not p.grad.any())
        for i, ids in enumerate(batches):
            _microbatch(run, ids, N_MICRO)
            if i == 0:
                first = {n: p.grad.clone() for n, p in model.named_parameters()}
        return first, {n: p.grad.clone() for n, p in model.named_parameters()}

    runs = {True: accumulate(True)}
    _assert_mx_ops(mxfx.last_report(), fmt, fuse)
    singles = []
    for ids in batches:
        model.zero_grad(set_to_none=True)
        _microbatch(run, ids, N_MICRO)
        singles.append({n: p.grad.clone() for n, p in model.named_parameters()})
    runs[False] = accumulate(False)
    exact = {n: torch.stack([s[n].double() for s in singles]).sum(0) for n in singles[0]}
    for set_to_none, (first, total) in runs.items():
        for n, grad in total.items():
            assert grad.dtype == torch.float32, (n, grad.dtype)  # FP32 accumulation into the FP32 main weight's grad
            assert exact[n].norm() > 0, n  # every parameter, experts included, got a gradient
            # the first microbatch writes its gradient (None) or adds it to zeros: that gradient alone
            assert _rel(first[n], singles[0][n]) <= ACCUM_RTOL, (set_to_none, n)
            err = _rel(grad, exact[n])
            assert err <= ACCUM_RTOL, f"set_to_none={set_to_none} {n}: accumulated vs sum of microbatches {err:.2e}"


SCHEDULE = (1, 1, 4, 8, 1)
"""Microbatches of each optimizer step in the counting test: one per step (each weight's dgrad form built for its
GEMM and not kept), the first step with several (the documented switch to keeping every form), then any count."""


@pytest.mark.parametrize(
    "compiled_step,fuse",
    [(False, False), (True, False), (False, True)],
    ids=["eager_step", "compiled_step", "eager_step-fused"],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_weight_quantized_once_per_step_whatever_the_microbatch_count(fmt, compiled_step, fuse):
    """The cache's counters over a step (its microbatches and the optimizer step) show the same quantizations for 1,
    4 and 8 microbatches, one per cached form (MXFP8) or per weight (fp8_block: its dgrad form is the forward grid
    transposed); every form cached before and right after each step equals a fresh quantize of the weight as it is
    then (and the step changed them), and the gradients after the steps equal those of caches built from scratch.
    Fused, the eager step's hook finds the gradients the wgrad GEMMs wrote, as it finds autograd's (a compiled step
    rebuilds the caches whatever the gradients)."""
    opts = {"inner": "aot_eager", "format": fmt, "fuse_wgrad_accumulation": fuse}
    model, batches = _model(), _ids(max(SCHEDULE))
    run = torch.compile(model, backend="mxfp8", options=opts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(opt.step, backend="mxfp8", options=opts) if compiled_step else opt.step
    per_form = {"mxfp8": 1, "fp8_block": 2}[fmt]  # cached forms per quantize
    per_step, seen_several, previous = [], False, {}
    for s, n in enumerate(SCHEDULE):
        cache.reset_stats()
        for ids in batches[:n]:
            _microbatch(run, ids, n)
        if s == 0:
            _assert_mx_ops(mxfx.last_report(), fmt, fuse)
        before = cache.stats()["quantize"]
        n_forms = sum(len(cache.entry_forms(p)) for p in model.parameters())
        assert n_forms == (2 * N_MX_WEIGHTS if seen_several or n > 1 else 0), (
            s,
            n,
            n_forms,
        )  # one microbatch: none kept
        assert _stale_forms(fmt, model) == [], s
        step()
        opt.zero_grad()
        stats = cache.stats()
        assert stats["quantize"] - before == N_MX_WEIGHTS, stats  # the step rebuilt each forward form, once
        assert stats["refresh_graph" if compiled_step else "refresh_eager"] == N_MX_WEIGHTS, stats
        after = _forms_snapshot(model)
        assert len(after) == N_MX_WEIGHTS and _stale_forms(fmt, model) == [], (s, sorted(after))
        if s:  # the step moved every forward form (a stale one would have kept the previous step's)
            assert all(not _same_bits(after[k][0], previous[k][0]) for k in after), s
        previous = after
        per_step.append(stats["quantize"])
        seen_several |= n > 1
    once = 2 * N_MX_WEIGHTS // per_form  # each cached form of each weight, one quantize each
    first_several = next(s for s, n in enumerate(SCHEDULE) if n > 1)
    # step 0 builds the forward forms at its first forward too; the first step with several microbatches builds
    # them twice (docs/caches.md: its second microbatch finds the forms its first backward dropped); every other
    # step once, whatever its microbatch count
    want = [once + N_MX_WEIGHTS if s == 0 else 2 * once if s == first_several else once for s in range(len(SCHEDULE))]
    assert per_step == want, (per_step, want)

    # the gradients of the next step's microbatches, with the caches the steps left and with every cache built
    # from the current weights (cache.clear()): a form left stale by a step would differ by FP8 rounding steps
    def grads():
        model.zero_grad(set_to_none=True)
        for ids in batches[:N_MICRO]:
            _microbatch(run, ids, N_MICRO)
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    kept = grads()
    cache.clear()
    rebuilt = grads()
    for n in kept:  # the same ops on the same operands: ACCUM_RTOL's reasons
        assert _rel(kept[n], rebuilt[n]) <= ACCUM_RTOL, n


# --- two processes ----------------------------------------------------------------------------------

FUSED_CASES = (("ddp", "mxfp8"), ("fsdp2", "fp8_block"))
"""The wrappers' cases run fused too, one format each: the formats' wgrad GEMMs are tested fused in one process,
the wrappers' hooks and reductions see the same ``.grad`` whichever GEMM wrote it."""
TWO_RANKS = [f"{wrapper}_{fmt}" for wrapper in ("ddp", "fsdp2") for fmt in FORMATS] + [
    f"{wrapper}_{fmt}_fused" for wrapper, fmt in FUSED_CASES
]
DIST_STEPS, DIST_LR = 2, 0.5  # SGD at 0.5: gradients of the second step from the first step's forms are 8% off


@pytest.mark.parametrize("fmt,fuse", [(f, False) for f in FORMATS] + [(FUSED_CASES[0][1], True)])
def test_ddp_no_sync_accumulation_matches_one_process(two_ranks, fmt, fuse):
    """DDP ``no_sync()`` over 3 microbatches then a synced one, 2 ranks, 2 steps: each step's gradients equal one
    process's of the concatenated microbatches at the same weights; all-reduces only in the synced microbatch; each
    weight quantized once per step on each rank. Fused: the reducer's hook, run after ``AccumulateGrad`` got no
    gradient, reads the ``.grad`` the wgrad GEMMs wrote."""
    assert two_ranks.count(f"ACCUM OK ddp {fmt} {'fused' if fuse else 'autograd'}\n") == 2, two_ranks


@pytest.mark.parametrize("fmt,fuse", [(f, False) for f in FORMATS] + [(FUSED_CASES[1][1], True)])
def test_fsdp2_gradient_sync_off_accumulation_matches_one_process(two_ranks, fmt, fuse):
    """FSDP2 ``set_requires_gradient_sync(False)`` over 3 microbatches then True: as for DDP, with reduce-scatters
    only in the synced microbatch (fused: of the unsharded parameters' ``.grad`` the wgrad GEMMs wrote)."""
    assert two_ranks.count(f"ACCUM OK fsdp2 {fmt} {'fused' if fuse else 'autograd'}\n") == 2, two_ranks


def _dist_ids(step: int, world: int) -> list[list[torch.Tensor]]:
    """Step ``step``'s microbatches: ``[microbatch][rank]`` ids ``[BATCH, SEQ]``."""
    flat = _ids(N_MICRO * world, seed=100 + step)
    return [flat[i * world : (i + 1) * world] for i in range(N_MICRO)]


DIST_RTOL = 1e-4
"""Relative Frobenius error allowed between a rank's reduced gradient and one process's gradient of the concatenated
microbatches at the same weights, for the parameters whose gradients are FP32 sums of per-token terms both sides
compute alike (embedding, norms, MX dense linears, the routed experts, whose BF16 grouped wgrad writes its FP32
sums). Per token the ranks run the same ops on the same bits: the forward's and dgrad's blocks are per row, and each
rank's 128 tokens a microbatch fill whole token blocks of the wgrad operands (32 for MXFP8, 128 for fp8_block) in
the concatenation too; the loss scales differ by a power of two, which MX and fp8_block scales absorb exactly. Only
the FP32 summation order differs (measured 1e-7, the experts' 8e-8, fused or not). A gradient not reduced, or a
microbatch lost, is off by tens of percent."""
BF16_RTOL = 5e-3
"""The same, for the parameters whose gradients go through a BF16 rounding of a partial sum (:data:`BF16_SUMS`): each
rank's BF16 weight-gradient GEMM rounds its own tokens' sum to BF16 (2^-9 relative) before the FP32 reduction,
where one process rounds the sum of both ranks' tokens (measured 1.4e-3 to 1.7e-3)."""
SPLIT_RTOL = 3e-2
"""The same, for the experts' ``gate_up_proj`` under DDP (measured 1.4e-2): Dynamo splits DDP's graph at bucket
boundaries, and there the experts' BF16 gate_up wgrad reads the MXFP8 copy of its gathered rows, where the whole
graph (and FSDP2's block) keeps the BF16 tokens and gathers them again (the saved pass, ``mxfx/passes/saved.py``):
its input differs by an E4M3 rounding, 2^-4 relative per value."""
BF16_SUMS = ("moe.gate.weight", "lm_head.weight")
"""The router (reads the experts' BF16 outputs) and lm_head (a BF16 autocast GEMM whose result autograd widens)."""


class _Reference(MoETransformer):
    """One process on the concatenated microbatches, at the weights the ranks have at each step. A forward of its
    own: compiled, it is a frame of its own, whose graphs no other model's call can pick up (DDP's compiled call of
    ``MoETransformer.forward`` would run a graph compiled here, unsplit, if it matched)."""

    def forward(self, idx, targets=None):
        return super().forward(idx, targets)


def _worker_accum(rank: int, world: int, wrapper: str, fmt: str, fuse: bool = False):
    import torch.distributed as dist

    from tests import counting_pg

    comm: list = []  # (collective, dtype, bytes) of each gradient reduction
    counting_pg.register(comm)  # FSDP2's collectives through a default process group that counts them
    dist.init_process_group(counting_pg.BACKEND if wrapper == "fsdp2" else "gloo", rank=rank, world_size=world)
    opts = {"inner": "aot_eager", "format": fmt, "fuse_wgrad_accumulation": fuse}
    torch.manual_seed(0)
    ref = _Reference(tiny_config(d_model=128, expert_hidden=128, shared_hidden=128))
    ref_run = torch.compile(ref, backend="mxfp8", options=opts)
    model = _model()
    if wrapper == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        def counted_allreduce(state, bucket):  # a comm hook: a counting process group would be traced by Dynamo
            comm.append(("all_reduce", bucket.buffer().dtype, bucket.buffer().nbytes))
            return allreduce_hook(state, bucket)

        torch._dynamo.config.optimize_ddp = True
        ddp = DDP(model)
        ddp.register_comm_hook(None, counted_allreduce)
        run = torch.compile(ddp, backend="mxfp8", options=opts)
        reduction = "all_reduce"

        def sync(on: bool):
            return contextlib.nullcontext() if on else ddp.no_sync()
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        for i, block in enumerate(model.layers):  # torchtitan's order: each block compiled, then sharded
            model.layers[i] = torch.compile(block, backend="mxfp8", options=opts, fullgraph=True)
        # the default group's mesh (a mesh of a group of its own would leave DTensor state that breaks later cases'
        # meshes: "Could not resolve the process group registered under the name 1")
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        run = model
        reduction = "reduce_scatter"

        def sync(on: bool):
            model.set_requires_gradient_sync(on)
            return contextlib.nullcontext()

    opt = torch.optim.SGD(model.parameters(), lr=DIST_LR)
    once = 2 * N_MX_WEIGHTS // {"mxfp8": 1, "fp8_block": 2}[fmt]  # quantizes a step: one per form (fp8_block: weight)
    for s in range(DIST_STEPS):
        weights = {
            n.replace("_orig_mod.", ""): p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            for n, p in model.named_parameters()
        }
        ref.load_state_dict(weights)
        cache.refresh(ref.parameters())  # its caches built now, whatever the version counters and step hooks say
        ref.zero_grad(set_to_none=True)
        for ids in _dist_ids(s, world):
            _microbatch(ref_run, torch.cat(ids), N_MICRO)
        cache.reset_stats()
        n_graphs = len(mxfx.all_reports())
        for i, ids in enumerate(_dist_ids(s, world)):
            last = i == N_MICRO - 1
            comm.clear()
            with sync(last):
                _microbatch(run, ids[rank], N_MICRO)
            reduced = sum(b for c, _, b in comm if c == reduction)
            assert (reduced > 0) == last, f"step {s} microbatch {i}: {reduced} bytes {reduction} ({comm})"
            if s == i == 0:  # DDP's graph optimizer splits the model's graph at bucket boundaries; FSDP2: one block
                graphs = mxfx.all_reports()[n_graphs:]
                assert len(graphs) == (2 if wrapper == "ddp" else 1), [pm.summary() for pm in graphs]
                assert sum(pm.count("grouped_mm", True) for pm in graphs) == 2, [pm.summary() for pm in graphs]
                fused = sum(FUSED_NOTE in r.reason for pm in graphs for r in pm.records)
                assert fused == (N_MX_WEIGHTS if fuse else 0), [pm.to_text() for pm in graphs]
        for n, p in model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            name = n.replace("_orig_mod.", "")
            rtol = (
                SPLIT_RTOL
                if wrapper == "ddp" and name.endswith("gate_up_proj")
                else BF16_RTOL
                if name.endswith(BF16_SUMS)
                else DIST_RTOL
            )
            err = _rel(grad, ref.get_parameter(name).grad)
            assert err <= rtol, f"{wrapper} {fmt} step {s} {name}: reduced gradient vs one process {err:.2e} > {rtol}"
        opt.step()
        opt.zero_grad()
        quantized = cache.stats()["quantize"]
        # the first step builds forms more than once (the one-process test); later ones once, on every rank: DDP's
        # step hook rebuilds the forward forms, FSDP2's unsharded weights are rebuilt at their first forward
        assert s == 0 or quantized == once, (
            f"{wrapper} {fmt} step {s}: {quantized} quantizes, want {once} ({cache.stats()})"
        )
    dist.destroy_process_group()
    print("ACCUM OK", wrapper, fmt, "fused" if fuse else "autograd")


WORKERS = {
    f"{wrapper}_{fmt}{'_fused' * fuse}": lambda r, w, wrapper=wrapper, fmt=fmt, fuse=fuse: _worker_accum(
        r, w, wrapper, fmt, fuse
    )
    for wrapper in ("ddp", "fsdp2")
    for fmt in FORMATS
    for fuse in (False, True)
    if not fuse or (wrapper, fmt) in FUSED_CASES
}

if __name__ == "__main__":
    run_worker(WORKERS)
