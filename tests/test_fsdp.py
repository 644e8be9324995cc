"""FSDP2 (``fully_shard``) under ``backend="mxfp8"`` on CPU (gloo), against one process.

Each test starts ``world`` processes running this file as a worker
(``python tests/test_fsdp.py CASE RANK WORLD PORT``, :func:`tests.helpers.launch`); the
worker asserts and exits non-zero on failure. The model is two residual MLP blocks of
width 64, trained 5 AdamW steps on a global batch split over the ranks; the reference is
the same model, compiled the same way, on one process with the global batch (FSDP averages
gradients over ranks, so the update is the same up to float summation order).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import launch  # noqa: E402

D, HIDDEN, STEPS, PER_RANK, LR = 64, 128, 5, 16, 1e-2
LOSS_RTOL = 1e-3  # MX rounding is the same on both sides; only fp32 summation order differs (and can flip a rounding)
OPTS = {"inner": "aot_eager"}  # CPU compile time; the rewrite is the same under Inductor


@pytest.mark.parametrize("layout", ["per_block", "whole"])
def test_fsdp2_trains_like_one_process(layout):
    """Per-step loss and final parameters of 2-process FSDP2 match one process within 1e-3 (stale caches drift ~6%)."""
    log = launch(__file__, f"train_{layout}", 2)
    assert log.count("TRAIN OK") == 2, log


# --------------------------------------------------------------------------- worker


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(D, HIDDEN), torch.nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x):
        # unrolled: with a loop, the graph break at each FSDP unit skips this whole frame
        # (Dynamo does not resume inside loops) and the root's projection would run eagerly
        x = self.layers[1](self.layers[0](x))
        return self.proj(x)


def _model() -> Model:
    torch.manual_seed(0)
    return Model()


def _data(world: int):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(world * PER_RANK, D, generator=g) for _ in range(STEPS)]
    ts = [torch.randn(world * PER_RANK, D, generator=g) for _ in range(STEPS)]
    return xs, ts


def _compile_per_block(m: Model) -> None:
    """torchtitan's order: each block compiled (fullgraph) before it is sharded."""
    for i, block in enumerate(m.layers):
        m.layers[i] = torch.compile(block, backend="mxfp8", options=OPTS, fullgraph=True)


def _train(m, run, xs, ts, shard, reduce_loss):
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = []
    for x, t in zip(xs, ts):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(run(x[shard]), t[shard])
        loss.backward()
        opt.step()
        losses.append(reduce_loss(loss.detach()))
    return losses


def _mx_ops(pm_list) -> list[tuple[str, str]]:
    """(kind, precision) of every weight GEMM over the precision maps, sorted: comparable across layouts."""
    return sorted((r.kind, r.forward) for pm in pm_list for r in pm.records if r.kind in ("linear", "grouped_mm"))


def _worker_train(rank: int, world: int, layout: str):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import mxfx

    dist.init_process_group("gloo", rank=rank, world_size=world)
    xs, ts = _data(world)

    ref = _model()
    if layout == "per_block":
        _compile_per_block(ref)
    ref_run = torch.compile(ref, backend="mxfp8", options=OPTS) if layout == "whole" else ref
    n0 = len(mxfx.all_reports())
    ref_losses = _train(ref, ref_run, xs, ts, slice(None), float)
    ref_ops = _mx_ops(mxfx.all_reports()[n0:])

    n_linears = 4 if layout == "per_block" else 5  # per block: the root's projection runs eagerly
    m = _model()
    if layout == "per_block":
        _compile_per_block(m)
    for block in m.layers:
        fully_shard(block)
    fully_shard(m)
    run = torch.compile(m, backend="mxfp8", options=OPTS) if layout == "whole" else m

    def mean_over_ranks(loss):
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return float(loss)

    n0 = len(mxfx.all_reports())
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses = _train(m, run, xs, ts, shard, mean_over_ranks)
    ops = _mx_ops(mxfx.all_reports()[n0:])

    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"{layout} step {step}: loss {a:.6f} vs one process {b:.6f}\n{losses}\n{ref_losses}"
    ref_params = {n.replace("_orig_mod.", ""): p for n, p in ref.named_parameters()}
    for name, p in m.named_parameters():
        full = p.full_tensor()
        r = ref_params[name.replace("_orig_mod.", "")]
        err = float((full - r).norm() / r.norm())
        assert err <= LOSS_RTOL, f"{layout} {name}: relative parameter error {err:.2e}"
    assert ops == ref_ops and ops.count(("linear", "mxfp8")) == n_linears, f"{layout}: MX ops {ops} vs one process {ref_ops}"
    dist.destroy_process_group()
    print("TRAIN OK", losses, ops)


if __name__ == "__main__":
    case, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    if case.startswith("train_"):
        _worker_train(rank, world, case.removeprefix("train_"))
    else:
        raise SystemExit(f"unknown case {case}")
