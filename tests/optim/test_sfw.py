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
