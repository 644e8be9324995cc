"""Expert-parallel MoE layer: router, all-to-all dispatch, local experts, all-to-all combine.

Run on CPU (gloo) or GPUs (NCCL), unchanged:

    torchrun --nproc-per-node 2 examples/ep_moe.py
    torchrun --nproc-per-node 2 examples/ep_moe.py --device cuda

Each rank holds ``n_experts / world`` experts and its own tokens. The layer is
compiled twice: ``backend="mxfp8"`` with every all-to-all direction in BF16
(the rows travel as written), and with the default MXFP8 transport (the recipe,
"Smaller Dispatch and Combine Payloads", "Routed Experts": dispatch and combine, forward and backward). The script
prints how far the MXFP8 output and gradients are from the BF16 ones and the
row payload bytes each direction sent. Split sizes come from the routing counts
(``.tolist()`` under ``capture_scalar_outputs``): one graph for every routing outcome.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

# ---- configuration (defaults run on a laptop CPU) ----
D_MODEL = 128
EXPERTS_PER_RANK = 2
EXPERT_HIDDEN = 128
TOP_K = 2
TOKENS_PER_RANK = 64
SEED = 0


class EPMoE(nn.Module):
    """Top-k routed MoE whose experts are spread over the ranks of ``group``.

    ``group=None`` runs every expert in this process (no collectives): the
    single-process form of the same layer. Expert weights are drawn for all
    ``n_experts`` from ``seed`` and each rank keeps its slice, so any world size
    builds the same global layer.

    Shapes: ``x [T, D]`` -> ``[T, D]`` in ``x.dtype``. Routed rows are sorted by
    expert; rank r owns experts ``[r*E_local, (r+1)*E_local)``.
    """

    def __init__(self, d_model, n_experts, top_k, hidden, group=None, seed=SEED):
        super().__init__()
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        if n_experts % self.world:
            raise ValueError(f"n_experts={n_experts} must be a multiple of the world size {self.world}")
        self.n_experts, self.top_k, self.e_local = n_experts, top_k, n_experts // self.world
        g = torch.Generator().manual_seed(seed)
        self.router = nn.Linear(d_model, n_experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(n_experts, d_model, generator=g) / d_model**0.5)
        w1 = torch.randn(n_experts, hidden, d_model, generator=g) / d_model**0.5
        w2 = torch.randn(n_experts, d_model, hidden, generator=g) / hidden**0.5
        mine = slice(rank * self.e_local, (rank + 1) * self.e_local)
        self.w1 = nn.Parameter(w1[mine].clone())  # [E_local, H, D]
        self.w2 = nn.Parameter(w2[mine].clone())  # [E_local, D, H]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on rows ``x [N, D]`` (an MLP in x's dtype)."""
        return F.linear(F.gelu(F.linear(x, self.w1[e].to(x.dtype))), self.w2[e].to(x.dtype))

    def all_to_all(self, x, output_split_sizes, input_split_sizes):
        """Rows of ``x`` to their ranks (``group=None``: nothing moves)."""
        if self.group is None:
            return x
        return funcol.all_to_all_single_autograd(x, output_split_sizes, input_split_sizes, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            probs = self.router(x.float()).softmax(-1)
        weight, idx = probs.topk(self.top_k, dim=-1)
        return self.route(x, idx, weight / weight.sum(-1, keepdim=True))

    def route(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Dispatch rows ``x [T, D]`` to experts ``idx [T, k]``, combine with ``weight [T, k]``."""
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments sorted by expert
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        # counts_in[s*E_local + e]: rows source rank s sends to my local expert e (split metadata)
        counts_in = counts if self.group is None else funcol.all_to_all_single(counts, None, None, self.group)
        send = counts.view(self.world, self.e_local).sum(1).tolist()
        recv = counts_in.view(self.world, self.e_local).sum(1).tolist()
        torch._check(sum(send) == t * k)

        rows = self.all_to_all(x[order // k], recv, send)  # dispatch
        # local expert of each received row: segment of counts_in it falls in, modulo E_local
        ends = counts_in.cumsum(0)
        seg = torch.searchsorted(ends, torch.arange(rows.shape[0], device=x.device), right=True)
        local = seg % self.e_local
        out = torch.zeros_like(rows)
        for e in range(self.e_local):
            out = torch.where((local == e).unsqueeze(-1), self.expert(e, rows), out)
        back = self.all_to_all(out, send, recv)  # combine
        unsorted = torch.zeros(t * k, x.shape[-1], dtype=back.dtype, device=x.device).index_copy(0, order, back)
        return (unsorted.view(t, k, -1) * weight.unsqueeze(-1).to(back.dtype)).sum(1)


class GroupedEPMoE(nn.Module):
    """Top-k MoE whose ``n_experts`` SwiGLU experts are split over the ranks of ``group``.

    ``group=None``: all experts in this process, no collectives (the reference).
    Weights are drawn for all experts from ``seed``; each rank keeps its slice.
    Shapes: ``x [T, D]`` -> ``[T, D]``.
    """

    def __init__(self, d, n_experts, top_k, hidden, group=None, seed=0):
        super().__init__()
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        self.n_experts, self.top_k, self.e_local = n_experts, top_k, n_experts // self.world
        g = torch.Generator().manual_seed(seed)
        self.router = nn.Linear(d, n_experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(n_experts, d, generator=g) / d**0.5)
        gate_up = torch.randn(n_experts, 2 * hidden, d, generator=g) / d**0.5
        down = torch.randn(n_experts, d, hidden, generator=g) / hidden**0.5
        mine = slice(rank * self.e_local, (rank + 1) * self.e_local)
        self.gate_up = nn.Parameter(gate_up[mine].clone())  # [E_local, 2H, D]
        self.down = nn.Parameter(down[mine].clone())  # [E_local, D, H]

    def _a2a(self, x, out_splits, in_splits):
        if self.group is None:
            return x
        return funcol.all_to_all_single_autograd(x, out_splits, in_splits, self.group)

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            probs = self.router(x.float()).softmax(-1)
        weight, idx = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device).scatter_add(
            0, flat, torch.ones_like(flat)
        )
        counts_in = counts if self.group is None else funcol.all_to_all_single(counts, None, None, self.group)
        send = counts.view(self.world, self.e_local).sum(1).tolist()
        recv = counts_in.view(self.world, self.e_local).sum(1).tolist()
        torch._check(sum(send) == t * k)
        rows = self._a2a(x[order // k], recv, send)  # dispatch: [(source rank, local expert)] order
        # regroup received rows by local expert for the grouped GEMMs
        seg = torch.searchsorted(counts_in.cumsum(0), torch.arange(rows.shape[0], device=x.device), right=True)
        local = seg % self.e_local
        by_expert = torch.argsort(local, stable=True)
        offs = counts_in.view(self.world, self.e_local).sum(0).cumsum(0).to(torch.int32)
        xs = rows[by_expert]
        gu = torch._grouped_mm(xs, self.gate_up.to(x.dtype).transpose(-2, -1), offs=offs)
        g_, u_ = gu.chunk(2, dim=-1)
        h = (F.silu(g_) * u_).contiguous()
        ys = torch._grouped_mm(h, self.down.to(x.dtype).transpose(-2, -1), offs=offs)
        out = torch.empty_like(ys).index_copy(0, by_expert, ys)
        back = self._a2a(out, send, recv)  # combine: rows come back in `order`
        # torchtitan's combine: scale the rows by their route weights in fp32, add them into their tokens
        weighted = back.float() * weight.reshape(-1)[order].reshape(-1, 1)
        y = torch.zeros(t, x.shape[-1], dtype=torch.float32, device=x.device).index_add(0, order // k, weighted)
        return y.to(x.dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch._dynamo.config.capture_scalar_outputs = True

    layer = EPMoE(D_MODEL, EXPERTS_PER_RANK * world, TOP_K, EXPERT_HIDDEN, group=dist.group.WORLD).to(dev)
    x = torch.randn(TOKENS_PER_RANK, D_MODEL, generator=torch.Generator().manual_seed(SEED + 1 + rank)).to(dev, dtype)
    results = {}
    for name, transport in (
        ("bf16", dict.fromkeys(["dispatch_fwd", "combine_fwd", "combine_bwd", "dispatch_bwd"], "bf16")),
        ("mxfp8", {}),
    ):
        torch._dynamo.reset()
        opts = {"inner": "aot_eager", "transport": transport, "passes": {"linear": False}}
        compiled = torch.compile(layer, backend="mxfp8", options=opts)
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = compiled(xi)
        y.float().square().sum().backward()
        results[name] = (y.detach(), xi.grad, layer.w1.grad.clone(), layer.w2.grad.clone())

    # row counts of this rank's dispatch (sent) and combine (received rows sent back)
    with torch.no_grad():
        _, idx = layer.router(x.float()).softmax(-1).topk(TOP_K, dim=-1)
    counts = torch.bincount(idx.reshape(-1), minlength=layer.n_experts)
    counts_in = funcol.all_to_all_single(counts, None, None, dist.group.WORLD).wait()
    sent, received = int(counts.sum()), int(counts_in.sum())
    per_value = {"bf16": float(torch.finfo(dtype).bits // 8), "mxfp8": 33 / 32}

    names = ("output", "x.grad", "w1.grad", "w2.grad")
    errs = [_rel(a, b) for a, b in zip(results["mxfp8"], results["bf16"])]
    lines = [
        f"rank {rank}: MXFP8 vs {args.dtype} transport, relative error "
        + ", ".join(f"{n} {e:.2e}" for n, e in zip(names, errs))
    ]
    for direction, nrows in (
        ("dispatch fwd", sent),
        ("combine fwd", received),
        ("combine bwd", sent),
        ("dispatch bwd", received),
    ):
        b16, bmx = nrows * D_MODEL * per_value["bf16"], nrows * D_MODEL * per_value["mxfp8"]
        lines.append(
            f"rank {rank}:   {direction:13s} {nrows:4d} rows: {args.dtype} {b16:8.0f} B, "
            f"mxfp8 {bmx:8.0f} B ({1 - bmx / max(b16, 1):.1%} less)"
        )
    for r in range(world):
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    ok = all(e < 0.1 for e in errs)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(f"rank {rank}: MXFP8 transport deviates more than 10% from {args.dtype}")


if __name__ == "__main__":
    main()
