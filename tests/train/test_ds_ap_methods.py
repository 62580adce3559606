"""Smoke tests of ``prunopt train --method ds`` / ``--method ap`` (tiny runs)."""
import re

import pytest

from prunopt.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("method", ["ds", "ap"])
def test_train_method_prints_summary(method, capsys, tmp_path):
    assert main(["train", "--method", method, "--epochs", "1", "--limit", "300", "--no-progress",
                 "--density", "0.5", "--out", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.match(r"summary: method=(\w+) dense_acc=([\d.]+) pruned_acc=([\d.]+) density=([\d.]+) sparsity=([\d.]+)", line)
    assert m and m.group(1) == method
    density, sparsity = float(m.group(4)), float(m.group(5))
    assert 0.0 < density <= 1.0 and abs(density + sparsity - 1.0) < 1e-3
    assert (tmp_path / "summary.json").exists() and (tmp_path / "checkpoint.pt").exists()


def test_ds_optimizer_param_roles():
    import torch

    from prunopt.nn.sparsification import convert_to_sparse_batchnorm
    from prunopt.train.loop import OptimizerGroup
    from prunopt.train.methods.ds import ds_optimizer
    from prunopt.train.models import SmallCNN

    model = convert_to_sparse_batchnorm(SmallCNN(width=4), preserve=False)
    opt, sched = ds_optimizer(model, lr=0.1, epochs=3, beta_lr=0.02, weight_decay=1e-3)
    sgd, adam = opt.optimizers
    names = {id(p): n for n, p in model.named_parameters()}
    wd = [[names[id(p)] for p in g["params"]] for g in sgd.param_groups]
    assert all(".gate." not in n for n in wd[0]) and sgd.param_groups[0]["weight_decay"] == 1e-3
    assert all(n.endswith(".gate.alpha") for n in wd[1]) and sgd.param_groups[1]["weight_decay"] == 0.0
    assert all(names[id(p)].endswith(".gate.beta") for p in adam.param_groups[0]["params"])
    assert adam.param_groups[0]["lr"] == 0.02
    assert sum(len(g["params"]) for o in opt.optimizers for g in o.param_groups) == len(names)
    # one step, then the group's state round-trips into a fresh group
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    opt.step()
    sched.step()
    fresh, _ = ds_optimizer(model, lr=0.1, epochs=3)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.optimizers[1].state_dict()["state"].keys() == adam.state_dict()["state"].keys()
    with pytest.raises(ValueError, match="optimizers"):
        OptimizerGroup(sgd).load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="lr"):
        ds_optimizer(model, lr=0.0, epochs=1)
