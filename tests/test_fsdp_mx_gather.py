"""MX weight all-gather under FSDP2 (``mxfx.fsdp.mx_all_gather``) on 2 gloo processes, against one process.

Worker cases run this file as ``python tests/test_fsdp_mx_gather.py CASE RANK WORLD PORT`` (:func:`helpers.launch`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import launch  # noqa: E402
from test_fsdp import LOSS_RTOL, OPTS, PER_RANK, _data, _model, _train  # noqa: E402


def test_mx_all_gather_trains_like_one_process_and_moves_mx_bytes():
    """Gathered forms byte-identical to one-process quantization; losses within 1e-3 of one process over 5 AdamW
    steps; all-gather bytes <= 0.55x of a BF16 FSDP2 run; DCP state dict holds the FP32 values."""
    log = launch(__file__, "train", 2, timeout_s=240)
    assert log.count("MXGATHER OK") == 2, log


def test_eligibility_fallback():
    """A weight whose shards would cut a 32-row group gathers high precision, and says so."""
    import mxfx.fsdp

    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 96))
    pmap = mxfx.fsdp.mx_all_gather(m, world_size=2)
    assert pmap["0.weight"] == "mx" and pmap["1.weight"].startswith("high precision"), pmap
    assert type(m[0].weight.data).__name__ == "MXWeight" and type(m[1].weight.data) is torch.Tensor


def _worker(rank: int, world: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import counting_pg
    import mxfx
    import mxfx.fsdp
    from mxfx import cache, kernels

    comm: list = []
    counting_pg.register(comm)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh.from_group(dist.new_group(backend=counting_pg.BACKEND), "cpu")
    xs, ts = _data(world)
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    def avg(loss):
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return float(loss)

    ref = _model()
    ref_losses = _train(ref, torch.compile(ref, backend="mxfp8", options=OPTS), xs, ts, slice(None), float)

    def sharded(mx, mp):
        m = _model()
        pmap = mxfx.fsdp.mx_all_gather(m) if mx else {}
        for block in m.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(m, mesh=mesh, mp_policy=mp)
        return m, pmap  # compiled whole below: every linear runs through mxfx's GEMMs

    # BF16 FSDP2 baseline bytes
    m, _ = sharded(False, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    comm.clear()
    _train(m, torch.compile(m, backend="mxfp8", options=OPTS), xs, ts, shard, avg)
    bf16_ag = counting_pg.total(comm, "all_gather")

    m, pmap = sharded(True, MixedPrecisionPolicy())
    assert all(v == "mx" for v in pmap.values()) and len(pmap) == 5, pmap
    comm.clear()
    run = torch.compile(m, backend="mxfp8", options=OPTS)
    losses = _train(m, run, xs, ts, shard, avg)
    ag, rs, a2a = (counting_pg.total(comm, c) for c in ("all_gather", "reduce_scatter", "all_to_all"))
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: loss {a:.6f} vs one process {b:.6f}\n{losses}\n{ref_losses}"
    assert ag <= 0.55 * bf16_ag, f"MX all-gather {ag} B vs BF16 {bf16_ag} B"

    # byte identity: forms installed for the gathered weight == quantizing the full FP32 weight on one process
    x = xs[-1][shard]
    loss = torch.nn.functional.mse_loss(run(x), ts[-1][shard])
    loss.backward()  # forward and dgrad gathers both ran; the last one left the unsharded weights' forms
    up = m.layers[0]._orig_mod.up if hasattr(m.layers[0], "_orig_mod") else m.layers[0].up
    full = up.weight.full_tensor()._tensor if hasattr(up.weight.full_tensor(), "_tensor") else up.weight.full_tensor()
    entries = [e for e in cache._entries.values() if e.shape == tuple(full.shape) and ("rceil", "dgrad") in e.forms
               and ("rceil", "forward") in e.forms]
    q, s = kernels.quantize_lastdim(full, "rceil")
    qt, st = kernels.quantize_lastdim(full.transpose(0, 1), "rceil")
    match = [e for e in entries
             if torch.equal(e.forms[("rceil", "forward")][0].view(torch.uint8), q.view(torch.uint8))
             and torch.equal(e.forms[("rceil", "forward")][1], s)
             and torch.equal(e.forms[("rceil", "dgrad")][0].view(torch.uint8), qt.view(torch.uint8))
             and torch.equal(e.forms[("rceil", "dgrad")][1], st)]
    assert match, f"no gathered forms byte-identical to one-process quantization among {len(entries)} entries"

    sd = m.state_dict()
    assert not any("cache" in k for k in sd)
    print("MXGATHER OK", losses, ref_losses, f"all_gather {ag} B vs bf16 {bf16_ag} B ({ag / bf16_ag:.3f}x);"
          f" reduce_scatter {rs} B; all_to_all {a2a} B")
    dist.destroy_process_group()


if __name__ == "__main__":
    case, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    if case == "train":
        _worker(rank, world)
    else:
        raise SystemExit(f"unknown case {case}")
