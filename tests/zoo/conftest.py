import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The zoo models are tiny: one intra-op thread avoids OpenMP barrier
    overhead (seconds per step on a shared machine); restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
