"""First-step time with a cold and with a warm compile cache: BF16 Inductor against mxfx.

Each measurement runs in a fresh Python process (nothing cached in memory), with
``TORCHINDUCTOR_CACHE_DIR`` pointing at a folder of its own arm: the first process finds
it empty (cold), the second finds what the first wrote (warm: Inductor's FX graph cache
and AOTAutograd's cache should hit). The model is one of ``bench/hf_models.py``'s
(``olmoe`` / ``qwen3`` / ``mixtral`` at the released checkpoints' per-layer shapes), FP32 parameters
under ``torch.autocast(bfloat16)``; the step is forward, backward and a fused AdamW step. Inductor's import is
left out of every arm's step (BF16's ``torch.compile`` call imports it before the step, mxfx's backend would inside).

Arms: ``bf16`` (``torch.compile`` with Inductor), ``mxfp8`` (``backend="mxfp8"``, whose ``kernels="auto"``
picks per graph), ``mxfp8-opaque`` and ``mxfp8-inductor`` (the same with ``kernels`` fixed: the MX kernels kept as
opaque custom ops, or traced in as ``wrap_triton`` calls that Inductor analyses and compiles per call site),
``fp8_block`` (``options={"format": "fp8_block"}``), ``fp8_block-opaque`` and ``fp8_block-inductor``;
``--per-block`` compiles each decoder layer on its own (``layer.compile(...)``, as
torchtitan does) instead of the whole model, where N identical layers should cost one
layer's compile. Reported per arm and cache state: first-step seconds, FX graph cache
and AOTAutograd cache hits / misses / bypasses, and the first bypass reason torch logged.
Goals (issue: compile time): mxfx cold <= 1.5x BF16 cold and warm <= 1.5x BF16 warm.

    python bench/compile_time.py                         # H200: olmoe, 4 layers, whole model and per block
    python bench/compile_time.py --model qwen3 --layers 2
    python bench/compile_time.py --smoke                 # CPU, tiny dims
    python bench/compile_time.py --units model --arms bf16,mxfp8,mxfp8-opaque --profile 30   # where cold time goes
    python bench/compile_time.py --passes-only --arms bf16,fp8_block,mxfp8   # CPU: the passes' own time, graph sizes

Each first step, cold and warm, is also split into phases (the table after the first one): Dynamo's bytecode trace, the
backend before AOTAutograd (mxfx's passes; Inductor's pre-grad passes for bf16), AOTAutograd's trace and partition,
Inductor's lowering and post-grad passes, its code generation, the wait for its compile workers (the Triton kernels
of the generated code, user kernels included), Triton compiles in the main process (kernels launched by mxfx
itself: count, compiles per kernel name, seconds) and Triton autotuning there (tunings, seconds; Triton >= 3.5's
listener), and the rest (the step itself, first launches). A kernel Triton compiled more than once in the main
process is listed with the arguments its compiles were specialized on differently (a constexpr's value, an int
equal to 1 or a multiple of 16); the backend's column also gives the seconds of mxfx's passes within it. The
kernels mxfx compiled ahead on its threads while the graph compiled (``mxfx.kernels.common.compile_ahead``) are
counted apart, with their threads' seconds: those overlap the other phases. From
torch's ``compile_times`` and Triton's ``knobs.compilation.listener`` / ``knobs.autotuning.listener``.

``--passes-only`` (``--dims small`` unless given: every GEMM converts in both formats) compiles the model's
forward once per arm in this process, Inductor's lowering left out: the mxfx backend's own seconds before its
inner compiler, each pass's seconds and the nodes it adds (:attr:`mxfx.report.PrecisionMap.steps`), then
AOTAutograd's trace with Inductor's decompositions and its min-cut partition (seconds, joint / forward /
backward nodes, and the Triton kernels traced into them: Inductor analyses each kernel node's Triton IR again
when it lowers it). On the CPU (``--smoke``, or no GPU) the MX ops stay opaque custom ops; on a GPU their bodies
and kernels are traced into the graph (``mxfx.kernels.common.launch``), so AOTAutograd's graphs there are larger.

``--profile N`` also writes, per arm and cache state, the N functions with the most cumulative time in the first
step (all, then those of Inductor's user-kernel analysis and of mxfx, then the N with the most time of their own)
(``cProfile``, main process only: Inductor's compile workers are not in it) to ``$MXFX_BENCH_OUT``
(default ``bench/results``) as ``compile_profile_<unit>_<arm>_<cold|warm>.txt``; ``--profile-cache warm`` profiles
the warm steps only (cProfile slows a cold compile about 3x, so a profiled cold step times nothing else).
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
import threading
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
    "mxfp8-inductor": ("mxfp8", {"kernels": "inductor"}, {}),
    "fp8_block-inductor": ("mxfp8", {"format": "fp8_block", "kernels": "inductor"}, {}),
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


_TRITON_CACHE_ENV = ("TRITON_CACHE_DIR", "TRITON_PTXAS_PATH", "TRITON_LIBDEVICE_PATH")
"""Environment variables that choose where Triton looks for a compiled kernel or what its key holds."""


class _TritonCompiles:
    """Triton compiles and autotunings of this process (its public ``knobs`` listeners): kernel names, seconds."""

    def __init__(self):
        self.compiles: dict[str, int] = {}
        self.variants: dict[str, list[dict[str, str]]] = {}  # kernel name -> what each compile specialized on
        self.compile_s = 0.0
        self.hits = 0
        self.missed_in: set[str] = set()  # where the misses looked: cache folder, ptxas, libdevice (env at the miss)
        self.tunings: dict[str, int] = {}
        self.tune_s = 0.0
        self.ahead_prefix = "-"  # the compile-ahead threads' name prefix (install)
        self.ahead = 0  # compiles on mxfx's compile-ahead threads (beside the other phases, not in the step's sum)
        self.ahead_s = 0.0

    def install(self) -> None:
        from triton import knobs

        from mxfx.kernels.common.compile_ahead import THREAD_PREFIX

        self.ahead_prefix = THREAD_PREFIX
        knobs.compilation.listener = self.on_compile
        if hasattr(knobs, "autotuning") and hasattr(knobs.autotuning, "listener"):
            knobs.autotuning.listener = self.on_tune
        else:
            self.tune_s = float("nan")  # this Triton has no autotuning listener

    def on_compile(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if cache_hit:
            self.hits += 1
            return
        if threading.current_thread().name.startswith(self.ahead_prefix):
            self.ahead += 1
            self.ahead_s += times.total / 1e6
            return
        name = getattr(getattr(src, "fn", None), "__name__", None) or metadata.get("name", "?")
        self.compiles[name] = self.compiles.get(name, 0) + 1
        self.variants.setdefault(name, []).append(specialization(src))
        self.missed_in.add(", ".join(f"{v}={os.environ.get(v, '-')}" for v in _TRITON_CACHE_ENV))
        self.compile_s += times.total / 1e6

    def on_tune(self, *, fn, key, best_config, configs_timings, duration, cache_hit) -> None:
        if not cache_hit:
            self.tunings[fn.__name__] = self.tunings.get(fn.__name__, 0) + 1
            self.tune_s += duration or 0.0


def specialization(src) -> dict[str, str]:
    """What one Triton compile was specialized on, per kernel argument name: a constexpr's value, or a runtime
    argument's type with the properties Triton assumed of it (``tt.divisibility=16``: a multiple of 16; an int
    equal to 1 is a constant). From the compiled source's ``signature``, ``constants`` and ``attrs`` ({} where the
    source is not a Triton kernel's)."""
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    if names is None:
        return {}
    name = lambda key: names[key[0]] + "".join(f"[{i}]" for i in key[1:])  # noqa: E731  (nested: tuple args)
    out = {arg: str(kind) for arg, kind in getattr(src, "signature", {}).items() if kind != "constexpr"}
    for key, value in getattr(src, "constants", {}).items():
        out[name(key)] = f"={value}"
    for key, props in getattr(src, "attrs", {}).items():
        out[name(key)] = " ".join([out.get(name(key), ""), *(f"{p}={v}" for p, v in props)]).strip()
    return out


def differing(variants: list[dict[str, str]]) -> str:
    """The arguments whose specialization differs between the compiles ``variants`` of one kernel, each with
    the values seen ("AXIS =0/=1; ssr i32/i32 tt.divisibility=16"); "" when none differs."""
    keys = sorted({k for v in variants for k in v}, key=lambda k: min(list(v).index(k) for v in variants if k in v))
    seen = {k: list(dict.fromkeys(v.get(k, "-") for v in variants)) for k in keys}
    return "; ".join(f"{k} {'/'.join(vals)}" for k, vals in seen.items() if len(vals) > 1)


def phases(first_step_s: float, triton: _TritonCompiles | None) -> dict:
    """The first step's phases in seconds (:data:`PHASES`, Triton's compiles and tunings, the rest)."""
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
        out["repeats differ in"] = {k: differing(v) for k, v in triton.variants.items() if len(v) > 1}
        out["tunings per kernel"] = triton.tunings
        out["Triton cache hits"] = triton.hits
        out["compiled ahead"] = (triton.ahead, triton.ahead_s)
        out["Triton misses looked in"] = sorted(triton.missed_in)
    timed = sum(v for k, v in out.items() if isinstance(v, float) and v == v)
    out["rest"] = first_step_s - timed
    return out


def measure(model_name: str, arm: str, layers: int, dims: str, per_block: bool, device: str, profile: int = 0) -> dict:
    """One first training step of ``model_name`` under ``arm`` in this process; its time and the cache counters
    (and, with ``profile``, the text of its ``profile`` costliest functions by cumulative time, key ``profile``).

    Inductor is imported before the clock starts, in every arm: ``torch.compile(backend="inductor")`` imports it
    when called, before the step, and the mxfp8 backend at its first compile, inside it (1 to 4 s)."""
    import torch
    import torch._inductor.compile_fx  # noqa: F401

    import hf_models

    handler = _Reasons()
    for name in CACHE_LOGGERS:
        lg = logging.getLogger(name)
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    model = hf_models.build_model(model_name, layers, dims, device)
    backend, options, _ = ARMS[arm]
    if per_block:
        for layer in model.model.layers:
            layer.compile(backend=backend, options=options)
        fn = model
    else:
        fn = torch.compile(model, backend=backend, options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    batch, seq = (4, 2048) if dims == "real" else (2, 64)
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
    passes_s = sum(t for pm in mxfx.report.all_reports() for t, _ in pm.steps.values())
    return {
        "first_step_s": first,
        "frames": counters["stats"]["unique_graphs"],
        "mx_ops": mx_ops,
        **cache_counters(),
        "mxfx_passes_s": passes_s,
        "bypass": handler.reasons[0] if handler.reasons else "",
        "phases": phases(first, triton),
        **({"profile": text} if text else {}),
    }


def run_child(args, arm: str, cache_dir: str, profile: int = 0) -> dict:
    """:func:`measure` in a fresh process with ``TORCHINDUCTOR_CACHE_DIR=cache_dir`` and the arm's environment."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--model",
        args.model,
        "--arms",
        arm,
        "--layers",
        str(args.layers),
        "--profile",
        str(profile),
    ]
    cmd += ["--dims", args.dims] + (["--smoke"] if args.smoke else []) + (["--per-block"] if args.per_block_run else [])
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, **ARMS[arm][2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
    if out.returncode or line is None:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(line)


def table(rows: list[dict]) -> str:
    """Markdown table: one line per (model, compile unit, arm, cache state), with the goal ratios."""
    lines = [
        "| model | compiled | arm | cache | first step s | vs BF16 | goal | FX graph cache h/m/b | AOT cache h/m/b "
        "| graphs | first bypass reason |",
        "|---|---|---|---|---:|---:|---:|---|---|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['unit']} | {r['arm']} | {r['cache']} | - | - | - | - | - | - "
                f"| error: {r['error']} |"
            )
            continue
        base = next(
            (
                b
                for b in rows
                if b["arm"] == "bf16"
                and b["cache"] == r["cache"]
                and b["unit"] == r["unit"]
                and b["model"] == r["model"]
                and "error" not in b
            ),
            None,
        )
        ratio = f"{r['first_step_s'] / base['first_step_s']:.2f}x" if base and r["arm"] != "bf16" else "-"
        goal = "<= 1.5x" if r["arm"] != "bf16" else ""
        if r.get("profiled") or (base and base.get("profiled")):  # cProfile's overhead, not the compile's
            ratio, goal = f"{ratio} (under cProfile: no timing)", "-"
        fx = "/".join(str(r.get(f"fxgraph_cache_{k}", 0)) for k in ("hit", "miss", "bypass"))
        aot = "/".join(str(r.get(f"autograd_cache_{k}", 0)) for k in ("hit", "miss", "bypass"))
        lines.append(
            f"| {r['model']} | {r['unit']} | {r['arm']} | {r['cache']} | {r['first_step_s']:.1f} | {ratio} | {goal} | "
            f"{fx} | {aot} | {r['frames']} | {r['bypass']} |"
        )
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> str:
    """Markdown table: where each first step's seconds go (:func:`phases`), one line per (unit, arm, cache state),
    and the kernels Triton compiled more than once in the main process."""
    timed = [r for r in rows if "phases" in r]
    if not timed:
        return ""
    columns = [c for c, _ in PHASES] + ["Triton compiles in process", "Triton autotune", "rest"]
    lines = [
        "| compiled | arm | cache | first step s | "
        + " | ".join(columns)
        + " | Triton compiles (repeated kernels) | compiled ahead (thread seconds) |",
        "|---|---|---|---:|" + "---:|" * len(columns) + "---|---:|",
    ]
    for r in timed:
        ph = r["phases"]
        cells = [f"{ph[c]:.1f}" if isinstance(ph.get(c), float) and ph[c] == ph[c] else "-" for c in columns]
        if r.get("mxfx_passes_s"):  # inside the backend's time: mxfx's passes (rewrite, bench/compile_time.py)
            cells[1] += f" (passes {r['mxfx_passes_s']:.2f})"
        per = ph.get("compiles per kernel", {})
        why = ph.get("repeats differ in", {})
        again = ", ".join(f"{k} x{n}" + (f" [{why[k]}]" if why.get(k) else "") for k, n in per.items() if n > 1)
        again = again or "none"
        lines.append(
            f"| {r['unit']} | {r['arm']} | {r['cache']} | {r['first_step_s']:.1f} | "
            + " | ".join(cells)
            + f" | {sum(per.values())} ({again}); {ph.get('Triton cache hits', 0)} cache hits |"
            + " {} ({:.1f} s) |".format(*ph.get("compiled ahead", (0, 0.0)))
        )
    looked = [(r, ph["Triton misses looked in"]) for r in timed if (ph := r["phases"]).get("Triton misses looked in")]
    if looked:
        lines += ["", "where the main process's Triton cache misses looked (environment at each miss):", ""]
        lines += [f"- {r['unit']} {r['arm']} {r['cache']}: " + " | ".join(where) for r, where in looked]
    return "\n".join(lines)


def _aot_only(row: dict):
    """An inner compiler that runs AOTAutograd alone, with Inductor's decompositions and min-cut partitioner, and
    writes its seconds and the joint / forward / backward graphs' node counts into ``row``; what it returns runs
    the graph it was given as it is (AOTAutograd's graphs are only measured)."""
    from functorch.compile import aot_module_simplified, make_boxed_func, min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def partition(joint, inputs, **kwargs):
        start = time.perf_counter()
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        row["partition s"] = time.perf_counter() - start
        row["joint nodes"], row["forward nodes"], row["backward nodes"] = (len(g.graph.nodes) for g in (joint, fw, bw))
        row["kernel nodes"] = sum(
            str(n.target).startswith("triton_kernel_wrapper") for g in (fw, bw) for n in g.graph.nodes
        )
        return fw, bw

    def compile_graph(gm, example_inputs):
        start = time.perf_counter()
        row.setdefault("backend s", start - row.pop("entered"))
        run_as_is = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
        aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=run_as_is,
            bw_compiler=run_as_is,
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )
        row["AOT trace + partition s"] = time.perf_counter() - start
        return gm.forward

    return compile_graph


def passes_only(
    model_name: str, arms: list[str], layers: int, dims: str, device: str, how: str | None = None
) -> list[dict]:
    """Per arm, in this process on ``device``: the mxfx backend's own seconds and its passes' (seconds and nodes
    each adds), then AOTAutograd's (module docstring, ``--passes-only``); prints both tables, headed by ``how``
    (what ran where; by default the device and whether the MX kernels were traced into the graph)."""
    import torch
    import torch._inductor.compile_fx  # noqa: F401  imported by every arm's compile: not the first arm's cost

    import hf_models
    import mxfx
    from mxfx.backend import mxfp8_backend

    rows, steps = [], {}
    for arm in arms:
        torch._dynamo.reset()
        backend, options, _ = ARMS[arm]
        row = {"arm": arm}
        aot = _aot_only(row)
        reports = len(mxfx.report.all_reports())

        def compile_arm(gm, example_inputs):
            row["entered"] = time.perf_counter()
            if backend == "inductor":
                row["Dynamo nodes"] = row["after passes"] = len(gm.graph.nodes)
                return aot(gm, example_inputs)
            return mxfp8_backend(gm, example_inputs, options={**(options or {}), "inner": aot})

        model = hf_models.build_model(model_name, layers, dims, device)
        x = torch.randint(0, model.config.vocab_size, (2, 64), device=device)
        with torch.autocast(device, torch.bfloat16):
            torch.compile(model, backend=compile_arm)(input_ids=x, labels=x)
        for pm in mxfx.report.all_reports()[reports:]:
            row["Dynamo nodes"] = row.get("Dynamo nodes", 0) + pm.nodes
            row["after passes"] = row.get("after passes", 0) + pm.nodes + sum(n for _, n in pm.steps.values())
            row["passes s"] = row.get("passes s", 0.0) + sum(t for t, _ in pm.steps.values())
            for step, (t, n) in pm.steps.items():
                was_t, was_n = steps.setdefault(step, {}).get(arm, (0.0, 0))
                steps[step][arm] = (was_t + t, was_n + n)
        rows.append(row)
    columns = [
        "Dynamo nodes",
        "after passes",
        "passes s",
        "backend s",
        "AOT trace + partition s",
        "partition s",
        "joint nodes",
        "forward nodes",
        "backward nodes",
        "kernel nodes",
    ]
    cell = lambda v: "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    how = how or (
        "CPU (MX ops opaque)" if device == "cpu" else f"{device} (MX kernels as each arm's policy launches them)"
    )
    lines = [
        f"{model_name}, {layers} layers, {dims} dims, {how}",
        "",
        "| arm | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    lines += ["| " + " | ".join([r["arm"], *(cell(r.get(c)) for c in columns)]) + " |" for r in rows]
    mx_arms = [a for a in arms if ARMS[a][0] != "inductor"]
    if steps and mx_arms:
        lines += [
            "",
            "each pass: ms (nodes added)",
            "",
            "| step | " + " | ".join(mx_arms) + " |",
            "|---|" + "---:|" * len(mx_arms),
        ]
        for step, per_arm in steps.items():
            lines.append(
                f"| {step} | "
                + " | ".join(
                    f"{per_arm[a][0] * 1e3:.1f} ({per_arm[a][1]:+d})" if a in per_arm else "-" for a in mx_arms
                )
                + " |"
            )
    from _results import emit

    emit("compile_passes.md", "\n".join(lines))
    return rows


def main(argv=None) -> list[dict]:
    import hf_models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="olmoe", help=f"one of {', '.join(hf_models.MODELS)} (bench/hf_models.py)")
    p.add_argument("--arms", default="bf16,mxfp8", help="comma list of " + ", ".join(ARMS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--units", default="model,block", help="comma list: model (whole-model compile), block (per layer)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny dims (with --dims: those dims)")
    p.add_argument(
        "--dims", choices=hf_models.DIMS, help="model dims (bench/hf_models.py): real, or smoke with --smoke"
    )
    p.add_argument("--passes-only", action="store_true", help="CPU: the passes' own time and graph sizes (no Inductor)")
    p.add_argument("--profile", type=int, default=0, help="write the N costliest functions of each first step")
    p.add_argument(
        "--profile-cache",
        default="cold,warm",
        help="comma list of the cache states --profile profiles (cProfile slows a cold compile about 3x)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--per-block", dest="per_block_run", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    if args.model not in hf_models.MODELS:
        p.error(f"argument --model: {args.model!r}: choose one of {', '.join(hf_models.MODELS)}")
    if args.layers < 1 or args.profile < 0:
        p.error(f"--layers {args.layers} must be >= 1 and --profile {args.profile} >= 0")
    for flag, given, allowed in (
        ("--units", args.units, ("model", "block")),
        ("--profile-cache", args.profile_cache, ("cold", "warm")),
        ("--arms", args.arms, tuple(ARMS)),
    ):
        names = given.split(",")
        if not all(names) or set(names) - set(allowed):
            p.error(f"argument {flag}: {given!r}: a comma list of {', '.join(allowed)}")
    if args.passes_only:
        device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        return passes_only(args.model, args.arms.split(","), args.layers, args.dims or "small", device)
    args.dims = args.dims or ("smoke" if args.smoke else "real")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.child:
        print(
            json.dumps(
                measure(args.model, args.arms, args.layers, args.dims, args.per_block_run, device, args.profile)
            ),
            flush=True,
        )
        return []
    out_dir = os.environ.get("MXFX_BENCH_OUT", os.path.join(ROOT, "bench", "results"))
    rows = []
    for unit in args.units.split(","):
        args.per_block_run = unit == "block"
        for arm in args.arms.split(","):
            with tempfile.TemporaryDirectory(prefix=f"compile_time_{arm}_") as cache_dir:
                for state in ("cold", "warm"):
                    r = {
                        "model": args.model,
                        "unit": unit,
                        "arm": arm,
                        "cache": state,
                        **run_child(
                            args, arm, cache_dir, args.profile if state in args.profile_cache.split(",") else 0
                        ),
                    }
                    if "profile" in r:
                        os.makedirs(out_dir, exist_ok=True)
                        path = os.path.join(out_dir, f"compile_profile_{unit}_{arm}_{state}.txt")
                        with open(path, "w") as f:
                            f.write(r.pop("profile"))
                        r["profiled"] = True
                        print(f"  wrote {path}", flush=True)
                    print(f"  {args.model} {unit} {arm} {state}: {r.get('first_step_s', r.get('error'))}", flush=True)
                    rows.append(r)
    from _results import emit

    emit("compile_time.md", table(rows) + "\n\nwhere each first step goes (seconds):\n\n" + phase_table(rows))
    return rows


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
