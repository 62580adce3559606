"""Pruning scores (App. F) against independently computed values."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunopt.pruning import (
    Masker,
    grasp_scores,
    magnitude_scores,
    random_scores,
    remove_masks,
    snip_scores,
    synflow_scores,
)

from _pruning_helpers import TinyNet, batch, random_masks


def _plain_params(model):
    return [model.conv1.weight, model.conv2.weight, model.fc.weight]


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [m.training for m in model.modules()]


def _assert_unchanged(model, snap):
    sd, modes = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert [m.training for m in model.modules()] == modes


def test_snip_is_abs_grad_times_weight():
    torch.manual_seed(0)
    model = TinyNet().eval()  # SNIP must switch BN to train mode itself
    ref = copy.deepcopy(model).train()
    masker = Masker(model)
    b1, b2 = batch(seed=1), batch(seed=2)
    snap = _snapshot(model)
    s = snip_scores(masker, [b1, b2])
    _assert_unchanged(model, snap)
    gs = [torch.zeros_like(p) for p in _plain_params(ref)]
    for x, y in (b1, b2):
        for acc, g in zip(gs, torch.autograd.grad(F.cross_entropy(ref(x), y), _plain_params(ref))):
            acc += g / 2
    for (n, v), g, w in zip(s.items(), gs, _plain_params(ref)):
        torch.testing.assert_close(v, (g * w).abs())


def test_snip_scores_pruned_entries_zero():
    model = TinyNet()
    masker = Masker(model)
    masker.set_masks(random_masks(masker, 0.5))
    s = snip_scores(masker, batch())
    for n, m in masker.masks().items():
        assert torch.equal(s[n][~m], torch.zeros(int((~m).sum())))


def test_grasp_against_explicit_hessian():
    torch.manual_seed(0)
    model = TinyNet(c=2, classes=3).double()
    ref = copy.deepcopy(model).train()
    masker = Masker(model)
    batches = [batch(n=6, size=4, classes=3, seed=s, dtype=torch.float64) for s in (3, 4)]
    snap = _snapshot(model)
    s = grasp_scores(masker, batches)
    _assert_unchanged(model, snap)

    names = ["conv1.weight", "conv2.weight", "fc.weight"]
    shapes = [ref.get_parameter(n).shape for n in names]
    sizes = [p.numel() for p in shapes]
    flat0 = torch.cat([ref.get_parameter(n).detach().reshape(-1) for n in names])
    others = {k: v.detach() for k, v in ref.named_parameters() if k not in names}
    buffers = {k: v.clone() for k, v in ref.named_buffers()}

    def loss(flat):
        params = dict(others)
        for n, chunk, shp in zip(names, flat.split(sizes), shapes):
            params[n] = chunk.reshape(shp)
        total = 0
        for x, y in batches:
            out = torch.func.functional_call(ref, {**params, **{k: v.clone() for k, v in buffers.items()}}, (x,))
            total = total + F.cross_entropy(out, y)
        return total / len(batches)

    g = torch.autograd.functional.jacobian(loss, flat0)
    H = torch.autograd.functional.hessian(loss, flat0)
    assert H.shape == (flat0.numel(), flat0.numel())
    expected = -(H @ g) * flat0
    got = torch.cat([s[n].reshape(-1) for n in names])
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_synflow_equals_path_norm_gradient_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5, bias=False), nn.ReLU(), nn.Linear(5, 3, bias=False)).double()
    W1, W2 = model[0].weight.detach().clone(), model[2].weight.detach().clone()
    masker = Masker(model)
    snap = _snapshot(model)
    s = synflow_scores(masker, (4,))
    _assert_unchanged(model, snap)
    # R = 1^T |W2| |W1| 1: dR/d|W1|_ij = (1^T |W2|)_i, dR/d|W2|_ki = (|W1| 1)_i
    s1 = W2.abs().sum(0)[:, None] * W1.abs()
    s2 = W2.abs() * W1.abs().sum(1)[None, :]
    torch.testing.assert_close(s["0.weight"], s1, rtol=1e-12, atol=0)
    torch.testing.assert_close(s["2.weight"], s2, rtol=1e-12, atol=0)


def test_synflow_conv_bn_eval_and_restores_weights():
    torch.manual_seed(0)
    model = TinyNet().double().train()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
        model.bn.weight.uniform_(-1, 1)
    masker = Masker(model)
    masker.set_masks(random_masks(masker, 0.7))
    snap = _snapshot(model)
    s = synflow_scores(masker, torch.zeros(5, 1, 6, 6, dtype=torch.float64))
    _assert_unchanged(model, snap)
    assert model.training
    # independent: the path-norm network written out with |theta|, BN in eval mode
    ref = copy.deepcopy(model)
    remove_masks(ref)
    ws = [ref.conv1.weight, ref.conv2.weight, ref.fc.weight]
    a = [w.detach().abs().requires_grad_() for w in ws]
    bn = ref.bn
    x = torch.ones(1, 1, 6, 6, dtype=torch.float64)
    h = F.conv2d(x, a[0], padding=1)
    h = (h - bn.running_mean.abs()[None, :, None, None]) / torch.sqrt(bn.running_var.abs() + bn.eps)[None, :, None, None]
    h = h * bn.weight.abs()[None, :, None, None] + bn.bias.abs()[None, :, None, None]
    h = torch.relu(torch.relu(h))
    h = torch.relu(F.conv2d(h, a[1], ref.conv2.bias.abs(), padding=1))
    R = F.linear(h.mean((2, 3)), a[2], ref.fc.bias.abs()).sum()
    grads = torch.autograd.grad(R, a)
    for n, g, w in zip(["conv1.weight", "conv2.weight", "fc.weight"], grads, a):
        torch.testing.assert_close(s[n], g * w.detach(), rtol=1e-10, atol=1e-12)
        assert bool((s[n] >= 0).all())


def test_magnitude_and_random():
    model = TinyNet()
    masker = Masker(model)
    masker.set_masks(random_masks(masker, 0.5))
    mag = magnitude_scores(masker)
    for n, pt in masker.tensors.items():
        torch.testing.assert_close(mag[n], (pt.parameter * pt.mask).abs().detach(), rtol=0, atol=0)
    r1 = random_scores(masker, torch.Generator().manual_seed(3))
    r2 = random_scores(model, torch.Generator().manual_seed(3))
    for n in r1:
        assert torch.equal(r1[n], r2[n]) and r1[n].shape == masker[n].parameter.shape
    allr = torch.cat([random_scores(nn.Linear(300, 300), torch.Generator().manual_seed(0))["weight"].reshape(-1)])
    assert abs(float(allr.mean())) < 0.02 and abs(float(allr.std()) - 1) < 0.02


def test_score_argument_errors():
    model = TinyNet()
    with pytest.raises(ValueError, match="batches"):
        snip_scores(model, [])
    with pytest.raises(TypeError, match="target"):
        magnitude_scores("model")
    with pytest.raises(ValueError, match="temperature"):
        grasp_scores(model, batch(), temperature=0)
    with pytest.raises(TypeError, match="example_input"):
        synflow_scores(model, "3x32x32")


def test_synflow_takes_integer_inputs_and_names_an_input_the_model_cannot_take():
    # a language model's example input is token ids: the all-ones input is token 1 everywhere
    emb = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
    scores = synflow_scores(emb, torch.tensor([[3, 4, 5]]))
    assert set(scores) == {"1.weight"} and all(torch.isfinite(s).all() for s in scores.values())
    assert bool((scores["1.weight"] > 0).all())  # every path from token 1 reaches the outputs
    before = {n: p.detach().clone() for n, p in emb.named_parameters()}
    # a conv model cannot take a token batch: a RuntimeError naming example_input, parameters restored
    model = TinyNet()
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="example_input"):
        synflow_scores(model, torch.ones(2, 5, dtype=torch.long))
    assert all(torch.equal(saved[n], p) for n, p in model.named_parameters())
    assert all(torch.equal(before[n], p) for n, p in emb.named_parameters())


@pytest.mark.parametrize("score", ["snip", "grasp", "synflow"])
def test_gradient_scores_work_under_no_grad(score):
    torch.manual_seed(0)
    model = TinyNet()
    masker = Masker(model)
    masker.set_masks(random_masks(masker, 0.6))
    b = [batch(seed=1)]
    fn = {"snip": lambda: snip_scores(masker, b), "grasp": lambda: grasp_scores(masker, b),
          "synflow": lambda: synflow_scores(masker, b[0][0])}[score]
    expected = fn()
    with torch.no_grad():
        got = fn()
        assert not torch.is_grad_enabled()  # the mode is restored
    assert list(got) == list(expected)
    for n, s in got.items():
        assert not s.requires_grad
        torch.testing.assert_close(s, expected[n], rtol=0, atol=0)
    assert any(bool((s != 0).any()) for s in got.values())


def test_scores_of_a_plain_model_count_tied_weights_once():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    assert list(magnitude_scores(model)) == ["0.weight"]
    x, y = torch.randn(6, 4), torch.randint(0, 4, (6,))
    s = snip_scores(model, (x, y))
    g = torch.autograd.grad(F.cross_entropy(model(x), y), [model[0].weight])[0]  # both uses
    torch.testing.assert_close(s["0.weight"], (g * model[0].weight).abs())
