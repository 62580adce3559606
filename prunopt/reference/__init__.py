"""Readable pure-PyTorch versions of every prunopt op: the oracles the fused
kernels are tested against, and the fallback when the extension is missing."""
from prunopt.reference.projection import (
    project_budget_reference,
    project_budget_sort,
    projection_phi,
)

__all__ = ["project_budget_reference", "project_budget_sort", "projection_phi"]

# --- differentiable sparsification / architecture pruning (issue 6) ---------
from prunopt.reference.architecture import (  # noqa: E402
    two_temperature_sigmoid_backward_reference,
    two_temperature_sigmoid_composed,
    two_temperature_sigmoid_reference,
)
from prunopt.reference.sparsification import (  # noqa: E402
    rgf_relu_backward_reference,
    rgf_relu_composed,
    rgf_relu_reference,
    sparse_gate_backward_reference,
    sparse_gate_composed,
    sparse_gate_reference,
)

__all__ += [
    "two_temperature_sigmoid_backward_reference",
    "two_temperature_sigmoid_composed",
    "two_temperature_sigmoid_reference",
    "rgf_relu_backward_reference",
    "rgf_relu_composed",
    "rgf_relu_reference",
    "sparse_gate_backward_reference",
    "sparse_gate_composed",
    "sparse_gate_reference",
]
