"""The pruning toolkit on interspace (FBConv2d) coefficients: IP scores with the
standard basis equal SP scores (App. F), masks hold, eq. 9, LT rewinds bases,
DST counts, export to a plain model."""
import copy

import pytest
import torch
import torch.nn.functional as F

import prunopt
from prunopt.nn import FBConv2d, to_interspace
from prunopt.pruning import (
    DynamicSparseTraining,
    LotteryTicket,
    Masker,
    PruningAtInit,
    export_csr,
    grasp_scores,
    magnitude_scores,
    pruning_rates,
    random_scores,
    remove_masks,
    snip_scores,
    synflow_scores,
)

from _pruning_helpers import TinyNet, batch, random_masks


def _pair(dtype=torch.float32, sharing="fine"):
    torch.manual_seed(0)
    sp = TinyNet().to(dtype)
    ip = to_interspace(copy.deepcopy(sp), sharing=sharing, init="standard")
    return sp, ip


def test_ip_tensors_are_coefficients():
    _, ip = _pair()
    masker = Masker(ip)
    assert list(masker.tensors) == ["conv1.coefficients", "conv2.coefficients", "fc.weight"]
    assert all("basis" not in n for n in masker.tensors)
    assert masker["conv1"].spatial_shape == (3, 1, 3, 3)


@pytest.mark.parametrize("score", ["random", "magnitude", "snip", "grasp", "synflow"])
def test_ip_scores_with_standard_basis_equal_sp_scores(score):
    sp, ip = _pair(torch.float64)
    b = [batch(seed=1, dtype=torch.float64), batch(seed=2, dtype=torch.float64)]
    fn = {
        "random": lambda t: random_scores(t, torch.Generator().manual_seed(5)),
        "magnitude": magnitude_scores,
        "snip": lambda t: snip_scores(t, b),
        "grasp": lambda t: grasp_scores(t, b),
        "synflow": lambda t: synflow_scores(t, b[0][0]),
    }[score]
    s_sp, s_ip = fn(Masker(sp)), fn(Masker(ip))
    for (n_sp, a), (n_ip, c) in zip(s_sp.items(), s_ip.items()):
        assert n_sp.rsplit(".", 1)[0] == n_ip.rsplit(".", 1)[0]
        torch.testing.assert_close(c.reshape(-1), a.reshape(-1), rtol=1e-10, atol=1e-12)


def _opts():
    opts = {
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    }
    if getattr(prunopt.optim, "PrunAdag", None) is not None:
        opts["prunadag"] = lambda ps: prunopt.optim.PrunAdag(ps)
    return opts


@pytest.mark.parametrize("opt_name", sorted(_opts()))
def test_ip_masks_hold_and_bases_train(opt_name):
    _, ip = _pair(sharing="coarse")
    opt = _opts()[opt_name](ip.parameters())
    masker = Masker(ip, opt)
    basis0 = ip.conv1.basis.weight.detach().clone()
    x, y = batch()
    F.cross_entropy(ip(x), y).backward()
    opt.step()
    masker.set_masks(random_masks(masker, 0.4))
    assert ip.conv1.basis is ip.conv2.basis  # coarse sharing
    for i in range(3):
        x, y = batch(seed=i + 3)
        opt.zero_grad()
        F.cross_entropy(ip(x), y).backward()
        opt.step()
        masker.step()
        for n, pt in masker.tensors.items():
            pruned = ~pt.mask.bool()
            assert torch.equal(pt.parameter.detach()[pruned], torch.zeros(int(pruned.sum())))
            for v in opt.state[pt.parameter].values():
                if torch.is_tensor(v) and v.shape == pt.parameter.shape:
                    assert torch.equal(v[pruned], torch.zeros_like(v[pruned]))
    assert not torch.equal(ip.conv1.basis.weight.detach(), basis0)  # the basis is trained, never masked
    ip.eval()
    out = ip(x)
    plain = remove_masks(copy.deepcopy(ip), to_conv2d=True)
    assert not any(isinstance(m, FBConv2d) for m in plain.modules())
    torch.testing.assert_close(plain(x), out, rtol=1e-5, atol=1e-5)


def test_pruning_rates_eq9():
    sp, ip = _pair(sharing="coarse")
    m_sp, m_ip = Masker(sp), Masker(ip)
    masks = random_masks(m_sp, 0.3)
    m_sp.set_masks(masks)
    m_ip.set_masks({n.replace("conv1.weight", "conv1.coefficients").replace("conv2.weight", "conv2.coefficients"):
                    m.reshape(m_ip[n.rsplit(".", 1)[0]].parameter.shape) for n, m in masks.items()})
    r_sp, r_ip = pruning_rates(m_sp), pruning_rates(m_ip)
    assert r_sp["p_sp"] == r_sp["p_ip"] == pytest.approx(r_ip["p_sp"])
    assert r_ip["D"] == r_sp["D"]
    assert r_ip["basis_nonzero"] == 9  # one shared standard basis, counted once
    assert r_ip["p_ip"] == pytest.approx(1 - (r_ip["nonzero"] + 9) / r_ip["D"])
    ref = prunopt.nn.pruning_rates(ip)  # the interspace module's own eq. 9
    assert ref["p_SP"] == pytest.approx(r_ip["p_sp"]) and ref["p_IP"] == pytest.approx(r_ip["p_ip"])
    assert export_csr(m_ip)["sparsity"] == pytest.approx(r_ip["p_sp"])


def test_lottery_ticket_rewinds_bases():
    _, ip = _pair()
    opt = torch.optim.SGD(ip.parameters(), lr=0.1, momentum=0.9)
    masker = Masker(ip, opt)
    lt = LotteryTicket(masker, opt, sparsity=0.5, t0=1)
    x, y = batch()
    for i in range(4):
        opt.zero_grad()
        F.cross_entropy(ip(x), y).backward()
        opt.step()
        lt.step()
        if i == 0:
            t0 = {k: v.clone() for k, v in ip.state_dict().items()}
    assert not torch.equal(ip.conv2.basis.weight.detach(), t0["conv2.basis.weight"])
    lt.prune_and_rewind()
    for k, v in ip.state_dict().items():
        if k.endswith("basis.weight") or k.startswith("bn") or k.endswith("bias"):
            assert torch.equal(v, t0[k]), k
    assert bool(masker.masks()["fc.weight"].all())


@pytest.mark.parametrize("mode", ["set", "rigl"])
def test_dst_ip_counts_match_sp(mode):
    sp, ip = _pair()
    c_sp = Masker(sp)
    c_ip = Masker(ip, torch.optim.SGD(ip.parameters(), lr=0.1))
    DynamicSparseTraining(c_sp, 0.7, total_steps=10, mode=mode, update_interval=1)
    dst = DynamicSparseTraining(c_ip, 0.7, total_steps=10, mode=mode, update_interval=1,
                                generator=torch.Generator().manual_seed(0))
    assert list(c_sp.counts().values()) == list(c_ip.counts().values())
    counts = c_ip.counts()
    x, y = batch()
    for _ in range(3):
        c_ip.optimizers[0].zero_grad()
        F.cross_entropy(ip(x), y).backward()
        c_ip.optimizers[0].step()
        dst.step(closure=lambda: F.cross_entropy(ip(x), y))
        assert c_ip.counts() == counts
    assert dst.updates == 3


def test_pai_on_ip_exact_count_and_dense_gradients():
    _, ip = _pair()
    masker = Masker(ip)
    PruningAtInit(masker, "snip", 0.75).prune(batches=[batch()])
    total = sum(pt.parameter.numel() for pt in masker.tensors.values())
    assert sum(masker.counts().values()) == int(0.25 * total)
    x, y = batch(seed=4)
    dense = masker.dense_gradients(lambda: F.cross_entropy(ip(x), y))
    plain = copy.deepcopy(ip)
    for m in plain.modules():
        if isinstance(m, FBConv2d):
            m.mask.fill_(1)
    remove_masks(plain)
    ref = torch.autograd.grad(F.cross_entropy(plain(x), y), [plain.conv1.coefficients, plain.conv2.coefficients])
    torch.testing.assert_close(dense["conv1.coefficients"], ref[0])
    torch.testing.assert_close(dense["conv2.coefficients"], ref[1])


def test_ip_masks_under_torch_compile():
    _, ip = _pair()
    ip.bn = torch.nn.Identity()
    opt = torch.optim.SGD(ip.parameters(), lr=0.05, momentum=0.9)
    masker = Masker(ip, opt)
    masker.set_masks(random_masks(masker, 0.5))
    compiled = torch.compile(ip, backend="aot_eager")
    x, y = batch()
    torch.testing.assert_close(compiled(x), ip(x))
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(compiled(x), y).backward()
        opt.step()
        masker.step()
    for pt in masker.tensors.values():
        pruned = ~pt.mask.bool()
        assert torch.count_nonzero(pt.parameter.detach()[pruned]) == 0
        assert torch.count_nonzero(opt.state[pt.parameter]["momentum_buffer"][pruned]) == 0


def test_non_square_kernels_use_kh_kw():
    from prunopt.nn import FilterBasis

    model = torch.nn.Sequential(FBConv2d(4, 8, (3, 1)), FBConv2d(8, 8, (1, 3)))
    masker = Masker(model)
    assert masker["0.coefficients"].spatial_shape == (8, 4, 3, 1)
    assert masker["1.coefficients"].spatial_shape == (8, 8, 1, 3)
    assert masker["0"].spatial_numel == 8 * 4 * 3
    rates = pruning_rates(masker)
    ref = prunopt.nn.pruning_rates(model)
    assert rates["p_sp"] == 0.0 == ref["p_SP"]
    assert rates["D"] == ref["D"] == 8 * 4 * 3 + 8 * 8 * 3
    assert rates["p_ip"] == pytest.approx(ref["p_IP"])
    # a dictionary of N != kh kw elements: D still counts the standard network's kh kw weights
    d = torch.nn.Sequential(FBConv2d(2, 3, (3, 2), basis=FilterBasis((3, 2), size=4, init="random")))
    assert Masker(d)["0"].spatial_shape == (3, 2, 3, 2)
    assert pruning_rates(d)["D"] == prunopt.nn.pruning_rates(d)["D"] == 3 * 2 * 6


@pytest.mark.parametrize("mode", ["set", "rigl"])
def test_dst_with_a_dictionary_keeps_the_target(mode):
    from prunopt.nn import FilterBasis

    torch.manual_seed(0)
    basis = FilterBasis(3, size=4, init="random")
    model = torch.nn.Sequential(
        FBConv2d(1, 16, 3, padding=1, basis=basis), torch.nn.ReLU(),
        FBConv2d(16, 32, 3, padding=1, basis=basis), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 4),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masker = Masker(model, opt)
    dst = DynamicSparseTraining(masker, 0.5, total_steps=10, mode=mode, update_interval=1,
                                generator=torch.Generator().manual_seed(0))
    d = sum(pt.parameter.numel() for pt in masker.tensors.values())
    counts = masker.counts()
    assert counts == dst.layer_counts
    assert sum(counts.values()) == int(0.5 * d)  # the global target, over the masked coefficients
    assert masker.sparsity() == pytest.approx(0.5, abs=1 / d)
    assert all(counts[n] <= pt.parameter.numel() for n, pt in masker.tensors.items())
    # ERK densities of the spatial weights (as SP), applied to the N-entry coefficient tensors
    from prunopt.pruning import erk_densities

    dens = erk_densities({n: pt.spatial_shape for n, pt in masker.tensors.items()}, 0.5,
                         numels={n: pt.parameter.numel() for n, pt in masker.tensors.items()})
    for n, pt in masker.tensors.items():
        assert abs(counts[n] - dens[n] * pt.parameter.numel()) <= 1, n
    x, y = batch()
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        dst.step(closure=lambda: F.cross_entropy(model(x), y))
        assert masker.counts() == counts
    assert dst.updates == 3
