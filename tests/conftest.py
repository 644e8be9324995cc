import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graphs or guards leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


_JOBS = pytest.StashKey()


def pytest_collection_finish(session):
    """Start the session's background jobs (:class:`tests.helpers.SessionJobs`) as soon as the tests are known."""
    if not session.config.option.collectonly:
        from tests.helpers import SessionJobs

        session.config.stash[_JOBS] = SessionJobs(session)


def pytest_unconfigure(config):
    jobs = config.stash.get(_JOBS, None)
    if jobs is not None:
        jobs.stop()


@pytest.fixture(scope="session")
def session_job(pytestconfig):
    """``session_job("stem:name")``: the result of a ``BACKGROUND_JOBS`` entry of a test file, once it has ended."""
    return pytestconfig.stash[_JOBS].result


@pytest.fixture(scope="session")
def two_ranks(pytestconfig) -> str:
    """The output of the 2-process launch carrying the ``TWO_RANKS`` worker cases of every collected test file."""
    return pytestconfig.stash[_JOBS].result("TWO_RANKS")


@pytest.fixture(scope="session")
def four_ranks(pytestconfig) -> str:
    """The output of the 4-process launch carrying the ``FOUR_RANKS`` worker cases of every collected test file."""
    return pytestconfig.stash[_JOBS].result("FOUR_RANKS")
