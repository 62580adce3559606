"""SparseGate, SparseBatchNorm2d, regularisers, schedule and channel removal (Lee)."""
import math

import pytest
import torch
from torch import nn

from prunopt.nn import (
    SparseBatchNorm2d,
    SparseGate,
    convert_to_sparse_batchnorm,
    cubic_strength,
    gate_density,
    group_l21_regularizer,
    l1_regularizer,
    lp_regularizer,
    remove_channels,
    sparse_gates,
)
from prunopt.testing import devices
from prunopt.train.models import SmallCNN


@pytest.mark.parametrize("n", [1, 2, 6, 9, 14, 64, 255, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gates_start_at_exactly_half(n, dtype):
    g = SparseGate(n, dtype=dtype)
    a = g()
    assert a.dtype == dtype and torch.equal(a, torch.full((n,), 0.5, dtype=dtype))
    # the paper's values (up to a few ulps in float32)
    assert abs(g.alpha[0].item() - 0.5 * (n + 1) / n) < 1e-6
    assert abs(g.beta.item() + (math.log(n * n + n - 1) if n > 1 else 0.0)) < 1e-5


def test_nonnegative_gates_start_uniform():
    a = SparseGate(8, signed=False)()
    torch.testing.assert_close(a, torch.full((8,), 1 / 8))


@pytest.mark.parametrize("rgf", [True, False])
def test_strong_regulariser_gives_exact_zeros(rgf):
    torch.manual_seed(0)
    g = SparseGate(16, rgf=rgf)
    target = torch.randn(16)
    opt = torch.optim.Adam(g.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        a = g()
        loss = ((a - target) ** 2).mean() * 0.01 + 1.0 * l1_regularizer(a)
        loss.backward()
        opt.step()
    a = g().detach()
    assert (a == 0).sum() >= 8  # exact zeros, not small numbers
    assert torch.isfinite(g.alpha).all() and torch.isfinite(g.beta)


def test_rgf_keeps_gradient_for_dropped_gates():
    g = SparseGate(4, rgf=True)
    with torch.no_grad():
        g.alpha.copy_(torch.tensor([2.0, 0.01, 1.0, 0.02]))
    a = g()
    assert a[1] == 0 and a[3] == 0
    a.sum().backward()
    assert g.alpha.grad[1] != 0  # elu surrogate: still a learning signal
    g2 = SparseGate(4, rgf=False)
    with torch.no_grad():
        g2.alpha.copy_(torch.tensor([2.0, 0.01, 1.0, 0.02]))
    (g2() * torch.tensor([1.0, 5.0, 1.0, 5.0])).sum().backward()
    # without rgf only the shared threshold term reaches dropped gates: equal for both
    assert g2.alpha.grad[1] == g2.alpha.grad[3]


def test_sparse_batchnorm_equals_batchnorm_when_a_is_one():
    torch.manual_seed(1)
    sbn, bn = SparseBatchNorm2d(5), nn.BatchNorm2d(5)
    with torch.no_grad():
        sbn.gate.alpha.fill_(1.0)
        sbn.gate.beta.fill_(-1e4)  # sigmoid(beta) == 0: a == 1 exactly
        b = torch.randn(5)
        sbn.shift.copy_(b)
        bn.bias.copy_(b)
    assert torch.equal(sbn.gates(), torch.ones(5))
    x = torch.randn(4, 5, 3, 3)
    for mode in ("train", "eval"):
        getattr(sbn, mode)(), getattr(bn, mode)()
        torch.testing.assert_close(sbn(x), bn(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(sbn.running_mean, bn.running_mean)
    torch.testing.assert_close(sbn.running_var, bn.running_var)


def test_convert_preserves_function_and_is_drop_in():
    torch.manual_seed(2)
    model = SmallCNN(width=4)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(-1.5, 1.5)
                m.bias.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2)
    model.eval()
    x = torch.rand(3, 1, 8, 8)
    ref = model(x)
    convert_to_sparse_batchnorm(model)
    assert sum(isinstance(m, SparseBatchNorm2d) for m in model.modules()) == 3
    torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)
    fresh = convert_to_sparse_batchnorm(SmallCNN(width=4), preserve=False)
    assert all(torch.equal(a, torch.full_like(a, 0.5)) for a in sparse_gates(fresh))


def test_regularisers_values_and_safe_gradients():
    a = torch.tensor([0.0, 0.0, 3.0, -4.0, 0.0, 0.0], requires_grad=True)
    assert l1_regularizer(a).item() == 7.0
    r = group_l21_regularizer(a, group_size=2)  # groups (0,0), (3,-4), (0,0)
    assert r.item() == 5.0
    (g,) = torch.autograd.grad(r, a)
    assert torch.isfinite(g).all() and g[0] == 0 and g[4] == 0
    lp = lp_regularizer(a, p=0.5)
    torch.testing.assert_close(lp, torch.tensor((math.sqrt(3) + 2) ** 2))
    (g,) = torch.autograd.grad(lp, a)
    assert torch.isfinite(g).all() and g[0] == 0
    z = torch.zeros(4, requires_grad=True)
    (g,) = torch.autograd.grad(lp_regularizer(z, 0.5) + group_l21_regularizer(z), z)
    assert torch.equal(g, torch.zeros(4))
    # list input: one group per tensor
    assert l1_regularizer([a, a]).item() == 14.0


@pytest.mark.parametrize("p", [1.0, 1.5, 0.0, -0.5, float("nan")])
def test_lp_rejects_p_outside_open_unit_interval(p):
    with pytest.raises(ValueError, match="p"):
        lp_regularizer(torch.ones(3), p)


def test_regulariser_errors():
    with pytest.raises(ValueError, match="empty group"):
        lp_regularizer(torch.ones(0), 0.5)
    with pytest.raises(ValueError, match="empty group"):
        group_l21_regularizer(torch.ones(0))
    with pytest.raises(ValueError, match="group_size"):
        group_l21_regularizer(torch.ones(6), group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        group_l21_regularizer(torch.ones(6), group_size=0)
    with pytest.raises(ValueError, match="empty group"):
        group_l21_regularizer(torch.ones(3, 0), group_size=2)
    with pytest.raises(ValueError, match="empty group"):
        l1_regularizer([torch.ones(3), torch.ones(0)])
    with pytest.raises(ValueError, match="empty group"):
        lp_regularizer([torch.ones(3), torch.ones(2, 0)], 0.5)
    with pytest.raises(ValueError, match="gates is empty"):
        group_l21_regularizer([])
    with pytest.raises(ValueError, match="num_gates"):
        SparseGate(0)
    with pytest.raises(ValueError, match="rgf_alpha"):
        SparseGate(3, rgf_alpha=-0.1)
    with pytest.raises(TypeError, match="num_gates"):
        SparseGate(2.0)
    with pytest.raises(TypeError, match="gates"):
        l1_regularizer("a")


def test_cubic_strength_schedule():
    assert cubic_strength(0, 0.0, 1.0, 5, 10) == 0.0
    assert cubic_strength(5, 0.0, 1.0, 5, 10) == 0.0
    assert cubic_strength(15, 0.0, 1.0, 5, 10) == 1.0
    assert cubic_strength(100, 0.0, 1.0, 5, 10) == 1.0
    assert cubic_strength(10, 0.0, 1.0, 5, 10) == pytest.approx(1 - 0.5 ** 3)
    vals = [cubic_strength(t, 1e-4, 1e-2, 0, 20) for t in range(25)]
    assert all(b >= a for a, b in zip(vals, vals[1:]))
    with pytest.raises(ValueError, match="n"):
        cubic_strength(1, 0.0, 1.0, 0, 0)


def _sparse_cnn(zero_frac=0.5, seed=3):
    torch.manual_seed(seed)
    model = convert_to_sparse_batchnorm(SmallCNN(width=8), preserve=False)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SparseBatchNorm2d):
                n = m.num_features
                drop = torch.randperm(n)[: int(n * zero_frac)]
                m.gate.alpha[drop] = 0.0  # alpha = 0 -> a = 0 exactly
                m.shift.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2)
    return model


def test_channel_removal_identical_outputs_fewer_params():
    model = _sparse_cnn()
    model.eval()
    x = torch.rand(5, 1, 8, 8)
    ref = model(x)
    small = remove_channels(model, example_input=x)
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in model.parameters())
    torch.testing.assert_close(small(x), ref, atol=1e-5, rtol=1e-5)
    convs = [m for m in small.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [4, 8, 8]
    assert small.classifier.in_features == 8
    assert not any(isinstance(m, SparseBatchNorm2d) for m in small.modules())
    # the original is untouched
    torch.testing.assert_close(model(x), ref)


def test_gate_regularisers_under_torch_compile():
    torch._dynamo.reset()
    gate = SparseGate(12)

    def f():
        a = gate()
        return l1_regularizer(a) + group_l21_regularizer(a, 4) + lp_regularizer(a, 0.5)

    eager = f()
    ge = torch.autograd.grad(eager, list(gate.parameters()))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)()
    gc = torch.autograd.grad(compiled, list(gate.parameters()))
    torch.testing.assert_close(compiled, eager)
    for u, v in zip(gc, ge):
        torch.testing.assert_close(u, v)


def test_channel_removal_of_a_fully_zero_layer():
    model = _sparse_cnn(0.0).eval()
    with torch.no_grad():
        model.features[1].gate.alpha.zero_()  # every gate of the first layer is 0
    x = torch.rand(3, 1, 8, 8)
    small = remove_channels(model, example_input=x)
    assert small.features[0].out_channels == 1
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)


def test_channel_removal_float64_and_gate_density():
    model = _sparse_cnn(0.25).double().eval()
    x = torch.rand(2, 1, 8, 8, dtype=torch.float64)
    small = remove_channels(model)
    torch.testing.assert_close(small(x), model(x), atol=1e-12, rtol=0)
    assert gate_density(model) == pytest.approx(0.75)


@pytest.mark.slow
def test_layers_under_torch_compile_model():
    torch._dynamo.reset()
    model = _sparse_cnn(0.25)
    x = torch.rand(4, 1, 8, 8)

    def step(x):
        out = model(x)
        gs = sparse_gates(model)
        return out.square().mean() + 1e-3 * l1_regularizer(gs) + 1e-3 * group_l21_regularizer(gs, 4) \
            + 1e-3 * lp_regularizer(gs, 0.5)

    eager = step(x)
    ge = torch.autograd.grad(eager, list(model.parameters()))
    compiled = torch.compile(step, backend="aot_eager")(x)
    gc = torch.autograd.grad(compiled, list(model.parameters()))
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    for u, v in zip(gc, ge):
        torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [3, 20000, 100003])
def test_gates_exactly_half_at_large_n_with_linear_memory(n, dtype, monkeypatch):
    # the solve evaluates one n-sized candidate at a time (it used to stack ~585 of
    # them, and at n = 20000 float32 every gate came out 0.49999997)
    import prunopt.nn.sparsification as sp

    sizes = []
    real = sp.sparse_gate

    def spy(alpha, beta, *args, **kwargs):
        sizes.append(alpha.numel())
        return real(alpha, beta, *args, **kwargs)

    monkeypatch.setattr(sp, "sparse_gate", spy)
    g = SparseGate(n, dtype=dtype)
    assert sizes and max(sizes) == n and len(sizes) <= 40
    monkeypatch.setattr(sp, "sparse_gate", real)
    assert torch.equal(g(), torch.full((n,), 0.5, dtype=dtype))
    assert bool((g.alpha > 0.5).all())  # a positive threshold, alpha within 4 ulps of the paper's
    a0 = torch.tensor(0.5 * (n + 1) / n, dtype=dtype).item()
    ulp = torch.finfo(dtype).eps / 2  # alpha is in [0.5, 1)
    assert abs(g.alpha[0].item() - a0) <= 4 * ulp


def test_convert_preserve_affine_false_and_zero_weights():
    torch.manual_seed(4)
    x = torch.randn(4, 3, 5, 5)
    bn = nn.BatchNorm2d(3, affine=False)
    for _ in range(3):
        bn(torch.randn(4, 3, 5, 5) * 2 + 1)
    model = nn.Sequential(bn).eval()
    ref = model(x)
    convert_to_sparse_batchnorm(model)  # y = x_hat: a = 1, b = 0
    torch.testing.assert_close(model[0].gates(), torch.ones(3))
    torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)
    # weights that are exactly 0: the solve counts only the non-zero ones
    bn = nn.BatchNorm2d(2)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 0.0]))
        bn.bias.zero_()
    model = nn.Sequential(bn).eval()
    ref = model(x[:, :2])
    convert_to_sparse_batchnorm(model)
    torch.testing.assert_close(model[0].gates(), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(model(x[:, :2]), ref, atol=1e-5, rtol=1e-5)
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 0.0, -2.0]))
        bn.bias.copy_(torch.tensor([0.1, 0.0, 0.3]))  # the w = 0 channel has no bias to lose
    model = nn.Sequential(bn).eval()
    ref = model(x)
    convert_to_sparse_batchnorm(model)
    torch.testing.assert_close(model[0].gates(), torch.tensor([1.0, 0.0, -2.0]))
    torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)


def test_convert_top_level_and_tied_batchnorms():
    torch.manual_seed(5)
    x = torch.randn(4, 3, 5, 5)
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        bn.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    bn(torch.randn(8, 3, 5, 5) * 2 + 1)
    bn.eval()
    ref = bn(x)
    new = convert_to_sparse_batchnorm(bn)  # a bare BatchNorm2d: its replacement comes back
    assert isinstance(new, SparseBatchNorm2d) and type(bn) is nn.BatchNorm2d and not new.training
    torch.testing.assert_close(new(x), ref, atol=1e-5, rtol=1e-5)
    assert convert_to_sparse_batchnorm(new) is new  # already converted
    # one BatchNorm2d under two names stays one module
    shared = nn.BatchNorm2d(3)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), shared, nn.ReLU(), nn.Conv2d(3, 3, 1), shared)
    out = convert_to_sparse_batchnorm(model, preserve=False)
    assert out is model and isinstance(model[1], SparseBatchNorm2d) and model[1] is model[4]
    assert sum(isinstance(m, SparseBatchNorm2d) for m in model.modules()) == 1


def test_regularisers_propagate_nan_and_stay_zero_safe():
    nan = float("nan")
    g = torch.tensor([nan, 3.0, 4.0])
    # as torch.linalg.vector_norm and l1_regularizer: a NaN gate is not read as 0
    assert torch.isnan(l1_regularizer(g))
    assert torch.isnan(group_l21_regularizer(g))
    assert torch.isnan(group_l21_regularizer(torch.tensor([0.0, 0.0, nan, 1.0]), group_size=2))
    assert torch.isnan(lp_regularizer(g, 0.5))
    assert torch.isnan(lp_regularizer([torch.ones(2), torch.tensor([nan])], 0.5))
    # exact zeros still give value and gradient 0
    z = torch.tensor([0.0, 0.0, 3.0, -4.0], requires_grad=True)
    (gr,) = torch.autograd.grad(group_l21_regularizer(z, 2) + lp_regularizer(z, 0.5)
                                + lp_regularizer(z[:2], 0.5), z)
    assert torch.isfinite(gr).all() and gr[0] == 0 and gr[1] == 0


def test_group_l21_default_groups_are_rows():
    # the default group is the last dimension: each row of a 2-D tensor is a group
    g = torch.tensor([[3.0, 4.0], [0.0, 0.0], [6.0, -8.0]])
    assert group_l21_regularizer(g).item() == 15.0
    torch.testing.assert_close(group_l21_regularizer(g), torch.linalg.vector_norm(g, dim=-1).sum())
    assert group_l21_regularizer(torch.tensor([3.0, 4.0])).item() == 5.0  # 1-D: one group
    assert group_l21_regularizer(torch.tensor(-2.0)).item() == 2.0  # 0-d: one gate
    # lp is different: each tensor, whatever its shape, is one group
    torch.testing.assert_close(lp_regularizer(g, 0.5), lp_regularizer(g.flatten(), 0.5))


def test_sparse_batchnorm_reset_parameters_resets_gate_shift_and_statistics():
    sbn = SparseBatchNorm2d(5)
    sbn(torch.randn(4, 5, 3, 3) * 3 + 1)
    with torch.no_grad():
        sbn.shift.normal_()
        sbn.gate.alpha.uniform_(-2, 2)
        sbn.gate.beta.fill_(1.0)
    sbn.reset_parameters()
    assert torch.equal(sbn.shift, torch.zeros(5))
    assert torch.equal(sbn.gates(), torch.full((5,), 0.5))
    assert torch.equal(sbn.running_mean, torch.zeros(5)) and torch.equal(sbn.running_var, torch.ones(5))
    assert sbn.num_batches_tracked.item() == 0


@pytest.mark.parametrize("device", devices())
def test_convert_stateless_batchnorm_takes_the_models_dtype_and_device(device):
    bn = nn.BatchNorm2d(3, affine=False, track_running_stats=False)  # holds no tensor
    model = nn.Sequential(nn.Conv2d(3, 3, 1), bn).to(device=device, dtype=torch.float64)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, device=device)
    ref = model(x)
    convert_to_sparse_batchnorm(model)
    sbn = model[1]
    assert isinstance(sbn, SparseBatchNorm2d)
    for t in (sbn.shift, sbn.gate.alpha, sbn.gate.beta):
        assert t.dtype == torch.float64 and t.device.type == device
    torch.testing.assert_close(model(x), ref)
    # nothing to follow: the defaults
    alone = convert_to_sparse_batchnorm(nn.BatchNorm2d(3, affine=False, track_running_stats=False))
    assert alone.shift.dtype == torch.get_default_dtype()


def test_remove_channels_restores_each_modules_training_flag():
    model = _sparse_cnn(0.5)
    model.train()
    model.features[1].eval()  # e.g. a BN kept in eval mode during fine-tuning
    model.classifier.eval()
    flags = [m.training for m in model.modules()]
    x = torch.rand(2, 1, 8, 8)
    small = remove_channels(model, example_input=x)
    assert [m.training for m in model.modules()] == flags
    assert not any(m.training for m in small.modules())
    with pytest.raises(RuntimeError):  # also when it raises
        remove_channels(model, example_input=torch.rand(2, 3, 8, 8))
    assert [m.training for m in model.modules()] == flags
