"""What runs natively on a device: the one home for device facts the other layers ask about.

* :func:`triton_available`: whether the Triton kernels serve a tensor (CUDA and Triton importable).
* :data:`NATIVE_GEMMS`: which MX GEMM ops a ``(format, arch)`` runs as a native block-scaled GEMM;
  every other pair is emulated (operands dequantized, fp32 accumulation).
* :func:`emulation_dtype`: the dtype emulated GEMMs read their operands in.
* :func:`colwise_in_source_layout`: the orientation kept for columnwise (dgrad) forms.
"""

from __future__ import annotations

import functools

import torch

FORMAT = "mxfp8"
"""The block-scaled format of the ``mxfx::*`` ops today (E4M3 payload, E8M0 scale per 32 values)."""

GEMM_OPS = ("mm", "grouped_mm", "grouped_mm_wgrad")
"""The MX GEMM ops (``mxfx::mm``, ``mxfx::grouped_mm``, ``mxfx::grouped_mm_wgrad``)."""

NATIVE_GEMMS: dict[tuple[str, str], frozenset[str]] = {
    (FORMAT, "sm100"): frozenset(GEMM_OPS),  # data-center Blackwell: torch._scaled_mm / _scaled_grouped_mm
    (FORMAT, "sm120"): frozenset({"mm"}),  # RTX Blackwell: dense only (torch's MX grouped kernel is sm100's)
}
"""``(format, arch) -> GEMM ops run natively``; arch from :func:`arch_of`. Absent pairs are emulated."""


@functools.cache
def has_triton() -> bool:
    """Whether Triton imports (imported lazily: ``import mxfx`` works without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available(t) -> bool:
    """True when ``t`` is a tensor on a CUDA device and Triton imports (anything else takes the reference path)."""
    return isinstance(t, torch.Tensor) and t.is_cuda and has_triton()


def capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA compute capability of ``device``, None for non-CUDA devices (tests monkeypatch this)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def arch_of(cap: tuple[int, int] | None) -> str:
    """Architecture family of a compute capability: "cpu" (None), "sm80", "sm90", "sm100", "sm120" or "other".

    "sm80" covers every 8.x part (Ampere A100 8.0, Ada L40 8.9), "sm100" every 10.x part (B200 10.0, B300 10.3),
    "sm120" RTX Blackwell (12.x).
    """
    if cap is None:
        return "cpu"
    return {8: "sm80", 9: "sm90", 10: "sm100", 12: "sm120"}.get(cap[0], "other")


def gemm_runs_natively(op: str, device: torch.device, fmt: str = FORMAT) -> bool:
    """Whether GEMM ``op`` (one of :data:`GEMM_OPS`) runs as a native block-scaled GEMM on ``device``.

    Raises:
        ValueError: ``op`` is not a GEMM op.
    """
    if op not in GEMM_OPS:
        raise ValueError(f"mxfx.gemm: op={op!r} is not a GEMM op; choose one of {GEMM_OPS}")
    return op in NATIVE_GEMMS.get((fmt, arch_of(capability(device))), ())


@functools.cache
def _cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies BF16 matrices in hardware (AVX512-BF16 or AMX); torch's own probes."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def native_bf16_matmul(device: torch.device) -> bool:
    """Whether BF16 GEMMs run on native BF16 instructions on ``device``: always on CUDA; on CPU only with
    AVX512-BF16 or AMX. Elsewhere (an AVX2-only CPU) BF16 GEMMs are emulated and much slower than FP32 ones,
    so mxfx's own BF16 GEMMs run in FP32 there: BF16 operands are exact in FP32 and accumulation is FP32
    either way, so the sums are the same up to summation order."""
    return device.type != "cpu" or _cpu_has_bf16_matmul()


def emulation_dtype(device: torch.device) -> torch.dtype:
    """The dtype emulated GEMMs dequantize into: fp32 on CPU, bf16 on CUDA (exact for E4M3 x 2^e)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def emulated_operand_dtype(op: str, device: torch.device) -> torch.dtype | None:
    """The dtype GEMM ``op`` reads its operands in where it is emulated on ``device``, None where it runs
    natively. A quantize pass making an operand of an emulated GEMM writes its dequantized values in this
    dtype too, so that no dequantize pass follows."""
    return None if gemm_runs_natively(op, device) else emulation_dtype(device)


def colwise_in_source_layout(device: torch.device, op: str = "mm") -> bool:
    """Whether columnwise (dgrad) MX operands for GEMM ``op`` on ``device`` stay in the source layout.

    Native MX GEMMs read the columnwise operand ``[K, M]`` as a contiguous (K-major) tensor, so it is
    stored transposed. Emulated GEMMs read either orientation at the same cost, so it stays the transpose
    view of a contiguous ``[M, K]`` tensor (no transpose in its quantize or dequantize). True exactly
    where ``op`` is emulated.
    """
    return not gemm_runs_natively(op, device)


def current_device() -> torch.device:
    """The current CUDA device where CUDA is available, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
