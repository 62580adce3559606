"""``OptimizerInfo`` entries for PrunAdag and SFW, in the form of PyTorch's
optimizer test database (``torch.testing._internal.common_optimizers``), so
that the contract checks of ``tests/optim/test_optim_contract.py`` (our own
versions of PyTorch's ``TestOptimRenewed`` checks) run over every
configuration. As in PyTorch, ``optim_inputs_func`` returns only
algorithm-specific and "global-friendly" kwargs; the implementation flags
(foreach, fused) are added by the tests (``all_inputs``)."""
from __future__ import annotations

from copy import deepcopy

import torch
from torch.nn import Parameter
from torch.optim.lr_scheduler import ExponentialLR, OneCycleLR, ReduceLROnPlateau, StepLR
from torch.testing._internal.common_optimizers import (ErrorOptimizerInput, OptimizerErrorEnum, OptimizerInfo,
                                                       OptimizerInput, get_error_inputs_for_all_optims)

import prunopt
from prunopt.ops import PRUNADAG_DEVICES
from prunopt.optim import SFW, PrunAdag


def optim_inputs_prunadag(device=None, dtype=None):
    """Versions, scopes, relevant (float, int, 1.0 = Adagrad), weight decay,
    maximize, lr_decay, initial accumulator, tensor lr and the paper's settings.
    The test parameters have >= 2 elements, so an int ``relevant=2`` is valid."""
    return [
        OptimizerInput(params=None, kwargs={}, desc="default"),
        OptimizerInput(params=None, kwargs={"relevant": 1.0}, desc="relevant=1.0 (Adagrad)"),
        OptimizerInput(params=None, kwargs={"relevant": 0.3, "version": 1}, desc="version 1"),
        OptimizerInput(params=None, kwargs={"relevant": 0.3, "version": 2}, desc="version 2"),
        OptimizerInput(params=None, kwargs={"relevant": 0.3, "version": 4, "lr": 0.05}, desc="version 4"),
        OptimizerInput(params=None, kwargs={"relevant": 0.3, "version": "relevant_only"}, desc="relevant only"),
        OptimizerInput(params=None, kwargs={"relevant": 2}, desc="int relevant"),
        OptimizerInput(params=None, kwargs={"relevant": 0.5, "scope": "tensor"}, desc="tensor scope"),
        OptimizerInput(params=None, kwargs={"relevant": 0.5, "scope": "group"}, desc="group scope"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.1}, desc="nonzero weight_decay"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.1, "maximize": True}, desc="maximize, weight_decay"),
        OptimizerInput(params=None, kwargs={"maximize": True, "relevant": 0.5}, desc="maximize"),
        OptimizerInput(params=None, kwargs={"lr": 0.1, "lr_decay": 0.5, "weight_decay": 0.1}, desc="lr_decay"),
        OptimizerInput(params=None, kwargs={"initial_accumulator_value": 0.1, "weight_decay": 0.1},
                       desc="initial_accumulator_value"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.001)}, desc="Tensor lr"),
        OptimizerInput(params=None, kwargs={"lr": 1.0, "eps": 0.0, "initial_accumulator_value": 0.01},
                       desc="the paper's settings"),
    ]


def optim_error_inputs_prunadag(device, dtype):
    sample = Parameter(torch.randn(1, 1, device=device, dtype=dtype))
    inputs = get_error_inputs_for_all_optims(device, dtype)
    ctor = OptimizerErrorEnum.CONSTRUCTION_ERROR
    step = OptimizerErrorEnum.STEP_ERROR

    def err(params, kwargs, desc, error_type, regex, on=ctor):
        return ErrorOptimizerInput(OptimizerInput(params=params, kwargs=kwargs, desc=desc), error_on=on,
                                   error_type=error_type, error_regex=regex)

    complex_param = torch.randn(2, 3, dtype=torch.complex64, requires_grad=True)
    complex_param.grad = torch.randn_like(complex_param)
    expanded = torch.zeros(1, device=device, dtype=dtype).expand(4).requires_grad_()
    expanded.grad = torch.ones(4, device=device, dtype=dtype)
    inputs += [
        err([sample], dict(lr=1e-2, lr_decay=-0.5), "lr_decay must be >= 0", ValueError, "Invalid lr_decay value: -0.5"),
        err([sample], dict(lr=-1.0), "lr must be >= 0", ValueError, "Invalid learning rate: -1.0"),
        err([sample], dict(eps=-1e-8), "eps must be >= 0", ValueError, "Invalid epsilon value"),
        err([sample], dict(weight_decay=-0.1), "weight_decay must be >= 0", ValueError, "Invalid weight_decay value"),
        err([sample], dict(initial_accumulator_value=-1.0), "initial_accumulator_value must be >= 0", ValueError,
            "Invalid initial_accumulator_value value"),
        err([sample], dict(foreach=True, fused=True), "`fused` and `foreach` cannot be `True` together",
            RuntimeError, "`fused` and `foreach` cannot be `True` together"),
        err([sample], dict(differentiable=True), "differentiable is not supported", ValueError, "differentiable"),
        err([sample], dict(relevant=0), "relevant must be >= 1", ValueError, "relevant"),
        err([sample], dict(relevant=1.5), "relevant must be in (0, 1]", ValueError, "relevant"),
        err([sample], dict(relevant=5), "int relevant > n", ValueError, "relevant"),
        err([sample], dict(version=5), "unknown version", ValueError, "version"),
        err([sample], dict(scope="layer"), "unknown scope", ValueError, "scope"),
        err([sample], dict(maximize=None), "maximize must be a bool", TypeError, "maximize"),
        err([{"params": [sample], "relevant": 0.5}, {"params": [Parameter(torch.randn(2))]}], {},
            "global scope: relevant must agree across groups", ValueError, "relevant must be the same"),
        err([complex_param], {}, "complex not supported", TypeError, "complex", on=step),
        err([expanded], {}, "an expanded (stride-0) parameter cannot be updated in place", RuntimeError,
            "single memory location", on=step),
    ]
    return inputs


def optim_inputs_sfw(device=None, dtype=None):
    """Zimmer et al.'s rescaling options, the prunAdag paper's FW1/FW2,
    momentum, maximize, another radius and T, and a tensor lr."""
    return [
        OptimizerInput(params=None, kwargs={}, desc="default (diameter rescaling)"),
        OptimizerInput(params=None, kwargs={"lr": 0.05, "rescale": "gradient"}, desc="gradient rescaling"),
        OptimizerInput(params=None, kwargs={"lr": 0.05, "rescale": None}, desc="no rescaling"),
        OptimizerInput(params=None, kwargs={"lr": 1.0, "rescale": "fw1"}, desc="FW1"),
        OptimizerInput(params=None, kwargs={"lr": 0.05, "rescale": "fw2"}, desc="FW2"),
        OptimizerInput(params=None, kwargs={"momentum": 0.9, "rescale": "gradient", "lr": 0.05}, desc="momentum"),
        OptimizerInput(params=None, kwargs={"maximize": True}, desc="maximize"),
        OptimizerInput(params=None, kwargs={"radius": 5.0, "relevant": 0.5}, desc="radius and relevant"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.2)}, desc="Tensor lr"),
    ]


def optim_error_inputs_sfw(device, dtype):
    sample = Parameter(torch.randn(1, 1, device=device, dtype=dtype))
    inputs = get_error_inputs_for_all_optims(device, dtype)
    ctor, step = OptimizerErrorEnum.CONSTRUCTION_ERROR, OptimizerErrorEnum.STEP_ERROR

    def err(params, kwargs, desc, error_type, regex, on=ctor):
        return ErrorOptimizerInput(OptimizerInput(params=params, kwargs=kwargs, desc=desc), error_on=on,
                                   error_type=error_type, error_regex=regex)

    nan_grad = Parameter(torch.randn(3, device=device, dtype=dtype))
    nan_grad.grad = torch.tensor([1.0, float("nan"), 0.0], device=device, dtype=dtype)
    expanded = torch.zeros(1, device=device, dtype=dtype).expand(4).requires_grad_()
    expanded.grad = torch.ones(4, device=device, dtype=dtype)
    inputs += [
        err([sample], dict(lr=-0.1), "lr must be >= 0", ValueError, "Invalid learning rate: -0.1"),
        err([sample], dict(rescale="fast"), "unknown rescale", ValueError, "rescale"),
        err([sample], dict(momentum=1.0), "momentum must be < 1", ValueError, "momentum"),
        err([sample], dict(radius=0.0), "radius must be > 0", ValueError, "radius"),
        err([sample], dict(relevant=0), "relevant must be >= 1", ValueError, "relevant"),
        err([sample], dict(beta=0.1), "beta needs step_rule='fw2'", ValueError, "beta"),
        err([sample], dict(step_rule="fw2", rescale="gradient"), "step_rule and rescale together", ValueError,
            "not both"),
        err([{"params": [sample], "radius": 2.0}, {"params": [Parameter(torch.randn(2))]}], {},
            "radius must agree across groups", ValueError, "radius must be the same"),
        err([nan_grad], {}, "non-finite gradient", ValueError, "non-finite", on=step),
        err([expanded], {}, "an expanded (stride-0) parameter", RuntimeError, "single memory location", on=step),
    ]
    return inputs


_fused_devices = tuple(sorted(PRUNADAG_DEVICES)) if prunopt.extension_available() else ()

prunadag_info = OptimizerInfo(
    PrunAdag,
    optim_inputs_func=optim_inputs_prunadag,
    optim_error_inputs_func=optim_error_inputs_prunadag,
    scheduler_inputs=(
        [lambda opt: StepLR(opt, gamma=0.9, step_size=10)],
        [lambda opt: ReduceLROnPlateau(opt)],
        [lambda opt: OneCycleLR(opt, max_lr=0.05, total_steps=30, cycle_momentum=False)],
    ),
    supported_impls=("foreach", "fused") if _fused_devices else ("foreach",),
    not_og_supported_flags=("foreach", "fused", "maximize", "differentiable"),
    supports_fused_on=_fused_devices,
    supports_complex=False,
)

sfw_info = OptimizerInfo(
    SFW,
    optim_inputs_func=optim_inputs_sfw,
    optim_error_inputs_func=optim_error_inputs_sfw,
    scheduler_inputs=(
        [lambda opt: StepLR(opt, gamma=0.9, step_size=10)],
        [lambda opt: ReduceLROnPlateau(opt)],
        [lambda opt: ExponentialLR(opt, gamma=0.95), lambda opt: StepLR(opt, gamma=0.5, step_size=5)],
    ),
    supported_impls=(),
    not_og_supported_flags=("maximize",),
    supports_complex=False,
)

optim_db = [prunadag_info, sfw_info]


def impl_kwargs(optim_info, device="cpu", skip=()):
    """The implementation flags a test runs each input with: the forloop (all
    flags False) and each supported flag on its own, as PyTorch's
    ``_get_optim_inputs_including_global_cliquey_kwargs`` does."""
    impls = [f for f in optim_info.supported_impls if f not in skip
             and (f != "fused" or torch.device(device).type in optim_info.supports_fused_on)]
    base = {f: False for f in impls}
    return [("forloop", base)] + [(f, {**base, f: True}) for f in impls]


def all_inputs(optim_info, device="cpu", skip=()):
    """(id, kwargs) for every input and implementation, fresh copies."""
    out = []
    for inp in optim_info.optim_inputs_func(device=device):
        for impl, flags in impl_kwargs(optim_info, device, skip):
            out.append((f"{inp.desc} & {impl}", {**deepcopy(inp.kwargs), **flags}))
    return out
