"""SyncSparseBatchNorm2d on 2 gloo ranks: the statistics, outputs, running
statistics and trained weights equal those of one process on the global batch
(under DDP; FSDP2 cannot shard the gate's 0-dim ``beta``)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunopt.nn import SparseBatchNorm2d, SyncSparseBatchNorm2d, convert_sync_batchnorm

from _dist import ok, run_scenarios

WORLD = 2


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = SparseBatchNorm2d(4, momentum=None)  # cumulative running averages: every batch counts
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _net():
    g = torch.Generator().manual_seed(3)
    net = _Net().double()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if not name.startswith("bn.gate"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return net


def _batch(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    # channel means far from 0 and unequal rank halves: local statistics would differ from global ones
    x = torch.randn(n, 2, 4, 4, generator=g, dtype=torch.float64) * torch.linspace(0.5, 3, n).view(n, 1, 1, 1) + 2
    return x, torch.randint(0, 3, (n,), generator=g)


def _train(rank):
    """Three SGD steps; ``rank=None``: one process on the global batch."""
    net = _net()
    if rank is not None:
        net = convert_sync_batchnorm(net)
        assert isinstance(net.bn, SyncSparseBatchNorm2d)
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net)
    else:
        model = net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    for step in range(3):
        x, y = _batch(step)
        if rank is not None:
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out, y).backward()
        opt.step()
        outs.append(out.detach())
    from prunopt.pruning import _dist

    weights = {n: _dist.full_tensor(p.detach()) for n, p in net.named_parameters()}
    net.eval()
    x, _ = _batch(10)
    return {"train_out": torch.cat(outs), "running_mean": net.bn.running_mean,
            "running_var": net.bn.running_var, "weights": weights, "eval_out": model(x).detach(),
            "gates": net.bn.gates().detach()}


def _train_scenario(rank, world_size):
    return _train(rank)


def _local_scenario(rank, world_size):
    return _local_statistics_differ(rank)


@pytest.fixture(scope="module")
def results():
    return run_scenarios([_train_scenario, _local_scenario], world_size=WORLD)


def test_synced_statistics_equal_one_process_on_the_global_batch(results):
    ref = _train(None)
    got = ok(results["_train_scenario"])
    for key in ("running_mean", "running_var", "eval_out", "gates"):
        for r in range(WORLD):
            torch.testing.assert_close(got[r][key], ref[key], rtol=1e-10, atol=1e-12, msg=key)
    for n, w in ref["weights"].items():
        for r in range(WORLD):
            torch.testing.assert_close(got[r]["weights"][n], w, rtol=1e-10, atol=1e-12, msg=n)
    # each rank's training outputs are its rows of the one-process outputs (global statistics)
    per_step = ref["train_out"].chunk(3)
    for r in range(WORLD):
        mine = torch.cat([s.chunk(WORLD)[r] for s in per_step])
        torch.testing.assert_close(got[r]["train_out"], mine, rtol=1e-10, atol=1e-12)


def _local_statistics_differ(rank):
    """Without synchronisation (plain SparseBatchNorm2d) the ranks' running
    statistics differ: the test data really tells the two apart."""
    net = _net()
    x, _ = _batch(0)
    net(x.chunk(WORLD)[rank])
    return net.bn.running_mean


def test_the_data_separates_local_from_global_statistics(results):
    a, b = ok(results["_local_scenario"])
    assert not torch.allclose(a, b)
