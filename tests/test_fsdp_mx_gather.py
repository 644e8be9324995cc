"""MX weight all-gather under FSDP2 (``mxfx.fsdp.mx_all_gather``) on 2 gloo processes, against one process.

Worker cases run this file as ``python tests/test_fsdp_mx_gather.py CASE RANK WORLD PORT`` (:func:`helpers.launch`).
The model and data are tests/test_fsdp.py's (two residual MLP blocks of width 64 and a root projection).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import launch  # noqa: E402
from test_fsdp import LOSS_RTOL, OPTS, PER_RANK, _compile_per_block, _data, _loss, _model, _train  # noqa: E402


@pytest.mark.parametrize("layout", ["whole", "whole_reshard", "per_block", "per_block_bf16"])
def test_mx_all_gather_trains_like_one_process(layout):
    """Losses within 1e-3 of one-process mxfp8 over 5 AdamW steps; gathered forms byte-identical to quantizing
    the full weight on one process; forward form in forward, dgrad form in backward; DCP save/load resumes
    bit-identically. ``whole``: the root (not resharded after forward, FSDP's default) gathers both forms once;
    ``per_block_bf16``: ``param_dtype=torch.bfloat16`` (biases gather BF16, blocks compute in BF16; the MX forms
    still come from the FP32 shards): losses within 5e-3 as in tests/test_fsdp.py. ``whole_reshard``: the root
    reshards too, and all-gather bytes per step are <= 0.55x the BF16 FSDP2 run's
    (same sharding) (asserted; the FP32 biases keep it above 33/64)."""
    log = launch(__file__, f"train_{layout}", 2, timeout_s=240)
    assert log.count("MXGATHER OK") == 2, log


def test_eligibility_fallback():
    """A weight whose shards would cut a 32-row group gathers high precision, and the gather map says so."""
    import mxfx.fsdp

    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 96))
    pmap = mxfx.fsdp.mx_all_gather(m, world_size=2)
    assert pmap["0.weight"] == "mx" and pmap["1.weight"].startswith("high precision"), pmap
    assert type(m[0].weight.data).__name__ == "MXWeight" and type(m[1].weight.data) is torch.Tensor
    sd = m.state_dict()
    assert type(sd["0.weight"]).__name__ == "MXWeight" and torch.equal(sd["0.weight"]._tensor, m[0].weight._tensor)
    with pytest.raises(ValueError, match="rule"):
        mxfx.fsdp.mx_all_gather(torch.nn.Linear(64, 64), rule="nearest")


def _byte_identical(unsharded: torch.Tensor, full: torch.Tensor) -> None:
    """The cache forms installed for the gathered ``unsharded`` weight equal one-process quantization of ``full``."""
    from mxfx import cache, kernels

    entry = cache._entries[cache._key(unsharded)]
    q, s = kernels.quantize_lastdim(full, "rceil")
    qt, st = kernels.quantize_lastdim(full.transpose(0, 1), "rceil")
    for o, (rq, rs) in (("forward", (q, s)), ("dgrad", (qt, st))):
        gq, gs = entry.forms[("rceil", o)]
        assert torch.equal(gq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(gs, rs), f"{o} form differs"


def _worker(rank: int, world: int, layout: str):
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import counting_pg
    import mxfx.fsdp

    comm: list = []
    counting_pg.register(comm)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh.from_group(dist.new_group(backend=counting_pg.BACKEND), "cpu")
    xs, ts = _data(world)
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

    ref = _model()
    if not whole:
        _compile_per_block(ref)
    ref_losses = _train(ref, torch.compile(ref, backend="mxfp8", options=OPTS) if whole else ref,
                        xs, ts, slice(None), float)

    bf16_ag = 0
    if layout == "whole_reshard":  # the BF16 FSDP2 baseline, same sharding
        m, _, run = sharded(False, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        comm.clear()
        _train(m, run, xs, ts, shard, avg)
        bf16_ag = counting_pg.total(comm, "all_gather")

    m, pmap, run = sharded(True, MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None))
    assert list(pmap.values()) == ["mx"] * (5 if whole else 4), pmap
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
    print("MXGATHER OK", layout, losses, ref_losses, f"all_gather {ag} B vs bf16 {bf16_ag} B;"
          f" reduce_scatter {rs} B; all_to_all {a2a} B")
    dist.destroy_process_group()


def _full(m, name: str) -> torch.Tensor:
    """The full FP32 value of sharded parameter ``name`` (``_orig_mod.`` prefixes ignored)."""
    for n, p in m.named_parameters():
        if n.replace("_orig_mod.", "") == name:
            full = p.full_tensor()
            return full._tensor if hasattr(full, "_tensor") else full
    raise KeyError(name)


if __name__ == "__main__":
    case, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    if case.startswith("train_"):
        _worker(rank, world, case.removeprefix("train_"))
    else:
        raise SystemExit(f"unknown case {case}")
