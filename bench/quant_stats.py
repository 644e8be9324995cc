"""Time of one quantization-statistics sample per kind of site: the fused kernels (``Format.stats_vector``, which
takes them on CUDA) against the plain-torch reference (``reduce_parts`` of ``Format.quant_stats``), next to the
quantize that made the operand.

Sites, per format and scale rule: ``rows`` (a forward input ``[T, K]``), ``rows swiglu`` (``silu(gate) * up``),
``tokens`` (a dense linear's wgrad operand of ``[T, K]``), ``weight`` (``[N, K]``), ``group tokens`` (a grouped
wgrad operand of ``[T, K]`` over ``--experts`` equal groups). Sources in BF16 on CUDA, FP32 on CPU. The weight's
quantize is not timed (its form comes from the weight cache, made once per optimizer step). Time per call: the
median of 5 runs of 10 calls (``--quick``: one run of 2; CUDA events after a synchronize on CUDA, wall time on CPU),
host cost included, as a sampled step pays it (the statistics op runs eagerly inside the compiled graph).
``match``: the fused sample equals the reference's (counts, amax and exponents exactly, the fp64 sums to a relative
1e-9).

Usage: ``python bench/quant_stats.py`` (CUDA; ``--tokens``, ``--k``, ``--n``, ``--experts``, ``--formats``);
``python bench/quant_stats.py --device cpu --quick``: toy sizes, the reference path alone (no fused kernel on CPU),
a smoke run. Prints a markdown table; writes it to ``$MXFX_BENCH_OUT/quant_stats.md`` when that variable is set.
For the cost in a training step, ``python bench/hf_models.py --stats-every N`` (``--stats-path plain`` for the
reference there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, run as a script

from bench._results import emit  # noqa: E402
from mxfx import formats  # noqa: E402
from mxfx.runtime import stats  # noqa: E402


def _ms(fn, device: str, calls: int = 10, runs: int = 5) -> float | None:
    """Median ms of one call of ``fn`` over ``runs`` runs of ``calls`` calls, after two warm-up calls (None for
    ``fn`` None)."""
    if fn is None:
        return None
    fn(), fn()
    times = []
    for _ in range(runs):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def _sites(fmt, rule: str, t: int, k: int, n: int, experts: int, device: str, dtype):
    """``(site, shape, quantize call, (source, combine, operand, layout, offs))`` of each kind of site."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=g).to(device, dtype)
    up = torch.randn(t, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g).to(device)
    offs = torch.linspace(t / experts, t, experts).round().to(device=device, dtype=torch.int32)
    h = fmt.stats_values((x, up), "swiglu")
    made = {
        "rows": (lambda: fmt.input_operand(x, None, rule, "mm"), (x,), "", "rows", None),
        "rows swiglu": (lambda: fmt.input_operand(x, up, rule, "mm"), (x, up), "swiglu", "rows", None),
        "tokens": (lambda: fmt.tokens_operand(x, rule), (x,), "", "tokens", None),
        "weight": (None, (w,), "", "weight", None),  # a weight-cache form: made once per optimizer step
        "group tokens": (lambda: fmt.grouped_tokens_operand(h, offs, rule), (x, up), "swiglu", "group_tokens", offs),
    }
    for site, (quantize, source, combine, layout, o) in made.items():
        shape = tuple(w.shape) if layout == "weight" else tuple(x.shape)
        operand = fmt.weight_operand(w, rule, "forward") if quantize is None else quantize()
        yield site, shape, quantize, (source, combine, operand, layout, o)


def _same(got: torch.Tensor, ref: torch.Tensor) -> bool:
    n = len(stats._FIELDS)
    exact = [i for i in range(got.numel()) if i not in (6, 7)]  # all but err_sq, ref_sq
    return bool(
        torch.equal(got[exact], ref[exact])
        and torch.allclose(got[6:8], ref[6:8], rtol=1e-9, atol=0.0)
        and got.numel() == n + stats.HIST_BINS
    )


def main(argv=None) -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    cli.add_argument("--quick", action="store_true", help="toy sizes (a smoke run)")
    cli.add_argument("--tokens", type=int, default=16384)
    cli.add_argument("--k", type=int, default=2048)
    cli.add_argument("--n", type=int, default=4096)
    cli.add_argument("--experts", type=int, default=8)
    cli.add_argument("--formats", default="mxfp8,fp8_block")
    args = cli.parse_args(argv)
    os.environ["MXFX_STATS_FUSED"] = "1"  # the fused arm (the library's default; a user's 0 would turn it off)
    if args.quick:
        args.tokens, args.k, args.n, args.experts = 256, 256, 256, 4
    device, dtype = args.device, (torch.bfloat16 if args.device == "cuda" else torch.float32)
    fused_here = device == "cuda"
    reps = (2, 1) if args.quick else (10, 5)  # (calls, runs)
    lines = [
        f"# quantization statistics: one sample per site ({device}"
        f"{', ' + torch.cuda.get_device_name() if device == 'cuda' else ''}; ms per call)",
        "",
        "| format | site | shape | quantize ms | reference ms | fused ms | reference / fused | fused / quantize "
        "| match |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.formats.split(","):
        fmt = formats.get(name)
        for rule in (r.value for r in fmt.scale_rules):
            for site, shape, quantize, (source, combine, operand, layout, offs) in _sites(
                fmt, rule, args.tokens, args.k, args.n, args.experts, device, dtype
            ):

                def reference():
                    return stats.reduce_parts(fmt.quant_stats(source, combine, operand, rule, layout, offs))

                q_ms, ref_ms = _ms(quantize, device, *reps), _ms(reference, device, *reps)
                if fused_here:
                    fused = fmt.fused_stats(source, combine, operand, rule, layout, offs)
                    f_ms = _ms(lambda: fmt.stats_vector(source, combine, operand, rule, layout, offs), device, *reps)
                    match = "n/a (not covered)" if fused is None else str(_same(fused, reference()))
                    per_quantize = "-" if q_ms is None else f"{f_ms / q_ms:.2f}x"
                    cells = [f"{f_ms:.3f}", f"{ref_ms / f_ms:.1f}x", per_quantize, match]
                else:
                    cells = ["-", "-", "-", "- (no fused kernel on CPU)"]
                made = "- (cached)" if q_ms is None else f"{q_ms:.3f}"
                lines.append(
                    f"| {name}/{rule} | {site} | {'x'.join(map(str, shape))} | {made} | {ref_ms:.3f} | "
                    + " | ".join(cells)
                    + " |"
                )
    emit("quant_stats.md", "\n".join(lines))


if __name__ == "__main__":
    main()
