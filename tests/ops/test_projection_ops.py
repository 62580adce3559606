"""prunopt.ops.project_budget: kernel vs float64 sort-based oracle (ProM supplement A.2)."""
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import example, given, strategies as st

import prunopt
from prunopt.ops import project_budget, project_budget_
from prunopt.reference import project_budget_reference, project_budget_sort
from prunopt.testing import devices, float_dtypes, simd_clones, tolerance

needs_ext = pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built")


def _check_kkt(x, t, c, S, atol):
    """theta* is feasible and satisfies the optimality conditions."""
    x, t, c = x.double(), t.double(), c.double()
    if x.numel() == 0:
        return
    assert x.min() >= 0 and x.max() <= 1
    assert (c * x).sum() <= S + atol * c.sum() + 1e-9


@st.composite
def projection_case(draw):
    n = draw(st.sampled_from([0, 1, 2, 3, 7, 64, 257, 1000, 4097]))
    shape = draw(st.sampled_from(["flat", "2d", "noncontig"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.5, 1.0, 3.0, 100.0]))
    shift = draw(st.sampled_from([-0.5, 0.0, 0.25]))
    density = draw(st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.9, 1.0, 2.0]))
    with_cost = draw(st.booleans())
    ties = draw(st.booleans())
    return n, shape, dtype, seed, scale, shift, density, with_cost, ties


def _make(n, shape, dtype, seed, scale, shift, with_cost, ties):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(max(n, 0), generator=g, dtype=torch.float64) * scale + shift
    if ties and n > 0:
        t = (t * 4).round() / 4  # many equal scores and breakpoints
    c = torch.rand(max(n, 0), generator=g, dtype=torch.float64) * 2 + 0.05 if with_cost else None
    t = t.to(dtype)
    c = None if c is None else c.to(dtype)
    if shape == "2d" and n > 0:
        t = t.reshape(1, n)
        c = None if c is None else c.reshape(1, n)
    elif shape == "noncontig":
        t = torch.stack([t, t + 1], dim=1)[:, 0]  # stride 2
        if c is not None:
            c = torch.stack([c, c], dim=1)[:, 1]
        assert n <= 1 or not t.is_contiguous()
    return t, c


@given(projection_case())
@example((4097, "flat", torch.float32, 0, 1.0, 0.0, 0.1, False, False))
@example((1000, "noncontig", torch.float64, 1, 3.0, -0.5, 0.5, True, True))
@example((3, "flat", torch.float64, 2, 0.5, 0.0, 0.0, False, False))
def test_matches_sort_oracle(case):
    n, shape, dtype, seed, scale, shift, density, with_cost, ties = case
    t, c = _make(n, shape, dtype, seed, scale, shift, with_cost, ties)
    S = density * (n if c is None else float(c.double().sum()))
    exact = project_budget_sort(t.double(), S, None if c is None else c.double())
    out = project_budget(t, S, c)
    assert out.dtype == t.dtype and out.shape == t.shape
    # The projection's accuracy bounds hold for scores of order one; with scores of order
    # `scale` the rounding of the multiplier grows with it (docs/projection.md).
    tol = tolerance(dtype)
    tol["atol"] *= max(1.0, scale / (1.0 if c is None else 0.05))
    torch.testing.assert_close(out.double(), exact, **tol)
    ref = project_budget_reference(t, S, c)
    torch.testing.assert_close(ref.double(), exact, **tol)
    _check_kkt(out, t, torch.ones_like(t) if c is None else c, S, tolerance(dtype)["atol"])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", float_dtypes())
@pytest.mark.parametrize("n", [1, 100, 200_000])
def test_exactness_bounds(device, dtype, n):
    # accuracy bound of the projection: <= 1e-12 in float64, <= 1e-5 in float32 against the sort solution
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g, dtype=torch.float64) * 0.4 + 0.5).to(dtype)
    S = 0.1 * n
    exact = project_budget_sort(t.double(), S)
    out = project_budget(t.to(device), S).cpu()
    err = (out.double() - exact).abs().max().item()
    assert err <= (1e-12 if dtype == torch.float64 else 1e-5)
    if n > 10:
        # the budget is active and met exactly
        assert abs(exact.sum().item() - S) <= 1e-6 * S


@needs_ext
@pytest.mark.parametrize("solver", ["fast", "histogram"])
@pytest.mark.parametrize("kind", ["randn", "ties", "wide"])
def test_simd_clones_agree(solver, kind, monkeypatch):
    """float32 scores with unit costs take the vectorised passes (the
    compaction, the histogram pass, the output pass, the small exact sets) of
    the AVX-512 or AVX2 clone, or the scalar loops (the DEFAULT capability):
    each is within the float32 bound of the sort solution, with the budget met,
    on inputs with vector tails and several tensors."""
    g = torch.Generator().manual_seed(11)
    n = 70_001
    t = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "ties":
        t = (t * 4).round() / 4
    elif kind == "wide":
        t = t * torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 3)
    ts = [t[:50_003].float(), t[50_003:].float(), torch.tensor([0.5, 2.0, -1.0])]
    flat = torch.cat([x.double() for x in ts])
    S = 0.05 * flat.numel()
    exact = project_budget_sort(flat, S)
    if solver == "histogram":
        monkeypatch.setenv("PRUNOPT_PROJECTION_SOLVER", "histogram")
    outs = []
    for _ in simd_clones(monkeypatch, default=True):
        out = torch.cat(torch.ops.prunopt.project_budget(ts, None, S)).double()
        assert (out - exact).abs().max().item() <= 1e-5
        assert abs(out.sum().item() - S) <= 1e-5 * S
        outs.append(out)
    assert len(outs) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    t = torch.rand(1000, dtype=torch.float64)
    out = project_budget(t.to(dtype), 100.0)
    assert out.dtype == dtype
    # computed in high precision from the rounded input, then rounded once
    exact = project_budget_sort(t.to(dtype).double(), 100.0)
    torch.testing.assert_close(out.double(), exact.to(dtype).double(), atol=0, rtol=0)


def test_list_equals_concatenation():
    g = torch.Generator().manual_seed(0)
    ts = [torch.rand(s, generator=g) * 1.2 for s in [(3, 5), (0,), (1,), (4097,), (7, 11)]]
    cs = [torch.rand(t.shape, generator=g) + 0.1 for t in ts]
    flat_t = torch.cat([t.reshape(-1) for t in ts])
    flat_c = torch.cat([c.reshape(-1) for c in cs])
    for cost, flat_cost in [(None, None), (cs, flat_c)]:
        S = 0.2 * flat_t.numel()
        outs = project_budget(ts, S, cost)
        assert isinstance(outs, list) and [o.shape for o in outs] == [t.shape for t in ts]
        flat = project_budget(flat_t, S, flat_cost)
        torch.testing.assert_close(torch.cat([o.reshape(-1) for o in outs]), flat, atol=1e-6, rtol=0)


def test_inplace_and_noncontiguous_inplace():
    t = torch.rand(50, 40, dtype=torch.float64) * 2 - 0.3
    view = t.t()  # non-contiguous
    expected = project_budget_sort(view.clone(), 300.0)
    ret = project_budget_(view, 300.0)
    assert ret is view
    torch.testing.assert_close(view, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(t.t(), expected, atol=1e-12, rtol=0)


def test_special_budgets():
    t = torch.tensor([0.2, 1.5, -0.3, 0.7])
    # slack: plain clamp
    torch.testing.assert_close(project_budget(t, 100.0), t.clamp(0, 1))
    # zero budget: all zeros
    assert torch.equal(project_budget(t, 0.0), torch.zeros(4))
    # empty input
    assert project_budget(torch.zeros(0), 1.0).numel() == 0
    assert project_budget([], 1.0) == []
    # integer budget and a 1-element tensor budget are accepted
    torch.testing.assert_close(project_budget(t, 1), project_budget(t, torch.tensor(1.0)))
    for b in (np.float32(1.0), np.float64(1.0), np.int64(1)):  # any real number (numbers.Real)
        torch.testing.assert_close(project_budget(t, b), project_budget(t, 1.0))


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.rand(3), -1.0), ValueError, "budget"),
        ((torch.rand(3), math.inf), ValueError, "budget"),
        ((torch.rand(3), math.nan), ValueError, "budget"),
        ((torch.rand(3), "1"), TypeError, "budget"),
        ((torch.rand(3), np.str_("1")), TypeError, "budget"),
        (("x", 1.0), TypeError, "theta"),
        ((torch.tensor([0.1, math.nan]), 1.0), ValueError, "theta"),
        ((torch.tensor([0.1, math.inf]), 1.0), ValueError, "theta"),
        ((torch.arange(3), 1.0), ValueError, "theta"),
        ((torch.rand(3), 1.0, torch.rand(4)), ValueError, "cost"),
        ((torch.rand(3), 1.0, torch.tensor([1.0, 0.0, 1.0])), ValueError, "cost"),
        ((torch.rand(3), 1.0, torch.tensor([1.0, -2.0, 1.0])), ValueError, "cost"),
        ((torch.rand(3), 1.0, torch.rand(3, dtype=torch.float64)), ValueError, "cost"),
        (([torch.rand(3), torch.rand(3, dtype=torch.float64)], 1.0), ValueError, "theta"),
        (([torch.rand(3)], 1.0, [torch.rand(3), torch.rand(3)]), ValueError, "cost"),
    ],
)
def test_errors_name_the_argument(args, exc, match):
    for fn in (project_budget, project_budget_, project_budget_reference):
        with pytest.raises(exc, match=match):
            fn(*args)


def test_error_leaves_input_untouched():
    t = torch.tensor([0.5, 2.0, math.nan, 0.3])
    before = t.clone()
    with pytest.raises(ValueError):
        project_budget_(t, 1.0)
    assert torch.equal(t.isnan(), before.isnan()) and torch.equal(t.nan_to_num(), before.nan_to_num())
    # a bad tensor later in the list must not leave earlier ones modified
    a, b = torch.rand(10) * 3, torch.tensor([1.0, math.inf])
    a0 = a.clone()
    with pytest.raises(ValueError):
        project_budget_([a, b], 1.0)
    assert torch.equal(a, a0)


@needs_ext
def test_raw_op_errors_are_value_errors():
    with pytest.raises(ValueError, match="budget"):
        torch.ops.prunopt.project_budget([torch.rand(3)], None, -1.0)
    with pytest.raises(ValueError, match="theta"):
        torch.ops.prunopt.project_budget([torch.tensor([math.nan])], None, 1.0)


@needs_ext
@pytest.mark.parametrize("cost", [False, True])
def test_opcheck(cost):
    ts = [torch.rand(5, 3, dtype=torch.float64) * 2, torch.rand(7, dtype=torch.float64)]
    cs = [torch.rand_like(t) + 0.5 for t in ts] if cost else None
    torch.library.opcheck(torch.ops.prunopt.project_budget.default, (ts, cs, 4.0))
    torch.library.opcheck(torch.ops.prunopt.project_budget_.default, ([t.clone() for t in ts], cs, 4.0))
    # with inputs that require grad: the Autograd registration is checked as well
    tg = [t.clone().requires_grad_() for t in ts]
    torch.library.opcheck(torch.ops.prunopt.project_budget.default, (tg, cs, 4.0))


def _projection_path(use_kernel, monkeypatch):
    """``prunopt.ops`` with the projection on the kernel (skipped without the
    extension) or, with ``use_kernel=False``, on the pure-PyTorch reference."""
    import prunopt.ops as ops
    import prunopt.ops.projection as projection_ops

    if use_kernel and not prunopt.extension_available():
        pytest.skip("compiled extension not built")
    if not use_kernel:
        monkeypatch.setattr(projection_ops, "_PROJECTION_DEVICES", frozenset())
    return ops


@pytest.mark.parametrize("use_kernel", [True, False])
def test_output_never_requires_grad(use_kernel, monkeypatch):
    ops = _projection_path(use_kernel, monkeypatch)
    g = torch.tensor([0.9, 0.8, 0.1], requires_grad=True)
    out = ops.project_budget(g, 1.0)
    assert not out.requires_grad and out.grad_fn is None  # was WarnNotImplemented on the kernel path
    torch.testing.assert_close(out, project_budget_sort(g.detach(), 1.0))
    outs = ops.project_budget([g, g.detach() * 2], 1.0)
    assert not any(o.requires_grad for o in outs)
    if use_kernel:  # the raw op as well
        assert not any(o.requires_grad for o in torch.ops.prunopt.project_budget([g], None, 1.0))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_inplace_bumps_version_counters(use_kernel, monkeypatch):
    # autograd must notice that a tensor saved for backward was overwritten;
    # the kernel path used to leave ``_version`` unchanged and backward then
    # silently used the projected values
    ops = _projection_path(use_kernel, monkeypatch)
    a, b = torch.rand(6) * 2, torch.rand(4) * 2
    va, vb = a._version, b._version
    ops.project_budget_([a, b], 2.0)
    assert a._version > va and b._version > vb
    w = torch.rand(6, requires_grad=True)
    t = torch.rand(6) * 2
    loss = (w * t).sum()  # saves t for backward
    ops.project_budget_(t, 1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    if use_kernel:  # the raw op, and inference tensors (which have no version counter)
        c = torch.rand(5) * 2
        vc = c._version
        torch.ops.prunopt.project_budget_([c], None, 1.0)
        assert c._version > vc
        with torch.inference_mode():
            d = torch.rand(5) * 2
            torch.ops.prunopt.project_budget_([d], None, 1.0)
            assert float(d.sum()) <= 1.0 + 1e-6


@pytest.mark.parametrize("use_kernel", [True, False])
def test_inplace_rejects_aliased_tensors_before_writing(use_kernel, monkeypatch):
    ops = _projection_path(use_kernel, monkeypatch)
    s = torch.tensor([0.9, 0.9])
    with pytest.raises(ValueError, match=r"theta\[0\] and theta\[1\] share memory"):
        ops.project_budget_([s, s], 1.0)  # used to give [0, 0]
    assert torch.equal(s, torch.tensor([0.9, 0.9]))
    base = torch.rand(4, 6) * 2
    before = base.clone()
    for views in ([base[0], base[0, 2:]], [base[:2], base.t()], [base[1:3], base.reshape(-1)[10:14]]):
        with pytest.raises(ValueError, match="share memory"):
            ops.project_budget_(views, 1.0)
        assert torch.equal(base, before)
    with pytest.raises(ValueError, match="expand"):
        ops.project_budget_(torch.rand(1).expand(4), 1.0)
    # views of one storage that do not overlap are fine: interleaved columns, separate rows
    cols = [base[:, ::2], base[:, 1::2]]
    expect = project_budget_sort([c.clone() for c in cols], 3.0)
    ops.project_budget_(cols, 3.0)
    for c, e in zip(cols, expect):
        torch.testing.assert_close(c, e)
    ops.project_budget_([base[:2], base[2:]], 1.0)


def test_torch_compile():
    def step(theta, budget):
        theta = theta * 1.1 + 0.01
        return project_budget(theta, budget)

    compiled = torch.compile(step, fullgraph=prunopt.extension_available(), backend="inductor")
    t = torch.rand(1000, dtype=torch.float64)
    torch.testing.assert_close(compiled(t, 100.0), step(t, 100.0), atol=1e-12, rtol=0)


@given(mags=st.lists(st.integers(-40, 40), min_size=1, max_size=8), signs=st.lists(st.booleans(), min_size=8,
                                                                                   max_size=8),
       budget_exp=st.integers(-35, 3), seed=st.integers(0, 2**31 - 1), with_cost=st.booleans())
@example(mags=[36, 36, 36, 0], signs=[True, False, True, True], budget_exp=-30, seed=0, with_cost=False)
def test_sort_oracle_on_scores_over_many_orders_of_magnitude(mags, signs, budget_exp, seed, with_cost):
    """The oracle is feasible and agrees with the bisection reference when the
    scores span 80 orders of magnitude: its running sums of the breakpoints'
    changes cancelled, and [4.9e36, -4.9e36, 1e36, 3.] with budget 1e-30 gave
    [1, 0, 0, 0], over the budget."""
    if with_cost:
        # with costs, t - lam c carries the rounding of lam c: beyond 2**53 an
        # ulp of t exceeds 1 and no double lam puts a free entry inside (0, 1)
        # (every solver, the kernels included, may then end a step over budget)
        mags = [min(m, 14) for m in mags]
    g = torch.Generator().manual_seed(seed)
    t = torch.tensor([(1 if s else -1) * (1 + float(torch.rand((), generator=g))) * 10.0 ** m
                      for m, s in zip(mags, signs)], dtype=torch.float64)
    c = torch.rand(t.shape, generator=g, dtype=torch.float64) * 10 + 0.1 if with_cost else None
    budget = 10.0 ** budget_exp
    out = project_budget_sort(t, budget, c)
    cc = torch.ones_like(t) if c is None else c
    used = float((out * cc).sum())
    assert ((out >= 0) & (out <= 1)).all()
    # a free entry t - lam c carries the rounding of lam c: a few ulps of t
    free = (out > 0) & (out < 1)
    slack = 4 * t.numel() * 2.0**-52 * float((t.abs() * cc)[free].max()) if free.any() else 0.0
    assert used <= budget * (1 + 1e-12) + slack
    torch.testing.assert_close(out, project_budget_reference(t, budget, c), atol=1e-12, rtol=0)
    torch.testing.assert_close(project_budget(t, budget, c), out, atol=1e-12, rtol=0)


def test_sort_oracle_example_from_the_fuzzer():
    t = torch.tensor([4.9e36, -4.9e36, 1e36, 3.0], dtype=torch.float64)
    out = project_budget_sort(t, 1e-30)
    assert float(out.sum()) <= 1e-30
    assert torch.equal(out, project_budget_reference(t, 1e-30))


def test_reference_bisection_reaches_exact_piece():
    # pathological: huge spread of scores, a budget far from both ends
    t = torch.cat([torch.tensor([1e6, -1e6]), torch.rand(997, dtype=torch.float64) * 1e-3])
    exact = project_budget_sort(t, 1.5)
    torch.testing.assert_close(project_budget(t, 1.5), exact, atol=1e-12, rtol=0)
    torch.testing.assert_close(project_budget_reference(t, 1.5), exact, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("position", [0, 5, 4096, 99_999])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_detected_anywhere(dtype, position, bad):
    # large enough for the sampled bracket and the vectorised float32 path
    t = torch.rand(100_000, dtype=dtype)
    t[position] = bad
    before = t.clone()
    with pytest.raises(ValueError, match="theta"):
        project_budget_(t, 10_000.0)
    assert torch.equal(t.nan_to_num(), before.nan_to_num())


# --- the CPU kernel's sampled fast path and its fallbacks -------------------
# The CPU kernel brackets lam* from a sample (runs of 8 elements spread evenly
# over the data), compacts the elements with a breakpoint inside the bracket,
# and solves them exactly. A bracket that misses lam*, or a buffer that does
# not shrink (many equal breakpoints at lam*), falls back to the histogram
# solver. These inputs are built to reach each of those paths; every one must
# still give the exact projection.

def _strided_mask(n, period, run=8):
    idx = torch.arange(n)
    return (idx % period) < run


def _assert_exact(t, S, c=None, scale=1.0):
    exact = project_budget_sort(t.double(), S, None if c is None else c.double())
    out = project_budget(t, S, c)
    tol = tolerance(t.dtype)
    torch.testing.assert_close(out.double(), exact, atol=tol["atol"] * scale, rtol=0)
    inplace = t.clone()
    project_budget_(inplace, S, c)
    torch.testing.assert_close(inplace, out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sampled_low", [True, False])
def test_sample_that_misses_the_root_falls_back(dtype, sampled_low):
    # n = 2^17 with 8192 sampled elements: the sample reads 8 of every 128
    # elements. Give exactly those misleading values.
    n = 1 << 17
    g = torch.Generator().manual_seed(3)
    mask = _strided_mask(n, 128)
    if sampled_low:  # the sample looks slack; lam* is well above 0
        t = torch.rand(n, generator=g, dtype=torch.float64) * 0.5 + 0.7
        t[mask] = 0.0
    else:  # the sample looks full; lam* is near 0
        t = torch.rand(n, generator=g, dtype=torch.float64) * 0.2
        t[mask] = 5.0
    _assert_exact(t.to(dtype), 0.05 * n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_cost", [False, True])
def test_equal_breakpoints_at_the_root(dtype, with_cost):
    # half the scores equal 0.3 and the budget puts lam* exactly there: the
    # bracket holds half of all breakpoints whatever its width
    n = 100_000
    t = torch.full((n,), 0.3, dtype=torch.float64)
    t[1::2] = 0.9
    c = None
    S = 0.3 * (n // 2)  # phi(0.3) = sum over the 0.9s of 0.6 = 0.3 n/2 ... = S
    if with_cost:
        c = torch.ones(n, dtype=torch.float64)
    _assert_exact(t.to(dtype), S, None if c is None else c.to(dtype))
    # and just off the tie, on both sides
    for dS in (-1.0, 1.0):
        _assert_exact(t.to(dtype), S + dS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_budget_edges_large(dtype):
    n = 50_000
    g = torch.Generator().manual_seed(5)
    t = (torch.rand(n, generator=g, dtype=torch.float64) * 1.4 - 0.2).to(dtype)
    slack = float(t.double().clamp(0, 1).sum())
    for S in [0.0, 1e-9, 0.5, 1.0, slack * 0.999999, slack, slack * 1.000001, n + 1.0]:
        _assert_exact(t, S)


def test_all_equal_and_huge_ranges_large():
    n = 60_000
    for value in [0.5, 1.0, 0.0, -3.0, 7.0]:
        t = torch.full((n,), value)
        for S in [0.0, 1.0, 0.25 * n, 0.999 * n]:
            _assert_exact(t, S)
    g = torch.Generator().manual_seed(11)
    t = torch.rand(n, generator=g, dtype=torch.float64) * 1e-3
    t[::997] = 1e6
    t[5::991] = -1e6
    for S in [1.5, 60.0, 100.0]:
        _assert_exact(t, S, scale=1.0)


@st.composite
def adversarial_case(draw):
    n = draw(st.sampled_from([4097, 9000, 1 << 15, 70_001]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**31 - 1))
    pattern = draw(st.sampled_from(["uniform", "strided", "ties", "two_point", "blocks", "tiny_free"]))
    period = draw(st.sampled_from([8, 16, 64, 128, 512]))
    density = draw(st.sampled_from([1e-4, 0.01, 0.1, 0.3, 0.5, 0.9, 0.99]))
    with_cost = draw(st.booleans())
    return n, dtype, seed, pattern, period, density, with_cost


@given(adversarial_case(), st.sampled_from(["default", "histogram"]))
@example((1 << 15, torch.float32, 0, "strided", 32 * 8 // 8 * 4, 0.1, False), "default")
@example((70_001, torch.float32, 1, "ties", 64, 0.3, False), "default")
@example((70_001, torch.float64, 1, "tiny_free", 64, 0.3, True), "histogram")
def test_adversarial_large_inputs(case, solver):
    # solver="histogram": the fallback alone (PRUNOPT_PROJECTION_SOLVER), on the same patterns
    if solver == "histogram" and not prunopt.extension_available():
        return
    with _solver_env(solver):
        _adversarial_case(case)


def _adversarial_case(case):
    n, dtype, seed, pattern, period, density, with_cost = case
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g, dtype=torch.float64) * 1.2
    if pattern == "strided":  # values correlated with the sample's positions
        t[_strided_mask(n, period)] += 2.0
    elif pattern == "ties":  # a few distinct values, many equal breakpoints
        t = (t * 3).round() / 3
    elif pattern == "two_point":
        t = torch.where(t > 0.6, 1.0, 0.25).to(torch.float64)
    elif pattern == "blocks":  # sorted blocks, as in a list of layers
        t = t.sort().values
    elif pattern == "tiny_free":  # lam* where almost no element is free
        t = torch.where(t > 0.6, 5.0, -5.0).to(torch.float64)
        t[7] = 0.123
    c = torch.rand(n, generator=g, dtype=torch.float64) * 2 + 0.05 if with_cost else None
    total = n if c is None else float(c.sum())
    S = density * total
    t = t.to(dtype)
    c = None if c is None else c.to(dtype)
    _assert_exact(t, S, c, scale=6.0 if c is not None else 6.0)


class _solver_env:
    """Sets PRUNOPT_PROJECTION_SOLVER for a block (hypothesis tests cannot take monkeypatch)."""

    def __init__(self, solver):
        self.solver = solver

    def __enter__(self):
        self.old = os.environ.get("PRUNOPT_PROJECTION_SOLVER")
        if self.solver == "histogram":
            os.environ["PRUNOPT_PROJECTION_SOLVER"] = "histogram"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("PRUNOPT_PROJECTION_SOLVER", None)
        else:
            os.environ["PRUNOPT_PROJECTION_SOLVER"] = self.old


@pytest.mark.parametrize("solver", ["default", "histogram"])
@pytest.mark.parametrize("n, spread", [(100_000, 1e6), (300_000, 1e4), (20_000, 1e8)])
def test_costs_over_many_orders_of_magnitude(monkeypatch, solver, n, spread):
    """Costs spanning up to 8 orders of magnitude: the histogram solver's running
    sums (crossing buckets subtracts c^2 terms up to 1e16) cancelled, picked
    wrong buckets and missed the root by up to 2e-2 (or returned all zeros);
    it now proposes brackets from them but takes every decision from direct
    sums. Both solvers against the float64 reference, in float64 and float32."""
    if not prunopt.extension_available():
        pytest.skip("compiled extension not built")
    if solver == "histogram":
        monkeypatch.setenv("PRUNOPT_PROJECTION_SOLVER", "histogram")
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g, dtype=torch.float64)
    c = torch.rand(n, generator=g, dtype=torch.float64) * spread + 1
    for dtype in (torch.float64, torch.float32):
        tt, cc = t.to(dtype), c.to(dtype)
        for budget in (1.0, 100.0, 1e4):
            x = project_budget(tt, budget, cc).double()
            ref = project_budget_reference(tt.double(), budget, cc.double())
            assert (x - ref).abs().max().item() <= tolerance(dtype)["atol"], (dtype, budget)


@pytest.mark.parametrize("solver", ["default", "histogram"])
def test_a_million_tied_scores_within_1e12(monkeypatch, solver):
    """1e6 equal float64 scores: each solver's sums were one long running sum of
    equal addends (one rounding each: 6.5e-12 off, and sum(theta) above the
    budget); they are summed in blocks now."""
    if not prunopt.extension_available():
        pytest.skip("compiled extension not built")
    if solver == "histogram":
        monkeypatch.setenv("PRUNOPT_PROJECTION_SOLVER", "histogram")
    x = project_budget(torch.full((10**6,), 0.7, dtype=torch.float64), 1e5)
    assert (x - 0.1).abs().max().item() <= 1e-12
    y = project_budget(torch.full((3 * 10**5,), 0.7, dtype=torch.float64), 0.3 * 3e5)
    assert (y - 0.3).abs().max().item() <= 1e-12


# ------------------------------------------ the bracket pass and the apply pass

@st.composite
def bracket_case(draw):
    sizes = draw(st.lists(st.sampled_from([0, 1, 5, 100, 4097, 70_000]), min_size=1, max_size=3))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    with_cost = draw(st.booleans())
    lo = draw(st.sampled_from([0.0, 0.1, 0.5, 0.69, 3.0]))
    width = draw(st.sampled_from([0.0, 1e-6, 0.01, 0.4, math.inf]))
    noncontig = draw(st.booleans())
    return sizes, dtype, seed, with_cost, lo, width, noncontig


def _bracket_inputs(sizes, dtype, seed, with_cost, noncontig):
    g = torch.Generator().manual_seed(seed)
    ts, cs = [], ([] if with_cost else None)
    for n in sizes:
        t = (torch.rand(2 * n if noncontig else n, generator=g, dtype=torch.float64) * 2.4 - 0.6).to(dtype)
        ts.append(t[::2] if noncontig else t)
        if with_cost:
            c = (torch.rand(2 * n if noncontig else n, generator=g, dtype=torch.float64) * 2 + 0.05).to(dtype)
            cs.append(c[::2] if noncontig else c)
    return ts, cs


@needs_ext
@given(bracket_case())
@example(([70_000], torch.float32, 0, False, 0.69, 0.01, False))  # the vectorised float32 pass
@example(([70_000, 5], torch.float64, 1, True, 0.5, math.inf, True))
def test_bracket_pass_matches_reference(case):
    """The kept elements bit for bit and in index order, the U and F sums to
    float64 rounding: every dtype, costs or not, strided inputs, empty
    tensors, brackets from a point to [lo, inf)."""
    from prunopt.ops import project_budget_bracket
    from prunopt.reference import project_budget_bracket_reference

    sizes, dtype, seed, with_cost, lo, width, noncontig = case
    ts, cs = _bracket_inputs(sizes, dtype, seed, with_cost, noncontig)
    hi = lo + width
    summary, kt, kc = project_budget_bracket(ts, lo, hi, cs)
    want = project_budget_bracket_reference(ts, cs, lo, hi)
    assert summary.dtype == torch.float64 and kt.dtype == dtype and kc.dtype == dtype
    torch.testing.assert_close(summary, want[0], rtol=1e-12, atol=1e-9)
    assert torch.equal(kt, want[1]) and torch.equal(kc, want[2])
    assert (kc.numel() == kt.numel()) if with_cost else kc.numel() == 0


@needs_ext
@pytest.mark.parametrize("with_cost", [False, True])
def test_bracket_pass_gives_phi_on_the_bracket(with_cost):
    """On [lo, hi], phi(lam) = U + F_ct - lam F_cc + sum over the kept elements
    (eq. 14), for any lam inside: checked against phi summed over all elements."""
    from prunopt.ops import project_budget_bracket
    from prunopt.reference import projection_phi

    ts, cs = _bracket_inputs([50_000, 333], torch.float32, 3, with_cost, False)
    t = torch.cat(ts).double()
    c = torch.cat(cs).double() if with_cost else torch.ones_like(t)
    lo, hi = 0.6, 0.62
    summary, kt, kc = project_budget_bracket(ts, lo, hi, cs)
    u, fct, fcc, bad_t, bad_c = summary.tolist()
    assert bad_t == bad_c == 0.0 and 0 < kt.numel() < t.numel() // 10
    kc = kc.double() if with_cost else torch.ones_like(kt, dtype=torch.float64)
    for lam in (lo, 0.605, 0.61999, hi):
        got = u + fct - lam * fcc + float((kc * (kt.double() - lam * kc).clamp(0, 1)).sum()) - 100.0
        assert got == pytest.approx(float(projection_phi(t, c, lam, 100.0)), rel=1e-12, abs=1e-9)


@needs_ext
@pytest.mark.parametrize("bad", ["nan", "inf", "zero_cost", "negative_cost", "nan_cost"])
def test_bracket_pass_reports_bad_input(bad):
    from prunopt.ops import project_budget_bracket

    t = torch.rand(10_000)
    c = torch.rand(10_000) + 0.5
    if bad in ("nan", "inf"):
        t[4321] = math.nan if bad == "nan" else -math.inf
    else:
        c[77] = {"zero_cost": 0.0, "negative_cost": -1.0, "nan_cost": math.nan}[bad]
    summary, kt, kc = project_budget_bracket([t], 0.2, 0.3, [c])
    assert summary.tolist() == ([0.0, 0.0, 0.0, 1.0, 0.0] if bad in ("nan", "inf") else [0.0, 0.0, 0.0, 0.0, 1.0])
    assert kt.numel() == 0 and kc.numel() == 0


@needs_ext
@given(bracket_case(), st.sampled_from([0.0, 1 / 3, 0.7, 5.0, math.inf]), st.booleans())
def test_apply_pass_matches_reference(case, lam, inplace):
    """clamp(theta - lam c, 0, 1) in double, rounded once: equal to the
    reference, into new tensors or in place (strided ones too)."""
    from prunopt.ops import project_budget_apply_
    from prunopt.reference import project_budget_apply_reference

    sizes, dtype, seed, with_cost, _, _, noncontig = case
    ts, cs = _bracket_inputs(sizes, dtype, seed, with_cost, noncontig)
    want = project_budget_apply_reference(ts, cs, lam)
    out = ts if inplace else [torch.full_like(t, 9.0) for t in ts]
    assert project_budget_apply_(out, ts, lam, cs) is out
    for o, w in zip(out, want):
        assert o.dtype == dtype and torch.equal(o, w)


@needs_ext
def test_projection_is_the_bracket_then_the_apply_pass():
    """project_budget's lambda, found from the bracket pass's sums and kept
    elements, then written by the apply pass: the one-process projection."""
    from prunopt.distributed import _set_root
    from prunopt.ops import project_budget_apply_, project_budget_bracket

    t = torch.rand(100_000, generator=torch.Generator().manual_seed(5)) * 1.2
    S = 0.1 * t.numel()
    lo, hi = 0.70, 0.72
    summary, kt, _ = project_budget_bracket(t, lo, hi)
    lam = _set_root(kt.double(), torch.ones(kt.numel(), dtype=torch.float64), None, summary[:3].tolist(), S, lo, hi)
    out = project_budget_apply_(torch.empty_like(t), t, lam)
    assert (out.double() - project_budget_sort(t.double(), S)).abs().max().item() <= 1e-6


@needs_ext
@pytest.mark.parametrize("cost", [False, True])
def test_bracket_and_apply_opcheck(cost):
    ts = [torch.rand(300) * 1.2, torch.rand(5, 4)]
    cs = [torch.rand_like(t) + 0.5 for t in ts] if cost else None
    torch.library.opcheck(torch.ops.prunopt.project_budget_bracket.default, (ts, cs, 0.3, 0.5))
    torch.library.opcheck(torch.ops.prunopt.project_budget_bracket.default, (ts, cs, 0.0, math.inf))
    torch.library.opcheck(torch.ops.prunopt.project_budget_apply_.default,
                          ([torch.empty_like(t) for t in ts], ts, cs, 0.4))
    torch.library.opcheck(torch.ops.prunopt.project_budget_apply_.default,
                          ([t.clone() for t in ts], [t.clone() for t in ts], cs, math.inf))


@needs_ext
def test_bracket_and_apply_errors_name_the_argument():
    from prunopt.ops import project_budget_apply_, project_budget_bracket

    t = torch.rand(8)
    for args, exc, match in [
        ((t, -1.0, 1.0), ValueError, "lo"),
        ((t, math.nan, 1.0), ValueError, "lo"),
        ((t, 0.5, 0.25), ValueError, "hi"),
        ((t, "0", 1.0), TypeError, "lo"),
        (([], 0.0, 1.0), TypeError, "theta"),
        ((t.long(), 0.0, 1.0), ValueError, "theta"),
    ]:
        with pytest.raises(exc, match=match):
            project_budget_bracket(*args)
    with pytest.raises(ValueError, match="cost"):
        project_budget_bracket(t, 0.0, 1.0, torch.rand(9))
    with pytest.raises(ValueError, match="theta must not be empty"):
        torch.ops.prunopt.project_budget_bracket([], [t], 0.0, 1.0)  # (the only tensors in the optional list)
    for args, exc, match in [
        ((torch.empty(8), t, -1.0), ValueError, "lam"),
        ((torch.empty(8), t, math.nan), ValueError, "lam"),
        ((torch.empty(9), t, 0.5), ValueError, "out"),
        ((torch.empty(8, dtype=torch.float64), t, 0.5), ValueError, "out"),
        ((torch.empty(8), t, "x"), TypeError, "lam"),
        (([torch.empty(8)], [t, t], 0.5), ValueError, "out"),
    ]:
        with pytest.raises(exc, match=match):
            project_budget_apply_(*args)
    leaf = torch.zeros(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf"):
        project_budget_apply_(leaf, t, 0.5)
    keep = torch.full((8,), 3.0)
    with pytest.raises(ValueError, match="out"):
        project_budget_apply_([keep, keep], [t, t], 0.5)
    assert torch.equal(keep, torch.full((8,), 3.0))  # nothing written
