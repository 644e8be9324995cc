"""Where a training step goes: the device time of one profiled step by kernel family.

:func:`kernel_family` names the family of one kernel from its name and the CPU ops it was launched under;
:func:`step_breakdown` sums a ``torch.profiler`` trace of one step by family; :func:`breakdown_table` prints the
families of several arms side by side. Families (:data:`FAMILIES`):

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
* ``optimizer + refresh``: the optimizer step (fused / foreach AdamW kernels) and mxfx's weight-cache rebuilds
  (``mxfx::cached_weight``, ``mxfx::refresh_weight_caches``);
* ``other``: the rest, Inductor's generated ``triton_*`` kernels (norms, activations, routing, casts) among them.

Known blind spots: every kernel under a GEMM or attention op (its operands' casts and copies) counts as that op's;
Inductor fuses the plain torch code of an op body traced into the graph (a quantize written with torch ops) into
``triton_*`` kernels that say nothing of their origin (``other``); a per-expert loop of dense GEMMs outside a
grouped op counts as dense; eager attention (matmul + softmax, no SDPA op) counts as dense GEMM and other.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Iterable, Sequence

ROUTED, DENSE, QUANTIZE, STATS, ATTENTION, ACCUMULATE, OPTIMIZER, OTHER = (
    "routed GEMM", "dense GEMM", "quantize/layout", "quantization statistics", "attention", "gradient accumulation",
    "optimizer + refresh", "other")
FAMILIES = (ROUTED, DENSE, QUANTIZE, STATS, ATTENTION, ACCUMULATE, OPTIMIZER, OTHER)

MXFX_KERNELS = {
    # mxfx's Triton kernels by the name of the function Triton compiles (mxfx/kernels); Inductor launches a kernel
    # traced into a graph as "<name>_<n>"
    "_quantize": QUANTIZE,  # mx/quantize.py (rowwise, transposed, route-weight, with dequantized values)
    "_quantize_kernel": QUANTIZE,  # fp8_block/quantize.py
    "_dual_kernel": QUANTIZE,  # mx/dual.py, fp8_block/quantize.py: both orientations from one read
    "_swiglu_quantize_kernel": QUANTIZE,  # mx/swiglu.py
    "_swiglu_save_kernel": QUANTIZE,  # fp8_block/quantize.py
    "_dequantize_kernel": QUANTIZE,  # mx/dequantize.py
    "_dequantize_source_kernel": QUANTIZE,
    "_transpose_kernel": QUANTIZE,  # common/transpose.py: qdata layouts
    "_grouped_body": ROUTED,  # fp8_block/grouped_gemm.py: the grouped forward / dgrad GEMM
    "_grouped_wgrad_kernel": ROUTED,  # fp8_block/grouped_gemm.py
    "_zero_rows_kernel": ROUTED,  # common/zero_rows.py: a grouped GEMM's rows past the last group
    "_swiglu_product_kernel": OTHER,  # common/silu_triton.py: the SwiGLU activation, unquantized
    "_mx_stats_kernel": STATS,  # mx/quant_stats.py: a sampled site's fused statistics (Policy.stats)
    "_block_stats_kernel": STATS,  # fp8_block/quant_stats.py
    "_finish_kernel": STATS,  # common/quant_stats.py: the sample vector from the partial rows
}
"""mxfx's launched Triton kernels and their families; ``tests/test_bench_smoke.py`` checks it lists every one."""

_ROUTED_OPS = re.compile(r"grouped_mm|grouped_wgrad")  # aten::_grouped_mm, aten::_scaled_grouped_mm, mxfx::*, transformers::*
_DENSE_OPS = re.compile(r"^(aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|_addmm_activation)|mxfx::(mm|block_mm))$")
_QUANTIZE_OPS = re.compile(r"^mxfx::(\w*quantize\w*|block_forward_operands)$")
_ATTENTION = re.compile(r"scaled_dot_product|flash|fmha|sdpa|attention", re.I)
_OP_FAMILIES = ((QUANTIZE, _QUANTIZE_OPS), (ATTENTION, _ATTENTION), (ROUTED, _ROUTED_OPS), (DENSE, _DENSE_OPS))
_OPTIMIZER_OPS = re.compile(
    r"^(Optimizer\.(step|zero_grad)#|aten::_fused_(adam|adamw|sgd|adagrad)|aten::_foreach_"
    r"|mxfx::(cached_weight|refresh_weight_caches)$)")
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
    then an op of ``ops`` that quantizes, runs attention, a routed GEMM or a dense GEMM, the first of these that
    any op is (a grouped GEMM op that loops dense ``aten::mm`` calls is routed); then the kernel's name (attention,
    a grouped or a dense GEMM); else other. For a CPU profile, pass an op as its own ``kernel``, first in ``ops``.
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


def _ops_of(evt) -> tuple[str, ...]:
    """``evt``'s name, then its CPU ancestors' (``FunctionEvent.cpu_parent``), innermost first."""
    names = []
    while evt is not None:
        names.append(evt.name)
        evt = evt.cpu_parent
    return tuple(names)


def _key(evt) -> tuple[str, float]:
    """A device event as the ``Kernel`` entry of its CPU op names it: (name, duration in us)."""
    return evt.name, evt.time_range.end - evt.time_range.start


def step_breakdown(events: Iterable, device: str, top: int = 20) -> dict:
    """Sum one profiled step (``torch.profiler.profile(...).events()``) by family.

    On CUDA: every device kernel's duration (its ``FunctionEvent.kernels`` entry on the CPU op that launched it;
    a device event no CPU op claims is named by its kernel name alone). Kernels on concurrent streams both count.
    On CPU (no kernels): every CPU op's self time, the op its own kernel.

    Returns ``{"source", "ms": {family: ms}, "total_ms", "top": [{"name", "family", "ms", "calls"}]}``, ``top``
    the ``top`` costliest kernels (CPU: ops).
    """
    from torch.autograd import DeviceType

    spent: dict[str, float] = defaultdict(float)
    by_kernel: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0])

    def add(name: str, family: str, us: float) -> None:
        spent[family] += us
        entry = by_kernel[(name, family)]
        entry[0] += us
        entry[1] += 1

    events = list(events)
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    if device == "cuda":
        source = "CUDA kernel time"
        device_events = [e for e in events if e.device_type != DeviceType.CPU]
        # a record_function's range on the device (gpu_user_annotation) spans kernels: never one itself
        annotations = Counter(_key(e) for e in device_events if getattr(e, "is_user_annotation", False))
        claimed: Counter = Counter()
        for e in cpu_events:
            if not e.kernels or getattr(e, "is_legacy", False):
                continue
            ops = _ops_of(e)
            for k in e.kernels:
                if annotations[(k.name, k.duration)]:
                    continue
                add(k.name, kernel_family(k.name, ops), k.duration)
                claimed[(k.name, k.duration)] += 1
        for e in device_events:  # kernels no CPU op claims (one of a claimed kernel's name and duration: that one)
            if getattr(e, "is_user_annotation", False):
                continue
            key = _key(e)
            if claimed[key]:
                claimed[key] -= 1
            else:
                add(e.name, kernel_family(e.name, ()), key[1])
    else:
        source = "CPU op self time"
        for e in cpu_events:
            add(e.name, kernel_family(e.name, _ops_of(e)), e.self_cpu_time_total)
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "source": source,
        "ms": {f: spent.get(f, 0.0) / 1e3 for f in FAMILIES},
        "total_ms": sum(spent.values()) / 1e3,
        "top": [{"name": name[:300], "family": fam, "ms": us / 1e3, "calls": n} for (name, fam), (us, n) in ranked],
    }


def top_lines(breakdown: dict, rows: int = 12, width: int = 90) -> str:
    """The costliest kernels of a :func:`step_breakdown`, one line each: ms, calls, family, name."""
    return "\n".join(f"    {k['ms']:8.2f} ms {k['calls']:5d}x  {k['family']:<22} {k['name'][:width]}"
                     for k in breakdown["top"][:rows])


def breakdown_table(columns: dict[str, dict]) -> str:
    """Markdown table, one column per arm: ``columns`` maps an arm to its measurements (``step_ms``, ``host_cpu_ms``,
    ``host_issue_ms`` and, when profiled, ``breakdown`` of :func:`step_breakdown`). Each cell: ms per optimizer step
    and its share of the step's wall time (``step_ms``)."""
    arms = list(columns)

    def cell(ms, step_ms):
        if ms is None:
            return "-"
        return f"{ms:.2f} ({100 * ms / step_ms:.0f}%)" if step_ms else f"{ms:.2f}"

    sources = {c["breakdown"]["source"] for c in columns.values() if c.get("breakdown")}
    rows = []
    if sources:
        for family in FAMILIES:
            rows.append((family, [c["breakdown"]["ms"][family] if c.get("breakdown") else None for c in columns.values()]))
        rows.append((f"sum ({', '.join(sorted(sources))})",
                     [c["breakdown"]["total_ms"] if c.get("breakdown") else None for c in columns.values()]))
    rows += [("step (wall)", [c["step_ms"] for c in columns.values()]),
             ("host CPU", [c["host_cpu_ms"] for c in columns.values()]),
             ("host issue (wall)", [c["host_issue_ms"] for c in columns.values()])]
    lines = ["| ms per step (% of step) | " + " | ".join(arms) + " |", "|---|" + "---:|" * len(arms)]
    for label, values in rows:
        lines.append(f"| {label} | " + " | ".join(cell(v, c["step_ms"]) for v, c in zip(values, columns.values())) + " |")
    return "\n".join(lines)
