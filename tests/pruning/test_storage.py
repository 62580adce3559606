"""CSR export with byte sizes and the entropy bound (App. C, eq. A.2)."""
import math

import pytest
import torch

from prunopt.pruning import Masker, entropy_bound, export_csr, from_csr, mask_entropy_bits, to_csr

from _pruning_helpers import TinyNet, random_masks


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 3, 3, 3), (300, 2), (1, 1), (3, 0), (0, 5), (0,), (0, 2, 3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_csr_round_trip_and_bytes(shape, dtype, density):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g, dtype=dtype)
    w = w * (torch.rand(shape, generator=g) < density)
    c = to_csr(w)
    back = from_csr(c)
    assert back.dtype == w.dtype and back.shape == w.shape
    assert torch.equal(back, w)
    nnz = int(w.count_nonzero())
    rows = shape[0] if len(shape) > 1 else 1
    cols = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    assert c.values.numel() == nnz
    expected = nnz * w.element_size() + nnz * c.col_indices.element_size() + (rows + 1) * c.crow_indices.element_size()
    assert c.nbytes == expected
    assert c.col_indices.element_size() == (1 if cols <= 128 else 2)


def test_entropy_bound_eq_a2():
    assert mask_entropy_bits(0.5) == pytest.approx(1.0)
    assert mask_entropy_bits(0.0) == 0.0 and mask_entropy_bits(1.0) == 0.0
    p = 0.85
    S = -p * math.log2(p) - (1 - p) * math.log2(1 - p)
    assert entropy_bound(p) == pytest.approx(S / 32 + 1 - p)
    with pytest.raises(ValueError, match="p must be"):
        mask_entropy_bits(1.5)
    assert entropy_bound(p, 16) == pytest.approx(S / 16 + 1 - p)
    with pytest.raises(ValueError, match="value_bits"):
        entropy_bound(0.5, 0)  # was a ZeroDivisionError
    with pytest.raises(TypeError, match="value_bits"):
        entropy_bound(0.5, 32.0)


def test_export_model():
    model = TinyNet()
    masker = Masker(model)
    masker.set_masks(random_masks(masker, 0.2))
    ex = export_csr(masker)
    assert set(ex["tensors"]) == set(masker.tensors)
    for n, c in ex["tensors"].items():
        assert torch.equal(c.to_dense(), masker[n].effective().detach())
    d = sum(pt.parameter.numel() for pt in masker.tensors.values())
    assert ex["dense_bytes"] == 4 * d
    assert ex["csr_bytes"] == sum(c.nbytes for c in ex["tensors"].values())
    assert ex["sparsity"] == pytest.approx(masker.sparsity())
    assert ex["entropy_fraction"] == pytest.approx(entropy_bound(ex["sparsity"]))


def test_errors():
    with pytest.raises(TypeError, match="weight"):
        to_csr([1.0, 0.0])
    with pytest.raises(ValueError, match="dimension"):
        to_csr(torch.tensor(1.0))
    with pytest.raises(TypeError, match="CSRTensor"):
        from_csr(torch.zeros(3))
    with pytest.raises(TypeError, match="target"):
        export_csr(3)


def test_rates_and_export_of_nothing_prunable_are_value_errors():
    from torch import nn

    from prunopt.pruning import pruning_rates

    for target in (nn.Sequential(nn.ReLU(), nn.BatchNorm2d(3)), Masker(nn.Linear(0, 4))):
        with pytest.raises(ValueError, match="no prunable"):
            pruning_rates(target)
        with pytest.raises(ValueError, match="no prunable"):
            export_csr(target)
    # an empty layer beside a non-empty one is fine
    m = Masker(nn.Sequential(nn.Linear(0, 4), nn.Linear(4, 2)))
    assert export_csr(m)["sparsity"] == 0.0 and pruning_rates(m)["D"] == 8
