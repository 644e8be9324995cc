from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graphs or guards leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def four_ranks() -> str:
    """The output of one 4-process launch carrying every 4-process case: tests/test_distributed.py's expert-parallel
    all-to-all and tests/test_fsdp.py's FSDP2 x expert-parallel example (4 processes start once, not per file)."""
    from tests.helpers import launch

    return launch(str(Path(__file__).with_name("test_distributed.py")), "test_distributed:ep,test_fsdp:fsdp_ep", 4,
                  timeout_s=450, check=False)
