import copy

import pytest
import torch
from torch import nn

from prunopt.nn import (
    ProbMask,
    ProbMaskInput,
    apply_probmask,
    finalize_probmask,
    gumbel_sigmoid,
    probmask_density,
    probmask_scores,
    remove_probmask,
    set_temperature,
)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))


def test_gumbel_sigmoid_statistics_and_limits():
    theta = torch.full((20000,), 0.3)
    g = torch.Generator().manual_seed(0)
    hard = gumbel_sigmoid(theta, 0.5, hard=True, generator=g)
    # P(y > 0.5) = theta exactly for the logistic relaxation
    assert abs(hard.mean().item() - 0.3) < 0.02
    assert set(hard.unique().tolist()) <= {0.0, 1.0}
    soft = gumbel_sigmoid(theta, 1e-3, generator=g)
    assert ((soft < 1e-3) | (soft > 1 - 1e-3)).float().mean() > 0.95  # low temperature: near binary
    with pytest.raises(ValueError, match="tau"):
        gumbel_sigmoid(theta, 0.0)


def test_straight_through_gradient():
    theta = torch.full((5,), 0.5, requires_grad=True)
    y = gumbel_sigmoid(theta, 1.0, hard=True, generator=torch.Generator().manual_seed(1))
    y.sum().backward()
    assert theta.grad is not None and bool((theta.grad > 0).all())


def test_apply_train_eval_and_finalize_exact_count():
    model = _model()
    x = torch.rand(2, 1, 8, 8)
    ref = model(x)
    masks = apply_probmask(model, init=1.0)
    assert [n for n, _ in masks] == ["0", "3"]
    model.eval()  # scores 1 > 0.5: deterministic mask of ones
    torch.testing.assert_close(model(x), ref)
    # gradients reach the scores through the sampled mask
    model.train()
    model(x).sum().backward()
    assert all(p.grad is not None for p in probmask_scores(model))
    with torch.no_grad():
        for p in probmask_scores(model):
            p.copy_(torch.rand_like(p))
    total = sum(p.numel() for p in probmask_scores(model))
    k = finalize_probmask(model, 0.1)
    assert k == round(0.1 * total)
    assert probmask_density(model) == pytest.approx(k / total)
    # the fixed mask is used in train and eval alike, and equals the top-k scores
    model.train()
    a = model[0].weight
    model.eval()
    torch.testing.assert_close(model[0].weight, a)
    nnz = sum(int((model[i].weight != 0).sum()) for i in (0, 3))
    assert nnz == k


def test_finalize_ties_give_exact_count():
    model = _model()
    apply_probmask(model, init=0.5)  # every score tied
    total = sum(p.numel() for p in probmask_scores(model))
    k = finalize_probmask(model, 0.37)
    assert k == round(0.37 * total) and probmask_density(model) == pytest.approx(k / total)


def test_remove_leaves_plain_model_and_deepcopy_state_dict():
    model = _model()
    apply_probmask(model)
    set_temperature(model, 0.2)
    clone = copy.deepcopy(model)
    clone.load_state_dict(model.state_dict())
    finalize_probmask(model, 0.5)
    x = torch.rand(3, 1, 8, 8)
    model.eval()
    out = model(x)
    remove_probmask(model)
    assert not any("parametrizations" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(model(x), out)
    assert abs(float((model[3].weight != 0).float().mean()) - 0.5) < 0.1


def test_input_mask_prom():
    m = ProbMaskInput((8, 8), init=0.7, hard=True)
    x = torch.rand(4, 2, 8, 8)
    y = m(x)
    assert y.shape == x.shape
    assert set(torch.unique(y / x).round(decimals=4).tolist()) <= {0.0, 1.0}
    y.sum().backward()
    assert m.scores.grad is not None
    with pytest.raises(ValueError, match="trailing"):
        m(torch.rand(2, 7, 7))


def test_errors():
    with pytest.raises(ValueError, match="init"):
        ProbMask((3,), init=1.5)
    with pytest.raises(ValueError, match="exclude"):
        apply_probmask(_model(), exclude=["nope"])
    with pytest.raises(ValueError, match="no layer"):
        apply_probmask(nn.ReLU())
    for bad in (0.5, (), (nn.Linear, "Conv2d")):
        with pytest.raises(TypeError, match="layer_types"):
            apply_probmask(_model(), bad)
    assert [n for n, _ in apply_probmask(_model(), nn.Linear)]  # one class is accepted as well
    with pytest.raises(ValueError, match="density"):
        finalize_probmask(_model(), 1.2)


def test_compiled_forward():
    model = _model()
    apply_probmask(model)
    model.eval()
    x = torch.rand(2, 1, 8, 8)
    compiled = torch.compile(model)
    torch.testing.assert_close(compiled(x), model(x))


def test_state_dict_round_trips_between_fixed_and_unfixed_masks():
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 3))
        apply_probmask(m)
        with torch.no_grad():
            for p in probmask_scores(m):
                p.copy_(torch.rand_like(p))
        return m

    fixed = make()
    k = finalize_probmask(fixed, 0.3)
    fresh = make()
    fresh.load_state_dict(fixed.state_dict())  # fixed -> fresh: takes the fixed mask
    pm = fresh[0].parametrizations.weight[0]
    assert pm.fixed.shape == (3, 4) and int(pm.fixed.sum()) == k
    assert probmask_density(fresh) == pytest.approx(k / 12)
    fresh.train()
    torch.testing.assert_close(fresh[0].weight, fixed[0].weight)
    # fresh -> fixed: the mask is no longer fixed, as in the saved model
    fixed.load_state_dict(make().state_dict())
    assert fixed[0].parametrizations.weight[0].fixed.numel() == 0
    # a fixed mask of the wrong shape is still a size-mismatch error
    sd = make().state_dict()
    sd["0.parametrizations.weight.0.fixed"] = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="size mismatch"):
        make().load_state_dict(sd)
    # ProM (ProbMaskInput) as well
    a, b = ProbMaskInput((2, 3)), ProbMaskInput((2, 3))
    a.mask_module.fix(torch.tensor([[1, 0, 1], [0, 0, 1]], dtype=torch.bool))
    b.load_state_dict(a.state_dict())
    b.eval()
    torch.testing.assert_close(b(torch.ones(2, 3)), torch.tensor([[1.0, 0, 1], [0, 0, 1]]))


def test_argument_types_are_named():
    import numpy as np

    for kwargs, name in [(dict(init="0.5"), "init"), (dict(tau="1"), "tau"), (dict(init=True), "init"),
                         (dict(tau=None), "tau")]:
        with pytest.raises(TypeError, match=name):
            ProbMask((3,), **kwargs)
    with pytest.raises(TypeError, match="tau"):
        gumbel_sigmoid(torch.rand(3), "0.5")
    with pytest.raises(TypeError, match="theta"):
        gumbel_sigmoid([0.5, 0.5], 1.0)
    model = _model()
    apply_probmask(model)
    with pytest.raises(TypeError, match="density"):
        finalize_probmask(model, "0.5")
    with pytest.raises(TypeError, match="mask"):
        probmask_modules_first = next(m for m in model.modules() if isinstance(m, ProbMask))
        probmask_modules_first.fix([1, 0])
    # numpy and 0-dim tensor numbers are numbers
    pm = ProbMask((3,), init=np.float32(0.25), tau=torch.tensor(2.0))
    assert pm.tau == 2.0 and torch.equal(pm.scores.detach(), torch.full((3,), 0.25))
    assert finalize_probmask(model, np.float64(0.5)) > 0
