"""CUDA kernels against the CPU kernels (and the references) on the same data:
prunAdag's threshold and step, the FB ops, the optimizer on CUDA parameters.
Skipped without a GPU and the compiled CUDA kernels (CI has neither; a GPU
session runs them: ``python -m pytest -q tests/ops/test_cuda_kernels.py``)."""
import math

import pytest
import torch

import prunopt
from prunopt.reference.prunadag import TensorHyper
from test_prunadag_ops import _case as _lists, _hyper_tensor as _hyper  # same data builders as the CPU tests

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and prunopt.cuda_kernels_available()),
                                reason="needs a GPU and the CUDA kernels")


# the last two need several launches: more than 36 tensors, more than 320 chunks of 16384
SIZES = [[1], [4097, 13, 0, 7], [150_001], [70_001, 1, 65_536, 30_000] + [3] * 40, [5_300_001, 5]]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ties", [False, True])
def test_threshold_cuda_matches_cpu(sizes, dtype, ties):
    _, gs, _, _ = _lists(sizes, dtype, 0, ties)
    n = sum(sizes)
    for k in sorted({1, min(2, n), max(1, n // 10), max(1, n // 2), n}):
        cpu = torch.ops.prunopt.topk_threshold(gs, k)
        gpu = torch.ops.prunopt.topk_threshold([v.cuda() for v in gs], k)
        assert torch.equal(gpu.cpu(), cpu), (sizes, k)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("version", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("wd, maximize", [(0.0, False), (0.1, True)])
def test_step_cuda_matches_cpu(sizes, dtype, version, wd, maximize):
    xs, gs, so, sd = _lists(sizes, dtype, 1, False)
    hypers = [TensorHyper(lr=0.3, k=2.0, lr_decay=0.1, weight_decay=wd, eps=1e-8, maximize=maximize,
                          prune=not (i == len(sizes) - 1 and len(sizes) > 1)) for i in range(len(sizes))]
    n = sum(s for s, h in zip(sizes, hypers) if h.prune)
    T = max(1, math.ceil(0.1 * n))
    cpu = [[t.clone() for t in lst] for lst in (xs, so, sd)]
    torch.ops.prunopt.prunadag_step_(cpu[0], cpu[1], cpu[2], gs, _hyper(hypers), T, version)
    gpu = [[t.cuda() for t in lst] for lst in (xs, so, sd)]
    torch.ops.prunopt.prunadag_step_(gpu[0], gpu[1], gpu[2], [v.cuda() for v in gs], _hyper(hypers).cuda(), T,
                                     version)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-13, rtol=1e-12)
    for lc, lg in zip(cpu, gpu):
        for a, b in zip(lc, lg):
            torch.testing.assert_close(b.cpu(), a, **tol)


def test_step_cuda_nonfinite_flag_skips_writes():
    xs, gs, so, sd = _lists([5000, 300], torch.float32, 2, False)
    gs[1][7] = math.nan
    dev = [[t.cuda() for t in lst] for lst in (xs, so, sd)]
    before = [t.clone() for lst in dev for t in lst]
    flag = torch.zeros(1, device="cuda")
    torch.ops.prunopt.prunadag_step_(dev[0], dev[1], dev[2], [v.cuda() for v in gs],
                                     _hyper([TensorHyper(lr=1.0)] * 2).cuda(), 100, 3, flag)
    assert flag.item() == 1.0
    for a, b in zip([t for lst in dev for t in lst], before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("version", [1, 3, "relevant_only"])
@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_optimizer_cuda_matches_cpu(version, scope):
    torch.manual_seed(0)
    shapes = [(64, 33), (33,), (17, 5, 3)]
    ps_cpu = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    ps_gpu = [torch.nn.Parameter(p.detach().cuda()) for p in ps_cpu]
    opts = [prunopt.optim.PrunAdag(ps, lr=0.05, relevant=0.2, version=version, scope=scope, weight_decay=0.01,
                                   fused=True) for ps in (ps_cpu, ps_gpu)]
    for _ in range(5):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for pc, pg, g in zip(ps_cpu, ps_gpu, grads):
            pc.grad, pg.grad = g.clone(), g.cuda()
        for o in opts:
            o.step()
    for pc, pg in zip(ps_cpu, ps_gpu):
        torch.testing.assert_close(pg.detach().cpu(), pc.detach(), atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------- filter-basis ops

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("co, ci, k, n", [(64, 32, 3, 9), (8, 5, 3, 4), (16, 8, 5, 25), (13, 11, 3, 9), (4, 3, 7, 60)])
def test_fb_reconstruct_and_backward_cuda_matches_cpu(dtype, co, ci, k, n):
    g = torch.Generator().manual_seed(3)
    lam = torch.randn(co, ci, n, generator=g, dtype=dtype)
    basis = torch.randn(n, k, k, generator=g, dtype=dtype)
    mask = (torch.rand(co, ci, n, generator=g) > 0.4).to(dtype)
    gh = torch.randn(co, ci, k, k, generator=g, dtype=dtype)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-11, rtol=1e-10)
    for m in (mask, None):
        h = torch.ops.prunopt.fb_reconstruct(lam, basis, m)
        hg = torch.ops.prunopt.fb_reconstruct(lam.cuda(), basis.cuda(), None if m is None else m.cuda())
        torch.testing.assert_close(hg.cpu(), h, **tol)
        a = torch.ops.prunopt.fb_reconstruct_backward(gh, lam, basis, m, [True, True])
        b = torch.ops.prunopt.fb_reconstruct_backward(gh.cuda(), lam.cuda(), basis.cuda(),
                                                      None if m is None else m.cuda(), [True, True])
        for u, v in zip(a, b):
            torch.testing.assert_close(v.cpu(), u, **tol)


@pytest.mark.parametrize("path", ["dense", "sparse"])
@pytest.mark.parametrize("stride, padding, dilation, groups", [(1, 1, 1, 1), (2, 0, 1, 1), (1, 2, 2, 2)])
def test_fb_conv2d_cuda_matches_cpu_with_grads(path, stride, padding, dilation, groups):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 8, 11, 9, generator=g, dtype=torch.float64)
    lam = torch.randn(6, 8 // groups, 9, generator=g, dtype=torch.float64)
    basis = torch.randn(9, 3, 3, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 8 // groups, 9, generator=g) > 0.7).double()
    bias = torch.randn(6, generator=g, dtype=torch.float64)
    outs = []
    for dev in ("cpu", "cuda"):
        leaves = [t.detach().to(dev).requires_grad_(True) for t in (x, lam, basis, bias)]
        y = prunopt.ops.fb_conv2d(leaves[0], leaves[1], leaves[2], mask.to(dev), leaves[3], stride, padding, dilation,
                                  groups, path=path)
        y.backward(torch.ones_like(y))
        outs.append([y.detach().cpu()] + [t.grad.cpu() for t in leaves])
    for u, v in zip(*outs):
        torch.testing.assert_close(v, u, atol=1e-10, rtol=1e-9)


def test_fbconv2d_layer_cuda_train_and_eval():
    from prunopt.nn import FBConv2d, FilterBasis
    torch.manual_seed(5)
    layer = FBConv2d(16, 32, 3, padding=1, basis=FilterBasis(3, init="orthonormal"))
    layer.mask.bernoulli_(0.05)
    x = torch.randn(2, 16, 10, 10)
    ref = layer(x)
    gl = layer.cuda()
    torch.testing.assert_close(gl(x.cuda()).cpu(), ref, atol=1e-4, rtol=1e-4)
    gl.eval()
    with torch.no_grad():
        torch.testing.assert_close(gl(x.cuda()).cpu(), ref.detach(), atol=1e-4, rtol=1e-4)


def test_fbconv2d_layer_cuda_gradients_and_autocast():
    """The training path on CUDA (fb_reconstruct's C++ autograd, then cuDNN) gives the
    CPU layer's gradients; under float16 autocast it runs as nn.Conv2d does."""
    from prunopt.nn import FBConv2d, FilterBasis
    torch.manual_seed(6)
    layer = FBConv2d(16, 32, 3, padding=1, basis=FilterBasis(3, init="orthonormal")).double()
    layer.mask.bernoulli_(0.5)
    x = torch.randn(2, 16, 8, 8, dtype=torch.float64)
    layer(x).square().sum().backward()
    expected = (layer.coefficients.grad.clone(), layer.basis.weight.grad.clone())
    gl = layer.cuda()
    gl.zero_grad(set_to_none=True)
    y = gl(x.cuda())
    assert "CppNode" in y.grad_fn.next_functions[1][0].name()  # the filters' node: C++ autograd
    y.square().sum().backward()
    for got, exp in zip((gl.coefficients.grad, gl.basis.weight.grad), expected):
        torch.testing.assert_close(got.cpu(), exp, atol=1e-9, rtol=1e-9)
    gl = gl.float()
    conv = gl.to_conv2d()
    with torch.autocast("cuda", dtype=torch.float16):
        y = gl(x.float().cuda())
        y_ref = conv(x.float().cuda())
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert gl.coefficients.grad.dtype == torch.float32 and torch.isfinite(gl.coefficients.grad).all()


@pytest.mark.parametrize("count", [1, 50])
def test_optimizer_cuda_step_does_not_synchronise(count):
    # a synchronising call inside step() would make the host wait for the device
    # every step (seen before: a pageable host-to-device copy, and
    # _foreach_add_ with a one-tensor scalar reading it on the host)
    ps = [torch.nn.Parameter(torch.randn(100 + i, device="cuda")) for i in range(count)]
    opt = prunopt.optim.PrunAdag(ps, lr=0.1, relevant=0.1, fused=True)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()  # state initialised outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert opt.state[ps[0]]["step"].item() == 2.0
