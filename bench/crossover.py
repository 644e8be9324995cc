"""Where does a low-precision format beat BF16? One linear, BF16 GEMM vs mxfx's ``mx_linear``, by projection family
and tokens M, for one format (``--format``, default mxfp8).

For each projection family ``K -> N`` and M = 128 .. 32768 (powers of 2), times:

* ``bf16``: ``F.linear`` on BF16 activations and a BF16 weight (cuBLAS), forward,
  and forward+backward (dgrad and wgrad);
* ``mx``: ``mxfx.ops.linear.mx_linear`` in the format, with an FP32 main weight: activation
  quantization included, weight operands from the weight cache (rebuilt once per
  optimizer step, so not in the loop: the recipe's "cached RHS, LHS Q included",
  Table 22); forward, and forward+backward;
* ``mxdq``: the same with ``keep_dequantized_weights=True`` (the Hopper option: the
  emulated GEMM takes the cached BF16 weight instead of dequantizing it per GEMM), for formats with such forms.

Forward is a training forward (grad enabled, wgrad operands saved). Times on CUDA are device times, medians of
CUDA-graph replays (``--timing graph``, the default: a compiled step issues these ops with far less host work than
eager calls, whose host cost would decide every small shape), or ``triton.testing.do_bench`` medians of the eager
calls, host cost included (``--timing eager``); wall-clock means on CPU.

Prints the ratios ``bf16 time / mx time`` (> 1: MXFP8 faster), writes the
measurements to ``<out>/crossover.json`` and a plot to ``<out>/crossover.png``, and
on a GPU also to ``mxfx/policy/crossover_<format>_sm<major><minor>.json``, the table that
``Policy(min_size="auto")`` reads for ops of that format (``--no-save-table`` to skip).

    python bench/crossover.py                               # GPU, ~2-3 min on an H200
    python bench/crossover.py --format fp8_block            # fp8_block's table
    python bench/crossover.py --device cpu --quick          # toy size, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mxfx import formats  # noqa: E402
from mxfx.runtime import cache  # noqa: E402
from mxfx.policy import crossover  # noqa: E402
from mxfx.ops.linear import mx_linear  # noqa: E402

FAMILIES = [(1024, 1024), (2048, 2048), (4096, 4096), (4096, 14336), (2048, 1024)]  # (K, N)
MS = [2**i for i in range(7, 16)]  # 128 .. 32768
QUICK_FAMILIES = [(128, 128), (256, 512)]
QUICK_MS = [32, 128]


def timer(device: str, rep_ms: int, timing: str, fallbacks: list):
    """``run(fn, grads) -> ms``. CUDA, ``timing="graph"``: device time of ``fn`` replayed from a CUDA graph (no host
    cost: a compiled step issues these ops with far less host work than eager calls), falling back to eager
    ``do_bench`` where ``fn`` cannot be captured (appended to ``fallbacks``); ``"eager"``: ``do_bench`` of the
    Python calls, host cost included."""
    if device == "cuda":
        import triton.testing

        def run(fn, grads):
            if timing == "graph":
                try:
                    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, grad_to_none=grads, return_mode="median")
                except RuntimeError as err:
                    fallbacks.append(str(err).splitlines()[0][:160])
                    torch.cuda.synchronize()
            return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, grad_to_none=grads)

        return run

    def run_cpu(fn, grads, n=3):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
            for g in grads:
                g.grad = None
        return (time.perf_counter() - t0) / n * 1e3

    return run_cpu


def measure(k: int, n: int, m: int, device: str, bench, fmt: formats.Format) -> dict:
    """Times (ms) of one (family, M) point, every arm on the same data."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    w32 = (torch.randn(n, k, device=device) * k**-0.5).requires_grad_()
    w16 = w32.detach().to(torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def fwd(f):
        return lambda: f()

    def fwdbwd(f):
        return lambda: f().backward(dy)

    arms = {"bf16": lambda: F.linear(x, w16), "mx": lambda: mx_linear(x, w32, format=fmt.name)}
    if fmt.dequantized_weight_forms:
        arms["mxdq"] = lambda: mx_linear(x, w32, format=fmt.name, keep_dequantized_weights=True)
    out = {"M": m}
    for name, f in arms.items():
        grads = [x, w16 if name == "bf16" else w32]
        f().backward(dy)  # builds the weight caches (and compiles kernels) outside the timing
        out[f"{name}_fwd_ms"] = bench(fwd(f), grads)
        out[f"{name}_fwdbwd_ms"] = bench(fwdbwd(f), grads)
    return out


def plot(table: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, what in zip(axes, ("fwd", "fwdbwd")):
        for fam in table["families"]:
            ms = [p["M"] for p in fam["points"]]
            (line,) = ax.plot(
                ms, [p[f"bf16_{what}_ms"] / p[f"mx_{what}_ms"] for p in fam["points"]], marker="o", label=fam["name"]
            )
            if f"mxdq_{what}_ms" in fam["points"][0]:
                ax.plot(
                    ms,
                    [p[f"bf16_{what}_ms"] / p[f"mxdq_{what}_ms"] for p in fam["points"]],
                    ls="--",
                    color=line.get_color(),
                    alpha=0.6,
                )
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_title({"fwd": "forward", "fwdbwd": "forward + backward"}[what])
    axes[0].set_ylabel(f"BF16 time / mxfx time (>1: {table['format']} faster)")
    axes[0].legend(title="K->N (dashed: keep_dequantized_weights)", fontsize=8)
    fig.suptitle(f"mx_linear ({table['format']}) vs BF16 linear on {table['device']} (torch {table['torch']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="toy families and M (CPU smoke run)")
    low_precision = [n for n in formats.NAMES if formats.get(n).low_precision]
    p.add_argument("--format", default="mxfp8", choices=low_precision, help="the format timed against BF16")
    p.add_argument(
        "--out", default=os.environ.get("MXFX_BENCH_OUT", "runs/crossover"), help="directory for crossover.png/.json"
    )
    p.add_argument("--rep-ms", type=int, default=60, help="do_bench repetition time per measurement (CUDA)")
    p.add_argument(
        "--timing",
        choices=("graph", "eager"),
        default="graph",
        help="CUDA: device time from CUDA-graph replays (default) or eager do_bench, host cost included",
    )
    p.add_argument(
        "--no-save-table", action="store_true", help="do not write mxfx/policy/crossover_<format>_sm<cc>.json"
    )
    a = p.parse_args()
    families, ms = (QUICK_FAMILIES, QUICK_MS) if a.quick else (FAMILIES, MS)
    device = a.device
    cap = torch.cuda.get_device_capability() if device == "cuda" else None
    fallbacks: list[str] = []
    bench = timer(device, a.rep_ms, a.timing, fallbacks)
    fmt = formats.get(a.format)
    t_start = time.perf_counter()
    table = {
        "capability": list(cap) if cap else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "format": fmt.name,
        "date": time.strftime("%Y-%m-%d"),
        "timing": (
            (
                "triton do_bench_cudagraph median (device time)"
                if a.timing == "graph"
                else "triton do_bench median (eager)"
            )
            if device == "cuda"
            else "wall-clock mean of 3 (eager)"
        ),
        "families": [],
    }
    for k, n in families:
        fam = {"name": f"{k}->{n}", "K": k, "N": n, "points": []}
        for m in ms:
            fam["points"].append(measure(k, n, m, device, bench, fmt))
            cache.clear()
            if device == "cuda":
                torch.cuda.empty_cache()
        table["families"].append(fam)
        print(f"measured {fam['name']} ({time.perf_counter() - t_start:.0f} s)", flush=True)

    if fallbacks:
        table["timing"] += f"; {len(fallbacks)} measurement(s) eager, not capturable: {fallbacks[0]}"
        print(f"{len(fallbacks)} measurement(s) could not be captured in a CUDA graph, timed eagerly: {fallbacks[0]}")
    cols = " ".join(f"{m:>7}" for m in ms)
    lines = [
        f"mx_linear ({fmt.name}) vs BF16 on {table['device']}: bf16 time / mxfx time (>1 = {fmt.name} faster); "
        f"mx = emulated or native per arch, mxdq = keep_dequantized_weights",
        "",
    ]
    for what, label in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
        for arm in ("mx", "mxdq") if fmt.dequantized_weight_forms else ("mx",):
            lines.append(f"{label}, {arm}:")
            lines.append(f"{'K->N':>12} {cols}")
            for fam in table["families"]:
                row = " ".join(f"{pt[f'bf16_{what}_ms'] / pt[f'{arm}_{what}_ms']:>7.2f}" for pt in fam["points"])
                lines.append(f"{fam['name']:>12} {row}")
            lines.append("")
    text = "\n".join(lines)
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "crossover.json"), "w") as f:
        json.dump(table, f, indent=1)
    with open(os.path.join(a.out, "crossover.txt"), "w") as f:
        f.write(text + "\n")
    plot(table, os.path.join(a.out, "crossover.png"))
    written = [os.path.join(a.out, x) for x in ("crossover.json", "crossover.txt", "crossover.png")]
    if cap is not None and not a.no_save_table:
        path = os.path.join(crossover.DATA_DIR, crossover.table_name(cap, fmt.name))
        os.makedirs(crossover.DATA_DIR, exist_ok=True)
        with open(path, "w") as f:
            json.dump(table, f, indent=1)
        written.append(path)
    print(f"wrote {', '.join(written)}; total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
