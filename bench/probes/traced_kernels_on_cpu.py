"""Probe: the graphs AOTAutograd traces on a GPU, approximated on the CPU (``compile_time.py --passes-only``).

On a GPU the fp8_block ops' Python bodies are traced into the graph and their Triton kernels enter it as
``wrap_triton`` calls, which AOTAutograd's functionalization analyses (Triton IR generated per kernel call), and
Inductor analyses again when it lowers them. On the CPU the ops stay opaque. Here traced CPU tensors take the
GPU's path: mxfx's ``triton_available`` answers yes for them (``mxfx.kernels.common.launch`` and
``mxfx.kernels.fp8_block.device_path``), the dense GEMM is cuBLAS's wrapper (``torch.nn.functional.scaled_mm``'s
meta function checks it), and Triton generates IR for an sm90 target (a driver that names one; no GPU, no
compile). What is not simulated: CUDA-only branches elsewhere (``tensor.is_cuda``), the grouped GEMM (an opaque op
on both), the partitioner's and Inductor's device-dependent choices.

    python -m bench.probes.traced_kernels_on_cpu                 # olmoe, 4 layers, small dims: bf16, fp8_block-inductor
    python -m bench.probes.traced_kernels_on_cpu --layers 1 --profile 40
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compile_time  # noqa: E402

from mxfx.kernels.common import launch  # noqa: E402
from mxfx.kernels.fp8_block import device_path, gemm, gemm_cublas  # noqa: E402


class _Sm90:
    """A Triton driver that only names its target: Triton IR is generated for sm90, nothing runs."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _as_on_gpu() -> None:
    """Traced tensors take the GPU's paths; tensors of data (the model's first step, run after it is compiled) the
    CPU's, which run."""
    triton.runtime.driver.set_active(_Sm90())
    for module in (launch, device_path):
        module.triton_available = lambda t: isinstance(t, torch.Tensor) and launch.traced(t)
    cpu_mm = gemm.scaled_mm

    def scaled_mm(a, a_scales, b, b_scales, out_dtype=torch.bfloat16):
        run = gemm_cublas.mm if launch.traced(a) else cpu_mm
        return run(a, a_scales, b, b_scales, out_dtype)

    gemm.scaled_mm = scaled_mm


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="olmoe")
    p.add_argument("--arms", default="bf16,fp8_block-inductor", help="fp8_block-inductor: kernels traced in as on sm90")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dims", default="small")
    p.add_argument("--profile", type=int, default=0, help="print the N functions with the most cumulative time")
    args = p.parse_args(argv)
    _as_on_gpu()
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    compile_time.passes_only(
        args.model,
        args.arms.split(","),
        args.layers,
        args.dims,
        "cpu",
        how="CPU as on an sm90 GPU (MX kernels traced into the graph; Triton IR for sm90)",
    )
    if prof:
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("cumulative").print_stats("generate_ttir|mxfx", args.profile)


if __name__ == "__main__":
    main()
