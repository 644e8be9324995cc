"""Probe: where an arm of ``bench/hf_models.py`` spends its step and reaches its peak memory: forward, backward,
optimizer step.

Runs a few steps of the named arms (same model and optimizer as the benchmark, random tokens) and prints, per step
and phase, the wall time (synchronized), the peak allocated GiB inside the phase and the allocated GiB at its end,
plus the weight caches' bytes and the allocator's device allocations and retries in the step. ``--cache-modes``
runs each arm with the default caches (``drop``: one microbatch per step frees a weight's caches at its backward)
and/or with every form kept (``keep``: ``mxfx.runtime.cache.set_dgrad_at_refresh(True)``).

    python bench/probes/hf_memory_phases.py --model qwen3 --arms mxfp8,fp8_block --steps 3 --cache-modes drop,keep
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import hf_models  # noqa: E402
from mxfx.runtime import cache  # noqa: E402

GIB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3")
    p.add_argument("--arms", default="mxfp8,fp8_block")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--cache-modes", default="drop", help="comma list of drop, keep")
    p.add_argument("--profile", action="store_true", help="print the kernels of the last step by GPU time")
    args = p.parse_args()
    for name, mode in [(n, m) for n in args.arms.split(",") for m in args.cache_modes.split(",")]:
        arm = hf_models.ARMS[name]
        cache.set_dgrad_at_refresh({"drop": False, "keep": True}[mode])
        gc.collect()
        torch._dynamo.reset()
        cache.clear()
        torch.cuda.empty_cache()
        model = hf_models.build_model(args.model, args.layers, "real", "cuda").to(arm.param_dtype)
        fn = arm.prepare(model, "inductor")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        gen = torch.Generator().manual_seed(1234)
        batch = args.tokens // args.seq
        amp = torch.autocast("cuda", torch.bfloat16, enabled=arm.autocast)
        print(f"== {args.model} / {name} / caches {mode}: parameters {sum(p.nbytes for p in model.parameters()) / GIB:.2f} GiB")
        for step in range(args.steps):
            x = torch.randint(0, model.config.vocab_size, (batch, args.seq), generator=gen).cuda()
            phases = []
            before = torch.cuda.memory_stats()
            prof = None
            if args.profile and step == args.steps - 1:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                prof.start()
            t_step = time.perf_counter()

            def phase(label, run):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                with torch.profiler.record_function(f"phase:{label}"):
                    out = run()
                torch.cuda.synchronize()
                phases.append(f"{label} {(time.perf_counter() - t0) * 1e3:.1f} ms peak "
                              f"{torch.cuda.max_memory_allocated() / GIB:.2f} end {torch.cuda.memory_allocated() / GIB:.2f}")
                return out

            with amp:
                loss = phase("forward", lambda: fn(input_ids=x, labels=x).loss)
            phase("backward", loss.backward)
            del loss
            phase("step", opt.step)
            phase("zero_grad", lambda: opt.zero_grad(set_to_none=True))
            after = torch.cuda.memory_stats()
            if prof is not None:
                prof.stop()
                print(prof.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=70))
            alloc = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_device_alloc", "num_alloc_retries")}
            print(f"  step {step}: {(time.perf_counter() - t_step) * 1e3:.1f} ms: " + "; ".join(phases)
                  + f"; caches {cache.persistent_bytes() / GIB:.2f} GiB; device allocs {alloc['num_device_alloc']}, "
                  f"retries {alloc['num_alloc_retries']}", flush=True)
        del model, fn, opt


if __name__ == "__main__":
    main()
