"""TwoTemperatureMask and its utilities (Colombo & Gao)."""
import copy
import math
import warnings

import pytest
import torch
from torch import nn

from prunopt.nn import (
    TwoTemperatureMask,
    apply_architecture,
    extract_architecture,
    layer_densities,
    mask_density,
    mask_regularizer,
    reshuffle_masks,
    stop_at_sparsity,
    two_temperature_masks,
    wrap_two_temperature_masks,
)
from prunopt.train.models import SmallCNN


def test_defaults_and_forward_equals_masked_layer():
    torch.manual_seed(0)
    lin = nn.Linear(6, 3)
    m = TwoTemperatureMask(lin)
    assert m.t_l == 1000.0 and m.t_s == 10.0
    assert (m.w > 0).all()  # w0 ~ |N(0, eps)|: every weight on
    x = torch.randn(4, 6)
    v = torch.sigmoid(1000.0 * m.w.detach())
    torch.testing.assert_close(m(x), torch.nn.functional.linear(x, lin.weight * v, lin.bias))
    conv = nn.Conv2d(2, 3, 3, padding=1)
    mc = TwoTemperatureMask(conv, t_l=100.0, t_s=1.0)
    xc = torch.randn(1, 2, 5, 5)
    torch.testing.assert_close(mc(xc), nn.functional.conv2d(xc, conv.weight * torch.sigmoid(100 * mc.w.detach()),
                                                            conv.bias, padding=1))


def test_mask_gradient_uses_soft_temperature():
    lin = nn.Linear(3, 1, bias=False)
    m = TwoTemperatureMask(lin, t_l=1000.0, t_s=10.0)
    x = torch.randn(5, 3)
    m(x).sum().backward()
    w = m.w.detach()
    sw = torch.sigmoid(10.0 * w)
    expected = x.sum(0) * lin.weight.detach()[0] * 10.0 * sw[0] * (1 - sw[0])
    torch.testing.assert_close(m.w.grad[0], expected)


def test_regulariser_binarisation_and_target_stop():
    torch.manual_seed(1)
    model = wrap_two_temperature_masks(nn.Sequential(nn.Linear(20, 10), nn.ReLU(), nn.Linear(10, 2)))
    masks = two_temperature_masks(model)
    assert len(masks) == 2
    opt = torch.optim.SGD([m.w for m in masks], lr=0.05)
    stopped_at = None
    for it in range(500):
        opt.zero_grad()
        reg = mask_regularizer(masks, gamma=1.0)
        if reg.requires_grad:
            reg.backward()
            opt.step()
        if stop_at_sparsity(masks, 0.5):
            stopped_at = it
            break
    assert stopped_at is not None
    assert 1 - mask_density(masks) >= 0.5
    frozen_w = [m.w.detach().clone() for m in masks]
    # after the stop: binary mask 1[w > 0], w no longer updated
    assert all(not m.w.requires_grad for m in masks)
    x = torch.randn(3, 20)
    out = model(x)
    l0 = masks[0].layer
    h = torch.relu(nn.functional.linear(x, l0.weight * (frozen_w[0] > 0), l0.bias))
    l1 = masks[1].layer
    torch.testing.assert_close(out, nn.functional.linear(h, l1.weight * (frozen_w[1] > 0), l1.bias))
    assert all(set(m.binary_mask().unique().tolist()) <= {0.0, 1.0} for m in masks)
    assert mask_regularizer(masks, 1.0).item() == 0.0


def test_layer_densities_reshuffle_and_transfer():
    torch.manual_seed(2)
    model = wrap_two_temperature_masks(SmallCNN(width=4))
    masks = two_temperature_masks(model)
    with torch.no_grad():
        for i, m in enumerate(masks):
            m.w.copy_(torch.randn_like(m.w) + 0.3 * i)
    dens = layer_densities(masks)
    before = extract_architecture(masks)
    g = torch.Generator().manual_seed(0)
    reshuffle_masks(masks, generator=g)
    after = extract_architecture(masks)
    for d, m, b, a in zip(dens, masks, before, after):
        assert abs(a.double().mean().item() - d) <= 1.0 / a.numel()
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    other = wrap_two_temperature_masks(SmallCNN(width=4))
    apply_architecture(two_temperature_masks(other), before)
    assert all(torch.equal(a, b) for a, b in zip(extract_architecture(two_temperature_masks(other)), before))
    with pytest.raises(ValueError, match="architecture"):
        apply_architecture(two_temperature_masks(other), before[:-1])


def _frozen_state(masks):
    return [(m.w.clone(), bool(m.frozen), m.w.requires_grad) for m in masks]


def _same_state(masks, state):
    return all(torch.equal(m.w, w) and bool(m.frozen) == f and m.w.requires_grad == rg
               for m, (w, f, rg) in zip(masks, state))


def test_reshuffle_and_apply_architecture_validate_before_writing():
    torch.manual_seed(3)
    masks = two_temperature_masks(wrap_two_temperature_masks(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))))
    state = _frozen_state(masks)
    # a bad entry for the last layer leaves the earlier layers untouched
    for bad, err in (([0.5, 1.5], ValueError), ([0.5, float("nan")], ValueError), ([0.5, "0.5"], TypeError),
                     ([0.5, True], TypeError)):
        with pytest.raises(err, match="densities"):
            reshuffle_masks(masks, bad)
        assert _same_state(masks, state)
    good = torch.ones(6, 4, dtype=torch.bool)
    for bad, err in (([good, torch.zeros(3, 3, dtype=torch.bool)], ValueError),
                     ([good, [[1] * 6] * 2], TypeError),
                     ([good, torch.full((2, 6), 0.3)], ValueError)):
        with pytest.raises(err, match="architecture"):
            apply_architecture(masks, bad)
        assert _same_state(masks, state)
    # 0/1 values of any dtype are accepted
    apply_architecture(masks, [good, torch.tensor([[1.0, 0.0] * 3] * 2)])
    assert torch.equal(extract_architecture(masks)[1], torch.tensor([[True, False] * 3] * 2))
    assert all(bool(m.frozen) for m in masks)


@pytest.mark.parametrize("bad", [0.0, -5.0, float("inf"), float("nan")])
def test_invalid_temperatures(bad):
    with pytest.raises(ValueError, match="t_l"):
        TwoTemperatureMask(nn.Linear(2, 2), t_l=bad)
    with pytest.raises(ValueError, match="t_s"):
        TwoTemperatureMask(nn.Linear(2, 2), t_s=bad)
    with pytest.raises(TypeError):
        TwoTemperatureMask(nn.ReLU())
    with pytest.raises(ValueError, match="target_sparsity"):
        stop_at_sparsity([], 1.5)


def test_mask_under_torch_compile():
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = wrap_two_temperature_masks(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)))
    masks = two_temperature_masks(model)
    x = torch.rand(3, 6)

    def f(x):
        return model(x).square().mean() + mask_regularizer(masks, 1e-4)

    params = [m.w for m in masks]
    eager = f(x)
    ge = torch.autograd.grad(eager, params)
    compiled = torch.compile(f, backend="aot_eager")(x)
    gc = torch.autograd.grad(compiled, params)
    torch.testing.assert_close(compiled, eager)
    for u, v in zip(gc, ge):
        torch.testing.assert_close(u, v, atol=1e-6, rtol=1e-4)


def _v(m):
    return torch.sigmoid(m.t_l * m.w.detach())


def test_wrap_keeps_tied_layers_tied_and_wraps_a_bare_layer():
    torch.manual_seed(4)
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    assert wrap_two_temperature_masks(model) is model
    # one wrapper under both names: the second use is masked too, with the same w
    assert isinstance(model[0], TwoTemperatureMask) and model[2] is model[0] and model[0].layer is lin
    assert len(two_temperature_masks(model)) == 1
    x = torch.randn(3, 4)
    wm = lin.weight * _v(model[0])
    ref = nn.functional.linear(torch.relu(nn.functional.linear(x, wm, lin.bias)), wm, lin.bias)
    torch.testing.assert_close(model(x), ref)
    # wrapping again changes nothing (no mask of a mask)
    first = model[0]
    assert wrap_two_temperature_masks(model) is model and model[0] is first and first.layer is lin
    # a bare layer: its wrapper comes back
    bare = nn.Linear(3, 2)
    wrapped = wrap_two_temperature_masks(bare)
    assert isinstance(wrapped, TwoTemperatureMask) and wrapped.layer is bare
    torch.testing.assert_close(wrapped(x[:, :3]), nn.functional.linear(x[:, :3], bare.weight * _v(wrapped), bare.bias))
    assert wrap_two_temperature_masks(wrapped) is wrapped and wrapped.layer is bare
    conv = nn.Conv2d(2, 3, 1)
    assert isinstance(wrap_two_temperature_masks(conv), TwoTemperatureMask)
    # a bare use of a layer that is wrapped elsewhere gets the existing wrapper
    inner = nn.Linear(3, 3)
    mask = TwoTemperatureMask(inner)
    mixed = wrap_two_temperature_masks(nn.Sequential(mask, inner))
    assert mixed[1] is mask and mask.layer is inner


def test_wrap_exact_types_only_and_transformer_runs():
    torch.manual_seed(5)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    ref = copy.deepcopy(layer)
    wrap_two_temperature_masks(layer)
    # MultiheadAttention reads out_proj.weight itself: its Linear subclass is left alone
    assert type(layer.self_attn.out_proj) is type(ref.self_attn.out_proj)
    assert isinstance(layer.linear1, TwoTemperatureMask) and isinstance(layer.linear2, TwoTemperatureMask)

    class MyLinear(nn.Linear):
        pass

    sub = nn.Sequential(MyLinear(2, 2))
    wrap_two_temperature_masks(sub)
    assert type(sub[0]) is MyLinear
    with torch.no_grad():
        ref.linear1.weight.mul_(_v(layer.linear1))
        ref.linear2.weight.mul_(_v(layer.linear2))
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(layer(x), ref(x))
    layer.linear1.w.detach()[0].fill_(-1.0)  # a pruned row: the masks matter
    with torch.no_grad():
        ref.linear1.weight[0] = 0.0
    layer.eval(), ref.eval()
    torch.testing.assert_close(layer(x), ref(x), atol=1e-5, rtol=1e-5)  # reads linear1.weight directly
    with torch.no_grad():  # the inference fast path, with the masked weights
        torch.testing.assert_close(layer(x), ref(x), atol=1e-5, rtol=1e-5)
    layer(x).sum().backward()
    assert layer.linear1.w.grad is not None and layer.linear1.layer.weight.grad is not None


def test_wrap_checks_arguments_before_changing_the_model():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="t_l"):
        wrap_two_temperature_masks(model, t_l=0.0)
    with pytest.raises(ValueError, match="init_scale"):
        wrap_two_temperature_masks(model, init_scale=-1.0)
    with pytest.raises(TypeError, match="init_scale"):
        wrap_two_temperature_masks(model, init_scale="0.1")
    assert type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match="t_s"):  # checked even without a layer to wrap
        wrap_two_temperature_masks(nn.ReLU(), t_s=float("nan"))
    with pytest.raises(TypeError, match="model"):
        wrap_two_temperature_masks("model")


def test_load_state_dict_keeps_frozen_and_requires_grad_consistent():
    torch.manual_seed(6)
    x = torch.randn(2, 3)
    live_sd = TwoTemperatureMask(nn.Linear(3, 3)).state_dict()
    frozen = TwoTemperatureMask(nn.Linear(3, 3))
    frozen.freeze()
    frozen_sd = frozen.state_dict()
    m = TwoTemperatureMask(nn.Linear(3, 3))
    m.freeze()
    m.load_state_dict(live_sd)  # an unfrozen checkpoint: w trains again
    assert not bool(m.frozen) and m.w.requires_grad
    m(x).sum().backward()
    assert m.w.grad is not None and m.w.grad.abs().sum() > 0
    m.load_state_dict(frozen_sd)  # a frozen one: binary mask, no gradient for w
    assert bool(m.frozen) and not m.w.requires_grad
    torch.testing.assert_close(m.mask(), (frozen_sd["w"] > 0).float())
    # through a model (prefixed keys), and with strict=False and no "frozen" key: unchanged
    model = wrap_two_temperature_masks(nn.Sequential(nn.Linear(3, 3)))
    model.load_state_dict({"0." + k: v for k, v in frozen_sd.items()})
    assert bool(model[0].frozen) and not model[0].w.requires_grad
    model.load_state_dict({"0.w": live_sd["w"]}, strict=False)
    assert bool(model[0].frozen) and not model[0].w.requires_grad


def test_mask_on_the_meta_device():
    with torch.device("meta"):
        m = TwoTemperatureMask(nn.Linear(3, 4))
    x = torch.empty(2, 3, device="meta")
    out = m(x)
    assert out.is_meta and out.shape == (2, 4) and mask_regularizer([m], 1.0).is_meta
    m.freeze()
    assert m(x).shape == (2, 4) and mask_regularizer([m], 1.0).item() == 0.0
    # loading a checkpoint into a meta model (assign=True materialises it)
    src = TwoTemperatureMask(nn.Linear(3, 4))
    src.freeze()
    with torch.device("meta"):
        meta = TwoTemperatureMask(nn.Linear(3, 4))
    meta.load_state_dict(src.state_dict(), strict=False, assign=True)
    assert bool(meta.frozen) and not meta.w.requires_grad
    with torch.device("meta"):
        meta = TwoTemperatureMask(nn.Linear(3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that copying into meta tensors is a no-op
        meta.load_state_dict(src.state_dict())  # the copy is a no-op on meta, but the frozen flag is known
    assert not meta.w.requires_grad and meta(x).is_meta


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_reshuffle_with_an_empty_layer():
    torch.manual_seed(7)
    masks = two_temperature_masks(wrap_two_temperature_masks(nn.Sequential(nn.Linear(0, 3), nn.Linear(3, 4))))
    dens = layer_densities(masks)
    assert math.isnan(dens[0]) and dens[1] == 1.0  # no weights: no density
    state = _frozen_state(masks)
    with pytest.raises(ValueError, match=r"densities must be in \[0, 1\], got nan \(entry 1\)"):
        reshuffle_masks(masks, [float("nan"), float("nan")])
    assert _same_state(masks, state)
    reshuffle_masks(masks, generator=torch.Generator().manual_seed(0))
    assert all(bool(m.frozen) for m in masks) and layer_densities(masks)[1] == 1.0
    reshuffle_masks(masks, [0.0, 0.5])
    assert layer_densities(masks)[1] == 0.5
