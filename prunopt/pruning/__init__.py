"""Pruning toolkit: masks, scores, schedules and methods for standard and
interspace weights."""
__all__ = []

# --- pruning toolkit: masks, scores, selection, methods, storage ---
from prunopt.pruning.masks import (  # noqa: E402
    Masker,
    PrunableTensor,
    WeightMask,
    is_fb_conv,
    is_hf_conv1d,
    prunable_tensors,
    remove_masks,
)
from prunopt.pruning.selection import (  # noqa: E402
    check_sparsity,
    erk_counts,
    erk_densities,
    global_masks,
    kept_count,
    layerwise_masks,
)
from prunopt.pruning.scores import (  # noqa: E402
    SCORES,
    grasp_scores,
    magnitude_scores,
    random_scores,
    snip_scores,
    synflow_scores,
)
from prunopt.pruning.methods import (  # noqa: E402
    DynamicSparseTraining,
    FineTuning,
    GradualMagnitudePruning,
    LotteryTicket,
    PruningAtInit,
    PruningMethod,
    cosine_drop_fraction,
    gmp_sparsity,
    lottery_ticket_trainings,
    magnitude_prune,
    synflow_prune,
)
from prunopt.pruning.storage import (  # noqa: E402
    CSRTensor,
    entropy_bound,
    export_csr,
    from_csr,
    mask_entropy_bits,
    pruning_rates,
    to_csr,
)

__all__ += [
    "Masker", "PrunableTensor", "WeightMask", "is_fb_conv", "is_hf_conv1d", "prunable_tensors", "remove_masks",
    "check_sparsity", "erk_counts", "erk_densities", "global_masks", "kept_count", "layerwise_masks",
    "SCORES", "grasp_scores", "magnitude_scores", "random_scores", "snip_scores", "synflow_scores",
    "DynamicSparseTraining", "FineTuning", "GradualMagnitudePruning", "LotteryTicket", "PruningAtInit",
    "PruningMethod", "cosine_drop_fraction", "gmp_sparsity", "lottery_ticket_trainings", "magnitude_prune",
    "synflow_prune",
    "CSRTensor", "entropy_bound", "export_csr", "from_csr", "mask_entropy_bits", "pruning_rates", "to_csr",
]


# --- prunAdag: a posteriori magnitude pruning and eq. 3.1 measures ---
from prunopt.pruning.magnitude import magnitude_masks, magnitude_prune_, rho_omega, sparsity  # noqa: E402

__all__ += ["magnitude_masks", "magnitude_prune_", "rho_omega", "sparsity"]


# --- migration from / to torch.nn.utils.prune and torch.ao.pruning ---
from prunopt.pruning.migration import from_ao_sparsifier, from_torch_prune, to_torch_prune  # noqa: E402

__all__ += ["from_ao_sparsifier", "from_torch_prune", "to_torch_prune"]
