"""torchtitan's MoE debug models under ``--compile.backend mxfp8`` (its per-block compile, FSDP2, optimizer container).

Runs ``examples/torchtitan/cpu_steps.py`` (torchtitan's own model, activation checkpointing,
``apply_compile`` and ``OptimizersContainer`` on CPU) in fresh processes: torchtitan's compile
module changes global Dynamo settings at import. Skipped when torchtitan is not installed (it is
not a CI dependency: its requirements pull in datasets, pyarrow, wandb and tensorboard).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import torch


def _series() -> tuple[int, int] | None:
    """(major, minor) of the installed torchtitan distribution, None when it is not installed."""
    try:
        return tuple(int(x) for x in version("torchtitan").split(".")[:2])
    except PackageNotFoundError:
        return None


SERIES = _series()
pytestmark = pytest.mark.skipif(SERIES is None, reason="torchtitan is not installed")
needs_03 = pytest.mark.skipif(
    SERIES is None or SERIES < (0, 3), reason="torchtitan 0.3's config registry and overrides"
)
needs_02 = pytest.mark.skipif(
    SERIES is None or SERIES >= (0, 3), reason="torchtitan 0.2's module-level experts function"
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "torchtitan" / "cpu_steps.py"


def _steps(tmp_path, *args: str, policy: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("MXFX_POLICY", None)
    if policy is not None:  # torchtitan passes the backend name only: the policy comes from MXFX_POLICY
        path = tmp_path / "policy.toml"
        path.write_text(policy)
        env["MXFX_POLICY"] = str(path)
    out = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_03
def test_qwen3_moe_debug_mxfp8_against_aot_eager(tmp_path):
    mx = _steps(tmp_path, "--model", "qwen3", "--backend", "mxfp8", policy='inner = "aot_eager"\n')
    ref = _steps(tmp_path, "--model", "qwen3", "--backend", "aot_eager")
    kinds = {(kind, module): (fwd, dgrad) for kind, module, fwd, dgrad in mx["records"]}
    # Full names (the override registers the model) and the MX ops of the block, once: the second block runs its graph.
    assert kinds[("linear", "layers.0.attention.qkv_linear.wqkv")] == ("mxfp8", "mxfp8")
    assert kinds[("linear", "layers.0.attention.wo")] == ("mxfp8", "mxfp8")
    assert kinds[("grouped_mm", "layers.0.moe.routed_experts.inner_experts")] == ("mxfp8", "mxfp8")
    assert kinds[("swiglu", "layers.0.moe.routed_experts.inner_experts")][0] == "mxfp8"
    assert kinds[("router", "layers.0.moe.router.gate")] == ("bf16", "bf16")
    assert sum(kind == "grouped_mm" for kind, *_ in mx["records"]) == 3  # gate, up, down
    assert all(math.isfinite(x) for x in mx["losses"] + ref["losses"])
    assert mx["losses"][-1] < mx["losses"][0] - 0.5 and ref["losses"][-1] < ref["losses"][0] - 0.5  # it trains
    # MXFP8 rounds each GEMM operand to 3 mantissa bits with a shared power-of-two scale per 32 values; over
    # a step of random-init training the loss moves by ~0.1% (measured); 1% leaves room without hiding a bug
    # (a stale weight cache or a dropped expert moves it by tens of percent after the first update).
    for a, b in zip(mx["losses"], ref["losses"]):
        assert abs(a - b) <= 0.01 * b, (mx["losses"], ref["losses"])


@needs_03
def test_deepseek_v3_debug_mxfp8_rewrites_mla_shared_and_routed_experts(tmp_path):
    mx = _steps(
        tmp_path, "--model", "deepseek_v3", "--backend", "mxfp8", "--steps", "2", policy='inner = "aot_eager"\n'
    )
    modules = {(kind, module) for kind, module, fwd, _ in mx["records"] if fwd == "mxfp8"}
    assert ("linear", "layers.0.attention.wkv_a") in modules  # MLA projections, dense block 0
    assert ("linear", "layers.0.feed_forward.w1") in modules
    assert ("grouped_mm", "layers.1.moe.routed_experts.inner_experts") in modules  # MoE block 1
    assert ("linear", "layers.1.moe.shared_experts.w2") in modules
    assert all(math.isfinite(x) for x in mx["losses"])


EXPERTS_02 = """
import json, torch, mxfx
from torchtitan.models.moe import moe as moe_module
torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan's apply_compile sets it
compiled = torch.compile(moe_module._run_experts_grouped_mm, backend="mxfp8", fullgraph=True)  # as apply_compile does
g = torch.Generator().manual_seed(0)
w1, w3 = (torch.nn.Parameter(torch.randn(4, 64, 64, generator=g) * 0.05) for _ in range(2))
w2 = torch.nn.Parameter(torch.randn(4, 64, 64, generator=g) * 0.05)
x = torch.randn(128, 64, generator=g)
counts = torch.tensor([16, 48, 0, 64])
out = compiled(w1, w2, w3, x, counts)
ref = moe_module._run_experts_grouped_mm(w1, w2, w3, x, counts)
print(json.dumps({"rel": ((out - ref).norm() / ref.norm()).item(),
                  "kinds": [[r.kind, r.forward] for r in mxfx.last_report().records]}))
"""


@needs_02
def test_02_experts_function_compiled_on_its_own(tmp_path):
    # torchtitan 0.2 compiles the experts' grouped GEMMs as one module-level function (weights are arguments).
    script = tmp_path / "experts.py"
    script.write_text(EXPERTS_02)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / "policy.toml"
    path.write_text('inner = "aot_eager"\n')
    env["MXFX_POLICY"] = str(path)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert [k for k, fwd in res["kinds"] if fwd == "mxfp8"].count("grouped_mm") == 3
    assert ["swiglu", "mxfp8"] in res["kinds"]
    # Two MXFP8-rounded GEMMs in a row (3 mantissa bits per operand, random weights): ~7% relative error measured
    # on such data; an unquantized path would be ~0 and a wrong expert assignment ~100%.
    assert 0.005 < res["rel"] < 0.15


REAL_SHAPES_CHECK = """
import json, torch, real_shapes
from torchtitan.config import JobConfig
from torchtitan.protocols.train_spec import get_train_spec
out = {}
for spec, flavor in (("qwen3_30b_a3b", "4layers"), ("qwen3_30b_a3b", "2layers_vocab2048"),
                     ("deepseek_v3_16b", "4layers"), ("deepseek_v3_16b", "4layers_vocab2048")):
    args = get_train_spec(spec).model_args[flavor]
    args.update_from_config(JobConfig())  # as the trainer does before building
    with torch.device("meta"):
        model = get_train_spec(spec).model_cls(args)
    moe = args.moe_args
    out[f"{spec}/{flavor}"] = {
        "fields": [args.n_layers, args.vocab_size, args.dim, args.n_heads, args.moe_inter_dim, moe.num_experts,
                   moe.top_k, moe.num_shared_experts, args.attn_type],
        "shapes": {n: list(p.shape) for n, p in model.named_parameters() if n.startswith(("layers.0.", "layers.1."))},
        "layers": len(model.layers),
    }
out["same_object"] = (
    get_train_spec("qwen3_30b_a3b").model_args["4layers"] is get_train_spec("qwen3_30b_a3b").model_args["4layers"]
)
out["torchtitan_own"] = [
    get_train_spec("qwen3").model_args["30B-A3B"].n_layers,
    get_train_spec("deepseek_v3").model_args["16B"].attn_type,
]
print(json.dumps(out))
"""


@needs_02
def test_02_real_shapes_specs(tmp_path):
    # examples/torchtitan/real_shapes.py: torchtitan's own 30B-A3B and 16B flavors with fewer blocks.
    script = tmp_path / "real_shapes_check.py"
    script.write_text(REAL_SHAPES_CHECK)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(ROOT / "examples" / "torchtitan"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    )
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    q4, q2 = res["qwen3_30b_a3b/4layers"], res["qwen3_30b_a3b/2layers_vocab2048"]
    assert q4["fields"] == [4, 151936, 2048, 32, 768, 128, 8, 0, "sdpa"] and q4["layers"] == 4
    assert q2["fields"][:2] == [2, 2048] and q2["layers"] == 2
    assert q4["shapes"]["layers.1.moe.experts.w1"] == [128, 768, 2048]
    assert q4["shapes"]["layers.1.moe.experts.w2"] == [128, 2048, 768]
    assert q4["shapes"]["layers.0.attention.wq.weight"] == [32 * 128, 2048]
    assert q4["shapes"]["layers.0.attention.wk.weight"] == [4 * 128, 2048]
    d4 = res["deepseek_v3_16b/4layers"]
    assert d4["fields"] == [4, 102400, 2048, 16, 1408, 64, 6, 2, "sdpa"] and d4["layers"] == 4
    assert res["deepseek_v3_16b/4layers_vocab2048"]["fields"][1] == 2048
    assert d4["shapes"]["layers.0.feed_forward.w1.weight"] == [10944, 2048]  # the dense first block
    assert d4["shapes"]["layers.1.moe.experts.w1"] == [64, 1408, 2048]
    assert d4["shapes"]["layers.1.moe.shared_experts.w1.weight"] == [2 * 1408, 2048]
    assert d4["shapes"]["layers.1.attention.wkv_a.weight"] == [512 + 64, 2048]  # MLA: KV rank + rope dims
    assert d4["shapes"]["layers.1.attention.wq.weight"] == [16 * (128 + 64), 2048]
    assert res["same_object"]
    assert res["torchtitan_own"] == [48, "flex"]  # torchtitan's own flavors are left as they are


def _mxfp8_entry_point() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "mxfp8" for ep in entry_points(group="torch_dynamo_backends"))


@needs_02
@pytest.mark.slow
@pytest.mark.timeout(600)  # a cold compile of real-shape blocks, in torchtitan's own process
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torchtitan's trainer needs a GPU")
@pytest.mark.skipif(not _mxfp8_entry_point(), reason="mxfx is not installed (torchtitan looks the backend up by name)")
def test_02_trainer_qwen3_real_shapes_mxfp8(tmp_path):
    # torchtitan's own trainer, Qwen3-30B-A3B's per-layer shapes, 2 blocks, 3 steps: every routed GEMM in MXFP8.
    out_json = tmp_path / "out.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "torchtitan_moe.py"),
        "--runs",
        "qwen3_30b_a3b:mxfp8",
        "--layers",
        "2",
        "--steps",
        "3",
        "--timeout",
        "540",
        "--budget",
        "560",
        "--json",
        str(out_json),
        "--keep-logs",
        str(tmp_path / "logs"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["status"] == "ok", out.stdout[-3000:]
    assert row["loss"] is not None and math.isfinite(row["loss"])
    assert row["routed_gemms"] and row["routed_gemms_unconverted"] == 0, row
