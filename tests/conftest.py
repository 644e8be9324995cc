import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graphs or guards leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


_LAUNCHES = pytest.StashKey()


def pytest_collection_finish(session):
    """Start the distributed launches (:class:`tests.helpers.DistributedLaunches`) as soon as the tests are known."""
    if not session.config.option.collectonly:
        from tests.helpers import DistributedLaunches

        session.config.stash[_LAUNCHES] = DistributedLaunches(session)


def pytest_unconfigure(config):
    launches = config.stash.get(_LAUNCHES, None)
    if launches is not None:
        launches.stop()


@pytest.fixture(scope="session")
def two_ranks(pytestconfig) -> str:
    """The output of the 2-process launch carrying the ``TWO_RANKS`` worker cases of every collected test file."""
    return pytestconfig.stash[_LAUNCHES].output("TWO_RANKS")


@pytest.fixture(scope="session")
def four_ranks(pytestconfig) -> str:
    """The output of the 4-process launch carrying the ``FOUR_RANKS`` worker cases of every collected test file."""
    return pytestconfig.stash[_LAUNCHES].output("FOUR_RANKS")
