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
    run_script(
        monkeypatch, "bench/crossover.py", "--device", "cpu", "--quick", "--format", "fp8_block", "--out", str(tmp_path)
    )
    table = json.loads((tmp_path / "crossover.json").read_text())
    point = table["families"][0]["points"][0]
    assert table["format"] == "fp8_block" and "mx_fwdbwd_ms" in point and "mxdq_fwdbwd_ms" not in point


def test_quant_stats_quick(monkeypatch, tmp_path):
    monkeypatch.setenv("MXFX_BENCH_OUT", str(tmp_path))
    run_script(monkeypatch, "bench/quant_stats.py", "--device", "cpu", "--quick")
    rows = [
        r
        for r in (tmp_path / "quant_stats.md").read_text().splitlines()
        if r.startswith("| mxfp8/") or r.startswith("| fp8_block/")
    ]
    assert len(rows) == 20, rows  # 2 formats x 2 rules x 5 sites


@pytest.mark.slow
def test_train_step_quick(monkeypatch, tmp_path):
    import torch._dynamo.config as dynamo_config

    keys = ("automatic_dynamic_shapes", "cache_size_limit")  # the script sets them: restore them after
    with dynamo_config.patch({k: getattr(dynamo_config, k) for k in keys}):
        run_script(
            monkeypatch,
            "bench/train_step.py",
            "--device",
            "cpu",
            "--quick",
            "--inner",
            "aot_eager",
            "--out",
            str(tmp_path),
        )
    res = json.loads((tmp_path / "train_step.json").read_text())
    assert set(res["phase1"]) == {"bf16", "mxfp8", "torchao"}
    assert all("tokens_per_s" in r for r in res["phase1"].values()), res["phase1"]
    assert res["phase1"]["mxfp8"]["rewritten"] > 0


@pytest.mark.slow
def test_moe_layer_tiny(monkeypatch, tmp_path):
    # the two mxfx arms with options of their own (each arm is the same measuring loop; the BF16 arm, torch's own
    # Inductor compile of the layer, adds a cold compile and nothing of the script or of mxfx)
    monkeypatch.setenv("MXFX_BENCH_OUT", str(tmp_path))
    run_script(
        monkeypatch,
        "bench/moe_layer.py",
        "--device",
        "cpu",
        "--tokens",
        "64",
        "--d",
        "128",
        "--experts",
        "4",
        "--topk",
        "2",
        "--hidden",
        "128",
        "--arms",
        "mxfxdq,fp8block",
    )
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
    run_script(
        monkeypatch,
        "examples/scale_rule_study.py",
        "--d-model",
        "64",
        "--layers",
        "1",
        "--experts",
        "4",
        "--expert-hidden",
        "64",
        "--shared-hidden",
        "64",
        "--seq",
        "32",
        "--batch",
        "2",
        "--pre-steps",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--stats-every",
        "1",
        "--out",
        str(tmp_path),
    )
    res = json.loads((tmp_path / "scale_rule_study.json").read_text())
    assert set(res["curves"]) == {"bf16", "mxfp8 rceil", "mxfp8 floor"}
    assert set(res["summary"]) == {"rceil", "floor"}
    assert set(res["stats_per_layer"]) == {"mxfp8 rceil", "mxfp8 floor"}  # quantization statistics per layer
    assert all(len(steps) == 2 for per in res["stats_per_layer"].values() for steps in per.values())
    assert (
        max(v["clipped"] for v in res["stats_per_layer"]["mxfp8 rceil"]["layers.0"].values()) == 0
    )  # rceil never clips
    assert (tmp_path / "scale_rule_study.png").stat().st_size > 0


def test_movement_ceiling_variants_move_their_bytes():
    """The movement-only variants ``bench/mx_kernels.py`` rates each kernel against write the high byte of every
    value (rowwise and transposed) under Triton's interpreter: a variant moving fewer bytes would flatter it."""
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    subprocess.run(
        [sys.executable, "-c", "from bench import movement; movement.check()"], check=True, cwd=ROOT, env=env
    )


@pytest.mark.slow
def test_hf_models_smoke(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    run_script(
        monkeypatch,
        "bench/hf_models.py",
        "--smoke",
        "--model",
        "olmoe",
        "--layers",
        "1",
        "--microbatches",
        "2",
        "--profile",
        "--out",
        str(tmp_path),
    )
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
        # the self times sum to the ops' ranges (their union on each thread), up to the trace's us rounding per op
        assert where["total_ms"] == pytest.approx(where["busy_ms"], abs=1e-6 * sum(where["calls"].values()))
        assert by_arm[arm]["profiled_step_ms"] > 0
        for family in ("routed GEMM", "dense GEMM", "attention", "gradient accumulation", "optimizer + refresh"):
            assert where["ms"][family] > 0, (arm, family, where["ms"])
    assert by_arm["mxfp8"]["breakdown"]["ms"]["quantize/layout"] > 0
    assert by_arm["mxfp8"]["expert_gemms_mx"] == 2 and by_arm["mxfp8"]["not_rewritten"] == 0
    assert by_arm["fp8_block"]["expert_gemms_mx"] == 2 and by_arm["fp8_block"]["expert_gemms_kept"] == 0  # 128-wide
    # format="bf16_gemm": transformers' FP32 expert fallback rewritten into BF16 grouped GEMMs from cached casts
    grouped = by_arm["bf16-grouped"]
    assert grouped["expert_gemms_mx"] == 2 and grouped["expert_gemms_kept"] == 0 and grouped["not_rewritten"] == 0
    assert "error" in by_arm["torchao-fp8-rowwise"]  # needs an FP8 GPU: reported, the run went on


@pytest.mark.slow
def test_hf_models_mixtral_smoke(monkeypatch, tmp_path):
    """The Mixtral model trains in fp8_block with both routed expert GEMMs converted (the 1.3x goal's shapes)."""
    pytest.importorskip("transformers")
    run_script(
        monkeypatch,
        "bench/hf_models.py",
        "--smoke",
        "--model",
        "mixtral",
        "--layers",
        "1",
        "--arms",
        "fp8_block",
        "--out",
        str(tmp_path),
    )
    (res,) = json.loads((tmp_path / "hf_models.json").read_text())["results"]
    assert res["model"] == "mixtral" and "error" not in res and res["tokens_per_s"] > 0, res
    assert res["expert_gemms_mx"] == 2 and res["expert_gemms_kept"] == 0 and res["not_rewritten"] == 0, res


@pytest.mark.parametrize(
    "script, args, says",
    [
        ("hf_models", ("--steps", "0"), "--steps: 0 must be >= 1"),
        ("hf_models", ("--steps", "4", "--skip", "4"), "leaves none of --steps 4"),
        ("hf_models", ("--skip", "-3"), "--skip: -3 must be >= 0"),
        ("hf_models", ("--eval-batches", "0"), "--eval-batches: 0 must be >= 1"),
        ("hf_models", ("--layers", "0"), "--layers: 0 must be >= 1"),
        ("hf_models", ("--model", "olmoe,nope"), "unknown model(s) ['nope']; give a comma list of olmoe, qwen3, mix"),
        ("hf_models", ("--model", " ,"), "names no model"),
        ("hf_models", ("--arms", ","), "names no arm"),
        ("hf_models", ("--arms", "bf16-grouped,nope"), "unknown arm(s) ['nope']"),
        ("hf_models", ("--arms", "fp8_block, bf16-grouped,fp8_block"), "['fp8_block'] named more than once"),
        ("hf_models", ("--tokens", "100", "--seq", "64"), "--tokens: 100 is not a multiple of --seq 64"),
        ("hf_models", ("--lr", "inf"), "--lr: inf must be finite and > 0"),
        ("compile_time", ("--units", "foo"), "--units: 'foo': a comma list of model, block"),
        ("compile_time", ("--arms", "bf16,nope"), "--arms: 'bf16,nope': a comma list of"),
        ("compile_time", ("--profile-cache", "hot"), "--profile-cache: 'hot': a comma list of cold, warm"),
        ("compile_time", ("--layers", "0"), "--layers 0 must be >= 1"),
        ("compile_time", ("--model", "gpt"), "--model: 'gpt': choose one of olmoe, qwen3, mixtral"),
    ],
)
def test_benchmarks_refuse_arguments_they_cannot_run(monkeypatch, capsys, script, args, says):
    """A bad size or name ends in an argparse error naming its flag before any arm runs (exit status 2)."""
    pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as e:
        run_script(monkeypatch, f"bench/{script}.py", *args)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_hf_models_without_transformers_says_how_to_install_it(monkeypatch):
    """Without transformers the benchmark ends with the install command, not a bare ModuleNotFoundError."""
    from bench import hf_models

    monkeypatch.setitem(sys.modules, "transformers", None)  # import of a None entry raises ModuleNotFoundError
    with pytest.raises(SystemExit, match=r"needs Hugging Face transformers.*pip install -e '\.\[bench\]'"):
        hf_models.model_config("olmoe", 1)


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
    """The first-step phase table (cold and warm rows): Triton compiles in the process counted per kernel name
    (cache hits apart), a kernel compiled for several specializations listed with its count, tunings summed, and the
    rest what the listed phases leave of the first step."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import compile_time

    class Times:
        total = 250_000  # microseconds

    class Src:
        def __init__(self, name):
            self.fn = type(name, (), {})

    t = compile_time._TritonCompiles()
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/cuda/bin/ptxas")  # in force at the misses: the table names it
    for name, hit in [
        ("_quantize_kernel", False),
        ("_quantize_kernel", False),
        ("_grouped_body", False),
        ("_grouped_body", True),
    ]:
        t.on_compile(src=Src(name), metadata={}, metadata_group={}, times=Times(), cache_hit=hit)
    t.on_tune(fn=Src("_grouped_body").fn, key=(1,), best_config=None, configs_timings={}, duration=2.0, cache_hit=False)
    t.on_tune(fn=Src("_grouped_body").fn, key=(1,), best_config=None, configs_timings={}, duration=9.0, cache_hit=True)
    assert t.compiles == {"_quantize_kernel": 2, "_grouped_body": 1} and t.hits == 1
    assert t.compile_s == pytest.approx(0.75) and t.tune_s == 2.0 and t.tunings == {"_grouped_body": 1}
    ph = compile_time.phases(100.0, t)
    listed = sum(v for k, v in ph.items() if isinstance(v, float) and k != "rest")
    assert ph["rest"] == pytest.approx(100.0 - listed) and listed >= 2.75
    row = {"unit": "model", "arm": "fp8_block", "cache": "cold", "first_step_s": 100.0, "phases": ph}
    text = compile_time.phase_table(
        [row, {**row, "cache": "warm"}, {"unit": "model", "arm": "bf16", "cache": "cold", "error": "x"}]
    )
    assert text.count("| model | fp8_block | cold |") == 1 and text.count("| model | fp8_block | warm |") == 1
    assert text.count("| model | bf16 |") == 0  # a row without phases (a failed child) is left out
    assert "| 3 (_quantize_kernel x2); 1 cache hits |" in text and "| 0.8 | 2.0 |" in text
    assert "- model fp8_block cold: TRITON_CACHE_DIR=" in text and "TRITON_PTXAS_PATH=/opt/cuda/bin/ptxas" in text


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
    sources = [
        ASTSource(_scale_kernel, signature, {"AXIS": 0}, {(0,): [["tt.divisibility", 16]]}),
        ASTSource(
            _scale_kernel, signature, {"AXIS": 1}, {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
        ),
    ]

    class Times:
        total = 1000

    t = compile_time._TritonCompiles()
    for src in sources:
        t.on_compile(src=src, metadata={}, metadata_group={}, times=Times(), cache_hit=False)
    assert compile_time.specialization(sources[1]) == {
        "x_ptr": "*fp32 tt.divisibility=16",
        "n": "i32",
        "stride": "i32 tt.divisibility=16",
        "AXIS": "=1",
    }
    assert compile_time.differing(t.variants["_scale_kernel"]) == "stride i32/i32 tt.divisibility=16; AXIS =0/=1"
    row = {
        "unit": "model",
        "arm": "fp8_block",
        "cache": "cold",
        "first_step_s": 10.0,
        "phases": compile_time.phases(10.0, t),
        "mxfx_passes_s": 0.25,
    }
    text = compile_time.phase_table([row])
    assert "_scale_kernel x2 [stride i32/i32 tt.divisibility=16; AXIS =0/=1]" in text
    assert "(passes 0.25)" in text


def test_compile_time_table_marks_profiled_steps(monkeypatch):
    """A first step timed under cProfile (``--profile``) is no compile time: its ratio is marked and held to no
    goal; an unprofiled one is compared with BF16's."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import compile_time

    row = {"model": "olmoe", "unit": "model", "frames": 1, "bypass": ""}
    rows = [
        {**row, "arm": "bf16", "cache": "cold", "first_step_s": 10.0},
        {**row, "arm": "fp8_block", "cache": "cold", "first_step_s": 15.0},
        {**row, "arm": "bf16", "cache": "warm", "first_step_s": 2.0},
        {**row, "arm": "fp8_block", "cache": "warm", "first_step_s": 6.0, "profiled": True},
    ]
    lines = compile_time.table(rows).splitlines()
    assert "| 1.50x | <= 1.5x |" in lines[3] and "cProfile" not in lines[3]
    assert "3.00x (under cProfile: no timing) | - |" in lines[5]


def test_switch_arms_set_the_switches_their_modules_read():
    """Arms that compare one library switch on and off set the environment variable the library module reads (a
    renamed switch would leave the arm measuring the default twice)."""
    from bench import hf_models
    from mxfx.kernels.common import custom_ops as common_ops
    from mxfx.kernels.fp8_block import gemm as block_gemm
    from mxfx.post_grad import route_grad_gather

    assert dict(hf_models.ARMS["fp8_block-ungathered"].env) == {route_grad_gather.ENV: "0"}
    assert dict(hf_models.ARMS["fp8_block-triton"].env) == {block_gemm.SM90_ENV: "0"}
    for arm in ("bf16-grouped-ws", "fp8_block-ws"):
        assert dict(hf_models.ARMS[arm].env) == {common_ops.WGRAD_SM90_ENV: "1"}
    assert dict(hf_models.ARMS["fp8_block-wgrad8-ws"].env) == {block_gemm.WGRAD_SM90_ENV: "1"}
