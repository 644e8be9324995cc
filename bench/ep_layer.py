"""Expert-parallel MoE layer on several processes: BF16 vs MXFP8 all-to-all transport (the recipe, "Smaller Dispatch
and Combine Payloads", "Routed Experts").

Run under torchrun, on GPUs (NCCL) or CPU processes (gloo):

    torchrun --nproc-per-node 2 bench/ep_layer.py                 # one GPU per rank
    torchrun --nproc-per-node 2 bench/ep_layer.py --device cpu --quick

Layer: router (FP32) -> top-k -> all-to-all dispatch -> local routed experts as two
``torch._grouped_mm`` (fused gate_up, SwiGLU, down; the form HF transformers and
torchtitan trace) -> all-to-all combine -> weighted sum. Split sizes come from the
routing counts (``.tolist()``), so one compiled graph serves every routing outcome.

Arms, same weights and tokens, in one process group:

* ``bf16``: ``torch.compile`` with the default compiler (no mxfx);
* ``mx/bf16-a2a``: ``backend="mxfp8"`` with every all-to-all direction in BF16;
* ``mx/mxfp8-a2a``: ``backend="mxfp8"`` with the default MXFP8 transport.

Reports, per arm, the layer's forward+backward time (median over ``--reps``, the
slowest rank), and for each all-to-all direction the row payload bytes this rank
sent and the time of the transport alone at this step's split sizes: BF16
``all_to_all_single`` vs mxfx's MXFP8 transport (quantize, qdata and scales
collectives, dequantize). Correctness: every rank also builds the whole layer in one
process (all experts, no collectives) and compares its tokens' outputs and input
gradients; with BF16 transport they must agree to summation order, with MXFP8
transport within the rounding of one extra MX quantization.

Writes the markdown table to ``$MXFX_BENCH_OUT/ep_layer.md`` when that variable is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
from ep_moe import GroupedEPMoE  # noqa: E402

from mxfx.ops.all_to_all import mx_all_to_all  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import emit  # noqa: E402

DIRECTIONS = ("dispatch_fwd", "combine_fwd", "combine_bwd", "dispatch_bwd")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _timer(device):
    if device.type == "cuda":

        def run(fn, reps):
            times = []
            for _ in range(reps):
                dist.barrier()
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            return statistics.median(times)
    else:

        def run(fn, reps):
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
            return statistics.median(times)

    return run


def _slowest(ms: float, device) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="toy sizes (CPU smoke run)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64, help="routed experts in total")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    if a.quick:
        a.tokens, a.d, a.experts, a.topk, a.hidden, a.reps = 64, 128, 4, 2, 64, 3
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(a.device, torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16
    torch._dynamo.config.capture_scalar_outputs = True
    inner = "inductor" if a.device == "cuda" else "aot_eager"
    bench = _timer(dev)

    layer = GroupedEPMoE(a.d, a.experts, a.topk, a.hidden, group=dist.group.WORLD).to(dev)
    ref_layer = GroupedEPMoE(a.d, a.experts, a.topk, a.hidden, group=None).to(dev)
    xs_all = torch.randn(world, a.tokens, a.d, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    x = xs_all[rank].contiguous()

    bf16_all = dict.fromkeys(DIRECTIONS, "bf16")
    arms = {
        "bf16": (None, {}),
        "mx/bf16-a2a": ("mxfp8", {"inner": inner, "transport": bf16_all}),
        "mx/mxfp8-a2a": ("mxfp8", {"inner": inner}),
    }
    results, times = {}, {}
    for name, (backend, opts) in arms.items():
        for ref in (False, True):
            torch._dynamo.reset()
            mod = ref_layer if ref else layer
            fn = torch.compile(mod, backend=backend, options=opts) if backend else torch.compile(mod, backend=inner)
            xi = x.clone().requires_grad_(True)
            mod.zero_grad()
            y = fn(xi)
            y.float().square().mean().backward()
            results[(name, ref)] = (y.detach(), xi.grad.detach())
            if ref:
                continue

            def step():
                xi.grad = None
                fn(xi).float().square().mean().backward()

            step()
            times[name] = _slowest(bench(step, a.reps), dev)
        if name == "bf16":
            # the reference process holds every expert; drop its MX caches before the next arm
            pass

    # transport alone, at this step's split sizes
    with torch.no_grad():
        _, idx = layer.router(x.float()).softmax(-1).topk(a.topk, dim=-1)
    counts = torch.bincount(idx.reshape(-1), minlength=a.experts)
    counts_in = funcol.all_to_all_single(counts, None, None, dist.group.WORLD).wait()
    send = counts.view(world, -1).sum(1).tolist()
    recv = counts_in.view(world, -1).sum(1).tolist()
    routes = {
        "dispatch_fwd": (recv, send),
        "combine_fwd": (send, recv),
        "combine_bwd": (recv, send),
        "dispatch_bwd": (send, recv),
    }
    transport = {}
    for direction, (out_s, in_s) in routes.items():
        rows = torch.randn(sum(in_s), a.d, device=dev, dtype=dtype)
        bf = lambda: funcol.all_to_all_single(rows, out_s, in_s, dist.group.WORLD).wait()  # noqa: E731
        mx = lambda: mx_all_to_all(rows, out_s, in_s, dist.group.WORLD)  # noqa: E731
        bf(), mx()
        t_bf, t_mx = _slowest(bench(bf, a.reps), dev), _slowest(bench(mx, a.reps), dev)
        n = sum(in_s)
        transport[direction] = (n, n * a.d * 2, n * a.d * 33 // 32, t_bf, t_mx)

    errs = {}
    for name in arms:
        ep, ref = results[(name, False)], results[(name, True)]
        errs[name] = (_rel(ep[0], ref[0]), _rel(ep[1], ref[1]))
    errs["mxfp8 vs bf16 transport"] = tuple(
        _rel(a_, b_) for a_, b_ in zip(results[("mx/mxfp8-a2a", False)], results[("mx/bf16-a2a", False)])
    )
    err_t = torch.tensor([v for e in errs.values() for v in e], dtype=torch.float64, device=dev)
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX)
    err_max = dict(zip(errs, err_t.view(-1, 2).tolist()))

    if rank == 0:
        hw = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        lines = [
            f"## EP MoE layer, {world} ranks ({a.device}, {hw}, {'nccl' if a.device == 'cuda' else 'gloo'}), "
            f"torch {torch.__version__}",
            "",
            f"{a.tokens} tokens/rank, d={a.d}, {a.experts} experts top-{a.topk} ({a.experts // world}/rank), "
            f"expert hidden {a.hidden}, "
            f"SwiGLU grouped GEMMs, BF16 activations, FP32 weights; slowest rank, median of {a.reps}.",
            "",
            "| arm | layer fwd+bwd ms | vs bf16 | max rel err vs 1-process (out, dx) |",
            "|---|---|---|---|",
        ]
        for name in arms:
            e = err_max[name]
            lines.append(
                f"| {name} | {times[name]:.3f} | {times['bf16'] / times[name]:.2f}x | {e[0]:.2e}, {e[1]:.2e} |"
            )
        e = err_max["mxfp8 vs bf16 transport"]
        lines += [
            "",
            f"MXFP8 vs BF16 transport under backend=mxfp8 (max over ranks): out {e[0]:.2e}, dx {e[1]:.2e}.",
            "",
            "| direction (rank 0) | rows sent | BF16 bytes | MXFP8 bytes | BF16 a2a ms "
            "| MXFP8 a2a ms (Q + 2 collectives + DQ) | speed |",
            "|---|---|---|---|---|---|---|",
        ]
        for direction, (n, b16, bmx, t_bf, t_mx) in transport.items():
            lines.append(
                f"| {direction} | {n} | {b16} | {bmx} ({1 - bmx / max(b16, 1):.1%} less) | {t_bf:.3f} | {t_mx:.3f} "
                f"| {t_bf / t_mx:.2f}x |"
            )
        emit("ep_layer.md", "\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
