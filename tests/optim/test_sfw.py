"""SFW (eq. 1.2-1.3, Zimmer et al.'s learning-rate rescaling) against a direct
float64 transcription of the papers."""
import copy
import math

import pytest
import torch

from prunopt.optim import SFW
from prunopt.reference.prunadag import support_norm_lmo_reference


def _reference_run(x0, grads_fn, radius, T, rescale, lr, momentum, steps, maximize=False):
    """Frank-Wolfe on the T-support-norm ball, written from the papers: the LMO
    of eq. 1.2 on the direction d (Zimmer et al.'s momentum: the buffer starts
    at the first gradient), x <- x + eta (v - x) with eta = clamp(lr c, 0, 1)."""
    x = x0.clone()
    d = None
    for k in range(steps):
        g = grads_fn(x)
        g = -g if maximize else g
        d = g if (momentum == 0 or d is None) else momentum * d + (1 - momentum) * g
        (v,), d_r = support_norm_lmo_reference([d], T, radius)
        if d_r == 0:
            v = x.clone()
        dist = (v - x).norm().item()
        c = {"diameter": 1 / (2 * radius), None: 1.0, "fw1": 1 / (k + 1),
             "gradient": d.norm().item() / dist if dist > 0 else 0.0,
             "fw2": d_r / dist if dist > 0 else 0.0}[rescale]
        x = x + min(max(lr * c, 0.0), 1.0) * (v - x)
    return x


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(30, 200, generator=g, dtype=torch.float64)
    b = torch.randn(30, generator=g, dtype=torch.float64)
    return lambda x: A.t() @ (A @ x - b)


@pytest.mark.parametrize("rescale, lr, momentum, maximize", [
    ("fw1", 1.0, 0.0, False), ("fw2", 0.5, 0.0, False), ("fw2", 0.5, 0.9, False), ("diameter", 0.3, 0.0, False),
    ("gradient", 0.05, 0.9, False), (None, 0.1, 0.0, True)])
def test_matches_reference(rescale, lr, momentum, maximize):
    grad = _problem()
    x0 = torch.zeros(200, dtype=torch.float64)
    ref = _reference_run(x0, grad, 5.0, 20, rescale, lr, momentum, 15, maximize)
    # split into two parameters: the LMO is global over both
    p1, p2 = x0[:73].clone(), x0[73:].clone()
    opt = SFW([p1, p2], lr=lr, rescale=rescale, momentum=momentum, radius=5.0, relevant=20, maximize=maximize)
    for _ in range(15):
        gr = grad(torch.cat([p1, p2]))
        p1.grad, p2.grad = gr[:73].clone(), gr[73:].clone()
        opt.step()
    torch.testing.assert_close(torch.cat([p1, p2]), ref, atol=1e-12, rtol=1e-12)
    assert torch.cat([p1, p2]).norm() <= 5.0 + 1e-9  # stays in the ball (convex combinations)


@pytest.mark.parametrize("rule", ["fw1", "fw2"])
def test_step_rule_is_the_papers_notation(rule):
    """step_rule='fw1' is rescale='fw1' with lr 1; step_rule='fw2', beta=b is
    rescale='fw2' with lr b (the prunAdag paper's FW1 / FW2)."""
    grad = _problem(1)
    a, b = torch.zeros(200, dtype=torch.float64), torch.zeros(200, dtype=torch.float64)
    opt_a = SFW([a], radius=5.0, relevant=20, step_rule=rule, beta=0.2)
    opt_b = SFW([b], lr=1.0 if rule == "fw1" else 0.2, rescale=rule, radius=5.0, relevant=20)
    assert opt_a.param_groups[0]["rescale"] == rule and opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    for _ in range(5):
        a.grad, b.grad = grad(a), grad(b)
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)


def test_fw1_is_rescale_none_with_a_harmonic_schedule():
    """FW1's eta_k = 1/(k+1) is also lr=1, rescale=None driven by LambdaLR."""
    grad = _problem(2)
    a, b = torch.zeros(200, dtype=torch.float64), torch.zeros(200, dtype=torch.float64)
    opt_a = SFW([a], lr=1.0, rescale="fw1", radius=5.0, relevant=20)
    opt_b = SFW([b], lr=1.0, rescale=None, radius=5.0, relevant=20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt_b, lambda k: 1.0 / (k + 1))
    for _ in range(6):
        a.grad, b.grad = grad(a), grad(b)
        opt_a.step()
        opt_b.step()
        sched.step()
    torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-14)


@pytest.mark.parametrize("make_sched", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=10, cycle_momentum=False),
    lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0)])
def test_lr_schedulers_drive_the_step(make_sched):
    """lr lives in the param groups: schedulers run (no KeyError) and the step
    uses the lr they set (rescale=None: eta = lr)."""
    grad = _problem(3)
    x = torch.zeros(200, dtype=torch.float64)
    opt = SFW([x], lr=0.3, rescale=None, radius=5.0, relevant=20)
    sched = make_sched(opt)
    ref = x.clone()
    for k in range(5):
        lr = opt.param_groups[0]["lr"]
        g = grad(x)
        (v,), _ = support_norm_lmo_reference([g], 20, 5.0)
        ref = ref + min(lr, 1.0) * (v - ref)
        x.grad = g
        opt.step()
        sched.step(float(k)) if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) else sched.step()
        torch.testing.assert_close(x, ref, atol=1e-13, rtol=1e-13)
    assert opt.param_groups[0]["lr"] != 0.3


def test_tensor_lr_equals_float_lr():
    grad = _problem(4)
    a, b = torch.zeros(200, dtype=torch.float64), torch.zeros(200, dtype=torch.float64)
    opt_a = SFW([a], lr=0.2, rescale="gradient", radius=5.0, relevant=20)
    opt_b = SFW([b], lr=torch.tensor(0.2, dtype=torch.float64).reshape(1, 1), rescale="gradient", radius=5.0,
                relevant=20)
    for _ in range(4):
        a.grad, b.grad = grad(a), grad(b)
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-14)


def test_group_lr():
    """Each group's lr scales its own step (the LMO and the factor are global)."""
    x, y = torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    opt = SFW([dict(params=[x], lr=0.5), dict(params=[y], lr=0.25)], rescale=None, radius=2.0, relevant=1.0)
    x.grad = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64)
    y.grad = torch.tensor([0.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    (vx, vy), _ = support_norm_lmo_reference([x.grad, y.grad], 8, 2.0)
    opt.step()
    torch.testing.assert_close(x, 0.5 + 0.5 * vx)
    torch.testing.assert_close(y, 0.75 + 0.25 * vy)


@pytest.mark.parametrize("rescale", ["diameter", "gradient", None, "fw1", "fw2"])
def test_zero_gradient_leaves_parameters_unchanged(rescale):
    """A zero direction: every point of the ball minimises <d, v>; SFW takes
    v = x (zero Frank-Wolfe gap) instead of shrinking x towards 0."""
    p, q = torch.randn(5, requires_grad=True), torch.randn(3, requires_grad=True)
    before = [p.detach().clone(), q.detach().clone()]
    opt = SFW([p, q], lr=0.5, rescale=rescale, momentum=0.5, radius=1.0, relevant=2)
    p.grad, q.grad = torch.zeros(5), torch.zeros(3)
    opt.step()
    assert torch.equal(p.detach(), before[0]) and torch.equal(q.detach(), before[1])
    # a zero gradient with a non-zero momentum buffer is a non-zero direction: it moves
    p.grad = torch.ones(5)
    opt.step()
    p.grad = torch.zeros(5)
    moved = p.detach().clone()
    opt.step()
    assert not torch.equal(p.detach(), moved)


def test_lmo_is_sparse_and_on_the_sphere():
    g = torch.randn(1000, dtype=torch.float64)
    (v,), g_r = support_norm_lmo_reference([g], 100, 3.0)
    assert int((v != 0).sum()) == 100
    assert math.isclose(v.norm().item(), 3.0, rel_tol=1e-12)
    assert (v * g).sum() < 0


@pytest.mark.parametrize("kwargs, match", [(dict(radius=0.0), "radius"), (dict(radius=-1.0), "radius"),
                                           (dict(rescale="fw3"), "rescale"), (dict(step_rule="fw3"), "step_rule"),
                                           (dict(lr=-0.1), "lr"), (dict(momentum=1.0), "momentum"),
                                           (dict(relevant=0), "relevant"), (dict(relevant=2.0), "relevant"),
                                           (dict(beta=0.1), "beta"), (dict(step_rule="fw2", beta=0.1, lr=0.2), "beta"),
                                           (dict(step_rule="fw1", rescale=None), "not both"),
                                           (dict(lr=torch.tensor([0.1, 0.2])), "Tensor lr must be 1-element")])
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
    assert torch.equal(p.detach(), before) and len(opt.state) == 0


def test_int_relevant_larger_than_n_raises_before_any_write():
    p = torch.randn(3, requires_grad=True)
    opt = SFW([p], relevant=5)
    p.grad = torch.randn(3)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="relevant"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_mixed_dtypes_with_momentum_step_and_keep_buffers_on_error():
    """float32 and float64 parameters share one LMO (threshold in float64); a
    rejected step leaves the momentum buffers as they were."""
    p, q = torch.randn(4, requires_grad=True), torch.randn(3, dtype=torch.float64, requires_grad=True)
    opt = SFW([p, q], lr=1.0, rescale=None, radius=1.0, relevant=3, momentum=0.9)
    p.grad, q.grad = torch.tensor([1.0, -5.0, 0.5, 2.0]), torch.tensor([4.0, -0.1, 3.0], dtype=torch.float64)
    opt.step()
    # eta = 1: x = v, the LMO of the first directions (the gradients: the buffer starts there)
    (vp, vq), _ = support_norm_lmo_reference([p.grad.double(), q.grad], 3, 1.0)
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
    opt = SFW([a, b], step_rule="fw1", radius=1.0, relevant=1.0)
    b.grad = torch.tensor([1.0, 2.0, 3.0])
    opt.step()  # k = 0: eta = 1, b jumps to v
    a.grad, b.grad = torch.ones(3), torch.tensor([-3.0, -2.0, -1.0])
    b1 = b.detach().clone()
    opt.step()  # k = 1: eta = 1/2
    (va, vb), _ = support_norm_lmo_reference([torch.ones(3), torch.tensor([-3.0, -2.0, -1.0])], 6, 1.0)
    torch.testing.assert_close(b.detach(), b1 + 0.5 * (vb.float() - b1))
    torch.testing.assert_close(a.detach(), 0.5 * va.float())
    assert opt.state[a]["step"].item() == opt.state[b]["step"].item() == 2


def test_add_param_group_must_agree_on_radius_and_relevant():
    x, y = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = SFW([x], radius=1.0)
    with pytest.raises(ValueError, match="radius"):
        opt.add_param_group(dict(params=[y], radius=100.0))
    with pytest.raises(ValueError, match="relevant"):
        opt.add_param_group(dict(params=[y], relevant=0.5))
    with pytest.raises(ValueError, match="momentum"):
        opt.add_param_group(dict(params=[y], momentum=1.5))
    assert len(opt.param_groups) == 1
    opt.add_param_group(dict(params=[y], radius=1.0, lr=0.5, momentum=0.5))  # lr and momentum are per group
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.5


def test_loads_a_state_dict_of_the_step_rule_form():
    """State dicts whose groups have step_rule/beta and no lr (the earlier
    SFW) load as rescale='fw1'/'fw2' with lr 1 / beta."""
    p = torch.randn(6, requires_grad=True)
    opt = SFW([p], radius=2.0, relevant=2)
    sd = copy.deepcopy(opt.state_dict())
    for rule, lr in (("fw1", 1.0), ("fw2", 0.25)):
        old = copy.deepcopy(sd)
        for key in ("lr", "rescale", "maximize"):
            old["param_groups"][0].pop(key)
        old["param_groups"][0].update(step_rule=rule, beta=0.25)
        opt.load_state_dict(old)
        g = opt.param_groups[0]
        assert (g["rescale"], g["lr"], g["maximize"]) == (rule, lr, False) and "step_rule" not in g
        p.grad = torch.randn(6)
        opt.step()


@pytest.mark.parametrize("kwargs, match", [(dict(lr=None, step_rule="fw2", beta="0.1"), "beta"),
                                           (dict(momentum="0.1"), "momentum"), (dict(radius="2"), "radius"),
                                           (dict(relevant="many"), "relevant"), (dict(maximize=1), "maximize"),
                                           (dict(lr="0.1"), "lr")])
def test_invalid_types_name_the_argument(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SFW([torch.zeros(3, requires_grad=True)], **kwargs)


def test_numpy_scalars():
    np = pytest.importorskip("numpy")
    opt = SFW([torch.zeros(3, requires_grad=True)], lr=np.float32(0.5), radius=np.float32(2.0), relevant=np.int64(2))
    group = opt.param_groups[0]
    assert group["radius"] == 2.0 and type(group["relevant"]) is int and group["relevant"] == 2
    assert type(group["lr"]) is float
