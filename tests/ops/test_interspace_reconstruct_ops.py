"""The fused reconstruction and its fused backward, prunopt::fb_reconstruct and
prunopt::fb_reconstruct_backward, against the float64 reference (Wimmer et al.;
eq. 4, 7, A.13, A.14): every vector width and the scalar loops, rows that end
at thread-chunk boundaries, float32/float64/bfloat16, output masks, double
backward, opcheck and torch.compile."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import prunopt
from prunopt.ops import fb_reconstruct, fb_reconstruct_backward
from prunopt.reference import fb_coefficient_grads_reference, fb_reconstruct_reference
from prunopt.testing import avx512_cpu, simd_clones

needs_ext = pytest.mark.skipif(
    not (prunopt.extension_available() and hasattr(torch.ops.prunopt, "fb_reconstruct_backward")),
    reason="compiled extension not built",
)


def _case(c_out, c_in_g, n, kh, kw, density, dtype, seed, mask=True):
    g = torch.Generator().manual_seed(seed)
    coeff = torch.randn(c_out, c_in_g, n, generator=g, dtype=torch.float64)
    basis = torch.randn(n, kh, kw, generator=g, dtype=torch.float64)
    mu = (torch.rand(coeff.shape, generator=g, dtype=torch.float64) < density).double() if mask else None
    gh = torch.randn(c_out, c_in_g, kh, kw, generator=g, dtype=torch.float64)
    return coeff, basis, mu, gh


def _close(actual, exact, dtype, scale):
    eps = {torch.float64: 1e-12, torch.float32: 3e-6, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(actual.double(), exact, atol=eps * scale, rtol=0)


@given(
    c_out=st.sampled_from([1, 2, 3, 7, 64]),
    c_in_g=st.sampled_from([1, 2, 5, 33]),
    kernel=st.sampled_from([(3, 3), (3, 3), (1, 1), (2, 2), (1, 3), (5, 5), (7, 7)]),
    n_delta=st.sampled_from([0, 0, -1, 3, 8]),
    density=st.sampled_from([0.0, 0.3, 1.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    mask=st.booleans(),
    output_mask=st.sampled_from([(True, True), (True, False), (False, True)]),
    noncontig=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@settings(deadline=None, max_examples=60)
@example(c_out=512, c_in_g=9, kernel=(3, 3), n_delta=0, density=0.5, dtype=torch.float32, mask=True,
         output_mask=(True, True), noncontig=False, seed=0)  # 4608 rows: several thread chunks
@example(c_out=97, c_in_g=43, kernel=(1, 1), n_delta=0, density=0.5, dtype=torch.float32, mask=True,
         output_mask=(True, True), noncontig=False, seed=1)  # N = K = 1: a row spills 7 rows ahead
def test_forward_and_backward_match_float64_reference(c_out, c_in_g, kernel, n_delta, density, dtype, mask,
                                                      output_mask, noncontig, seed):
    kh, kw = kernel
    n = max(1, kh * kw + n_delta)
    coeff, basis, mu, gh = _case(c_out, c_in_g, n, kh, kw, density, dtype, seed, mask)
    c, b, m, d = (None if t is None else t.to(dtype) for t in (coeff, basis, mu, gh))
    if noncontig:  # strided views of the same values
        c = torch.stack([c, c], -1)[..., 0]
        d = torch.stack([d, d], -1)[..., 0]
    h = fb_reconstruct(c, b, m)
    scale_h = 1 + float(coeff.abs().max() * basis.abs().sum(0).max())
    _close(h, fb_reconstruct_reference(coeff, basis, mu), dtype, scale_h)
    g_lam, g_basis = fb_reconstruct_backward(d, c, b, m, output_mask)
    r_lam, r_basis = fb_coefficient_grads_reference(gh, coeff, basis, mu)
    if output_mask[0]:
        assert g_lam.shape == coeff.shape and g_lam.dtype == dtype
        _close(g_lam, r_lam, dtype, 1 + float(gh.abs().max() * basis.abs().sum((1, 2)).max()))
        if mu is not None:  # eq. 7: exactly zero where the mask is
            assert torch.equal(g_lam[mu == 0], torch.zeros_like(g_lam[mu == 0]))
    else:
        assert g_lam is None
    if output_mask[1]:
        assert g_basis.shape == basis.shape and g_basis.dtype == dtype
        lam_mu = coeff if mu is None else coeff * mu
        scale_b = 1 + float(torch.einsum("oin,oikl->nkl", lam_mu.abs(), gh.abs()).max())
        _close(g_basis, r_basis, dtype, scale_b)
    else:
        assert g_basis is None


@needs_ext
@pytest.mark.parametrize("shape", [(4, 3, 9, 3, 3), (8, 5, 25, 5, 5), (2, 3, 49, 7, 7)])
def test_bfloat16_and_half_scalar_loops(shape):
    c_out, c_in_g, n, kh, kw = shape
    coeff, basis, mu, gh = _case(c_out, c_in_g, n, kh, kw, 0.5, torch.float64, 11)
    for dtype in (torch.bfloat16, torch.float16):
        c, b, m, d = (t.to(dtype) for t in (coeff, basis, mu, gh))
        h = torch.ops.prunopt.fb_reconstruct(c, b, m)
        g_lam, g_basis = torch.ops.prunopt.fb_reconstruct_backward(d, c, b, m, [True, True])
        # the reference on the rounded inputs, in float64
        cd, bd, md, dd = (t.double() for t in (c, b, m, d))
        torch.testing.assert_close(h.double(), fb_reconstruct_reference(cd, bd, md), atol=0.05 * n ** 0.5, rtol=2e-2)
        r_lam, r_basis = fb_coefficient_grads_reference(dd, cd, bd, md)
        torch.testing.assert_close(g_lam.double(), r_lam, atol=0.05 * kh * kw, rtol=2e-2)
        torch.testing.assert_close(g_basis.double(), r_basis, atol=0.05 * c_out * c_in_g, rtol=2e-2)


@pytest.mark.parametrize("shape", [(0, 3, 9, 3, 3), (4, 0, 9, 3, 3)])
def test_empty(shape):
    c_out, c_in_g, n, kh, kw = shape
    coeff, basis, mu, gh = (t.float() for t in _case(c_out, c_in_g, n, kh, kw, 0.5, torch.float64, 0))
    assert fb_reconstruct(coeff, basis, mu).shape == gh.shape
    g_lam, g_basis = fb_reconstruct_backward(gh, coeff, basis, mu)
    assert g_lam.shape == coeff.shape
    assert torch.equal(g_basis, torch.zeros_like(basis))


@needs_ext
def test_backward_does_not_depend_on_the_thread_count():
    coeff, basis, mu, gh = (None if t is None else t.float() for t in _case(256, 130, 9, 3, 3, 0.5, torch.float64, 3))
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(torch.ops.prunopt.fb_reconstruct_backward(gh, coeff, basis, mu, [True, True]))
    finally:
        torch.set_num_threads(threads)
    for g_lam, g_basis in outs[1:]:
        assert torch.equal(g_lam, outs[0][0])  # per-row sums: bitwise
        # short float blocks, chunks summed in double: differences at the float rounding of the block sums
        scale = float(torch.einsum("oin,oikl->nkl", (coeff * mu).abs(), gh.abs()).max())
        torch.testing.assert_close(g_basis, outs[0][1], atol=1e-7 * scale, rtol=0)


@needs_ext
@pytest.mark.skipif(not avx512_cpu(), reason="needs an AVX-512 CPU for the second clone")
@pytest.mark.parametrize("mask", [True, False])
@pytest.mark.parametrize("output_mask", [[True, True], [True, False], [False, True]])
@pytest.mark.parametrize("rows", [(1, 1), (3, 5), (64, 33), (257, 130)])  # 1, 15, 2112, 33410 rows
def test_3x3_clones_agree_bitwise(rows, output_mask, mask, monkeypatch):
    """The 3x3 float kernels' AVX-512VL clone (the AVX2 code with 32 registers)
    and the AVX2 clone give the same bits: forward, dL/dlam and dL/dg, with and
    without a mask, row counts that are not multiples of the 8-row blocks, of the
    32-row dg blocks or of a thread's chunk."""
    c_out, c_in_g = rows
    coeff, basis, mu, gh = (None if t is None else t.float()
                            for t in _case(c_out, c_in_g, 9, 3, 3, 0.5, torch.float64, 7, mask))
    outs = []
    for _ in simd_clones(monkeypatch):
        h = torch.ops.prunopt.fb_reconstruct(coeff, basis, mu)
        outs.append((h, *torch.ops.prunopt.fb_reconstruct_backward(gh, coeff, basis, mu, output_mask)))
    for a, b in zip(*outs):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    # and both are right
    mu64 = None if mu is None else mu.double()
    exact_lam, exact_basis = fb_coefficient_grads_reference(gh.double(), coeff.double(), basis.double(), mu64)
    h_exact = fb_reconstruct_reference(coeff.double(), basis.double(), mu64)
    _close(outs[0][0], h_exact, torch.float32, 1 + float(h_exact.abs().max()))
    if output_mask[0]:
        _close(outs[0][1], exact_lam, torch.float32, 1 + float(exact_lam.abs().max()))
    if output_mask[1]:
        scale = float(torch.einsum("oin,oikl->nkl", coeff.double().abs(), gh.double().abs()).max())
        _close(outs[0][2], exact_basis, torch.float32, 1 + scale)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(9, 3, 3), (12, 5, 5), (4, 2, 2), (30, 1, 1), (16, 4, 4)])
def test_generic_rows_clones_agree_bitwise(shape, dtype, monkeypatch):
    """The generic row kernels on at::vec::Vectorized (AVX-512: 16 float / 8
    double lanes, AVX2: 8 / 4, DEFAULT: 8 / 4 in arrays) take the same
    operations per lane in the same order, so their rows give the same bits
    whatever their width: forward, dL/dlam and dL/dg, with a mask, row counts
    that leave chunk tails. (The float 3x3 basis takes its own loops on AVX2
    and AVX-512 CPUs; PRUNOPT_FB_GENERIC_3X3=1 sends it to the generic rows
    here, which the DEFAULT capability runs anyway.)"""
    n, kh, kw = shape
    coeff, basis, mu, gh = (t.to(dtype) for t in _case(37, 11, n, kh, kw, 0.5, torch.float64, 3, True))
    monkeypatch.setenv("PRUNOPT_FB_GENERIC_3X3", "1")
    outs = []
    for isa in simd_clones(monkeypatch, default=True):
        h = torch.ops.prunopt.fb_reconstruct(coeff, basis, mu)
        outs.append((h, *torch.ops.prunopt.fb_reconstruct_backward(gh, coeff, basis, mu, [True, True])))
    assert len(outs) >= 1
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)
    h_exact = fb_reconstruct_reference(coeff.double(), basis.double(), mu.double())
    _close(outs[-1][0], h_exact, dtype, 1 + float(h_exact.abs().max()))
    exact_lam, exact_basis = fb_coefficient_grads_reference(gh.double(), coeff.double(), basis.double(), mu.double())
    _close(outs[-1][1], exact_lam, dtype, 1 + float(exact_lam.abs().max()))
    scale = float(torch.einsum("oin,oikl->nkl", coeff.double().abs(), gh.double().abs()).max())
    _close(outs[-1][2], exact_basis, dtype, 1 + scale)


def test_autograd_uses_the_fused_backward_and_is_masked():
    coeff, basis, mu, gh = _case(6, 4, 9, 3, 3, 0.4, torch.float64, 4)
    c = coeff.clone().requires_grad_()
    b = basis.clone().requires_grad_()
    g_lam, g_basis = torch.autograd.grad(fb_reconstruct(c, b, mu), (c, b), gh)
    r_lam, r_basis = fb_coefficient_grads_reference(gh, coeff, basis, mu)
    torch.testing.assert_close(g_lam, r_lam, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_basis, r_basis, atol=1e-12, rtol=0)
    # only the coefficients need a gradient: the basis gradient is not computed
    (g_only,) = torch.autograd.grad(fb_reconstruct(c, basis, mu), (c,), gh)
    torch.testing.assert_close(g_only, r_lam, atol=1e-12, rtol=0)


@needs_ext
@pytest.mark.parametrize("mask", [True, False])
def test_gradgradcheck_float64(mask):
    coeff, basis, mu, _ = _case(3, 2, 5, 2, 3, 0.5, torch.float64, 5, mask)
    c = coeff.requires_grad_()
    b = basis.requires_grad_()
    op = torch.ops.prunopt
    assert torch.autograd.gradcheck(lambda c, b: op.fb_reconstruct(c, b, mu), (c, b), fast_mode=True)
    assert torch.autograd.gradgradcheck(lambda c, b: op.fb_reconstruct(c, b, mu), (c, b), fast_mode=True)
    gh = torch.randn(3, 2, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda d, c, b: op.fb_reconstruct_backward(d, c, b, mu, [True, True]), (gh, c, b), fast_mode=True)


@needs_ext
def test_opcheck():
    coeff, basis, mu, gh = _case(4, 3, 9, 3, 3, 0.5, torch.float64, 6)
    op = torch.ops.prunopt.fb_reconstruct_backward.default
    for output_mask in ([True, True], [True, False], [False, True]):
        torch.library.opcheck(op, (gh, coeff, basis, mu, output_mask))
    torch.library.opcheck(op, (gh.float(), coeff.float(), basis.float(), None, [True, True]))


def test_torch_compile_training_step():
    coeff, basis, mu, _ = (None if t is None else t.float() for t in _case(8, 4, 9, 3, 3, 0.5, torch.float64, 7))
    x = torch.randn(2, 4, 6, 6)

    def loss(c, b):
        return torch.nn.functional.conv2d(x, fb_reconstruct(c, b, mu), padding=1).square().sum()

    grads = []
    for fn in (loss, torch.compile(loss, backend="inductor")):
        c = coeff.clone().requires_grad_()
        b = basis.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(c, b), (c, b)))
    for a, e in zip(*grads):
        torch.testing.assert_close(a, e, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(grad_h=torch.randn(4, 2, 3, 2)), ValueError, "grad_h"),
    (dict(grad_h=torch.randn(4, 2, 3, 3, dtype=torch.float64)), ValueError, "grad_h"),
    (dict(grad_h="g"), TypeError, "grad_h"),
    (dict(basis=torch.randn(8, 3, 3)), ValueError, "basis"),
    (dict(mask=torch.ones(4, 2, 8)), ValueError, "mask"),
    (dict(output_mask=(True,)), TypeError, "output_mask"),
])
def test_errors_name_the_argument(kwargs, exc, match):
    args = dict(grad_h=torch.randn(4, 2, 3, 3), coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 3, 3),
                mask=None, output_mask=(True, True))
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        fb_reconstruct_backward(**args)


@needs_ext
def test_raw_op_raises_value_errors():
    op = torch.ops.prunopt.fb_reconstruct_backward
    c, b = torch.randn(4, 2, 9), torch.randn(9, 3, 3)
    with pytest.raises(ValueError, match="grad_h"):
        op(torch.randn(4, 2, 2, 3), c, b, None, [True, True])
    with pytest.raises(ValueError, match="mask"):
        op(torch.randn(4, 2, 3, 3), c, b, torch.ones(4, 2, 8), [True, True])
