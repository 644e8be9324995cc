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

def _series() -> tuple[int, int] | None:
    """(major, minor) of the installed torchtitan distribution, None when it is not installed."""
    try:
        return tuple(int(x) for x in version("torchtitan").split(".")[:2])
    except PackageNotFoundError:
        return None


SERIES = _series()
pytestmark = pytest.mark.skipif(SERIES is None, reason="torchtitan is not installed")
needs_03 = pytest.mark.skipif(SERIES is None or SERIES < (0, 3), reason="torchtitan 0.3's config registry and overrides")
needs_02 = pytest.mark.skipif(SERIES is None or SERIES >= (0, 3), reason="torchtitan 0.2's module-level experts function")

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
    mx = _steps(tmp_path, "--model", "deepseek_v3", "--backend", "mxfp8", "--steps", "2", policy='inner = "aot_eager"\n')
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
