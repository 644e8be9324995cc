"""FSDP2 + expert parallel on a 2-D DeviceMesh, compiled with ``backend="mxfp8"``.

Run on CPU (gloo) or GPUs (NCCL):

    torchrun --nproc-per-node 4 examples/fsdp_ep_moe.py
    torchrun --nproc-per-node 4 examples/fsdp_ep_moe.py --device cuda

The mesh is ``("dp", "ep")`` = ``(world / EP, EP)``. Each block is a dense MLP plus a top-k
MoE (:class:`ep_moe.GroupedEPMoE`) whose routed experts are split over the ``"ep"`` ranks:
dispatch and combine all-to-alls move MXFP8 rows (qdata + one E8M0 scale per 32 values).
FSDP2 shards the expert weights over ``"dp"`` (the ranks holding the same experts) and every
other parameter (dense MLP, router) over all ranks. torchtitan's order: compile each block,
then ``fully_shard`` the experts, the router, the block and the root. Before sharding,
``mxfx.fsdp.mx_all_gather`` makes FSDP's all-gathers move the weights' MXFP8 forms (qdata + scales).

Gradient scaling: each rank's loss is the mean over its own tokens, so the global loss is their
mean over all ranks. An expert's gradient on one rank already sums the contributions of every
``"ep"`` peer's tokens (through the all-to-all's backward); the expert unit divides by the whole
world (not its ``"dp"`` size) after the reduce-scatter over ``"dp"``.

The script trains a few AdamW steps and prints the loss per step; ``--check`` also trains the same
model on one process (all experts local, the global batch) and prints the relative loss gap.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ep_moe import GroupedEPMoE  # noqa: E402

# ---- configuration (defaults run on a laptop CPU) ----
D_MODEL = 64
EXPERTS = 4
TOP_K = 2
EXPERT_HIDDEN = 64
EP = 2
TOKENS_PER_RANK = 32
STEPS = 3
LR = 1e-2
SEED = 0


class Block(nn.Module):
    """``x + MoE(x)``, then ``x + MLP(x)``; experts over ``ep_group`` (None: all local)."""

    def __init__(self, index: int, ep_group=None):
        super().__init__()
        self.moe = GroupedEPMoE(D_MODEL, EXPERTS, TOP_K, EXPERT_HIDDEN, group=ep_group, seed=SEED + index)
        self.up, self.down = nn.Linear(D_MODEL, 2 * D_MODEL), nn.Linear(2 * D_MODEL, D_MODEL)

    def forward(self, x):
        x = x + self.moe(x.bfloat16()).float()  # grouped GEMMs take BF16 activations; weights stay FP32
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, ep_group=None, n_blocks: int = 2):
        super().__init__()
        torch.manual_seed(SEED)  # dense weights: the same on every rank and in the one-process reference
        self.blocks = nn.ModuleList([Block(i, ep_group) for i in range(n_blocks)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def compile_blocks(model: Model, options: dict) -> None:
    """torchtitan's order, step 1: each block compiled on its own (the MoE's split sizes are data)."""
    torch._dynamo.config.capture_scalar_outputs = True
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="mxfp8", options=options)


def _moe(block):
    return block._orig_mod.moe if hasattr(block, "_orig_mod") else block.moe


def shard(model: Model, mesh, options: dict | None = None) -> dict[str, str]:
    """Step 2: experts over ``"dp"`` (divided by the world size), routers, blocks and root over all ranks.

    With ``options`` (the compile policy), the all-gathers move the weights' MXFP8 forms
    (``mxfx.fsdp.mx_all_gather``: the experts told their ``"dp"`` mesh first, then the rest the world's);
    returns its gather map.
    """
    from torch.distributed.fsdp import fully_shard

    import mxfx.fsdp

    world_mesh = mesh._flatten("dp_ep")
    gather_map = {}
    if options is not None:
        for i, block in enumerate(model.blocks):
            experts = mxfx.fsdp.mx_all_gather(_moe(block), options, world_size=mesh["dp"].size())
            gather_map.update({f"blocks.{i}.moe.{k}": v for k, v in experts.items()})
        gather_map.update(mxfx.fsdp.mx_all_gather(model, options, world_size=world_mesh.size()))
    for block in model.blocks:
        moe = _moe(block)
        fully_shard(moe.router, mesh=world_mesh)
        experts = fully_shard(moe, mesh=mesh["dp"])
        experts.set_gradient_divide_factor(float(mesh.size()))
        experts.set_force_sum_reduction_for_comms(True)  # SUM then divide: gloo has no PREMUL_SUM
        fully_shard(block, mesh=world_mesh)
    fully_shard(model, mesh=world_mesh)
    return gather_map


def batches(world: int, device):
    """``STEPS`` global batches ``(x, target)`` of ``world * TOKENS_PER_RANK`` tokens; rank r takes slice r."""
    g = torch.Generator().manual_seed(SEED + 1)
    n = world * TOKENS_PER_RANK
    return [
        (torch.randn(n, D_MODEL, generator=g).to(device), torch.randn(n, D_MODEL, generator=g).to(device))
        for _ in range(STEPS)
    ]


def train(model, data, rows: slice, mean_over_ranks=float) -> list[float]:
    """AdamW steps on ``data[rows]``; returns the loss per step (through ``mean_over_ranks``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, t in data:
        opt.zero_grad()
        loss = F.mse_loss(model(x[rows]), t[rows])
        loss.backward()
        opt.step()
        losses.append(mean_over_ranks(loss.detach()))
    return losses


def run(transport: str = "mxfp8", check: bool = False, device: str = "cpu") -> tuple[list[float], list[float] | None]:
    """Train on the process group (already initialized); returns (losses, one-process losses or None)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % EP or EXPERTS % EP:
        raise ValueError(f"world size {world} and {EXPERTS} experts must be multiples of EP={EP}")
    mesh = init_device_mesh(device, (world // EP, EP), mesh_dim_names=("dp", "ep"))
    # the router reads its weight outside mxfx's GEMMs (kept in its own precision): this rule also keeps its
    # all-gather in FP32 (mx_all_gather follows the policy)
    options = {
        "inner": "aot_eager" if device == "cpu" else "inductor",
        "rules": [{"module": "*.router", "precision": "bf16"}],
    }
    if transport == "bf16":
        options["transport"] = dict.fromkeys(["dispatch_fwd", "combine_fwd", "combine_bwd", "dispatch_bwd"], "bf16")
    data = batches(world, device)

    reference = None
    if check:  # the same model on one process: all experts local, the global batch
        ref = Model().to(device)
        compile_blocks(ref, options)
        reference = train(ref, data, slice(None))

    model = Model(ep_group=mesh["ep"].get_group()).to(device)
    compile_blocks(model, options)
    gather_map = shard(model, mesh, options)
    if rank == 0:
        print("all-gather forms:", ", ".join(f"{k}: {v}" for k, v in gather_map.items()))

    def mean_over_ranks(loss):
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return float(loss)

    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    return train(model, data, rows, mean_over_ranks), reference


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--transport", default="mxfp8", choices=["mxfp8", "bf16"])
    p.add_argument("--check", action="store_true", help="also train on one process and compare the losses")
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    losses, reference = run(args.transport, args.check, args.device)
    if dist.get_rank() == 0:
        print("loss per step:", ", ".join(f"{v:.5f}" for v in losses))
        if reference is not None:
            gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            print("one process:  ", ", ".join(f"{v:.5f}" for v in reference), f"(max relative gap {gap:.2e})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
