"""First-step time with a cold and with a warm compile cache: BF16 Inductor against mxfx.

Each measurement runs in a fresh Python process (nothing cached in memory), with
``TORCHINDUCTOR_CACHE_DIR`` pointing at a folder of its own arm: the first process finds
it empty (cold), the second finds what the first wrote (warm: Inductor's FX graph cache
and AOTAutograd's cache should hit). The model is one of ``bench/hf_models.py``'s
(``olmoe`` / ``qwen3`` at the released checkpoints' per-layer shapes), FP32 parameters
under ``torch.autocast(bfloat16)``; the step is forward, backward and a fused AdamW step.

Arms: ``bf16`` (``torch.compile`` with Inductor), ``mxfp8`` (``backend="mxfp8"``), ``mxfp8-opaque``
(the same with ``kernels="opaque"``: the MX kernels stay opaque custom ops instead of ``wrap_triton`` calls
that Inductor analyses and compiles per call site), ``fp8_block`` (``options={"format": "fp8_block"}``) and
``fp8_block-opaque``;
``--per-block`` compiles each decoder layer on its own (``layer.compile(...)``, as
torchtitan does) instead of the whole model, where N identical layers should cost one
layer's compile. Reported per arm and cache state: first-step seconds, FX graph cache
and AOTAutograd cache hits / misses / bypasses, and the first bypass reason torch logged.
Goals (issue: compile time): mxfx cold <= 1.5x BF16 cold, mxfx warm <= 2x BF16 warm.

    python bench/compile_time.py                         # H200: olmoe, 4 layers, whole model and per block
    python bench/compile_time.py --model qwen3 --layers 2
    python bench/compile_time.py --smoke                 # CPU, tiny dims
    python bench/compile_time.py --units model --arms bf16,mxfp8,mxfp8-opaque --profile 30   # where cold time goes

Each cold first step is also split into phases (the table after the first one): Dynamo's bytecode trace, the
backend before AOTAutograd (mxfx's passes; Inductor's pre-grad passes for bf16), AOTAutograd's trace and partition,
Inductor's lowering and post-grad passes, its code generation, the wait for its compile workers (the Triton kernels
of the generated code, user kernels included), Triton compiles in the main process (kernels launched by mxfx
itself: count, compiles per kernel name, seconds) and Triton autotuning there (tunings, seconds; Triton >= 3.5's
listener), and the rest (the step itself, first launches). From torch's ``compile_times`` and Triton's
``knobs.compilation.listener`` / ``knobs.autotuning.listener``.

``--profile N`` also writes, per arm, the N functions with the most cumulative time in the cold first step (all, then
those of Inductor's user-kernel analysis and of mxfx, then the N with the most time of their own)
(``cProfile``, main process only: Inductor's compile workers are not in it) to ``$MXFX_BENCH_OUT``
(default ``bench/results``) as ``compile_profile_<unit>_<arm>.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

ARMS = {  # arm -> (backend, options, extra environment)
    "bf16": ("inductor", None, {}),
    "mxfp8": ("mxfp8", None, {}),
    "mxfp8-opaque": ("mxfp8", {"kernels": "opaque"}, {}),
    "fp8_block": ("mxfp8", {"format": "fp8_block"}, {}),
    "fp8_block-opaque": ("mxfp8", {"format": "fp8_block", "kernels": "opaque"}, {}),
}
CACHE_LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")


class _Reasons(logging.Handler):
    """Collects the bypass reasons Inductor and AOTAutograd log about their caches."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "ypass" in msg:
            self.reasons.append(" ".join(msg.split())[:200])


def cache_counters() -> dict:
    """Inductor's FX graph cache and AOTAutograd's cache counters of this process."""
    from torch._dynamo.utils import counters

    out = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    out.update({k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")})
    return out


PHASES = (  # column -> compile_times keys summed (aggregate seconds of this process)
    ("dynamo trace", ("bytecode_tracing",)),
    ("backend pre-AOT", ("OutputGraph.call_user_compiler", "-create_aot_dispatcher_function")),
    ("AOT trace + partition", ("aot_collect_metadata", "aot_trace_joint_graph", "min_cut_rematerialization_partition")),
    ("Inductor lowering", ("_recursive_post_grad_passes", "GraphLowering.run")),
    ("Inductor codegen", ("GraphLowering.codegen",)),
    ("compile workers wait", ("async_compile.wait",)),
    ("guards", ("build_guards",)),
)


class _TritonCompiles:
    """Triton compiles and autotunings of this process (its public ``knobs`` listeners): kernel names, seconds."""

    def __init__(self):
        self.compiles: dict[str, int] = {}
        self.compile_s = 0.0
        self.hits = 0
        self.tunings: dict[str, int] = {}
        self.tune_s = 0.0

    def install(self) -> None:
        from triton import knobs

        knobs.compilation.listener = self.on_compile
        if hasattr(knobs, "autotuning") and hasattr(knobs.autotuning, "listener"):
            knobs.autotuning.listener = self.on_tune
        else:
            self.tune_s = float("nan")  # this Triton has no autotuning listener

    def on_compile(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if cache_hit:
            self.hits += 1
            return
        name = getattr(getattr(src, "fn", None), "__name__", None) or metadata.get("name", "?")
        self.compiles[name] = self.compiles.get(name, 0) + 1
        self.compile_s += times.total / 1e6

    def on_tune(self, *, fn, key, best_config, configs_timings, duration, cache_hit) -> None:
        if not cache_hit:
            self.tunings[fn.__name__] = self.tunings.get(fn.__name__, 0) + 1
            self.tune_s += duration or 0.0


def phases(first_step_s: float, triton: _TritonCompiles | None) -> dict:
    """The cold first step's phases in seconds (:data:`PHASES`, Triton's compiles and tunings, the rest)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    times = dict(zip(names, (float(v) for v in values)))
    out = {}
    for column, keys in PHASES:
        out[column] = sum(-times.get(k[1:], 0.0) if k.startswith("-") else times.get(k, 0.0) for k in keys)
    if triton is not None:
        out["Triton compiles in process"] = triton.compile_s
        out["Triton autotune"] = triton.tune_s
        out["compiles per kernel"] = dict(sorted(triton.compiles.items(), key=lambda kv: -kv[1]))
        out["tunings per kernel"] = triton.tunings
        out["Triton cache hits"] = triton.hits
    timed = sum(v for k, v in out.items() if isinstance(v, float) and v == v)
    out["rest"] = first_step_s - timed
    return out


def measure(model_name: str, arm: str, layers: int, smoke: bool, per_block: bool, device: str,
            profile: int = 0) -> dict:
    """One first training step of ``model_name`` under ``arm`` in this process; its time and the cache counters
    (and, with ``profile``, the text of its ``profile`` costliest functions by cumulative time, key ``profile``)."""
    import torch

    import hf_models

    handler = _Reasons()
    for name in CACHE_LOGGERS:
        lg = logging.getLogger(name)
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    model = hf_models.build_model(model_name, layers, "smoke" if smoke else "real", device)
    backend, options, _ = ARMS[arm]
    if per_block:
        for layer in model.model.layers:
            layer.compile(backend=backend, options=options)
        fn = model
    else:
        fn = torch.compile(model, backend=backend, options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    batch, seq = (2, 64) if smoke else (4, 2048)
    x = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    prof = cProfile.Profile() if profile else None
    triton = None
    if device == "cuda":
        triton = _TritonCompiles()
        triton.install()
    t0 = time.perf_counter()
    with prof or contextlib.nullcontext():
        with torch.autocast(device, torch.bfloat16):
            loss = fn(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
    first = time.perf_counter() - t0
    text = ""
    if prof is not None:
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("cumulative").print_stats(profile)  # where the time goes, top down
        stats.sort_stats("cumulative").print_stats("triton_kernel_wrap|mxfx", profile)  # user-kernel analysis, mxfx
        stats.sort_stats("tottime").print_stats(profile)  # the leaves that spend it
        text = buf.getvalue()
    from torch._dynamo.utils import counters

    import mxfx

    mx_ops = sum(pm.count(rewritten=True) for pm in mxfx.report.all_reports())
    return {"first_step_s": first, "frames": counters["stats"]["unique_graphs"], "mx_ops": mx_ops, **cache_counters(),
            "bypass": handler.reasons[0] if handler.reasons else "", "phases": phases(first, triton),
            **({"profile": text} if text else {})}


def run_child(args, arm: str, cache_dir: str, profile: int = 0) -> dict:
    """:func:`measure` in a fresh process with ``TORCHINDUCTOR_CACHE_DIR=cache_dir`` and the arm's environment."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--arms", arm,
           "--layers", str(args.layers), "--profile", str(profile)]
    cmd += (["--smoke"] if args.smoke else []) + (["--per-block"] if args.per_block_run else [])
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, **ARMS[arm][2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
    if out.returncode or line is None:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(line)


def table(rows: list[dict]) -> str:
    """Markdown table: one line per (model, compile unit, arm, cache state), with the goal ratios."""
    lines = ["| model | compiled | arm | cache | first step s | vs BF16 | goal | FX graph cache h/m/b | AOT cache h/m/b | graphs | "
             "first bypass reason |", "|---|---|---|---|---:|---:|---:|---|---|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['unit']} | {r['arm']} | {r['cache']} | - | - | - | - | - | - | error: {r['error']} |")
            continue
        base = next((b for b in rows if b["arm"] == "bf16" and b["cache"] == r["cache"] and b["unit"] == r["unit"]
                     and b["model"] == r["model"] and "error" not in b), None)
        ratio = f"{r['first_step_s'] / base['first_step_s']:.2f}x" if base and r["arm"] != "bf16" else "-"
        goal = ("<= 1.5x" if r["cache"] == "cold" else "<= 2x") if r["arm"] != "bf16" else ""
        fx = "/".join(str(r.get(f"fxgraph_cache_{k}", 0)) for k in ("hit", "miss", "bypass"))
        aot = "/".join(str(r.get(f"autograd_cache_{k}", 0)) for k in ("hit", "miss", "bypass"))
        lines.append(f"| {r['model']} | {r['unit']} | {r['arm']} | {r['cache']} | {r['first_step_s']:.1f} | {ratio} | {goal} | "
                     f"{fx} | {aot} | {r['frames']} | {r['bypass']} |")
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> str:
    """Markdown table: where each cold first step's seconds go (:func:`phases`), one line per (unit, arm), and
    the kernels Triton compiled more than once in the main process."""
    cold = [r for r in rows if r["cache"] == "cold" and "phases" in r]
    if not cold:
        return ""
    columns = [c for c, _ in PHASES] + ["Triton compiles in process", "Triton autotune", "rest"]
    lines = ["| compiled | arm | first step s | " + " | ".join(columns) + " | Triton compiles (repeated kernels) |",
             "|---|---|---:|" + "---:|" * len(columns) + "---|"]
    for r in cold:
        ph = r["phases"]
        cells = [f"{ph[c]:.1f}" if isinstance(ph.get(c), float) and ph[c] == ph[c] else "-" for c in columns]
        per = ph.get("compiles per kernel", {})
        again = ", ".join(f"{k} x{n}" for k, n in per.items() if n > 1) or "none"
        lines.append(f"| {r['unit']} | {r['arm']} | {r['first_step_s']:.1f} | " + " | ".join(cells)
                     + f" | {sum(per.values())} ({again}) |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="olmoe", help="olmoe or qwen3 (bench/hf_models.py)")
    p.add_argument("--arms", default="bf16,mxfp8", help="comma list of " + ", ".join(ARMS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--units", default="model,block", help="comma list: model (whole-model compile), block (per layer)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny dims")
    p.add_argument("--profile", type=int, default=0, help="write the N costliest functions of each cold first step")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--per-block", dest="per_block_run", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.child:
        print(json.dumps(measure(args.model, args.arms, args.layers, args.smoke, args.per_block_run, device,
                                 args.profile)), flush=True)
        return []
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        p.error(f"unknown arm(s) {sorted(unknown)}; choose from {', '.join(ARMS)}")
    out_dir = os.environ.get("MXFX_BENCH_OUT", os.path.join(ROOT, "bench", "results"))
    rows = []
    for unit in args.units.split(","):
        args.per_block_run = unit == "block"
        for arm in args.arms.split(","):
            with tempfile.TemporaryDirectory(prefix=f"compile_time_{arm}_") as cache_dir:
                for state in ("cold", "warm"):
                    profile = args.profile if state == "cold" else 0
                    r = {"model": args.model, "unit": unit, "arm": arm, "cache": state,
                         **run_child(args, arm, cache_dir, profile)}
                    if "profile" in r:
                        os.makedirs(out_dir, exist_ok=True)
                        with open(os.path.join(out_dir, f"compile_profile_{unit}_{arm}.txt"), "w") as f:
                            f.write(r.pop("profile"))
                    print(f"  {args.model} {unit} {arm} {state}: {r.get('first_step_s', r.get('error'))}", flush=True)
                    rows.append(r)
    from _results import emit

    emit("compile_time.md", table(rows) + "\n\nwhere the cold first step goes (seconds):\n\n" + phase_table(rows))
    return rows


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
