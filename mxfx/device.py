"""Device facts the other layers ask about, whatever the format.

* :func:`triton_available`: whether the Triton kernels serve a tensor (CUDA and Triton importable).
* :func:`capability` / :func:`arch_of`: the architecture family of a device ("cpu", "sm90", "sm100", ...), by
  which each format (:attr:`mxfx.formats.base.Format.native_gemms`) says which of its GEMMs run natively.
* :func:`native_bf16_matmul`: whether BF16 GEMMs run on native BF16 instructions.
* :func:`num_sms`: the streaming multiprocessors a persistent grid is sized by.
"""

from __future__ import annotations

import functools

import torch


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
    """CUDA compute capability of ``device``, None for non-CUDA devices (tests monkeypatch this). Asked per weight
    lookup and GEMM dispatch: read once per device index."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def arch_of(cap: tuple[int, int] | None) -> str:
    """Architecture family of a compute capability: "cpu" (None), "sm80", "sm90", "sm100", "sm120" or "other".

    "sm80" covers every 8.x part (Ampere A100 8.0, Ada L40 8.9), "sm100" every 10.x part (B200 10.0, B300 10.3),
    "sm120" RTX Blackwell (12.x).
    """
    if cap is None:
        return "cpu"
    return {8: "sm80", 9: "sm90", 10: "sm100", 12: "sm120"}.get(cap[0], "other")


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


def current_device() -> torch.device:
    """The current CUDA device where CUDA is available, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (read once per device index); 132, an H100's, elsewhere (the
    launches the sm90 compile tests build on the CPU)."""
    if device.type != "cuda":
        return 132
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
