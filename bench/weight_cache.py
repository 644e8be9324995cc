"""Weight caches vs per-call weight quantization in a training step (the recipe, "Forward, Dgrad, and Wgrad Need
Different Operands", "Autograd Must Carry qdata and Scales as One Value", "DDP Must Be MXFP8-Aware").

A small MoE-ish model of ``nn.Linear`` layers (dense soft routing over experts, so
the graph has no data-dependent shapes; the router stays BF16 by policy), trained
with ``torch.compile(model, backend="mxfp8")``, 4 microbatches per step (``--microbatches``) and an
AdamW (foreach) step. Modes:

* ``cached``: :mod:`mxfx.runtime.cache`, forward/dgrad weight operands rebuilt once per step: the forward
  forms at the refresh, the dgrad forms by the first backward (the default).
* ``cached-at-refresh``: the same with ``mxfx.runtime.cache.set_dgrad_at_refresh(True)``: both forms at the
  refresh (one pass over each weight where the GEMM is emulated).
* ``per-call``: every GEMM quantizes its weight (the linear op's ``weight_operands``
  patched back to the pre-cache behaviour): 2 quantizations per weight per microbatch.

Weight-quantization time is the profiler total of a ``weight_quantize`` range wrapped
around each weight quantization (device time on CUDA, CPU time otherwise).

Usage: ``python bench/weight_cache.py`` (CUDA, ~1.5 min on an H200) or
``python bench/weight_cache.py --device cpu`` (toy size). Prints a markdown table;
writes it to ``$MXFX_BENCH_OUT/weight_cache.md`` when that variable is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mxfx.kernels.mx import device_path  # noqa: E402
from mxfx.runtime import cache  # noqa: E402
from mxfx.ops import linear as mx_linear_mod  # noqa: E402
from _results import emit  # noqa: E402  (bench/ is on sys.path when a script runs)

RANGE = "weight_quantize"


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


class MoEish(nn.Module):
    """``layers`` blocks of (router + ``experts`` dense-routed experts + shared expert), residual."""

    def __init__(self, d, h, experts, layers):
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            blk = nn.Module()
            blk.router = nn.Linear(d, experts, bias=False)
            blk.experts = nn.ModuleList(Expert(d, h) for _ in range(experts))
            blk.shared = Expert(d, h)
            self.blocks.append(blk)

    def forward(self, x):
        for blk in self.blocks:
            probs = blk.router(x).float().softmax(-1).to(x.dtype)
            y = blk.shared(x)
            for i, e in enumerate(blk.experts):
                y = y + probs[..., i : i + 1] * e(x)
            x = x + y
        return x


def _ranged_quantize(fn):
    def run(*args, **kwargs):
        with record_function(RANGE):
            return fn(*args, **kwargs)

    return run


_per_call_count = [0]


@torch.library.custom_op("mxfx_bench::weight_quantize", mutates_args=())
def _per_call_weight_quantize(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    _per_call_count[0] += 1
    w = weight if orientation == "forward" else weight.transpose(-2, -1)
    with record_function(RANGE):
        q, s = device_path.quantize_lastdim(w, rule)
        return q.contiguous(), s.contiguous()


@_per_call_weight_quantize.register_fake
def _(weight, rule, orientation):
    shape = list(weight.shape) if orientation == "forward" else [*weight.shape[:-2], weight.shape[-1], weight.shape[-2]]
    return weight.new_empty(shape, dtype=torch.float8_e4m3fn), weight.new_empty(
        [*shape[:-1], shape[-1] // 32], dtype=torch.uint8
    )


def per_call_weight_operands(weight, rule, orientation, keep_dequantized):
    with torch.no_grad():
        return (*_per_call_weight_quantize(weight, rule, orientation), None)


def run_mode(mode, args, device):
    torch._dynamo.reset()
    cache.clear()
    cache.reset_stats()
    _per_call_count[0] = 0
    original, original_cache_quantize = mx_linear_mod.weight_operands, cache.forms._quantize
    cache.forms._quantize = _ranged_quantize(original_cache_quantize)
    previous = cache.set_dgrad_at_refresh(mode == "cached-at-refresh")
    if mode == "per-call":
        mx_linear_mod.weight_operands = per_call_weight_operands
    try:
        torch.manual_seed(0)
        model = MoEish(args.d, args.h, args.experts, args.layers).to(device)
        cm = torch.compile(model, backend="mxfp8", options={"inner": args.inner})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        step_fn = (
            torch.compile(opt.step, backend="mxfp8", options={"inner": args.inner}) if args.compiled_step else opt.step
        )
        xs = [torch.randn(args.tokens, args.d, device=device) for _ in range(args.microbatches)]

        def train_step():
            for x in xs:
                with torch.autocast(device.type, torch.bfloat16):
                    loss = cm(x).float().square().mean()
                loss.backward()
            step_fn()
            opt.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            train_step()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        cache.reset_stats()
        _per_call_count[0] = 0
        times = []
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                train_step()
                sync()
                times.append(time.perf_counter() - t0)
        q_us = 0.0
        for ev in prof.key_averages():
            if ev.key == RANGE:
                q_us += ev.device_time_total if device.type == "cuda" else ev.cpu_time_total
        calls = _per_call_count[0] if mode == "per-call" else cache.stats()["quantize"]
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
        return {
            "mode": mode,
            "step_ms": 1e3 * statistics.median(times),
            "wq_ms": q_us / 1e3 / args.steps,
            "wq_calls": calls / args.steps,
            "cache_mib": cache.persistent_bytes() / 2**20,
            "peak_mib": peak,
            "weights": sum(1 for n, p in model.named_parameters() if p.dim() == 2 and "router" not in n),
        }
    finally:
        mx_linear_mod.weight_operands, cache.forms._quantize = original, original_cache_quantize
        cache.set_dgrad_at_refresh(previous)


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--inner", default=None, help="inner compiler (default: inductor on cuda, aot_eager on cpu)")
    ap.add_argument("--compiled-step", action="store_true", help="also compile optimizer.step with the mxfp8 backend")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--microbatches",
        type=int,
        default=4,
        help="per optimizer step; with 1, the forward's peak is where building dgrad forms at first use saves",
    )
    ap.add_argument("--d", type=int, default=None)
    ap.add_argument("--h", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    defaults = (
        dict(d=2048, h=4096, experts=8, layers=2, tokens=2048, steps=10)
        if gpu
        else dict(d=64, h=128, experts=4, layers=1, tokens=128, steps=2)
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.inner = args.inner or ("inductor" if gpu else "aot_eager")

    rows = [run_mode(m, args, device) for m in ("per-call", "cached", "cached-at-refresh")]
    title = (
        f"weight caches, {device.type} ({torch.cuda.get_device_name() if gpu else 'cpu'}), inner={args.inner}, "
        f"d={args.d} h={args.h} experts={args.experts} layers={args.layers} tokens/microbatch={args.tokens}, "
        f"{args.microbatches} microbatches/step, {'compiled' if args.compiled_step else 'eager'} AdamW step, "
        f"{rows[0]['weights']} MX weights"
    )
    lines = [
        f"## {title}",
        "",
        "| mode | step ms (median) | weight Q ms/step | weight Q calls/step | cache MiB | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = "n/a" if r["peak_mib"] != r["peak_mib"] else f"{r['peak_mib']:.0f}"
        lines.append(
            f"| {r['mode']} | {r['step_ms']:.2f} | {r['wq_ms']:.3f} | {r['wq_calls']:.0f} | {r['cache_mib']:.2f} "
            f"| {peak} |"
        )
    table = "\n".join(lines)
    emit("weight_cache.md", table)


if __name__ == "__main__":
    main()
