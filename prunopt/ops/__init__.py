"""Typed Python wrappers over ``torch.ops.prunopt.*``, one module per op family
(mirroring ``csrc/``, :mod:`prunopt.reference`, ``tests/ops/`` and
:mod:`prunopt.bench`):

* :mod:`prunopt.ops.projection`: ``project_budget``, ``project_budget_``,
  ``project_budget_bracket``, ``project_budget_apply_``;
* :mod:`prunopt.ops.prunadag`: ``topk_threshold``, ``topk_bracket``, ``topk_slice``,
  ``prunadag_norms``, ``prunadag_bracket``, ``prunadag_slice`` (and the fused step that :class:`prunopt.optim.PrunAdag`
  calls);
* :mod:`prunopt.ops.interspace`: ``fb_reconstruct``, ``fb_conv2d``,
  ``fb_compress``, ``fb_conv2d_compressed``;
* :mod:`prunopt.ops.gates`: ``rgf_relu``, ``sparse_gate``,
  ``two_temperature_sigmoid``.

Each wrapper validates its arguments (``TypeError``/``ValueError`` naming the
argument), then calls the fused kernel of the extension when it is loaded and
the pure-PyTorch reference (:mod:`prunopt.reference`) otherwise. Importing a
family registers its fake (meta) kernels and autograd formulas, so every op
traces under ``torch.compile``.
"""
from prunopt.ops._registry import TensorOrList
from prunopt.ops.gates import rgf_relu, sparse_gate, two_temperature_sigmoid
from prunopt.ops.interspace import (FBCompressed, fb_compress, fb_conv2d, fb_conv2d_compressed, fb_reconstruct,
                                    fb_reconstruct_backward)
from prunopt.ops.projection import project_budget, project_budget_, project_budget_apply_, project_budget_bracket
from prunopt.ops.prunadag import (PRUNADAG_DEVICES, prunadag_bracket, prunadag_norms, prunadag_slice, topk_bracket,
                                  topk_slice, topk_threshold)

__all__ = [
    "project_budget", "project_budget_", "project_budget_bracket", "project_budget_apply_", "topk_threshold",
    "topk_bracket", "topk_slice", "prunadag_norms", "prunadag_bracket", "prunadag_slice",
    "PRUNADAG_DEVICES",
    "fb_reconstruct", "fb_reconstruct_backward", "fb_conv2d", "fb_compress", "fb_conv2d_compressed", "FBCompressed",
    "rgf_relu", "sparse_gate", "two_temperature_sigmoid", "TensorOrList",
]
