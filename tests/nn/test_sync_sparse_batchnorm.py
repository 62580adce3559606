"""SyncSparseBatchNorm2d and the batch-norm conversions in one process (the
synchronised statistics themselves: tests/distributed/test_syncbn_dist.py)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunopt.nn import (
    SparseBatchNorm2d,
    SyncSparseBatchNorm2d,
    convert_sync_batchnorm,
    convert_to_sparse_batchnorm,
    sparse_gates,
)


def _trained_bn_net(sync=False, zero_weight=True):
    torch.manual_seed(0)
    bn = nn.SyncBatchNorm if sync else nn.BatchNorm2d
    net = nn.Sequential(nn.Conv2d(2, 5, 3, padding=1), bn(5), nn.ReLU(), nn.Conv2d(5, 3, 1), bn(3),
                        nn.Flatten(), nn.Linear(3 * 16, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(-2, 2)
                if zero_weight:
                    m.weight[0] = 0.0  # a zero weight: a zero gate (its constant bias is dropped)
                m.bias.uniform_(-1, 1)
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return net.eval()


def test_convert_sync_batchnorm_keeps_gates_and_eval_outputs():
    net = convert_to_sparse_batchnorm(_trained_bn_net())
    x = torch.randn(4, 2, 4, 4)
    before = net(x)
    tensors = {id(t) for t in list(net.parameters()) + list(net.buffers())}
    out = convert_sync_batchnorm(net)
    assert out is net
    assert isinstance(net[1], SyncSparseBatchNorm2d) and isinstance(net[4], SyncSparseBatchNorm2d)
    assert type(net[7]) is nn.SyncBatchNorm  # a plain batch norm: torch's conversion
    # the very same tensors (optimizers stay valid), gates and shift kept
    assert {id(t) for t in list(net.parameters()) + list(net.buffers())} == tensors
    assert len(sparse_gates(net)) == 2
    torch.testing.assert_close(net(x), before, rtol=0, atol=0)
    assert convert_sync_batchnorm(net) is net and isinstance(net[1], SyncSparseBatchNorm2d)  # already converted


def test_convert_sync_batchnorm_of_a_layer_returns_the_replacement():
    sbn = SparseBatchNorm2d(3, momentum=None, track_running_stats=True).double()
    sync = convert_sync_batchnorm(sbn, process_group="pg")
    assert isinstance(sync, SyncSparseBatchNorm2d) and type(sbn) is SparseBatchNorm2d
    assert sync.process_group == "pg" and sync.momentum is None and sync.gate is sbn.gate
    assert sync.shift is sbn.shift and sync.running_var is sbn.running_var
    tied = nn.Module()
    tied.a = tied.b = SparseBatchNorm2d(3)
    convert_sync_batchnorm(tied)
    assert tied.a is tied.b and isinstance(tied.a, SyncSparseBatchNorm2d)
    with pytest.raises(TypeError, match="module"):
        convert_sync_batchnorm("net")


def test_torch_convert_sync_batchnorm_refuses_sparse_batch_norms():
    net = convert_to_sparse_batchnorm(_trained_bn_net())
    with pytest.raises(AttributeError, match="prunopt.nn.convert_sync_batchnorm"):
        nn.SyncBatchNorm.convert_sync_batchnorm(net)
    with pytest.raises(AttributeError, match="sparse gate"):
        nn.SyncBatchNorm.convert_sync_batchnorm(SparseBatchNorm2d(3))
    sbn = SparseBatchNorm2d(3)
    assert not hasattr(sbn, "weight") and getattr(sbn, "bias", None) is None
    assert "weight" not in sbn.state_dict() and "gate.alpha" in sbn.state_dict()


def test_convert_to_sparse_batchnorm_converts_sync_batchnorm():
    pg = object()
    net = _trained_bn_net(sync=True, zero_weight=False)
    for m in net.modules():
        if isinstance(m, nn.SyncBatchNorm):
            m.process_group = pg
    x = torch.randn(4, 2, 4, 4)
    # SyncBatchNorm in eval mode (and without a process group) is BatchNorm's function
    before = net[:5](x)
    out = convert_to_sparse_batchnorm(net[:5])
    assert isinstance(out[1], SyncSparseBatchNorm2d) and out[1].process_group is pg
    torch.testing.assert_close(out(x), before, rtol=1e-5, atol=1e-5)
    single = convert_to_sparse_batchnorm(nn.SyncBatchNorm(3))
    assert isinstance(single, SyncSparseBatchNorm2d)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("track", [True, False])
def test_statistics_are_batchnorm2d_s(momentum, track):
    """SparseBatchNorm2d's normalisation (and SyncSparseBatchNorm2d's without
    a process group) is BatchNorm2d(affine=False)'s, running statistics too."""
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(3, affine=False, momentum=momentum, track_running_stats=track)
    for cls in (SparseBatchNorm2d, SyncSparseBatchNorm2d):
        sbn = cls(3, momentum=momentum, track_running_stats=track)
        with torch.no_grad():
            sbn.gate.alpha.copy_(torch.tensor([1.0, 2.0, -1.5]))
            sbn.gate.beta.fill_(-20.0)  # threshold ~ 0: a = alpha
            sbn.shift.copy_(torch.tensor([0.5, -1.0, 0.0]))
        ref.reset_running_stats()
        a = sbn.gates().detach().view(1, -1, 1, 1)
        for train in (True, True, False):
            ref.train(train)
            sbn.train(train)
            x = torch.randn(4, 3, 5, 5) * 2 + 1
            torch.testing.assert_close(sbn(x), a * (ref(x) + sbn.shift.detach().view(1, -1, 1, 1)))
        if track:
            torch.testing.assert_close(sbn.running_mean, ref.running_mean)
            torch.testing.assert_close(sbn.running_var, ref.running_var)
            assert int(sbn.num_batches_tracked) == int(ref.num_batches_tracked) == 2


def test_sync_sparse_batchnorm_trains_like_sparse_batchnorm_in_one_process():
    torch.manual_seed(0)
    a, b = SparseBatchNorm2d(4), SyncSparseBatchNorm2d(4)
    b.load_state_dict(a.state_dict())
    x = torch.randn(6, 4, 3, 3, requires_grad=True)
    ga = torch.autograd.grad(a(x).pow(2).sum(), [x, a.gate.alpha, a.shift])
    gb = torch.autograd.grad(b(x).pow(2).sum(), [x, b.gate.alpha, b.shift])
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v)
    torch.testing.assert_close(a.running_var, b.running_var)
    assert "SyncSparseBatchNorm2d" in repr(b) and F.relu(b(x)).shape == x.shape
