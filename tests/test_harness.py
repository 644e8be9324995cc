"""The test harness itself (tests/conftest.py, :class:`tests.helpers.SessionJobs`): under pytest-xdist a session
job runs once, on the worker that runs every test reading it."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest


@pytest.mark.slow
def test_xdist_runs_a_session_job_once(tmp_path):
    pytest.importorskip("xdist")
    root = Path(__file__).resolve().parents[1]
    log = tmp_path / "job.log"
    env = dict(os.environ, MXFX_PROBE_LOG=str(log))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "3", "-p", "no:cacheprovider", "-rA", "tests/xdist_probe.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "8 passed" in run.stdout, run.stdout
    pids = log.read_text().split()
    assert len(pids) == 1, f"the job ran {len(pids)} times (workers {pids}):\n{run.stdout}"


def test_the_job_scheduler_sends_a_jobs_tests_as_one_unit(tmp_path):
    """:class:`tests.conftest.JobScheduling` overrides pytest-xdist's private ``LoadScopeScheduling._split_scope``
    (the test extras pin the xdist releases it was checked on): this fails when a release renames it, changes its
    signature, or stops asking it for each test's unit, which would otherwise split a job's tests silently."""
    pytest.importorskip("xdist")
    from xdist.scheduler import LoadScopeScheduling

    from tests.conftest import _GROUPS_FILE, JobScheduling

    assert list(inspect.signature(LoadScopeScheduling._split_scope).parameters) == ["self", "nodeid"]
    jobs = [f"tests/test_a.py::test_job[{i}]" for i in range(4)]
    plain = [f"tests/test_a.py::test_plain[{i}]" for i in range(8)]
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps(dict.fromkeys(jobs, "test_a:jobs")))

    class Worker:
        """What the scheduler reads of an xdist worker, and the tests it was sent."""

        def __init__(self, name):
            self.gateway, self.workerinput = SimpleNamespace(id=name), {_GROUPS_FILE: str(groups)}
            self.shutting_down, self.sent = False, []

        def send_runtest_some(self, indices):
            self.sent += indices

        def shutdown(self):
            self.shutting_down = True

    config = SimpleNamespace(getvalue={"tx": ["popen"] * 2}.get, option=SimpleNamespace(loadscopereorder=True))
    scheduler = JobScheduling(config)
    workers = [Worker("gw0"), Worker("gw1")]
    for w in workers:
        scheduler.add_node(w)
    for w in workers:
        scheduler.add_node_collection(w, jobs + plain)
    scheduler.schedule()
    sent = [{(jobs + plain)[i] for i in w.sent} for w in workers]
    holders = [got for got in sent if got & set(jobs)]
    assert len(holders) == 1 and set(jobs) <= holders[0], sent  # the job's four tests: one unit, one worker
    assert all(sent), sent  # every other test a unit of its own (by module, one worker would take all twelve)
