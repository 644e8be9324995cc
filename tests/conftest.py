import json
import os
import tempfile

import pytest
import torch._inductor.config  # noqa: F401  (compile_threads, set per xdist worker)
import torch

from mxfx.runtime import cache

try:  # pytest-xdist's scheduler classes (the test extras install it; a plain run needs none)
    from xdist.scheduler import LoadScopeScheduling
except ImportError:
    LoadScopeScheduling = None


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graphs or guards leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


_JOBS = pytest.StashKey()


def _xdist_worker(config) -> bool:
    """Whether this process is a pytest-xdist worker (its controller hands it tests one group at a time)."""
    return hasattr(config, "workerinput")


_GROUPS_DIR = pytest.StashKey()
_GROUPS_FILE = "mxfx_job_groups"
"""``workerinput`` key: the file where xdist workers write which collected tests read which session job."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a case that takes tens of seconds; started first under pytest-xdist")
    if _xdist_worker(config):
        _share_the_cores(config.workerinput["workercount"])
    elif getattr(config.option, "dist", "no") != "no":
        config.stash[_GROUPS_DIR] = tempfile.TemporaryDirectory(prefix="mxfx-xdist-")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: tell each worker where to write the tests' job groups (:class:`JobScheduling`)."""
    node.workerinput[_GROUPS_FILE] = os.path.join(node.config.stash[_GROUPS_DIR].name, "groups.json")


if LoadScopeScheduling is not None:

    class JobScheduling(LoadScopeScheduling):
        """``--dist load`` (what ``-n N`` means alone) with one exception: the tests reading one session job
        (:class:`tests.helpers.SessionJobs`, :meth:`~tests.helpers.SessionJobs.group_of`) go to one worker as one
        unit, so that worker alone runs that job and no test waits for another worker's; every other test is a
        unit of its own. The groups come from the workers' collection (the file of ``pytest_configure_node``),
        written before they report it, so they are there when scheduling starts.

        It overrides ``LoadScopeScheduling._split_scope``, a private method: xdist's own ``--dist loadgroup`` does the
        same from ``xdist_group`` marks, but it tags each test's node id, which pytest 9.2 no longer lets a plugin
        change, so its groups are lost without a word (pytest-xdist issue 1386). The test extras pin the xdist
        releases this was checked on; ``tests/test_harness.py`` fails when the method changes."""

        def _split_scope(self, nodeid: str) -> str:
            if not hasattr(self, "_groups"):
                path = self.nodes[0].workerinput[_GROUPS_FILE]
                with open(path) as f:
                    self._groups = json.load(f)
            return self._groups.get(nodeid, nodeid)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(config, log):
        return JobScheduling(config, log) if config.getvalue("dist") == "load" else None


def _share_the_cores(workers: int) -> None:
    """An xdist worker's share of the machine: ``cores / workers`` intra-op threads and Inductor compiling in this
    process (its default, a pool of one compile process per core in every worker, gives workers x cores
    processes, each holding a copy of torch); the processes a test starts inherit both."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ.update(OMP_NUM_THREADS=str(threads), TORCHINDUCTOR_COMPILE_THREADS="1")
    torch.set_num_threads(threads)
    torch._inductor.config.compile_threads = 1


def pytest_collection_modifyitems(config, items):
    """Mark each test reading a session job ``slow``; on an xdist worker, ``slow`` tests first (a long test
    scheduled last is the run's tail) and the tests' job groups written for the controller (:class:`JobScheduling`)."""
    from tests.helpers import SessionJobs

    groups = {}
    for item in items:
        group = SessionJobs.group_of(item)
        if group is not None:  # it waits for another process's work: slow too
            groups[item.nodeid] = group
            item.add_marker(pytest.mark.slow)
    if _xdist_worker(config):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order kept otherwise
        path = config.workerinput.get(_GROUPS_FILE)
        if path:  # every worker writes the same map; one whole file replaces another
            with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as f:
                json.dump(groups, f)
            os.replace(f.name, path)


def pytest_collection_finish(session):
    """Set up the session's jobs (:class:`tests.helpers.SessionJobs`) as soon as the tests are known: started at
    once in the background in a plain run, on first use on the worker that runs their tests under pytest-xdist."""
    if not session.config.option.collectonly:
        from tests.helpers import SessionJobs

        session.config.stash[_JOBS] = SessionJobs(session, lazy=_xdist_worker(session.config))


def pytest_unconfigure(config):
    jobs = config.stash.get(_JOBS, None)
    if jobs is not None:
        jobs.stop()
    groups_dir = config.stash.get(_GROUPS_DIR, None)
    if groups_dir is not None:
        groups_dir.cleanup()


@pytest.fixture(scope="session")
def session_job(pytestconfig):
    """``session_job("stem:name")``: the result of a ``BACKGROUND_JOBS`` entry of a test file, once it has ended."""
    return pytestconfig.stash[_JOBS].result


@pytest.fixture(scope="module")
def two_ranks(pytestconfig, request) -> str:
    """The output of the 2-process launch carrying this test file's ``TWO_RANKS`` worker cases (in a plain run,
    one launch for every collected test file's cases)."""
    return pytestconfig.stash[_JOBS].result(pytestconfig.stash[_JOBS].launch_of("TWO_RANKS", request.module))


@pytest.fixture(scope="module")
def four_ranks(pytestconfig, request) -> str:
    """The output of the 4-process launch carrying this test file's ``FOUR_RANKS`` worker cases (in a plain run,
    one launch for every collected test file's cases)."""
    return pytestconfig.stash[_JOBS].result(pytestconfig.stash[_JOBS].launch_of("FOUR_RANKS", request.module))


@pytest.fixture
def fresh_weight_cache():
    """Empty weight caches and counters, the optimizer step hook installed; after the test the hook is put back
    (tests that disable it), dgrad forms are built lazily again (the default) and the caches emptied."""
    cache.clear()
    cache.reset_stats()
    cache.install()
    yield cache
    cache.install()
    cache.set_dgrad_at_refresh(False)
    cache.clear()
