"""Global (A.39-A.40) / layerwise selection with the documented tie rule, and
ERK densities (A.76)."""
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, strategies as st

from prunopt.pruning import erk_counts, erk_densities, global_masks, kept_count, layerwise_masks


def _scores(sizes, seed, ties):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, n in enumerate(sizes):
        s = torch.rand(n, generator=g)
        if ties:
            s = (s * 3).round()
        out[f"l{i}.weight"] = s.reshape(n, 1) if i % 2 else s
    return out


@given(st.lists(st.integers(1, 50), min_size=1, max_size=4), st.floats(0, 1), st.integers(0, 1000), st.booleans())
def test_global_count_exact_and_top_scores(sizes, p, seed, ties):
    scores = _scores(sizes, seed, ties)
    masks = global_masks(scores, p)
    d = sum(sizes)
    k = math.floor((1 - p) * d + 1e-9)
    assert sum(int(m.sum()) for m in masks.values()) == k
    flat = torch.cat([s.reshape(-1) for s in scores.values()])
    keep = torch.cat([m.reshape(-1) for m in masks.values()])
    if 0 < k < d:
        assert flat[keep].min() >= flat[~keep].max()
        # tie rule: among equal scores at the threshold the earlier entries are kept
        thr = flat[keep].min()
        at = (flat == thr).nonzero().reshape(-1)
        kept_at = keep[at]
        assert bool((kept_at[:-1].int() >= kept_at[1:].int()).all())


def test_tie_rule_all_equal():
    scores = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    masks = global_masks(scores, 0.5)  # k = floor(0.5 * 7) = 3
    assert masks["a"].tolist() == [True, True, True]
    assert masks["b"].sum() == 0


@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.floats(0, 1), st.integers(0, 100))
def test_layerwise_counts_exact(sizes, p, seed):
    scores = _scores(sizes, seed, ties=True)
    masks = layerwise_masks(scores, p)
    for n, m in masks.items():
        assert int(m.sum()) == kept_count(p, m.numel())
        assert m.shape == scores[n].shape


def test_layerwise_rates_mapping_and_errors():
    scores = {"a": torch.arange(10.0), "b": torch.arange(4.0)}
    masks = layerwise_masks(scores, {"a": 0.7, "b": 0.5})
    assert masks["a"].tolist() == [False] * 7 + [True] * 3
    assert masks["b"].tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="unknown layer name.*'c'"):
        layerwise_masks(scores, {"a": 0.5, "b": 0.5, "c": 0.1})
    with pytest.raises(ValueError, match="no rate"):
        layerwise_masks(scores, {"a": 0.5})
    with pytest.raises(ValueError, match="sparsity"):
        global_masks(scores, 1.2)
    with pytest.raises(ValueError, match="NaN"):
        global_masks({"a": torch.tensor([0.0, float("nan")])}, 0.5)
    with pytest.raises(ValueError, match="non-empty"):
        global_masks({}, 0.5)


def test_kept_count_rounding():
    assert kept_count(0.9, 10) == 1
    assert kept_count(0.7, 10) == 3
    assert kept_count(1.0, 10) == 0 and kept_count(0.0, 10) == 10
    # large d: exact floor (a relative 1e-9 guard used to add one)
    assert kept_count(0.5, 2_000_000_001) == 1_000_000_000
    assert kept_count(0.3, 1_000_000_007) == 700_000_004
    assert kept_count(0.5, 2**45 + 1) == 2**44
    assert kept_count(0.0, 0) == 0 and kept_count(0.25, 4) == 3
    for p in (0.1, 0.2, 0.3, 0.6, 0.7, 0.9, 0.99):  # float noise of decimal rates
        for d in (10, 100, 1000, 10**6 + 1, 10**9 + 7):
            exact = Fraction(1) - Fraction(str(p))
            assert kept_count(p, d) == math.floor(exact * d), (p, d)
    with pytest.raises(ValueError, match="sparsity"):
        kept_count(1.5, 10)
    with pytest.raises(ValueError, match="d must"):
        kept_count(0.5, -1)
    with pytest.raises(TypeError, match="d must"):
        kept_count(0.5, 10.0)


SHAPES = {"c1": (16, 3, 3, 3), "c2": (32, 16, 3, 3), "c3": (64, 32, 3, 3), "c4": (64, 64, 3, 3), "fc": (10, 64)}


@pytest.mark.parametrize("density", [0.01, 0.05, 0.1, 0.3, 0.5, 0.9])
def test_erk_meets_target(density):
    dens = erk_densities(SHAPES, density)
    n = {k: math.prod(s) for k, s in SHAPES.items()}
    total = sum(n.values())
    assert sum(dens[k] * n[k] for k in SHAPES) == pytest.approx(density * total, rel=1e-12)
    assert all(0 < d <= 1 for d in dens.values())
    # non-dense layers follow eps * sum(shape) / prod(shape) with one eps (A.76)
    eps = {k: dens[k] * n[k] / sum(SHAPES[k]) for k in SHAPES if dens[k] < 1}
    assert max(eps.values()) == pytest.approx(min(eps.values()), rel=1e-12)
    counts = erk_counts(SHAPES, density)
    assert sum(counts.values()) == kept_count(1 - density, total)
    assert all(abs(counts[k] - dens[k] * n[k]) <= 1 + 1e-9 for k in SHAPES)


def test_erk_small_layers_become_dense():
    dens = erk_densities(SHAPES, 0.5)
    assert dens["c1"] == 1.0  # 3 input channels: ERK density > 1 is capped
    assert dens["c4"] < dens["c2"]


def test_erk_zero_sized_layer_is_dense_and_takes_no_budget():
    shapes = {"empty": (0, 3), "b": (4, 4)}
    assert erk_densities(shapes, 0.5) == {"empty": 1.0, "b": 0.5}  # was a ZeroDivisionError
    assert erk_counts(shapes, 0.5) == {"empty": 0, "b": 8}
    assert erk_counts({"empty": (3, 0, 2)}, 0.3) == {"empty": 0}
    with pytest.raises(ValueError, match=r"shapes\['b'\]"):
        erk_densities({"a": (2, 2), "b": (2, -1)}, 0.5)
    with pytest.raises(TypeError, match=r"shapes\['a'\]"):
        erk_densities({"a": "22"}, 0.5)


def test_erk_errors():
    with pytest.raises(ValueError, match="density"):
        erk_densities(SHAPES, 1.5)
    with pytest.raises(ValueError, match="dense.*nope"):
        erk_densities(SHAPES, 0.5, dense=["nope"])


def test_erk_numels_refer_to_the_masked_tensors():
    shapes = {"a": (16, 1, 3, 3), "b": (32, 16, 3, 3), "c": (4, 32)}
    numels = {"a": 16 * 4, "b": 32 * 16 * 4, "c": 128}  # FB layers with N = 4 coefficients
    counts = erk_counts(shapes, 0.3, numels=numels)
    total = sum(numels.values())
    assert sum(counts.values()) == kept_count(0.7, total)
    assert all(counts[k] <= numels[k] for k in shapes)
    dens = erk_densities(shapes, 0.3, numels=numels)
    assert sum(dens[k] * numels[k] for k in shapes) == pytest.approx(0.3 * total)
    # same ERK scores sum(shape)/prod(shape) (of the spatial shapes), another budget: ratios agree
    shapes = {"a": (16, 8, 3, 3), "b": (32, 16, 3, 3), "c": (10, 64)}
    numels = {"a": 16 * 8 * 4, "b": 32 * 16 * 4, "c": 640}
    ref, low = erk_densities(shapes, 0.1), erk_densities(shapes, 0.1, numels=numels)
    assert all(v < 1 for v in ref.values()) and all(v < 1 for v in low.values())
    assert low["b"] / low["c"] == pytest.approx(ref["b"] / ref["c"])
    assert low["a"] / low["b"] == pytest.approx(ref["a"] / ref["b"])
    assert sum(low[k] * numels[k] for k in shapes) == pytest.approx(0.1 * sum(numels.values()))
    with pytest.raises(ValueError, match="numels"):
        erk_counts(shapes, 0.3, numels={"a": 1})
    with pytest.raises(TypeError, match="numels"):
        erk_counts(shapes, 0.3, numels={**numels, "a": 1.5})
