"""PrunAdag and SFW on DTensor parameters in a one-rank process group (the
multi-rank runs are in tests/distributed/test_prunadag_dist.py): the same
steps as on plain tensors, the state stays a DTensor, the op's ``selection``
argument is checked."""
import pytest
import torch
import torch.distributed as dist

from prunopt.optim import SFW, PrunAdag


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _pair(mesh, placement, seed=0):
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(seed)
    plain = [torch.nn.Parameter(torch.randn(5, 3, generator=g, dtype=torch.float64)),
             torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64))]
    sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [placement])) for p in plain]
    return plain, sharded


@pytest.mark.parametrize("path", [dict(fused=True), dict(foreach=True), dict(foreach=False)])
@pytest.mark.parametrize("version", [1, 3, 4, "relevant_only"])
def test_dtensor_steps_equal_plain_steps(one_rank_group, path, version):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (1,))
    plain, sharded = _pair(mesh, Shard(0))
    opts = [PrunAdag(ps, lr=0.1, relevant=0.3, version=version, weight_decay=0.01, **path) for ps in (plain, sharded)]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in plain]
        for p, q, gr in zip(plain, sharded, grads):
            p.grad = gr
            q.grad = torch.distributed.tensor.distribute_tensor(gr, mesh, q.placements)
        for opt in opts:
            opt.step()
    for p, q in zip(plain, sharded):
        torch.testing.assert_close(q.detach().full_tensor(), p.detach(), rtol=1e-13, atol=1e-13)
        assert isinstance(opts[1].state[q]["sum"], torch.distributed.tensor.DTensor)


def test_sfw_dtensor_steps_equal_plain_steps(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    plain, sharded = _pair(mesh, Replicate())
    opts = [SFW(ps, lr=0.5, rescale="gradient", momentum=0.5, radius=2.0, relevant=0.4) for ps in (plain, sharded)]
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        for p, q in zip(plain, sharded):
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            q.grad = distribute_tensor(p.grad.clone(), mesh, q.placements)
        for opt in opts:
            opt.step()
    for p, q in zip(plain, sharded):
        torch.testing.assert_close(q.detach().full_tensor(), p.detach(), rtol=1e-13, atol=1e-13)


def _op_args(n=6):
    x = torch.randn(n, dtype=torch.float64)
    hyper = torch.tensor([[0.1, 0.1, 0.0, 1e-10, 0.0, 1.0]], dtype=torch.float64)
    return [x], [torch.full_like(x, 0.01)], [torch.full_like(x, 0.01)], [torch.randn(n, dtype=torch.float64)], hyper


@pytest.mark.parametrize("selection, match", [
    (torch.tensor([0.5, 1.0]), "float64 tensor of 2 elements"),
    (torch.tensor([0.5, 1.0, 2.0, 0.0], dtype=torch.float64), "float64 tensor of 2 elements"),
    (torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64), r"selection\[2\]"),
    (torch.tensor([-0.5, 1.0], dtype=torch.float64), r"selection\[0\]"),
    (torch.tensor([float("nan"), 1.0], dtype=torch.float64), r"selection\[0\]"),
    (torch.tensor([0.5, float("inf")], dtype=torch.float64), r"selection\[1\]"),
    (torch.tensor([0.5, -1.0], dtype=torch.float64), r"selection\[1\]"),
])
def test_op_selection_is_checked_before_writing(selection, match):
    xs, so, sd, gs, hyper = _op_args()
    before = [t.clone() for t in xs + so + sd]
    with pytest.raises(ValueError, match=match):
        torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyper, 2, 3, None, selection)
    assert all(torch.equal(a, b) for a, b in zip(xs + so + sd, before))


@pytest.mark.parametrize("checked", [0.0, 1.0])
def test_op_selection_with_gradients_checked_is_the_same_step(checked):
    """[tau, r, 1] (the caller checked the gradients finite: the kernel skips
    its own pass) and [tau, r, 0] give the step of [tau, r], bit for bit."""
    out = []
    for sel in ([0.5, 1.25], [0.5, 1.25, checked]):
        torch.manual_seed(4)
        xs, so, sd, gs, hyper = _op_args(300)
        torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyper, 2, 3, None, torch.tensor(sel, dtype=torch.float64))
        out.append([t.clone() for t in xs + so + sd])
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_op_selection_float_threshold_must_be_a_float_value():
    xs, so, sd, gs, hyper = _op_args()
    xs, so, sd, gs = ([t.float() for t in lst] for lst in (xs, so, sd, gs))
    with pytest.raises(ValueError, match="value of the params' dtype"):
        torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyper, 2, 3, None,
                                         torch.tensor([0.1, 1.0], dtype=torch.float64))


def test_sharded_view_counts_each_placement_once_per_view(one_rank_group, monkeypatch):
    """ShardedView.counts asks prunopt.distributed.counts_locally once per
    placement in a view (a step builds one view) and answers per placement:
    a Partial DTensor still raises ValueError, every time."""
    import prunopt.distributed as pd
    from prunopt.optim._sharded import ShardedView
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (1,))
    tensors = [DTensor.from_local(torch.zeros(2, 3), mesh, [pl]) for pl in (Shard(0), Replicate(), Shard(1), Shard(0))]
    asked = []
    answers = {Shard(0): True, Replicate(): False, Shard(1): True}  # (a stand-in answer per placement)
    monkeypatch.setattr(pd, "counts_locally", lambda t: asked.append(t.placements[0]) or answers[t.placements[0]])
    view = ShardedView(tensors)
    assert [view.counts(t) for t in tensors + tensors] == [True, False, True, True] * 2
    assert asked == [Shard(0), Replicate(), Shard(1)]
    assert view.counts(torch.zeros(3)) is True  # a plain tensor beside them: replicated, counted at coordinate 0
    monkeypatch.undo()
    partial = DTensor.from_local(torch.zeros(2), mesh, [Partial()])
    for _ in range(2):
        with pytest.raises(ValueError, match="Partial"):
            view.counts(partial)
