"""SFW (eq. 1.2-1.3) against a direct float64 transcription of the paper."""
import math

import pytest
import torch

from prunopt.optim import SFW
from prunopt.reference.prunadag import support_norm_lmo_reference


def _reference_run(x0, grads_fn, radius, T, rule, beta, momentum, steps):
    x = x0.clone()
    m = torch.zeros_like(x)
    for k in range(steps):
        g = grads_fn(x)
        m = momentum * m + (1 - momentum) * g if momentum > 0 else g
        (v,), g_r = support_norm_lmo_reference([m], T, radius)
        if rule == "fw1":
            eta = 1.0 / (k + 1)
        else:
            d = (v - x).norm().item()
            eta = min(beta * g_r / d, 1.0) if d > 0 else 0.0
        x = x + eta * (v - x)
    return x


@pytest.mark.parametrize("rule, momentum", [("fw1", 0.0), ("fw2", 0.0), ("fw2", 0.9)])
def test_matches_reference(rule, momentum):
    g = torch.Generator().manual_seed(0)
    A = torch.randn(30, 200, generator=g, dtype=torch.float64)
    b = torch.randn(30, generator=g, dtype=torch.float64)

    def grad(x):
        return A.t() @ (A @ x - b)

    x0 = torch.zeros(200, dtype=torch.float64)
    ref = _reference_run(x0, grad, 5.0, 20, rule, 0.5, momentum, 15)
    # split into two parameters: the LMO is global over both
    p1, p2 = x0[:73].clone(), x0[73:].clone()
    opt = SFW([p1, p2], radius=5.0, relevant=20, step_rule=rule, beta=0.5, momentum=momentum)
    for _ in range(15):
        gr = grad(torch.cat([p1, p2]))
        p1.grad, p2.grad = gr[:73].clone(), gr[73:].clone()
        opt.step()
    torch.testing.assert_close(torch.cat([p1, p2]), ref, atol=1e-12, rtol=1e-12)
    assert torch.cat([p1, p2]).norm() <= 5.0 + 1e-9  # stays in the ball (convex combination)


def test_lmo_is_sparse_and_on_the_sphere():
    g = torch.randn(1000, dtype=torch.float64)
    (v,), g_r = support_norm_lmo_reference([g], 100, 3.0)
    assert int((v != 0).sum()) == 100
    assert math.isclose(v.norm().item(), 3.0, rel_tol=1e-12)
    assert (v * g).sum() < 0


@pytest.mark.parametrize("kwargs, match", [(dict(radius=0.0), "radius"), (dict(radius=-1.0), "radius"),
                                           (dict(step_rule="fw3"), "step_rule"), (dict(beta=0.0), "beta"),
                                           (dict(momentum=1.0), "momentum"), (dict(relevant=0), "relevant"),
                                           (dict(relevant=2.0), "relevant")])
def test_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SFW([torch.zeros(3, requires_grad=True)], **kwargs)


def test_non_finite_grad_raises_and_keeps_params():
    p = torch.randn(10, requires_grad=True)
    opt = SFW([p], radius=1.0, relevant=3)
    p.grad = torch.randn(10)
    p.grad[4] = math.nan
    before = p.detach().clone()
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_mixed_dtypes_with_momentum_step_and_keep_buffers_on_error():
    """float32 and float64 parameters share one LMO (threshold in float64); a
    rejected step leaves the momentum buffers as they were."""
    p, q = torch.randn(4, requires_grad=True), torch.randn(3, dtype=torch.float64, requires_grad=True)
    opt = SFW([p, q], radius=1.0, relevant=3, momentum=0.9)
    p.grad, q.grad = torch.tensor([1.0, -5.0, 0.5, 2.0]), torch.tensor([4.0, -0.1, 3.0], dtype=torch.float64)
    opt.step()
    # k = 0: eta = 1, x = v, the LMO of the momentum directions 0.1 g (float64 reference)
    (vp, vq), _ = support_norm_lmo_reference([0.1 * p.grad.double(), 0.1 * q.grad], 3, 1.0)
    torch.testing.assert_close(p.detach(), vp.float())
    torch.testing.assert_close(q.detach(), vq)
    assert int((vp != 0).sum() + (vq != 0).sum()) == 3
    x0 = torch.cat([p.detach().double(), q.detach()])
    bufs = [opt.state[t]["momentum_buffer"].clone() for t in (p, q)]
    p.grad = torch.tensor([1.0, math.nan, 0.5, 2.0])
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()
    assert all(torch.equal(opt.state[t]["momentum_buffer"], b) for t, b in zip((p, q), bufs))
    assert torch.equal(torch.cat([p.detach().double(), q.detach()]), x0)


def test_fw1_counts_optimizer_steps_not_a_parameters_steps():
    """eta_k = 1/(k+1) with k the optimizer's step count, also for a parameter
    that had no gradient in the first step."""
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = SFW([a, b], radius=1.0, relevant=1.0)
    b.grad = torch.tensor([1.0, 2.0, 3.0])
    opt.step()  # k = 0: eta = 1, b jumps to v
    a.grad, b.grad = torch.ones(3), torch.tensor([-3.0, -2.0, -1.0])
    b1 = b.detach().clone()
    opt.step()  # k = 1: eta = 1/2
    (va, vb), _ = support_norm_lmo_reference([torch.ones(3), torch.tensor([-3.0, -2.0, -1.0])], 6, 1.0)
    torch.testing.assert_close(b.detach(), b1 + 0.5 * (vb.float() - b1))
    torch.testing.assert_close(a.detach(), 0.5 * va.float())
    assert opt.state[a]["step"].item() == opt.state[b]["step"].item() == 2


def test_add_param_group_must_agree():
    x, y = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = SFW([x], radius=1.0)
    with pytest.raises(ValueError, match="radius"):
        opt.add_param_group(dict(params=[y], radius=100.0))
    with pytest.raises(ValueError, match="momentum"):
        opt.add_param_group(dict(params=[y], momentum=0.5))
    assert len(opt.param_groups) == 1
    opt.add_param_group(dict(params=[y], radius=1.0))
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("kwargs, match", [(dict(beta=None), "beta"), (dict(momentum="0.1"), "momentum"),
                                           (dict(radius="2"), "radius"), (dict(relevant="many"), "relevant")])
def test_invalid_types_name_the_argument(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SFW([torch.zeros(3, requires_grad=True)], **kwargs)


def test_numpy_scalars():
    np = pytest.importorskip("numpy")
    opt = SFW([torch.zeros(3, requires_grad=True)], radius=np.float32(2.0), relevant=np.int64(2), beta=np.float64(0.5))
    group = opt.param_groups[0]
    assert group["radius"] == 2.0 and type(group["relevant"]) is int and group["relevant"] == 2
