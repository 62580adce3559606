"""Layers and masks: probabilistic masks (ProbMask/ProM), filter-basis
convolutions (interspace pruning), sparse gates and two-temperature masks."""
__all__ = []

# --- differentiable sparsification / two-temperature masks (issue 6) --------
from prunopt.nn.architecture import *  # noqa: E402,F401,F403
from prunopt.nn.architecture import __all__ as _architecture_all  # noqa: E402
from prunopt.nn.sparsification import *  # noqa: E402,F401,F403
from prunopt.nn.sparsification import __all__ as _sparsification_all  # noqa: E402

__all__ += list(_sparsification_all) + list(_architecture_all)
