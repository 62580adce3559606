"""prunopt ops of prunAdag: topk_threshold vs torch.kthvalue, prunadag_step_
vs the float64-safe reference (Porcelli et al.), opcheck and errors."""
import math

import pytest
import torch
from hypothesis import example, given, strategies as st

import prunopt
from prunopt.ops import topk_threshold
from prunopt.reference.prunadag import TensorHyper, prunadag_step_reference
from prunopt.testing import simd_clones

needs_ext = pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built")

SIZE_CHOICES = [0, 1, 2, 3, 7, 13, 64, 257, 1000, 4097]


def _values(sizes, dtype, seed, ties, scale):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        v = torch.randn(n, generator=g, dtype=torch.float64) * scale
        if ties:
            v = (v * 2).round() / 2  # many equal magnitudes, zeros and +-0
        out.append(v.to(dtype))
    return out


@given(
    sizes=st.lists(st.sampled_from(SIZE_CHOICES), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
    ties=st.booleans(),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e6]),
    frac=st.floats(0.0, 1.0),
)
@example(sizes=[4097], dtype=torch.float32, seed=0, ties=True, scale=1.0, frac=0.1)
@example(sizes=[1], dtype=torch.float64, seed=1, ties=False, scale=1.0, frac=1.0)
def test_threshold_matches_kthvalue(sizes, dtype, seed, ties, scale, frac):
    vals = _values(sizes, dtype, seed, ties, scale)
    n = sum(sizes)
    if n == 0:
        with pytest.raises(ValueError, match="k"):
            topk_threshold(vals, 1)
        return
    k = min(n, max(1, int(round(frac * n))))
    flat = torch.cat([v.abs() for v in vals])
    expected = torch.kthvalue(flat, n - k + 1).values
    got = topk_threshold(vals, k)
    assert got.dtype == dtype and got.dim() == 0
    assert torch.equal(got, expected)


def test_threshold_all_ties_and_noncontiguous():
    v = torch.ones(100, 3).t()  # non-contiguous, every |v| equal
    assert topk_threshold(v, 1).item() == 1.0 and topk_threshold(v, 300).item() == 1.0
    w = torch.tensor([-0.0, 0.0, 2.0, -2.0, 1.0])
    assert [topk_threshold(w, k).item() for k in range(1, 6)] == [2.0, 2.0, 1.0, 0.0, 0.0]
    assert topk_threshold(torch.tensor(3.0), 1).item() == 3.0  # 0-dim


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.rand(3), 0), ValueError, "k"),
        ((torch.rand(3), 4), ValueError, "k"),
        ((torch.rand(3), 1.5), TypeError, "k"),
        (("x", 1), TypeError, "values"),
        (([torch.rand(3), torch.rand(3, dtype=torch.float64)], 1), ValueError, "values"),
        ((torch.tensor([1.0, math.nan]), 1), ValueError, "non-finite"),
        ((torch.tensor([1.0, math.inf]), 2), ValueError, "non-finite"),
        ((torch.arange(4), 1), ValueError, "values"),
    ],
)
def test_threshold_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        topk_threshold(*args)


# ---------------------------------------------------------------- the step op

def _case(sizes, dtype, seed, ties):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in sizes]
    gs = [torch.randn(n, generator=g, dtype=torch.float64) for n in sizes]
    if ties:
        gs = [(x * 2).round() / 2 for x in gs]
    gs = [x.to(dtype) for x in gs]
    so = [(torch.rand(n, generator=g, dtype=torch.float64) + 0.01).to(dtype) for n in sizes]
    sd = [(torch.rand(n, generator=g, dtype=torch.float64) + 0.01).to(dtype) for n in sizes]
    return xs, gs, so, sd


def _hyper_tensor(hypers):
    rows = [[h.lr_k, h.lr_k / (h.k + 1), h.weight_decay, h.eps, float(h.maximize), float(h.prune)] for h in hypers]
    return torch.tensor(rows, dtype=torch.float64).reshape(len(hypers), 6)


@needs_ext
@given(
    sizes=st.lists(st.sampled_from(SIZE_CHOICES), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
    version=st.sampled_from([0, 1, 2, 3, 4]),
    frac=st.floats(0.01, 1.0),
    k=st.sampled_from([0.0, 1.0, 7.0]),
    wd=st.sampled_from([0.0, 0.1]),
    maximize=st.booleans(),
    unpruned_last=st.booleans(),
    ties=st.booleans(),
)
@example(sizes=[4097, 13], dtype=torch.float32, seed=3, version=3, frac=0.1, k=1.0, wd=0.0, maximize=False,
         unpruned_last=True, ties=False)
def test_step_matches_reference(sizes, dtype, seed, version, frac, k, wd, maximize, unpruned_last, ties):
    xs, gs, so, sd = _case(sizes, dtype, seed, ties)
    hypers = [TensorHyper(lr=0.7, k=k, lr_decay=0.1, weight_decay=wd, eps=1e-8, maximize=maximize,
                          prune=not (unpruned_last and i == len(sizes) - 1 and len(sizes) > 1))
              for i in range(len(sizes))]
    n = sum(x.numel() for x, h in zip(xs, hypers) if h.prune)
    T = min(n, max(1, math.ceil(frac * n))) if n else 0
    ref = [[t.clone() for t in lst] for lst in (xs, so, sd)]
    prunadag_step_reference(ref[0], gs, ref[1], ref[2], hypers, T, "relevant_only" if version == 0 else version)
    out = [[t.clone() for t in lst] for lst in (xs, so, sd)]
    torch.ops.prunopt.prunadag_step_(out[0], out[1], out[2], gs, _hyper_tensor(hypers), T, version)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-13, rtol=1e-12)
    for lo, lr in zip(out, ref):
        for a, b in zip(lo, lr):
            torch.testing.assert_close(a, b, **tol)


@needs_ext
@given(
    sizes=st.lists(st.sampled_from(SIZE_CHOICES), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float16, torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
    version=st.sampled_from([0, 1, 2, 3, 4]),
    q=st.floats(0.0, 1.0),
    ratio=st.sampled_from([0.0, 0.3, 2.5]),
    wd=st.sampled_from([0.0, 0.1]),
    maximize=st.booleans(),
    unpruned_last=st.booleans(),
    ties=st.booleans(),
)
def test_step_with_given_selection_matches_reference(sizes, dtype, seed, version, q, ratio, wd, maximize,
                                                     unpruned_last, ties):
    """A given [tau, r] (the threshold and ratio agreed over the processes that
    share a scope): R = {|g| >= tau} and r as given, for tau anywhere among the
    |g| values (quantile q; 0: every element relevant)."""
    xs, gs, so, sd = _case(sizes, dtype, seed, ties)
    hypers = [TensorHyper(lr=0.7, k=2.0, lr_decay=0.1, weight_decay=wd, eps=1e-8, maximize=maximize,
                          prune=not (unpruned_last and i == len(sizes) - 1 and len(sizes) > 1))
              for i in range(len(sizes))]
    keys = torch.cat([(-g if maximize else g).add(x, alpha=wd).abs().reshape(-1) for x, g in zip(xs, gs)])
    tau = 0.0 if keys.numel() == 0 or q == 0.0 else float(keys.float().quantile(q).to(dtype))
    ref = [[t.float() if dtype == torch.float16 else t.clone() for t in lst] for lst in (xs, so, sd)]
    gref = [g.float() if dtype == torch.float16 else g for g in gs]
    prunadag_step_reference(ref[0], gref, ref[1], ref[2], hypers, 0, "relevant_only" if version == 0 else version,
                            selection=(tau, ratio))
    out = [[t.clone() for t in lst] for lst in (xs, so, sd)]
    sel = torch.tensor([tau, ratio], dtype=torch.float64)
    torch.ops.prunopt.prunadag_step_(out[0], out[1], out[2], gs, _hyper_tensor(hypers), 0, version, None, sel)
    tol = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.float32: dict(atol=1e-6, rtol=1e-5),
           torch.float64: dict(atol=1e-13, rtol=1e-12)}[dtype]
    for lo, lr in zip(out, ref):
        for a, b in zip(lo, lr):
            torch.testing.assert_close(a, b.to(a.dtype), **tol)


@needs_ext
def test_step_given_selection_of_the_own_threshold_is_the_plain_step():
    """Given the scope's own tau and r, the op takes exactly the plain step."""
    from prunopt.reference.prunadag import prunadag_norms_reference

    xs, gs, so, sd = _case([3000, 517], torch.float32, 9, False)
    hypers = [TensorHyper(lr=0.3, k=3.0, weight_decay=0.01) for _ in xs]
    keys = [g.add(x, alpha=0.01) for x, g in zip(xs, gs)]
    tau = topk_threshold(keys, 400)
    g_r, x_m, _ = prunadag_norms_reference(xs, gs, hypers, tau).tolist()
    sel = torch.tensor([float(tau), math.sqrt(g_r) / math.sqrt(x_m)], dtype=torch.float64)
    plain = [[t.clone() for t in lst] for lst in (xs, so, sd)]
    torch.ops.prunopt.prunadag_step_(plain[0], plain[1], plain[2], gs, _hyper_tensor(hypers), 400, 3)
    given = [[t.clone() for t in lst] for lst in (xs, so, sd)]
    torch.ops.prunopt.prunadag_step_(given[0], given[1], given[2], gs, _hyper_tensor(hypers), 0, 3, None, sel)
    for a, b in zip(plain, given):
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-7)


@needs_ext
def test_step_given_selection_nonfinite_raises_or_flags_before_writing():
    xs, gs, so, sd = _case([40, 7], torch.float32, 4, False)
    gs[1][3] = float("inf")
    hyp = _hyper_tensor([TensorHyper(lr=0.5) for _ in xs])
    sel = torch.tensor([0.5, 1.0], dtype=torch.float64)
    before = [t.clone() for t in xs + so + sd]
    with pytest.raises(ValueError, match="non-finite"):
        torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyp, 0, 3, None, sel)
    flag = torch.zeros(1)
    torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyp, 0, 3, flag, sel)
    assert flag.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(xs + so + sd, before))


@needs_ext
@given(
    sizes=st.lists(st.sampled_from(SIZE_CHOICES), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
    ties=st.booleans(),
    q=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
)
@example(sizes=[4097, 0, 13], dtype=torch.float32, seed=1, ties=True, q=(0.5, 0.5))
def test_bracket_matches_reference(sizes, dtype, seed, ties, q):
    from prunopt.ops import topk_bracket
    from prunopt.reference.prunadag import topk_bracket_reference

    vals = _values(sizes, dtype, seed, ties, 3.0)
    flat = torch.cat(vals).abs()
    if flat.numel() == 0:
        lo = hi = 0.5
    else:
        lo, hi = sorted(float(flat.double().quantile(x).to(dtype)) for x in q)
    above, cands = torch.ops.prunopt.topk_bracket(vals, lo, hi)
    want_above, want_cands = topk_bracket_reference(vals, lo, hi)
    assert above.dtype == torch.int64 and above.shape == () and int(above) == int(want_above)
    assert cands.dtype == dtype and torch.equal(cands, want_cands)
    a2, c2 = topk_bracket(vals, lo, float("inf"))
    assert int(a2) == 0 and c2.numel() == int((flat >= lo).sum())


@needs_ext
@pytest.mark.parametrize("args, exc, match", [
    (([torch.ones(3, dtype=torch.int32)], 0.0, 1.0), ValueError, "float32 or float64"),
    (([torch.ones(3), torch.ones(3, dtype=torch.float64)], 0.0, 1.0), ValueError, "dtype"),
    (([torch.ones(3)], -1.0, 1.0), ValueError, "lo must be finite"),
    (([torch.ones(3)], 2.0, 1.0), ValueError, "hi must be >= lo"),
    (([torch.ones(3)], 0.1, 1.0), ValueError, "values of the values' dtype"),
    (([torch.tensor([1.0, float("nan")])], 0.0, 1.0), ValueError, "non-finite"),
])
def test_bracket_op_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        torch.ops.prunopt.topk_bracket(*args)


def test_bracket_wrapper_errors():
    from prunopt.ops import topk_bracket

    with pytest.raises(TypeError, match="non-empty list"):
        topk_bracket([], 0.0, 1.0)
    with pytest.raises(TypeError, match="lo must be a real number"):
        topk_bracket(torch.ones(3), "0", 1.0)
    with pytest.raises(ValueError, match="0 <= lo <= hi"):
        topk_bracket(torch.ones(3), 1.0, 0.5)


def _norms_case(sizes, dtype, seed, wd, maximize, unpruned_last, bad):
    """Parameters, gradients (the last one spoiled by ``bad`` when given) and
    hyper rows of the norms and bracket tests (the last tensor not pruned with
    ``unpruned_last``)."""
    xs, gs, _, _ = _case(sizes, dtype, seed, False)
    hypers = [TensorHyper(lr=0.5, weight_decay=wd, maximize=maximize,
                          prune=not (unpruned_last and i == len(sizes) - 1 and len(sizes) > 1))
              for i in range(len(sizes))]
    if bad is not None and gs[-1].numel():
        gs[-1].view(-1)[0] = float(bad)
    return xs, gs, hypers


@needs_ext
@given(
    sizes=st.lists(st.sampled_from(SIZE_CHOICES), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float16, torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
    q=st.floats(0.0, 1.0),
    wd=st.sampled_from([0.0, 0.1]),
    maximize=st.booleans(),
    unpruned_last=st.booleans(),
    bad=st.sampled_from([None, "nan", "inf"]),
)
def test_norms_matches_reference(sizes, dtype, seed, q, wd, maximize, unpruned_last, bad):
    from prunopt.reference.prunadag import prunadag_norms_reference

    xs, gs, hypers = _norms_case(sizes, dtype, seed, wd, maximize, unpruned_last, bad)
    up = [t.float() if dtype == torch.float16 else t for t in xs], [t.float() if dtype == torch.float16 else t
                                                                     for t in gs]
    keys = torch.cat([(-g if maximize else g).add(x, alpha=wd).abs().reshape(-1) for x, g in zip(*up)])
    finite = keys[torch.isfinite(keys)]
    tau = 0.0 if finite.numel() == 0 else float(finite.double().quantile(q).to(up[0][0].dtype))
    got = torch.ops.prunopt.prunadag_norms(xs, gs, _hyper_tensor(hypers), torch.tensor([tau], dtype=torch.float64))
    want = prunadag_norms_reference(up[0], up[1], hypers, tau)
    assert got.dtype == torch.float64 and got.shape == (3,)
    assert got[2].item() == want[2].item()
    if want[2].item() == 0:
        torch.testing.assert_close(got[:2], want[:2], rtol=1e-6 if dtype != torch.float64 else 1e-12, atol=1e-30)


@needs_ext
@given(
    sizes=st.lists(st.sampled_from(SIZE_CHOICES), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
    q=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    wd=st.sampled_from([0.0, 0.1]),
    maximize=st.booleans(),
    unpruned_last=st.booleans(),
    bad=st.sampled_from([None, "nan", "inf"]),
)
@example(sizes=[4097, 0, 13], dtype=torch.float32, seed=1, q=(0.2, 0.9), wd=0.1, maximize=True,
         unpruned_last=True, bad=None)
def test_prunadag_bracket_matches_reference(sizes, dtype, seed, q, wd, maximize, unpruned_last, bad):
    """The bracket pass against its float64 reference: the same count and
    candidates bit for bit (|ge| and the sign-matched x^2, in index order),
    the norms' sums to float rounding, non-finite values reported (pruned or
    not), and [lo, inf) keeps everything from lo up."""
    from prunopt.ops import prunadag_bracket
    from prunopt.reference.prunadag import prunadag_bracket_reference

    xs, gs, hypers = _norms_case(sizes, dtype, seed, wd, maximize, unpruned_last, bad)
    # (the kernels' effective gradient: weight decay's product rounded before the sum)
    keys = torch.cat([((-g if maximize else g) + x * wd).abs().reshape(-1) for x, g in zip(xs, gs)])
    finite = keys[torch.isfinite(keys)]
    lo, hi = (0.5, 0.5) if finite.numel() == 0 else sorted(float(finite.double().quantile(x).to(dtype)) for x in q)
    hyper = _hyper_tensor(hypers)
    summary, keys_in, m = torch.ops.prunopt.prunadag_bracket(xs, gs, hyper, lo, hi)
    want = prunadag_bracket_reference(xs, gs, hypers, lo, hi)
    assert summary.dtype == torch.float64 and summary.shape == (4,)
    assert summary[3].item() == want[0][3].item()
    if want[0][3].item() == 0:
        assert summary[0].item() == want[0][0].item()
        torch.testing.assert_close(summary[1:3], want[0][1:3], rtol=1e-6 if dtype == torch.float32 else 1e-12,
                                   atol=1e-30)
        assert keys_in.dtype == dtype and torch.equal(keys_in, want[1])
        assert m.dtype == torch.float64 and torch.equal(m, want[2])
        s2, g2, _ = prunadag_bracket(xs, gs, hyper, lo, float("inf"))
        pruned_keys = [k for k, h in zip(keys.split([x.numel() for x in xs]), hypers) if h.prune]
        assert s2[0].item() == 0 and s2[1].item() == 0
        assert g2.numel() == sum(int((k >= lo).sum()) for k in pruned_keys)
    else:
        assert keys_in.numel() == 0 and m.numel() == 0


@needs_ext
def test_prunadag_bracket_errors_and_opcheck():
    from prunopt.ops import prunadag_bracket

    xs, gs, _, _ = _case([6, 1, 0, 9], torch.float32, 1, False)
    hyp = _hyper_tensor([TensorHyper(lr=0.5, weight_decay=0.1 * i) for i in range(len(xs))])
    torch.library.opcheck(torch.ops.prunopt.prunadag_bracket.default, (xs, gs, hyp, 0.25, 1.5))
    torch.library.opcheck(torch.ops.prunopt.prunadag_bracket.default, (xs, gs, hyp, 0.0, float("inf")))
    op = torch.ops.prunopt.prunadag_bracket
    for args, match in [((xs, gs[:2], hyp, 0.0, 1.0), "grads must have 4 tensors"),
                        ((xs, gs, hyp.float(), 0.0, 1.0), "hyper must be a float64"),
                        ((xs, gs, hyp, -1.0, 1.0), "lo must be finite"),
                        ((xs, gs, hyp, 1.0, 0.5), "hi must be >= lo"),
                        ((xs, gs, hyp, 0.1, 1.0), "values of the params' dtype"),
                        (([x.half() for x in xs], [g.half() for g in gs], hyp, 0.0, 1.0), "float32 or float64"),
                        ((xs, [gs[0].double()] + gs[1:], hyp, 0.0, 1.0), "grads"),
                        ((xs, [torch.zeros(7)] + gs[1:], hyp, 0.0, 1.0), "shape")]:
        with pytest.raises(ValueError, match=match):
            op(*args)
    with pytest.raises(TypeError, match="lo must be a real number"):
        prunadag_bracket(xs, gs, hyp, "0", 1.0)
    with pytest.raises(ValueError, match="beyond the float range"):
        prunadag_bracket(xs, gs, hyp, 10 ** 400, 1.0)
    summary, keys, m = op([], [], torch.zeros(0, 6, dtype=torch.float64), 0.0, 1.0)
    assert summary.tolist() == [0.0] * 4 and keys.numel() == m.numel() == 0 and m.dtype == torch.float64


@needs_ext
def test_norms_op_errors_and_opchecks():
    xs, gs, _, _ = _case([6, 1, 0, 9], torch.float64, 1, False)
    hyp = _hyper_tensor([TensorHyper(lr=0.5) for _ in xs])
    tau = torch.tensor([0.3], dtype=torch.float64)
    torch.library.opcheck(torch.ops.prunopt.prunadag_norms.default, (xs, gs, hyp, tau))
    torch.library.opcheck(torch.ops.prunopt.topk_bracket.default, ([torch.randn(5, 3), torch.randn(7)], 0.25, 1.5))
    with pytest.raises(ValueError, match="tau must be a one-element float64"):
        torch.ops.prunopt.prunadag_norms(xs, gs, hyp, tau.float())
    with pytest.raises(ValueError, match="tau must be finite"):
        torch.ops.prunopt.prunadag_norms(xs, gs, hyp, torch.tensor([-1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="grads must have"):
        torch.ops.prunopt.prunadag_norms(xs, gs[:2], hyp, tau)
    with pytest.raises(ValueError, match="hyper must be"):
        torch.ops.prunopt.prunadag_norms(xs, gs, hyp[:2], tau)


@needs_ext
def test_step_float32_against_float64_reference():
    """One float32 kernel step is within float32 rounding of the float64 reference."""
    xs, gs, so, sd = _case([3000, 517], torch.float64, 5, False)
    hypers = [TensorHyper(lr=1.0, k=2.0, eps=0.0) for _ in xs]
    ref = [[t.clone() for t in lst] for lst in (xs, so, sd)]
    prunadag_step_reference(ref[0], gs, ref[1], ref[2], hypers, 352, 3)
    out = [[t.float() for t in lst] for lst in (xs, so, sd)]
    torch.ops.prunopt.prunadag_step_(out[0], out[1], out[2], [g.float() for g in gs], _hyper_tensor(hypers), 352, 3)
    for lo, lr in zip(out, ref):
        for a, b in zip(lo, lr):
            torch.testing.assert_close(a.double(), b, atol=2e-6, rtol=2e-6)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("maximize, wd", [(False, 0.0), (True, 0.1)])
def test_step_reduced_precision_is_float32_rounded_once(dtype, maximize, wd):
    """float16 / bfloat16 (as torch.optim.Adagrad(fused=True) does them): the
    float32 step on the stored values, every output rounded once to the dtype,
    bit for bit; a non-contiguous parameter and a non-finite gradient too."""
    xs, gs, so, sd = _case([4097, 13, 70], torch.float32, 7, False)
    xs[2] = torch.randn(10, 7).t()  # non-contiguous
    so[2], sd[2], gs[2] = (t.reshape(7, 10) for t in (so[2], sd[2], gs[2]))
    low = [[t.to(dtype) for t in lst] for lst in (xs, gs, so, sd)]
    hypers = [TensorHyper(lr=0.3, k=1.0, lr_decay=0.1, weight_decay=wd, eps=1e-8, maximize=maximize) for _ in xs]
    hyp = _hyper_tensor(hypers)
    ref = [[t.float() for t in lst] for lst in (low[0], low[2], low[3])]
    torch.ops.prunopt.prunadag_step_(ref[0], ref[1], ref[2], [g.float() for g in low[1]], hyp, 400, 3)
    out = [[t.clone() for t in lst] for lst in (low[0], low[2], low[3])]
    torch.ops.prunopt.prunadag_step_(out[0], out[1], out[2], low[1], hyp, 400, 3)
    for lo, lr in zip(out, ref):
        for a, b in zip(lo, lr):
            assert a.dtype == dtype and torch.equal(a, b.to(dtype))
    bad = [g.clone() for g in low[1]]
    bad[1][3] = math.nan
    before = [[t.clone() for t in lst] for lst in out]
    with pytest.raises(ValueError, match="non-finite"):
        torch.ops.prunopt.prunadag_step_(out[0], out[1], out[2], bad, hyp, 400, 3)
    flag = torch.zeros(1)
    torch.ops.prunopt.prunadag_step_(out[0], out[1], out[2], bad, hyp, 400, 3, flag)
    assert flag.item() == 1.0
    assert all(torch.equal(a, b) for lo, lb in zip(out, before) for a, b in zip(lo, lb))
    with pytest.raises(ValueError, match="grads"):  # lists of mixed dtypes are not upcast silently
        torch.ops.prunopt.prunadag_step_(out[0], out[1], out[2], [low[1][0].float()] + low[1][1:], hyp, 400, 3)


@needs_ext
def test_step_noncontiguous_and_channels_last():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, 5, generator=g).to(memory_format=torch.channels_last)
    gr = torch.randn(4, 3, 5, 5, generator=g)  # contiguous grad for a channels_last param
    so = torch.full_like(x, 0.01)
    sd = torch.full_like(x, 0.01)
    y = torch.randn(6, 7, generator=g).t()
    gy = torch.randn(7, 6, generator=g)
    hyp = [TensorHyper(lr=0.5), TensorHyper(lr=0.5)]
    ref = [[x.contiguous().clone(), y.contiguous().clone()], [so.contiguous().clone(), torch.full((7, 6), 0.01)],
           [sd.contiguous().clone(), torch.full((7, 6), 0.01)]]
    prunadag_step_reference(ref[0], [gr, gy], ref[1], ref[2], hyp, 40, 3)
    soy, sdy = torch.full((6, 7), 0.01).t(), torch.full((6, 7), 0.01).t()
    torch.ops.prunopt.prunadag_step_([x, y], [so, soy], [sd, sdy], [gr, gy], _hyper_tensor(hyp), 40, 3)
    for a, b in zip([x, y, so, soy, sd, sdy], [ref[0][0], ref[0][1], ref[1][0], ref[1][1], ref[2][0], ref[2][1]]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@needs_ext
def test_step_op_errors_leave_inputs_untouched():
    xs, gs, so, sd = _case([10, 5], torch.float32, 0, False)
    hyp = _hyper_tensor([TensorHyper(lr=1.0), TensorHyper(lr=1.0)])
    before = [t.clone() for t in xs + so + sd]
    gs[1][2] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyp, 3, 3)
    gs[1][2] = 0.0
    with pytest.raises(ValueError, match="relevant"):
        torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyp, 16, 3)
    with pytest.raises(ValueError, match="version"):
        torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyp, 3, 9)
    with pytest.raises(ValueError, match="hyper"):
        torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyp[:1], 3, 3)
    with pytest.raises(ValueError, match="grads"):
        torch.ops.prunopt.prunadag_step_(xs, so, sd, [gs[0].double(), gs[1]], hyp, 3, 3)
    with pytest.raises(ValueError, match="opt_sums"):
        torch.ops.prunopt.prunadag_step_(xs, so[:1], sd, gs, hyp, 3, 3)
    for a, b in zip(xs + so + sd, before):
        assert torch.equal(a, b)


@needs_ext
def test_step_op_bumps_version_counters():
    # every tensor the schema marks as written gets a new version, so autograd
    # and version-keyed caches see the in-place step
    xs, gs, so, sd = _case([10, 5], torch.float32, 0, False)
    hyp = _hyper_tensor([TensorHyper(lr=1.0), TensorHyper(lr=1.0)])
    written = xs + so + sd
    before = [t._version for t in written]
    gv = [g._version for g in gs]
    torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyp, 3, 3)
    assert all(t._version > v for t, v in zip(written, before))
    assert [g._version for g in gs] == gv  # read only
    w = torch.rand(10, requires_grad=True)
    loss = (w * xs[0]).sum()  # saves xs[0]
    torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyp, 3, 3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@needs_ext
def test_opcheck():
    xs, gs, so, sd = _case([6, 1, 0, 9], torch.float64, 1, False)
    hyp = _hyper_tensor([TensorHyper(lr=0.5, k=1.0) for _ in xs])
    torch.library.opcheck(torch.ops.prunopt.prunadag_step_.default, (xs, so, sd, gs, hyp, 4, 3))
    sel = torch.tensor([0.3, 1.5], dtype=torch.float64)
    torch.library.opcheck(torch.ops.prunopt.prunadag_step_.default, (xs, so, sd, gs, hyp, 0, 1, None, sel))
    torch.library.opcheck(torch.ops.prunopt.topk_threshold.default, ([torch.randn(5, 3), torch.randn(7)], 4))


@pytest.mark.slow
def test_threshold_compiles():
    def f(a, b):
        return topk_threshold([a * 2, b], 5)

    a, b = torch.randn(40), torch.randn(9)
    compiled = torch.compile(f, fullgraph=prunopt.extension_available(), backend="inductor")
    assert torch.equal(compiled(a, b), f(a, b))


# ---------------------------------------------------------------- large inputs: sampled select and its fallback
#
# Below 2^16 pruned elements the CPU kernel keeps every element as a candidate;
# above, it brackets tau with a sample and falls back to an exact radix select
# when the bracket misses or holds too many candidates (ties). Both paths must
# give torch.kthvalue's value bit for bit; PRUNOPT_PRUNADAG_SELECT=radix forces
# the fallback.

SELECT_MODES = ["sample", "radix"]
LARGE = 150_001


def _sample_blocks(total):
    """The CPU kernel's sample size in blocks of 16 (prunadag.cpp, sample_blocks)."""
    return max(128, min(2048, int(2048 * (total / 1e7) ** (2 / 3))))


def _large_values(kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return [torch.randn(LARGE, generator=g)]
    if kind == "list":  # many tensors, one empty, mixed sizes
        return [torch.randn(n, generator=g) for n in (70_001, 0, 1, 4097, 65_536, 13, 30_000)]
    if kind == "ties":  # few distinct magnitudes: the bracket holds too many candidates
        return [(torch.randn(LARGE, generator=g) * 2).round() / 2]
    if kind == "equal":
        return [torch.full((LARGE,), -0.25)]
    if kind == "zeros_and_outliers":  # mostly zero, a few huge values in one place
        v = torch.zeros(LARGE)
        v[1000:1100] = torch.randn(100, generator=g) * 1e6
        return [v, torch.randn(LARGE, generator=g) * 1e-3]
    if kind == "sorted":  # magnitude grows along the index space
        return [torch.linspace(-1.0, 3.0, LARGE), torch.linspace(5.0, 4.0, 70_000)]
    if kind == "unsampled":  # large values only between the sample blocks of kernel (see prunadag.cpp)
        total = LARGE
        sampled = torch.zeros(total, dtype=torch.bool)
        blocks = _sample_blocks(total)
        for blk in range(blocks):
            start = blk * (total - 16) // (blocks - 1)
            sampled[start:start + 16] = True
        v = torch.rand(total, generator=g)
        v[~sampled] += 10.0
        return [v]
    raise AssertionError(kind)


LARGE_KINDS = ["normal", "list", "ties", "equal", "zeros_and_outliers", "sorted", "unsampled"]


@needs_ext
@pytest.mark.parametrize("mode", SELECT_MODES)
@pytest.mark.parametrize("kind", LARGE_KINDS)
def test_threshold_large_matches_kthvalue(kind, mode, monkeypatch):
    monkeypatch.setenv("PRUNOPT_PRUNADAG_SELECT", mode)
    for dtype in (torch.float32, torch.float64):
        vals = [v.to(dtype) for v in _large_values(kind)]
        flat = torch.cat([v.abs() for v in vals])
        n = flat.numel()
        for k in (1, 2, 100, n // 1000, n // 10, n // 2, n - 1, n):
            expected = torch.kthvalue(flat, n - k + 1).values
            assert torch.equal(topk_threshold(vals, k), expected), (kind, mode, dtype, k)


@needs_ext
@pytest.mark.parametrize("n", [65_536, 700_001, 2_500_000])
def test_threshold_sample_sizes_match_kthvalue(n, monkeypatch):
    """The sample grows with n (128 blocks at the bottom, 347 at 700K, 812 at
    2.5M): every size brackets tau and gives kthvalue's value."""
    monkeypatch.setenv("PRUNOPT_PRUNADAG_SELECT", "sample")
    g = torch.Generator().manual_seed(n)
    vals = [torch.randn(n, generator=g)]
    flat = vals[0].abs()
    for k in (1, n // 100, n // 10, n // 2, n):
        assert torch.equal(topk_threshold(vals, k), torch.kthvalue(flat, n - k + 1).values), (n, k)


def _large_step_case(kind, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gs = [v.to(dtype) for v in _large_values(kind, seed)]
    xs = [torch.randn(v.shape, generator=g, dtype=torch.float64).to(dtype) for v in gs]
    so = [(torch.rand(v.shape, generator=g, dtype=torch.float64) + 0.01).to(dtype) for v in gs]
    sd = [(torch.rand(v.shape, generator=g, dtype=torch.float64) + 0.01).to(dtype) for v in gs]
    return xs, gs, so, sd


@needs_ext
@pytest.mark.parametrize("mode", SELECT_MODES)
@pytest.mark.parametrize("kind, dtype, version, wd, maximize, frac", [
    ("normal", torch.float32, 3, 0.0, False, 0.1),
    ("normal", torch.float64, 1, 0.1, True, 0.3),
    ("list", torch.float32, 3, 0.1, False, 0.05),
    ("list", torch.float32, 1, 0.1, True, 0.05),  # maximize with weight decay: -g + wd x in every pass
    ("list", torch.float64, 0, 0.0, True, 0.5),
    ("ties", torch.float32, 3, 0.0, False, 0.1),
    ("ties", torch.float32, 2, 0.1, False, 0.2),
    ("unsampled", torch.float32, 4, 0.0, False, 0.1),
    ("unsampled", torch.float32, 3, 0.0, True, 0.01),
    ("zeros_and_outliers", torch.float64, 3, 0.0, False, 0.001),
])
def test_step_large_matches_reference(kind, dtype, version, wd, maximize, frac, mode, monkeypatch):
    monkeypatch.setenv("PRUNOPT_PRUNADAG_SELECT", mode)
    xs, gs, so, sd = _large_step_case(kind, dtype)
    hypers = [TensorHyper(lr=0.3, k=2.0, lr_decay=0.1, weight_decay=wd, eps=1e-8, maximize=maximize)
              for _ in xs]
    if len(xs) > 2:  # an Adagrad-only tensor rides along
        hypers[-1] = TensorHyper(lr=0.3, k=2.0, lr_decay=0.1, weight_decay=wd, eps=1e-8, maximize=maximize, prune=False)
    n = sum(x.numel() for x, h in zip(xs, hypers) if h.prune)
    T = max(1, math.ceil(frac * n))
    ref = [[t.clone() for t in lst] for lst in (xs, so, sd)]
    prunadag_step_reference(ref[0], gs, ref[1], ref[2], hypers, T, "relevant_only" if version == 0 else version)
    out = [[t.clone() for t in lst] for lst in (xs, so, sd)]
    torch.ops.prunopt.prunadag_step_(out[0], out[1], out[2], gs, _hyper_tensor(hypers), T, version)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-13, rtol=1e-12)
    for lo, lr in zip(out, ref):
        for a, b in zip(lo, lr):
            torch.testing.assert_close(a, b, **tol)


def _assert_one_large_step_matches_reference(x, gr, gen, eps, version):
    """One step (k = 0, lr 0.1, T = n/10) of the op from accumulators in
    [0.01, 1.01) against the float64-norm reference, to the last few ulps
    (atol only for denormal results)."""
    n = x.numel()
    so = torch.rand(n, generator=gen) + 0.01
    sd = torch.rand(n, generator=gen) + 0.01
    hypers = [TensorHyper(lr=0.1, k=0.0, lr_decay=0.0, weight_decay=0.0, eps=eps, maximize=False)]
    ref = [x.clone(), so.clone(), sd.clone()]
    prunadag_step_reference([ref[0]], [gr], [ref[1]], [ref[2]], hypers, n // 10, version)
    out = [x.clone(), so.clone(), sd.clone()]
    torch.ops.prunopt.prunadag_step_([out[0]], [out[1]], [out[2]], [gr], _hyper_tensor(hypers), n // 10, version)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-37, rtol=1e-5)


@needs_ext
@pytest.mark.parametrize("mode", SELECT_MODES)
@pytest.mark.parametrize("scale", [1e-20, 1e-25])
@pytest.mark.parametrize("version", [1, 3])
def test_step_large_tiny_parameters_ratio(version, scale, mode, monkeypatch):
    """prunAdag drives the decreased weights towards 0. When the weights of M
    are tiny, float32 squares are denormal (|x| ~ 1e-20) or 0 (~1e-25), yet
    ||x||_M and so r = ||g||_R / ||x||_M must be the reference's (float64):
    with version 1 the acceptance test a <= |s| depends on r alone (a kernel
    that summed the squares in float took r from the candidates only and
    accepted the wrong elements, errors of ~0.1)."""
    monkeypatch.setenv("PRUNOPT_PRUNADAG_SELECT", mode)
    g = torch.Generator().manual_seed(5)
    n = LARGE
    x = torch.randn(n, generator=g) * scale
    x[: n // 3] = torch.randn(n // 3, generator=g) * 1e-3  # and a normal third in front
    if scale == 1e-25:
        x[: n // 3] *= 1e-22  # all tiny
    gr = torch.randn(n, generator=g)
    _assert_one_large_step_matches_reference(x, gr, g, 1e-10, version)


@needs_ext
@pytest.mark.parametrize("mode", SELECT_MODES)
@pytest.mark.parametrize("scale", [1e-20, 1e-25])
@pytest.mark.parametrize("version", [1, 3])
def test_step_large_tiny_gradients_ratio(version, scale, mode, monkeypatch):
    """Vanishing gradients: float32 squares of |g| ~ 1e-25 are 0, yet
    ||g||_R and so r must be the reference's. With ordinary accumulators the
    acceptance test a <= |s| then depends on r (a kernel that took ||g||_R from
    the candidates alone put elements in O that belong in D: decrease_sum off
    by ~20)."""
    monkeypatch.setenv("PRUNOPT_PRUNADAG_SELECT", mode)
    g = torch.Generator().manual_seed(5)
    n = LARGE
    x = torch.randn(n, generator=g)
    gr = torch.randn(n, generator=g) * scale
    _assert_one_large_step_matches_reference(x, gr, g, 1e-30, version)


@needs_ext
def test_step_large_nonfinite_raises_before_writing():
    xs, gs, so, sd = _large_step_case("list", torch.float32)
    hyp = _hyper_tensor([TensorHyper(lr=1.0) for _ in xs])
    before = [t.clone() for t in xs + so + sd]
    for bad in (math.nan, math.inf, -math.inf):
        gs[-1][-1] = bad  # the very last element: found by the scan before any write
        with pytest.raises(ValueError, match="non-finite"):
            torch.ops.prunopt.prunadag_step_(xs, so, sd, gs, hyp, 1000, 3)
        for a, b in zip(xs + so + sd, before):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- the float32 element pass's shortcut
#
# For float32 the vectorised element pass decides the acceptance test
# a <= |st| <= b (eq. 2.8) from an estimate of |st| built with rsqrt, and then
# computes only the quotient each lane needs (st where optimised, sl where
# decreased): one sqrt and one division per lane instead of two. Vectors with
# an undecided lane are computed exactly. The result must be bit for bit that
# of the scalar formula (update_one), including lanes placed right at a = |st|
# and |st| = b, accumulators around the estimate's cut (eps^2 2^22), tiny and
# huge accumulators, and eps = 0; on every SIMD clone (PRUNOPT_NO_AVX512 picks
# the AVX2 one on an AVX-512 host).

def _update_np(x, so, sd, g, tau, lr, lr1, eps, version):
    """update_one (csrc/include/prunopt/prunadag.h) in numpy (x's dtype), operation by operation."""
    import numpy as np
    f = x.dtype.type
    with np.errstate(all="ignore"):
        rel = np.abs(g) >= f(tau)
        so_new = so + g * g
        s = (g * f(-lr)) / (np.sqrt(so_new) + f(eps))
        ax = np.abs(x)
        m = ~rel & (x * g > 0)
        a = ax * f(lr1)
        as_ = np.abs(s)
        acc = m & (a <= as_) & ((version < 3) | (as_ <= ax))
        opt = rel | acc
        sd_new = sd + x * x
        sl = (ax * f(lr)) / (np.sqrt(sd_new) + f(eps))
        dec = np.where(m, np.where(a < sl, a, sl), f(0))
        xd = np.where(x < 0, x + dec, x - dec)
    return np.where(opt, x + s, xd), np.where(opt, so_new, so), np.where(opt, sd, sd_new)


def _assert_step_equals_numpy(x, so, sd, g, T, lr, lr1, eps, version):
    """One kernel step on (x, so, sd, g) with T relevant elements is
    bitwise the element-wise numpy formula (_update_np) at the exact tau."""
    import numpy as np
    tau = np.sort(np.abs(g))[-T]
    hyper = torch.tensor([[lr, lr1, 0.0, eps, 0.0, 1.0]], dtype=torch.float64)
    out = [torch.from_numpy(a.copy()) for a in (x, so, sd)]
    torch.ops.prunopt.prunadag_step_([out[0]], [out[1]], [out[2]], [torch.from_numpy(g)], hyper, T, version)
    expected = _update_np(x, so, sd, g, tau, lr, lr1, eps, version)
    for got, exp in zip(out, expected):
        assert torch.equal(got, torch.from_numpy(exp))


@needs_ext
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("version", [2, 4])
def test_step_tiny_parameters_are_exact(dtype, version):
    """The element pass squares 0 instead of a tiny x where x * x cannot change
    sd (|x| < 2^-60 and sd >= 2^-90 in float32; 2^-520 / 2^-960 in float64), so
    that long runs, which drive decreased weights towards 0, take no underflow
    assists. The result has the bits of update_one for every x and sd around
    those bounds, denormals and zeros included."""
    import numpy as np
    rng = np.random.default_rng(1)
    f = np.dtype(dtype).type
    xt, sb = (2.0 ** -60, 2.0 ** -90) if dtype == "float32" else (2.0 ** -520, 2.0 ** -960)
    tiny = np.finfo(dtype).tiny
    xs = np.array([xt, np.nextafter(f(xt), f(0)), np.nextafter(f(xt), f(1)), xt / 2, xt / 1e3, xt * 2,
                   tiny, tiny / 3, tiny * 1e-6, 0.0, 1e-3, 1.0], dtype=dtype)
    # (below sb, e.g. sb * 2^-10, x * x does change sd: the guard must leave those)
    sds = np.array([sb, np.nextafter(f(sb), f(0)), np.nextafter(f(sb), f(1)), sb / 4, sb * 4, sb * 2.0 ** -10,
                    sb * 2.0 ** -20, 0.0, tiny / 5, tiny, xt * xt * 4, 1e-2, 1.0], dtype=dtype)
    n = 16 * 1024 + 3
    x = rng.choice(xs, n) * rng.choice([-1, 1], n)
    sd = rng.choice(sds, n)
    g = rng.standard_normal(n).astype(dtype)
    so = (rng.random(n) + 0.01).astype(dtype)
    x, sd = x.astype(dtype), sd.astype(dtype)
    lr, lr1 = 0.3, 0.01
    T = n // 10
    _assert_step_equals_numpy(x, so, sd, g, T, lr, lr1, 1e-10, version)


@needs_ext
@pytest.mark.parametrize("version", [2, 4])
@pytest.mark.parametrize("eps", [1e-10, 0.0])
def test_step_float32_shortcut_is_exact(version, eps):
    import numpy as np
    rng = np.random.default_rng(0)
    n = 64 * 1024 + 5  # a vector tail too
    f = np.float32
    lr, lr1 = 0.3, 0.3 / 8.0
    x = rng.standard_normal(n).astype(f)
    g = rng.standard_normal(n).astype(f)
    so = (rng.random(n) + 0.01).astype(f)
    # sd around the value that makes a = sl: sqrt(sd + x^2) + eps = lr / lr1 = 8
    # (first half: mostly surely a < sl, so that whole vectors take the shortcut
    # with a near-boundary lane among them now and then)
    near = [0.0, 1e-7, -1e-7, 1e-5, -1e-5, 1e-3, -1e-3]
    rel_off = np.concatenate([rng.choice([-0.5] * 12 + near, n // 2), rng.choice(near + [0.5, -0.5, 10.0], n - n // 2)])
    target = (8.0 * (1 + rel_off) - eps) ** 2 - x.astype(np.float64) ** 2
    sd = np.where(target > 0, target, 1.0).astype(f)
    # extremes: zero, denormal and huge accumulators, tiny and huge parameters
    idx = rng.choice(n, 400, replace=False)
    sd[idx[:80]] = 0.0
    sd[idx[80:160]] = 1e-41
    sd[idx[160:240]] = 3e38
    x[idx[240:320]] = 1e-30
    x[idx[320:400]] = 1e15
    T = n // 10
    _assert_step_equals_numpy(x, so, sd, g, T, lr, lr1, eps, version)


@needs_ext
@pytest.mark.parametrize("isa", ["default", "no_avx512", "no_simd"])
@pytest.mark.parametrize("version", [2, 4])
@pytest.mark.parametrize("eps", [1e-10, 0.0, 1e-3])
def test_step_float32_acceptance_estimate_is_exact(version, eps, isa, monkeypatch):
    import numpy as np
    monkeypatch.delenv("PRUNOPT_NO_AVX512", raising=False)
    monkeypatch.delenv("PRUNOPT_NO_SIMD", raising=False)
    if isa == "no_avx512":
        monkeypatch.setenv("PRUNOPT_NO_AVX512", "1")
    elif isa == "no_simd":  # the DEFAULT capability's clone
        monkeypatch.setenv("PRUNOPT_NO_SIMD", "1")
    rng = np.random.default_rng(2)
    n = 64 * 1024 + 11
    f = np.float32
    lr, lr1 = 0.3, 0.3 / 8.0
    g = (rng.standard_normal(n) * 0.5).astype(f)  # |g| < tau for most lanes: M is large
    so = (rng.random(n) * 2 + 0.01).astype(f)
    # so_new around the estimate's cut eps^2 2^22 (eps = 1e-3: 4.19): both sides
    cut = eps * eps * 2.0 ** 22
    if cut > 0:
        k = rng.choice(n, n // 8, replace=False)
        so[k] = (cut * (1 + rng.choice([-1e-3, -1e-7, 0.0, 1e-7, 1e-3], k.size)) - g[k].astype(np.float64) ** 2
                 ).clip(0).astype(f)
    so_new = (so + g * g).astype(np.float64)
    st = lr * np.abs(g.astype(np.float64)) / (np.sqrt(so_new) + eps)
    # |x| placed so that a = lr1 |x| or b = |x| sits at |st| (1 + off)
    off = rng.choice([0.0, 1e-7, -1e-7, 6e-8, -6e-8, 1e-5, -1e-5, 1e-3, -1e-3, 2e-3, -2e-3, 0.5, -0.5], n)
    which = rng.integers(0, 3, n)  # 0: at a, 1: at b, 2: random
    ax = np.where(which == 0, st * (1 + off) / lr1, np.where(which == 1, st * (1 + off), np.abs(rng.standard_normal(n))))
    x = (ax * np.where(rng.random(n) < 0.85, np.sign(g), -np.sign(g))).astype(f)  # mostly sign-matched
    sd = (rng.random(n) + 0.01).astype(f)
    # extremes: zero, denormal and huge accumulators, zero gradients, tiny and huge parameters
    idx = rng.choice(n, 600, replace=False)
    so[idx[:80]] = 0.0
    so[idx[80:160]] = 1e-41
    so[idx[160:240]] = 3e38
    g[idx[240:320]] = 0.0
    g[idx[320:400]] = 1e-30
    x[idx[400:480]] = 1e-30
    x[idx[480:560]] = 1e15
    so[idx[560:600]] = 1e-41
    g[idx[560:600]] = 1e-25
    T = n // 20
    _assert_step_equals_numpy(x, so, sd, g, T, lr, lr1, eps, version)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("version", [0, 2, 3, 4])
def test_step_simd_clones_agree(dtype, version, monkeypatch):
    """The AVX-512, AVX2 and DEFAULT clones of the scan and the element pass
    (same operations per element) give the same bits for versions 2 and 4;
    versions that use the ratio r of two norms summed in SIMD lanes
    (relevant_only, 1, 3) agree to rounding (the lanes' summation order
    differs)."""
    xs, gs, so, sd = _large_step_case("list", dtype, seed=5)
    hypers = [TensorHyper(lr=0.3, k=2.0, lr_decay=0.1, weight_decay=0.01, eps=1e-8, maximize=False) for _ in xs]
    n = sum(x.numel() for x in xs)
    outs = []
    for _ in simd_clones(monkeypatch, default=True):
        out = [[t.clone() for t in lst] for lst in (xs, so, sd)]
        torch.ops.prunopt.prunadag_step_(out[0], out[1], out[2], gs, _hyper_tensor(hypers), n // 10, version)
        outs.append(out)
    assert len(outs) == 3
    for other in outs[1:]:
        for la, lb in zip(outs[0], other):
            for a, b in zip(la, lb):
                if version in (2, 4):
                    assert torch.equal(a, b)
                else:
                    torch.testing.assert_close(a, b, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0.0)


def test_reference_sqrt_is_correctly_rounded():
    # every float32 mantissa of [1, 4) (sqrt is scale-invariant by powers of 4):
    # the reference's root is the IEEE one, whatever torch.sqrt does here
    import numpy as np

    from prunopt.reference.prunadag import ieee_sqrt

    t = torch.arange(0x3F800000, 0x40800000, 61, dtype=torch.int32).view(torch.float32)
    expect = torch.from_numpy(np.sqrt(t.numpy()))  # numpy: the hardware sqrtps
    assert torch.equal(ieee_sqrt(t), expect)
    assert torch.equal(ieee_sqrt(t.double()), t.double().sqrt())
