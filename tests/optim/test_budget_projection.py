import pytest
import torch

from prunopt.optim import BudgetProjection
from prunopt.reference import project_budget_sort
from prunopt.schedules import DensitySchedule


def _scores(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.rand(s, generator=g)) for s in [(10, 20), (7,), (3, 3, 5)]]


@pytest.mark.parametrize("opt_cls, kw", [(torch.optim.SGD, dict(lr=0.5, momentum=0.9)), (torch.optim.Adam, dict(lr=0.05))])
def test_attached_projection_keeps_the_budget(opt_cls, kw):
    scores = _scores()
    total = sum(p.numel() for p in scores)
    sched = DensitySchedule(0.2, start=0, end=5)
    proj = BudgetProjection(scores, sched)
    opt = opt_cls(scores, **kw)
    handle = proj.attach(opt)
    for step in range(8):
        opt.zero_grad()
        loss = -sum((p * torch.linspace(-1, 2, p.numel()).reshape(p.shape)).sum() for p in scores)
        loss.backward()
        before = [p.detach().clone() for p in scores]
        opt.step()  # projection runs in the post-hook
        # the hook projected exactly what the optimizer produced
        flat = torch.cat([p.detach().reshape(-1) for p in scores])
        assert flat.min() >= 0 and flat.max() <= 1
        assert flat.sum().item() <= sched(step) * total + 1e-3
        assert not all(torch.equal(a, b) for a, b in zip(before, scores))
    assert proj.step_count == 8
    handle.remove()
    opt.step()
    assert proj.step_count == 8


def test_step_matches_joint_projection_and_costs():
    scores = _scores(1)
    costs = [torch.rand_like(p) + 0.5 for p in scores]
    raw = [p.detach().clone() * 3 for p in scores]
    with torch.no_grad():
        for p, r in zip(scores, raw):
            p.copy_(r)
    proj = BudgetProjection(scores, 0.3, cost=costs)
    budget = proj.step()
    assert budget == pytest.approx(0.3 * sum(c.sum().item() for c in costs))
    exact = project_budget_sort([r.double() for r in raw], budget, [c.double() for c in costs])
    for p, e in zip(scores, exact):
        torch.testing.assert_close(p.detach().double(), e, atol=1e-5, rtol=0)


def test_state_dict_roundtrip():
    scores = _scores()
    proj = BudgetProjection(scores, DensitySchedule(0.1, 0, 100, power=3))
    for _ in range(7):
        proj.step()
    other = BudgetProjection(_scores(), DensitySchedule(0.5, 0, 10))
    other.load_state_dict(proj.state_dict())
    assert other.step_count == 7 and other.budget() == pytest.approx(proj.budget())
    fixed = BudgetProjection(_scores(), 0.4)
    fixed2 = BudgetProjection(_scores(), 0.9)
    fixed2.load_state_dict(fixed.state_dict())
    assert fixed2.budget() == pytest.approx(fixed.budget())


def test_errors():
    with pytest.raises(ValueError, match="params"):
        BudgetProjection([], 0.5)
    with pytest.raises(ValueError, match="density"):
        BudgetProjection(_scores(), 1.5)
    with pytest.raises(TypeError, match="density"):
        BudgetProjection(_scores(), "half")
    with pytest.raises(ValueError, match="cost"):
        BudgetProjection(_scores(), 0.5, cost=[torch.ones(3)])
    with pytest.raises(ValueError, match=r"cost\[0\]"):
        s = _scores()
        BudgetProjection(s, 0.5, cost=[torch.zeros_like(p) for p in s])
    proj = BudgetProjection(_scores(), lambda step: 2.0)
    with pytest.raises(ValueError, match="density"):
        proj.step()


def test_attach_again_after_remove():
    p = torch.nn.Parameter(torch.rand(4))
    proj = BudgetProjection([p], 0.5)
    opt = torch.optim.SGD([p], lr=0.1)
    handle = proj.attach(opt)
    with pytest.raises(RuntimeError, match="already attached"):
        proj.attach(opt)
    handle.remove()
    opt2 = torch.optim.SGD([p], lr=0.1)
    proj.attach(opt2)
    with torch.no_grad():
        p.fill_(1.0)
    p.grad = torch.zeros(4)
    opt.step()  # detached: no projection
    assert proj.step_count == 0
    opt2.step()
    assert proj.step_count == 1 and float(p.sum()) == pytest.approx(2.0)


def test_non_finite_cost_names_cost():
    with pytest.raises(ValueError, match=r"cost\[0\]"):
        BudgetProjection([torch.rand(10)], 0.5, cost=[torch.full((10,), float("inf"))])
    with pytest.raises(ValueError, match=r"cost\[0\]"):
        BudgetProjection([torch.rand(10)], 0.5, cost=[torch.full((10,), float("nan"))])


def test_load_state_dict_validates_before_assigning():
    proj = BudgetProjection(_scores(), DensitySchedule(0.2, 0, 10))
    proj.step()
    proj.step()
    with pytest.raises(ValueError):
        proj.load_state_dict({"step_count": 7, "density": {"target": 5.0, "start": 0, "end": 10}})
    assert proj.step_count == 2 and proj.current_density() == pytest.approx(DensitySchedule(0.2, 0, 10)(2))
    fixed = BudgetProjection(_scores(), 0.5)
    for bad in (5.0, float("nan"), -1.0):
        with pytest.raises(ValueError, match="density"):
            fixed.load_state_dict({"step_count": 0, "density": bad})
    with pytest.raises(ValueError, match="step_count"):
        fixed.load_state_dict({"step_count": -1, "density": 0.3})
    assert fixed.step_count == 0 and fixed.density == 0.5


def test_numpy_density():
    np = pytest.importorskip("numpy")
    proj = BudgetProjection(_scores(), np.float32(0.25))
    assert proj.budget() == pytest.approx(0.25 * proj.total)


# --- audit fixes: everything is checked at construction --------------------------------------


@pytest.mark.parametrize("make, exc, match", [
    (lambda: ([torch.rand(3)], dict(cost=[torch.ones(3, dtype=torch.float64)])), ValueError, r"cost\[0\].*dtype"),
    (lambda: ([torch.rand(3)], dict(cost=[torch.ones(3, device="meta")])), ValueError, r"cost\[0\].*device"),
    (lambda: ([torch.rand(3)], dict(cost=[[1.0, 1.0, 1.0]])), TypeError, r"cost\[0\]"),
    (lambda: ([torch.rand(3)], dict(cost=torch.ones(3))), TypeError, "cost"),
    (lambda: ([torch.ones(3, dtype=torch.int64)], {}), ValueError, r"params\[0\].*floating"),
    (lambda: ([torch.rand(3), torch.rand(2, dtype=torch.float64)], {}), ValueError, r"params\[1\].*dtype"),
    (lambda: ([torch.rand(3), torch.rand(2, device="meta")], {}), ValueError, r"params\[1\].*device"),
    (lambda: ([torch.rand(3), "x"], {}), TypeError, r"params\[1\]"),
    (lambda: (torch.rand(3), {}), TypeError, "params"),
])
def test_construction_checks_params_and_cost(make, exc, match):
    params, kw = make()
    with pytest.raises(exc, match=match):
        BudgetProjection(params, 0.5, **kw)


def test_params_sharing_memory_are_rejected_at_construction():
    x = torch.rand(10)
    for params, match in [([x, x], r"params\[0\] and params\[1\]"), ([x[:6], x[4:]], r"params\[0\] and params\[1\]"),
                          ([torch.rand(1).expand(4)], r"params\[0\]")]:
        with pytest.raises(ValueError, match=match):
            BudgetProjection(params, 0.5)
    BudgetProjection([x[::2], x[1::2]], 0.5).step()  # interleaved views share no element: fine
    BudgetProjection([torch.rand(3, 4).t()], 0.5).step()


def test_bad_cost_never_reaches_an_attached_step():
    # used to be accepted: the first attached step raised after optimizer.step() had moved the scores
    p = torch.nn.Parameter(torch.full((4,), 0.5))
    with pytest.raises(ValueError, match=r"cost\[0\]"):
        BudgetProjection([p], 0.5, cost=[torch.ones(4, dtype=torch.float64)])


def test_huge_density_is_a_value_error():
    with pytest.raises(ValueError, match="density"):
        BudgetProjection(_scores(), 10**400)  # was OverflowError
    proj = BudgetProjection(_scores(), 0.5)
    with pytest.raises(ValueError, match="density"):
        proj.load_state_dict({"step_count": 1, "density": 10**400})
    assert proj.step_count == 0 and proj.density == 0.5
    bad = BudgetProjection(_scores(), lambda step: "half")
    with pytest.raises(ValueError, match="density"):
        bad.step()
    assert bad.step_count == 0
