"""Replacing modules of a model in place (shared by the conversions)."""
from __future__ import annotations

from typing import Dict

from torch import nn


def swap_modules(model: nn.Module, new: Dict[int, nn.Module]) -> nn.Module:
    """Puts ``new[id(old)]`` in place of every submodule ``old`` of ``model``,
    under every name it is registered by (``named_children`` lists a module
    once, so a tied module stays tied). When ``model`` itself is replaced, its
    replacement is returned and ``model`` is left as it is; else ``model``."""
    if id(model) in new:
        return new[id(model)]
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in new:
                parent._modules[name] = new[id(child)]
    return model
