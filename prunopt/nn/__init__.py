"""Layers and masks: probabilistic masks (ProbMask/ProM), filter-basis
convolutions (interspace pruning), sparse gates and two-temperature masks."""
__all__ = []
