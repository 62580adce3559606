import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune

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


# --- audit fixes: tied weights, boundary gradients, ProM masks, atomic apply ---------------------

def _tied():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    m[1].weight = m[0].weight
    return m


def _structure(model):
    """What apply_probmask may change: parametrized layers and state dict entries."""
    return ([n for n, mod in model.named_modules() if parametrize.is_parametrized(mod)],
            {k: v if nn.parameter.is_lazy(v) else v.clone() for k, v in model.state_dict(keep_vars=True).items()})


def _same_structure(a, b):
    assert a[0] == b[0] and list(a[1]) == list(b[1])
    for k, v in a[1].items():
        w = b[1][k]
        assert w is v if nn.parameter.is_lazy(v) else torch.equal(v, w)


def test_tied_weights_share_one_mask():
    m = _tied()
    shared = m[0].weight
    masks = apply_probmask(m)
    assert [n for n, _ in masks] == ["0"]
    pm = masks[0][1]
    assert m[0].parametrizations.weight[0] is pm and m[1].parametrizations.weight[0] is pm
    assert m[0].parametrizations.weight.original is shared is m[1].parametrizations.weight.original
    scores = probmask_scores(m)
    assert len(scores) == 1 and sum(p.numel() for p in scores) == 16  # D counted once (was 32)
    with torch.no_grad():
        scores[0].copy_(torch.rand(4, 4, generator=torch.Generator().manual_seed(1)))
    m.eval()
    torch.testing.assert_close(m[0].weight, m[1].weight)  # both uses are masked alike
    set_temperature(m, 0.3)
    assert pm.tau == 0.3
    k = finalize_probmask(m, 0.5)
    assert k == 8 and probmask_density(m) == 0.5
    x = torch.rand(3, 4)
    out = m(x)
    remove_probmask(m)
    assert m[0].weight is m[1].weight is shared  # the tie is kept, the Parameter is the same object
    assert int((shared != 0).sum()) == 8  # baked once: density 0.5 (was 0.25)
    torch.testing.assert_close(m(x), out)


def test_tied_weights_copy_and_state_dict_keep_the_tie():
    m = _tied()
    apply_probmask(m)
    c = copy.deepcopy(m)
    assert c[0].parametrizations.weight[0] is c[1].parametrizations.weight[0]
    with torch.no_grad():
        probmask_scores(m)[0].copy_(torch.rand(4, 4))
    k = finalize_probmask(m, 0.25)
    c.load_state_dict(m.state_dict())
    assert probmask_density(c) == k / 16
    c.eval()
    m.eval()
    torch.testing.assert_close(c[1].weight, m[1].weight)


def test_tie_with_an_unmasked_use_is_an_error_and_changes_nothing():
    emb = nn.Embedding(5, 4)
    head = nn.Linear(4, 5, bias=False)
    head.weight = emb.weight  # the classic tie: embedding and output layer
    model = nn.Sequential(emb, head)
    before = _structure(model)
    with pytest.raises(ValueError, match=r"'1'.*'0\.weight'"):
        apply_probmask(model)  # the embedding (not in layer_types) would stay unmasked
    _same_structure(before, _structure(model))
    m = _tied()
    with pytest.raises(ValueError, match="tied"):
        apply_probmask(m, exclude=["1"])
    assert not parametrize.is_parametrized(m[0])
    assert [n for n, _ in apply_probmask(model, (nn.Linear, nn.Embedding))] == ["0"]  # all uses: fine
    assert model[0].parametrizations.weight[0] is model[1].parametrizations.weight[0]


def _plain_gumbel(theta, tau, hard, generator):
    """gumbel_sigmoid before the straight-through clamp (the oracle for interior scores)."""
    p = theta.clamp(1e-6, 1 - 1e-6)
    u = torch.rand(p.shape, dtype=p.dtype, generator=generator).clamp(1e-6, 1 - 1e-6)
    y = torch.sigmoid((torch.log(p) - torch.log1p(-p) + torch.log(u) - torch.log1p(-u)) / tau)
    return (y > 0.5).to(y.dtype) - y.detach() + y if hard else y


@pytest.mark.parametrize("hard", [False, True])
def test_scores_at_zero_and_one_get_a_gradient(hard):
    # float64: the sample never saturates at tau = 1, so every draw has a gradient
    theta = torch.tensor([0.0, 1.0], dtype=torch.float64, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        (grad,) = torch.autograd.grad(gumbel_sigmoid(theta, 1.0, hard, g).sum(), theta)
        assert bool(torch.isfinite(grad).all()) and bool((grad != 0).all()), grad  # was exactly 0
    # every dtype: finite (bfloat16/float16 used to give NaN at 1), and non-zero on average
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        theta = torch.tensor([0.0, 1.0], dtype=dtype, requires_grad=True)
        grads = torch.stack([torch.autograd.grad(gumbel_sigmoid(theta, 1.0, hard, g).sum(), theta)[0]
                             for _ in range(50)])
        assert bool(torch.isfinite(grads).all()) and bool((grads.abs().sum(0) > 0).all()), (dtype, grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hard", [False, True])
def test_interior_scores_are_unchanged_bit_for_bit(dtype, hard):
    theta = torch.tensor([1e-6, 1e-3, 0.3, 0.5, 0.77, 0.999, 1 - 1e-6], dtype=dtype, requires_grad=True)
    ref = theta.detach().clone().requires_grad_()
    y = gumbel_sigmoid(theta, 0.7, hard, torch.Generator().manual_seed(3))
    y_ref = _plain_gumbel(ref, 0.7, hard, torch.Generator().manual_seed(3))
    assert torch.equal(y, y_ref)
    (g,) = torch.autograd.grad((y * torch.arange(7.0, dtype=dtype)).sum(), theta)
    (g_ref,) = torch.autograd.grad((y_ref * torch.arange(7.0, dtype=dtype)).sum(), ref)
    assert torch.equal(g[1:-1], g_ref[1:-1])
    # a score without grad takes the plain path
    assert torch.equal(gumbel_sigmoid(theta.detach(), 0.7, hard, torch.Generator().manual_seed(3)), y.detach())


def test_scores_initialised_at_one_learn():
    model = _model()
    apply_probmask(model, init=1.0)  # every score at the boundary
    model(torch.rand(2, 1, 8, 8)).square().sum().backward()
    for p in probmask_scores(model):
        assert bool(torch.isfinite(p.grad).all())
        assert (p.grad != 0).float().mean() > 0.5  # was all zeros


def _prom_model():
    torch.manual_seed(0)
    return nn.Sequential(ProbMaskInput((8, 8)), nn.Flatten(), nn.Linear(64, 2))


def test_model_helpers_include_input_masks():
    model = _prom_model()
    prom = model[0].mask_module
    set_temperature(model, 0.1)
    assert prom.tau == 0.1  # was left at 1.0
    scores = probmask_scores(model)
    assert len(scores) == 1 and scores[0] is prom.scores  # no weight mask yet: only the input mask
    with torch.no_grad():
        prom.scores.copy_(torch.rand(8, 8))
    k = finalize_probmask(model, 0.25)  # used to raise "no ProbMask"
    assert k == 16 and int(prom.fixed.sum()) == 16 and probmask_density(model) == 0.25
    # weight and input masks together: one joint budget of exactly round(d * D) ones
    model = _prom_model()
    apply_probmask(model)
    assert [s.shape for s in probmask_scores(model)] == [(8, 8), (2, 64)]
    with torch.no_grad():
        for p in probmask_scores(model):
            p.copy_(torch.rand_like(p))
    k = finalize_probmask(model, 0.3)
    assert k == round(0.3 * 192)
    assert int(model[0].mask_module.fixed.sum()) + int(model[2].parametrizations.weight[0].fixed.sum()) == k
    assert probmask_density(model) == pytest.approx(k / 192)
    kept = int(model[2].parametrizations.weight[0].fixed.sum())
    remove_probmask(model)  # bakes the weight mask, keeps the input layer
    assert not parametrize.is_parametrized(model[2]) and int((model[2].weight != 0).sum()) == kept
    assert isinstance(model[0], ProbMaskInput) and int(model[0].mask_module.fixed.sum()) == k - kept
    # the layer alone is a model too: its own budget
    sampler = ProbMaskInput((4, 4))
    assert finalize_probmask(sampler, 0.5) == 8 and probmask_density(sampler) == 0.5


@pytest.mark.parametrize("make, match", [
    (lambda: nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(2)), "'1' is uninitialized"),
    (lambda: nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, affine=False)), "'1'.*no weight"),
    (lambda: nn.Sequential(nn.Linear(3, 3), torch.nn.utils.parametrizations.weight_norm(nn.Linear(3, 3))),
     "'1'.*already parametrized"),
    (lambda: nn.Sequential(nn.Linear(3, 3), prune.identity(nn.Linear(3, 3), "weight")),
     "'1'.*pre-hook"),
])
def test_apply_checks_every_layer_first(make, match):
    model = make()
    before = _structure(model)
    with pytest.raises(ValueError, match=match):
        apply_probmask(model, (nn.Linear, nn.BatchNorm1d))
    _same_structure(before, _structure(model))  # layer 0 used to be left parametrized


def test_apply_rolls_back_when_registering_fails(monkeypatch):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    weights = [model[0].weight, model[1].weight]
    register = parametrize.register_parametrization
    calls = []

    def failing(module, name, p, **kw):
        calls.append(module)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return register(module, name, p, **kw)

    monkeypatch.setattr(torch.nn.utils.parametrize, "register_parametrization", failing)
    with pytest.raises(RuntimeError, match="boom"):
        apply_probmask(model)
    assert not any(parametrize.is_parametrized(m) for m in model)
    assert model[0].weight is weights[0] and model[1].weight is weights[1]


def test_apply_twice_says_already_masked():
    model = _model()
    apply_probmask(model)
    with pytest.raises(ValueError, match="already masked"):
        apply_probmask(model)
    # a new layer of another type is still masked, the masked ones are skipped
    model = _model()
    apply_probmask(model, nn.Conv2d)
    assert [n for n, _ in apply_probmask(model)] == ["3"]
    with pytest.raises(TypeError, match="exclude"):
        apply_probmask(_model(), exclude="3")


def test_remove_refuses_other_parametrizations_before_changing_anything():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    apply_probmask(model)

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    parametrize.register_parametrization(model[1], "weight", Double())
    with pytest.raises(ValueError, match="'1'"):
        remove_probmask(model)
    assert all(parametrize.is_parametrized(m) for m in model)


def test_fix_accepts_binary_masks_only():
    pm = ProbMask((2, 2))
    for bad in (torch.tensor([[0.3, 1.0], [0.0, 1.0]]), torch.tensor([[float("nan"), 1.0], [0.0, 1.0]]),
                torch.tensor([[2, 1], [0, 1]])):
        with pytest.raises(ValueError, match="binary"):
            pm.fix(bad)  # 0.3 used to become True
        assert pm.fixed.numel() == 0
    with pytest.raises(TypeError, match="mask"):
        pm.fix(torch.ones(2, 2, dtype=torch.complex64))
    pm.fix(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    assert pm.fixed.tolist() == [[False, True], [True, False]]


def test_huge_numbers_are_value_errors():
    with pytest.raises(ValueError, match="init"):
        ProbMask((3,), init=10**400)
    with pytest.raises(ValueError, match="density"):
        finalize_probmask(_prom_model(), 10**400)
    with pytest.raises(TypeError, match="tau"):
        set_temperature(_prom_model(), "0.1")
