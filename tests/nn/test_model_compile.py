"""Model-level ``torch.compile`` with ``fullgraph=True`` (no graph break) for a
small CNN carrying each of prunopt's layers, in training (forward and
backward) and evaluation, against the eager model."""
import copy

import pytest
import torch
import torch._dynamo
from torch import nn

from prunopt.nn import (
    FBConv2d,
    ProbMaskInput,
    SyncSparseBatchNorm2d,
    apply_probmask,
    convert_to_sparse_batchnorm,
    to_interspace,
    two_temperature_masks,
    wrap_two_temperature_masks,
)
from prunopt.pruning import Masker


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _fb():
    model = to_interspace(_cnn())
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, FBConv2d):
            m.mask.copy_((torch.rand(m.mask.shape, generator=g) < 0.3).float())
    return model


def _probmask():
    model = _cnn()
    apply_probmask(model, hard=True)
    return model


def _probmask_input():
    return nn.Sequential(ProbMaskInput((8, 8)), _cnn())


def _sync_sparse_bn():
    model = convert_to_sparse_batchnorm(_cnn())
    model[1], model[4] = SyncSparseBatchNorm2d(8), SyncSparseBatchNorm2d(8)  # one process: local statistics
    return model


def _two_temperature(frozen):
    def make():
        model = wrap_two_temperature_masks(_cnn(), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            for m in two_temperature_masks(model):
                m.w.sub_(0.005)  # some logits below 0
                if frozen:
                    m.freeze()
        return model
    return make


def _masker():
    model = _cnn()
    masker = Masker(model)
    g = torch.Generator().manual_seed(3)
    masker.set_masks({n: torch.rand(pt.parameter.shape, generator=g) < 0.5 for n, pt in masker.tensors.items()})
    return model


MODELS = {"FBConv2d": _fb, "ProbMask": _probmask, "ProbMaskInput": _probmask_input,
          "SparseBatchNorm2d": lambda: convert_to_sparse_batchnorm(_cnn()), "SyncSparseBatchNorm2d": _sync_sparse_bn,
          "TwoTemperatureMask": _two_temperature(False), "TwoTemperatureMask-frozen": _two_temperature(True),
          "Masker": _masker}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_model_compiles_without_graph_breaks(kind, mode):
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    eager = MODELS[kind]()
    model = copy.deepcopy(eager)
    getattr(eager, mode)()
    getattr(model, mode)()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break raises
    if mode == "eval":
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), eager(x), atol=1e-5, rtol=1e-5)
        return
    torch.manual_seed(5)  # ProbMask samples its mask in training
    out = compiled(x)
    torch.manual_seed(5)
    ref = eager(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
