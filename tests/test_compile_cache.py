"""A model compiled with ``backend="mxfp8"`` in a fresh process reuses what an earlier process compiled.

Two processes (this file run as a script, :func:`_first_step`) share one ``TORCHINDUCTOR_CACHE_DIR``: one
training step of the tests' MoE layer (``tests.models.MoE``: shared-expert linears, routed experts in grouped
GEMMs, SwiGLU, the route-weight combine), FP32 parameters under BF16 autocast, compiled with Inductor. Its
rewritten graph holds every kind of node the passes write (MX linears, grouped GEMMs with a fused SwiGLU and
route-weight combine, the local dispatch quantize, MX saved activations). The first process misses both caches
and writes them; the second must hit Inductor's FX graph cache (forward and backward graphs) and AOTAutograd's
cache, with no bypass: a bypass means something in the rewritten graph is not cache-safe (a target AOTAutograd
cannot vouch for or pickle, a node without an example value, an unpicklable config patch). The two processes
run in the background from the start of the session (``BACKGROUND_JOBS``, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"linear": 3, "grouped_mm": 2, "swiglu": 2, "combine": 1}  # rewritten ops of the layer's graph, by kind


def _cold_and_warm(environ) -> tuple[dict, dict]:
    """:func:`_first_step` in a process finding an empty cache folder, then in one finding what the first wrote."""
    with tempfile.TemporaryDirectory(prefix="mxfx_compile_cache_") as cache_dir:
        return _run(cache_dir, environ), _run(cache_dir, environ)


BACKGROUND_JOBS = {"cold_and_warm": _cold_and_warm}


@pytest.mark.timeout(660)  # two cold-and-warm processes of at most 300 s each (the job runs under this test)
def test_second_process_hits_compile_caches(session_job):
    cold, warm = session_job("test_compile_cache:cold_and_warm")
    assert cold["mx_ops"] == KINDS and warm["mx_ops"] == KINDS, (cold, warm)  # really rewritten, both times
    assert cold.get("fxgraph_cache_miss", 0) == 2 and cold.get("autograd_cache_miss", 0) == 1, cold
    assert warm.get("fxgraph_cache_hit", 0) == 2 and warm.get("fxgraph_cache_miss", 0) == 0, warm
    assert warm.get("autograd_cache_hit", 0) == 1 and not warm.get("autograd_cache_bypass"), warm
    assert cold["bypass"] == warm["bypass"] == [], (cold["bypass"], warm["bypass"])


def _run(cache_dir, environ) -> dict:
    """:func:`_first_step` in a fresh process with ``environ``, ``TORCHINDUCTOR_CACHE_DIR=cache_dir`` and no GPU."""
    env = dict(environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), CUDA_VISIBLE_DEVICES="")  # a CPU layer: no GPU set-up
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
    assert out.returncode == 0 and line is not None, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(line)


def _first_step() -> dict:
    """One forward and backward of the compiled layer in this process: the rewritten ops by kind, Inductor's
    FX graph cache and AOTAutograd's cache counters, and the bypass reasons torch logged."""
    import logging

    from torch._dynamo.utils import counters

    import mxfx
    from tests.models import MoE, tiny_config

    class Layer(MoE):
        def route(self, x):
            # the router under the caller's autocast: the model's autocast-off region would be an autocast node in
            # the graph, which AOTAutograd's cache refuses for any backend
            probs = F.linear(x, self.gate.weight).float().softmax(dim=-1)
            weights, experts = probs.topk(self.top_k, dim=-1)
            return experts, weights / weights.sum(dim=-1, keepdim=True)

    reasons = []

    class Bypasses(logging.Handler):
        def emit(self, record):
            if "ypass" in record.getMessage():
                reasons.append(" ".join(record.getMessage().split())[:200])

    for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache"):
        logging.getLogger(name).addHandler(Bypasses(logging.INFO))
        logging.getLogger(name).setLevel(logging.INFO)
    torch.manual_seed(0)
    layer = Layer(tiny_config())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    with torch.autocast("cpu", torch.bfloat16):
        y = torch.compile(layer, backend="mxfp8")(torch.randn(2, 32, 64))
    y.float().square().mean().backward()
    kinds = {}
    for pm in mxfx.all_reports():
        for r in pm.records:
            if r.rewritten:
                kinds[r.kind] = kinds.get(r.kind, 0) + 1
    caches = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    caches.update({k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")})
    return {"mx_ops": kinds, **caches, "bypass": reasons}


if __name__ == "__main__":
    print(json.dumps(_first_step()), flush=True)
