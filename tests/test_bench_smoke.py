"""CPU smoke runs of the GPU benchmark scripts and the scale-rule study, at their smallest sizes.

They check that the scripts run end to end and write their outputs; the numbers
mean nothing at this size. The GPU commands are in each script's docstring.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(monkeypatch, path: str, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", [path, *args])
    monkeypatch.syspath_prepend(str((ROOT / path).parent))  # as `python <path>` puts the script's folder first
    runpy.run_path(str(ROOT / path), run_name="__main__")


def test_crossover_quick(monkeypatch, tmp_path):
    run_script(monkeypatch, "bench/crossover.py", "--device", "cpu", "--quick", "--out", str(tmp_path))
    table = json.loads((tmp_path / "crossover.json").read_text())
    assert table["capability"] is None and len(table["families"]) == 2
    assert {"bf16_fwdbwd_ms", "mx_fwdbwd_ms", "mxdq_fwdbwd_ms"} <= set(table["families"][0]["points"][0])
    assert (tmp_path / "crossover.png").stat().st_size > 0


def test_quant_stats_quick(monkeypatch, tmp_path):
    monkeypatch.setenv("MXFX_BENCH_OUT", str(tmp_path))
    run_script(monkeypatch, "bench/quant_stats.py", "--device", "cpu", "--quick")
    rows = [r for r in (tmp_path / "quant_stats.md").read_text().splitlines() if r.startswith("| mxfp8/")
            or r.startswith("| fp8_block/")]
    assert len(rows) == 20, rows  # 2 formats x 2 rules x 5 sites


@pytest.mark.slow
def test_train_step_quick(monkeypatch, tmp_path):
    import torch._dynamo.config as dynamo_config

    keys = ("automatic_dynamic_shapes", "cache_size_limit")  # the script sets them: restore them after
    with dynamo_config.patch({k: getattr(dynamo_config, k) for k in keys}):
        run_script(monkeypatch, "bench/train_step.py", "--device", "cpu", "--quick", "--inner", "aot_eager",
                   "--out", str(tmp_path))
    res = json.loads((tmp_path / "train_step.json").read_text())
    assert set(res["phase1"]) == {"bf16", "mxfp8", "torchao"}
    assert all("tokens_per_s" in r for r in res["phase1"].values()), res["phase1"]
    assert res["phase1"]["mxfp8"]["rewritten"] > 0


@pytest.mark.slow
def test_moe_layer_tiny(monkeypatch, tmp_path):
    # the two mxfx arms with options of their own (each arm is the same measuring loop; the BF16 arm, torch's own
    # Inductor compile of the layer, adds a cold compile and nothing of the script or of mxfx)
    monkeypatch.setenv("MXFX_BENCH_OUT", str(tmp_path))
    run_script(monkeypatch, "bench/moe_layer.py", "--device", "cpu", "--tokens", "64", "--d", "128", "--experts", "4",
               "--topk", "2", "--hidden", "128", "--arms", "mxfxdq,fp8block")
    rows = [r for r in (tmp_path / "moe_layer.md").read_text().splitlines() if r.startswith("| mxfx")]
    assert len(rows) == 2 and not any("failed" in r for r in rows), rows


def test_moe_layer_padded_groups_are_exact(monkeypatch):
    """The torchao FP8 rowwise arm pads routed groups to 16 rows: the GEMM must see 16-row groups, and the layer
    the products and gradients of the unpadded groups (empty, 1-row and already aligned groups included)."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from moe_layer import padded_groups

    def loop_mm(a, b, offs):  # per-group reference, float64 so row blocking cannot differ
        starts = [0, *offs.tolist()[:-1]]
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, offs.tolist()))])

    seen = []

    def aligned_mm(a, b, offs):
        seen.append(offs)
        return loop_mm(a, b, offs)

    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([0, 37, 16, 1, 100, 0, 146]).cumsum(0).to(torch.int32)
    a = torch.randn(300, 64, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 64, 48, generator=g, dtype=torch.float64, requires_grad=True)
    out, ref = padded_groups(aligned_mm)(a, b, offs), loop_mm(a, b, offs)
    assert seen[0].tolist() == [0, 48, 64, 80, 192, 192, 352]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    dy = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(out, (a, b), dy), torch.autograd.grad(ref, (a, b), dy)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_scale_rule_study_tiny(monkeypatch, tmp_path):
    run_script(monkeypatch, "examples/scale_rule_study.py", "--d-model", "64", "--layers", "1", "--experts", "4",
               "--expert-hidden", "64", "--shared-hidden", "64", "--seq", "32", "--batch", "2",
               "--pre-steps", "2", "--steps", "2", "--warmup", "1", "--stats-every", "1", "--out", str(tmp_path))
    res = json.loads((tmp_path / "scale_rule_study.json").read_text())
    assert set(res["curves"]) == {"bf16", "mxfp8 rceil", "mxfp8 floor"}
    assert set(res["summary"]) == {"rceil", "floor"}
    assert set(res["stats_per_layer"]) == {"mxfp8 rceil", "mxfp8 floor"}  # quantization statistics per layer
    assert all(len(steps) == 2 for per in res["stats_per_layer"].values() for steps in per.values())
    assert max(v["clipped"] for v in res["stats_per_layer"]["mxfp8 rceil"]["layers.0"].values()) == 0  # rceil never clips
    assert (tmp_path / "scale_rule_study.png").stat().st_size > 0


def test_movement_ceiling_variants_move_their_bytes():
    """The movement-only variants ``bench/mx_kernels.py`` rates each kernel against write the high byte of every
    value (rowwise and transposed) under Triton's interpreter: a variant moving fewer bytes would flatter it."""
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", "from bench import movement; movement.check()"], check=True, cwd=ROOT, env=env)


@pytest.mark.slow
def test_hf_models_smoke(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    run_script(monkeypatch, "bench/hf_models.py", "--smoke", "--model", "olmoe", "--layers", "1", "--microbatches", "2",
               "--profile", "--out", str(tmp_path))
    res = json.loads((tmp_path / "hf_models.json").read_text())["results"]
    by_arm = {r["arm"]: r for r in res}
    assert set(by_arm) == {"bf16-users", "bf16-weights", "bf16-grouped", "mxfp8", "fp8_block", "torchao-fp8-rowwise"}
    for arm in ("bf16-users", "bf16-weights", "bf16-grouped", "mxfp8", "fp8_block"):
        assert "error" not in by_arm[arm] and by_arm[arm]["tokens_per_s"] > 0, by_arm[arm]
        assert by_arm[arm]["microbatches"] == 2
        assert by_arm[arm]["host_cpu_ms"] > 0 and by_arm[arm]["host_issue_ms"] <= by_arm[arm]["step_ms"]
        # where the profiled step went (CPU: op self times): both microbatches' GEMMs, their accumulation, the step
        where = by_arm[arm]["breakdown"]
        assert where["source"] == "CPU op self time" and where["top"]
        assert sum(where["ms"].values()) == pytest.approx(where["total_ms"])
        for family in ("routed GEMM", "dense GEMM", "attention", "gradient accumulation", "optimizer + refresh"):
            assert where["ms"][family] > 0, (arm, family, where["ms"])
    assert by_arm["mxfp8"]["breakdown"]["ms"]["quantize/layout"] > 0
    assert by_arm["mxfp8"]["expert_gemms_mx"] == 2 and by_arm["mxfp8"]["not_rewritten"] == 0
    # format="bf16_gemm": transformers' FP32 expert fallback rewritten into BF16 grouped GEMMs from cached casts
    grouped = by_arm["bf16-grouped"]
    assert grouped["expert_gemms_mx"] == 2 and grouped["expert_gemms_kept"] == 0 and grouped["not_rewritten"] == 0
    assert "error" in by_arm["torchao-fp8-rowwise"]  # needs an FP8 GPU: reported, the run went on


def test_fp32_gemms_compiler_is_a_bf16_gemm():
    """``--compiler aot_eager_fp32_gemms`` runs BF16 GEMMs as FP32 GEMMs of the BF16 operands, BF16 out: the same
    products and FP32 accumulation as a BF16 GEMM (up to summation order), forward and backward."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from bench import hf_models  # it puts bench/ and examples/ on sys.path itself, as its script run does

    torch.manual_seed(0)
    a, b = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(64, 96, dtype=torch.bfloat16)
    gm = make_fx(torch.mm)(a, b)
    hf_models._fp32_gemms(gm, [a, b])
    (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert all(arg.args[1] is torch.float32 for arg in mm.args)  # FP32 operands ...
    y = gm(a, b)
    assert y.dtype == torch.bfloat16  # ... BF16 result: one rounding of the FP32 sums
    torch.testing.assert_close(y, (a.float() @ b.float()).bfloat16(), rtol=2**-7, atol=0)

    w = torch.randn(96, 64, requires_grad=True)  # under autocast, through aot_autograd: forward and backward
    x = torch.randn(40, 64)

    def f(x, w):
        with torch.autocast("cpu", torch.bfloat16):
            return torch.nn.functional.linear(x, w)

    torch._dynamo.reset()
    y = torch.compile(f, backend=hf_models._backend("aot_eager_fp32_gemms"))(x, w)
    y.float().square().sum().backward()
    g, w.grad = w.grad, None
    y_ref = f(x, w)
    y_ref.float().square().sum().backward()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=2**-7, atol=1e-2)  # the BF16 GEMM, up to summation order
    torch.testing.assert_close(g, w.grad, rtol=2**-6, atol=1e-1)


KERNELS = [  # (kernel name, the CPU ops it ran under: launching op first), family
    # cuBLAS / cutlass GEMMs: a dense GEMM, or routed under a grouped op (forward, dgrad, wgrad)
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", ("aten::mm", "CompiledFunction"), "dense GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     ("aten::addmm", "CompiledFunctionBackward", "autograd::engine::evaluate_function: CompiledFunctionBackward"), "dense GEMM"),
    ("nvjet_qqtst_128x128_128x6_2x1_v_bz_coopA_TNN", ("aten::_scaled_mm", "mxfx::block_mm"), "dense GEMM"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)", (), "dense GEMM"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
     "cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cute::tuple<cute::C<128>, cute::C<256>, cute::C<64> >>>>",
     ("aten::_grouped_mm", "CompiledFunction"), "routed GEMM"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
     "cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >>>>", (), "routed GEMM"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x128x32_cublas",
     ("aten::mm", "transformers::grouped_mm_fallback_backward", "CompiledFunctionBackward"), "routed GEMM"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", ("aten::mm", "aten::_grouped_mm", "mxfx::grouped_wgrad_bf16"), "routed GEMM"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::FillFunctor<float>>>",
     ("aten::fill_", "aten::zero_", "mxfx::block_grouped_wgrad"), "routed GEMM"),
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
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float, float, float>>",
     ("aten::copy_", "mxfx::quantize_dual_blocked"), "quantize/layout"),
    ("_swiglu_product_kernel_0", ("_swiglu_product_kernel_0", "CompiledFunction"), "other"),
    # a weight-cache rebuild quantizes: its cost is the step's refresh
    ("_dual_kernel", ("mxfx::cached_weight", "CompiledFunction", "Torch-Compiled Region: 0/0"), "optimizer + refresh"),
    ("_quantize", ("mxfx::refresh_weight_caches",), "optimizer + refresh"),
    # attention
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>",
     ("aten::_flash_attention_forward", "aten::_scaled_dot_product_flash_attention"), "attention"),
    ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128>>",
     ("aten::_flash_attention_backward", "aten::_scaled_dot_product_flash_attention_backward"), "attention"),
    ("cudnn_generated_fortran_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
     ("aten::_scaled_dot_product_cudnn_attention",), "attention"),
    ("fmha_cutlassB_bf16_aligned_128x64_k128_sm80", (), "attention"),
    ("void at::native::elementwise_kernel<128, 4, at::native::FillFunctor<c10::BFloat16>>",
     ("aten::fill_", "aten::zero_", "aten::_scaled_dot_product_efficient_attention_backward"), "attention"),
    # gradient accumulation: AccumulateGrad's add_ of a microbatch's gradient into .grad
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3>>",
     ("aten::add_", "torch::autograd::AccumulateGrad",
      "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"), "gradient accumulation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3>>",
     ("aten::add", "CompiledFunctionBackward"), "other"),
    # the optimizer step
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, double, double, double, double, double, bool, double*, float*>",
     ("aten::_fused_adamw_", "Optimizer.step#AdamW.step"), "optimizer + refresh"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>>",
     ("aten::_foreach_add_", "Optimizer.step#AdamW.step"), "optimizer + refresh"),
    ("triton_poi_fused__foreach_addcdiv__foreach_mul_0", ("triton_poi_fused__foreach_addcdiv__foreach_mul_0",
     "Optimizer.step#AdamW.step"), "optimizer + refresh"),
    # Inductor's generated kernels: other, whatever their fused ops' names say
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
     "CompiledFunction"), "other"),
    ("triton_poi_fused__scaled_dot_product_flash_attention_transpose_3",
     ("triton_poi_fused__scaled_dot_product_flash_attention_transpose_3", "CompiledFunction"), "other"),
    ("triton_per_fused__softmax_topk_2", ("triton_per_fused__softmax_topk_2",), "other"),
    ("triton_tem_fused_mm_4", ("triton_tem_fused_mm_4",), "dense GEMM"),
    ("Memcpy DtoD (Device -> Device)", ("aten::copy_", "CompiledFunction"), "other"),
    ("void at::native::index_elementwise_kernel<128, 4>", ("aten::index", "CompiledFunction"), "other"),
    # a CPU profile: each op is its own kernel
    ("aten::mm", ("aten::mm", "aten::_grouped_mm", "CompiledFunction"), "routed GEMM"),
    ("aten::mm", ("aten::mm", "CompiledFunction"), "dense GEMM"),
    ("aten::_fused_adamw_", ("aten::_fused_adamw_", "Optimizer.step#AdamW.step"), "optimizer + refresh"),
    ("aten::add_", ("aten::add_", "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"),
     "gradient accumulation"),
    ("aten::amax", ("aten::amax", "mxfx::cached_weight"), "optimizer + refresh"),
    ("CompiledFunction", ("CompiledFunction", "Torch-Compiled Region: 0/0"), "other"),
]


@pytest.mark.parametrize("kernel,ops,family", KERNELS, ids=[f"{i}-{f}" for i, (_, _, f) in enumerate(KERNELS)])
def test_kernel_family(kernel, ops, family):
    """``bench/breakdown.py`` names a kernel's family from its name and the CPU ops it ran under."""
    from bench.breakdown import FAMILIES, kernel_family

    assert family in FAMILIES
    assert kernel_family(kernel, ops) == family


def test_every_mxfx_kernel_has_a_family():
    """Every Triton kernel mxfx launches (a ``@triton.jit`` function named ``*_kernel``, or one ``triton.jit(...)``
    wraps) is in ``MXFX_KERNELS``, and nothing else is: a new or renamed kernel would fall into ``other``."""
    import ast

    from bench.breakdown import MXFX_KERNELS

    def is_jit(node):  # triton.jit or triton.jit(...)
        node = node.func if isinstance(node, ast.Call) else node
        return isinstance(node, ast.Attribute) and node.attr == "jit"

    launched = set()
    for path in (ROOT / "mxfx" / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(map(is_jit, node.decorator_list)):
                launched.add(node.name)
            if isinstance(node, ast.Call) and is_jit(node.func) and node.args and isinstance(node.args[0], ast.Name):
                launched.add(node.args[0].id)  # triton.jit(...)(fn)
    assert launched == set(MXFX_KERNELS)


def _event(name, parent=None, kernels=(), device=False, start=0.0, end=0.0, annotation=False):
    """A stand-in for a ``torch.profiler`` ``FunctionEvent``: what ``step_breakdown`` reads of one."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel

    return SimpleNamespace(name=name, cpu_parent=parent, is_async=False, is_legacy=False, is_user_annotation=annotation,
                           device_type=DeviceType.CUDA if device else DeviceType.CPU,
                           kernels=[Kernel(k, 0, d) for k, d in kernels], time_range=SimpleNamespace(start=start, end=end))


def test_step_breakdown_cuda_events():
    """On CUDA every kernel counts once: through the CPU op that launched it, else (no CPU op) by its name; a
    record_function's device range (a GPU user annotation) is no kernel."""
    from bench.breakdown import step_breakdown

    step = _event("Optimizer.step#AdamW.step")
    adam = _event("aten::_fused_adamw_", step, kernels=[("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 30.0),
                                                        ("Optimizer.step#AdamW.step", 40.0)])
    acc = _event("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad")
    add = _event("aten::add_", acc, kernels=[("vectorized_elementwise_kernel<CUDAFunctor_add>", 5.0)])
    mm = _event("aten::mm", kernels=[("nvjet_tst_128x256", 100.0)])
    device = [
        _event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", device=True, start=0.0, end=30.0),
        _event("Optimizer.step#AdamW.step", device=True, start=0.0, end=40.0, annotation=True),
        _event("vectorized_elementwise_kernel<CUDAFunctor_add>", device=True, start=50.0, end=55.0),
        _event("nvjet_tst_128x256", device=True, start=60.0, end=160.0),
        _event("nvjet_tst_128x256", device=True, start=200.0, end=300.0),  # no CPU op claims it
    ]
    out = step_breakdown([step, adam, acc, add, mm, *device], "cuda")
    assert out["source"] == "CUDA kernel time"
    assert out["ms"]["optimizer + refresh"] == pytest.approx(0.030)
    assert out["ms"]["gradient accumulation"] == pytest.approx(0.005)
    assert out["ms"]["dense GEMM"] == pytest.approx(0.200)
    assert out["total_ms"] == pytest.approx(0.235)
    assert out["top"][0] == {"name": "nvjet_tst_128x256", "family": "dense GEMM", "ms": pytest.approx(0.2), "calls": 2}


def test_step_breakdown_cpu_profile():
    """On CPU a real profile of a step: each op's self time, by family; the table puts arms side by side."""
    import torch

    from bench.breakdown import breakdown_table, step_breakdown

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(lin.parameters(), fused=True)
    x = torch.randn(2, 4, 16, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):  # two microbatches: the second one's gradients are accumulated
            q = lin(x)
            torch.nn.functional.scaled_dot_product_attention(q, q, q).square().mean().backward()
        opt.step()
    out = step_breakdown(prof.events(), "cpu")
    assert out["source"] == "CPU op self time"
    for family in ("dense GEMM", "attention", "gradient accumulation", "optimizer + refresh"):
        assert out["ms"][family] > 0, (family, out["ms"])
    assert sum(out["ms"].values()) == pytest.approx(out["total_ms"])
    arm = {"step_ms": 2 * out["total_ms"], "host_cpu_ms": 1.0, "host_issue_ms": 1.5, "breakdown": out}
    text = breakdown_table({"mxfp8": arm, "bf16-weights": {**arm, "breakdown": None}})
    assert text.splitlines()[0] == "| ms per step (% of step) | mxfp8 | bf16-weights |"
    assert "| dense GEMM | " in text and "(50%)" in text and "| host CPU | 1.00 " in text


def _mxfx_imports(path: Path) -> list[tuple[str, str | None]]:
    """``(module, name)`` of each ``from mxfx... import name`` / ``import mxfx...`` in a script, at any depth."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mxfx":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "mxfx"]
    return found


@pytest.mark.parametrize("script", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench").rglob("*.py")))
def test_bench_scripts_import_names_that_exist(script):
    """Every bench script and probe, including those no smoke run executes, imports mxfx names that exist."""
    import importlib

    missing = []
    for module, name in _mxfx_imports(ROOT / script):
        mod = importlib.import_module(module)
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{script} imports names mxfx no longer has: {missing}"


def test_compile_time_phase_table_counts_triton_compiles(monkeypatch):
    """The cold-step phase table: Triton compiles in the process counted per kernel name (cache hits apart), a
    kernel compiled for several specializations listed with its count, tunings summed, and the rest what the
    listed phases leave of the first step."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import compile_time

    class Times:
        total = 250_000  # microseconds

    class Src:
        def __init__(self, name):
            self.fn = type(name, (), {})

    t = compile_time._TritonCompiles()
    for name, hit in [("_quantize_kernel", False), ("_quantize_kernel", False), ("_grouped_body", False),
                      ("_grouped_body", True)]:
        t.on_compile(src=Src(name), metadata={}, metadata_group={}, times=Times(), cache_hit=hit)
    t.on_tune(fn=Src("_grouped_body").fn, key=(1,), best_config=None, configs_timings={}, duration=2.0,
              cache_hit=False)
    t.on_tune(fn=Src("_grouped_body").fn, key=(1,), best_config=None, configs_timings={}, duration=9.0,
              cache_hit=True)
    assert t.compiles == {"_quantize_kernel": 2, "_grouped_body": 1} and t.hits == 1
    assert t.compile_s == pytest.approx(0.75) and t.tune_s == 2.0 and t.tunings == {"_grouped_body": 1}
    ph = compile_time.phases(100.0, t)
    listed = sum(v for k, v in ph.items() if isinstance(v, float) and k != "rest")
    assert ph["rest"] == pytest.approx(100.0 - listed) and listed >= 2.75
    row = {"unit": "model", "arm": "fp8_block", "cache": "cold", "first_step_s": 100.0, "phases": ph}
    text = compile_time.phase_table([row, {**row, "cache": "warm"}])
    assert text.count("| model | fp8_block |") == 1  # cold rows only
    assert "| 3 (_quantize_kernel x2) |" in text and "| 0.8 | 2.0 |" in text


def test_compile_time_names_what_repeated_compiles_differ_in(monkeypatch):
    """A kernel compiled twice in the process is listed with the arguments its two compiles were specialized on
    differently (read from the Triton sources the compile listener receives), and only those: a constexpr's
    value, an int's divisibility by 16."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import compile_time
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    @triton.jit
    def _scale_kernel(x_ptr, n, stride, AXIS: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, 16) * stride, tl.zeros((16,), tl.float32), mask=tl.arange(0, 16) < n)

    signature = {"x_ptr": "*fp32", "n": "i32", "stride": "i32", "AXIS": "constexpr"}
    sources = [ASTSource(_scale_kernel, signature, {"AXIS": 0}, {(0,): [["tt.divisibility", 16]]}),
               ASTSource(_scale_kernel, signature, {"AXIS": 1},
                         {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]})]

    class Times:
        total = 1000

    t = compile_time._TritonCompiles()
    for src in sources:
        t.on_compile(src=src, metadata={}, metadata_group={}, times=Times(), cache_hit=False)
    assert compile_time.specialization(sources[1]) == {
        "x_ptr": "*fp32 tt.divisibility=16", "n": "i32", "stride": "i32 tt.divisibility=16", "AXIS": "=1"}
    assert compile_time.differing(t.variants["_scale_kernel"]) == "stride i32/i32 tt.divisibility=16; AXIS =0/=1"
    row = {"unit": "model", "arm": "fp8_block", "cache": "cold", "first_step_s": 10.0,
           "phases": compile_time.phases(10.0, t), "mxfx_passes_s": 0.25}
    text = compile_time.phase_table([row])
    assert "_scale_kernel x2 [stride i32/i32 tt.divisibility=16; AXIS =0/=1]" in text
    assert "(passes 0.25)" in text
