"""Masks from torch.nn.utils.prune and torch.ao.pruning into a Masker, and back."""
import pytest
import torch
import torch.nn.utils.prune as prune
from torch import nn
from torch.nn.utils import parametrize

from prunopt.nn import FBConv2d
from prunopt.pruning import Masker, WeightMask, from_ao_sparsifier, from_torch_prune, to_torch_prune


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def _net(seed=0):
    torch.manual_seed(seed)
    return Net(), torch.randn(5, 2, 4, 4)


def _has_prune_hook(m):
    return any(isinstance(h, prune.BasePruningMethod) for h in m._forward_pre_hooks.values())


def test_from_torch_prune_takes_over_masks_and_keeps_the_function():
    model, x = _net()
    prune.l1_unstructured(model.conv, "weight", amount=0.5)
    prune.random_unstructured(model.conv, "weight", amount=0.3)  # a PruningContainer: the product of both
    prune.global_unstructured([(model.fc1, "weight"), (model.fc2, "weight")], prune.L1Unstructured, amount=0.7)
    expected = {"conv.weight": model.conv.weight_mask.bool(), "fc1.weight": model.fc1.weight_mask.bool(),
                "fc2.weight": model.fc2.weight_mask.bool()}
    orig = model.fc1.weight_orig
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built on the pruned model
    ref = model(x)
    masker = from_torch_prune(model, opt)
    assert not any(_has_prune_hook(m) for m in model.modules())
    assert not any(n.endswith(("_orig", "_mask")) for n, _ in list(model.named_parameters()) + list(model.named_buffers()))
    for name, mask in masker.masks().items():
        assert torch.equal(mask, expected[name])
    assert masker["fc1.weight"].parameter is orig  # the same Parameter: the optimizer still updates it
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
    # training keeps the pruned entries (and their momentum) at zero
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        masker.step()
    for name, pt in masker.tensors.items():
        assert not pt.parameter[~expected[name]].any()
        assert not opt.state[pt.parameter]["momentum_buffer"][~expected[name]].any()


def test_from_torch_prune_respects_exclude_and_combines_with_fb_masks():
    model, x = _net(1)
    prune.l1_unstructured(model.conv, "weight", amount=0.5)
    prune.l1_unstructured(model.fc2, "weight", amount=0.5)
    masker = from_torch_prune(model, exclude=["fc2"])
    assert _has_prune_hook(model.fc2) and not _has_prune_hook(model.conv)  # fc2 stays with torch's pruning
    assert masker.names() == ["conv.weight", "fc1.weight"]
    assert masker.counts()["fc1.weight"] == model.fc1.weight.numel()  # an unpruned layer: all ones

    fb = FBConv2d(2, 3, 3)
    with torch.no_grad():
        fb.mask.bernoulli_(0.5)
    fb_mask = fb.mask.bool().clone()
    prune.random_unstructured(fb, "coefficients", amount=0.5)
    torch_mask = fb.coefficients_mask.bool().clone()
    xi = torch.randn(2, 2, 5, 5)
    ref = fb(xi)
    masker = from_torch_prune(fb)
    assert torch.equal(masker.masks()["coefficients"], fb_mask & torch_mask)
    torch.testing.assert_close(fb(xi), ref)


def test_from_torch_prune_rejects_tensors_a_masker_cannot_hold_before_changing_anything():
    model, _ = _net()
    prune.l1_unstructured(model.conv, "weight", amount=0.5)
    prune.l1_unstructured(model.fc1, "bias", amount=0.5)
    with pytest.raises(ValueError, match="fc1.bias"):
        from_torch_prune(model)
    assert _has_prune_hook(model.conv) and hasattr(model.conv, "weight_orig")  # untouched
    with pytest.raises(TypeError, match="model"):
        from_torch_prune("not a model")


def test_to_torch_prune_round_trip():
    model, x = _net(2)
    masker = Masker(model)
    g = torch.Generator().manual_seed(0)
    masks = {n: torch.rand(pt.parameter.shape, generator=g) < 0.4 for n, pt in masker.tensors.items()}
    masker.set_masks(masks)
    ref = model(x)
    weights = {n: pt.parameter for n, pt in masker.tensors.items()}
    out = to_torch_prune(masker)
    assert out is model
    assert not any(isinstance(m, WeightMask) for m in model.modules())
    for name, mask in masks.items():
        layer = model.get_submodule(name.rsplit(".", 1)[0])
        assert _has_prune_hook(layer) and not parametrize.is_parametrized(layer)
        assert torch.equal(layer.weight_mask, mask.float())
        assert layer.weight_orig is weights[name]
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
    back = from_torch_prune(model)  # and into a masker again
    for name, mask in back.masks().items():
        assert torch.equal(mask, masks[name])
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)


def test_to_torch_prune_rejects_fb_coefficients():
    model = nn.Sequential(FBConv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4, 2))
    masker = Masker(model)
    with pytest.raises(ValueError, match="0.coefficients"):
        to_torch_prune(masker)
    assert parametrize.is_parametrized(model[2])  # nothing changed
    with pytest.raises(TypeError, match="masker"):
        to_torch_prune(model)


def test_from_ao_sparsifier():
    from torch.ao.pruning import WeightNormSparsifier

    model, x = _net(3)
    sparsifier = WeightNormSparsifier(sparsity_level=0.5, sparse_block_shape=(1, 4), zeros_per_block=4)
    sparsifier.prepare(model, config=[{"tensor_fqn": "fc1.weight"}, {"tensor_fqn": "fc2.weight"}])
    sparsifier.step()
    expected = {n: model.get_submodule(n).parametrizations.weight[0].mask.bool().clone() for n in ("fc1", "fc2")}
    assert all(0 < m.float().mean() < 1 for m in expected.values())
    original = model.fc1.parametrizations.weight.original
    ref = model(x)
    masker = from_ao_sparsifier(sparsifier)  # the sparsifier or its model
    assert masker["fc1.weight"].parameter is original
    for n in ("fc1", "fc2"):
        assert torch.equal(masker.masks()[f"{n}.weight"], expected[n])
        assert [type(p) for p in model.get_submodule(n).parametrizations.weight] == [WeightMask]
    assert masker.counts()["conv.weight"] == model.conv.weight.numel()
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)

    # another parametrization beside FakeSparsity is an error naming the tensor, nothing changed
    model, _ = _net(4)
    sparsifier = WeightNormSparsifier(sparsity_level=0.5, sparse_block_shape=(1, 4), zeros_per_block=4)
    sparsifier.prepare(model, config=[{"tensor_fqn": "fc1.weight"}])
    parametrize.register_parametrization(model.fc1, "weight", nn.Identity())
    with pytest.raises(ValueError, match="fc1.weight"):
        from_ao_sparsifier(model)
    assert len(model.fc1.parametrizations.weight) == 2


def _pruned_checkpoint():
    """A state dict saved from a model pruned with torch.nn.utils.prune (fc1
    pruned twice: its mask is the product), and the pruned model's outputs."""
    model, x = _net(1)
    prune.l1_unstructured(model.fc1, "weight", amount=0.5)
    prune.random_unstructured(model.fc1, "weight", amount=0.3)
    prune.ln_structured(model.conv, "weight", amount=0.5, n=2, dim=0)
    with torch.no_grad():
        y = model(x)
    return model.state_dict(), x, y


def test_from_torch_prune_loads_a_pruned_checkpoint_into_a_fresh_model():
    sd, x, y = _pruned_checkpoint()
    assert {"fc1.weight_orig", "fc1.weight_mask", "conv.weight_mask"} <= set(sd)
    fresh, _ = _net(2)  # other weights: they come from the checkpoint
    fc1_param = fresh.fc1.weight
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    masker = from_torch_prune(fresh, opt, state_dict=sd)
    masks = masker.masks()
    assert torch.equal(masks["fc1.weight"], sd["fc1.weight_mask"].bool())
    assert torch.equal(masks["conv.weight"], sd["conv.weight_mask"].bool())
    assert masks["fc2.weight"].all()  # not pruned in the checkpoint
    assert not any(_has_prune_hook(m) for m in fresh.modules())
    assert fresh.fc1.parametrizations.weight.original is fc1_param  # the optimizer's Parameter
    torch.testing.assert_close(fresh.fc1.weight, sd["fc1.weight_orig"] * sd["fc1.weight_mask"])
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), y)
    # the masks hold through training, on the parameters and the momentum
    for _ in range(2):
        opt.zero_grad()
        fresh(x).square().sum().backward()
        opt.step()
        masker.step()
    assert not fresh.fc1.parametrizations.weight.original[~masks["fc1.weight"]].any()
    assert not opt.state[fc1_param]["momentum_buffer"][~masks["fc1.weight"]].any()


def test_from_torch_prune_checkpoint_into_an_already_pruned_model():
    sd, x, y = _pruned_checkpoint()
    model, _ = _net(3)
    prune.l1_unstructured(model.fc1, "weight", amount=0.9)  # its own hook: the checkpoint's mask replaces its mask
    masker = from_torch_prune(model, state_dict=sd)
    assert torch.equal(masker.masks()["fc1.weight"], sd["fc1.weight_mask"].bool())
    with torch.no_grad():
        torch.testing.assert_close(model(x), y)


@pytest.mark.parametrize("bad", ["no module", "no parameter", "bias", "shape"])
def test_from_torch_prune_checkpoint_errors_leave_the_model_unchanged(bad):
    sd, _, _ = _pruned_checkpoint()
    if bad == "no module":
        sd["head.weight_orig"], sd["head.weight_mask"] = sd["fc2.weight"], torch.ones_like(sd["fc2.weight"])
        err, match = ValueError, "no module 'head'"
    elif bad == "no parameter":
        sd["fc2.scale_orig"], sd["fc2.scale_mask"] = torch.ones(3), torch.ones(3)
        err, match = ValueError, "no parameter 'scale'"
    elif bad == "bias":
        sd["fc2.bias_orig"], sd["fc2.bias_mask"] = sd.pop("fc2.bias"), torch.ones(3)
        err, match = ValueError, "fc2.bias"
    else:
        sd["fc1.weight_mask"] = torch.ones(16, 3)
        err, match = RuntimeError, "size mismatch"
    model, _ = _net(4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(err, match=match):
        from_torch_prune(model, state_dict=sd)
    assert not any(_has_prune_hook(m) for m in model.modules())
    assert [n for n, _ in model.named_parameters()] == names  # the same parameters, in their order
    assert all(p is q for p, q in zip(model.parameters(), params))
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(TypeError, match="state_dict"):
        from_torch_prune(model, state_dict=[1, 2])
