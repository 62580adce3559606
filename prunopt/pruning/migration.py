"""Moving masks between PyTorch's own pruning utilities and a :class:`Masker`.

PyTorch has two mask conventions of its own:

* ``torch.nn.utils.prune``: the pruned tensor ``weight`` becomes a plain
  attribute recomputed before every forward by a pre-hook (a
  ``BasePruningMethod``, or a ``PruningContainer`` after several calls) from the
  Parameter ``weight_orig`` and the buffer ``weight_mask``:
  ``weight = weight_orig * weight_mask``.
* ``torch.ao.pruning`` sparsifiers (``WeightNormSparsifier``, ...): after
  ``sparsifier.prepare(model, config)`` the weight carries a
  ``torch.nn.utils.parametrize`` parametrization ``FakeSparsity`` whose buffer
  ``mask`` multiplies it.

A :class:`~prunopt.pruning.Masker` uses the second convention with its own
parametrization (:class:`~prunopt.pruning.WeightMask`), and keeps the
optimizer state masked as well. :func:`from_torch_prune` and
:func:`from_ao_sparsifier` take the masks over (the computed weight
``w * mask`` is baked into the same ``Parameter`` object, so optimizers built
before stay valid); :func:`to_torch_prune` hands a masker's masks back to
``torch.nn.utils.prune.custom_from_mask``.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils import prune as torch_prune

from prunopt.pruning.masks import Masker, check_optimizers, prunable_tensors

__all__ = ["from_torch_prune", "from_ao_sparsifier", "to_torch_prune"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _pruning_hooks(model: nn.Module) -> List[Tuple[str, nn.Module, str]]:
    """``(module name, module, tensor name)`` of every ``torch.nn.utils.prune``
    pre-hook in ``model`` (one per pruned tensor: repeated pruning of a tensor
    is one ``PruningContainer``)."""
    found = []
    for mname, m in model.named_modules():
        for hook in m._forward_pre_hooks.values():
            if isinstance(hook, torch_prune.BasePruningMethod):
                found.append((mname, m, hook._tensor_name))
    return found


def _fake_sparsity_type():
    try:
        from torch.ao.pruning import FakeSparsity
    except ImportError:  # pragma: no cover - torch without torch.ao.pruning
        return None
    return FakeSparsity


def _ao_masks(model: nn.Module) -> List[Tuple[str, nn.Module, str, Tensor]]:
    """``(module name, module, tensor name, mask)`` of every ``FakeSparsity``
    parametrization in ``model``; any other parametrization beside it on the
    same tensor is a ``ValueError`` naming the tensor."""
    fake = _fake_sparsity_type()
    found = []
    if fake is None:
        return found
    for mname, m in model.named_modules():
        if not parametrize.is_parametrized(m):
            continue
        for tname, plist in m.parametrizations.items():
            kinds = [type(p) for p in plist]
            if fake not in kinds:
                continue
            if kinds != [fake]:
                raise ValueError(
                    f"{_join(mname, tname)} carries the parametrizations {[k.__name__ for k in kinds]}; only a single "
                    "FakeSparsity can be taken over by a Masker: remove the others first"
                )
            found.append((mname, m, tname, plist[0].mask))
    return found


def _plan(model: nn.Module, found, include, exclude, source: str):
    """The Masker tensor name of each found mask (``None``: skipped, because
    ``include``/``exclude`` leave the layer out). A masked tensor that a
    Masker cannot hold is a ``ValueError`` naming it."""
    selected = prunable_tensors(model, include, exclude)
    if not selected:  # (the Masker would refuse it after the masks were taken over)
        raise ValueError("include/exclude leave no prunable tensor of the model" if include is not None
                         or exclude is not None else "model has no prunable tensors (Conv2d/Linear weights or "
                         "FBConv2d coefficients)")
    every = prunable_tensors(model)
    plan = []
    for mname, m, tname, *rest in found:
        key = _join(mname, tname)
        if key not in every:
            raise ValueError(
                f"{key} is masked by {source}, but a Masker masks only the weight of Conv2d, Linear and "
                "transformers' Conv1D layers and the coefficients of FBConv2d layers: remove that mask first "
                f"(or exclude the layer {mname!r} from the masker and leave it to {source})"
            )
        plan.append((key if key in selected else None, mname, m, tname, *rest))
    return plan


def _masker_with(model, optimizers, include, exclude, masks) -> Masker:
    masker = Masker(model, optimizers, include=include, exclude=exclude)
    if masks:
        current = masker.masks()
        masker.set_masks(OrderedDict((k, v.to(current[k].device).bool() & current[k]) for k, v in masks.items()))
    return masker


def _has_prune_hook(m: nn.Module, tname: str) -> bool:
    return any(isinstance(h, torch_prune.BasePruningMethod) and h._tensor_name == tname
               for h in m._forward_pre_hooks.values())


def _load_torch_prune_checkpoint(model: nn.Module, state_dict) -> None:
    """Loads a state dict saved from a ``torch.nn.utils.prune`` model (keys
    ``<t>_orig`` and ``<t>_mask`` for each pruned tensor ``<t>``) into
    ``model``: each such tensor first gets ``torch.nn.utils.prune.identity``
    (unless ``model`` is pruned there already), so that the keys match. On any
    error the hooks it added are removed and ``model`` is as it was."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping (a model's state dict), got {type(state_dict).__name__}")
    pruned = sorted(k[: -len("_mask")] for k in state_dict
                    if isinstance(k, str) and k.endswith("_mask") and k[: -len("_mask")] + "_orig" in state_dict)
    todo = []
    every = prunable_tensors(model)
    for full in pruned:
        mname, _, tname = full.rpartition(".")
        try:
            m = model.get_submodule(mname)
        except AttributeError:
            raise ValueError(f"state_dict holds {full}_orig and {full}_mask, but the model has no module "
                             f"{mname!r}") from None
        if not _has_prune_hook(m, tname):
            if not isinstance(m._parameters.get(tname), nn.Parameter):
                raise ValueError(f"state_dict holds {full}_orig and {full}_mask, but the model's module {mname!r} "
                                 f"({type(m).__name__}) has no parameter {tname!r}")
            todo.append((m, tname))
        if full not in every:  # as from_torch_prune's own check, but before the checkpoint is loaded
            raise ValueError(
                f"{full} is masked by the torch.nn.utils.prune checkpoint, but a Masker masks only the weight of "
                "Conv2d, Linear and transformers' Conv1D layers and the coefficients of FBConv2d layers")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    order = {id(m): list(m._parameters) for m, _ in todo}
    added = []
    try:
        for m, tname in todo:
            torch_prune.identity(m, tname)
            added.append((m, tname))
        model.load_state_dict(state_dict)
    except Exception:
        for m, tname in reversed(added):
            torch_prune.remove(m, tname)  # weight_orig * ones: the same Parameter again
            m._parameters = {k: m._parameters[k] for k in order[id(m)]}  # and in its place
        model.load_state_dict(before)  # load_state_dict copies what it can before it reports an error
        raise


def from_torch_prune(model: nn.Module, optimizers=None, include: Optional[Sequence[str]] = None,
                     exclude: Optional[Sequence[str]] = None, *, state_dict=None) -> Masker:
    """A :class:`Masker` holding the masks that ``torch.nn.utils.prune`` put on ``model``.

    Every pruned tensor that the masker selects (``include``/``exclude``, as
    :class:`Masker`) is taken over: its mask (``<name>_mask``, the product of
    every pruning call on it) is read, ``torch.nn.utils.prune.remove`` bakes
    ``<name>_orig * <name>_mask`` into the Parameter ``<name>_orig``, which
    becomes ``<name>`` again (the same object, so an optimizer built on the
    pruned model keeps working), and the masker imposes the mask on the
    parameter and on the state of ``optimizers``. An FBConv2d whose
    coefficients were pruned keeps its own mask as well (the masks are
    multiplied). Layers left out by ``include``/``exclude`` keep their
    ``torch.nn.utils.prune`` hooks.

    Example::

        prune.global_unstructured(params, pruning_method=prune.L1Unstructured, amount=0.8)
        masker = from_torch_prune(model, optimizer)   # model now has WeightMask parametrizations
        ... optimizer.step(); masker.step()

    ``state_dict``: a checkpoint saved from a model pruned with
    ``torch.nn.utils.prune`` (keys ``<name>_orig`` and ``<name>_mask``), to be
    loaded into ``model`` (the same architecture, unpruned or pruned) first:
    each pruned tensor of the checkpoint gets ``torch.nn.utils.prune.identity``
    so that the keys match, the checkpoint is loaded, and its masks are taken
    over as above::

        masker = from_torch_prune(Net(), optimizer, state_dict=torch.load("pruned.pt"))

    Raises ``ValueError`` (before anything changes) for a pruned tensor that a
    masker cannot hold (a bias, an embedding, ...), naming it, and for a
    checkpoint key whose module or parameter ``model`` lacks; a checkpoint that
    does not load (``RuntimeError`` of ``load_state_dict``) leaves ``model`` as
    it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizers is not None:
        check_optimizers(optimizers)  # before the checkpoint is loaded and the hooks are removed
    if state_dict is not None:
        _load_torch_prune_checkpoint(model, state_dict)
    plan = _plan(model, _pruning_hooks(model), include, exclude, "torch.nn.utils.prune")
    masks = OrderedDict()
    for key, _, m, tname in plan:
        if key is not None:
            masks[key] = getattr(m, tname + "_mask").detach().clone()
    for key, _, m, tname in plan:
        if key is not None:
            torch_prune.remove(m, tname)
    return _masker_with(model, optimizers, include, exclude, masks)


def from_ao_sparsifier(model, optimizers=None, include: Optional[Sequence[str]] = None,
                       exclude: Optional[Sequence[str]] = None) -> Masker:
    """A :class:`Masker` holding the masks of a ``torch.ao.pruning`` sparsifier.

    ``model`` is the model the sparsifier was prepared on, or the sparsifier
    itself (its ``model``). Every ``FakeSparsity`` parametrization on a tensor
    the masker selects is taken over: the mask is read, the parametrization is
    removed with the masked weight ``mask * w`` baked into the original
    Parameter (the same object: optimizers stay valid), and the masker imposes
    the mask on the parameter and the optimizer state. Call
    ``sparsifier.step()`` for the last time before: the sparsifier holds
    references to the removed parametrizations and must not be used after.

    Example::

        sparsifier = torch.ao.pruning.WeightNormSparsifier(sparsity_level=0.8)
        sparsifier.prepare(model, config=[{"tensor_fqn": "fc1.weight"}, {"tensor_fqn": "fc2.weight"}])
        sparsifier.step()
        masker = from_ao_sparsifier(model, optimizer)

    Raises ``ValueError`` (before anything changes) for a masked tensor that a
    masker cannot hold, or one that carries other parametrizations beside
    ``FakeSparsity``, naming it.
    """
    base = getattr(getattr(torch, "ao", None), "pruning", None)
    if base is not None and isinstance(model, base.BaseSparsifier):
        if getattr(model, "model", None) is None:
            raise ValueError("the sparsifier has no model: call sparsifier.prepare(model, config) first")
        model = model.model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a torch.ao.pruning sparsifier, got {type(model).__name__}")
    if optimizers is not None:
        check_optimizers(optimizers)  # before the parametrizations are removed
    plan = _plan(model, _ao_masks(model), include, exclude, "a torch.ao.pruning sparsifier")
    masks = OrderedDict((key, mask.detach().clone()) for key, _, _, _, mask in plan if key is not None)
    for key, _, m, tname, _ in plan:
        if key is not None:
            parametrize.remove_parametrizations(m, tname, leave_parametrized=True)
    return _masker_with(model, optimizers, include, exclude, masks)


def to_torch_prune(masker: Masker) -> nn.Module:
    """Hands ``masker``'s masks to ``torch.nn.utils.prune`` and returns the model.

    Each masked weight loses its :class:`~prunopt.pruning.WeightMask`
    parametrization and gets ``torch.nn.utils.prune.custom_from_mask`` with the
    same mask: the Parameter (the same object, values ``w * mu``) becomes
    ``weight_orig``, the mask ``weight_mask`` (in the weight's dtype), and the
    model computes what it computed before. Tied layers each get their own
    pre-hook on the shared Parameter. The masker is used up: it no longer
    holds masks and must not be stepped again.

    FBConv2d coefficients cannot be handed over (the layer computes with its
    own ``mask`` buffer): a masker holding any is a ``ValueError`` naming them,
    raised before anything changes; convert them first (``masker.remove(to_conv2d=True)``
    and a new ``Masker`` on the plain model).
    """
    if not isinstance(masker, Masker):
        raise TypeError(f"masker must be a prunopt.pruning.Masker, got {type(masker).__name__}")
    every = list(masker.tensors.values()) + list(masker._alias_tensors.values())
    fb = [pt.name for pt in every if pt.interspace]
    if fb:
        raise ValueError(f"{fb} are FBConv2d coefficients, which torch.nn.utils.prune cannot hold (the layer "
                         "computes with its own mask buffer): remove them from the masker (exclude=) or convert "
                         "the layers to nn.Conv2d first")
    masks = [(pt.module, pt.attr, pt.mask.detach().clone()) for pt in every]
    model = masker.remove()
    for module, attr, mask in masks:
        weight = getattr(module, attr)
        torch_prune.custom_from_mask(module, attr, mask.to(device=weight.device, dtype=weight.dtype))
    return model
