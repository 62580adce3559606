"""Layers and masks: probabilistic masks (ProbMask/ProM), filter-basis
convolutions (interspace pruning), sparse gates and two-temperature masks."""
from prunopt.nn.probmask import (
    ProbMask,
    ProbMaskInput,
    apply_probmask,
    finalize_probmask,
    gumbel_sigmoid,
    mask_density,
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
    "mask_density",
    "probmask_modules",
    "probmask_scores",
    "remove_probmask",
    "set_temperature",
]
