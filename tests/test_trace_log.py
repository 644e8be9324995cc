"""The rewrite in torch's own logs: ``TORCH_TRACE`` artifacts and the ``mxfx`` logger under ``TORCH_LOGS``.

Both are read at torch's import, so a fresh process with both set compiles a small linear model once, from the start
of the session (``BACKGROUND_JOBS``, tests/conftest.py); each test reads its part of what that process wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import torch
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
c = torch.compile(m, backend="mxfp8", options={"inner": "aot_eager"})
c(torch.randn(32, 64)).sum().backward()
"""


def _run(environ, **env) -> subprocess.CompletedProcess:
    full = dict(environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), environ.get("PYTHONPATH")) if p), **env)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def _logged(environ) -> tuple[str, Path]:
    """``(stderr, trace folder)`` of one run of :data:`SCRIPT` under ``TORCH_TRACE`` and ``TORCH_LOGS="+mxfx"``."""
    trace = Path(tempfile.mkdtemp(prefix="mxfx_torch_trace_"))
    return _run(environ, TORCH_TRACE=str(trace), TORCH_LOGS="+mxfx").stderr, trace


BACKGROUND_JOBS = {"logged": _logged}


@pytest.fixture(scope="module")
def logged(session_job):
    return session_job("test_trace_log:logged")


def test_precision_map_and_graphs_in_torch_trace(logged):
    _, tmp_path = logged
    artifacts = {}
    for f in tmp_path.glob("*.log"):
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            if '{"artifact"' in line:  # glog prefix, then the JSON envelope; the payload follows, tab-indented
                meta = json.loads(line[line.index('{"artifact"') :])["artifact"]
                payload = []
                for nxt in lines[i + 1 :]:
                    if not nxt.startswith("\t"):
                        break
                    payload.append(nxt[1:])
                artifacts[meta["name"]] = "\n".join(payload)
    assert {"mxfx_graph_before", "mxfx_precision_map", "mxfx_precision_map_json", "mxfx_graph_after"} <= set(artifacts)
    assert "linear: 2 mxfp8 / 0 kept" in artifacts["mxfx_precision_map"]
    records = json.loads(artifacts["mxfx_precision_map_json"])["records"]
    assert [r["kind"] for r in records if r["forward"] == "mxfp8"].count("linear") == 2
    assert "mx_linear" in artifacts["mxfx_graph_after"] and "mx_linear" not in artifacts["mxfx_graph_before"]


def test_one_line_per_graph_under_torch_logs(logged):
    err, _ = logged
    lines = [ln for ln in err.splitlines() if "mxfx: graph" in ln]
    assert len(lines) == 1 and "linear: 2 mxfp8 / 0 kept" in lines[0], err[-2000:]
