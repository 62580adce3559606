"""prunopt repro ds: the statistics behind the DS Fig. 1-2 comparison."""
import pytest
import torch

from prunopt.repro.ds import sparsity_stats, train


def test_sparsity_stats_channel_and_group():
    # l1-like: zeros scattered over groups; l2,1-like: whole groups
    scattered = [torch.tensor([0.0, 1, 1, 1, 1, 0, 1, 1]), torch.tensor([1.0, 1, 0, 1])]
    grouped = [torch.tensor([0.0, 0, 0, 0, 1, 1, 1, 1]), torch.tensor([1.0, 2, 3, 4])]
    s = sparsity_stats(scattered, 4)
    assert s["channel_sparsity"] == pytest.approx(3 / 12)
    assert s["group_sparsity"] == 0.0 and s["zeros_in_zero_groups"] == 0.0
    assert s["layer_sparsity"] == [0.25, 0.25]
    g = sparsity_stats(grouped, 4)
    assert g["channel_sparsity"] == pytest.approx(4 / 12)
    assert g["group_sparsity"] == pytest.approx(1 / 3) and g["zeros_in_zero_groups"] == 1.0
    assert sparsity_stats([torch.ones(4)], 4)["zeros_in_zero_groups"] == 0.0


@pytest.mark.parametrize("norm", ["l1", "l21"])
def test_train_runs_and_exports(norm):
    gates, acc, gated_acc, small_params, dense_params = train(norm, 0.1, 2, 150, 0, width=4)
    assert [g.numel() for g in gates] == [4, 8, 8]
    assert 0.0 <= acc <= 1.0 and acc == pytest.approx(gated_acc)  # the export changes nothing
    assert small_params <= dense_params
