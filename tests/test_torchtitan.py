"""torchtitan's MoE debug models under ``--compile.backend mxfp8`` (its per-block compile, FSDP2, optimizer container).

Runs ``examples/torchtitan/cpu_steps.py`` (torchtitan's own model, activation checkpointing,
``apply_compile`` and ``OptimizersContainer`` on CPU) in fresh processes: torchtitan's compile
module changes global Dynamo settings at import. Skipped when torchtitan is not installed (it is
not a CI dependency: its requirements pull in datasets, pyarrow, wandb and tensorboard).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")

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


def test_deepseek_v3_debug_mxfp8_rewrites_mla_shared_and_routed_experts(tmp_path):
    mx = _steps(tmp_path, "--model", "deepseek_v3", "--backend", "mxfp8", "--steps", "2", policy='inner = "aot_eager"\n')
    modules = {(kind, module) for kind, module, fwd, _ in mx["records"] if fwd == "mxfp8"}
    assert ("linear", "layers.0.attention.wkv_a") in modules  # MLA projections, dense block 0
    assert ("linear", "layers.0.feed_forward.w1") in modules
    assert ("grouped_mm", "layers.1.moe.routed_experts.inner_experts") in modules  # MoE block 1
    assert ("linear", "layers.1.moe.shared_experts.w2") in modules
    assert all(math.isfinite(x) for x in mx["losses"])
