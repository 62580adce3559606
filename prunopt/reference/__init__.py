"""Readable pure-PyTorch versions of every prunopt op: the oracles the fused
kernels are tested against, and the fallback when the extension is missing."""
from prunopt.reference.projection import (
    project_budget_apply_reference,
    project_budget_bracket_reference,
    project_budget_reference,
    project_budget_sort,
    projection_phi,
)

__all__ = ["project_budget_reference", "project_budget_sort", "projection_phi", "project_budget_bracket_reference",
           "project_budget_apply_reference"]

# --- interspace pruning: filter-basis convolution (Wimmer et al.) ---
from prunopt.reference.interspace import (  # noqa: E402
    fb_coefficient_grads_reference,
    fb_conv2d_reference,
    fb_conv2d_sparse_reference,
    fb_reconstruct_reference,
)

__all__ += [
    "fb_reconstruct_reference",
    "fb_conv2d_reference",
    "fb_conv2d_sparse_reference",
    "fb_coefficient_grads_reference",
]

# --- prunAdag (Porcelli et al.) ---
from prunopt.reference.prunadag import (  # noqa: E402
    TensorHyper,
    prunadag_bracket_reference,
    prunadag_norms_reference,
    prunadag_step_reference,
    resolve_relevant,
    support_norm_lmo_reference,
    topk_bracket_reference,
    topk_slice_reference,
    prunadag_slice_reference,
    topk_threshold_reference,
)

__all__ += [
    "TensorHyper",
    "prunadag_bracket_reference",
    "prunadag_norms_reference",
    "prunadag_step_reference",
    "resolve_relevant",
    "support_norm_lmo_reference",
    "topk_bracket_reference",
    "topk_slice_reference",
    "prunadag_slice_reference",
    "topk_threshold_reference",
]

# --- differentiable sparsification / architecture pruning ---------
from prunopt.reference.gates import (  # noqa: E402
    rgf_relu_backward_reference,
    rgf_relu_composed,
    rgf_relu_reference,
    sparse_gate_backward_reference,
    sparse_gate_composed,
    sparse_gate_reference,
    two_temperature_sigmoid_backward_reference,
    two_temperature_sigmoid_composed,
    two_temperature_sigmoid_reference,
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


# --- which reference is the oracle of which registered op -------------------
# Every schema in csrc/ops.cpp has an entry (tests/test_reference_coverage.py).
REFERENCE_FOR_OP = {
    "project_budget": project_budget_reference,
    "project_budget_": project_budget_reference,  # in-place variant
    "project_budget_bracket": project_budget_bracket_reference,
    "project_budget_apply_": project_budget_apply_reference,
    "topk_threshold": topk_threshold_reference,
    "topk_bracket": topk_bracket_reference,
    "topk_slice": topk_slice_reference,
    "prunadag_slice": prunadag_slice_reference,
    "prunadag_step_": prunadag_step_reference,
    "prunadag_norms": prunadag_norms_reference,
    "prunadag_bracket": prunadag_bracket_reference,
    "fb_reconstruct": fb_reconstruct_reference,
    "fb_reconstruct_backward": fb_coefficient_grads_reference,
    "fb_conv2d": fb_conv2d_reference,
    "fb_conv2d_csr": fb_conv2d_sparse_reference,
    "rgf_relu": rgf_relu_reference,
    "rgf_relu_backward": rgf_relu_backward_reference,
    "sparse_gate": sparse_gate_reference,
    "sparse_gate_backward": sparse_gate_backward_reference,
    "two_temperature_sigmoid": two_temperature_sigmoid_reference,
    "two_temperature_sigmoid_backward": two_temperature_sigmoid_backward_reference,
}

__all__ += ["REFERENCE_FOR_OP"]
