"""Layers and masks: probabilistic masks (ProbMask/ProM), filter-basis
convolutions (interspace pruning), sparse gates and two-temperature masks."""
from prunopt.nn.probmask import (
    ProbMask,
    ProbMaskInput,
    apply_probmask,
    finalize_probmask,
    gumbel_sigmoid,
    probmask_density,
    probmask_modules,
    probmask_scores,
    remove_probmask,
    set_temperature,
)

__all__ = [
    "ProbMask",
    "ProbMaskInput",
    "apply_probmask",
    "finalize_probmask",
    "gumbel_sigmoid",
    "probmask_density",
    "probmask_modules",
    "probmask_scores",
    "remove_probmask",
    "set_temperature",
]

# --- interspace pruning: filter-basis convolutions (Wimmer et al.) ---
from prunopt.nn.interspace import (  # noqa: E402
    FBConv2d,
    FilterBasis,
    interspace_flops,
    interspace_param_groups,
    interspace_report,
    pruning_rates,
    sparse_storage,
    to_interspace,
)

__all__ += [
    "FilterBasis",
    "FBConv2d",
    "to_interspace",
    "interspace_param_groups",
    "pruning_rates",
    "interspace_flops",
    "sparse_storage",
    "interspace_report",
]

# --- differentiable sparsification / two-temperature masks --------
from prunopt.nn.architecture import *  # noqa: E402,F401,F403
from prunopt.nn.architecture import __all__ as _architecture_all  # noqa: E402
from prunopt.nn.sparsification import *  # noqa: E402,F401,F403
from prunopt.nn.sparsification import __all__ as _sparsification_all  # noqa: E402
from prunopt.nn.sparse_graph import *  # noqa: E402,F401,F403
from prunopt.nn.sparse_graph import __all__ as _sparse_graph_all  # noqa: E402

__all__ += list(_sparsification_all) + list(_architecture_all) + list(_sparse_graph_all)
