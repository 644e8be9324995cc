"""``Policy(kernels="auto")``: per compiled CUDA graph, launch mxfx's Triton kernels from Inductor's code or keep
them as mxfx's custom ops, whichever the graph's size makes cheaper.

Both run the same kernels; they differ in host time. Traced in (``wrap_triton``), each kernel call site is analysed
and compiled by AOTAutograd and Inductor in the first step, and later calls cost a launch from generated code. Kept
opaque, the first step skips that work, and every call pays a custom op's dispatch and Python body instead. That
extra host time is hidden while the host runs ahead of a busy GPU, and is the step's time once it does not.

The choice compares, for one graph, the extra host time per call of its converted GEMMs' ops kept opaque
(:data:`OPAQUE_HOST_S_PER_GEMM` each, forward and backward) with the GPU time of those GEMMs' forward, dgrad
and wgrad at :data:`GEMM_FLOPS`: opaque where the extra host time is at most :data:`HOST_SHARE` of the GEMMs' GPU
time, Inductor-launched otherwise. The estimate leaves out the host work Inductor-launched graphs add of their own
(larger generated code and its launches). A GEMM whose size is data-dependent (expert-parallel received rows) adds
host time and no GPU time.
"""

from __future__ import annotations

from collections.abc import Sequence

OPAQUE_HOST_S_PER_GEMM = 430e-6
"""Extra host seconds a converted GEMM's quantize/layout ops cost per call of its graph (forward and backward)
when kept as custom ops instead of launched by Inductor's code; measured on an H100 host (the kernel notes)."""

GEMM_FLOPS = 600e12
"""FLOP/s assumed for the converted GEMMs (an FP8 rate Hopper's grouped and dense GEMMs sustain)."""

HOST_SHARE = 1.0
"""Share of the converted GEMMs' GPU time the opaque ops' extra host time may take (docs/kernel-notes.md,
2026-12-08: the evidence)."""


def choose(macs: Sequence[int | None]) -> tuple[str, str]:
    """``("opaque" | "inductor", why)`` for a graph whose converted GEMMs have these forward multiply-accumulates
    (None, or not a positive count: not known at compile time, no GPU time counted). ``why`` gives both estimates
    in milliseconds per call of the graph."""
    host = len(macs) * OPAQUE_HOST_S_PER_GEMM
    gpu = 3 * 2 * sum(m for m in macs if m is not None and m > 0) / GEMM_FLOPS  # fwd, dgrad, wgrad; 2 FLOPs a MAC
    mode = "opaque" if host <= HOST_SHARE * gpu else "inductor"
    rel = "<=" if mode == "opaque" else ">"
    return mode, (
        f"auto: custom ops' extra host time {host * 1e3:.3g} ms {rel} {HOST_SHARE:g} x GEMM GPU time "
        f"{gpu * 1e3:.3g} ms per call ({len(macs)} converted GEMM{'' if len(macs) == 1 else 's'})"
    )
