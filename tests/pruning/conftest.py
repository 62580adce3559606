import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The pruning tests use tiny tensors: one intra-op thread avoids OpenMP
    barrier overhead (large on shared machines); restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
