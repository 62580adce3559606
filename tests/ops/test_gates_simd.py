"""The vectorised CPU kernels of rgf_relu, two_temperature_sigmoid and sparse_gate
(ATen's at::vec::Vectorized per CPU capability, csrc/cpu/gates_kernels.inc):
vector tails, the vector exp over its whole range, special values, both
sparse_gate layouts (many short groups in a scratch row, few long groups split
over threads, rows longer than the scratch), the AVX2 and AVX-512 clones against
each other, and the scalar fallback (PRUNOPT_NO_SIMD=1, ATEN_CPU_CAPABILITY=default)
against the float64 reference."""
import os
import subprocess
import sys

import pytest
import torch

import prunopt
from prunopt.ops import rgf_relu, sparse_gate, two_temperature_sigmoid
from prunopt.reference import (
    rgf_relu_backward_reference,
    sparse_gate_backward_reference,
    sparse_gate_reference,
    two_temperature_sigmoid_backward_reference,
    two_temperature_sigmoid_reference,
)
from prunopt.testing import avx512_cpu, simd_clones, tolerance

pytestmark = pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built")

# around the 8 (float) and 4 (double) lane widths, and a chunk boundary
TAIL_SIZES = [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 4097]
DTYPES = [torch.float32, torch.float64]


def _input(n, dtype, seed, scale=3.0, noncontig=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2 if noncontig else 1, generator=g, dtype=torch.float64) * scale
    return x.to(dtype)[:, 0]  # column 0 of (n, 2) has stride 2


def _grad_tol(dtype, g):
    return tolerance(dtype)["atol"] * (1 + (g.abs().amax().item() if g.numel() else 0))


@pytest.mark.parametrize("noncontig", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", TAIL_SIZES)
def test_elementwise_tails(n, dtype, noncontig):
    x = _input(n, dtype, n, noncontig=noncontig)
    assert x.is_contiguous() == (not noncontig or n <= 1)
    g = _input(n, dtype, n + 1)
    xr = x.clone().requires_grad_(True)
    y = rgf_relu(xr, 0.3)
    torch.testing.assert_close(y, torch.relu(x), atol=0, rtol=0)
    (gx,) = torch.autograd.grad(y, xr, g)
    torch.testing.assert_close(gx.double(), rgf_relu_backward_reference(g.double(), x.double(), 0.3),
                               atol=_grad_tol(dtype, g), rtol=0)
    w = (x * 0.01).requires_grad_(True)
    v = two_temperature_sigmoid(w, 100.0, 2.0)
    torch.testing.assert_close(v.double(), two_temperature_sigmoid_reference(w.detach().double(), 100.0, 2.0),
                               **tolerance(dtype))
    (gw,) = torch.autograd.grad(v, w, g)
    torch.testing.assert_close(gw.double(),
                               two_temperature_sigmoid_backward_reference(g.double(), w.detach().double(), 2.0),
                               atol=_grad_tol(dtype, g) * 2.0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_exp_over_its_range(dtype):
    # rgf_relu_backward with alpha = 1 and grad = 1 is exp(x) for x <= 0: the
    # vector exp, relative to float64 exp, down to the flush to 0 below e^-80
    # (float) / e^-700 (double) that keeps the kernels free of denormals.
    flush = -80.0 if dtype == torch.float32 else -700.0
    x = torch.cat([torch.linspace(flush * 1.1, 0.0, 20011, dtype=torch.float64),
                   torch.tensor([flush, -0.0, -1e-30, -1e-8], dtype=torch.float64)]).to(dtype)
    got = torch.ops.prunopt.rgf_relu_backward(torch.ones_like(x), x, 1.0).double()
    want = torch.exp(x.double())
    kept = x.double() >= flush
    rel = ((got - want).abs() / want)[kept]
    assert rel.max().item() <= 2 * torch.finfo(dtype).eps, rel.max().item()
    # below the flush: 0 (the scalar tail, libm exp, may give the tiny exact value)
    assert (got[~kept] <= want[~kept] * (1 + 4 * torch.finfo(dtype).eps)).all()
    assert got[:16].eq(0).all()  # a full vector below the flush


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_over_the_exp_range(dtype):
    # forward: 1 / (1 + exp(-t_l w)) where exp(-t_l w) runs up to overflow (v -> 0)
    lim = 120.0 if dtype == torch.float32 else 800.0
    w = torch.linspace(-lim, lim, 40009, dtype=torch.float64).to(dtype)
    v = torch.ops.prunopt.two_temperature_sigmoid(w, 1.0, 1.0).double()
    want = torch.sigmoid(w.double())
    ulp = torch.finfo(dtype).eps
    rel = (v - want).abs() / want.clamp_min(torch.finfo(dtype).tiny)
    assert rel[want > torch.finfo(dtype).tiny * 4].max().item() <= 3 * ulp
    gw = torch.ops.prunopt.two_temperature_sigmoid_backward(torch.ones_like(w), w, 1.0).double()
    gwant = want * torch.sigmoid(-w.double())  # sigmoid (1 - sigmoid), without the cancellation
    flush = 80.0 if dtype == torch.float32 else 700.0  # exp(-|w|) is flushed to 0 beyond
    keep = w.double().abs() <= flush
    assert ((gw - gwant).abs() / gwant)[keep].max().item() <= 4 * ulp
    assert (gw[~keep] <= gwant[~keep] * (1 + 4 * ulp)).all() and (gw >= 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([nan, -inf, inf, -0.0, 0.0, -1e30, 1e30, -88.8, 88.8, -709.9, 709.9, -746.0] * 3, dtype=dtype)
    g = torch.ones_like(x)
    for alpha in (0.0, 0.1):
        got = torch.ops.prunopt.rgf_relu_backward(g, x, alpha)
        want = rgf_relu_backward_reference(g, x, alpha)
        torch.testing.assert_close(got, want, equal_nan=True, atol=1e-30, rtol=1e-6)
    torch.testing.assert_close(torch.ops.prunopt.rgf_relu(x, 0.1), torch.relu(x), equal_nan=True, atol=0, rtol=0)
    v = torch.ops.prunopt.two_temperature_sigmoid(x, 1000.0, 10.0)
    torch.testing.assert_close(v, two_temperature_sigmoid_reference(x, 1000.0, 10.0), equal_nan=True, atol=1e-30,
                               rtol=1e-6)
    gw = torch.ops.prunopt.two_temperature_sigmoid_backward(g, x, 10.0)
    assert torch.isnan(gw[0::12]).all() and torch.isfinite(gw[x == x]).all() and (gw[x == x] >= 0).all()


def _check_gate(alpha, beta, signed, rgf_alpha, seed=0):
    dtype = alpha.dtype
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(alpha.shape, generator=gen, dtype=torch.float64)
    al = alpha.clone().requires_grad_(True)
    be = beta.clone().requires_grad_(True)
    a = sparse_gate(al, be, signed=signed, rgf=rgf_alpha > 0, rgf_alpha=rgf_alpha or 0.1)
    torch.testing.assert_close(a.double(), sparse_gate_reference(alpha.double(), beta.double(), signed),
                               **tolerance(dtype))
    ga, gb = torch.autograd.grad(a, (al, be), g.to(dtype))
    ra, rb = sparse_gate_backward_reference(g, alpha.double(), beta.double(), signed, rgf_alpha)
    scale = 1 + ra.abs().max().item() + rb.abs().max().item()
    tol = dict(atol=(1e-12 if dtype == torch.float64 else 2e-6) * scale, rtol=0)
    torch.testing.assert_close(ga.double(), ra, **tol)
    torch.testing.assert_close(gb.double(), rb, **tol)


def _gate_inputs(groups, n, dtype, signed, seed):
    gen = torch.Generator().manual_seed(seed)
    alpha = torch.randn(groups, n, generator=gen, dtype=torch.float64)
    # thresholds that keep some gates open: s ||.||_1 around the largest entries
    if signed:
        beta = torch.full((groups,), -torch.log(torch.tensor(float(n))).item() - 0.5, dtype=torch.float64)
    else:
        beta = torch.full((groups,), -torch.log(torch.tensor(float(n))).item() + 0.3, dtype=torch.float64)
    beta = beta + 0.3 * torch.randn(groups, generator=gen, dtype=torch.float64)
    return alpha.to(dtype), beta.to(dtype)


_SHORT = [(1, 1), (5, 3), (37, 9), (3, 4097), (300, 17)]
_LONG = [(5, 16385), (1, 40001), (3, 33000)]
_LAYOUTS = [(s, d, sg, r) for s in _SHORT for d in DTYPES for sg in (True, False) for r in (0.0, 0.1)]
_LAYOUTS += [(s, d, sg, 0.1) for s in _LONG for d in DTYPES for sg in (True, False)]


@pytest.mark.parametrize("shape,dtype,signed,rgf_alpha", _LAYOUTS,
                         ids=[f"{s[0]}x{s[1]}-{str(d)[6:]}-{'signed' if sg else 'nonneg'}-{r}" for s, d, sg, r in _LAYOUTS])
def test_sparse_gate_layouts(shape, dtype, signed, rgf_alpha):
    # (5, 16385): rows longer than the scratch; (1, 40001), (3, 33000): few long
    # groups, each row split into segments over the threads
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alpha, beta = _gate_inputs(*shape, dtype, signed, seed=sum(shape))
        _check_gate(alpha, beta, signed, rgf_alpha)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(4, 16384), (4, 16385), (1, 40001), (3, 33000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_long_rows_keep_intermediates_in_double(shape, dtype):
    """Rows longer than the scratch row and split rows used to park gt = relu(exp(alpha)
    - th), t and q in the output tensor, in its dtype: exp(alpha) overflowed (float32
    and bfloat16 from alpha ~ 88.7, float16 from ~11: the gate became inf) and float16
    lost ~1e-2 of the gradient. They are recomputed in double now, as the rows that
    fit the scratch keep them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        big = 12.0 if dtype == torch.float16 else 90.0
        alpha = torch.zeros(shape, dtype=dtype)
        alpha[:, 0] = big
        a = sparse_gate(alpha, torch.full(shape[:1], -3.0, dtype=dtype), signed=False)
        assert torch.isfinite(a).all() and (a[:, 0] == 1).all() and (a[:, 1:] == 0).all()
        # a realistic row: the gate values and gradients to the dtype's own rounding
        alpha, beta = _gate_inputs(*shape, torch.float64, False, seed=shape[1])
        alpha, beta = alpha.to(dtype), beta.to(dtype)
        al, be = alpha.clone().requires_grad_(), beta.clone().requires_grad_()
        a = sparse_gate(al, be, signed=False, rgf_alpha=0.1)
        eps = torch.finfo(dtype).eps
        ref = sparse_gate_reference(alpha.double(), beta.double(), False)
        torch.testing.assert_close(a.double(), ref, atol=eps * ref.abs().max().item(), rtol=eps)
        g = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
        ga, gb = torch.autograd.grad(a, (al, be), g)
        ra, rb = sparse_gate_backward_reference(g.double(), alpha.double(), beta.double(), False, 0.1)
        # one rounding to the dtype (the sums are in double): within 1 ulp of the largest entry
        torch.testing.assert_close(ga.double(), ra, atol=eps * ra.abs().max().item(), rtol=eps)
        torch.testing.assert_close(gb.double(), rb, atol=eps * rb.abs().max().item(), rtol=eps)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("signed", [True, False])
def test_sparse_gate_split_rows_match_serial(signed):
    # the same long group, split over 2 threads and run on 1: equal up to the order of the sums
    alpha, beta = _gate_inputs(2, 50000, torch.float64, signed, seed=5)
    g = torch.randn(2, 50000, dtype=torch.float64)
    threads = torch.get_num_threads()
    out = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            a = torch.ops.prunopt.sparse_gate(alpha, beta, signed, 0.1)
            out.append((a, *torch.ops.prunopt.sparse_gate_backward(g, alpha, beta, signed, 0.1)))
    finally:
        torch.set_num_threads(threads)
    for u, v in zip(*out):
        torch.testing.assert_close(u, v, atol=1e-13, rtol=1e-12)


def test_sparse_gate_noncontiguous_groups():
    # groups along dim 0 of a (n, groups) tensor: the kernel sees a transposed, non-contiguous view
    alpha, beta = _gate_inputs(6, 13, torch.float32, False, seed=9)
    at = alpha.t().contiguous().t()  # same values, column-major
    assert not at.is_contiguous()
    for signed in (True, False):
        a = sparse_gate(at, beta, signed=signed)
        torch.testing.assert_close(a, sparse_gate(alpha, beta, signed=signed), atol=0, rtol=0)


_SCALAR_PATH = r"""
import torch, prunopt
from prunopt.reference import (rgf_relu_backward_reference, sparse_gate_backward_reference, sparse_gate_reference,
    two_temperature_sigmoid_backward_reference, two_temperature_sigmoid_reference)
torch.set_num_threads(2)
for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
    for n in (0, 1, 7, 9, 4097):
        x = (torch.randn(n, dtype=torch.float64) * 3).to(dtype)
        g = torch.randn(n, dtype=torch.float64).to(dtype)
        ops = torch.ops.prunopt
        assert torch.equal(ops.rgf_relu(x, 0.1), torch.relu(x))
        assert torch.allclose(ops.rgf_relu_backward(g, x, 0.1).double(),
                              rgf_relu_backward_reference(g.double(), x.double(), 0.1), atol=tol * 5, rtol=0)
        w = x * 0.01
        assert torch.allclose(ops.two_temperature_sigmoid(w, 100.0, 2.0).double(),
                              two_temperature_sigmoid_reference(w.double(), 100.0, 2.0), atol=tol, rtol=0)
        assert torch.allclose(ops.two_temperature_sigmoid_backward(g, w, 2.0).double(),
                              two_temperature_sigmoid_backward_reference(g.double(), w.double(), 2.0),
                              atol=tol * 10, rtol=0)
    for groups, n in ((7, 9), (1, 33000)):
        alpha = (torch.randn(groups, n, dtype=torch.float64)).to(dtype)
        beta = torch.full((groups,), -float(torch.log(torch.tensor(float(n)))), dtype=dtype)
        g = torch.randn(groups, n, dtype=torch.float64)
        for signed in (True, False):
            a = torch.ops.prunopt.sparse_gate(alpha, beta, signed, 0.1)
            assert torch.allclose(a.double(), sparse_gate_reference(alpha.double(), beta.double(), signed),
                                  atol=tol, rtol=0)
            ga, gb = torch.ops.prunopt.sparse_gate_backward(g.to(dtype), alpha, beta, signed, 0.1)
            ra, rb = sparse_gate_backward_reference(g, alpha.double(), beta.double(), signed, 0.1)
            s = 1 + ra.abs().max().item() + rb.abs().max().item()
            assert torch.allclose(ga.double(), ra, atol=tol * s * 10, rtol=0)
            assert torch.allclose(gb.double(), rb, atol=tol * s * 10, rtol=0)
print("ok")
"""


@pytest.mark.parametrize("switch", [("PRUNOPT_NO_SIMD", "1"), ("ATEN_CPU_CAPABILITY", "default")])
def test_scalar_fallback_matches_reference(switch):
    # the path of CPUs without AVX2 (and of half/bfloat16): forced by our own
    # switch, or by torch's capability override, which the kernels follow
    env = dict(os.environ)
    env.pop("PRUNOPT_NO_AVX512", None)
    env[switch[0]] = switch[1]
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _SCALAR_PATH], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def _all_gate_outputs(dtype):
    """Every gate op, forward and backward, on inputs with vector tails, chunk
    boundaries and split sparse_gate rows (2 threads): (output, row length of its
    sums, 0 for the elementwise ops)."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in (17, 4097, 70001):
        x = (torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)
        g = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        ops = torch.ops.prunopt
        out += [(y, 0) for y in (ops.rgf_relu(x, 0.1), ops.rgf_relu_backward(g, x, 0.1),
                                 ops.rgf_relu_backward(g, x, 0.0), ops.two_temperature_sigmoid(x * 0.01, 100.0, 2.0),
                                 ops.two_temperature_sigmoid_backward(g, x, 2.0))]
    for groups, k in ((37, 9), (3, 4097), (1, 40001)):
        for signed in (True, False):
            alpha, beta = _gate_inputs(groups, k, dtype, signed, seed=groups + k)
            g = torch.randn(groups, k, generator=gen, dtype=torch.float64).to(dtype)
            out.append((torch.ops.prunopt.sparse_gate(alpha, beta, signed, 0.1), k))
            out += [(y, k) for y in torch.ops.prunopt.sparse_gate_backward(g, alpha, beta, signed, 0.1)]
    return out


@pytest.mark.skipif(not avx512_cpu(), reason="needs a CPU with AVX-512 (torch's AVX512 capability)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_avx512_and_avx2_clones_agree(dtype, monkeypatch):
    # Both clones run the same vector operations on every element but a range's
    # last < one vector (8 / 16 float lanes, 4 / 8 double lanes), which takes the
    # scalar math (libm exp): elementwise results agree to a few ulp there and bit
    # for bit elsewhere. sparse_gate adds its row sums (in double) in lane order,
    # 4 or 8 partial sums: its outputs differ by the rounding of a sum of k terms
    # (k eps relative to the largest output, the sums being O(1) here).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = {isa: _all_gate_outputs(dtype) for isa in simd_clones(monkeypatch)}
    finally:
        torch.set_num_threads(threads)
    eps = torch.finfo(dtype).eps
    for (a, k), (b, _) in zip(got["avx512"], got["avx2"]):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        scale = 1 + (a.abs().max().item() if a.numel() else 0)
        if k == 0:
            torch.testing.assert_close(a, b, atol=4 * eps * scale, rtol=4 * eps)
        else:
            torch.testing.assert_close(a, b, atol=(4 * eps + k * torch.finfo(torch.float64).eps) * scale, rtol=0)
    # rgf_relu's forward is the same max on both: identical bits
    assert torch.equal(got["avx512"][0][0], got["avx2"][0][0])
    # elementwise outputs off the tails are identical: at 70001 elements over two
    # threads only the last < 16 elements of each thread's range can differ
    for (a, k), (b, _) in zip(got["avx512"][10:15], got["avx2"][10:15]):
        assert (a != b).sum().item() <= 2 * 15, (a != b).sum().item()
