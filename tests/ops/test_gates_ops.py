"""rgf_relu, sparse_gate and two_temperature_sigmoid (Lee; Colombo & Gao): kernels vs the
float64 reference, custom backwards vs the papers' formulas, opcheck, gradcheck,
torch.compile and argument errors."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, strategies as st

import prunopt
from prunopt.ops import rgf_relu, sparse_gate, two_temperature_sigmoid
from prunopt.reference import (
    rgf_relu_backward_reference,
    rgf_relu_composed,
    rgf_relu_reference,
    sparse_gate_backward_reference,
    sparse_gate_composed,
    sparse_gate_reference,
    two_temperature_sigmoid_backward_reference,
    two_temperature_sigmoid_composed,
    two_temperature_sigmoid_reference,
)
from prunopt.testing import devices, tolerance

needs_ext = pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built")


def _make(n, layout, dtype, seed, scale, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    if layout == "2d" and n % 2 == 0 and n > 0:
        x = x.reshape(2, n // 2)
    elif layout == "noncontig":
        x = torch.stack([x, x + 1], 1)[:, 0]
    return x.to(dtype=dtype, device=device)


elementwise_case = st.tuples(
    st.sampled_from([0, 1, 2, 7, 64, 257, 4097]),
    st.sampled_from(["flat", "2d", "noncontig"]),
    st.sampled_from([torch.float32, torch.float64]),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.01, 1.0, 5.0, 100.0]),
)


# ---------------------------------------------------------------- rgf_relu
@given(elementwise_case, st.sampled_from([0.0, 0.1, 1.0]))
@example((4097, "noncontig", torch.float32, 3, 5.0), 0.1)
def test_rgf_relu_matches_reference(case, alpha):
    n, layout, dtype, seed, scale = case
    for dev in devices():
        x = _make(n, layout, dtype, seed, scale, dev).requires_grad_(True)
        y = rgf_relu(x, alpha)
        torch.testing.assert_close(y, rgf_relu_reference(x.detach(), alpha), **tolerance(dtype))
        g = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, x, g)
        expected = rgf_relu_backward_reference(g.double(), x.detach().double(), alpha)
        torch.testing.assert_close(gx.double(), expected, atol=tolerance(dtype)["atol"] * (1 + g.abs().amax().item() if g.numel() else 1), rtol=0)


def test_rgf_relu_backward_is_elu_derivative():
    # eq. 15: the gradient of rgf_relu is the derivative of elu(x; alpha), checked
    # against finite differences of elu (float64, away from the kink at 0).
    x = torch.tensor([-3.0, -1.0, -0.25, -1e-3, 0.2, 1.5, 4.0], dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(rgf_relu(x, 0.1).sum(), x)
    h = 1e-6
    fd = (F.elu(x.detach() + h, 0.1) - F.elu(x.detach() - h, 0.1)) / (2 * h)
    torch.testing.assert_close(gx, fd, atol=1e-8, rtol=0)
    assert torch.equal(rgf_relu(x, 0.1), torch.relu(x))  # relu forward
    # alpha = 0: the plain relu gradient, gradcheck holds away from 0
    torch.autograd.gradcheck(lambda t: rgf_relu(t, 0.0), (x,))


def test_rgf_relu_composed_matches_kernel():
    x = torch.randn(300, dtype=torch.float64, requires_grad=True)
    g = torch.randn(300, dtype=torch.float64)
    a = torch.autograd.grad(rgf_relu(x, 0.3), x, g)[0]
    b = torch.autograd.grad(rgf_relu_composed(x, 0.3), x, g)[0]
    torch.testing.assert_close(a, b, atol=1e-14, rtol=0)


def test_rgf_relu_keeps_nan_and_low_precision():
    x = torch.tensor([float("nan"), -1.0, 2.0])
    assert torch.isnan(rgf_relu(x)[0])
    for dt in (torch.bfloat16, torch.float16):
        xl = torch.randn(50).to(dt)
        torch.testing.assert_close(rgf_relu(xl), torch.relu(xl), **tolerance(dt))


# ---------------------------------------------------------------- sparse_gate
gate_case = st.tuples(
    st.sampled_from([1, 3, 17]),  # groups
    st.sampled_from([1, 2, 5, 64, 300]),  # gates per group
    st.sampled_from([torch.float32, torch.float64]),
    st.booleans(),  # signed
    st.booleans(),  # rgf
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.1, 1.0, 3.0]),
)


@given(gate_case)
@example((3, 5, torch.float64, False, True, 0, 3.0))
@example((1, 1, torch.float32, True, True, 1, 1.0))
def test_sparse_gate_matches_reference(case):
    groups, n, dtype, signed, rgf, seed, scale = case
    gen = torch.Generator().manual_seed(seed)
    alpha = (torch.randn(groups, n, generator=gen, dtype=torch.float64) * scale).to(dtype)
    beta = (torch.randn(groups, generator=gen, dtype=torch.float64) * 2 - 1).to(dtype)
    for dev in devices():
        al = alpha.to(dev).requires_grad_(True)
        be = beta.to(dev).requires_grad_(True)
        a = sparse_gate(al, be, signed=signed, rgf=rgf)
        torch.testing.assert_close(a.double(), sparse_gate_reference(alpha.double(), beta.double(), signed).to(dev),
                                   **tolerance(dtype))
        g = torch.randn(groups, n, generator=gen, dtype=torch.float64)
        ga, gb = torch.autograd.grad(a, (al, be), g.to(dtype=dtype, device=dev))
        ra, rb = sparse_gate_backward_reference(g, alpha.double(), beta.double(), signed, 0.1 if rgf else 0.0)
        scale_g = 1 + ra.abs().max().item() + rb.abs().max().item()
        tol = dict(atol=(1e-10 if dtype == torch.float64 else 1e-4) * scale_g, rtol=0)
        torch.testing.assert_close(ga.double().cpu(), ra, **tol)
        torch.testing.assert_close(gb.double().cpu(), rb, **tol)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("rgf_alpha", [0.0, 0.1, 0.7])
def test_sparse_gate_backward_equals_composed_autograd(signed, rgf_alpha):
    # the hand-derived kernel backward equals autograd through the plain-PyTorch
    # composition (relu forward / elu backward via straight-through).
    torch.manual_seed(1)
    alpha = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    beta = torch.randn(4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 9, dtype=torch.float64)
    a = sparse_gate(alpha, beta, signed=signed, rgf=rgf_alpha > 0, rgf_alpha=rgf_alpha or 0.1)
    k = torch.autograd.grad(a, (alpha, beta), g)
    c = torch.autograd.grad(sparse_gate_composed(alpha, beta, signed, rgf_alpha), (alpha, beta), g)
    for u, v in zip(k, c):
        torch.testing.assert_close(u, v, atol=1e-13, rtol=0)


@pytest.mark.parametrize("signed", [True, False])
def test_sparse_gate_gradcheck_without_rgf(signed):
    # rgf=False: the exact derivative of eq. 10-12 (gradcheck, float64, no entry at a kink).
    torch.manual_seed(2)
    alpha = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    beta = torch.randn(3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: sparse_gate(a, b, signed=signed, rgf=False), (alpha, beta))


def _hvp(f, inputs):
    """Gradient of ||d/dinputs sum(f(inputs) * weights)^2|| : a second-order quantity
    (a Hessian-vector product, as GraSP takes) through the op's backward."""
    out = f(*inputs)
    weights = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).reshape(out.shape)
    grads = torch.autograd.grad((out * weights).pow(2).sum(), inputs, create_graph=True)
    return torch.autograd.grad(sum((g * g).sum() for g in grads), inputs)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("rgf_alpha", [0.0, 0.1])
def test_double_backward_equals_composed(signed, rgf_alpha):
    """create_graph=True: the backward kernels have no autograd of their own, so the
    second-order terms used to be silently wrong (a constant gradient); they now
    equal those of the composed ops, for all three ops."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, dtype=torch.float64, generator=g).requires_grad_()
    for op, ref in ((lambda t: rgf_relu(t, rgf_alpha), lambda t: rgf_relu_composed(t, rgf_alpha)),
                    (lambda t: two_temperature_sigmoid(t, 10.0, 1.5), lambda t: two_temperature_sigmoid_composed(t, 10.0, 1.5))):
        for a, b in zip(_hvp(lambda t: op(t * 1.3), (x,)), _hvp(lambda t: ref(t * 1.3), (x,))):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    alpha = torch.randn(4, 6, dtype=torch.float64, generator=g).requires_grad_()
    beta = torch.randn(4, dtype=torch.float64, generator=g).requires_grad_()
    kw = dict(rgf_alpha=rgf_alpha) if rgf_alpha > 0 else dict(rgf=False)
    got = _hvp(lambda a, b: sparse_gate(a, b, signed=signed, **kw), (alpha, beta))
    want = _hvp(lambda a, b: sparse_gate_composed(a, b, signed, rgf_alpha), (alpha, beta))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_gradgradcheck_float64():
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 5, dtype=torch.float64, generator=g) + 0.05).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: rgf_relu(t, 0.1), (x,))
    assert torch.autograd.gradgradcheck(lambda t: two_temperature_sigmoid(t, 4.0, 1.0), (x,))
    alpha = torch.randn(2, 5, dtype=torch.float64, generator=g).requires_grad_()
    beta = torch.randn(2, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda a, b: sparse_gate(a, b, signed=False, rgf=False), (alpha, beta))


def test_signed_gate_rgf_gradient_is_elu_chain_rule():
    # eq. 15 for eq. 12: d a_i / d alpha = d[sign(alpha_i) elu(|alpha_i| - s||alpha||_1)] (finite differences).
    torch.manual_seed(3)
    alpha = torch.randn(1, 7, dtype=torch.float64, requires_grad=True)
    beta = torch.tensor([-0.5], dtype=torch.float64, requires_grad=True)

    def surrogate(a, b):
        u = a.abs() - torch.sigmoid(b).unsqueeze(-1) * a.abs().sum(-1, keepdim=True)
        return torch.sign(a) * F.elu(u, 0.1)

    g = torch.randn(1, 7, dtype=torch.float64)
    k = torch.autograd.grad(sparse_gate(alpha, beta), (alpha, beta), g)
    jac = torch.autograd.functional.jacobian(surrogate, (alpha.detach(), beta.detach()))
    expected = [(g.reshape(-1, 1) * j.reshape(7, -1)).sum(0).reshape(t.shape) for j, t in zip(jac, (alpha, beta))]
    for u, v in zip(k, expected):
        torch.testing.assert_close(u, v, atol=1e-12, rtol=0)


def test_sparse_gate_dim_and_batched_groups():
    torch.manual_seed(4)
    alpha = torch.randn(5, 3, 4, dtype=torch.float64)
    beta = torch.randn(3, 4, dtype=torch.float64)
    a = sparse_gate(alpha, beta, dim=0)
    ref = sparse_gate_reference(alpha.movedim(0, -1), beta).movedim(-1, 0)
    torch.testing.assert_close(a, ref, atol=1e-14, rtol=0)
    # 1-D alpha: one group, scalar beta
    a1 = sparse_gate(alpha[:, 0, 0], beta[0, 0])
    torch.testing.assert_close(a1, ref[:, 0, 0], atol=1e-14, rtol=0)


def test_signed_gate_paper_initialisation_is_half():
    for n in [1, 2, 3, 10, 64, 1000]:
        alpha = torch.full((n,), 0.5 * (n + 1) / n, dtype=torch.float64)
        beta = torch.tensor(-math.log(n * n + n - 1), dtype=torch.float64)
        torch.testing.assert_close(sparse_gate(alpha, beta), torch.full((n,), 0.5, dtype=torch.float64),
                                   atol=1e-14, rtol=0)


def test_nonnegative_gates_sum_to_one_or_zero():
    alpha = torch.randn(6, 8, dtype=torch.float64)
    a = sparse_gate(alpha, torch.full((6,), -3.0, dtype=torch.float64), signed=False)
    torch.testing.assert_close(a.sum(-1), torch.ones(6, dtype=torch.float64), atol=1e-14, rtol=0)
    assert (a >= 0).all()
    # a threshold above every gamma: all gates 0 (no NaN), gradient finite
    al = alpha.clone().requires_grad_(True)
    be = torch.full((6,), 30.0, dtype=torch.float64, requires_grad=True)
    a = sparse_gate(al, be, signed=False)
    assert torch.equal(a, torch.zeros_like(a))
    ga, gb = torch.autograd.grad(a.sum(), (al, be))
    assert torch.isfinite(ga).all() and torch.isfinite(gb).all()


# ---------------------------------------------------------------- two-temperature sigmoid
@given(elementwise_case, st.sampled_from([(1000.0, 10.0), (1000.0, 1.0), (1000.0, 1000.0), (5.0, 0.5)]))
@example((4097, "flat", torch.float32, 7, 0.01), (1000.0, 10.0))
def test_two_temperature_sigmoid_matches_reference(case, temps):
    n, layout, dtype, seed, scale = case
    t_l, t_s = temps
    for dev in devices():
        w = _make(n, layout, dtype, seed, scale, dev).requires_grad_(True)
        v = two_temperature_sigmoid(w, t_l, t_s)
        torch.testing.assert_close(v.double(), two_temperature_sigmoid_reference(w.detach().double(), t_l, t_s),
                                   **tolerance(dtype))
        g = torch.randn_like(v)
        (gw,) = torch.autograd.grad(v, w, g)
        exp_ = two_temperature_sigmoid_backward_reference(g.double(), w.detach().double(), t_s)
        tol = tolerance(dtype)["atol"] * (1 + t_s * (g.abs().amax().item() if g.numel() else 0))
        torch.testing.assert_close(gw.double(), exp_, atol=tol, rtol=0)


def test_two_temperature_backward_is_soft_sigmoid_derivative():
    # eq. 7: dv/dw = t_s sigma(t_s w)(1 - sigma(t_s w)) = d sigmoid(t_s w)/dw (finite differences)
    w = torch.linspace(-0.5, 0.5, 41, dtype=torch.float64, requires_grad=True)
    (gw,) = torch.autograd.grad(two_temperature_sigmoid(w, 1000.0, 10.0).sum(), w)
    h = 1e-7
    fd = (torch.sigmoid(10.0 * (w.detach() + h)) - torch.sigmoid(10.0 * (w.detach() - h))) / (2 * h)
    torch.testing.assert_close(gw, fd, atol=1e-7, rtol=0)
    torch.testing.assert_close(two_temperature_sigmoid(w, 1000.0, 10.0), torch.sigmoid(1000.0 * w), atol=1e-15, rtol=0)
    # t_s = t_l is the plain sigmoid: gradcheck
    torch.autograd.gradcheck(lambda t: two_temperature_sigmoid(t, 3.0, 3.0), (w,))
    # default t_s = t_l / 100
    (gd,) = torch.autograd.grad(two_temperature_sigmoid(w).sum(), w)
    torch.testing.assert_close(gd, gw, atol=1e-15, rtol=0)


def test_two_temperature_composed_matches_kernel():
    w = torch.randn(500, dtype=torch.float64, requires_grad=True) * 0.01
    w.retain_grad()
    g = torch.randn(500, dtype=torch.float64)
    leaf = w.detach().requires_grad_(True)
    a = torch.autograd.grad(two_temperature_sigmoid(leaf, 1000.0, 10.0), leaf, g)[0]
    b = torch.autograd.grad(two_temperature_sigmoid_composed(leaf, 1000.0, 10.0), leaf, g)[0]
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_two_temperature_extremes_are_finite():
    w = torch.tensor([-1e30, -50.0, 0.0, 50.0, 1e30, float("inf"), -float("inf")], requires_grad=True)
    v = two_temperature_sigmoid(w, 1000.0, 10.0)
    assert torch.equal(v.detach(), torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 0.0]))
    (gw,) = torch.autograd.grad(v.sum(), w)
    assert torch.isfinite(gw).all()


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_temperatures_raise(bad):
    w = torch.randn(4)
    with pytest.raises(ValueError, match="t_l"):
        two_temperature_sigmoid(w, bad, 1.0)
    with pytest.raises(ValueError, match="t_s"):
        two_temperature_sigmoid(w, 10.0, bad)


def test_type_and_value_errors():
    with pytest.raises(TypeError, match="t_l"):
        two_temperature_sigmoid(torch.randn(3), "hot")
    with pytest.raises(TypeError, match="w"):
        two_temperature_sigmoid([1.0, 2.0])
    with pytest.raises(ValueError, match="w"):
        two_temperature_sigmoid(torch.arange(3))
    with pytest.raises(ValueError, match="alpha"):
        rgf_relu(torch.randn(3), -0.1)
    with pytest.raises(TypeError, match="x"):
        rgf_relu(3.0)
    with pytest.raises(ValueError, match="empty group"):
        sparse_gate(torch.randn(3, 0), torch.randn(3))
    with pytest.raises(ValueError, match="beta must have shape"):
        sparse_gate(torch.randn(3, 4), torch.randn(4))
    with pytest.raises(ValueError, match="dtype"):
        sparse_gate(torch.randn(3, 4), torch.randn(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="rgf_alpha"):
        sparse_gate(torch.randn(3, 4), torch.randn(3), rgf_alpha=float("nan"))
    with pytest.raises(TypeError, match="signed"):
        sparse_gate(torch.randn(3, 4), torch.randn(3), signed=1)


@needs_ext
def test_kernel_level_errors_are_value_errors():
    with pytest.raises(ValueError, match="t_s"):
        torch.ops.prunopt.two_temperature_sigmoid(torch.randn(3), 1.0, 0.0)
    with pytest.raises(ValueError, match="at least one gate"):
        torch.ops.prunopt.sparse_gate(torch.randn(2, 0), torch.randn(2), True, 0.1)
    with pytest.raises(ValueError, match="grad"):
        torch.ops.prunopt.rgf_relu_backward(torch.randn(4), torch.randn(3), 0.1)


# ---------------------------------------------------------------- opcheck / compile
@needs_ext
def test_opcheck():
    x = torch.randn(7, 3)
    xg = x.clone().requires_grad_(True)
    al = torch.randn(4, 6, requires_grad=True)
    be = torch.randn(4, requires_grad=True)
    ops = torch.ops.prunopt
    torch.library.opcheck(ops.rgf_relu, (xg, 0.1))
    torch.library.opcheck(ops.rgf_relu, (x.t(), 0.0))
    torch.library.opcheck(ops.rgf_relu_backward, (torch.randn(7, 3), x, 0.1))
    torch.library.opcheck(ops.two_temperature_sigmoid, (xg, 1000.0, 10.0))
    torch.library.opcheck(ops.two_temperature_sigmoid_backward, (torch.randn(7, 3), x, 10.0))
    for signed in (True, False):
        torch.library.opcheck(ops.sparse_gate, (al, be, signed, 0.1))
        torch.library.opcheck(ops.sparse_gate_backward, (torch.randn(4, 6), al.detach(), be.detach(), signed, 0.1))


def test_ops_under_torch_compile():
    torch._dynamo.reset()

    def f(x, al, be, w):
        a = sparse_gate(al, be) + sparse_gate(al, be, signed=False, rgf=False)
        return (rgf_relu(x) * 2).sum() + (a * a).sum() + two_temperature_sigmoid(w, 50.0, 5.0).sum()

    args = [torch.randn(5, 4, dtype=torch.float64, requires_grad=True), torch.randn(3, 5, dtype=torch.float64, requires_grad=True),
            torch.randn(3, dtype=torch.float64, requires_grad=True), torch.randn(8, dtype=torch.float64, requires_grad=True)]
    eager = f(*args)
    ge = torch.autograd.grad(eager, args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    gc = torch.autograd.grad(compiled, args)
    torch.testing.assert_close(compiled, eager)
    for u, v in zip(gc, ge):
        torch.testing.assert_close(u, v)


def test_import_and_ops_without_extension():
    # importing never fails without prunopt._C; the ops fall back to the composed reference
    import os
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['prunopt._C'] = None\n"
        "import torch, prunopt\n"
        "assert not prunopt.extension_available()\n"
        "from prunopt.ops import rgf_relu, sparse_gate, two_temperature_sigmoid\n"
        "from prunopt.nn import SparseGate\n"
        "assert bool((SparseGate(9)() == 0.5).all())\n"
        "x = torch.tensor([-1.0, 2.0], requires_grad=True); rgf_relu(x, 0.1).sum().backward()\n"
        "assert abs(x.grad[0].item() - 0.1 * 2.718281828 ** -1) < 1e-6 and x.grad[1].item() == 1.0\n"
        "w = torch.zeros(1, requires_grad=True); two_temperature_sigmoid(w, 1000.0, 10.0).sum().backward()\n"
        "assert abs(w.grad.item() - 2.5) < 1e-6\n"
    )
    env = dict(os.environ, PRUNOPT_REQUIRE_EXTENSION="0")
    env.pop("PRUNOPT_EXTENSION_LIBRARY", None)  # (tools/sanitize.sh loads the kernels from there)
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
