"""The test harness itself (tests/conftest.py, :class:`tests.helpers.SessionJobs`): under pytest-xdist a session
job runs once, on the worker that runs every test reading it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_xdist_runs_a_session_job_once(tmp_path):
    pytest.importorskip("xdist")
    root = Path(__file__).resolve().parents[1]
    log = tmp_path / "job.log"
    env = dict(os.environ, MXFX_PROBE_LOG=str(log))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "3", "-p", "no:cacheprovider", "-rA",
                          "tests/xdist_probe.py"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "8 passed" in run.stdout, run.stdout
    pids = log.read_text().split()
    assert len(pids) == 1, f"the job ran {len(pids)} times (workers {pids}):\n{run.stdout}"
