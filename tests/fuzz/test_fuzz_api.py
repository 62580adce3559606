"""Fuzzing the public entry points: every name in the ``__all__`` of
:mod:`prunopt.ops`, :mod:`prunopt.optim`, :mod:`prunopt.nn` and
:mod:`prunopt.pruning` that can be called.

Each entry has a valid call (tiny models and tensors). A hypothesis draw
replaces one of its arguments with a hostile value (None, a string, a bool, a
NaN or infinite float, a negative or huge number, an integer beyond the float
range, an empty list, a tensor of the wrong dtype or shape); the call must then
either succeed or raise ValueError, TypeError or RuntimeError with a message
naming that argument, and an error must leave every tensor and module it was
given unchanged (parameters, buffers and the module tree are compared before
and after). The op wrappers must also agree with their references
(:mod:`prunopt.reference`) on every call they accept.

Budget: ``PRUNOPT_FUZZ_EXAMPLES`` examples per entry (default 25, fixed
seeds); ``PRUNOPT_FUZZ_EXAMPLES=5000 pytest tests/fuzz`` runs long with fresh
random examples (see tests/fuzz/test_fuzz_ops.py for the registered ops).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st

import prunopt.nn as pnn
import prunopt.ops as pops
import prunopt.optim as poptim
import prunopt.pruning as ppr
from prunopt.reference import (TensorHyper, fb_conv2d_reference, fb_reconstruct_reference,
                               prunadag_bracket_reference, prunadag_norms_reference, project_budget_reference,
                               project_budget_apply_reference, project_budget_bracket_reference,
                               prunadag_slice_reference, rgf_relu_reference, sparse_gate_reference,
                               topk_bracket_reference, topk_slice_reference, topk_threshold_reference,
                               two_temperature_sigmoid_reference)

from _fuzz import assert_clean_error, call, fuzz_settings, same_bits, tensor


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))


def _x():
    return torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(1))


def _batches():
    return [(_x(), torch.tensor([0, 3]))]


def _masker():
    return ppr.Masker(_model())


def _ttm_masks():
    m = pnn.wrap_two_temperature_masks(_model())
    return pnn.two_temperature_masks(m)


def _probmask_model():
    m = _model()
    pnn.apply_probmask(m)
    return m


def _sparse_bn_model():
    return pnn.convert_to_sparse_batchnorm(_model())


def _interspace_model():
    return pnn.to_interspace(_model())


@dataclass
class Entry:
    """A public callable, a factory of a valid call's keyword arguments, the
    names that an error about each argument may use (default: the argument's
    own name) and, where one exists, a reference that the result must match."""
    fn: Callable
    kwargs: Callable[[], Dict[str, object]]
    aliases: Dict[str, Sequence[str]] = field(default_factory=dict)
    check: Optional[Callable[[object, Dict[str, object]], None]] = None
    skip: Sequence[str] = ()  # arguments not fuzzed (callables, generators, process groups)
    counts: Sequence[str] = ()  # iteration counts: a huge one is long work, not an error


def _close(a, b, dtype=torch.float32, atol=1e-5):
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            _close(x, y, dtype, atol)
        return
    torch.testing.assert_close(a.double(), b.double(), atol=atol if dtype != torch.float64 else 1e-12, rtol=0.0,
                               equal_nan=True)


def _check_projection(out, kw):
    ref = project_budget_reference(kw["theta"], kw["budget"], kw.get("cost"))
    _close(out, ref)


def _as_list(x):
    return [x] if isinstance(x, torch.Tensor) else x


def _check_projection_bracket(out, kw):
    summary, kt, kc = project_budget_bracket_reference(_as_list(kw["theta"]), _as_list(kw["cost"]), kw["lo"],
                                                       kw["hi"])
    torch.testing.assert_close(out[0], summary, atol=1e-9, rtol=1e-12)
    assert torch.equal(out[1], kt) and torch.equal(out[2], kc)


def _check_projection_apply(out, kw):
    want = project_budget_apply_reference(_as_list(kw["theta"]), _as_list(kw["cost"]), kw["lam"])
    assert all(torch.equal(o, w) for o, w in zip(_as_list(out), want))


def _check_bracket(out, kw):
    values = [kw["values"]] if isinstance(kw["values"], torch.Tensor) else kw["values"]
    above, cands = topk_bracket_reference(values, kw["lo"], kw["hi"])
    assert torch.equal(out[0], above) and torch.equal(out[1], cands)


def _check_slice(out, kw):
    values = [kw["values"]] if isinstance(kw["values"], torch.Tensor) else kw["values"]
    want = topk_slice_reference(values, kw["share"], kw["buckets"], kw["cap"],
                                kw.get("sample", (1 << 15, 1 << 20, 128)))
    assert all(torch.equal(o, w) for o, w in zip(out, want))


def _check_prunadag_bracket(out, kw):
    hypers = [TensorHyper(lr=r[0], weight_decay=r[2], maximize=bool(r[4]), prune=bool(r[5]))
              for r in kw["hyper"].tolist()]
    summary, keys, m = prunadag_bracket_reference(kw["params"], kw["grads"], hypers, kw["lo"], kw["hi"])
    torch.testing.assert_close(out[0], summary, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[1], keys) and torch.equal(out[2], m)


def _check_prunadag_slice(out, kw):
    hypers = [TensorHyper(lr=r[0], weight_decay=r[2], maximize=bool(r[4]), prune=bool(r[5]))
              for r in kw["hyper"].tolist()]
    want = prunadag_slice_reference(kw["params"], kw["grads"], hypers, kw["share"], kw["buckets"], kw["cap"],
                                    kw.get("sample", (1 << 15, 1 << 20, 128)))
    for i in (0, 2, 3, 4, 5, 6):
        assert torch.equal(out[i], want[i]), i
    torch.testing.assert_close(out[1], want[1], atol=1e-6, rtol=1e-6)


def _check_norms(out, kw):
    hypers = [TensorHyper(lr=r[0], weight_decay=r[2], maximize=bool(r[4]), prune=bool(r[5]))
              for r in kw["hyper"].tolist()]
    torch.testing.assert_close(out, prunadag_norms_reference(kw["params"], kw["grads"], hypers, kw["tau"]),
                               atol=1e-6, rtol=1e-6)


ENTRIES: Dict[str, Entry] = {
    # ---- prunopt.ops (against their references)
    "ops.project_budget": Entry(pops.project_budget, lambda: dict(theta=tensor((7,), torch.float32, 1), budget=2.0,
                                                                  cost=None), check=_check_projection),
    "ops.project_budget_": Entry(pops.project_budget_, lambda: dict(theta=tensor((7,), torch.float32, 1), budget=2.0,
                                                                    cost=None)),
    "ops.project_budget_bracket": Entry(pops.project_budget_bracket, lambda: dict(
        theta=[tensor((7,), torch.float32, 1), tensor((3,), torch.float32, 2)], lo=0.25, hi=0.75, cost=None),
        check=lambda out, kw: _check_projection_bracket(out, kw)),
    "ops.project_budget_apply_": Entry(pops.project_budget_apply_, lambda: dict(
        out=[torch.zeros(7), torch.zeros(3)], theta=[tensor((7,), torch.float32, 1), tensor((3,), torch.float32, 2)],
        lam=0.25, cost=None), check=lambda out, kw: _check_projection_apply(out, kw),
        aliases={"out": ["out", "theta"], "theta": ["theta", "out"]}),  # (a list one of them does not match)
    "ops.topk_threshold": Entry(pops.topk_threshold, lambda: dict(values=[tensor((7,), torch.float32, 1)], k=3),
                                aliases={"values": ["values", "n="]},  # (empty values: "k must be in [1, n=0]")
                                check=lambda out, kw: _close(out, topk_threshold_reference(kw["values"], kw["k"]))),
    "ops.topk_bracket": Entry(pops.topk_bracket, lambda: dict(values=[tensor((7,), torch.float32, 1),
                                                              tensor((3,), torch.float32, 2)], lo=0.25, hi=1.5),
                              check=lambda out, kw: _check_bracket(out, kw)),
    "ops.topk_slice": Entry(pops.topk_slice, lambda: dict(values=[tensor((7,), torch.float32, 1),
                                                          tensor((3,), torch.float32, 2)], share=3, buckets=8, cap=4),
                            check=lambda out, kw: _check_slice(out, kw)),
    "ops.prunadag_norms": Entry(pops.prunadag_norms, lambda: dict(
        params=[tensor((5,), torch.float32, 1), tensor((2, 3), torch.float32, 2)],
        grads=[tensor((5,), torch.float32, 3), tensor((2, 3), torch.float32, 4)],
        hyper=torch.tensor([[0.1, 0.1, 0.0, 1e-10, 0.0, 1.0], [0.1, 0.1, 0.01, 1e-10, 1.0, 1.0]], dtype=torch.float64),
        tau=torch.tensor(0.5, dtype=torch.float64)), check=lambda out, kw: _check_norms(out, kw),
        aliases={"params": ["params", "grads"]}),  # (a params list that grads does not match: either is named)
    "ops.prunadag_bracket": Entry(pops.prunadag_bracket, lambda: dict(
        params=[tensor((5,), torch.float32, 1), tensor((2, 3), torch.float32, 2)],
        grads=[tensor((5,), torch.float32, 3), tensor((2, 3), torch.float32, 4)],
        hyper=torch.tensor([[0.1, 0.1, 0.0, 1e-10, 0.0, 1.0], [0.1, 0.1, 0.01, 1e-10, 1.0, 1.0]], dtype=torch.float64),
        lo=0.25, hi=1.5), check=lambda out, kw: _check_prunadag_bracket(out, kw),
        aliases={"params": ["params", "grads"]}),
    "ops.prunadag_slice": Entry(pops.prunadag_slice, lambda: dict(
        params=[tensor((5,), torch.float32, 1), tensor((2, 3), torch.float32, 2)],
        grads=[tensor((5,), torch.float32, 3), tensor((2, 3), torch.float32, 4)],
        hyper=torch.tensor([[0.1, 0.1, 0.0, 1e-10, 0.0, 1.0], [0.1, 0.1, 0.01, 1e-10, 1.0, 1.0]], dtype=torch.float64),
        share=3, buckets=8, cap=4), check=lambda out, kw: _check_prunadag_slice(out, kw),
        aliases={"params": ["params", "grads"]}),
    "ops.fb_reconstruct": Entry(pops.fb_reconstruct, lambda: dict(coefficients=tensor((3, 2, 4), torch.float32, 1),
                                                                  basis=tensor((4, 3, 3), torch.float32, 2),
                                                                  mask=None),
                                check=lambda out, kw: _close(out, fb_reconstruct_reference(**kw))),
    "ops.fb_reconstruct_backward": Entry(pops.fb_reconstruct_backward, lambda: dict(
        grad_h=tensor((3, 2, 3, 3), torch.float32, 3), coefficients=tensor((3, 2, 4), torch.float32, 1),
        basis=tensor((4, 3, 3), torch.float32, 2), mask=None, output_mask=(True, True))),
    "ops.fb_conv2d": Entry(pops.fb_conv2d, lambda: dict(
        input=tensor((1, 2, 6, 6), torch.float32, 4), coefficients=tensor((3, 2, 4), torch.float32, 1),
        basis=tensor((4, 3, 3), torch.float32, 2), mask=None, bias=None, stride=1, padding=1, dilation=1, groups=1),
        check=lambda out, kw: _close(out, fb_conv2d_reference(**kw), atol=1e-4)),
    "ops.fb_compress": Entry(pops.fb_compress, lambda: dict(coefficients=tensor((3, 2, 4), torch.float32, 1),
                                                            mask=(tensor((3, 2, 4), torch.float32, 5) > 0).float())),
    "ops.fb_conv2d_compressed": Entry(pops.fb_conv2d_compressed, lambda: dict(
        input=tensor((1, 2, 6, 6), torch.float32, 4), compressed=pops.fb_compress(tensor((3, 2, 4), torch.float32, 1)),
        basis=tensor((4, 3, 3), torch.float32, 2), bias=None, stride=1, padding=1, dilation=1, groups=1)),
    "ops.rgf_relu": Entry(pops.rgf_relu, lambda: dict(x=tensor((5,), torch.float32, 1), alpha=0.1),
                          check=lambda out, kw: _close(out, rgf_relu_reference(kw["x"], kw["alpha"]))),
    "ops.sparse_gate": Entry(pops.sparse_gate, lambda: dict(alpha=tensor((3, 4), torch.float32, 1),
                                                            beta=tensor((3,), torch.float32, 2), signed=True, rgf=True,
                                                            rgf_alpha=0.1, dim=-1),
                             check=lambda out, kw: _close(out, sparse_gate_reference(
                                 kw["alpha"].movedim(kw["dim"], -1), kw["beta"], kw["signed"]).movedim(-1, kw["dim"]))),
    "ops.two_temperature_sigmoid": Entry(pops.two_temperature_sigmoid, lambda: dict(
        w=tensor((5,), torch.float32, 1), t_l=10.0, t_s=None),
        check=lambda out, kw: _close(out, two_temperature_sigmoid_reference(
            kw["w"], kw["t_l"], kw["t_l"] / 100 if kw["t_s"] is None else kw["t_s"]))),
    "ops.FBCompressed": Entry(pops.FBCompressed, lambda: dict(
        crow_indices=torch.tensor([0, 1], dtype=torch.int32), col_indices=torch.tensor([0], dtype=torch.int32),
        values=torch.ones(1), shape=(1, 1, 1))),
    # ---- prunopt.optim (constructors; steps are fuzzed below)
    "optim.BudgetProjection": Entry(poptim.BudgetProjection, lambda: dict(params=[torch.rand(6)], density=0.5,
                                                                          cost=None)),
    "optim.PrunAdag": Entry(poptim.PrunAdag, lambda: dict(
        params=[nn.Parameter(torch.randn(5))], lr=0.01, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
        eps=1e-10, foreach=None, maximize=False, differentiable=False, fused=None, relevant=0.5, version=3,
        scope="global"), aliases={"params": ["params", "iterable", "parameter list"], "lr": ["lr", "learning rate"],
                                  "lr_decay": ["lr_decay", "lr_decay value"],
                                  "weight_decay": ["weight_decay", "weight_decay value"],
                                  "initial_accumulator_value": ["initial_accumulator_value", "initial_accumulator"],
                                  "eps": ["eps", "epsilon"]}),
    "optim.SFW": Entry(poptim.SFW, lambda: dict(params=[nn.Parameter(torch.randn(5))], lr=None, rescale="diameter",
                                                momentum=0.0, radius=10.0, relevant=0.5, maximize=False),
                       aliases={"params": ["params", "iterable", "parameter list"], "lr": ["lr", "learning rate"]}),
    # ---- prunopt.nn
    "nn.ProbMask": Entry(pnn.ProbMask, lambda: dict(shape=(3, 4), init=1.0, tau=1.0, hard=False)),
    "nn.ProbMaskInput": Entry(pnn.ProbMaskInput, lambda: dict(shape=(3, 4), init=0.5, tau=1.0, hard=True)),
    "nn.apply_probmask": Entry(pnn.apply_probmask, lambda: dict(model=_model(), init=1.0, tau=1.0, hard=False)),
    "nn.finalize_probmask": Entry(pnn.finalize_probmask, lambda: dict(model=_probmask_model(), density=0.5)),
    "nn.gumbel_sigmoid": Entry(pnn.gumbel_sigmoid, lambda: dict(theta=torch.rand(5), tau=1.0, hard=False,
                                                                generator=torch.Generator().manual_seed(0))),
    "nn.probmask_density": Entry(pnn.probmask_density, lambda: dict(model=_probmask_model())),
    "nn.probmask_modules": Entry(pnn.probmask_modules, lambda: dict(model=_probmask_model())),
    "nn.probmask_scores": Entry(pnn.probmask_scores, lambda: dict(model=_probmask_model())),
    "nn.remove_probmask": Entry(pnn.remove_probmask, lambda: dict(model=_probmask_model())),
    "nn.set_temperature": Entry(pnn.set_temperature, lambda: dict(model=_probmask_model(), tau=0.5)),
    "nn.FilterBasis": Entry(pnn.FilterBasis, lambda: dict(kernel_size=3, size=None, init="standard")),
    "nn.FBConv2d": Entry(pnn.FBConv2d, lambda: dict(in_channels=2, out_channels=3, kernel_size=3, stride=1,
                                                    padding=0, dilation=1, groups=1, bias=True, padding_mode="zeros")),
    "nn.to_interspace": Entry(pnn.to_interspace, lambda: dict(model=_model(), sharing="fine", init="standard",
                                                              size=None)),
    "nn.interspace_param_groups": Entry(pnn.interspace_param_groups, lambda: dict(model=_interspace_model(),
                                                                                  weight_decay=0.1)),
    "nn.pruning_rates": Entry(pnn.pruning_rates, lambda: dict(model=_interspace_model())),
    "nn.interspace_flops": Entry(pnn.interspace_flops, lambda: dict(model=_interspace_model(),
                                                                    example_input=_x()),
                                 aliases={"example_input": ["example_input", "input"]}),  # (the layers' own check)
    "nn.sparse_storage": Entry(pnn.sparse_storage, lambda: dict(numel=100, nonzero=10, value_bits=32, index_bits=32,
                                                                rows=1)),
    "nn.interspace_report": Entry(pnn.interspace_report, lambda: dict(model=_interspace_model(),
                                                                      example_input=_x()),
                                  aliases={"example_input": ["example_input", "input"]}),
    "nn.SparseGate": Entry(pnn.SparseGate, lambda: dict(num_gates=4, signed=True, rgf=True, rgf_alpha=0.1)),
    "nn.SparseBatchNorm2d": Entry(pnn.SparseBatchNorm2d, lambda: dict(num_features=3, eps=1e-5, momentum=0.1,
                                                                      track_running_stats=True, signed=True, rgf=True,
                                                                      rgf_alpha=0.1)),
    "nn.SyncSparseBatchNorm2d": Entry(pnn.SyncSparseBatchNorm2d, lambda: dict(
        num_features=3, eps=1e-5, momentum=0.1, track_running_stats=True, signed=True, rgf=True, rgf_alpha=0.1)),
    "nn.convert_to_sparse_batchnorm": Entry(pnn.convert_to_sparse_batchnorm, lambda: dict(
        model=_model(), preserve=True, signed=True, rgf=True, rgf_alpha=0.1)),
    "nn.convert_sync_batchnorm": Entry(pnn.convert_sync_batchnorm, lambda: dict(module=_sparse_bn_model()),
                                       skip=("process_group",)),
    "nn.sparse_gates": Entry(pnn.sparse_gates, lambda: dict(model=_sparse_bn_model())),
    "nn.l1_regularizer": Entry(pnn.l1_regularizer, lambda: dict(gates=[torch.randn(4)])),
    "nn.group_l21_regularizer": Entry(pnn.group_l21_regularizer, lambda: dict(gates=[torch.randn(4)], group_size=2)),
    "nn.lp_regularizer": Entry(pnn.lp_regularizer, lambda: dict(gates=[torch.randn(4)], p=0.5)),
    "nn.cubic_strength": Entry(pnn.cubic_strength, lambda: dict(t=3.0, lam_i=0.0, lam_f=1.0, t0=1.0, n=10.0)),
    "nn.remove_channels": Entry(pnn.remove_channels, lambda: dict(model=_sparse_bn_model().eval(),
                                                                  example_input=_x(), atol=1e-5)),
    "nn.gate_density": Entry(pnn.gate_density, lambda: dict(model=_sparse_bn_model())),
    "nn.TwoTemperatureMask": Entry(pnn.TwoTemperatureMask, lambda: dict(layer=nn.Linear(3, 4), t_l=1000.0, t_s=None,
                                                                        init_scale=0.01)),
    "nn.wrap_two_temperature_masks": Entry(pnn.wrap_two_temperature_masks, lambda: dict(
        model=_model(), t_l=1000.0, t_s=None, init_scale=0.01)),
    "nn.two_temperature_masks": Entry(pnn.two_temperature_masks, lambda: dict(
        model=pnn.wrap_two_temperature_masks(_model()))),
    "nn.mask_regularizer": Entry(pnn.mask_regularizer, lambda: dict(masks=_ttm_masks(), gamma=0.1)),
    "nn.mask_density": Entry(pnn.mask_density, lambda: dict(masks=_ttm_masks())),
    "nn.stop_at_sparsity": Entry(pnn.stop_at_sparsity, lambda: dict(masks=_ttm_masks(), target_sparsity=0.5)),
    "nn.layer_densities": Entry(pnn.layer_densities, lambda: dict(masks=_ttm_masks())),
    "nn.reshuffle_masks": Entry(pnn.reshuffle_masks, lambda: dict(masks=_ttm_masks(), densities=None,
                                                                  generator=torch.Generator().manual_seed(0))),
    "nn.extract_architecture": Entry(pnn.extract_architecture, lambda: dict(masks=_ttm_masks())),
    "nn.apply_architecture": Entry(pnn.apply_architecture, lambda: _architecture_kwargs()),
    "nn.SparseEdges": Entry(pnn.SparseEdges, lambda: dict(in_nodes=3, out_nodes=4, bias=False, rgf=True,
                                                          rgf_alpha=0.1)),
    "nn.SparseAdjacency": Entry(pnn.SparseAdjacency, lambda: dict(num_nodes=4, iters=5, rgf=True, rgf_alpha=0.1,
                                                                  mask=None)),
    "nn.balanced_normalize": Entry(pnn.balanced_normalize, lambda: dict(A=torch.rand(4, 4), iters=5,
                                                                        allow_empty=False), counts=("iters",)),
    "nn.adjacency_regularizer": Entry(pnn.adjacency_regularizer, lambda: dict(A=torch.rand(4, 4), p=0.5)),
    # ---- prunopt.pruning
    "pruning.Masker": Entry(ppr.Masker, lambda: dict(model=_model(), optimizers=None, include=None, exclude=None,
                                                     zero_state_every_step=True), skip=("process_group",)),
    "pruning.WeightMask": Entry(ppr.WeightMask, lambda: dict(mask=torch.ones(3, 4))),
    "pruning.prunable_tensors": Entry(ppr.prunable_tensors, lambda: dict(model=_model(), include=None, exclude=None)),
    "pruning.remove_masks": Entry(ppr.remove_masks, lambda: dict(model=_masker().model, to_conv2d=False)),
    "pruning.check_sparsity": Entry(ppr.check_sparsity, lambda: dict(p=0.5, name="sparsity"), skip=("name",)),
    "pruning.erk_counts": Entry(ppr.erk_counts, lambda: dict(shapes={"a": (4, 3), "b": (5, 2, 3, 3)}, density=0.3,
                                                             dense=None, numels=None)),
    "pruning.erk_densities": Entry(ppr.erk_densities, lambda: dict(shapes={"a": (4, 3), "b": (5, 2, 3, 3)},
                                                                   density=0.3, dense=None, numels=None)),
    "pruning.global_masks": Entry(ppr.global_masks, lambda: dict(scores={"a": torch.rand(4, 3), "b": torch.rand(5)},
                                                                 sparsity=0.5)),
    "pruning.kept_count": Entry(ppr.kept_count, lambda: dict(sparsity=0.5, d=10)),
    "pruning.layerwise_masks": Entry(ppr.layerwise_masks, lambda: dict(
        scores={"a": torch.rand(4, 3), "b": torch.rand(5)}, sparsity=0.5)),
    "pruning.magnitude_scores": Entry(ppr.magnitude_scores, lambda: dict(target=_masker())),
    "pruning.random_scores": Entry(ppr.random_scores, lambda: dict(target=_masker(),
                                                                   generator=torch.Generator().manual_seed(0))),
    "pruning.snip_scores": Entry(ppr.snip_scores, lambda: dict(target=_masker(), batches=_batches()),
                                 skip=("loss_fn",)),
    "pruning.grasp_scores": Entry(ppr.grasp_scores, lambda: dict(target=_masker(), batches=_batches(),
                                                                 temperature=1.0), skip=("loss_fn",)),
    "pruning.synflow_scores": Entry(ppr.synflow_scores, lambda: dict(target=_masker(), example_input=_x())),
    "pruning.DynamicSparseTraining": Entry(ppr.DynamicSparseTraining, lambda: dict(
        masker=_masker(), sparsity=0.5, total_steps=10, mode="set", update_interval=None, p_init=0.5, p_min=0.005,
        generator=torch.Generator().manual_seed(0))),
    "pruning.FineTuning": Entry(ppr.FineTuning, lambda: dict(masker=_masker(), sparsity=0.5, scope="global")),
    "pruning.GradualMagnitudePruning": Entry(ppr.GradualMagnitudePruning, lambda: dict(
        masker=_masker(), sparsity=0.5, t0=0, t1=10, interval=2, scope="global")),
    "pruning.LotteryTicket": Entry(ppr.LotteryTicket, lambda: _lottery_kwargs(), skip=("scheduler",)),
    "pruning.PruningAtInit": Entry(ppr.PruningAtInit, lambda: dict(masker=_masker(), score="random", sparsity=0.5,
                                                                   synflow_rounds=3,
                                                                   generator=torch.Generator().manual_seed(0)),
                                   skip=("loss_fn",)),
    "pruning.PruningMethod": Entry(ppr.PruningMethod, lambda: dict(masker=_masker())),
    "pruning.cosine_drop_fraction": Entry(ppr.cosine_drop_fraction, lambda: dict(t=3, total_steps=10, p_init=0.5,
                                                                                 p_min=0.005)),
    "pruning.gmp_sparsity": Entry(ppr.gmp_sparsity, lambda: dict(t=3, sparsity=0.5, t0=0, t1=10)),
    "pruning.lottery_ticket_trainings": Entry(ppr.lottery_ticket_trainings, lambda: dict(sparsity=0.5, rate=0.2)),
    "pruning.magnitude_prune": Entry(ppr.magnitude_prune, lambda: dict(masker=_masker(), sparsity=0.5,
                                                                       scope="global", keep_pruned=True)),
    "pruning.synflow_prune": Entry(ppr.synflow_prune, lambda: dict(masker=_masker(), sparsity=0.5,
                                                                   example_input=_x(), rounds=3), counts=("rounds",)),
    "pruning.CSRTensor": Entry(ppr.CSRTensor, lambda: dict(shape=torch.Size([1, 2]), values=torch.ones(1),
                                                           crow_indices=torch.tensor([0, 1]),
                                                           col_indices=torch.tensor([1]))),
    "pruning.entropy_bound": Entry(ppr.entropy_bound, lambda: dict(p=0.5, value_bits=32)),
    "pruning.export_csr": Entry(ppr.export_csr, lambda: dict(target=_masker())),
    "pruning.from_csr": Entry(ppr.from_csr, lambda: dict(c=ppr.to_csr(torch.tensor([[0.0, 1.0], [2.0, 0.0]])))),
    "pruning.mask_entropy_bits": Entry(ppr.mask_entropy_bits, lambda: dict(p=0.5)),
    "pruning.pruning_rates": Entry(ppr.pruning_rates, lambda: dict(target=_masker())),
    "pruning.to_csr": Entry(ppr.to_csr, lambda: dict(weight=torch.tensor([[0.0, 1.0], [2.0, 0.0]]))),
    "pruning.magnitude_masks": Entry(ppr.magnitude_masks, lambda: dict(params=[torch.randn(5)], sigma=0.5,
                                                                       delta=None)),
    "pruning.magnitude_prune_": Entry(ppr.magnitude_prune_, lambda: dict(params=[torch.randn(5)], sigma=0.5,
                                                                         delta=None)),
    "pruning.rho_omega": Entry(ppr.rho_omega, lambda: dict(x=[torch.randn(5)], x_pruned=[torch.randn(5)]),
                               skip=("f",)),
    "pruning.sparsity": Entry(ppr.sparsity, lambda: dict(params=[torch.randn(5)])),
    "pruning.from_ao_sparsifier": Entry(ppr.from_ao_sparsifier, lambda: _ao_kwargs()),
    "pruning.from_torch_prune": Entry(ppr.from_torch_prune, lambda: _torch_prune_kwargs()),
    "pruning.to_torch_prune": Entry(ppr.to_torch_prune, lambda: dict(masker=_masker())),
}

#: public names that are not callables with arguments of their own
NOT_CALLED = {"ops.TensorOrList", "ops.PRUNADAG_DEVICES", "pruning.SCORES", "pruning.PrunableTensor",
              "pruning.is_fb_conv", "pruning.is_hf_conv1d"}


def _architecture_kwargs():
    masks = _ttm_masks()
    return dict(masks=masks, architecture=pnn.extract_architecture(masks))


def _lottery_kwargs():
    masker = _masker()
    return dict(masker=masker, optimizer=torch.optim.SGD(masker.model.parameters(), lr=0.1), sparsity=0.5, t0=0,
                rate=0.2, dense=None)


def _ao_kwargs():
    from torch.ao.pruning import WeightNormSparsifier

    model = _model()
    sp = WeightNormSparsifier(sparsity_level=0.5)
    sp.prepare(model, [{"tensor_fqn": "4.weight"}])
    sp.step()
    return dict(model=model, optimizers=None, include=None, exclude=None)


def _torch_prune_kwargs():
    import torch.nn.utils.prune as tprune

    model = _model()
    tprune.l1_unstructured(model[4], "weight", amount=0.5)
    return dict(model=model, optimizers=None, include=None, exclude=None)


# (the exact call each entry makes: rho_omega takes a function first)
CALL_WITH = {"pruning.rho_omega": lambda kw: ppr.rho_omega(lambda xs: sum(x.sum() for x in xs), **kw)}

HOSTILE = [None, "x", True, math.nan, math.inf, -math.inf, -1, 0, -1.5, 2.5, 10**400, 1e300, [], (), object(),
           torch.tensor([1, 2]), torch.tensor(math.nan), torch.zeros(0)]


def _huge(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return abs(v) > 2**63 if isinstance(v, int) else math.isfinite(v) and abs(v) > 2**63


def _all_public():
    names = []
    for prefix, mod in (("ops", pops), ("optim", poptim), ("nn", pnn), ("pruning", ppr)):
        names += [f"{prefix}.{n}" for n in mod.__all__]
    return names


def test_every_public_entry_is_fuzzed():
    missing = [n for n in _all_public() if n not in ENTRIES and n not in NOT_CALLED]
    assert not missing, f"public names without a fuzz entry: {missing}"


def _state(kwargs) -> List[tuple]:
    """What an error must leave unchanged: every tensor given, and for every
    module (and optimizer, masker) its tree and its parameters and buffers."""
    out = []

    def visit(o, path, depth=0):
        if depth > 3:
            return
        if isinstance(o, torch.Tensor):
            out.append((path, "t", o, o.detach().clone()))
        elif isinstance(o, nn.Module):
            out.append((path, "m", o, repr(o)))
            for k, v in o.state_dict(keep_vars=True).items():
                out.append((f"{path}.{k}", "t", v, v.detach().clone()))
        elif isinstance(o, torch.optim.Optimizer):
            for i, g in enumerate(o.param_groups):
                for j, p in enumerate(g["params"]):
                    out.append((f"{path}.group{i}.{j}", "t", p, p.detach().clone()))
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                visit(v, f"{path}[{i}]", depth + 1)
        elif isinstance(o, dict):
            for k, v in o.items():
                visit(v, f"{path}[{k!r}]", depth + 1)
        elif hasattr(o, "model") and isinstance(getattr(o, "model"), nn.Module):  # Masker
            visit(o.model, f"{path}.model", depth + 1)
    for k, v in kwargs.items():
        visit(v, k)
    return out


def _assert_state_unchanged(state, what):
    for path, kind, obj, before in state:
        if kind == "t":
            assert same_bits(obj, before), f"{what}: {path} was written before the error"
        else:
            assert repr(obj) == before, f"{what}: the module tree of {path} changed before the error"


def _invoke(name, kwargs):
    fn = CALL_WITH.get(name)
    return call(fn, kwargs) if fn else call(ENTRIES[name].fn, **kwargs)


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_the_valid_call_succeeds(name):
    entry = ENTRIES[name]
    kwargs = entry.kwargs()
    out, exc = _invoke(name, kwargs)
    assert exc is None, f"{name}: the valid call raised {type(exc).__name__}: {exc}"
    if entry.check is not None:
        entry.check(out, entry.kwargs())


@pytest.mark.parametrize("name", sorted(ENTRIES))
@fuzz_settings
@given(data=st.data())
def test_hostile_arguments_fail_cleanly(name, data):
    entry = ENTRIES[name]
    kwargs = entry.kwargs()
    params = [k for k in kwargs if k not in entry.skip]
    arg = data.draw(st.sampled_from(params), label="argument")
    value = data.draw(st.sampled_from([v for v in HOSTILE if not (arg in entry.counts and _huge(v))]), label="value")
    if isinstance(value, torch.Tensor):
        value = value.clone()
    kwargs[arg] = value
    state = _state(kwargs)
    out, exc = _invoke(name, kwargs)
    what = f"{name}({arg}={value!r})"
    if exc is None:
        if entry.check is not None:  # accepted: then it must be what the reference computes
            ref_kwargs = dict(kwargs)
            entry.check(out, ref_kwargs)
        return
    assert_clean_error(exc, list(entry.aliases.get(arg, [arg])), what)
    _assert_state_unchanged(state, what)
