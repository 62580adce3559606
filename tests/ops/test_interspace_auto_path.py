"""path="auto" of the functional fb_conv2d, which has no cached CSR: its cost
model counts the CSR's count and build (and the dense path's reconstruction),
so it takes the dense path where building the CSR would dominate; the ops it
dispatches are recorded to see which path ran."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prunopt.ops import fb_compress, fb_conv2d, fb_conv2d_compressed
from prunopt.ops import interspace as ops_interspace
from prunopt.ops.interspace import auto_max_density, cost_constants, sparse_is_faster
from prunopt.reference.interspace import fb_conv2d_reference

needs_kernel = pytest.mark.skipif(not ops_interspace._CONV_DEVICES, reason="needs the compiled fb_conv2d kernel")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("capability", ["AVX512", "default"])
def test_cost_model_picks_dense_when_the_csr_build_dominates(capability):
    c = cost_constants(capability)
    # 512->512, 3x3 at 4x4, batch 1, density 0.1: with a cached CSR eq. 8 wins, but building the
    # CSR (a pass over 2.4M coefficients) costs more than the whole dense path
    total = 512 * 512 * 9
    nnz = total // 10
    assert sparse_is_faster(nnz, 512, 512, 512, 9, 9, 16, constants=c)
    assert not sparse_is_faster(nnz, 512, 512, 512, 9, 9, 16, constants=c, csr_cached=False)
    assert auto_max_density(512, 512, 512, 9, 9, 16, constants=c, csr_cached=False) < 0
    # the build adds to the sparse side only: the uncached threshold is always below the cached one
    for c_in, c_out, hw in ((3, 64, 32), (64, 64, 32), (128, 128, 16), (256, 256, 8), (512, 512, 2)):
        cached = auto_max_density(c_out, c_in, c_in, 9, 9, hw * hw, constants=c)
        uncached = auto_max_density(c_out, c_in, c_in, 9, 9, hw * hw, constants=c, csr_cached=False)
        assert uncached < cached
    # a large image at a low density still takes the sparse path without a cache
    assert sparse_is_faster(64 * 64 * 9 // 100, 64, 64, 64, 9, 9, 1024, constants=c, csr_cached=False)


def _run(x, lam, g, mu):
    with torch.no_grad(), _Ops() as rec:
        y = fb_conv2d(x, lam, g, mu, None, 1, 1)
    return y, rec.names


@needs_kernel
@pytest.mark.parametrize("capability", ["AVX512", "default"])
def test_auto_runs_the_path_the_uncached_model_picks(capability, monkeypatch):
    monkeypatch.setattr(ops_interspace, "_cpu_capability", lambda: capability)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(9, 3, 3, generator=gen)

    def layer(c, hw, density):
        lam = torch.randn(c, c, 9, generator=gen)
        mu = (torch.rand(c, c, 9, generator=gen) < density).float()
        return torch.randn(1, c, hw, hw, generator=gen), lam, mu

    # 512 channels on a small image, every density: never the kernel (no count, no CSR), conv2d on the
    # reconstructed filters
    assert auto_max_density(512, 512, 512, 9, 9, 16, csr_cached=False) < 0
    for density in (0.01, 0.5):
        x, lam, mu = layer(512, 4, density)
        y, names = _run(x, lam, g, mu)
        assert "prunopt.fb_conv2d" not in names and "aten.convolution" in names
        torch.testing.assert_close(y.double(), fb_conv2d_reference(x.double(), lam.double(), g.double(),
                                                                   mu.double(), None, 1, 1), atol=1e-4, rtol=1e-4)
    # a large image at a low density: the kernel, which takes eq. 8
    x, lam, mu = layer(64, 32, 0.01)
    y, names = _run(x, lam, g, mu)
    assert "prunopt.fb_conv2d" in names
    torch.testing.assert_close(y.double(), fb_conv2d_reference(x.double(), lam.double(), g.double(), mu.double(),
                                                               None, 1, 1), atol=1e-4, rtol=1e-4)
    # where the kernel's count is not negligible, a density far above the threshold skips the kernel
    dims = (128, 128, 128, 9, 9, 256, 256)
    threshold = auto_max_density(*dims, csr_cached=False)
    assert 0 < threshold < 0.5
    assert ops_interspace._count_is_costly(128, 128, 9, ops_interspace._costs(*dims, csr_cached=False)[0])
    x, lam, mu = layer(128, 16, min(1.0, 2 * threshold + 0.1))
    _, names = _run(x, lam, g, mu)
    assert "prunopt.fb_conv2d" not in names
    x, lam, mu = layer(128, 16, threshold / 4)
    _, names = _run(x, lam, g, mu)
    assert "prunopt.fb_conv2d" in names


def test_auto_skips_the_kernels_count_when_the_sample_is_clearly_below_the_threshold():
    """Where the count is costly, a sampled density four standard errors below
    the threshold hands the kernel max_density 1.0 (no second, exact count);
    near the threshold the kernel gets the threshold and counts."""
    gen = torch.Generator().manual_seed(3)
    dims = (128, 128, 128, 9, 9, 256, 256)
    threshold = auto_max_density(*dims, csr_cached=False)
    g = torch.randn(9, 3, 3, generator=gen)
    x = torch.randn(1, 128, 16, 16, generator=gen)
    lam = torch.randn(128, 128, 9, generator=gen)
    args = ((1, 1), (1, 1), (1, 1), 1)
    low = (torch.rand(lam.shape, generator=gen) < threshold / 4).float()
    assert ops_interspace._uncached_max_density(x, lam, g, low, *args) == 1.0
    near = (torch.rand(lam.shape, generator=gen) < 0.97 * threshold).float()
    d = ops_interspace._sampled_density(lam, near)
    assert d + 4 * (d * (1 - d) / ops_interspace._SAMPLE) ** 0.5 > threshold  # not clearly below
    if d <= threshold:
        assert ops_interspace._uncached_max_density(x, lam, g, near, *args) == threshold


def test_sampled_density_estimates_the_masked_density():
    gen = torch.Generator().manual_seed(1)
    lam = torch.randn(256, 64, 9, generator=gen)
    for d in (0.02, 0.3, 0.9):
        mu = (torch.rand(lam.shape, generator=gen) < d).float()
        est = ops_interspace._sampled_density(lam, mu)
        assert abs(est - float(mu.mean())) < 0.05
    assert ops_interspace._sampled_density(lam, None) == 1.0
    small = torch.randn(4, 4, 9, generator=gen)
    mu = (torch.rand(small.shape, generator=gen) < 0.5).float()
    assert ops_interspace._sampled_density(small, mu) == pytest.approx(float(((small * mu) != 0).sum()) / small.numel())
    # a non-contiguous view is read in place
    est = ops_interspace._sampled_density(lam.transpose(0, 1), None)
    assert est == 1.0


def test_compressed_op_reuses_the_csr():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 6, 6, generator=gen)
    lam = torch.randn(5, 8, 9, generator=gen)
    mu = (torch.rand(lam.shape, generator=gen) < 0.3).float()
    g = torch.randn(9, 3, 3, generator=gen)
    comp = fb_compress(lam, mu)
    with _Ops() as rec:
        for _ in range(2):
            y = fb_conv2d_compressed(x, comp, g, None, 1, 1)
    assert "prunopt.fb_conv2d" not in rec.names
    torch.testing.assert_close(y.double(), fb_conv2d_reference(x.double(), lam.double(), g.double(), mu.double(),
                                                               None, 1, 1), atol=1e-4, rtol=1e-4)


def test_sampled_density_is_remembered_until_the_mask_is_written(monkeypatch):
    """A layer called again with the same mask skips the sample; an in-place
    write (a new version) samples again, so the path follows the new mask."""
    calls = []
    sample = ops_interspace._sample_density
    monkeypatch.setattr(ops_interspace, "_sample_density", lambda t: calls.append(1) or sample(t))
    monkeypatch.setattr(ops_interspace, "_DENSITY", {})
    gen = torch.Generator().manual_seed(4)
    lam = torch.randn(128, 128, 9, generator=gen)
    mu = (torch.rand(lam.shape, generator=gen) < 0.05).float()
    d = ops_interspace._sampled_density(lam, mu)
    assert ops_interspace._sampled_density(lam, mu) == d and len(calls) == 1
    mu.fill_(1.0)  # written in place: sampled again
    assert ops_interspace._sampled_density(lam, mu) == 1.0 and len(calls) == 2
    assert ops_interspace._sampled_density(lam, mu.clone()) == 1.0 and len(calls) == 3  # another tensor
    for d in (0.02, 0.9, 0.02):  # new masks, often in the memory of the freed one, at version 0
        m = (torch.rand(lam.shape, generator=gen) < d).float()
        assert abs(ops_interspace._sampled_density(lam, m) - d) < 0.05
        del m
    assert len(calls) == 6
    with torch.inference_mode():  # no version counter: sampled every time, no error
        inf_mu = torch.zeros(lam.shape)
        assert ops_interspace._sampled_density(lam, inf_mu) == 0.0
        assert ops_interspace._sampled_density(lam, inf_mu) == 0.0
    assert len(calls) == 8


@needs_kernel
def test_auto_follows_a_mask_written_in_place():
    gen = torch.Generator().manual_seed(5)
    dims = (128, 128, 128, 9, 9, 256, 256)
    threshold = auto_max_density(*dims, csr_cached=False)
    g = torch.randn(9, 3, 3, generator=gen)
    x = torch.randn(1, 128, 16, 16, generator=gen)
    lam = torch.randn(128, 128, 9, generator=gen)
    mu = (torch.rand(lam.shape, generator=gen) < threshold / 4).float()
    _, names = _run(x, lam, g, mu)
    assert "prunopt.fb_conv2d" in names
    mu.fill_(1.0)  # now dense: auto must see it
    y, names = _run(x, lam, g, mu)
    assert "prunopt.fb_conv2d" not in names
    torch.testing.assert_close(y.double(), fb_conv2d_reference(x.double(), lam.double(), g.double(), mu.double(),
                                                               None, 1, 1), atol=1e-4, rtol=1e-4)
