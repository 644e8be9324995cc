import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graphs or guards leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def two_ranks(request) -> str:
    """The output of one 2-process launch carrying the ``TWO_RANKS`` worker cases of every collected test file."""
    from tests.helpers import launch_declared_cases

    return launch_declared_cases(request.session, "TWO_RANKS", 2)


@pytest.fixture(scope="session")
def four_ranks(request) -> str:
    """The output of one 4-process launch carrying the ``FOUR_RANKS`` worker cases of every collected test file."""
    from tests.helpers import launch_declared_cases

    return launch_declared_cases(request.session, "FOUR_RANKS", 4)
