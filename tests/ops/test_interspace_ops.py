"""prunopt.ops.fb_conv2d / fb_reconstruct / fb_conv2d_compressed against the
float64 reference (Wimmer et al.; eq. 4, 6, 7, 8, A.12-A.14)."""
import pytest
import torch
from hypothesis import example, given, strategies as st

import prunopt
from prunopt.ops import fb_compress, fb_conv2d, fb_conv2d_compressed, fb_reconstruct
from prunopt.reference import (
    fb_coefficient_grads_reference,
    fb_conv2d_reference,
    fb_conv2d_sparse_reference,
    fb_reconstruct_reference,
)
from prunopt.testing import devices, kernels_optimised

needs_ext = pytest.mark.skipif(
    not (prunopt.extension_available() and hasattr(torch.ops.prunopt, "fb_conv2d")), reason="compiled extension not built"
)


@st.composite
def fb_case(draw):
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    c_in_g = draw(st.integers(1, 4))
    c_out_g = draw(st.integers(1, 4))
    kh, kw = draw(st.sampled_from([(1, 1), (3, 3), (3, 3), (2, 3), (5, 5), (1, 3)]))
    n = draw(st.sampled_from([kh * kw, kh * kw, max(1, kh * kw - 2), kh * kw + 3]))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    h_min = max(1, dilation[0] * (kh - 1) + 1 - 2 * padding[0])
    w_min = max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1])
    h = draw(st.integers(h_min, h_min + 9))
    w = draw(st.integers(w_min, w_min + 9))
    batch = draw(st.sampled_from([1, 1, 2, 3]))
    density = draw(st.sampled_from([0.0, 0.05, 0.3, 0.7, 1.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    layout = draw(st.sampled_from(["contiguous", "channels_last", "noncontig", "unbatched"]))
    bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(groups=groups, c_in_g=c_in_g, c_out_g=c_out_g, k=(kh, kw), n=n, stride=stride, padding=padding,
                dilation=dilation, hw=(h, w), batch=batch, density=density, dtype=dtype, layout=layout, bias=bias,
                seed=seed)


def make(case, device="cpu"):
    g = torch.Generator().manual_seed(case["seed"])
    c_in = case["c_in_g"] * case["groups"]
    c_out = case["c_out_g"] * case["groups"]
    kh, kw = case["k"]
    x = torch.randn(case["batch"], c_in, *case["hw"], generator=g, dtype=torch.float64)
    coeff = torch.randn(c_out, case["c_in_g"], case["n"], generator=g, dtype=torch.float64)
    basis = torch.randn(case["n"], kh, kw, generator=g, dtype=torch.float64)
    mask = (torch.rand(coeff.shape, generator=g, dtype=torch.float64) < case["density"]).double()
    bias = torch.randn(c_out, generator=g, dtype=torch.float64) if case["bias"] else None
    dt = case["dtype"]
    x, coeff, basis, mask = (t.to(device=device, dtype=dt) for t in (x, coeff, basis, mask))
    bias = None if bias is None else bias.to(device=device, dtype=dt)
    if case["layout"] == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif case["layout"] == "noncontig":
        x = torch.stack([x, x + 1], dim=-1)[..., 0]
        assert not x.is_contiguous() or x.numel() <= 1
    elif case["layout"] == "unbatched":
        x = x[0]
    return x, coeff, basis, mask, bias


def _tol(dtype, scale):
    return dict(atol=(1e-10 if dtype == torch.float64 else 2e-5) * scale, rtol=0)


def _assert_clones_agree(y512, y256, x, coeff, basis, mask, bias, stride, padding, dilation, what):
    """The AVX-512 and AVX2 clones' outputs: the same bits in an optimised
    build; in an unoptimised one (kernels_optimised()), where only the
    AVX-512 clone's 4-output maps fuse their multiply-adds, within
    (K + 2) units of rounding of the sum of the absolute terms of each output
    (one rounding of a product per tap of the map, two for the mixing sum)."""
    if kernels_optimised():
        assert torch.equal(y512, y256), what
        return
    k = basis.shape[1] * basis.shape[2]
    terms = fb_conv2d_reference(x.double().abs(), coeff.double().abs(), basis.double().abs(),
                                None if mask is None else mask.double(), None if bias is None else bias.double().abs(),
                                stride, padding, dilation)
    bound = (k + 2) * torch.finfo(y512.dtype).eps * terms
    assert bool(((y512.double() - y256.double()).abs() <= bound).all()), what


@given(fb_case())
@example(dict(groups=1, c_in_g=3, c_out_g=4, k=(3, 3), n=9, stride=(1, 1), padding=(1, 1), dilation=(1, 1),
              hw=(7, 7), batch=1, density=0.3, dtype=torch.float32, layout="contiguous", bias=True, seed=0))
@example(dict(groups=3, c_in_g=2, c_out_g=2, k=(3, 3), n=12, stride=(2, 3), padding=(2, 0), dilation=(2, 1),
              hw=(9, 8), batch=2, density=1.0, dtype=torch.float64, layout="channels_last", bias=False, seed=1))
@example(dict(groups=1, c_in_g=1, c_out_g=1, k=(1, 1), n=1, stride=(3, 3), padding=(0, 0), dilation=(1, 1),
              hw=(1, 1), batch=1, density=0.0, dtype=torch.float32, layout="noncontig", bias=True, seed=2))
def test_all_paths_match_float64_reference(case):
    x, coeff, basis, mask, bias = make(case)
    args = (case["stride"], case["padding"], case["dilation"], case["groups"])
    exact = fb_conv2d_reference(x.double(), coeff.double(), basis.double(), mask.double(),
                                None if bias is None else bias.double(), *args)
    scale = 1.0 + float(exact.abs().max()) if exact.numel() else 1.0
    tol = _tol(case["dtype"], scale)
    for path in ("dense", "sparse", "auto"):
        y = fb_conv2d(x, coeff, basis, mask, bias, *args, path=path)
        assert y.shape == exact.shape and y.dtype == case["dtype"]
        torch.testing.assert_close(y.double(), exact, **tol)
    y = fb_conv2d_compressed(x, fb_compress(coeff, mask), basis, bias, *args)
    torch.testing.assert_close(y.double(), exact, **tol)
    # the readable eq. 8 reference agrees with the eq. 6 reference
    torch.testing.assert_close(fb_conv2d_sparse_reference(x.double(), coeff.double(), basis.double(), mask.double(),
                                                          None if bias is None else bias.double(), *args), exact,
                               atol=1e-10 * scale, rtol=0)
    h = fb_reconstruct(coeff, basis, mask)
    torch.testing.assert_close(h.double(), fb_reconstruct_reference(coeff.double(), basis.double(), mask.double()),
                               **_tol(case["dtype"], 1 + float(coeff.abs().max() * basis.abs().sum(0).max())))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vgg_like_layer_all_densities(device, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 32, 16, 16, generator=g, dtype=torch.float64)
    coeff = torch.randn(64, 32, 9, generator=g, dtype=torch.float64) * 0.1
    basis = torch.linalg.qr(torch.randn(9, 9, generator=g, dtype=torch.float64))[0].reshape(9, 3, 3)
    for density in (0.0, 0.01, 0.1, 0.5, 1.0):
        mask = (torch.rand(coeff.shape, generator=g, dtype=torch.float64) < density).double()
        exact = fb_conv2d_reference(x, coeff, basis, mask, None, 1, 1)
        dev = [t.to(device=device, dtype=dtype) for t in (x, coeff, basis, mask)]
        for path in ("dense", "sparse", "auto"):
            y = fb_conv2d(*dev, None, 1, 1, path=path)
            torch.testing.assert_close(y.double().cpu(), exact, **_tol(dtype, 10.0))


@needs_ext
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX-512 CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_path_avx512_clone_matches_avx2(dtype, monkeypatch):
    """The sparse path's loops have an AVX-512 clone (64-byte vectors) beside
    the AVX2 one; each output sums its products in the same order in both, so
    they agree bit for bit (PRUNOPT_NO_AVX512 selects the AVX2 clone). Image
    sizes cover every tile width (P = 4 ... 64 and several tiles), stride 1
    (shifted padded rows) and 2 (im2col + transform), the standard basis."""
    g = torch.Generator().manual_seed(7)
    for hw, stride, basis_kind in [(2, 1, "orth"), (4, 1, "orth"), (8, 1, "std"), (13, 1, "orth"), (16, 2, "orth"),
                                   (32, 1, "orth")]:
        x = torch.randn(2, 24, hw, hw, generator=g, dtype=dtype)
        coeff = torch.randn(40, 24, 9, generator=g, dtype=dtype)
        mask = (torch.rand(coeff.shape, generator=g) < 0.2).to(dtype)
        if basis_kind == "std":
            basis = torch.eye(9, dtype=dtype).reshape(9, 3, 3)
        else:
            basis = torch.linalg.qr(torch.randn(9, 9, generator=g, dtype=torch.float64))[0].reshape(9, 3, 3).to(dtype)
        bias = torch.randn(40, generator=g, dtype=dtype)
        args = (x, coeff, basis, mask, bias, [stride] * 2, [1, 1], [1, 1], 1, 1.0)
        monkeypatch.delenv("PRUNOPT_NO_AVX512", raising=False)
        y512 = torch.ops.prunopt.fb_conv2d(*args)
        monkeypatch.setenv("PRUNOPT_NO_AVX512", "1")
        y256 = torch.ops.prunopt.fb_conv2d(*args)
        _assert_clones_agree(y512, y256, x, coeff, basis, mask, bias, stride, 1, 1, (hw, stride, basis_kind))
        exact = fb_conv2d_reference(x.double(), coeff.double(), basis.double(), mask.double(), bias.double(), stride, 1)
        torch.testing.assert_close(y512.double(), exact, **_tol(dtype, 30.0))


@needs_ext
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX-512 CPU")
@pytest.mark.parametrize("n", [1, 4, 5, 9, 13, 16, 17])
def test_sparse_path_four_output_maps_match_on_both_clones(n, monkeypatch):
    """Float32, 3x3 taps, stride 1 and a 2x2 output (P = 4): the AVX-512 clone
    computes 4 maps x 4 outputs per 16-lane vector from masked loads of the
    channel itself (N <= 16; N = 17 takes the general loop). Padding in one or
    both directions, a taller input, dilation and every mask density; the same
    bits as the AVX2 clone (optimised builds) and the float64 reference's values."""
    g = torch.Generator().manual_seed(n)
    for (h, w), padding, dilation in [((2, 2), (1, 1), (1, 1)), ((4, 2), (0, 1), (1, 1)), ((2, 2), (1, 2), (1, 2)),
                                      ((2, 2), (2, 2), (2, 2)), ((6, 2), (0, 1), (2, 1))]:
        x = torch.randn(3, 20, h, w, generator=g)
        coeff = torch.randn(24, 20, n, generator=g)
        basis = torch.randn(n, 3, 3, generator=g)
        for density in (0.05, 0.5, 1.0):
            mask = (torch.rand(coeff.shape, generator=g) < density).float()
            bias = torch.randn(24, generator=g)
            args = (x, coeff, basis, mask, bias, [1, 1], list(padding), list(dilation), 1, 1.0)
            monkeypatch.delenv("PRUNOPT_NO_AVX512", raising=False)
            y512 = torch.ops.prunopt.fb_conv2d(*args)
            monkeypatch.setenv("PRUNOPT_NO_AVX512", "1")
            y256 = torch.ops.prunopt.fb_conv2d(*args)
            assert y512.shape[-2:] == (2, 2)
            _assert_clones_agree(y512, y256, x, coeff, basis, mask, bias, 1, padding, dilation,
                                 ((h, w), padding, dilation, density))
            exact = fb_conv2d_reference(x.double(), coeff.double(), basis.double(), mask.double(), bias.double(), 1,
                                        padding, dilation)
            torch.testing.assert_close(y512.double(), exact, **_tol(torch.float32, 30.0))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sparse_path_half_types_are_float32_rounded_once(dtype):
    """float16 and bfloat16 run the float32 sparse path: the output is the
    float32 op on the converted arguments, rounded once to the input dtype,
    bit for bit (CSR and masked forms; the basis stays in the input dtype,
    as it is converted to double exactly either way), and close to the float64
    reference of those values."""
    g = torch.Generator().manual_seed(11)
    for hw, stride in [(2, 1), (7, 1), (16, 1), (9, 2)]:
        x = torch.randn(2, 6, hw, hw, generator=g).to(dtype)
        coeff = torch.randn(8, 6, 9, generator=g).to(dtype)
        mask = (torch.rand(coeff.shape, generator=g) < 0.3).to(dtype)
        basis = torch.randn(9, 3, 3, generator=g).to(dtype)
        bias = torch.randn(8, generator=g).to(dtype)
        conv = ([stride] * 2, [1, 1], [1, 1], 1)
        y = torch.ops.prunopt.fb_conv2d(x, coeff, basis, mask, bias, *conv, 1.0)
        y32 = torch.ops.prunopt.fb_conv2d(x.float(), coeff.float(), basis.float(), mask.float(), bias.float(), *conv,
                                          1.0)
        assert y.dtype == dtype and torch.equal(y, y32.to(dtype)), (hw, stride)
        crow, col, values, _ = fb_compress(coeff, mask)
        y_csr = torch.ops.prunopt.fb_conv2d_csr(x, crow, col, values, basis, None, *conv)
        y_csr32 = torch.ops.prunopt.fb_conv2d_csr(x.float(), crow, col, values.float(), basis.float(), None, *conv)
        assert y_csr.dtype == dtype and torch.equal(y_csr, y_csr32.to(dtype)), (hw, stride)
        exact = fb_conv2d_reference(x.double(), coeff.double(), basis.double(), mask.double(), bias.double(),
                                    stride, 1)
        torch.testing.assert_close(y.double(), exact, atol=4e-2 * float(exact.abs().max()), rtol=0)


def test_both_paths_have_the_same_gradients():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    coeff = torch.randn(6, 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    basis = torch.randn(5, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(6, 2, 5, generator=g) < 0.4).double()
    gy = torch.randn(2, 6, 4, 3, generator=g, dtype=torch.float64)
    grads = []
    for fn in (lambda: fb_conv2d_reference(x, coeff, basis, mask, bias, 2, 1, 1, 2),
               lambda: fb_conv2d(x, coeff, basis, mask, bias, 2, 1, 1, 2, path="dense"),
               lambda: fb_conv2d(x, coeff, basis, mask, bias, 2, 1, 1, 2, path="sparse")):
        grads.append(torch.autograd.grad(fn(), (x, coeff, basis, bias), gy))
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # eq. 7: coefficient gradient is masked; basis gradient is sum lam mu dL/dh
    assert torch.equal(grads[1][1] * (1 - mask), torch.zeros_like(coeff))


def test_reconstruct_grads_match_eq7():
    g = torch.Generator().manual_seed(4)
    coeff = torch.randn(5, 3, 9, generator=g, dtype=torch.float64, requires_grad=True)
    basis = torch.randn(9, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(5, 3, 9, generator=g) < 0.5).double()
    gh = torch.randn(5, 3, 3, 3, generator=g, dtype=torch.float64)
    g_lam, g_basis = torch.autograd.grad(fb_reconstruct(coeff, basis, mask), (coeff, basis), gh)
    r_lam, r_basis = fb_coefficient_grads_reference(gh, coeff.detach(), basis.detach(), mask)
    torch.testing.assert_close(g_lam, r_lam, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_basis, r_basis, atol=1e-12, rtol=0)


@needs_ext
@pytest.mark.parametrize("mask", [True, False])
def test_gradcheck_float64(mask):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    coeff = torch.randn(4, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    basis = torch.randn(6, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    mu = (torch.rand(4, 2, 6, generator=g) < 0.5).double() if mask else None
    op = torch.ops.prunopt
    assert torch.autograd.gradcheck(lambda c, b: op.fb_reconstruct(c, b, mu), (coeff, basis), fast_mode=True)
    for max_density in (1.0, -1.0):  # sparse and dense implementation inside the op
        assert torch.autograd.gradcheck(
            lambda x, c, b, bi: op.fb_conv2d(x, c, b, mu, bi, [2, 1], [1, 0], [1, 2], 2, max_density),
            (x, coeff, basis, bias), fast_mode=True)
    comp = fb_compress(coeff.detach(), mu)
    vals = comp.values.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x, v, b, bi: op.fb_conv2d_csr(x, comp.crow_indices, comp.col_indices, v, b, bi, [1, 2], [1, 1], [1, 1], 2),
        (x, vals, basis, bias), fast_mode=True)


@needs_ext
def test_opcheck():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 4, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    coeff = torch.randn(4, 2, 9, generator=g, dtype=torch.float64, requires_grad=True)
    basis = torch.randn(9, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(4, 2, 9, generator=g) < 0.5).double()
    op = torch.ops.prunopt
    torch.library.opcheck(op.fb_reconstruct.default, (coeff, basis, mask))
    torch.library.opcheck(op.fb_reconstruct.default, (coeff, basis, None))
    torch.library.opcheck(op.fb_conv2d.default, (x, coeff, basis, mask, bias, [1, 1], [1, 1], [1, 1], 2, 1.0))


@needs_ext
@pytest.mark.slow
def test_opcheck_more():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 4, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    coeff = torch.randn(4, 2, 9, generator=g, dtype=torch.float64, requires_grad=True)
    basis = torch.randn(9, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(4, 2, 9, generator=g) < 0.5).double()
    op = torch.ops.prunopt
    torch.library.opcheck(op.fb_reconstruct.default, (coeff, basis, None))
    torch.library.opcheck(op.fb_conv2d.default, (x, coeff, basis, mask, bias, [1, 1], [1, 1], [1, 1], 2, -1.0))
    dense_coeff = coeff.detach().repeat(1, 2, 1).requires_grad_()  # groups=1, no mask, no bias
    torch.library.opcheck(op.fb_conv2d.default, (x, dense_coeff, basis, None, None, [2, 1], [0, 1], [1, 2], 1, 1.0))
    comp = fb_compress(coeff.detach(), mask)
    vals = comp.values.clone().requires_grad_(True)
    torch.library.opcheck(op.fb_conv2d_csr.default,
                          (x, comp.crow_indices, comp.col_indices, vals, basis, bias, [1, 1], [1, 1], [1, 1], 2))


def test_torch_compile_op():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4, 8, 8, generator=g)
    coeff = torch.randn(6, 4, 9, generator=g)
    basis = torch.randn(9, 3, 3, generator=g)
    mask = (torch.rand(6, 4, 9, generator=g) < 0.2).float()

    def f(x, c, b, m):
        return torch.relu(fb_conv2d(x * 2, c, b, m, None, 1, 1, path="sparse"))

    compiled = torch.compile(f, fullgraph=prunopt.extension_available(), backend="inductor")
    torch.testing.assert_close(compiled(x, coeff, basis, mask), f(x, coeff, basis, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(8, 3, 3)), ValueError, "basis"),
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 3, 3), mask=torch.ones(4, 2, 8)), ValueError, "mask"),
    (dict(coefficients=torch.randn(4, 3, 9), basis=torch.randn(9, 3, 3)), ValueError, "channels"),
    (dict(coefficients=torch.randn(4, 2, 9, 1), basis=torch.randn(9, 3, 3)), ValueError, "coefficients"),
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 9)), ValueError, "basis"),
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 3, 3, dtype=torch.float64)), ValueError, "basis"),
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 3, 3), bias=torch.randn(5)), ValueError, "bias"),
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 3, 3), groups=3), ValueError, "groups"),
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 3, 3), stride=0), ValueError, "stride"),
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 3, 3), padding=-1), ValueError, "padding"),
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 3, 3), stride="1"), TypeError, "stride"),
    (dict(coefficients="c", basis=torch.randn(9, 3, 3)), TypeError, "coefficients"),
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 3, 3), path="fast"), ValueError, "path"),
    (dict(coefficients=torch.randn(4, 2, 9), basis=torch.randn(9, 7, 7)), ValueError, "kernel"),
])
def test_errors_name_the_argument(kwargs, exc, match):
    x = torch.randn(1, 2, 5, 5)
    with pytest.raises(exc, match=match):
        fb_conv2d(x, **kwargs)


@needs_ext
def test_raw_ops_raise_value_errors():
    op = torch.ops.prunopt
    x, c, b = torch.randn(1, 2, 5, 5), torch.randn(4, 2, 9), torch.randn(9, 3, 3)
    with pytest.raises(ValueError, match="basis"):
        op.fb_reconstruct(c, torch.randn(8, 3, 3), None)
    with pytest.raises(ValueError, match="mask"):
        op.fb_conv2d(x, c, b, torch.ones(4, 2, 8), None, [1, 1], [0, 0], [1, 1], 1, 1.0)
    with pytest.raises(ValueError, match="channels"):
        op.fb_conv2d(torch.randn(1, 3, 5, 5), c, b, None, None, [1, 1], [0, 0], [1, 1], 1, 1.0)
    comp = fb_compress(c)
    bad_col = comp.col_indices.clone()
    bad_col[0] = 99
    with pytest.raises(ValueError, match="col_indices"):
        op.fb_conv2d_csr(x, comp.crow_indices, bad_col, comp.values, b, None, [1, 1], [0, 0], [1, 1], 1)
    with pytest.raises(ValueError, match="crow_indices"):
        op.fb_conv2d_csr(x, comp.crow_indices.long(), comp.col_indices, comp.values, b, None, [1, 1], [0, 0], [1, 1], 1)


def test_compress_round_trip():
    from prunopt.ops.interspace import _decompress

    c = torch.randn(5, 3, 9)
    m = (torch.rand(5, 3, 9) < 0.3).float()
    comp = fb_compress(c, m)
    assert comp.values.numel() == int(((c * m) != 0).sum())
    assert comp.crow_indices.dtype == torch.int32 and comp.col_indices.dtype == torch.int32
    torch.testing.assert_close(_decompress(comp), c * m)


def test_cost_model_picks_the_path_by_density_and_image_size(monkeypatch):
    """The model's form, with the AVX2 ("default") constants pinned: the AVX512
    set takes the sparse path for the 3-channel layer
    up to density ~0.18, where it is 1.02-1.22x slower (docs/interspace.md)."""
    from prunopt.ops import interspace as ops_interspace
    from prunopt.ops.interspace import auto_max_density, sparse_is_faster

    monkeypatch.setattr(ops_interspace, "_cpu_capability", lambda: "default")

    # a VGG layer at batch 1: dense at full density, sparse at 1%
    total = 256 * 256 * 9
    assert not sparse_is_faster(total, 256, 256, 256, 9, 9, 64)
    assert sparse_is_faster(total // 100, 256, 256, 256, 9, 9, 64)
    d = auto_max_density(256, 256, 256, 9, 9, 64)
    assert 0.01 < d < 1.0
    assert sparse_is_faster(int(0.99 * d * total), 256, 256, 256, 9, 9, 64)
    assert not sparse_is_faster(int(1.01 * d * total) + 1, 256, 256, 256, 9, 9, 64)
    # the first VGG layer (3 input channels) never profits from the sparse path
    assert auto_max_density(64, 3, 3, 9, 9, 1024) < 0.05


def test_cost_model_constants_per_cpu_capability(monkeypatch):
    """One set of cost-model constants per CPU capability: the AVX512 set on
    AVX-512 CPUs (where oneDNN's conv2d is about twice as fast and the AVX2 set
    chose the sparse path for 2x2 layers at density 0.5, 2.7x slower), the
    AVX2 ("default") set elsewhere."""
    from prunopt.ops import interspace as ops_interspace
    from prunopt.ops.interspace import COST_CONSTANTS, cost_constants, sparse_is_faster

    assert cost_constants("AVX512") is COST_CONSTANTS["AVX512"]
    for cap in ("AVX2", "DEFAULT", "ZVECTOR", "default"):
        assert cost_constants(cap) is COST_CONSTANTS["default"]
    assert cost_constants() is cost_constants(torch.backends.cpu.get_cpu_capability())
    total = 512 * 512 * 9
    picks = {}
    for cap in ("default", "AVX512"):
        monkeypatch.setattr(ops_interspace, "_cpu_capability", lambda cap=cap: cap)
        picks[cap] = [sparse_is_faster(int(d * total), 512, 512, 512, 9, 9, 4) for d in (0.01, 0.1, 0.5)]
    assert picks["default"] == [True, True, True]  # conv2d on 2x2 images is slow on the AVX2 host
    assert picks["AVX512"] == [True, True, False]


def test_auto_path_is_exact_on_both_sides_of_the_threshold():
    from prunopt.ops.interspace import auto_max_density

    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, 64, 8, 8, generator=g)
    coeff = torch.randn(64, 64, 9, generator=g)
    basis = torch.randn(9, 3, 3, generator=g)
    d = auto_max_density(64, 64, 64, 9, 9, 64)
    for density in (d / 2, min(1.0, d * 1.5 + 0.05)):
        mask = (torch.rand(coeff.shape, generator=g) < density).float()
        exact = fb_conv2d_reference(x.double(), coeff.double(), basis.double(), mask.double(), None, 1, 1)
        torch.testing.assert_close(fb_conv2d(x, coeff, basis, mask, None, 1, 1).double(), exact,
                                   **_tol(torch.float32, 1 + float(exact.abs().max())))


# -- regressions (audit of the interspace ops) ---------------------------------------------------

@pytest.mark.parametrize("path", ["auto", "dense", "sparse"])
def test_zero_size_kernel_is_a_value_error_naming_basis(path):
    x, c = torch.randn(1, 2, 5, 5), torch.randn(4, 2, 9)
    for basis in (torch.randn(9, 0, 3), torch.randn(9, 3, 0)):
        with pytest.raises(ValueError, match="basis"):
            fb_conv2d(x, c, basis, path=path)
    with pytest.raises(ValueError, match="basis"):
        fb_reconstruct(c, torch.randn(9, 0, 3))
    with pytest.raises(ValueError, match="basis"):
        fb_conv2d_compressed(x, fb_compress(c), torch.randn(9, 0, 3))


@pytest.mark.parametrize("path", ["auto", "dense", "sparse"])
def test_non_tensor_input_is_a_type_error_naming_input(path):
    c, b = torch.randn(4, 2, 9), torch.randn(9, 3, 3)
    for bad in (None, [[1.0]]):
        with pytest.raises(TypeError, match="input"):
            fb_conv2d(bad, c, b, path=path)
        with pytest.raises(TypeError, match="input"):
            fb_conv2d_compressed(bad, fb_compress(c), b)


def test_compress_errors_are_value_and_type_errors():
    with pytest.raises(ValueError, match="coefficients"):
        fb_compress(torch.randn(4, 9))
    with pytest.raises(TypeError, match="coefficients"):
        fb_compress([1, 2])
    with pytest.raises(ValueError, match="meta"):
        fb_compress(torch.randn(4, 2, 9, device="meta"))


@pytest.mark.parametrize("path", ["auto", "dense", "sparse"])
def test_meta_device(path):
    x = torch.randn(2, 2, 5, 5, device="meta")
    c, b, m = (torch.randn(4, 2, 9, device="meta"), torch.randn(9, 3, 3, device="meta"),
               torch.ones(4, 2, 9, device="meta"))
    y = fb_conv2d(x, c, b, m, None, 2, 1, path=path)
    assert y.device.type == "meta" and y.shape == (2, 4, 3, 3)
    assert fb_conv2d(x[0], c, b, m, None, 1, 1, path=path).shape == (4, 5, 5)
    assert fb_reconstruct(c, b, m).shape == (4, 2, 3, 3)


@pytest.mark.parametrize("path", ["auto", "dense", "sparse"])
def test_torch_func_transforms(path):
    """torch.func.grad / vmap / jvp through the ops match torch.autograd (the
    reference is used under the transforms)."""
    from torch.func import grad, jvp, vmap

    torch.manual_seed(0)
    x, c, b = torch.randn(2, 4, 6, 6, dtype=torch.float64), torch.randn(6, 2, 5, dtype=torch.float64), \
        torch.randn(5, 3, 3, dtype=torch.float64)
    m = (torch.rand(6, 2, 5) < 0.5).double()

    def f(x, c, b):
        return fb_conv2d(x, c, b, m, None, 1, 1, 1, 2, path=path).square().sum()

    got = grad(f, argnums=(0, 1, 2))(x, c, b)
    xs, cs, bs = (t.clone().requires_grad_() for t in (x, c, b))
    want = torch.autograd.grad(f(xs, cs, bs), (xs, cs, bs))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)
    with torch.no_grad():
        y = vmap(lambda xi: fb_conv2d(xi, c, b, m, None, 1, 1, 1, 2, path=path))(x)
        torch.testing.assert_close(y, fb_conv2d_reference(x, c, b, m, None, 1, 1, 1, 2), atol=1e-12, rtol=0)
        t = torch.randn_like(c)
        _, tangent = jvp(lambda c: fb_conv2d(x, c, b, m, None, 1, 1, 1, 2, path=path), (c,), (t,))
        torch.testing.assert_close(tangent, fb_conv2d_reference(x, t, b, m, None, 1, 1, 1, 2), atol=1e-12, rtol=0)
    gl = grad(lambda c: fb_reconstruct(c, b, m).square().sum())(c)
    torch.testing.assert_close(gl, 2 * torch.einsum("oikl,nkl->oin", fb_reconstruct(c, b, m), b) * m,
                               atol=1e-10, rtol=1e-10)
    comp = fb_compress(c, m)
    gx = grad(lambda x: fb_conv2d_compressed(x, comp, b, None, 1, 1, 1, 2).square().sum())(x)
    torch.testing.assert_close(gx, got[0], atol=1e-10, rtol=1e-10)
