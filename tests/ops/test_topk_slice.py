"""topk_slice (one rank's slice of the sharded top-k threshold): the compiled
op against its pure-PyTorch reference bit for bit, the invariants that the
sharded select relies on, opcheck and errors."""
import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import prunopt
from prunopt.ops import prunadag_slice, topk_slice
from prunopt.reference.prunadag import SLICE_SAMPLE, topk_slice_reference
from tests.ops.test_prunadag_ops import _values

needs_ext = pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built")

_INT = {torch.float32: torch.int32, torch.float64: torch.int64}
_TOP = {torch.float32: 0x7F7FFFFF, torch.float64: 0x7FEFFFFFFFFFFFFF}


def _same(a, b):
    """Equal bit for bit (floats compared through their bit patterns)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        a, b = a.view(_INT[a.dtype]), b.view(_INT[b.dtype])
    return torch.equal(a, b)


def _check_invariants(values, share, buckets, cap, out):
    """What the sharded select relies on, from the values themselves."""
    head, hist, window, inside = out
    dtype = values[0].dtype
    h = head.tolist()
    n, above, start, j, nb, bad = h[:6]
    w_above, w_lo, w_end, w_m = h[6:10]
    scan_start, scan_stop = h[10:12]
    flat = torch.cat([v.reshape(-1) for v in values]) if values else torch.empty(0, dtype=dtype)
    assert n == flat.numel()
    if n == 0:
        assert h == [0] * 8 + [_TOP[dtype] + 1, 0, 0, 0]
        return
    if not bool(torch.isfinite(flat).all()):
        assert bad == 1 and above == 0 and inside.numel() == 0 and w_m == -1
        return
    bits = flat.abs().view(_INT[dtype]).long()
    assert bad == 0
    # what was read: the count beyond it and the candidates inside it, in index order
    assert above == int((bits >= scan_stop).sum())
    assert _same(inside, flat.abs()[(bits >= scan_start) & (bits < scan_stop)])
    # the grid: nb buckets of 2^j from start, at most `buckets`, aligned, holding every candidate
    assert 1 <= nb <= buckets and start % (1 << j) == 0 and start >= scan_start
    keys = inside.view(_INT[dtype]).long()
    assert int(hist.sum()) == inside.numel() and hist.numel() == nb
    if keys.numel():
        assert torch.equal(hist, torch.bincount((keys - start) >> j, minlength=nb))
    if w_m < 0:
        assert window.numel() == 0
        return
    assert cap > 0 and w_m == window.numel() <= cap
    # the window's promise: for every t in [w_lo, w_end), #{|v| >= t} = w_above + #{window >= t}
    w = window.long()
    for t in sorted({w_lo, w_end - 1, *w.tolist()[:50]}):
        if w_lo <= t < w_end:
            assert int((bits >= t).sum()) == w_above + int((w >= t).sum()), t


@needs_ext
@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 7, 300, 4097, 40000, 150000]), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
    ties=st.booleans(),
    scale=st.sampled_from([1e-30, 1.0, 1e6]),
    q=st.floats(-0.1, 1.1),
    buckets=st.sampled_from([1, 7, 64, 2042]),
    cap=st.sampled_from([0, 1, 100, 8184]),
    nonfinite=st.sampled_from([None, math.inf, math.nan]),
    sample=st.sampled_from([SLICE_SAMPLE, (64, 64, 4), (100, 700, 16), (1, 1, 1)]),
)
@example(sizes=[150000], dtype=torch.float32, seed=0, ties=False, scale=1.0, q=0.05, buckets=2042, cap=8184,
         nonfinite=None, sample=SLICE_SAMPLE)
@example(sizes=[40000, 7], dtype=torch.float64, seed=3, ties=True, scale=1.0, q=0.5, buckets=64, cap=100,
         nonfinite=None, sample=SLICE_SAMPLE)
@example(sizes=[300], dtype=torch.float32, seed=1, ties=False, scale=1.0, q=0.5, buckets=7, cap=8184,
         nonfinite=math.nan, sample=(64, 64, 4))
def test_slice_matches_reference(sizes, dtype, seed, ties, scale, q, buckets, cap, nonfinite, sample):
    values = _values(sizes, dtype, seed, ties, scale)
    n = sum(sizes)
    if nonfinite is not None and n:
        i = next(i for i, v in enumerate(values) if v.numel())
        values[i][seed % values[i].numel()] = nonfinite
    share = int(round(q * n))
    got = torch.ops.prunopt.topk_slice(values, share, buckets, cap, list(sample))
    want = topk_slice_reference(values, share, buckets, cap, sample)
    for g, w in zip(got, want):
        assert _same(g, w)
    _check_invariants(values, share, buckets, cap, got)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_slice_samples_blocks_and_single_values(dtype):
    """A list where some tensors hold whole sample blocks and others fewer
    blocks than the stride (sampled one value at a time), non-contiguous and
    multi-dimensional tensors among them, and shares at both ends."""
    g = torch.Generator().manual_seed(5)
    values = [torch.randn(400, 300, generator=g, dtype=dtype).t(), torch.randn(1000, generator=g, dtype=dtype),
              torch.randn(3, 50, generator=g, dtype=dtype), torch.randn(60000, generator=g, dtype=dtype)]
    n = sum(v.numel() for v in values)
    for share in (1, 2, n // 7, n // 2, n - 1, n):
        got = topk_slice(values, share, 2042, 8184)
        want = topk_slice_reference(values, share, 2042, 8184)
        assert all(_same(a, b) for a, b in zip(got, want)), share
        _check_invariants(values, share, 2042, 8184, got)


@needs_ext
def test_slice_of_a_rank_without_values_and_a_bracket_open_above():
    for dtype in (torch.float32, torch.float64):
        empty = [torch.empty(0, dtype=dtype)]
        got = torch.ops.prunopt.topk_slice(empty, 1, 64, 100, list(SLICE_SAMPLE))
        assert got[0].tolist() == [0] * 8 + [_TOP[dtype] + 1, 0, 0, 0]
        assert got[1].numel() == got[2].numel() == got[3].numel() == 0
        assert got[2].dtype == _INT[dtype] and got[3].dtype == dtype
        # share 1 of a few values: the bracket opens above, the grid ends at the largest
        v = [torch.tensor([0.5, -3.0, 2.0], dtype=dtype)]
        head = topk_slice(v, 1, 64, 100)[0].tolist()
        largest = int(torch.tensor(3.0, dtype=dtype).view(_INT[dtype]))
        assert head[2] + (head[4] << head[3]) > largest >= head[2] + ((head[4] - 1) << head[3])
        _check_invariants(v, 1, 64, 100, topk_slice(v, 1, 64, 100))


def test_wrapper_reference_path_matches_op(monkeypatch):
    """Without a kernel for the device the wrapper runs the reference (the
    same results)."""
    import prunopt.ops.prunadag as P

    values = _values([5000, 33], torch.float32, 2, True, 1.0)
    want = topk_slice_reference(values, 700, 64, 500)
    monkeypatch.setattr(P, "_SLICE_DEVICES", frozenset())
    got = P.topk_slice(values, 700, 64, 500)
    assert all(_same(a, b) for a, b in zip(got, want))


@needs_ext
@pytest.mark.parametrize("args, match", [
    (([], 1, 64, 0), "values must not be empty"),
    (([torch.ones(3, dtype=torch.int32)], 1, 64, 0), "float32 or float64"),
    (([torch.ones(3), torch.ones(2, dtype=torch.float64)], 1, 64, 0), r"values\[1\] must have dtype"),
    (([torch.ones(3)], 1, 0, 0), "buckets must be >= 1"),
    (([torch.ones(3)], 1, 64, -1), "cap must be >= 0"),
    (([torch.ones(3)], 1, 64, 0, [0, 5, 4]), "sample must be"),
    (([torch.ones(3)], 1, 64, 0, [8, 5, 4]), "sample must be"),
    (([torch.ones(3)], 1, 64, 0, [8, 8, 0]), "sample must be"),
    (([torch.ones(3)], 1, 64, 0, [8, 8]), "sample must be"),
])
def test_slice_op_errors(args, match):
    if len(args) == 4:
        args = args + (list(SLICE_SAMPLE),)
    with pytest.raises(ValueError, match=match):
        torch.ops.prunopt.topk_slice(*args)


def test_slice_wrapper_errors():
    with pytest.raises(TypeError, match="values"):
        topk_slice([], 1, 64, 0)
    with pytest.raises(TypeError, match="share"):
        topk_slice(torch.ones(3), 1.5, 64, 0)
    with pytest.raises(TypeError, match="buckets"):
        topk_slice(torch.ones(3), 1, True, 0)
    with pytest.raises(TypeError, match="cap"):
        topk_slice(torch.ones(3), 1, 64, None)
    with pytest.raises(ValueError, match="buckets must be >= 1"):
        topk_slice(torch.ones(3), 1, 0, 0)
    with pytest.raises(ValueError, match="cap must be >= 0"):
        topk_slice(torch.ones(3), 1, 64, -2)
    with pytest.raises(ValueError, match="float32 or float64"):
        topk_slice(torch.ones(3, dtype=torch.float16), 1, 64, 0)
    with pytest.raises(TypeError, match="sample"):
        topk_slice(torch.ones(3), 1, 64, 0, sample=(1, 2))
    with pytest.raises(TypeError, match="sample"):
        topk_slice(torch.ones(3), 1, 64, 0, sample=(1, 2, 1.5))
    with pytest.raises(ValueError, match="sample"):
        topk_slice(torch.ones(3), 1, 64, 0, sample=(3, 2, 1))


@needs_ext
def test_slice_opcheck():
    g = torch.Generator().manual_seed(0)
    for args in (([torch.randn(5, 3, generator=g), torch.randn(7, generator=g)], 4, 64, 8, [4, 4, 2]),
                 ([torch.randn(40000, generator=g, dtype=torch.float64)], 4000, 2042, 8184, list(SLICE_SAMPLE)),
                 ([torch.empty(0)], 1, 64, 0, list(SLICE_SAMPLE))):
        torch.library.opcheck(torch.ops.prunopt.topk_slice.default, args)


# ---------------------------------------------------------------- prunadag_slice

def _prunadag_case(sizes, dtype, seed, wd, maximize, unpruned, bad):
    from prunopt.reference.prunadag import TensorHyper

    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in sizes]
    gs = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in sizes]
    hypers = [TensorHyper(lr=0.5, weight_decay=wd, maximize=maximize, prune=i not in unpruned)
              for i in range(len(sizes))]
    if bad is not None and gs[-1].numel():
        gs[-1][seed % gs[-1].numel()] = bad
    rows = [[h.lr_k, h.lr_k / (h.k + 1), h.weight_decay, h.eps, float(h.maximize), float(h.prune)] for h in hypers]
    return xs, gs, hypers, torch.tensor(rows, dtype=torch.float64).reshape(len(sizes), 6)


def _check_prunadag_slice(got, want, dtype):
    """Bit for bit but the float64 sums (the kernel's blocks and order: to
    rounding)."""
    head, sums, hist, w_bits, w_m, keys, m = got
    assert _same(head, want[0]) and _same(hist, want[2]) and _same(w_bits, want[3]) and _same(keys, want[5])
    assert _same(w_m, want[4]) and _same(m, want[6])
    torch.testing.assert_close(sums, want[1], rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-30)


@needs_ext
@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 13, 300, 4097, 40000]), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
    wd=st.sampled_from([0.0, 0.1]),
    maximize=st.booleans(),
    unpruned=st.sampled_from([(), (0,), (1,)]),
    bad=st.sampled_from([None, math.inf, math.nan]),
    q=st.floats(-0.1, 1.1),
    buckets=st.sampled_from([1, 64, 2042]),
    cap=st.sampled_from([0, 10, 4094]),
    sample=st.sampled_from([SLICE_SAMPLE, (64, 64, 4), (1, 1, 1)]),
)
@example(sizes=[40000, 300], dtype=torch.float32, seed=0, wd=0.1, maximize=True, unpruned=(1,), bad=None, q=0.05,
         buckets=2042, cap=4094, sample=(64, 64, 4))
@example(sizes=[0, 13], dtype=torch.float64, seed=1, wd=0.0, maximize=False, unpruned=(1,), bad=math.inf, q=0.5,
         buckets=64, cap=10, sample=SLICE_SAMPLE)
def test_prunadag_slice_matches_reference(sizes, dtype, seed, wd, maximize, unpruned, bad, q, buckets, cap, sample):
    from prunopt.reference.prunadag import prunadag_slice_reference

    xs, gs, hypers, hyper = _prunadag_case(sizes, dtype, seed, wd, maximize, unpruned, bad)
    n = sum(x.numel() for x, h in zip(xs, hypers) if h.prune)
    share = int(round(q * n))
    got = torch.ops.prunopt.prunadag_slice(xs, gs, hyper, share, buckets, cap, list(sample))
    want = prunadag_slice_reference(xs, gs, hypers, share, buckets, cap, sample)
    _check_prunadag_slice(got, want, dtype)
    head = got[0].tolist()
    assert head[0] == n
    # bad = 1 whenever an effective gradient of any tensor is not finite, pruned or not
    assert head[5] == int(bad is not None and sizes[-1] > 0)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prunadag_slice_window_promise(dtype):
    """For any t in the window, this rank's sum of ge^2 over |ge| >= t is
    G_w + the window's c^2 >= t, and its sign-matched x^2 over |ge| < t is
    X_w + the window's m < t (float64, to rounding); the keys are |ge| with
    weight decay's product rounded before the sum."""
    xs, gs, hypers, hyper = _prunadag_case([30000, 20000], dtype, 3, 0.1, True, (), None)
    head, sums, _, w_bits, w_m, keys, m = prunadag_slice(xs, gs, hyper, 5000, 2042, 4094)
    h = head.tolist()
    assert 0 < h[9] <= 4094
    ge = torch.cat([(-g + x * 0.1).reshape(-1) for x, g in zip(xs, gs)])
    x = torch.cat([x.reshape(-1) for x in xs])
    bits = ge.abs().view(_INT[dtype]).long()
    sign_m = (x.double() ** 2) * (x * ge > 0)
    wb = w_bits.long()
    c2 = torch.from_numpy(w_bits.numpy()).view(dtype).double() ** 2
    for t in sorted({h[7], h[8] - 1, *wb.tolist()[:20]}):
        if h[7] <= t < h[8]:
            assert int((bits >= t).sum()) == h[6] + int((wb >= t).sum())
            want_g = float((ge.double() ** 2)[bits >= t].sum())
            want_x = float(sign_m[bits < t].sum())
            assert math.isclose(float(sums[2]) + float(c2[wb >= t].sum()), want_g, rel_tol=1e-6)
            assert math.isclose(float(sums[3]) + float(w_m[wb < t].sum()), want_x, rel_tol=1e-6)


def test_prunadag_slice_wrapper_reference_path_and_errors(monkeypatch):
    import prunopt.ops.prunadag as P
    from prunopt.reference.prunadag import prunadag_slice_reference

    xs, gs, hypers, hyper = _prunadag_case([5000, 70], torch.float32, 2, 0.1, False, (1,), None)
    want = prunadag_slice_reference(xs, gs, hypers, 700, 64, 500, SLICE_SAMPLE)
    monkeypatch.setattr(P, "_PRUNADAG_SLICE_DEVICES", frozenset())
    got = P.prunadag_slice(xs, gs, hyper, 700, 64, 500)
    assert all(_same(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="params must not be empty"):
        P.prunadag_slice([], [], torch.zeros(0, 6, dtype=torch.float64), 1, 64, 0)
    with pytest.raises(TypeError, match="params"):
        prunadag_slice(xs[0], gs, hyper, 1, 64, 0)
    with pytest.raises(TypeError, match="hyper"):
        prunadag_slice(xs, gs, None, 1, 64, 0)
    with pytest.raises(TypeError, match="cap"):
        prunadag_slice(xs, gs, hyper, 1, 64, 0.5)


@needs_ext
@pytest.mark.parametrize("change, match", [
    (lambda a: a.__setitem__(0, []), "grads must have 0 tensors"),
    (lambda a: a.__setitem__(1, a[1][:1]), "grads must have 2 tensors"),
    (lambda a: a.__setitem__(2, a[2].float()), "hyper must be a float64"),
    (lambda a: a.__setitem__(1, [a[1][0], a[1][1].double()]), r"grads\[1\] must have dtype"),
    (lambda a: a.__setitem__(1, [a[1][0], a[1][1][:3]]), r"grads\[1\] must have the shape"),
    (lambda a: a.__setitem__(4, 0), "buckets must be >= 1"),
    (lambda a: a.__setitem__(5, -1), "cap must be >= 0"),
    (lambda a: a.__setitem__(6, [4, 2, 1]), "sample must be"),
])
def test_prunadag_slice_op_errors(change, match):
    xs, gs, _, hyper = _prunadag_case([50, 20], torch.float32, 0, 0.0, False, (), None)
    args = [xs, gs, hyper, 10, 64, 16, list(SLICE_SAMPLE)]
    change(args)
    with pytest.raises(ValueError, match=match):
        torch.ops.prunopt.prunadag_slice(*args)
    # (the fake kernel checks the same)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [[mode.from_tensor(t) for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                else mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(ValueError, match=match):
            torch.ops.prunopt.prunadag_slice(*fake)


@needs_ext
def test_prunadag_slice_opcheck():
    for dtype in (torch.float32, torch.float64):
        xs, gs, _, hyper = _prunadag_case([300, 40, 0], dtype, 1, 0.1, True, (1,), None)
        torch.library.opcheck(torch.ops.prunopt.prunadag_slice.default, (xs, gs, hyper, 30, 64, 16, [8, 8, 2]))
        torch.library.opcheck(torch.ops.prunopt.prunadag_slice.default,
                              (xs, gs, hyper, 30, 2042, 0, list(SLICE_SAMPLE)))
