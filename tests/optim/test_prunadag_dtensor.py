"""PrunAdag refuses DTensor (FSDP2-sharded) parameters with a clear error
before writing anything (a per-shard selection would be another algorithm)."""
import pytest
import torch
import torch.distributed as dist

from prunopt.optim import PrunAdag


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_parameters_are_a_value_error_and_nothing_changes(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
    w.grad = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    before = w.detach().full_tensor().clone()
    opt = PrunAdag([w], lr=0.1, relevant=0.5)
    with pytest.raises(ValueError, match="DTensor"):
        opt.step()
    assert torch.equal(w.detach().full_tensor(), before)
