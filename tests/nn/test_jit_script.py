"""torch.jit.script on models containing prunopt modules: one clear error that
names the module and the supported alternatives (torch.compile, torch.export),
not a TorchScript parser error from inside prunopt's source."""
import pytest
import torch
from torch import nn

from prunopt.nn import (
    FBConv2d,
    FilterBasis,
    ProbMaskInput,
    SparseAdjacency,
    SparseBatchNorm2d,
    SparseEdges,
    SparseGate,
    TwoTemperatureMask,
    apply_probmask,
)
from prunopt.nn._jit import TorchScriptNotSupportedError
from prunopt.pruning import Masker

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.script.*is deprecated:DeprecationWarning")


class Holder(nn.Module):
    """A user's model with the prunopt module deep inside."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.body = nn.Sequential(nn.Identity(), nn.ModuleDict({"inner": inner}))

    def forward(self, x):
        return x


def _probmasked():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    apply_probmask(model)
    return model


def _masked():
    model = nn.Sequential(nn.Linear(3, 4))
    Masker(model)
    return model


CASES = {
    "FBConv2d": lambda: FBConv2d(3, 4, 3),
    "FilterBasis": lambda: FilterBasis(3),
    "SparseBatchNorm2d": lambda: nn.Sequential(nn.Conv2d(3, 4, 3), SparseBatchNorm2d(4)),
    "SparseGate": lambda: SparseGate(4),
    "TwoTemperatureMask": lambda: TwoTemperatureMask(nn.Linear(3, 4)),
    "ProbMask": _probmasked,
    "ProbMaskInput": lambda: ProbMaskInput((4,)),
    "SparseEdges": lambda: SparseEdges(3, 4),
    "SparseAdjacency": lambda: SparseAdjacency(4),
    "WeightMask": _masked,
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_script_of_a_model_containing_a_prunopt_module_names_it_and_the_alternatives(kind):
    for model in (CASES[kind](), Holder(CASES[kind]())):
        with pytest.raises(TorchScriptNotSupportedError, match=kind) as info:
            torch.jit.script(model)
        msg = str(info.value)
        assert "torch.compile" in msg and "torch.export" in msg
        assert "prunopt/" not in msg  # not a parser error pointing into prunopt's source
        assert isinstance(info.value, RuntimeError)


def test_plain_models_still_script():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    scripted = torch.jit.script(model.eval())
    x = torch.randn(1, 3, 6, 6)
    torch.testing.assert_close(scripted(x), model(x))
