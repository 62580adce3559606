"""TorchScript guard shared by prunopt's modules.

prunopt's layers call custom ops through Python wrappers (argument checks,
``torch.func`` and autocast dispatch, eval caches), which TorchScript's
compiler cannot parse. ``torch.jit.script`` calls ``__prepare_scriptable__`` on
the scripted module and on every submodule before it compiles anything, so a
guard there turns the parser errors from inside prunopt's source into one
clear error, also when the prunopt module sits deep inside the user's model.
"""
from __future__ import annotations


class TorchScriptNotSupportedError(RuntimeError):
    """``torch.jit.script`` was called on a model containing a prunopt module."""


def script_unsupported(self):
    """``__prepare_scriptable__`` of prunopt's modules: raises
    :class:`TorchScriptNotSupportedError` naming the module and the supported
    alternatives (``torch.compile``, ``torch.export``)."""
    name = type(self).__name__
    raise TorchScriptNotSupportedError(
        f"torch.jit.script is not supported for prunopt's {name} (found in the scripted model: "
        f"{name}({self.extra_repr()})): TorchScript cannot compile the Python wrappers of prunopt's custom ops. "
        "Use torch.compile(model) or torch.export.export(model, args) instead"
    )
