"""prunopt.pruning.Masker: masks hold through optimizer steps (gradients and
optimizer state masked), deepcopy / state_dict / torch.compile, export."""
import copy
import warnings

import pytest
import torch
from torch import nn

import prunopt
from prunopt.pruning import Masker, WeightMask, check_sparsity, prunable_tensors, remove_masks
from torch.nn.utils import parametrize

from _pruning_helpers import TinyNet, batch, random_masks


class UnknownAccumulator(torch.optim.Optimizer):
    """An optimizer with state keys the masker cannot know: an accumulator that
    grows for every entry (|p| + 1), and a buffer that would move pruned weights."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["acc_xyz"] = torch.zeros_like(p)
                    st["drift"] = torch.zeros_like(p)
                    st["step"] = torch.tensor(0.0)
                st["acc_xyz"].add_(p.abs() + 1.0)
                st["drift"].mul_(0.5).add_(0.01)
                st["step"] += 1
                p.add_(-group["lr"] * p.grad / st["acc_xyz"].sqrt() + st["drift"])


def _optimizers():
    opts = {
        "sgd_momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
        "unknown_state": lambda ps: UnknownAccumulator(ps),
    }
    prunadag = getattr(prunopt.optim, "PrunAdag", None)
    if prunadag is not None:
        opts["prunadag"] = lambda ps: prunadag(ps)
    return opts


def _assert_pruned_zero(masker, opt):
    for name, pt in masker.tensors.items():
        pruned = ~pt.mask.bool()
        assert pruned.any()
        assert torch.equal(pt.parameter.detach()[pruned], torch.zeros(int(pruned.sum()))), name
        assert torch.equal(pt.effective().detach()[pruned], torch.zeros(int(pruned.sum()))), name
        for key, v in opt.state[pt.parameter].items():
            if torch.is_tensor(v) and v.shape == pt.parameter.shape:
                assert torch.equal(v[pruned], torch.zeros_like(v[pruned])), (name, key)


@pytest.mark.parametrize("opt_name", sorted(_optimizers()))
def test_masks_hold_through_optimizer_steps(opt_name):
    torch.manual_seed(0)
    model = TinyNet()
    opt = _optimizers()[opt_name](model.parameters())
    masker = Masker(model, opt)
    # one dense step first, so the optimizer state is non-zero everywhere
    x, y = batch()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    masker.set_masks(random_masks(masker, 0.5))
    _assert_pruned_zero(masker, opt)
    for i in range(4):
        x, y = batch(seed=i + 1)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for pt in masker.tensors.values():  # autograd masks the gradient
            pruned = ~pt.mask.bool()
            assert torch.equal(pt.parameter.grad[pruned], torch.zeros(int(pruned.sum())))
        opt.step()
        masker.step()
        _assert_pruned_zero(masker, opt)
    # kept weights did move
    assert any(bool((pt.parameter.detach()[pt.mask.bool()] != 0).all()) for pt in masker.tensors.values())


def test_parametrization_layout_and_fqn_state_dict():
    model = TinyNet()
    masker = Masker(model)
    assert list(masker.tensors) == ["conv1.weight", "conv2.weight", "fc.weight"]
    assert isinstance(model.conv1.parametrizations.weight[0], WeightMask)
    keys = set(model.state_dict())
    assert "conv1.parametrizations.weight.original" in keys and "conv1.parametrizations.weight.0.mask" in keys
    masker.set_masks(random_masks(masker, 0.3))
    sd = masker.state_dict()
    assert set(sd["masks"]) == {"conv1.weight", "conv2.weight", "fc.weight"}
    assert all(not isinstance(v, nn.Module) for v in sd["masks"].values())
    # a fresh model + masker loads the model state dict and the masks
    model2 = TinyNet()
    masker2 = Masker(model2)
    model2.load_state_dict(model.state_dict())
    masker2.load_state_dict(sd)
    x, _ = batch()
    model.eval(), model2.eval()
    torch.testing.assert_close(model2(x), model(x), rtol=0, atol=0)
    for n in masker.tensors:
        assert torch.equal(masker.masks()[n], masker2.masks()[n])


def test_deepcopy_is_independent():
    model = TinyNet().eval()
    masker = Masker(model)
    masker.set_masks(random_masks(masker, 0.5))
    clone = copy.deepcopy(model)
    x, _ = batch()
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
    masker.set_masks({"fc.weight": torch.zeros_like(model.fc.weight, dtype=torch.bool)})
    assert clone.fc.parametrizations.weight[0].mask.sum() > 0


def test_torch_compile_forward_and_train_step():
    torch.manual_seed(0)
    model = TinyNet(bn=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    masker = Masker(model, opt)
    masker.set_masks(random_masks(masker, 0.4))
    compiled = torch.compile(model, backend="aot_eager")
    x, y = batch()
    torch.testing.assert_close(compiled(x), model(x))
    for i in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(compiled(x), y).backward()
        opt.step()
        masker.step()
    _assert_pruned_zero(masker, opt)


@pytest.mark.slow
def test_torch_compile_inductor():
    model = TinyNet(bn=False)
    masker = Masker(model)
    masker.set_masks(random_masks(masker, 0.4))
    compiled = torch.compile(model)
    x, _ = batch()
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_remove_leaves_plain_model():
    model = TinyNet().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masker = Masker(model, opt)
    masker.set_masks(random_masks(masker, 0.5))
    x, _ = batch()
    before = model(x).detach()
    original = model.conv1.parametrizations.weight.original
    masks = masker.masks()
    masker.remove()
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert set(model.state_dict()) == set(TinyNet().state_dict())
    assert model.conv1.weight is original  # the optimizer still holds it
    assert torch.equal(model.conv1.weight[~masks["conv1.weight"]], torch.zeros(int((~masks["conv1.weight"]).sum())))
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)



class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


def test_remove_touches_only_the_maskers_layers_and_checks_first():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    parametrize.register_parametrization(m[1], "weight", _Double())  # not a prunopt mask
    masker = Masker(m, include=["0", "2"])
    masker.set_masks({"0": torch.rand(4, 4) > 0.5})
    mask0 = masker.masks()["0.weight"]
    parametrize.register_parametrization(m[2], "weight", _Double())  # WeightMask + another one
    with pytest.raises(ValueError, match="2.weight"):
        masker.remove()
    # nothing was baked: layer 0 still has its mask
    assert parametrize.is_parametrized(m[0], "weight") and isinstance(m[0].parametrizations.weight[0], WeightMask)
    with pytest.raises(ValueError, match="2.weight"):
        remove_masks(m)
    assert parametrize.is_parametrized(m[0], "weight")
    parametrize.remove_parametrizations(m[2], "weight", leave_parametrized=False)
    x = torch.randn(3, 4)
    before = m(x)
    masker = Masker(nn.Sequential(*m[:2]), include=["0"])  # layer 1 (_Double only) is not the masker's
    masker.remove()
    assert not parametrize.is_parametrized(m[0]) and isinstance(m[1].parametrizations.weight[0], _Double)
    assert bool((m[0].weight[~mask0] == 0).all()) and not parametrize.is_parametrized(m[2])
    torch.testing.assert_close(m(x), before)
    remove_masks(m)  # layers without a WeightMask are left alone
    assert isinstance(m[1].parametrizations.weight[0], _Double)

def test_dense_gradients_match_unmasked_model():
    torch.manual_seed(0)
    model = TinyNet(bn=False)
    masker = Masker(model)
    masker.set_masks(random_masks(masker, 0.5))
    x, y = batch()
    dense = masker.dense_gradients(lambda: torch.nn.functional.cross_entropy(model(x), y))
    plain = copy.deepcopy(model)
    remove_masks(plain)
    loss = torch.nn.functional.cross_entropy(plain(x), y)
    ref = torch.autograd.grad(loss, [plain.conv1.weight, plain.conv2.weight, plain.fc.weight])
    for (n, g), r in zip(dense.items(), ref):
        torch.testing.assert_close(g, r)
        assert (g[~masker.masks()[n]] != 0).any()  # pruned entries do get a gradient
    assert masker.masks()["fc.weight"].float().mean() < 1  # masks restored


def test_unknown_names_raise():
    model = TinyNet()
    with pytest.raises(ValueError, match="exclude.*nope"):
        prunable_tensors(model, exclude=["nope"])
    with pytest.raises(ValueError, match="include"):
        Masker(model, include=["conv9"])
    masker = Masker(model, exclude=["fc"])
    assert list(masker.tensors) == ["conv1.weight", "conv2.weight"]
    with pytest.raises(ValueError, match="unknown layer name 'fc.weight'"):
        masker.set_masks({"fc.weight": torch.ones(4, 3, dtype=torch.bool)})
    with pytest.raises(TypeError, match="model"):
        Masker("not a model")


def test_bad_masks_leave_nothing_half_updated():
    model = TinyNet()
    masker = Masker(model)
    before = masker.masks()
    good = torch.zeros_like(model.conv1.parametrizations.weight.original, dtype=torch.bool)
    with pytest.raises(ValueError, match="shape"):
        masker.set_masks({"conv1.weight": good, "conv2.weight": torch.ones(2, 2, dtype=torch.bool)})
    with pytest.raises(ValueError, match="binary"):
        masker.set_masks({"conv1.weight": good, "fc.weight": torch.full((4, 3), 0.5)})
    for n, m in masker.masks().items():
        assert torch.equal(m, before[n])
    assert bool((model.conv1.parametrizations.weight.original != 0).all())


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_invalid_sparsity_value(bad):
    with pytest.raises(ValueError, match="sparsity"):
        check_sparsity(bad)


@pytest.mark.parametrize("bad", ["0.5", True, None])
def test_invalid_sparsity_type(bad):
    with pytest.raises(TypeError, match="sparsity"):
        check_sparsity(bad)


# --------------------------------------------------------------- tied weights
class _Tied(nn.Module):
    """Two Linear layers holding one Parameter (``b.weight = a.weight``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def test_tied_weights_share_one_mask():
    torch.manual_seed(0)
    model = _Tied()
    shared = model.a.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    masker = Masker(model, opt)
    assert list(masker.tensors) == ["a.weight", "head.weight"]  # the first name wins
    assert masker.aliases == {"b.weight": "a.weight"}
    assert masker["b"].name == "a.weight" and masker["b.weight"].parameter is shared
    assert model.a.parametrizations.weight[0] is model.b.parametrizations.weight[0]  # one WeightMask
    mask = torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) < 0.5
    masker.set_masks({"b.weight": mask})  # an alias name means the tied tensor
    assert torch.equal(masker.masks()["a.weight"], mask)
    with pytest.raises(ValueError, match="same tensor"):
        masker.set_masks({"a.weight": mask, "b": mask})
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        masker.step()
    # the real sparsity of the shared Parameter is the one the masker reports
    d = shared.numel() + model.head.weight.numel()
    real_zeros = int((shared == 0).sum()) + int((model.head.weight == 0).sum())
    assert masker.sparsity() == pytest.approx(real_zeros / d)
    assert torch.equal(model.a.weight, model.b.weight)
    assert torch.equal(model.a.weight[~mask], torch.zeros(int((~mask).sum())))
    assert torch.equal(opt.state[shared]["momentum_buffer"][~mask], torch.zeros(int((~mask).sum())))
    # dense gradients see both uses of the tied weight
    dense = masker.dense_gradients(lambda: torch.nn.functional.cross_entropy(model(x), y))
    plain = _Tied()  # the same effective weights, no masks
    with torch.no_grad():
        plain.a.weight.copy_(masker["a.weight"].effective())
        plain.head.weight.copy_(masker["head.weight"].effective())
        for n in ("a.bias", "b.bias", "head.bias"):
            plain.get_parameter(n).copy_(model.get_parameter(n))
    ref = torch.autograd.grad(torch.nn.functional.cross_entropy(plain(x), y), [plain.a.weight])[0]
    torch.testing.assert_close(dense["a.weight"], ref)
    assert (ref[~mask] != 0).any()  # pruned entries do get a gradient
    # remove() bakes both layers and keeps the tie
    before = model(x)
    masker.remove()
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert model.a.weight is shared and model.b.weight is shared
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)


def test_tied_fb_coefficients_share_one_mask():
    from prunopt.nn import FBConv2d

    torch.manual_seed(0)
    model = nn.Sequential(FBConv2d(2, 2, 3, padding=1), nn.ReLU(), FBConv2d(2, 2, 3, padding=1))
    model[2].coefficients = model[0].coefficients
    masker = Masker(model)
    assert list(masker.tensors) == ["0.coefficients"] and masker.aliases == {"2.coefficients": "0.coefficients"}
    assert model[2].mask is model[0].mask
    mask = torch.rand(2, 2, 9, generator=torch.Generator().manual_seed(0)) < 0.5
    masker.set_masks({"2": mask})
    assert torch.equal(model[0].mask.bool(), mask) and torch.equal(model[2].mask.bool(), mask)
    assert masker.sparsity() == pytest.approx(1 - int(mask.sum()) / mask.numel())
    # tied FB layers that already disagree on their masks cannot share one: nothing changes
    other = nn.Sequential(FBConv2d(2, 2, 3), FBConv2d(2, 2, 3))
    other[1].coefficients = other[0].coefficients
    other[1].mask[0, 0, 0] = 0
    mask1 = other[1].mask
    with pytest.raises(ValueError, match="tied layers '0.coefficients' and '1.coefficients'"):
        Masker(other)
    assert other[1].mask is mask1


# ----------------------------------------------- construction is all-or-nothing
def _plain_layers(model):
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def test_masker_construction_is_atomic():
    import torch.nn.utils.prune as torch_prune

    lazy = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LazyLinear(3))
    with pytest.raises(ValueError, match="'2.weight'.*uninitialized"):
        Masker(lazy)
    assert not parametrize.is_parametrized(lazy[0])  # the earlier layer is untouched
    pruned = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    torch_prune.l1_unstructured(pruned[1], "weight", 0.5)
    with pytest.raises(ValueError, match="'1.weight'.*torch.nn.utils.prune"):
        Masker(pruned)
    assert not parametrize.is_parametrized(pruned[0])
    # the other layers can still be masked
    assert list(Masker(pruned, exclude=["1"]).tensors) == ["0.weight"]


@pytest.mark.parametrize("how", ["parametrizations.weight_norm", "utils.weight_norm"])
def test_already_parametrized_weight_is_a_value_error(how):
    lin = nn.Linear(4, 3)
    if how == "parametrizations.weight_norm":
        lin = nn.utils.parametrizations.weight_norm(lin)
    else:
        with warnings.catch_warnings():  # deprecated in favour of the parametrization
            warnings.simplefilter("ignore")
            lin = nn.utils.weight_norm(lin)
    model = nn.Sequential(nn.Linear(4, 4), lin)
    keys = set(model.state_dict())
    with pytest.raises(ValueError, match="'1.weight'"):
        Masker(model)
    assert not parametrize.is_parametrized(model[0]) and set(model.state_dict()) == keys
    masker = Masker(model, exclude=["1"])  # excluding it works, and step() runs
    masker.step()


def test_density_of_empty_tensors_is_a_value_error():
    masker = Masker(nn.Linear(0, 4))
    with pytest.raises(ValueError, match="no prunable entries"):
        masker.density()
    with pytest.raises(ValueError, match="no prunable entries"):
        masker.sparsity()
