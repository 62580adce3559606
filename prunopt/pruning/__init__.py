"""Pruning toolkit: masks, scores, schedules and methods for standard and
interspace weights."""
__all__ = []


# --- prunAdag: a posteriori magnitude pruning and eq. 3.1 measures ---
from prunopt.pruning.magnitude import magnitude_masks, magnitude_prune_, rho_omega, sparsity  # noqa: E402

__all__ += ["magnitude_masks", "magnitude_prune_", "rho_omega", "sparsity"]
