"""prunopt.nn FilterBasis / FBConv2d / to_interspace and the eq. 9, App. C, App. D helpers."""
import io
import math

import pytest
import torch
from torch import nn

import prunopt
from prunopt.nn import (
    FBConv2d,
    FilterBasis,
    interspace_flops,
    interspace_param_groups,
    interspace_report,
    pruning_rates,
    sparse_storage,
    to_interspace,
)
from prunopt.reference import fb_conv2d_reference


@pytest.fixture
def avx2_cost_model(monkeypatch):
    """The path choices these tests expect are those of the AVX2 ("default")
    cost-model constants; pin them whatever this CPU is."""
    from prunopt.ops import interspace as ops_interspace
    monkeypatch.setattr(ops_interspace, "_cpu_capability", lambda: "default")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# -- FilterBasis (App. G) ------------------------------------------------------------------

def test_filter_basis_inits():
    b = FilterBasis(3)
    assert b.weight.shape == (9, 3, 3) and isinstance(b.weight, nn.Parameter)
    torch.testing.assert_close(b.matrix(), torch.eye(9))  # Alg. A1
    o = FilterBasis(3, init="orthonormal", generator=_gen(), dtype=torch.float64)
    m = o.matrix()
    torch.testing.assert_close(m.T @ m, torch.eye(9, dtype=torch.float64), atol=1e-12, rtol=0)  # Alg. A2
    assert not torch.allclose(m, torch.eye(9, dtype=torch.float64))
    r = FilterBasis((3, 3), size=20, init="random", generator=_gen(), dtype=torch.float64)  # Alg. A3
    assert r.size == 20 and r.weight.shape == (20, 3, 3)
    torch.testing.assert_close(r.weight.mean(0), torch.full((3, 3), 1 / 20, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(r.weight.var(0, unbiased=False), torch.full((3, 3), 1 / 20 - 1 / 400, dtype=torch.float64),
                               atol=1e-12, rtol=0)
    rect = FilterBasis((1, 3))
    assert rect.weight.shape == (3, 1, 3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kernel_size=3, size=5), "size"),
    (dict(kernel_size=3, init="bogus"), "init"),
    (dict(kernel_size=3, size=0, init="random"), "size"),
    (dict(kernel_size=3, size=10, init="orthonormal"), "size"),
])
def test_filter_basis_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FilterBasis(**kwargs)


def test_random_dictionary_init_mimics_kaiming():
    # Alg. A3: kaiming-normal coefficients in a rescaled random dictionary give
    # spatial weights with mean 0 and variance 2/fan_in (eq. A.69-A.74)
    basis = FilterBasis(3, size=16, init="random", generator=_gen(1))
    layer = FBConv2d(64, 256, 3, basis=basis)
    h = layer.reconstruct().detach().double()
    std = math.sqrt(2 / (64 * 9))
    assert abs(h.mean().item()) < 0.05 * std
    assert abs(h.std().item() / std - 1) < 0.05


# -- FBConv2d ------------------------------------------------------------------------------

def test_layer_interface():
    layer = FBConv2d(6, 8, 3, stride=2, padding=1, groups=2)
    assert layer.coefficients.shape == (8, 3, 9) and isinstance(layer.coefficients, nn.Parameter)
    assert layer.mask.shape == (8, 3, 9) and layer.mask.dtype == torch.float32 and bool((layer.mask == 1).all())
    assert "mask" in dict(layer.named_buffers()) and layer.bias.shape == (8,)
    assert isinstance(layer.basis, FilterBasis)
    assert layer.reconstruct().shape == (8, 3, 3, 3)
    # kaiming normal (Alg. A1)
    big = FBConv2d(128, 256, 3, bias=False)
    assert big.bias is None
    assert abs(big.coefficients.std().item() / math.sqrt(2 / (128 * 9)) - 1) < 0.02


CONV_CASES = [
    dict(),
    dict(stride=2, padding=1),
    dict(padding=(2, 1), dilation=(2, 1)),
    dict(groups=2, padding=1, bias=False),
    dict(padding=1, padding_mode="reflect"),
    dict(padding=2, padding_mode="circular", stride=(1, 2)),
    dict(padding=1, padding_mode="replicate"),
    dict(padding="same", dilation=2),
    dict(padding="same", kernel_size=(2, 4)),
    dict(padding="valid", kernel_size=(1, 3)),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
@pytest.mark.parametrize("init", ["standard", "orthonormal"])
def test_matches_conv2d_both_ways(case, init):
    case = dict(case)
    k = case.pop("kernel_size", 3)
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, k, **case).double()
    basis = FilterBasis(k, init=init, generator=_gen(), dtype=torch.float64)
    fb = FBConv2d.from_conv2d(conv, basis)
    assert fb.basis is basis
    for x in (torch.randn(3, 4, 9, 10, dtype=torch.float64), torch.randn(4, 7, 8, dtype=torch.float64)):
        y = conv(x)
        torch.testing.assert_close(fb(x), y, atol=1e-12, rtol=0)
        fb.eval()
        with torch.no_grad():
            torch.testing.assert_close(fb(x), y, atol=1e-12, rtol=0)
        fb.train()
    back = fb.to_conv2d()
    assert isinstance(back, nn.Conv2d) and back.padding_mode == conv.padding_mode and back.padding == conv.padding
    torch.testing.assert_close(back.weight, conv.weight, atol=1e-13, rtol=0)


def test_round_trip_standard_basis_is_bitwise():
    conv = nn.Conv2d(3, 5, 3, padding=1)
    fb = FBConv2d.from_conv2d(conv, FilterBasis(3))
    assert torch.equal(fb.coefficients.detach().reshape(5, 3, 3, 3), conv.weight.detach())
    assert torch.equal(fb.to_conv2d().weight, conv.weight)
    fb2 = FBConv2d.from_conv2d(fb.to_conv2d(), FilterBasis(3))
    assert torch.equal(fb2.coefficients, fb.coefficients)


def test_round_trip_dictionary():
    conv = nn.Conv2d(3, 5, 3).double()
    over = FilterBasis(3, size=14, init="random", generator=_gen(), dtype=torch.float64)  # spans R^{3x3}
    fb = FBConv2d.from_conv2d(conv, over)
    torch.testing.assert_close(fb.to_conv2d().weight, conv.weight, atol=1e-12, rtol=0)
    # and a trained-looking FB layer converts exactly to a conv (App. E)
    layer = FBConv2d(3, 5, 3, basis=over).double()
    layer.mask.bernoulli_(0.5, generator=_gen(2))
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(layer.to_conv2d()(x), layer(x), atol=1e-12, rtol=0)


def test_mask_zeroes_coefficient_gradient_and_basis_gets_gradient():
    layer = FBConv2d(3, 4, 3, padding=1)
    layer.mask.bernoulli_(0.3, generator=_gen())
    x = torch.randn(2, 3, 5, 5)
    layer(x).square().sum().backward()
    assert torch.equal(layer.coefficients.grad * (1 - layer.mask), torch.zeros_like(layer.coefficients))
    assert layer.basis.weight.grad is not None and layer.basis.weight.grad.abs().sum() > 0
    # the output does not depend on masked coefficients
    y0 = layer(x)
    with torch.no_grad():
        layer.coefficients.add_(100 * (1 - layer.mask))
    torch.testing.assert_close(layer(x), y0)


@pytest.mark.parametrize("requires", [(True, True, True, True), (False, True, False, False), (False, False, True, True)])
def test_training_gradients_match_reference(requires):
    """The layer's training path (the fused reconstruction, its autograd in C++, then
    conv2d) gives the gradients of reconstruct + F.conv2d (eq. 7, A.11-A.14) for every
    subset of input / coefficients / basis / bias that requires one."""
    torch.manual_seed(3)
    layer = FBConv2d(4, 6, 3, stride=(1, 2), padding=1, groups=2, basis=FilterBasis(3, init="orthonormal")).double()
    layer.mask.bernoulli_(0.6, generator=_gen(4))
    x = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    ps = (x, layer.coefficients, layer.basis.weight, layer.bias)
    for p, r in zip(ps, requires):
        p.requires_grad_(r)
    wanted = [p for p, r in zip(ps, requires) if r]
    gy = torch.randn_like(layer(x))
    got = torch.autograd.grad(layer(x), wanted, gy)
    ref = fb_conv2d_reference(x, layer.coefficients, layer.basis.weight, layer.mask, layer.bias, (1, 2), 1, 1, 2)
    expected = torch.autograd.grad(ref, wanted, gy)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0)
    if prunopt.extension_available():
        # no Python autograd node on the training path (its host cost is the step of a small GPU layer)
        h = torch.ops.prunopt.fb_reconstruct(layer.coefficients, layer.basis.weight, layer.mask)
        if h.requires_grad:
            assert "CppNode" in h.grad_fn.name()
    lam, g = layer.coefficients.detach().clone(), layer.basis.weight.detach().clone()

    def f(x, lam, g):
        return torch.func.functional_call(layer, {"coefficients": lam, "basis.weight": g}, (x,))

    assert torch.autograd.gradcheck(f, (x.detach().requires_grad_(), lam.requires_grad_(), g.requires_grad_()),
                                    fast_mode=True)


@pytest.mark.parametrize("train", [True, False])
def test_autocast_matches_conv2d(train, avx2_cost_model):
    """Under torch.autocast the layer behaves as nn.Conv2d: conv2d in the autocast
    dtype (the input may have it), the filters reconstructed in the coefficients'
    dtype, float32 gradients for coefficients and basis; in eval a pruned layer
    does not take the sparse path (which computes in float32)."""
    torch.manual_seed(5)
    fbs = nn.Sequential(FBConv2d(3, 64, 3, padding=1), nn.ReLU(), FBConv2d(64, 64, 3, padding=1))
    fbs[0].mask.bernoulli_(0.5, generator=_gen(6))
    fbs[2].mask.bernoulli_(0.01, generator=_gen(6))  # sparse enough for the sparse eval path
    convs = nn.Sequential(fbs[0].to_conv2d(), nn.ReLU(), fbs[2].to_conv2d())
    x = torch.randn(1, 3, 8, 8)
    if not train:
        with torch.no_grad():
            fbs.eval()(x)
        assert fbs[2]._compressed[("plan", torch.Size([1, 64, 8, 8]), (1, 1))]  # sparse without autocast
    fbs.train(train)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(train):
        y = fbs(x)
        y_ref = convs(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    if train:
        y.float().square().sum().backward()
        assert fbs[2].coefficients.grad.dtype == torch.float32 and fbs[2].basis.weight.grad.dtype == torch.float32
        assert torch.isfinite(fbs[0].coefficients.grad).all()
        # the mask still zeroes the gradient of pruned coefficients (eq. 7)
        assert torch.equal(fbs[0].coefficients.grad * (1 - fbs[0].mask), torch.zeros_like(fbs[0].coefficients))


def test_functional_autocast():
    torch.manual_seed(7)
    x = torch.randn(1, 4, 6, 6)
    lam, basis = torch.randn(5, 4, 9), torch.linalg.qr(torch.randn(9, 9))[0].reshape(9, 3, 3)
    mask = (torch.rand(5, 4, 9) < 0.1).float()
    exact = fb_conv2d_reference(x, lam, basis, mask, None, 1, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_auto = prunopt.ops.fb_conv2d(x.bfloat16(), lam, basis, mask, padding=1)
        y_sparse = prunopt.ops.fb_conv2d(x.bfloat16(), lam, basis, mask, padding=1, path="sparse")
    assert y_auto.dtype == torch.bfloat16 and y_sparse.dtype == torch.float32
    torch.testing.assert_close(y_auto.float(), exact, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(y_sparse, fb_conv2d_reference(x.bfloat16().float(), lam, basis, mask, None, 1, 1),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="dtype"):  # without autocast the dtypes must agree
        prunopt.ops.fb_conv2d(x.bfloat16(), lam, basis, mask, padding=1)


def test_non_tensor_input_is_a_type_error():
    with pytest.raises(TypeError, match="input"):
        FBConv2d(4, 6, 3)([[1.0]])


def test_eval_cache_follows_coefficient_and_mask_changes():
    layer = FBConv2d(8, 8, 3, padding=1).eval()
    layer.mask.bernoulli_(0.1, generator=_gen())
    x = torch.randn(1, 8, 6, 6)
    ref = lambda: fb_conv2d_reference(x, layer.coefficients, layer.basis.weight, layer.mask, layer.bias, padding=1)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref(), atol=1e-5, rtol=0)
        layer.mask.bernoulli_(0.05, generator=_gen(1))
        torch.testing.assert_close(layer(x), ref(), atol=1e-5, rtol=0)
        layer.coefficients.mul_(2)
        torch.testing.assert_close(layer(x), ref(), atol=1e-5, rtol=0)
        layer.basis.weight.mul_(-1)
        torch.testing.assert_close(layer(x), ref(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(in_channels=4, out_channels=6, kernel_size=3, groups=4), ValueError, "groups"),
    (dict(in_channels=4, out_channels=6, kernel_size=3, padding_mode="mirror"), ValueError, "padding_mode"),
    (dict(in_channels=4, out_channels=6, kernel_size=3, padding="full"), ValueError, "padding"),
    (dict(in_channels=4, out_channels=6, kernel_size=3, basis=FilterBasis(5)), ValueError, "kernel_size"),
    (dict(in_channels=4, out_channels=6, kernel_size=3, basis=torch.eye(9)), TypeError, "basis"),
    (dict(in_channels=0, out_channels=6, kernel_size=3), ValueError, "in_channels"),
])
def test_layer_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FBConv2d(**kwargs)


def test_wrong_input_channels_is_a_value_error():
    with pytest.raises(ValueError, match="channels"):
        FBConv2d(4, 6, 3)(torch.randn(1, 5, 8, 8))


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("channels, groups", [(10, 1), (10, 2), (6, 1)])
def test_eval_paths_check_the_input_and_basis(monkeypatch, sparse, channels, groups):
    """In eval without gradients the sparse path runs the CSR op, which takes
    C_in from the input: too many channels were silently dropped (or, with
    groups, mixed across groups) until the layer checked the input itself."""
    from prunopt.ops import interspace as ops_interspace

    monkeypatch.setattr(ops_interspace, "sparse_is_faster", lambda *a, **k: sparse)
    torch.manual_seed(0)
    layer = FBConv2d(8, 8, 3, padding=1, groups=groups).eval()
    layer.mask.bernoulli_(0.3)
    with torch.no_grad():
        layer(torch.randn(1, 8, 6, 6))  # a good call first: the fast path is set up
        with pytest.raises(ValueError, match="channels"):
            layer(torch.randn(1, channels, 6, 6))
        with pytest.raises(ValueError, match="channels"):
            layer(torch.randn(channels, 6, 6))
        layer.basis = FilterBasis(3, size=10, init="random")  # N = 10 against coefficients' 9
        with pytest.raises(ValueError, match="basis"):
            layer(torch.randn(1, 8, 6, 6))


# -- to_interspace (Sec. 4.3, App. H) -----------------------------------------------------

def vgg_like():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 5, padding=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) if stride > 1 or cin != cout else nn.Identity()

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


def resnet_like():
    return nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         Block(8, 8, 1), Block(8, 16, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


@pytest.mark.parametrize("make", [vgg_like, resnet_like])
@pytest.mark.parametrize("sharing", ["fine", "coarse"])
@pytest.mark.parametrize("init", ["standard", "orthonormal", "random"])
def test_to_interspace_keeps_outputs(make, sharing, init):
    torch.manual_seed(0)
    model = make().double().eval()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    y = model(x)
    n_conv = sum(isinstance(m, nn.Conv2d) and max(m.kernel_size) > 1 for m in model.modules())
    n_1x1 = sum(isinstance(m, nn.Conv2d) and max(m.kernel_size) == 1 for m in model.modules())
    out = to_interspace(model, sharing=sharing, init=init, generator=_gen())
    assert out is model
    fbs = [m for m in model.modules() if isinstance(m, FBConv2d)]
    assert len(fbs) == n_conv
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == n_1x1  # 1x1 stay standard
    bases = {id(m.basis) for m in fbs}
    kernels = {m.kernel_size for m in fbs}
    assert len(bases) == (n_conv if sharing == "fine" else len(kernels))
    torch.testing.assert_close(model(x), y, atol=1e-10, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), y, atol=1e-10, rtol=0)


def test_to_interspace_callable_sharing():
    model = resnet_like()
    # "medium": one basis per block; the stem stays standard
    to_interspace(model, sharing=lambda name, conv: None if name == "0" else name.split(".")[0])
    assert isinstance(model[0], nn.Conv2d)
    assert model[3].conv1.basis is model[3].conv2.basis
    assert model[4].conv1.basis is not model[3].conv1.basis
    with pytest.raises(ValueError, match="sharing"):
        to_interspace(vgg_like(), sharing="medium")
    with pytest.raises(TypeError, match="sharing"):
        to_interspace(vgg_like(), sharing=3)


def test_shared_basis_saved_once_and_shared_after_load():
    torch.manual_seed(0)
    model = to_interspace(vgg_like(), sharing="coarse")
    with torch.no_grad():
        model[0].basis.weight.add_(0.1 * torch.randn(9, 3, 3))
    sd = model.state_dict()
    keys = [k for k in sd if k.endswith("basis.weight")]
    assert len(keys) == 4
    # one storage for the 3x3 basis (torch.save writes it once)
    assert len({sd[k].untyped_storage().data_ptr() for k in keys}) == 2  # 3x3 and 5x5
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh = to_interspace(vgg_like(), sharing="coarse")
    fresh.load_state_dict(torch.load(buf))
    assert fresh[0].basis is fresh[3].basis is fresh[7].basis
    torch.testing.assert_close(fresh[3].basis.weight, model[0].basis.weight)
    with torch.no_grad():
        fresh[0].basis.weight.mul_(2)
    assert torch.equal(fresh[7].basis.weight, fresh[0].basis.weight)
    x = torch.randn(1, 3, 8, 8)
    model.eval(), fresh.eval()
    with torch.no_grad():
        fresh[0].basis.weight.div_(2)
        torch.testing.assert_close(fresh(x), model(x))


def test_param_groups():
    model = to_interspace(vgg_like(), sharing="coarse")
    groups = interspace_param_groups(model, 5e-4, lr=0.1)
    assert groups[0]["weight_decay"] == 5e-4 and groups[1]["weight_decay"] == 0.0
    basis_params = {id(m.weight) for m in model.modules() if isinstance(m, FilterBasis)}
    assert {id(p) for p in groups[1]["params"]} == basis_params
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(model.parameters()))
    assert any(p is model[0].coefficients for p in groups[0]["params"])
    torch.optim.SGD(groups, momentum=0.9)  # accepted by an optimizer


# -- eq. 9, App. C, App. D ---------------------------------------------------------------------

def test_pruning_rates_eq9():
    model = nn.Sequential(FBConv2d(2, 4, 3), nn.Flatten(), nn.Linear(4 * 2 * 2, 3))  # 72 + 48 prunable
    model[0].mask.zero_()
    model[0].mask[:, :, 0] = 1  # 8 non-zero coefficients
    with torch.no_grad():
        model[2].weight[:, :8] = 0  # 24 non-zero
    r = pruning_rates(model)
    assert r["D"] == 72 + 48 and r["nonzero"] == 8 + 24 and r["basis_nonzero"] == 9
    assert r["p_SP"] == pytest.approx(1 - 32 / 120) and r["p_IP"] == pytest.approx(1 - 41 / 120)


def test_flops_app_d():
    layer = FBConv2d(4, 8, 3)
    layer.mask.zero_()
    layer.mask[:, :, :3] = 1
    x = torch.randn(1, 4, 10, 10)
    f = interspace_flops(layer, x)
    d = 8 * 8
    assert f["dense"] == 2 * 8 * 4 * 9 * d  # A.5
    assert f["basis_overhead"] == 2 * 4 * 9 * 9 * d  # 2 C_in K^4 d1 d2
    assert f["sparse"] == 2 * 8 * 4 * 3 * d + f["basis_overhead"]  # A.8 with p = 2/3
    p = 2 / 3
    assert f["ratio"] == pytest.approx((1 - p) + 9 / 8)


def test_storage_app_c():
    s = sparse_storage(1000, 100)
    p = 0.9
    h = -p * math.log2(p) - (1 - p) * math.log2(1 - p)
    assert s["dense"] == 4000
    assert s["entropy"] / s["dense"] == pytest.approx(h / 32 + 1 - p)  # eq. A.2
    assert s["csr"] == (100 * 8 + 2 * 4)
    assert sparse_storage(10, 10)["entropy"] == 40 and sparse_storage(10, 0)["entropy"] == 0


def test_report():
    model = to_interspace(vgg_like(), sharing="fine")
    rep = interspace_report(model, torch.randn(1, 3, 16, 16))
    assert set(rep) >= {"p_SP", "p_IP", "storage_bytes", "flops"}
    assert rep["p_SP"] == pytest.approx(0.0) and rep["p_IP"] < 0  # dense + bases
    assert rep["flops"]["ratio"] > 1  # dense FB layers pay the basis overhead


# -- torch.compile -----------------------------------------------------------------------------

def test_torch_compile_model_with_fbconv2d():
    torch.manual_seed(0)
    model = to_interspace(vgg_like())
    for m in model.modules():
        if isinstance(m, FBConv2d):
            m.mask.bernoulli_(0.5, generator=_gen())
    x = torch.randn(2, 3, 8, 8)
    compiled = torch.compile(model, backend="inductor")
    y = compiled(x)
    torch.testing.assert_close(y, model(x), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    assert model[0].coefficients.grad is not None and model[0].basis.weight.grad is not None


def test_eval_takes_both_paths_and_caches_the_dense_filters():
    # dense path (full mask: cached reconstructed filters) and sparse path (1%)
    for density, key in ((1.0, "filters"), (0.01, None)):
        layer = FBConv2d(128, 128, 3, padding=1, basis=FilterBasis(3, init="orthonormal")).eval()
        layer.mask.bernoulli_(density, generator=_gen())
        x = torch.randn(2, 128, 8, 8)
        ref = lambda: fb_conv2d_reference(x, layer.coefficients, layer.basis.weight, layer.mask, layer.bias, padding=1)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), ref(), atol=1e-3, rtol=0)
            assert ("filters" in layer._compressed) == (key == "filters")
            layer.coefficients.mul_(0.5)  # an in-place update invalidates the cache
            torch.testing.assert_close(layer(x), ref(), atol=1e-4, rtol=0)
            torch.testing.assert_close(layer(x[0]), ref()[0], atol=1e-4, rtol=0)  # unbatched


def test_eval_path_choice_follows_density_and_input_shape(avx2_cost_model):
    # the per-shape path choice is cached with the CSR: a mask change re-decides it
    layer = FBConv2d(128, 128, 3, padding=1, basis=FilterBasis(3, init="orthonormal")).eval()
    layer.mask.bernoulli_(0.01, generator=_gen())
    ref = lambda x: fb_conv2d_reference(x, layer.coefficients, layer.basis.weight, layer.mask, layer.bias, padding=1)
    with torch.no_grad():
        for hw in (8, 4, 8):
            x = torch.randn(1, 128, hw, hw)
            torch.testing.assert_close(layer(x), ref(x), atol=1e-4, rtol=0)
        assert "filters" not in layer._compressed  # sparse at 1%
        layer.mask.fill_(1.0)
        x = torch.randn(1, 128, 8, 8)
        torch.testing.assert_close(layer(x), ref(x), atol=1e-3, rtol=0)
        assert "filters" in layer._compressed  # dense at 100%


def test_eval_output_is_an_ordinary_tensor():
    # the eval call runs below autograd; its output must still work in a later graph
    layer = FBConv2d(8, 8, 3, padding=1).eval()
    layer.mask.bernoulli_(0.05, generator=_gen())
    x = torch.randn(1, 8, 6, 6)
    with torch.no_grad():
        y = layer(x)
    assert not y.requires_grad and not y.is_inference()
    w = torch.ones((), requires_grad=True)
    (y * w).sum().backward()
    torch.testing.assert_close(w.grad, y.sum())


def test_eval_with_torch_prune_reparametrisation():
    # torch.nn.utils.prune replaces the coefficients parameter by an attribute
    import torch.nn.utils.prune as tprune

    layer = FBConv2d(4, 4, 3, padding=1).eval()
    tprune.l1_unstructured(layer, "coefficients", amount=0.5)
    x = torch.randn(1, 4, 5, 5)
    with torch.no_grad():
        ref = fb_conv2d_reference(x, layer.coefficients, layer.basis.weight, layer.mask, layer.bias, padding=1)
        torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=0)
        layer.coefficients_orig.mul_(2)
        ref = fb_conv2d_reference(x, layer.coefficients_orig * layer.coefficients_mask, layer.basis.weight,
                                  layer.mask, layer.bias, padding=1)
        torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("density", [0.02, 1.0])  # the sparse op and the dense filters
def test_eval_fast_path_follows_every_change(density, monkeypatch):
    """After one eval call without gradients, a repeated call with an input of
    the same shape takes the fast path (no _inference_forward); any change the
    full path depends on sends the call the full way again."""
    torch.manual_seed(0)
    layer = FBConv2d(16, 16, 3, padding=1, basis=FilterBasis(3, init="orthonormal")).eval()
    layer.mask.bernoulli_(density, generator=_gen())
    x = torch.randn(1, 16, 6, 6)

    def ref(inp=x):
        return fb_conv2d_reference(inp, layer.coefficients, layer.basis.weight, layer.mask, layer.bias,
                                   stride=layer.stride, padding=1)

    full = FBConv2d._inference_forward
    calls = []

    def counting(self, *a, **k):
        calls.append(1)
        return full(self, *a, **k)

    monkeypatch.setattr(FBConv2d, "_inference_forward", counting)

    def check(expect_full, inp=x):
        n = len(calls)
        with torch.no_grad():
            torch.testing.assert_close(layer(inp), ref(inp), atol=2e-5, rtol=0)
        assert len(calls) - n == int(expect_full)

    check(True)
    check(False)  # the fast path
    check(False)
    with torch.no_grad():
        layer.coefficients.mul_(-0.5)  # in place
    check(True)
    check(False)
    layer.mask.bernoulli_(density, generator=_gen(3))
    check(True)
    layer.mask = torch.ones_like(layer.mask)  # replaced
    check(True)
    with torch.no_grad():
        layer.basis.weight.mul_(2)  # a (shared) basis updated in place
    check(True)
    layer.basis = FilterBasis(3, init="random")  # another basis
    check(True)
    with torch.no_grad():
        layer.bias.add_(1.0)  # bias in place: read at call time
    check(False)
    layer.bias = torch.nn.Parameter(torch.randn(16))  # replaced
    check(True)
    layer.stride = (2, 2)
    check(True)
    check(False)
    check(True, torch.randn(1, 16, 7, 7))  # another shape
    check(True, x[0])  # unbatched
    check(False, x[0])
    layer.train()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref(), atol=2e-5, rtol=0)
    layer.eval()  # train()/eval() drop the caches (the remedy for writes through .data)
    check(True, x[0])
    with torch.enable_grad():  # gradients: the training path, not the cache
        y = layer(x)
        assert y.requires_grad
        torch.testing.assert_close(y.detach(), ref().detach(), atol=2e-5, rtol=0)
    check(False, x[0])
    with pytest.raises(ValueError, match="input"):  # errors still come from the full path
        with torch.no_grad():
            layer(torch.randn(1, 5, 6, 6))


# -- regressions (audit of the interspace layers) ------------------------------------------------

@pytest.fixture(params=[True, False], ids=["sparse", "dense"])
def forced_path(request, monkeypatch):
    """Pins the eval path of FBConv2d: the cached CSR (sparse) or the cached filters."""
    from prunopt.ops import interspace as ops_interspace
    monkeypatch.setattr(ops_interspace, "sparse_is_faster", lambda *a, **k: request.param)
    return request.param


def _conv_ref(layer, x):
    """nn.Conv2d with the layer's current filters: the expected output."""
    return layer.to_conv2d()(x)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_eval_cache_dropped_by_train_and_eval_after_data_writes(padding_mode, forced_path):
    # writes through .data bypass the version counter: train()/eval() (also on a
    # parent module) must make the next eval call rebuild the caches
    layer = FBConv2d(4, 4, 3, padding=1, padding_mode=padding_mode).eval()
    layer.mask.bernoulli_(0.5, generator=_gen())
    model = nn.Sequential(layer)
    x = torch.randn(1, 4, 6, 6)
    with torch.no_grad():
        y0 = layer(x)
        layer(x)  # the fast path is armed too
        layer.coefficients.data.mul_(2)
        layer.train()
        layer.eval()
        torch.testing.assert_close(layer(x), _conv_ref(layer, x), atol=1e-5, rtol=0)
        b = layer.bias.reshape(1, -1, 1, 1)
        torch.testing.assert_close(layer(x), 2 * (y0 - b) + b, atol=1e-5, rtol=0)  # not the stale y0
        layer.basis.weight.data.mul_(-1)
        model.train()
        model.eval()
        torch.testing.assert_close(layer(x), _conv_ref(layer, x), atol=1e-5, rtol=0)
        layer.mask.data.zero_()
        model.eval()  # already in eval: eval() still drops the caches
        torch.testing.assert_close(layer(x), b.expand(1, 4, 6, 6), atol=0, rtol=0)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_eval_cache_not_fooled_by_replaced_tensors_reusing_an_address(padding_mode, forced_path):
    # a new mask per pruning round: the new tensor may get the freed address of
    # an earlier one with the same version (0); the cache compares identity
    torch.manual_seed(0)
    layer = FBConv2d(8, 8, 3, padding=1, padding_mode=padding_mode, bias=False).eval()
    x = torch.randn(1, 8, 6, 6)
    stale = 0
    with torch.no_grad():
        for r in range(40):
            layer.mask = (torch.rand(8, 8, 9) < 0.5).float()
            if r % 2:
                continue
            stale += not torch.allclose(layer(x), _conv_ref(layer, x), atol=1e-5)
            stale += not torch.allclose(layer(x), _conv_ref(layer, x), atol=1e-5)  # the fast path
    assert stale == 0


def test_eval_cache_follows_data_assignment(forced_path):
    # p.data = new keeps the Parameter object and its version: the cache keeps
    # the old storage alive, so the new data pointer always differs
    layer = FBConv2d(4, 4, 3, padding=1).eval()
    x = torch.randn(1, 4, 5, 5)
    with torch.no_grad():
        for r in range(10):
            layer.coefficients.data = torch.randn(4, 4, 9)
            layer.mask.data = (torch.rand(4, 4, 9) < 0.5).float()
            torch.testing.assert_close(layer(x), _conv_ref(layer, x), atol=1e-5, rtol=0)
            torch.testing.assert_close(layer(x), _conv_ref(layer, x), atol=1e-5, rtol=0)


def test_copies_and_pickles_leave_the_eval_cache_behind():
    import copy
    import pickle

    layer = FBConv2d(4, 4, 3, padding=1).eval()
    x = torch.randn(1, 4, 5, 5)
    with torch.no_grad():
        layer(x)
        layer(x)
    assert layer._eval_fast is not None and layer._compressed
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other._compressed is None and other._eval_fast is None and other._compressed_refs is None
        with torch.no_grad():
            other.coefficients.mul_(3)
            torch.testing.assert_close(other(x), _conv_ref(other, x), atol=1e-5, rtol=0)
    assert layer._eval_fast is not None  # the original keeps its own
    layer.double()  # .to() drops the caches (they hold the old dtype)
    assert layer._compressed is None and layer._eval_fast is None


def test_to_interspace_converts_exact_conv2d_only():
    class MyConv(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(MyConv(3, 3, 3), nn.Conv2d(3, 3, 3))
    x = torch.randn(1, 3, 8, 8)
    y = model(x)
    assert to_interspace(model) is model
    assert type(model[0]) is MyConv and isinstance(model[1], FBConv2d)
    torch.testing.assert_close(model(x), y, atol=1e-5, rtol=0)


def test_to_interspace_replaces_a_tied_conv_under_every_name():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 3, 3, padding=1)
            self.b = self.a
            self.seq = nn.Sequential(self.a)

        def forward(self, x):
            return self.seq[0](self.b(self.a(x)))

    model = Tied()
    x = torch.randn(1, 3, 6, 6)
    y = model(x)
    to_interspace(model, init="orthonormal", generator=_gen())
    assert isinstance(model.a, FBConv2d) and model.a is model.b is model.seq[0]
    assert sum(isinstance(m, FBConv2d) for m in model.modules()) == 1
    torch.testing.assert_close(model(x), y, atol=1e-5, rtol=0)


def test_to_interspace_top_level_conv_returns_the_new_layer():
    conv = nn.Conv2d(3, 4, 3, padding=1).eval()
    x = torch.randn(2, 3, 5, 5)
    y = conv(x)
    out = to_interspace(conv, init="orthonormal")
    assert isinstance(out, FBConv2d) and not out.training
    assert type(conv) is nn.Conv2d and dict(conv.named_children()) == {}  # left unchanged
    torch.testing.assert_close(out(x), y, atol=1e-5, rtol=0)
    one = nn.Conv2d(3, 4, 1)
    assert to_interspace(one) is one  # 1x1 stays standard
    assert to_interspace(conv, sharing=lambda name, c: None) is conv


def test_to_interspace_bases_follow_dtype_and_device():
    model = nn.Sequential(nn.Conv2d(3, 3, 3), nn.Conv2d(3, 3, 3).double(), nn.Conv2d(3, 3, 3).double())
    to_interspace(model, sharing="coarse")
    assert model[0].basis is not model[1].basis and model[1].basis is model[2].basis
    assert model[0].basis.weight.dtype == torch.float32 and model[1].basis.weight.dtype == torch.float64
    x = torch.randn(1, 3, 7, 7, dtype=torch.float64)
    assert model[2](model[1](x)).dtype == torch.float64
    model = nn.Sequential(nn.Conv2d(3, 3, 3), nn.Conv2d(3, 3, 3).double())
    to_interspace(model, sharing=lambda name, conv: "all")
    assert model[0].basis.weight.dtype == torch.float32 and model[1].basis.weight.dtype == torch.float64


def test_fbconv2d_rejects_a_basis_of_another_dtype_or_device():
    with pytest.raises(ValueError, match="basis"):
        FBConv2d(2, 2, 3, basis=FilterBasis(3), dtype=torch.float64)
    with pytest.raises(ValueError, match="basis"):
        FBConv2d(2, 2, 3, basis=FilterBasis(3), device="meta")
    with pytest.raises(ValueError, match="basis"):
        FBConv2d.from_conv2d(nn.Conv2d(2, 2, 3).double(), FilterBasis(3))
    basis = FilterBasis(3, dtype=torch.float64)
    layer = FBConv2d(2, 2, 3, basis=basis)  # dtype=None takes the basis's
    assert layer.coefficients.dtype == torch.float64 and layer.basis is basis
    assert FBConv2d(2, 2, 3, basis=basis, dtype=torch.float64, device="cpu").basis is basis


@pytest.mark.parametrize("kwargs, exc", [
    (dict(init="orthonormal", size=9), ValueError),  # right for the 3x3 layer, wrong for the 5x5 one
    (dict(sharing=lambda name, conv: [name] if name == "1" else name), TypeError),  # unhashable at the second
])
def test_to_interspace_error_leaves_the_model_unchanged(kwargs, exc):
    model = nn.Sequential(nn.Conv2d(3, 3, 3), nn.Conv2d(3, 3, 5))
    before = list(model)
    with pytest.raises(exc):
        to_interspace(model, **kwargs)
    assert list(model) == before and all(type(m) is nn.Conv2d for m in model)


def test_meta_device_layer():
    layer = FBConv2d(2, 4, 3, padding=1, device="meta")
    assert layer.coefficients.device.type == "meta"
    x = torch.randn(1, 2, 5, 5, device="meta")
    assert layer(x).shape == (1, 4, 5, 5) and layer(x).device.type == "meta"
    layer.eval()
    with torch.no_grad():
        assert layer(x).shape == (1, 4, 5, 5)
        assert layer(x[0]).shape == (4, 5, 5)
    reflect = FBConv2d(2, 4, 3, padding=1, padding_mode="reflect", device="meta").eval()
    with torch.no_grad():
        assert reflect(x).shape == (1, 4, 5, 5)


@pytest.mark.parametrize("n", [4, 9, 16])
def test_pruning_rates_count_the_standard_network_for_a_dictionary(n):
    # D of eq. 9 (Wimmer et al.) is C_out C_in/groups K^2 whatever the dictionary size N
    layer = FBConv2d(2, 4, 3, groups=2, basis=FilterBasis(3, size=n, init="random", generator=_gen()))
    layer.mask.zero_()
    layer.mask[:, :, 0] = 1  # 4 non-zero coefficients
    r = pruning_rates(nn.Sequential(layer))
    d = 4 * 1 * 9
    assert r["D"] == d and r["nonzero"] == 4 and r["basis_nonzero"] == n * 9
    assert r["p_SP"] == pytest.approx(1 - 4 / d) and r["p_IP"] == pytest.approx(1 - (4 + 9 * n) / d)
    storage = interspace_report(nn.Sequential(layer))["storage_bytes"]
    assert storage["dense"] == 4 * d  # the standard network's weights, float32
    assert storage["csr"] == sparse_storage(4 * n, 4, rows=4)["csr"]  # the stored coefficients
    assert storage["entropy"] == pytest.approx(sparse_storage(4 * n, 4)["entropy"])
    assert storage["bases"] == 4 * 9 * n


def test_flops_have_no_side_effects_and_restore_every_mode():
    model = nn.Sequential(FBConv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Dropout(0.5),
                          nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3)))
    model.train()
    model[3].eval()  # mixed modes: restored per submodule
    modes = {name: m.training for name, m in model.named_modules()}
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 2, 5, 5)
    rng = torch.get_rng_state()
    f = interspace_flops(model, x)
    assert f["dense"] > 0
    assert {name: m.training for name, m in model.named_modules()} == modes
    for k, v in model.state_dict().items():  # running stats and num_batches_tracked untouched
        assert torch.equal(v, stats[k]), k
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew nothing
    assert model[0]._compressed is None  # no eval cache left on a training layer
    rep = interspace_report(model, x)
    assert rep["flops"] == f and {name: m.training for name, m in model.named_modules()} == modes
    with pytest.raises(ValueError):  # restored on an error too
        interspace_flops(model, torch.randn(2, 5, 5, 5))
    assert {name: m.training for name, m in model.named_modules()} == modes


@pytest.mark.parametrize("kernel_size, exc", [(3.0, TypeError), ((3, 3, 3), TypeError), ("3", TypeError),
                                              (0, ValueError), ((3, -1), ValueError)])
def test_kernel_size_errors_name_kernel_size(kernel_size, exc):
    with pytest.raises(exc, match="kernel_size"):
        FilterBasis(kernel_size)
    with pytest.raises(exc, match="kernel_size"):
        FBConv2d(4, 4, kernel_size)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(stride=0), ValueError, "stride"),
    (dict(stride=1.5), TypeError, "stride"),
    (dict(padding=-1, padding_mode="reflect"), ValueError, "padding"),
    (dict(padding=1.5), TypeError, "padding"),
    (dict(dilation=0), ValueError, "dilation"),
    (dict(init="bogus", basis=FilterBasis(3)), ValueError, "init"),
])
def test_conv_arguments_checked_when_built(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FBConv2d(4, 4, 3, **kwargs)


@pytest.mark.parametrize("train", [True, False])
def test_torch_func_transforms(train, forced_path):
    """torch.func.grad / vmap / jvp and forward-mode AD through the layer (the
    fused kernel's C++ autograd is not functorch-aware: the reference is used)."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import functional_call, grad, jvp, vmap

    torch.manual_seed(0)
    layer = FBConv2d(4, 4, 3, padding=1, padding_mode="reflect").train(train)
    layer.mask.bernoulli_(0.3, generator=_gen())
    conv = layer.to_conv2d().train(train)
    x, t = torch.randn(3, 4, 6, 6), torch.randn(3, 4, 6, 6)
    with torch.no_grad():  # arm the eval caches and the fast path
        layer(x)
        layer(x)
    torch.testing.assert_close(grad(lambda x: layer(x).square().sum())(x),
                               grad(lambda x: conv(x).square().sum())(x), atol=1e-4, rtol=1e-5)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    g = grad(lambda p: functional_call(layer, p, (x,)).square().sum())(params)
    layer.zero_grad()
    layer(x).square().sum().backward()
    for k, v in layer.named_parameters():
        torch.testing.assert_close(g[k], v.grad, atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(vmap(layer)(x), conv(x), atol=1e-5, rtol=0)
        _, tangent = jvp(layer, (x,), (t,))  # no_grad: the eval path would drop the tangent
        torch.testing.assert_close(tangent, conv(t) - conv.bias.reshape(1, -1, 1, 1), atol=1e-5, rtol=0)
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(layer(fwAD.make_dual(x, t))).tangent
        assert tangent is not None
        torch.testing.assert_close(tangent, conv(t) - conv.bias.reshape(1, -1, 1, 1), atol=1e-5, rtol=0)
        torch.testing.assert_close(layer(x), conv(x), atol=1e-5, rtol=0)  # the normal paths after


def test_init_with_basis_param_groups_and_compressed_bias_errors():
    from prunopt.ops import interspace as ops_interspace
    from prunopt.nn import FilterBasis, interspace_param_groups

    basis = FilterBasis(3, init="orthonormal")
    with pytest.raises(ValueError, match="init"):
        FBConv2d(2, 3, 3, basis=basis, init="standard")  # used to be ignored silently
    assert FBConv2d(2, 3, 3, basis=basis, init="orthonormal").basis is basis
    model = nn.Sequential(FBConv2d(2, 3, 3, basis=basis), FBConv2d(3, 3, 3, basis=basis))
    groups = interspace_param_groups(model, 1e-4, lr=0.1)
    assert [g["weight_decay"] for g in groups] == [1e-4, 0.0] and groups[1]["params"] == [basis.weight]
    for bad, exc in [(dict(weight_decay="1"), TypeError), (dict(weight_decay=-1.0), ValueError)]:
        with pytest.raises(exc, match="weight_decay"):
            interspace_param_groups(model, **bad)
    with pytest.raises(ValueError, match="params"):
        interspace_param_groups(model, 0.0, params=[])
    layer = model[0]
    c = ops_interspace.fb_compress(layer.coefficients, layer.mask)
    with pytest.raises(ValueError, match=r"bias must have the dtype and device of basis \(torch.float32, cpu\)"):
        ops_interspace.fb_conv2d_compressed(torch.randn(1, 2, 6, 6), c, basis.weight, torch.zeros(3, dtype=torch.float64))


def test_shared_basis_loaded_with_conflicting_values_is_an_error():
    torch.manual_seed(1)
    fine = to_interspace(vgg_like(), sharing="fine", init="random")
    coarse = to_interspace(vgg_like(), sharing="coarse")
    with pytest.raises(RuntimeError, match="shared with"):  # the last prefix used to win silently
        coarse.load_state_dict(fine.state_dict())
    # equal values under every prefix load fine (e.g. a fine model whose bases agree)
    fine2 = to_interspace(vgg_like(), sharing="fine")
    coarse2 = to_interspace(vgg_like(), sharing="coarse")
    coarse2.load_state_dict(fine2.state_dict())
    assert coarse2[0].basis is coarse2[3].basis
    coarse2.load_state_dict(coarse.state_dict())  # a later call starts afresh
