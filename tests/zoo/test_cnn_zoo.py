"""prunopt on transformers' image models (random weights, small configs):
ResNet (basic and bottleneck blocks) and MobileNetV2 (depthwise convolutions,
stride 2, inverted residuals, TF-style padding). Each check compares with an
independent result: the original model, a hand-built reference or torch's own
modules."""
import copy
import math

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from _zoo import CNNS, cnn, labels, logits  # noqa: E402
from prunopt.nn import (  # noqa: E402
    FBConv2d,
    SparseBatchNorm2d,
    TwoTemperatureMask,
    convert_to_sparse_batchnorm,
    l1_regularizer,
    remove_channels,
    sparse_gates,
    to_interspace,
    two_temperature_masks,
    wrap_two_temperature_masks,
)
from prunopt.ops import interspace as ops_interspace  # noqa: E402
from prunopt.pruning import (  # noqa: E402
    DynamicSparseTraining,
    FineTuning,
    GradualMagnitudePruning,
    LotteryTicket,
    Masker,
    PruningAtInit,
)


def _close(a, b, tol=1e-5):
    a, b = a.detach(), b.detach()
    torch.testing.assert_close(a, b, atol=tol * (1 + float(b.abs().max())), rtol=tol)


def _fb_layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FBConv2d)]


@pytest.mark.parametrize("kind", CNNS)
def test_to_interspace_is_exact_trains_like_the_conv_model_and_runs_sparse_eval(kind, monkeypatch):
    model, x = cnn(kind)
    ref = logits(model(x))
    fb = to_interspace(copy.deepcopy(model))  # standard basis: lam = phi exactly
    layers = _fb_layers(fb)
    assert layers and any(m.groups > 1 for _, m in layers) == (kind == "mobilenet_v2")
    _close(logits(fb(x)), ref)

    # one training step: with the standard basis held fixed, d lam = d phi, so SGD moves the
    # coefficients exactly as it moves the conv weights (and BatchNorm updates its statistics alike)
    conv_model = copy.deepcopy(model).train()
    fb.train()
    y = labels()
    opt_c = torch.optim.SGD(conv_model.parameters(), lr=0.1, momentum=0.9)
    opt_f = torch.optim.SGD([p for n, p in fb.named_parameters() if not n.endswith("basis.weight")], lr=0.1,
                            momentum=0.9)
    for m, opt in ((conv_model, opt_c), (fb, opt_f)):
        F.cross_entropy(logits(m(x)), y).backward()
        opt.step()
    convs = dict(conv_model.named_modules())
    for name, layer in layers:
        _close(layer.coefficients.detach().reshape(convs[name].weight.shape), convs[name].weight.detach())
    conv_model.eval()
    fb.eval()
    _close(logits(fb(x)), logits(conv_model(x)))

    # sparse eval (eq. 8 on the cached CSR of lam * mu) against the equivalent conv model
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, layer in layers:
            layer.mask.copy_((torch.rand(layer.mask.shape, generator=g) > 0.9).float())
    dense = copy.deepcopy(fb)
    for name, layer in _fb_layers(dense):
        parent, _, attr = name.rpartition(".")
        setattr(dense.get_submodule(parent), attr, layer.to_conv2d())
    monkeypatch.setattr(ops_interspace, "sparse_is_faster", lambda *a, **k: True)
    with torch.no_grad():
        out = logits(fb(x))
        assert all(layer._compressed is not None for _, layer in layers)  # the CSR cache was used
        _close(out, logits(dense(x)))


def _global_topk(scores, keep):
    flat = torch.cat([s.reshape(-1) for s in scores.values()])
    thresh = flat.topk(keep).values.min()
    return {n: s >= thresh for n, s in scores.items()}


def _check_masked(model, masker, target=None):
    """Pruned entries are 0 and the masks act on the HF forward: the model
    equals a copy with the masks multiplied into plain weights by hand."""
    masks = masker.masks()
    for n, pt in masker.tensors.items():
        assert not pt.parameter[~masks[n]].any()
    if target is not None:
        total = sum(m.numel() for m in masks.values())
        assert masker.sparsity() == pytest.approx(target, abs=1.5 / total)


PAI = ("random", "magnitude", "snip", "grasp", "synflow")


@pytest.mark.parametrize("kind", CNNS)
def test_every_pruning_method_on_the_image_models(kind):
    model, x = cnn(kind)
    y = labels()
    for score in PAI:
        m = copy.deepcopy(model)
        fresh = copy.deepcopy(model)
        masker = Masker(m)
        PruningAtInit(masker, score, 0.8, synflow_rounds=2, generator=torch.Generator().manual_seed(0)).prune(
            batches=[(x, y)], example_input=x)
        _check_masked(m, masker, 0.8)
        masks = masker.masks()
        with torch.no_grad():  # the same masks multiplied into the weights of an unmasked copy
            for n, mask in masks.items():
                fresh.get_submodule(n.rsplit(".", 1)[0]).weight.mul_(mask)
        _close(logits(m(x)), logits(fresh(x)))
        kept = int(sum(mk.sum() for mk in masks.values()))
        if score == "magnitude":  # the kept entries are the largest |w| over the whole model
            w = {n: pt.parameter.detach().abs() for n, pt in Masker(copy.deepcopy(model)).tensors.items()}
            want = _global_topk(w, kept)
            assert all(torch.equal(masks[n], want[n]) for n in masks)
        if score == "snip":  # |g w| with the gradient of the training-mode loss, computed here by hand
            ref = copy.deepcopy(model).train()
            params = {n: ref.get_submodule(n.rsplit(".", 1)[0]).weight for n in masks}
            grads = torch.autograd.grad(F.cross_entropy(logits(ref(x)), y), list(params.values()))
            s = {n: (g * p).abs().detach() for (n, p), g in zip(params.items(), grads)}
            want = _global_topk(s, kept)
            assert all(torch.equal(masks[n], want[n]) for n in masks)

    # methods that train: a step keeps pruned weights and their optimizer state at zero
    def step(m, opt, method, closure=None):
        opt.zero_grad()
        F.cross_entropy(logits(m(x)), y).backward()
        opt.step()
        method.step(closure) if closure is not None else method.step()

    m = copy.deepcopy(model).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    masker = Masker(m, opt)
    lt = LotteryTicket(masker, opt, sparsity=0.5, rate=0.2)
    t0 = {n: pt.parameter.detach().clone() for n, pt in masker.tensors.items()}
    step(m, opt, lt)
    assert lt.prune_and_rewind() == pytest.approx(0.2, abs=1e-3)
    masks = masker.masks()
    for n, pt in masker.tensors.items():  # rewound to t0, with the new masks
        torch.testing.assert_close(pt.parameter.detach(), t0[n] * masks[n])
    step(m, opt, lt)
    _check_masked(m, masker)

    for mode in ("set", "rigl"):
        m = copy.deepcopy(model).train()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        masker = Masker(m, opt)
        dst = DynamicSparseTraining(masker, 0.8, total_steps=10, mode=mode, update_interval=1,
                                    generator=torch.Generator().manual_seed(0))
        before = masker.masks()
        step(m, opt, dst, (lambda: F.cross_entropy(logits(m(x)), y)) if mode == "rigl" else None)
        after = masker.masks()
        assert dst.updates == 1 and any(not torch.equal(before[n], after[n]) for n in after)
        assert masker.counts() == dst.layer_counts  # every layer keeps its ERK count
        _check_masked(m, masker)
        assert all(not opt.state[pt.parameter]["momentum_buffer"][~after[n]].any()
                   for n, pt in masker.tensors.items())

    m = copy.deepcopy(model).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    masker = Masker(m, opt)
    gmp = GradualMagnitudePruning(masker, 0.8, t0=0, t1=2, interval=1)
    for _ in range(2):
        step(m, opt, gmp)
    _check_masked(m, masker, 0.8)

    m = copy.deepcopy(model)
    masker = Masker(m)
    FineTuning(masker, 0.8).prune()
    _check_masked(m, masker, 0.8)


@pytest.mark.parametrize("kind", CNNS)
def test_two_temperature_masks_on_the_image_models(kind):
    model, x = cnn(kind)
    wrapped = wrap_two_temperature_masks(copy.deepcopy(model), generator=torch.Generator().manual_seed(0))
    masks = two_temperature_masks(wrapped)
    assert masks and all(isinstance(m, TwoTemperatureMask) for m in masks)
    # reference: the original model with each weight multiplied by sigmoid(t_l w) by hand
    ref = copy.deepcopy(model)
    wrapped_names = [n for n, m in wrapped.named_modules() if isinstance(m, TwoTemperatureMask)]
    with torch.no_grad():
        for n in wrapped_names:
            ttm = wrapped.get_submodule(n)
            ref.get_submodule(n).weight.mul_(torch.sigmoid(ttm.t_l * ttm.w))
    _close(logits(wrapped(x)), logits(ref(x)))
    F.cross_entropy(logits(wrapped(x)), labels()).backward()  # (eval mode: BatchNorm statistics stay as in ref)
    assert all(m.w.grad is not None and torch.isfinite(m.w.grad).all() for m in masks)
    for m in masks:
        with torch.no_grad():
            m.w.sub_(0.005)  # some logits cross 0
        m.freeze()
    with torch.no_grad():
        for n in wrapped_names:
            ttm = wrapped.get_submodule(n)
            ref.get_submodule(n).weight.copy_(model.get_submodule(n).weight * (ttm.w > 0))
    _close(logits(wrapped(x)), logits(ref(x)))


@pytest.mark.parametrize("kind", CNNS)
def test_sparse_batchnorm_training_and_channel_removal(kind):
    model, x = cnn(kind)
    ref = logits(model(x))
    sbn = convert_to_sparse_batchnorm(copy.deepcopy(model))  # preserve=True: same function
    bns = [m for m in sbn.modules() if isinstance(m, SparseBatchNorm2d)]
    assert len(bns) == sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    _close(logits(sbn(x)), ref)
    sbn.train()
    opt = torch.optim.SGD(sbn.parameters(), lr=0.05)
    loss = F.cross_entropy(logits(sbn(x)), labels()) + 1e-3 * l1_regularizer(sparse_gates(sbn))
    loss.backward()
    assert all(b.gate.alpha.grad is not None for b in bns)
    opt.step()
    # drop channels as a long enough run with the gate regulariser would: exact zero gates
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in bns:
            b.gate.alpha[torch.rand(b.num_features, generator=g) < 0.4] = 0.0
    sbn.eval()
    small = remove_channels(sbn, example_input=x)
    assert not any(isinstance(m, SparseBatchNorm2d) for m in small.modules())
    n_small, n_big = sum(p.numel() for p in small.parameters()), sum(p.numel() for p in model.parameters())
    assert n_small < 0.9 * n_big
    shrunk = [n for n, m in small.named_modules()
              if isinstance(m, nn.Conv2d) and m.out_channels < model.get_submodule(n).out_channels]
    assert shrunk
    _close(logits(small(x)), logits(sbn(x)))
    if kind == "mobilenet_v2":  # depthwise layers keep groups == channels
        dw = [m for m in small.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
        assert dw and all(m.groups == m.in_channels == m.out_channels for m in dw)
        assert any(m.groups < model.get_submodule(n).groups for n, m in small.named_modules() if m in dw)
    assert math.isfinite(float(logits(small(x)).detach().sum()))
