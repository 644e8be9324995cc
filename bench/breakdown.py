"""Where a training step goes: the GPU time of one profiled step by kernel family, summing to the GPU busy time.

:func:`profile_trace` reads a ``torch.profiler`` profile as its Chrome trace (the exported JSON);
:func:`step_breakdown` sums one profiled step of it by family; :func:`kernel_family` names the family of one kernel
from its name and the CPU ops it was launched under; :func:`breakdown_table` prints one arm's breakdown and host
time; :func:`kernel_comparison` sets the costliest kernels of several arms side by side. Families (:data:`FAMILIES`):

* ``routed GEMM``: the grouped expert GEMMs (forward, dgrad, wgrad): mxfx's grouped ops and Triton kernels,
  ``torch._grouped_mm`` / ``torch._scaled_grouped_mm`` (cutlass grouped kernels), transformers' grouped-GEMM
  fallback op;
* ``dense GEMM``: every other GEMM (attention projections, router, shared experts, lm_head): cuBLAS / nvjet /
  cutlass kernels under ``aten::mm`` and kin, ``torch._scaled_mm``, ``mxfx::mm``, ``mxfx::block_mm``;
* ``quantize/layout``: mxfx's quantize, dequantize and transpose kernels and the ops around them (scale layouts);
* ``quantization statistics``: the fused statistics kernels of a sampled step (``Policy.stats``);
* ``attention``: flash / cuDNN / memory-efficient SDPA kernels and what runs under the SDPA ops;
* ``gradient accumulation``: what the autograd engine's ``AccumulateGrad`` runs (the ``add_`` of a microbatch's
  gradient into ``.grad``);
* ``optimizer + refresh``: what runs inside the optimizer step (``Optimizer.step``: fused / foreach AdamW
  kernels, and the weight-cache rebuilds of its post-hook) and mxfx's weight-cache ops elsewhere
  (``mxfx::cached_weight(s)``, ``mxfx::refresh_weight_caches``);
* ``other``: the rest, Inductor's generated ``triton_*`` kernels (norms, activations, routing, casts) among them.

The accounting (CUDA): the device work is every kernel, memcpy and memset event of the trace; profiler-only
events (GPU-side ranges of ``record_function`` annotations, CUDA sync waits, the trace's own range) are no work.
The GPU busy time is the union of the work intervals over all streams. Where kernels of several streams run at
once, each of the k running kernels is given 1/k of that time, so the families sum to the busy time. A kernel is
linked to its launch (the CUDA runtime / driver call of the same ``correlation`` id) and classified by the CPU
ranges (ops, ``record_function`` annotations) enclosing that launch on the launching thread, innermost first; a
kernel without a launch event falls back to the CPU op of its ``External id``, then to its name alone.
``FunctionEvent.kernels`` is not used: torch also attaches a kernel to a runtime call whose CUPTI correlation id
equals the kernel's op id, which counted kernels twice (docs/kernel-notes.md, 2026-12-06).
On CPU (no kernels) every CPU range's self time, the op its own kernel: the self times sum to the union of the
ranges on each thread.

Known blind spots: every kernel under a GEMM or attention op (its operands' casts and copies) counts as that op's;
Inductor fuses the plain torch code of an op body traced into the graph (a quantize written with torch ops) into
``triton_*`` kernels that say nothing of their origin (``other``); a per-expert loop of dense GEMMs outside a
grouped op counts as dense; eager attention (matmul + softmax, no SDPA op) counts as dense GEMM and other.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import tempfile
from collections import defaultdict
from typing import Sequence

ROUTED, DENSE, QUANTIZE, STATS, ATTENTION, ACCUMULATE, OPTIMIZER, OTHER = (
    "routed GEMM",
    "dense GEMM",
    "quantize/layout",
    "quantization statistics",
    "attention",
    "gradient accumulation",
    "optimizer + refresh",
    "other",
)
FAMILIES = (ROUTED, DENSE, QUANTIZE, STATS, ATTENTION, ACCUMULATE, OPTIMIZER, OTHER)

MXFX_KERNELS = {
    # mxfx's Triton kernels by the name of the function Triton compiles (mxfx/kernels); Inductor launches a kernel
    # traced into a graph as "<name>_<n>"
    "_quantize": QUANTIZE,  # mx/quantize.py (rowwise, transposed, route-weight, with dequantized values)
    "_quantize_kernel": QUANTIZE,  # fp8_block/quantize.py
    "_dual_kernel": QUANTIZE,  # mx/dual.py, fp8_block/quantize.py: both orientations from one read
    "_swiglu_quantize_kernel": QUANTIZE,  # mx/swiglu.py
    "_swiglu_save_kernel": QUANTIZE,  # fp8_block/quantize.py
    "_route_grad_kernel": QUANTIZE,  # fp8_block/quantize.py: dY's rows, dY in BF16 and the route weights' gradient
    "_dequantize_kernel": QUANTIZE,  # mx/dequantize.py
    "_dequantize_source_kernel": QUANTIZE,
    "_transpose_kernel": QUANTIZE,  # common/transpose.py: qdata layouts
    "_grouped_body": ROUTED,  # fp8_block/grouped_gemm_triton.py: the grouped forward / dgrad GEMM
    "_grouped_kernel": ROUTED,  # fp8_block/grouped_gemm_sm90.py: the warp-specialized sm90 forward / dgrad GEMM
    "_schedule_kernel": ROUTED,  # fp8_block/grouped_gemm_sm90.py: the tile table the sm90 kernel reads
    "_grouped_wgrad_kernel": ROUTED,  # fp8_block/grouped_gemm_triton.py
    "_grouped_wgrad_into_kernel": ROUTED,  # common/grouped_wgrad_triton.py: BF16 wgrad into the FP32 gradient
    "_grouped_wgrad_into_tma_kernel": ROUTED,  # the same, its operands through TMA
    "_grouped_wgrad_into_sm90_kernel": ROUTED,  # common/grouped_wgrad_sm90.py: the same, ping-pong Gluon on sm90
    "_zero_rows_kernel": ROUTED,  # common/zero_rows.py: a grouped GEMM's rows past the last group
    "_swiglu_product_kernel": OTHER,  # common/silu_triton.py: the SwiGLU activation, unquantized
    "_mx_stats_kernel": STATS,  # mx/quant_stats.py: a sampled site's fused statistics (Policy.stats)
    "_block_stats_kernel": STATS,  # fp8_block/quant_stats.py
    "_finish_kernel": STATS,  # common/quant_stats.py: the sample vector from the partial rows
}
"""mxfx's launched Triton kernels and their families; ``tests/test_breakdown.py`` checks it lists every one."""

_ROUTED_OPS = re.compile(
    r"grouped_mm|grouped_wgrad"
)  # aten::_grouped_mm, aten::_scaled_grouped_mm, mxfx::*, transformers::*
_DENSE_OPS = re.compile(
    r"^(aten::(mm|addmm_?|bmm|baddbmm_?|matmul|linear|_scaled_mm|_addmm_activation)|mxfx::(mm|hp_mm|block_mm(_into)?))$"
)
_QUANTIZE_OPS = re.compile(r"^mxfx::(\w*quantize\w*|block_forward_operands|\w*grad_operands\w*)$")
_STATS_OPS = re.compile(r"^mxfx::quant_stats$")
_ATTENTION = re.compile(r"scaled_dot_product|flash|fmha|sdpa|attention", re.I)
_OP_FAMILIES = (
    (STATS, _STATS_OPS),
    (QUANTIZE, _QUANTIZE_OPS),
    (ATTENTION, _ATTENTION),
    (ROUTED, _ROUTED_OPS),
    (DENSE, _DENSE_OPS),
)
_OPTIMIZER_OPS = re.compile(
    r"^(Optimizer\.(step|zero_grad)#|aten::_fused_(adam|adamw|sgd|adagrad)|aten::_foreach_"
    r"|mxfx::(cached_weights?|refresh_weight_caches)$)"
)
_OPTIMIZER_KERNELS = re.compile(r"adam", re.I)
_GEMM_KERNELS = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|s16816|s1688|wgmma", re.I)
_GROUPED_KERNELS = re.compile(r"group", re.I)
_INDUCTOR_SUFFIX = re.compile(r"_\d+$")


def kernel_family(kernel: str, ops: Sequence[str]) -> str:
    """The family (:data:`FAMILIES`) of one kernel named ``kernel`` launched under the CPU ops ``ops``: the op that
    launched it first, then that op's ancestors out to the top level (empty when the kernel has no CPU op).

    In order: under ``AccumulateGrad`` -> gradient accumulation; under an optimizer step, a fused / foreach optimizer
    op or an mxfx weight-cache op, or an Adam kernel -> optimizer + refresh; an mxfx kernel (:data:`MXFX_KERNELS`)
    -> its family; an Inductor ``triton_*`` kernel -> other (a ``triton_tem_*`` GEMM template: routed or dense GEMM);
    then an op of ``ops`` that samples statistics, quantizes, runs attention, a routed GEMM or a dense GEMM, the first
    of these that any op is (a grouped GEMM op that loops dense ``aten::mm`` calls is routed); then the kernel's name
    (attention, a grouped or a dense GEMM); else other. For a CPU profile, pass an op as its own ``kernel``, first
    in ``ops``.
    """
    if any("AccumulateGrad" in op for op in ops):
        return ACCUMULATE
    if any(_OPTIMIZER_OPS.match(op) for op in ops) or _OPTIMIZER_KERNELS.search(kernel):
        return OPTIMIZER
    family = MXFX_KERNELS.get(kernel) or MXFX_KERNELS.get(_INDUCTOR_SUFFIX.sub("", kernel))
    if family:
        return family
    if kernel.startswith("triton_"):
        if kernel.startswith("triton_tem_") and re.search(r"mm", kernel):
            return ROUTED if "grouped_mm" in kernel else DENSE
        return OTHER
    for family, pattern in _OP_FAMILIES:  # an op of an earlier family holds ops of later ones, never the reverse
        if any(pattern.search(op) for op in ops):
            return family
    if _ATTENTION.search(kernel):
        return ATTENTION
    if _GEMM_KERNELS.search(kernel):
        return ROUTED if _GROUPED_KERNELS.search(kernel) else DENSE
    return OTHER


_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}  # device work (Chrome trace "cat", lower case)
_LAUNCHES = {"cuda_runtime", "cuda_driver"}  # the host calls that launch it
_SYNC_CALL = re.compile(r"Synchronize|^cu(da)?Memcpy(2D|3D)?(DtoH|HtoD|DtoD)?(_v2)?$")
"""Runtime / driver calls that wait for the device by contract (a stream, event or device synchronize, a blocking
copy): their whole duration is the host waiting."""
_QUEUED_CALL = re.compile(r"Launch|Memcpy.*Async|Memset")
"""Calls that put work in the device's queue (kernel launches, async copies and memsets): past
:data:`QUEUE_WAIT_US` they waited for a slot in it. Any other call (an allocation, a module load) is host work."""
QUEUE_WAIT_US = 50.0
"""A queueing call's time past this many microseconds is the host waiting for a slot in the device's launch queue:
the call's own work takes a few microseconds."""
_CPU_RANGES = {"cpu_op", "user_annotation"}  # ops and record_function ranges on a host thread
_NESTED_US = 1e-3  # a range ending this close past its parent's end is still inside it (the trace's us rounding)


def profile_trace(prof) -> dict:
    """The Chrome trace of a finished ``torch.profiler.profile`` (its ``export_chrome_trace`` JSON), parsed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


class _Thread:
    """The CPU ranges of one host thread nested by containment: each range's parent, the ranges enclosing a time."""

    def __init__(self, ranges: list[tuple[float, float, str, object]]):
        """``ranges``: (start us, end us, name, External id) of each."""
        ranges = sorted(ranges, key=lambda r: (r[0], -r[1]))
        self.starts, self.ends, self.names, self.ids = (list(field) for field in zip(*ranges))
        self.parent = []
        open_ = []  # the ranges enclosing the current one, outermost first
        for start, end, *_ in ranges:
            while open_ and (start >= self.ends[open_[-1]] or end > self.ends[open_[-1]] + _NESTED_US):
                open_.pop()
            self.parent.append(open_[-1] if open_ else -1)
            open_.append(len(self.parent) - 1)

    def chain(self, i: int) -> tuple[str, ...]:
        """Range ``i``'s name, then its ancestors' out to the top level."""
        names = []
        while i >= 0:
            names.append(self.names[i])
            i = self.parent[i]
        return tuple(names)

    def enclosing(self, t: float) -> tuple[str, ...]:
        """The names of the ranges open at time ``t``, innermost first (empty if none)."""
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.ends[i] < t:
            i = self.parent[i]
        return self.chain(i)

    def self_times(self) -> list[float]:
        """Each range's duration less its children's."""
        own = [end - start for start, end in zip(self.starts, self.ends)]
        for i, p in enumerate(self.parent):
            if p >= 0:
                own[p] -= self.ends[i] - self.starts[i]
        return own


def _split_overlaps(intervals: Sequence[tuple[float, float]]) -> tuple[list[float], float]:
    """Each interval's share of the union of ``intervals`` (time run by k intervals at once: 1/k to each), and the
    union's length. The shares sum to the union."""
    points = sorted([p for i, (s, e) in enumerate(intervals) for p in ((s, 1, i), (e, 0, i))])
    shares, active, union, last = [0.0] * len(intervals), set(), 0.0, None
    for t, starts, i in points:  # at one time, ends before starts: back-to-back kernels never overlap
        if active and t > last:
            share = (t - last) / len(active)
            for j in active:
                shares[j] += share
            union += t - last
        last = t
        (active.add if starts else active.discard)(i)
    return shares, union


def _threads(events: list[dict]) -> dict[tuple, _Thread]:
    ranges = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in _CPU_RANGES:
            start = float(e["ts"])
            ranges[(e.get("pid"), e.get("tid"))].append(
                (start, start + float(e["dur"]), e["name"], e.get("args", {}).get("External id"))
            )
    return {key: _Thread(r) for key, r in ranges.items()}


def _summary(source: str, spent: list[tuple[str, str, float]], busy_us: float, work_us: float, top: int) -> dict:
    """Sum ``spent`` ((name, family, us) per kernel) by family and by (name, family)."""
    ms, calls = dict.fromkeys(FAMILIES, 0.0), dict.fromkeys(FAMILIES, 0)
    by_kernel: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0])
    for name, family, us in spent:
        ms[family] += us / 1e3
        calls[family] += 1
        by_kernel[(name, family)][0] += us / 1e3
        by_kernel[(name, family)][1] += 1
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])
    costliest = {}
    for (name, family), (kernel_ms, _) in ranked:
        costliest.setdefault(family, {"name": name[:300], "ms": kernel_ms})
    return {
        "source": source,
        "ms": ms,
        "calls": calls,
        "total_ms": sum(ms.values()),
        "busy_ms": busy_us / 1e3,
        "work_ms": work_us / 1e3,
        "overlap_ms": (work_us - busy_us) / 1e3,
        "costliest": costliest,
        "top": [{"name": n[:300], "family": f, "ms": t, "calls": c} for (n, f), (t, c) in ranked[:top]],
    }


def step_breakdown(trace: dict, device: str, top: int = 20) -> dict:
    """Sum one profiled step (the Chrome trace of :func:`profile_trace`, or any dict with ``traceEvents`` in that
    form) by family, as the module docstring says: on ``"cuda"`` the device work's share of the GPU busy time, on
    ``"cpu"`` the CPU ranges' self time.

    Returns ``{"source", "ms": {family: ms}, "calls": {family: n}, "total_ms", "busy_ms", "work_ms",
    "overlap_ms", "unlinked", "host_wait_ms", "costliest": {family: {"name", "ms"}}, "top": [{"name", "family", "ms",
    "calls"}]}``:
    ``total_ms`` the families' sum, ``busy_ms`` the union of the work intervals computed apart from it (CPU: of the
    ranges, per thread), ``work_ms`` the work's summed durations, ``overlap_ms`` their difference (time counted on
    two or more streams), ``unlinked`` the kernels classified by name alone, ``host_wait_ms`` (CUDA; CPU: 0) the time
    the host threads spent waiting for the device inside runtime and driver calls (synchronizing calls whole,
    launches, async copies and memsets past :data:`QUEUE_WAIT_US`: a full launch queue; the union over each thread's
    calls, summed over threads), which a step bound by the GPU adds to its host time, ``top`` the ``top`` costliest
    kernels (CPU: ops) by (name, family).

    Raises:
        ValueError: a ``"cuda"`` trace with no kernel (profiled without ``ProfilerActivity.CUDA``) or with device
            work on more than one device (profile one), or a ``device`` other than ``"cuda"`` and ``"cpu"``.
    """
    events = trace.get("traceEvents", [])
    threads = _threads(events)
    if device == "cpu":
        spent, busy = [], 0.0
        for thread in threads.values():
            for i, own in enumerate(thread.self_times()):
                chain = thread.chain(i)
                spent.append((chain[0], kernel_family(chain[0], chain), own))
            _, union = _split_overlaps(list(zip(thread.starts, thread.ends)))
            busy += union
        out = _summary("CPU op self time", spent, busy, sum(us for *_, us in spent), top)
        out["unlinked"], out["host_wait_ms"] = 0, 0.0
        return out
    if device != "cuda":
        raise ValueError(f"step_breakdown: device {device!r}: give 'cuda' (kernel time) or 'cpu' (op self time)")
    work = [e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() in _WORK]
    if not any(str(e.get("cat")).lower() == "kernel" for e in work):
        raise ValueError(
            "step_breakdown: the trace has no kernel events; profile with ProfilerActivity.CUDA "
            "(or pass device='cpu' for a CPU profile)"
        )
    devices = {e.get("args", {}).get("device", e.get("pid")) for e in work}
    if len(devices) > 1:
        raise ValueError(f"step_breakdown: device work on devices {sorted(devices, key=str)}; profile one device")
    launches = {}  # correlation id -> (host thread, launch time)
    waits = defaultdict(list)  # host thread -> intervals it waited on the device
    for e in events:
        if e.get("ph") != "X" or str(e.get("cat", "")).lower() not in _LAUNCHES:
            continue
        start, dur = float(e["ts"]), max(0.0, float(e.get("dur", 0.0)))
        if _SYNC_CALL.search(e["name"]):
            waits[(e.get("pid"), e.get("tid"))].append((start, start + dur))
        elif _QUEUED_CALL.search(e["name"]) and dur > QUEUE_WAIT_US:
            waits[(e.get("pid"), e.get("tid"))].append((start + QUEUE_WAIT_US, start + dur))
        if "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = ((e.get("pid"), e.get("tid")), start)
    # a runtime call nested in another (cudaStreamSynchronize over cuStreamSynchronize) waits once: union per thread
    wait_us = sum(_split_overlaps(intervals)[1] for intervals in waits.values())
    ops_of_id = {ext: thread.chain(i) for thread in threads.values() for i, ext in enumerate(thread.ids) if ext}
    families: dict[tuple, str] = {}
    spent, unlinked = [], 0
    shares, busy = _split_overlaps([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in work])
    for e, share in zip(work, shares):
        args = e.get("args", {})
        launch = launches.get(args.get("correlation"))
        if launch and launch[0] in threads:
            ops = threads[launch[0]].enclosing(launch[1])
        else:
            ops = ops_of_id.get(args.get("External id"), ())
            unlinked += not ops
        key = (e["name"], ops)
        if key not in families:
            families[key] = kernel_family(e["name"], ops)
        spent.append((e["name"], families[key], share))
    out = _summary("CUDA kernel time", spent, busy, sum(float(e["dur"]) for e in work), top)
    out["unlinked"], out["host_wait_ms"] = unlinked, wait_us / 1e3
    return out


def breakdown_table(title: str, arm: dict) -> str:
    """One arm's markdown table. ``arm``: its measurements, ``step_ms`` (steady wall time per optimizer step),
    ``host_cpu_ms``, ``host_issue_ms`` and, when profiled, ``profiled_step_ms`` and ``breakdown``
    (:func:`step_breakdown`). Family rows: ms per step, % of the GPU busy time (CPU: of the op self time), kernel
    (CPU: op) count and the costliest; then the busy time and the host times, % of the steady step."""
    step = arm["step_ms"]

    def pct(ms, of):
        return f"{100 * ms / of:.1f}" if of else "-"

    lines = [f"| {title} | ms | % | calls | costliest |", "|---|---:|---:|---:|---|"]
    where = arm.get("breakdown")
    if where:
        for family in FAMILIES:
            top = where["costliest"].get(family)
            top = f"{top['name'][:60]}: {top['ms']:.2f} ms" if top else ""
            lines.append(
                f"| {family} | {where['ms'][family]:.2f} | {pct(where['ms'][family], where['total_ms'])} | "
                f"{where['calls'][family]} | {top} |"
            )
        busy = "GPU busy, union over streams" if where["source"] == "CUDA kernel time" else "CPU op self time"
        note = f"{where['overlap_ms']:.2f} ms on 2+ streams at once, split evenly" if where["overlap_ms"] > 0 else ""
        if where["unlinked"]:
            note += f"; {where['unlinked']} kernels without a launch, by name"
        lines.append(
            f"| **{busy}** (families' sum) | {where['total_ms']:.2f} | {pct(where['total_ms'], step)} | "
            f"{sum(where['calls'].values())} | {note} |"
        )
    profiled = f"profiled step: {arm['profiled_step_ms']:.1f} ms" if arm.get("profiled_step_ms") else ""
    lines += [
        f"| **step**, wall (steady) | {step:.2f} | 100.0 | | {profiled} |",
        f"| host issue, wall | {arm['host_issue_ms']:.2f} | {pct(arm['host_issue_ms'], step)} | | |",
        f"| host CPU | {arm['host_cpu_ms']:.2f} | {pct(arm['host_cpu_ms'], step)} | | |",
    ]
    if where and where.get("host_wait_ms"):
        lines.append(
            f"| host waiting on the GPU, profiled step | {where['host_wait_ms']:.2f} | "
            f"{pct(where['host_wait_ms'], arm.get('profiled_step_ms') or step)} | | launch queue full, syncs |"
        )
    if where and where["source"] == "CUDA kernel time" and where["total_ms"]:
        work = max(0.0, arm["host_issue_ms"] - where.get("host_wait_ms", 0.0))
        lines.append(
            f"| host work: issue less waits | {work:.2f} | {pct(work, step)} | | "
            f"{work / where['total_ms']:.2f}x the GPU busy time (steady issue less the profiled step's waits) |"
        )
    return "\n".join(lines)


def kernel_comparison(arms: Sequence[tuple[str, dict]], rows: int = 30, what: str = "kernel") -> str:
    """The costliest kernels of several arms side by side: a markdown table with one row per kernel name (Inductor's
    ``_<n>`` numbering dropped, so that a kernel of each microbatch's graph is one row) and per arm its ms per step
    and calls, the ``rows`` rows with the most time in any arm first. ``arms``: ``(name, breakdown)`` pairs, each a
    :func:`step_breakdown` result; a kernel outside an arm's ``top`` list shows ``-`` there (absent, or cheaper than
    the arm's last listed kernel). ``what`` heads the first column (a CPU breakdown lists ops)."""
    merged: dict[tuple[str, str], dict[str, list]] = defaultdict(dict)
    for arm, where in arms:
        for k in where["top"]:
            cell = merged[(_INDUCTOR_SUFFIX.sub("", k["name"]), k["family"])].setdefault(arm, [0.0, 0])
            cell[0] += k["ms"]
            cell[1] += k["calls"]
    order = sorted(merged.items(), key=lambda kv: -max(ms for ms, _ in kv[1].values()))[:rows]
    names = [arm for arm, _ in arms]
    lines = [
        f"| {what} | family | " + " | ".join(f"{a} ms (calls)" for a in names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for (kernel, family), cells in order:
        shown = [f"{cells[a][0]:.2f} ({cells[a][1]})" if a in cells else "-" for a in names]
        lines.append(f"| {kernel[:90]} | {family} | " + " | ".join(shown) + " |")
    return "\n".join(lines)
