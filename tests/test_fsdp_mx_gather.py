"""Low-precision weight all-gather under FSDP2 (``mxfx.fsdp.mx_all_gather``) on 2 gloo processes, against one process.

The worker cases (``TWO_RANKS``) run in one launch of 2 processes shared with the other distributed test files
(``two_ranks`` in tests/conftest.py, :func:`tests.helpers.run_worker`), one case after the other; each test reads
the line its case prints on success. The dense model, data and one-process reference are
tests/test_fsdp.py's (two residual MLP blocks of width 64 and a root projection); the MoE (``moe`` case, mxfp8 and
fp8_block) is two blocks of examples/ep_moe.py's grouped-GEMM MoE plus a dense MLP.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import load_example, run_worker
from tests.test_fsdp import LOSS_RTOL, OPTS, PER_RANK, _compile_per_block, _data, _loss, _model, _reference, _train

LAYOUTS = ["whole", "whole_reshard", "per_block", "per_block_bf16"]
TWO_RANKS = [*(f"train_{layout}" for layout in LAYOUTS), "moe"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mx_all_gather_trains_like_one_process(two_ranks, layout):
    """Losses within 1e-3 of one-process mxfp8 over 5 AdamW steps; gathered forms byte-identical to quantizing
    the full weight on one process; forward form in forward, dgrad form in backward; DCP save/load resumes
    bit-identically. ``whole``: the root (not resharded after forward, FSDP's default) gathers both forms once;
    ``per_block_bf16``: ``param_dtype=torch.bfloat16`` (biases gather BF16, blocks compute in BF16; the MX forms
    still come from the FP32 shards): losses within 5e-3 as in tests/test_fsdp.py. ``whole_reshard``: the root
    reshards too, and all-gather bytes per step are <= 0.55x the BF16 FSDP2 run's
    (same sharding) (asserted; the FP32 biases keep it above 33/64)."""
    assert two_ranks.count(f"MXGATHER OK {layout} ") == 2, two_ranks


def test_eligibility_fallback():
    """A weight whose shards would cut a 32-row group gathers high precision, and the gather map says so."""
    import mxfx.fsdp

    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 96))
    pmap = mxfx.fsdp.mx_all_gather(m, world_size=2)
    assert pmap["0.weight"] == "mxfp8" and pmap["1.weight"].startswith("high precision"), pmap
    assert type(m[0].weight.data).__name__ == "MXWeight" and type(m[1].weight.data) is torch.Tensor
    sd = m.state_dict()
    assert type(sd["0.weight"]).__name__ == "MXWeight" and torch.equal(sd["0.weight"]._tensor, m[0].weight._tensor)
    with pytest.raises(ValueError, match="rule"):
        mxfx.fsdp.mx_all_gather(torch.nn.Linear(64, 64), {"scale_rule": "nearest"})


def test_expert_weights_gather_low_precision(two_ranks):
    """A small MoE (per-block compile, routed experts ``[E, N, K]`` in grouped GEMMs, sharded over experts), for
    mxfp8 and fp8_block: with the low-precision gather, losses over 5 AdamW steps equal those of the same FSDP2 run
    gathering FP32, and are within 1e-2 of one process (tests/test_fsdp.py's MoE bound); gathered expert and linear
    forms byte-identical to one-process quantization; the expert unit's all-gather moves 33/32 (mxfp8) or 1 + 4/128^2
    (fp8_block) bytes per value, <= 0.52x the BF16 FSDP2 run's. fp8_block: the dense ``down`` ([128, 256],
    64-row shards) gathers in FP32, as the map says. An expert weight that fully_shard shards on dim 1 while
    mx_all_gather was told dim 0 raises at its gather."""
    assert two_ranks.count("MOEGATHER OK") == 2, two_ranks


def test_gather_map_follows_policy_and_sharding():
    """The map: fp8_block needs 128-row shards, expert weights need experts split evenly, Shard(1) and BF16 ops
    gather high precision; unconverted parameters stay plain tensors."""
    import mxfx.fsdp
    from torch.distributed.tensor import Shard

    m = _MoEModel()
    block = {"format": "fp8_block"}
    assert mxfx.fsdp.mx_all_gather(_MoEModel(), world_size=2) == {
        f"blocks.{i}.{n}": f
        for i in range(2)
        for n, f in (
            (
                "moe.router.weight",
                "high precision (the op stays bf16: features 128->4 are not multiples of 32 (mxfp8 blocks); "
                "the GEMM is narrower than one block (4 output features), too narrow to pad: it stays "
                "as the model wrote it)",
            ),
            ("moe.gate_up", "mxfp8"),
            ("moe.down", "mxfp8"),
            ("up.weight", "mxfp8"),
            ("down.weight", "mxfp8"),
        )
    }
    pmap = mxfx.fsdp.mx_all_gather(m, block, world_size=2)
    assert [pmap[f"blocks.0.{n}"] for n in ("moe.gate_up", "moe.down", "up.weight")] == ["fp8_block"] * 3, pmap
    assert pmap["blocks.0.down.weight"].startswith("high precision (shape (128, 256): 2 shards of 64 rows"), pmap
    assert type(m.blocks[0].down.weight.data) is torch.Tensor and m.blocks[0].moe.gate_up._format.name == "fp8_block"
    pmap = mxfx.fsdp.mx_all_gather(_MoEModel(), world_size=8)  # 4 experts over 8 ranks
    assert pmap["blocks.0.moe.gate_up"].startswith("high precision (shape (4, 256, 128): dim 0"), pmap
    pmap = mxfx.fsdp.mx_all_gather(torch.nn.Linear(64, 256), block, world_size=1)  # as the passes: K=64 stays BF16
    assert pmap["weight"].startswith("high precision (the op stays bf16: features 64->256 are not multiples of 128"), (
        pmap
    )
    pmap = mxfx.fsdp.mx_all_gather(
        _MoEModel(), world_size=2, shard_placement_fn=lambda p: Shard(1) if p.dim() == 3 else None
    )
    assert pmap["blocks.0.moe.gate_up"].startswith("high precision (Shard(1)") and pmap["blocks.0.up.weight"] == "mxfp8"
    pmap = mxfx.fsdp.mx_all_gather(_MoEModel(), {"rules": [{"module": "*.moe", "precision": "bf16"}]}, world_size=2)
    assert (
        pmap["blocks.1.moe.down"].startswith("high precision (the op stays bf16")
        and pmap["blocks.1.up.weight"] == "mxfp8"
    )
    m = _MoEModel()  # experts over a 4-rank mesh (converted first), the rest over 8 ranks
    assert mxfx.fsdp.mx_all_gather(m.blocks[0].moe, world_size=4)["gate_up"] == "mxfp8"
    pmap = mxfx.fsdp.mx_all_gather(m, world_size=8)
    assert pmap["blocks.0.moe.gate_up"] == "mxfp8" and pmap["blocks.1.moe.gate_up"].startswith("high precision"), pmap
    with pytest.raises(ValueError, match="is not a rule of format"):
        mxfx.fsdp.mx_all_gather(_MoEModel(), {"format": "fp8_block", "scale_rule": "floor"}, world_size=2)


def _byte_identical(unsharded: torch.Tensor, full: torch.Tensor, fmt: str = "mxfp8") -> None:
    """The cache forms installed for the gathered ``unsharded`` weight (``[N, K]`` or ``[E, N, K]``) equal
    one-process quantization of ``full`` (the format's spec reference)."""
    from mxfx.numerics import block as block_format
    from mxfx.runtime import cache
    from mxfx.numerics import mx as format

    entry = cache.store.state.entries[cache.store._key(unsharded)]
    assert entry.gathered
    if fmt == "fp8_block":
        q, s = block_format.quantize_128x128(full, "rceil")
        refs = {"block_forward": (q, s), "block_dgrad": (q.transpose(-2, -1), s.transpose(-2, -1))}
    else:
        refs = {
            "forward": format.quantize_lastdim(full, "rceil"),
            "dgrad": format.quantize_lastdim(full.transpose(-2, -1), "rceil"),
        }
    for o, (rq, rs) in refs.items():
        gq, gs = entry.forms[("rceil", o)]
        assert torch.equal(gq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(gs, rs), f"{o} form differs"


def _worker(rank: int, world: int, layout: str):
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import mxfx.fsdp
    from tests import counting_pg

    comm: list = []
    counting_pg.register(comm)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh.from_group(dist.new_group(backend=counting_pg.BACKEND), "cpu")
    xs, ts = _data(world)
    name = layout
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    bf16 = layout.endswith("_bf16")
    layout = layout.removesuffix("_bf16")
    whole = layout.startswith("whole")
    rtol = 5e-3 if bf16 else LOSS_RTOL  # BF16: the tolerance and reason of tests/test_fsdp.py
    root_kw = {"reshard_after_forward": True} if layout == "whole_reshard" else {}

    def avg(loss):
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return float(loss)

    def sharded(mx, mp):
        m = _model()
        # per block, the root's projection runs eagerly (tests/test_fsdp.py): it reads its weight outside
        # mxfx's GEMMs, so only the compiled blocks convert there
        pmap = (mxfx.fsdp.mx_all_gather(m if whole else m.layers)) if mx else {}
        if not whole:
            _compile_per_block(m)
        for block in m.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(m, mesh=mesh, mp_policy=mp, **root_kw)
        return m, pmap, (torch.compile(m, backend="mxfp8", options=OPTS) if whole else m)

    ref_losses = _reference("whole" if whole else "per_block", xs, ts)[0]

    bf16_ag = 0
    if layout == "whole_reshard":  # the BF16 FSDP2 baseline, same sharding
        m, _, run = sharded(False, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        comm.clear()
        _train(m, run, xs, ts, shard, avg)
        bf16_ag = counting_pg.total(comm, "all_gather")

    m, pmap, run = sharded(True, MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None))
    assert list(pmap.values()) == ["mxfp8"] * (5 if whole else 4), pmap
    comm.clear()
    mxfx.fsdp.stats.clear()
    losses = _train(m, run, xs, ts, shard, avg)
    ag, rs, a2a = (counting_pg.total(comm, c) for c in ("all_gather", "reduce_scatter", "all_to_all"))
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a:.6f} vs one process {b:.6f}\n{losses}\n{ref_losses}"
    # blocks reshard after forward: forward form before forward, dgrad form in backward; the root (no reshard,
    # whole layout only) gathers once per step with both forms
    n_fwd = n_bwd = 5 if whole else 4
    assert dict(mxfx.fsdp.stats) == {"gather_forward": 5 * n_fwd, "gather_dgrad": 5 * n_bwd}, dict(mxfx.fsdp.stats)
    if layout == "whole_reshard":  # elsewhere the root gathers once per step (both forms, or FP32 unconverted)
        assert ag <= 0.55 * bf16_ag, f"MX all-gather {ag} B vs BF16 {bf16_ag} B"

    # byte identity of the gathered forms (forward form kept from the forward gather, dgrad from the backward's)
    block = m.layers[0]._orig_mod if hasattr(m.layers[0], "_orig_mod") else m.layers[0]
    loss = _loss(run(xs[0][shard]), ts[0][shard])
    loss.backward()
    full = _full(m, "layers.0.up.weight")
    m.layers[0].unshard()  # the FSDP unit: the compiled wrapper per block
    _byte_identical(block.up.weight, full)
    m.layers[0].reshard()

    # DCP: save, train one step, load, the same step again gives the same loss (caches never saved)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

    def one_step():
        opt.zero_grad()
        loss = _loss(run(xs[1][shard]), ts[1][shard])
        loss.backward()
        opt.step()
        return avg(loss.detach())

    one_step()
    msd, osd = get_state_dict(m, opt)
    assert not any("cache" in k or "qdata" in k for k in msd), list(msd)
    ckpt = tempfile.mkdtemp() if rank == 0 else None
    box = [ckpt]
    dist.broadcast_object_list(box)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=box[0])

    first = [one_step(), one_step()]
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=box[0])
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    again = [one_step(), one_step()]
    assert first == again, f"DCP resume: {first} vs {again}"
    print(
        "MXGATHER OK",
        name,
        losses,
        ref_losses,
        f"all_gather {ag} B vs bf16 {bf16_ag} B; reduce_scatter {rs} B; all_to_all {a2a} B",
    )
    dist.destroy_process_group()


def _full(m, name: str) -> torch.Tensor:
    """The full FP32 value of sharded parameter ``name`` (``_orig_mod.`` prefixes ignored)."""
    for n, p in m.named_parameters():
        if n.replace("_orig_mod.", "") == name:
            full = p.full_tensor()
            return full._tensor if hasattr(full, "_tensor") else full
    raise KeyError(name)


# --------------------------------------------------------------------------- MoE worker

MOE_D, MOE_EXPERTS, MOE_HIDDEN, MOE_STEPS, MOE_TOKENS = 128, 4, 128, 5, 16
MOE_LOSS_RTOL = 1e-2


class _MoEBlock(torch.nn.Module):
    """``x + MoE(x)`` (examples/ep_moe.py's grouped-GEMM MoE, all experts local), then ``x + MLP(x)``."""

    def __init__(self, index: int):
        super().__init__()
        self.moe = load_example("ep_moe").GroupedEPMoE(
            MOE_D, MOE_EXPERTS, 2, MOE_HIDDEN, seed=index
        )  # gate_up [4, 256, 128], down [4, 128, 128]
        self.up, self.down = (
            torch.nn.Linear(MOE_D, 2 * MOE_D, bias=False),
            torch.nn.Linear(2 * MOE_D, MOE_D, bias=False),
        )

    def forward(self, x):
        x = x + self.moe(x.bfloat16()).to(x.dtype)
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _MoEModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_MoEBlock(0), _MoEBlock(1)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _moe_train(m, xs, ts, shard, reduce_loss):
    """:func:`test_fsdp._train` of a model that runs itself (compiled per block or not at all)."""
    return _train(m, m, xs, ts, shard, reduce_loss)


def _worker_moe(rank: int, world: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import mxfx.fsdp
    from tests import counting_pg

    comm: list = []
    counting_pg.register(comm)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh.from_group(dist.new_group(backend=counting_pg.BACKEND), "cpu")
    torch._dynamo.config.capture_scalar_outputs = True  # the MoE's split sizes are data
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(world * MOE_TOKENS, MOE_D, generator=g) for _ in range(MOE_STEPS)]
    ts = [torch.randn(world * MOE_TOKENS, MOE_D, generator=g) for _ in range(MOE_STEPS)]
    shard = slice(rank * MOE_TOKENS, (rank + 1) * MOE_TOKENS)

    def model(opts):
        m = _MoEModel()
        for i, block in enumerate(m.blocks):
            m.blocks[i] = torch.compile(block, backend="mxfp8", options=opts) if opts else block
        return m

    def sharded(opts, mx, mp=MixedPrecisionPolicy()):
        m = model(opts)
        pmap = mxfx.fsdp.mx_all_gather(m, opts) if mx else {}
        for block in m.blocks:
            fully_shard(block.moe.router, mesh=mesh, mp_policy=mp)  # the expert unit holds the experts alone
            fully_shard(block.moe, mesh=mesh, mp_policy=mp)
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(m, mesh=mesh, mp_policy=mp)
        return m, pmap

    def avg(loss):
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return float(loss)

    def expert_gather_bytes(m) -> int:
        """All-gather bytes of one forward unshard of the first block's expert unit (gate_up and down)."""
        n0 = len(comm)
        m.blocks[0].moe.unshard()
        m.blocks[0].moe.reshard()
        return counting_pg.total(comm[n0:], "all_gather")

    # BF16 FSDP2 baseline (eager: FSDP gathers the same whether or not the blocks are compiled)
    bf16_model, _ = sharded(None, False, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    bf16_expert = expert_gather_bytes(bf16_model)
    comm.clear()
    _moe_train(bf16_model, xs, ts, shard, avg)
    bf16_ag = counting_pg.total(comm, "all_gather")

    report = []
    for fmt in ("mxfp8", "fp8_block"):
        opts = {**OPTS, "format": fmt}
        ref_losses = _moe_train(model(opts), xs, ts, slice(None), float)  # one process, the global batch
        plain_losses = _moe_train(sharded(opts, False)[0], xs, ts, shard, avg)
        m, pmap = sharded(opts, True)
        rows_cut = fmt == "fp8_block"  # down [128, 256]: 64-row shards would cut a 128-row block
        for i in range(2):
            got = {n: pmap[f"blocks.{i}.{n}"] for n in ("moe.gate_up", "moe.down", "up.weight", "down.weight")}
            assert got == {
                "moe.gate_up": fmt,
                "moe.down": fmt,
                "up.weight": fmt,
                "down.weight": got["down.weight"] if rows_cut else fmt,
            }, pmap
            assert not rows_cut or got["down.weight"].startswith("high precision (shape (128, 256)"), pmap
        comm.clear()
        mxfx.fsdp.stats.clear()
        losses = _moe_train(m, xs, ts, shard, avg)
        ag = counting_pg.total(comm, "all_gather")
        # the gathered forms equal the forms the plain FSDP2 run quantizes from its gathered FP32 weights
        assert losses == plain_losses, f"{fmt}: {losses} with the low-precision gather vs {plain_losses} without"
        # one process: the bound of tests/test_fsdp.py's MoE case (routing flips and BF16 expert gradients summed
        # per rank; the gap is the FP32-gather run's too, as the equality above shows)
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert gap <= MOE_LOSS_RTOL, f"{fmt}: losses {losses} vs one process {ref_losses}"
        n_mx = 3 if rows_cut else 4  # per block; every unit reshards after forward: one form per gather
        want = (
            {"gather_block": 2 * 2 * n_mx * MOE_STEPS}
            if rows_cut
            else {"gather_forward": 2 * n_mx * MOE_STEPS, "gather_dgrad": 2 * n_mx * MOE_STEPS}
        )
        assert dict(mxfx.fsdp.stats) == want, dict(mxfx.fsdp.stats)

        expert = expert_gather_bytes(m)
        experts = [p.shape for p in (m.blocks[0].moe.gate_up, m.blocks[0].moe.down)]
        values = sum(e * n * k for e, n, k in experts) // world  # per rank
        # mxfp8: one E8M0 byte per 32 values; fp8_block: one float32 per 128x128 block
        scale_bytes = sum(e * n * k // 128**2 * 4 for e, n, k in experts) // world if rows_cut else values // 32
        assert expert == values + scale_bytes and bf16_expert == 2 * values, (expert, bf16_expert, values)
        assert expert <= 0.52 * bf16_expert, (expert, bf16_expert)

        # byte identity with one-process quantization (forward forms from this forward, dgrad from the backward)
        _loss(m(xs[0][shard]), ts[0][shard]).backward()
        names = ("moe.gate_up", "moe.down", "up.weight")
        full = [_full(m, f"blocks.0.{n}") for n in names]
        m.blocks[0].moe.unshard()
        m.blocks[0].unshard()
        block = m.blocks[0]._orig_mod
        for w, f in zip((block.moe.gate_up, block.moe.down, block.up.weight), full):
            _byte_identical(w, f, fmt)
        m.blocks[0].reshard()
        m.blocks[0].moe.reshard()
        report.append(
            f"{fmt}: losses {losses} (one process: max gap {gap:.1e}); "
            f"expert unit all_gather {expert} B vs bf16 {bf16_expert} B "
            f"({expert / bf16_expert:.3f}x); all_gather per {MOE_STEPS} steps {ag} B vs bf16 {bf16_ag} B "
            f"({ag / bf16_ag:.3f}x)"
        )
    # fully_shard told to shard experts on dim 1 while mx_all_gather assumed dim 0: a clear error at the gather
    from torch.distributed.tensor import Shard

    moe = _MoEModel().blocks[0].moe
    assert mxfx.fsdp.mx_all_gather(moe, world_size=world)["gate_up"] == "mxfp8"
    fully_shard(moe, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 3 else None)
    try:
        moe.unshard()
        raise AssertionError("a gather sharded on dim 1 ran")
    except RuntimeError as e:
        assert "not on dim 0" in str(e) and "shard_placement_fn" in str(e), e
    print("MOEGATHER OK", *report, sep="\n")
    dist.destroy_process_group()


WORKERS = {
    "moe": _worker_moe,
    **{f"train_{layout}": lambda r, w, layout=layout: _worker(r, w, layout) for layout in LAYOUTS},
}

if __name__ == "__main__":
    run_worker(WORKERS)
