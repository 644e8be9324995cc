import pytest
import torch._inductor.config  # noqa: F401  (compile_threads, set per xdist worker)
import torch


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


def pytest_configure(config):
    """Under pytest-xdist, ``--dist load`` (what ``-n N`` means alone) becomes ``loadgroup``: the tests that read
    one job (:class:`tests.helpers.SessionJobs`) carry its ``xdist_group`` mark and so run on one worker, which
    alone runs that job; every other test is scheduled as ``load`` would."""
    config.addinivalue_line("markers", "slow: a case that takes tens of seconds; started first under pytest-xdist")
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"
    if _xdist_worker(config):
        _share_the_cores(config.workerinput["workercount"])


def _share_the_cores(workers: int) -> None:
    """An xdist worker's share of the machine: ``cores / workers`` intra-op threads and Inductor compiling in this
    process (its default, a pool of one compile process per core in every worker, gives workers x cores
    processes, each holding a copy of torch); the processes a test starts inherit both."""
    import os

    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ.update(OMP_NUM_THREADS=str(threads), TORCHINDUCTOR_COMPILE_THREADS="1")
    torch.set_num_threads(threads)
    torch._inductor.config.compile_threads = 1


def pytest_collection_modifyitems(config, items):
    """Mark each test reading a session job with that job's ``xdist_group`` (and ``slow``); under xdist, ``slow``
    tests first (a long test scheduled last is the run's tail)."""
    from tests.helpers import SessionJobs

    for item in items:
        group = SessionJobs.group_of(item)
        if group is not None:  # it waits for another process's work: slow too
            item.add_marker(pytest.mark.xdist_group(group))
            item.add_marker(pytest.mark.slow)
    if _xdist_worker(config):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order kept otherwise


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
