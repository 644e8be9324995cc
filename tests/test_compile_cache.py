"""A model compiled with ``backend="mxfp8"`` in a fresh process reuses what an earlier process compiled.

Two processes share one ``TORCHINDUCTOR_CACHE_DIR`` (``bench/compile_time.py --child``: one
training step of a 1-layer tiny HF OLMoE, FP32 parameters under BF16 autocast). The first
misses both caches and writes them; the second must hit Inductor's FX graph cache (forward and
backward graphs) and AOTAutograd's cache, with no bypass: a bypass means something in the
rewritten graph is not cache-safe (a target AOTAutograd cannot vouch for or pickle, a node
without an example value, an unpicklable config patch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import compile_time  # noqa: E402  (bench/compile_time.py)

pytest.importorskip("transformers")


def test_second_process_hits_compile_caches(tmp_path):
    args = argparse.Namespace(model="olmoe", layers=1, smoke=True, per_block_run=False)
    cold = compile_time.run_child(args, "mxfp8", str(tmp_path))
    warm = compile_time.run_child(args, "mxfp8", str(tmp_path))
    assert "error" not in cold and "error" not in warm, (cold, warm)
    assert cold["mx_ops"] > 0 and warm["mx_ops"] == cold["mx_ops"]  # the graph really was rewritten, both times
    assert cold.get("fxgraph_cache_miss", 0) >= 2 and cold.get("autograd_cache_miss", 0) == 1, cold
    assert warm.get("fxgraph_cache_hit", 0) == cold["fxgraph_cache_miss"], warm
    assert warm.get("fxgraph_cache_miss", 0) == 0, warm
    assert warm.get("autograd_cache_hit", 0) == 1 and not warm.get("autograd_cache_bypass"), warm
    assert warm["bypass"] == "", warm["bypass"]
