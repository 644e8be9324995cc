"""``bench/breakdown.py``: kernel families, and the accounting of a profiled step (families summing to the GPU
busy time) on a hand-built Chrome trace and on a real CPU profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.breakdown import (
    FAMILIES,
    MXFX_KERNELS,
    QUEUE_WAIT_US,
    breakdown_table,
    kernel_comparison,
    kernel_family,
    profile_trace,
    step_breakdown,
)

ROOT = Path(__file__).resolve().parents[1]

KERNELS = [  # (kernel name, the CPU ops it ran under: launching op first), family
    # cuBLAS / cutlass GEMMs: a dense GEMM, or routed under a grouped op (forward, dgrad, wgrad)
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", ("aten::mm", "CompiledFunction"), "dense GEMM"),
    (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
        ("aten::addmm", "CompiledFunctionBackward", "autograd::engine::evaluate_function: CompiledFunctionBackward"),
        "dense GEMM",
    ),
    ("nvjet_qqtst_128x128_128x6_2x1_v_bz_coopA_TNN", ("aten::_scaled_mm", "mxfx::block_mm"), "dense GEMM"),
    (
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)",
        (),
        "dense GEMM",
    ),
    (
        "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
        "cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, "
        "cute::tuple<cute::C<128>, cute::C<256>, cute::C<64> >>>>",
        ("aten::_grouped_mm", "CompiledFunction"),
        "routed GEMM",
    ),
    (
        "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
        "cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >>>>",
        (),
        "routed GEMM",
    ),
    (
        "sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x128x32_cublas",
        ("aten::mm", "transformers::grouped_mm_fallback_backward", "CompiledFunctionBackward"),
        "routed GEMM",
    ),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", ("aten::mm", "aten::_grouped_mm", "mxfx::grouped_wgrad_bf16"), "routed GEMM"),
    (
        "void at::native::elementwise_kernel<128, 2, "
        "at::native::gpu_kernel_impl_nocast<at::native::FillFunctor<float>>>",
        ("aten::fill_", "aten::zero_", "mxfx::block_grouped_wgrad"),
        "routed GEMM",
    ),
    # mxfx's Triton kernels: launched from its custom ops, or from Inductor's code as <name>_<n>
    ("_grouped_body", ("mxfx::block_grouped_mm", "CompiledFunction"), "routed GEMM"),
    ("_grouped_wgrad_kernel", ("mxfx::block_grouped_wgrad",), "routed GEMM"),
    ("_zero_rows_kernel_3", ("_zero_rows_kernel_3", "CompiledFunction"), "routed GEMM"),
    ("_quantize", ("mxfx::quantize", "CompiledFunction"), "quantize/layout"),
    ("_quantize_2", ("_quantize_2", "CompiledFunction"), "quantize/layout"),
    ("_quantize_kernel", ("mxfx::block_quantize",), "quantize/layout"),
    ("_dual_kernel_0", ("_dual_kernel_0", "CompiledFunctionBackward"), "quantize/layout"),
    ("_swiglu_quantize_kernel_1", ("_swiglu_quantize_kernel_1", "CompiledFunction"), "quantize/layout"),
    ("_swiglu_save_kernel", ("mxfx::block_forward_operands",), "quantize/layout"),
    ("_transpose_kernel_4", ("_transpose_kernel_4",), "quantize/layout"),
    ("_dequantize_kernel", ("mxfx::dequantize",), "quantize/layout"),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float, float, float>>",
        ("aten::copy_", "mxfx::quantize_dual_blocked"),
        "quantize/layout",
    ),
    ("_swiglu_product_kernel_0", ("_swiglu_product_kernel_0", "CompiledFunction"), "other"),
    # a weight-cache rebuild quantizes: its cost is the step's refresh
    ("_dual_kernel", ("mxfx::cached_weight", "CompiledFunction", "Torch-Compiled Region: 0/0"), "optimizer + refresh"),
    ("_quantize", ("mxfx::refresh_weight_caches",), "optimizer + refresh"),
    # attention
    (
        "void pytorch_flash::flash_fwd_kernel<"
        "Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>",
        ("aten::_flash_attention_forward", "aten::_scaled_dot_product_flash_attention"),
        "attention",
    ),
    (
        "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128>>",
        ("aten::_flash_attention_backward", "aten::_scaled_dot_product_flash_attention_backward"),
        "attention",
    ),
    (
        "cudnn_generated_fortran_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
        ("aten::_scaled_dot_product_cudnn_attention",),
        "attention",
    ),
    ("fmha_cutlassB_bf16_aligned_128x64_k128_sm80", (), "attention"),
    # a fused wgrad: cuBLAS accumulating into the FP32 .grad (addmm_ / out=), FP8's cuBLAS GEMM then its add
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_TNT", ("aten::addmm_", "mxfx::wgrad_into_grad"), "dense GEMM"),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
        ("aten::add_", "mxfx::block_mm_into", "mxfx::wgrad_into_grad"),
        "dense GEMM",
    ),
    ("_grouped_wgrad_into_kernel", ("mxfx::wgrad_into_grad",), "routed GEMM"),
    ("nvjet_sm90_tst_64x64_64x6_1x2_h_bz_TNT", ("aten::mm", "mxfx::hp_mm"), "dense GEMM"),
    (
        "void at::native::elementwise_kernel<128, 4, at::native::FillFunctor<c10::BFloat16>>",
        ("aten::fill_", "aten::zero_", "aten::_scaled_dot_product_efficient_attention_backward"),
        "attention",
    ),
    # gradient accumulation: AccumulateGrad's add_ of a microbatch's gradient into .grad
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3>>",
        (
            "aten::add_",
            "torch::autograd::AccumulateGrad",
            "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",
        ),
        "gradient accumulation",
    ),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3>>",
        ("aten::add", "CompiledFunctionBackward"),
        "other",
    ),
    # the optimizer step
    (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::ADAM_MODE)1, false>, double, double, double, double, double, bool, double*, float*>",
        ("aten::_fused_adamw_", "Optimizer.step#AdamW.step"),
        "optimizer + refresh",
    ),
    (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>>",
        ("aten::_foreach_add_", "Optimizer.step#AdamW.step"),
        "optimizer + refresh",
    ),
    (
        "triton_poi_fused__foreach_addcdiv__foreach_mul_0",
        ("triton_poi_fused__foreach_addcdiv__foreach_mul_0", "Optimizer.step#AdamW.step"),
        "optimizer + refresh",
    ),
    # Inductor's generated kernels: other, whatever their fused ops' names say
    (
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "CompiledFunction"),
        "other",
    ),
    (
        "triton_poi_fused__scaled_dot_product_flash_attention_transpose_3",
        ("triton_poi_fused__scaled_dot_product_flash_attention_transpose_3", "CompiledFunction"),
        "other",
    ),
    ("triton_per_fused__softmax_topk_2", ("triton_per_fused__softmax_topk_2",), "other"),
    ("triton_tem_fused_mm_4", ("triton_tem_fused_mm_4",), "dense GEMM"),
    ("Memcpy DtoD (Device -> Device)", ("aten::copy_", "CompiledFunction"), "other"),
    ("void at::native::index_elementwise_kernel<128, 4>", ("aten::index", "CompiledFunction"), "other"),
    # a CPU profile: each op is its own kernel
    ("aten::mm", ("aten::mm", "aten::_grouped_mm", "CompiledFunction"), "routed GEMM"),
    ("aten::mm", ("aten::mm", "CompiledFunction"), "dense GEMM"),
    ("aten::_fused_adamw_", ("aten::_fused_adamw_", "Optimizer.step#AdamW.step"), "optimizer + refresh"),
    (
        "aten::add_",
        ("aten::add_", "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"),
        "gradient accumulation",
    ),
    ("aten::amax", ("aten::amax", "mxfx::cached_weight"), "optimizer + refresh"),
    ("aten::amax", ("aten::amax", "mxfx::block_route_grad_operands_gathered"), "quantize/layout"),
    ("aten::mul", ("aten::mul", "mxfx::block_grouped_grad_operands"), "quantize/layout"),
    ("aten::amax", ("aten::amax", "mxfx::block_quantize", "mxfx::quant_stats"), "quantization statistics"),
    ("CompiledFunction", ("CompiledFunction", "Torch-Compiled Region: 0/0"), "other"),
]


@pytest.mark.parametrize("kernel,ops,family", KERNELS, ids=[f"{i}-{f}" for i, (_, _, f) in enumerate(KERNELS)])
def test_kernel_family(kernel, ops, family):
    """``bench/breakdown.py`` names a kernel's family from its name and the CPU ops it ran under."""
    assert family in FAMILIES
    assert kernel_family(kernel, ops) == family


def test_every_mxfx_kernel_has_a_family():
    """Every Triton kernel mxfx launches (a ``@triton.jit`` function named ``*_kernel``, or one ``triton.jit(...)``
    wraps) is in ``MXFX_KERNELS``, and nothing else is: a new or renamed kernel would fall into ``other``."""
    import ast

    def is_jit(node):  # triton.jit or triton.jit(...)
        node = node.func if isinstance(node, ast.Call) else node
        return isinstance(node, ast.Attribute) and node.attr == "jit"

    launched = set()
    for path in (ROOT / "mxfx" / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.FunctionDef)
                and node.name.endswith("_kernel")
                and any(map(is_jit, node.decorator_list))
            ):
                launched.add(node.name)
            if isinstance(node, ast.Call) and is_jit(node.func) and node.args and isinstance(node.args[0], ast.Name):
                launched.add(node.args[0].id)  # triton.jit(...)(fn)
    assert launched == set(MXFX_KERNELS)


HOST, ENGINE, GPU = (1, 1), (1, 2), 0  # (pid, tid) of the main thread and the autograd engine's; the GPU's pid
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3>>"
ADAM = "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor<float>>"


def _x(cat, name, ts, dur, where, **args):
    """One complete ("X") event of a Chrome trace as torch.profiler exports it; ``where``: (pid, tid)."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": where[0], "tid": where[1], "args": args}


def _launch(name, ts, corr, ext, where=HOST, cat="cuda_runtime"):
    return _x(cat, name, ts, 2, where, correlation=corr, **({"External id": ext} if ext else {}))


def _kernel(name, ts, dur, stream, corr, ext, cat="kernel"):
    return _x(
        cat,
        name,
        ts,
        dur,
        (GPU, stream),
        device=GPU,
        stream=stream,
        correlation=corr,
        **({"External id": ext} if ext else {}),
    )


def synthetic_trace():
    """One step on two streams (us): a forward GEMM on stream 7 overlapping a quantize on stream 20, an
    accumulation launched from the autograd engine's thread, the optimizer step (fused AdamW, a memset beside it on
    stream 20, and a weight-cache quantize of its post-hook launched outside any op: a user-scope range such as
    ``Optimizer.step`` gives no External id, so the launch and its kernel have none, and the launch's CUPTI
    correlation id equals aten::mm's External id), a kernel found only by its External id and one found by
    nothing; profiler-only events (the optimizer's GPU-side annotation, a stream wait, the trace's own range)."""
    return {
        "traceEvents": [
            {"ph": "M", "name": "thread_name", "pid": HOST[0], "tid": HOST[1], "args": {"name": "python"}},
            _x("Trace", "PyTorch Profiler (0)", 0, 1000, HOST),
            _x("cpu_op", "CompiledFunction", 0, 60, HOST, **{"External id": 1}),
            _x("cpu_op", "aten::mm", 5, 10, HOST, **{"External id": 2}),
            _launch("cudaLaunchKernel", 6, 101, 2),
            _x("cpu_op", "mxfx::block_forward_operands", 20, 10, HOST, **{"External id": 3}),
            _launch("cuLaunchKernelEx", 21, 102, 3, cat="cuda_driver"),
            _x("cpu_op", "aten::add", 35, 5, HOST, **{"External id": 4}),
            _launch("cudaLaunchKernel", 36, 103, 4),
            _x(
                "cpu_op",
                "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",
                200,
                20,
                ENGINE,
                **{"External id": 20},
            ),
            _x("cpu_op", "torch::autograd::AccumulateGrad", 201, 18, ENGINE, **{"External id": 21}),
            _x("cpu_op", "aten::add_", 202, 8, ENGINE, **{"External id": 22}),
            _launch("cudaLaunchKernel", 203, 120, 22, where=ENGINE),
            _x("user_annotation", "Optimizer.step#AdamW.step", 300, 100, HOST, **{"External id": 10}),
            _x("cpu_op", "aten::_fused_adamw_", 310, 20, HOST, **{"External id": 11}),
            _launch("cudaLaunchKernel", 312, 110, 11),
            _launch("cuLaunchKernelEx", 340, 2, 0, cat="cuda_driver"),  # the post-hook's refresh: CUPTI's id 2, no op's
            _x("cpu_op", "aten::zero_", 360, 5, HOST, **{"External id": 12}),
            _launch("cudaMemsetAsync", 361, 112, 12),
            _kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 100, 100, 7, 101, 2),
            _kernel("_quantize_kernel", 150, 80, 20, 102, 3),
            _kernel(ADD, 230, 10, 7, 103, 4),
            _x("cuda_sync", "Stream Wait Event", 240, 10, (GPU, 7), device=GPU, stream=7),
            _kernel(ADD, 250, 20, 7, 120, 22),
            _x(
                "gpu_user_annotation", "Optimizer.step#AdamW.step", 500, 60, (GPU, 7), device=GPU, **{"External id": 10}
            ),
            _kernel(ADAM, 500, 40, 7, 110, 11),
            _kernel("Memset (Device)", 520, 10, 20, 112, 12, cat="gpu_memset"),
            _kernel("_dual_kernel", 540, 20, 7, 2, 0),
            _kernel("nvjet_hsh_64x32_64x16_2x1_v_bz_TNT", 600, 10, 20, 130, 2),  # its launch is not in the trace
            _kernel("triton_per_fused_sum_0", 700, 5, 7, 131, 0),  # nothing links it
            {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 101, "pid": HOST[0], "tid": HOST[1], "ts": 6},
            {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 101, "pid": GPU, "tid": 7, "ts": 100, "bp": "e"},
        ]
    }


def test_step_breakdown_adds_up_to_busy_time():
    """The families sum to the GPU busy time: time on two streams at once counted once (split evenly between its
    kernels), profiler-only events (a GPU-side annotation, a stream wait, the trace's range) no work, each kernel
    in the family of the CPU ranges around its launch (inside ``Optimizer.step``: optimizer + refresh, whatever its
    name; under ``AccumulateGrad``: accumulation, the same add kernel elsewhere: other), a kernel counted once even
    where a launch's correlation id equals its op's External id."""
    out = step_breakdown(synthetic_trace(), "cuda")
    us = 1e-3  # ms
    # busy: [100, 240] + [250, 270] + [500, 560] + [600, 610] + [700, 705]; work: the durations' sum
    assert out["busy_ms"] == pytest.approx(235 * us)
    assert out["work_ms"] == pytest.approx(295 * us) and out["overlap_ms"] == pytest.approx(60 * us)
    assert out["total_ms"] == pytest.approx(out["busy_ms"], rel=1e-12)
    expected = {  # the GEMM and the quantize split [150, 200]; AdamW and the memset split [520, 530]
        "dense GEMM": 75 + 10,
        "quantize/layout": 25 + 30,
        "other": 10 + 5,
        "gradient accumulation": 20,
        "optimizer + refresh": 35 + 5 + 20,
        "routed GEMM": 0,
        "attention": 0,
        "quantization statistics": 0,
    }
    assert out["ms"] == pytest.approx({f: ms * us for f, ms in expected.items()}, abs=1e-12)
    kernels = {  # (name, family): ms of the busy time
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "dense GEMM"): 75,
        ("_quantize_kernel", "quantize/layout"): 55,
        (ADD, "other"): 10,
        (ADD, "gradient accumulation"): 20,
        (ADAM, "optimizer + refresh"): 35,
        ("Memset (Device)", "optimizer + refresh"): 5,
        ("_dual_kernel", "optimizer + refresh"): 20,
        ("nvjet_hsh_64x32_64x16_2x1_v_bz_TNT", "dense GEMM"): 10,  # by its External id: aten::mm
        ("triton_per_fused_sum_0", "other"): 5,
    }
    assert {(k["name"], k["family"]): k["ms"] for k in out["top"]} == pytest.approx(
        {key: ms * us for key, ms in kernels.items()}, abs=1e-12
    )
    assert all(k["calls"] == 1 for k in out["top"])
    assert out["unlinked"] == 1
    assert out["costliest"]["optimizer + refresh"] == {"name": ADAM, "ms": pytest.approx(35 * us)}


def test_step_breakdown_host_waits_on_the_device():
    """Time the host spends waiting on the GPU inside runtime calls: a synchronize whole (once where the driver's
    runs inside the runtime's), a launch past QUEUE_WAIT_US (a full launch queue) by its excess; the synthetic
    trace's 2 us launches, an allocation and a module load (host work), an event without a duration wait for
    nothing."""
    assert step_breakdown(synthetic_trace(), "cuda")["host_wait_ms"] == 0
    trace = synthetic_trace()
    trace["traceEvents"] += [
        _x("cuda_runtime", "cudaLaunchKernel", 400, QUEUE_WAIT_US + 250, HOST, correlation=150),
        _x("cuda_runtime", "cudaStreamSynchronize", 800, 40, HOST),
        _x("cuda_driver", "cuStreamSynchronize", 805, 30, HOST),  # inside the runtime's: the same wait, once
        _x("cuda_driver", "cuLaunchKernelEx", 900, QUEUE_WAIT_US - 1, HOST, correlation=151),  # slow, not blocked
        _x("cuda_runtime", "cudaMalloc", 950, 5000, HOST),  # host work however long: it queues nothing
        _x("cuda_driver", "cuModuleLoadData", 6000, 3000, HOST),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 9500, "pid": 1, "tid": 1, "args": {}},
    ]
    out = step_breakdown(trace, "cuda")
    assert out["host_wait_ms"] == pytest.approx((250 + 40) * 1e-3)
    table = breakdown_table("t", {"step_ms": 2.0, "host_cpu_ms": 1.0, "host_issue_ms": 1.5, "breakdown": out})
    assert "| host waiting on the GPU, profiled step | 0.29 | 14.5 |" in table, table
    # the host's own work, 1.5 - 0.29 ms, against the GPU busy time of the synthetic step
    work = f"{(1.5 - 0.29) / out['total_ms']:.2f}x the GPU busy time"
    assert f"| host work: issue less waits | 1.21 | 60.5 | | {work}" in table, table


def test_step_breakdown_bad_traces():
    """A CUDA breakdown of a trace without kernels, or with kernels of two devices, says what to do."""
    cpu_only = {"traceEvents": [e for e in synthetic_trace()["traceEvents"] if e.get("pid") != GPU]}
    with pytest.raises(ValueError, match="no kernel events.*ProfilerActivity.CUDA"):
        step_breakdown(cpu_only, "cuda")
    two = synthetic_trace()
    two["traceEvents"].append({**_kernel("_quantize_kernel", 800, 5, 7, 140, 3), "pid": 1})
    two["traceEvents"][-1]["args"] = {**two["traceEvents"][-1]["args"], "device": 1}
    with pytest.raises(ValueError, match=r"devices \[0, 1\]; profile one device"):
        step_breakdown(two, "cuda")
    with pytest.raises(ValueError, match="device 'mps'"):
        step_breakdown(two, "mps")


def test_step_breakdown_cpu_profile():
    """On CPU a real profile of a step, read from its exported trace: each op's self time by family, summing to
    the union of the ops' ranges; the table gives every family, the busy time and the host rows."""
    import torch

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(lin.parameters(), fused=True)
    x = torch.randn(2, 4, 16, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):  # two microbatches: the second one's gradients are accumulated
            q = lin(x)
            torch.nn.functional.scaled_dot_product_attention(q, q, q).square().mean().backward()
        opt.step()
    out = step_breakdown(profile_trace(prof), "cpu")
    assert out["source"] == "CPU op self time"
    for family in ("dense GEMM", "attention", "gradient accumulation", "optimizer + refresh"):
        assert out["ms"][family] > 0, (family, out["ms"])
    # self times against the union of the ranges, computed apart: equal up to the trace's us rounding per op
    assert out["total_ms"] == pytest.approx(out["busy_ms"], abs=1e-6 * sum(out["calls"].values()))
    arm = {
        "step_ms": 2 * out["total_ms"],
        "host_cpu_ms": 1.0,
        "host_issue_ms": 1.5,
        "breakdown": out,
        "profiled_step_ms": 3.0,
    }
    lines = breakdown_table("tiny / mxfp8", arm).splitlines()
    assert lines[0] == "| tiny / mxfp8 | ms | % | calls | costliest |"
    assert [line.split(" | ")[0] for line in lines[2 : 2 + len(FAMILIES)]] == [f"| {f}" for f in FAMILIES]
    assert lines[2 + len(FAMILIES)].startswith(
        f"| **CPU op self time** (families' sum) | {out['total_ms']:.2f} | 50.0 |"
    )
    assert lines[-2].startswith("| host issue, wall | 1.50 |")
    assert len(breakdown_table("tiny / bf16", {**arm, "breakdown": None}).splitlines()) == 5


def test_kernel_comparison_merges_inductor_numbering_and_orders_by_cost():
    """Kernels of one name in several graphs (Inductor's ``_<n>`` suffixes) are one row; rows are ordered by their
    largest time in any arm; a kernel an arm did not list shows ``-`` there."""

    def top(*kernels):
        return {"top": [{"name": n, "family": f, "ms": ms, "calls": c} for n, f, ms, c in kernels]}

    a = top(
        ("triton_poi_fused_add_3", "other", 2.0, 4),
        ("triton_poi_fused_add_7", "other", 1.0, 4),
        ("_grouped_kernel", "routed GEMM", 5.0, 16),
    )
    b = top(("_grouped_wgrad_into_kernel", "routed GEMM", 7.5, 8), ("triton_poi_fused_add_1", "other", 0.5, 8))
    lines = kernel_comparison([("bf16", b), ("fp8", a)]).splitlines()
    assert lines[0] == "| kernel | family | bf16 ms (calls) | fp8 ms (calls) |"
    assert lines[2:] == [
        "| _grouped_wgrad_into_kernel | routed GEMM | 7.50 (8) | - |",
        "| _grouped_kernel | routed GEMM | - | 5.00 (16) |",
        "| triton_poi_fused_add | other | 0.50 (8) | 3.00 (8) |",
    ]
    assert kernel_comparison([("fp8", a)], what="host op").splitlines()[0] == "| host op | family | fp8 ms (calls) |"
