"""Typed Python wrappers over ``torch.ops.prunopt.*``.

Each wrapper validates its arguments (``TypeError``/``ValueError`` naming the
argument), then calls the fused kernel of the extension when it is loaded and
the pure-PyTorch reference (``prunopt.reference``) otherwise. Fake (meta)
kernels are registered here so that every op traces under ``torch.compile``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from prunopt._extension import extension_available
from prunopt.reference.projection import project_budget_reference, validate_projection_args

TensorOrList = Union[Tensor, Sequence[Tensor]]

__all__ = ["project_budget", "project_budget_"]


def _kernel_devices(op: str) -> frozenset:
    """Device types with a compiled kernel for ``prunopt::op`` (fixed at import,
    so the check is a constant under torch.compile)."""
    if not extension_available():
        return frozenset()
    keys = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}
    return frozenset(
        d for d, k in keys.items() if d == "meta" or torch._C._dispatch_has_kernel_for_dispatch_key(f"prunopt::{op}", k)
    )


_PROJECTION_DEVICES = _kernel_devices("project_budget")


def _use_kernel(tensors: List[Tensor], devices: frozenset = _PROJECTION_DEVICES) -> bool:
    # len(), not bool(): dynamo in torch 2.11 cannot trace bool() of a list
    # (test_project_budget.py::test_torch_compile failed there, seen on the H100)
    return len(tensors) > 0 and tensors[0].device.type in devices


def project_budget(theta: TensorOrList, budget: float, cost: Optional[TensorOrList] = None):
    r"""Exact Euclidean projection onto the budget set (SPEC.md §1, ProM supplement eq. 9-17).

    .. math::
        \theta^* = \arg\min_x \|x - \theta\|^2 \;\; \text{s.t.}\;\; 0 \le x_i \le 1,\;
        \textstyle\sum_i c_i x_i \le S, \qquad
        \theta^* = \mathrm{clamp}(\theta - \lambda^* c, 0, 1)

    with :math:`\lambda^* = \max(0, \lambda_1)` the root of the non-increasing
    :math:`\phi(\lambda) = \sum_i c_i\,\mathrm{clamp}(\theta_i - \lambda c_i, 0, 1) - S`
    (eq. 14). The result is exact to rounding (not a bisection approximation).

    Args:
        theta: a tensor of any shape, or a list of tensors projected jointly under
            one budget (no concatenated copy is made). float32/float64; float16 and
            bfloat16 are computed in double and rounded back.
        budget: ``S >= 0``. ``S = 0`` gives all zeros.
        cost: optional positive costs ``c`` with the shape(s) of ``theta``
            (default all ones, so the budget counts elements).

    Returns:
        A new tensor (or list) with the projected values. It does not require
        grad, whatever ``theta`` does: the projection is an optimisation step
        (like ``torch.argmax``), not a differentiable layer, so no gradient flows
        back through it (the compiled op has a non-differentiable Autograd
        kernel; the pure-PyTorch fallback computes on detached data).

    Raises:
        TypeError: ``theta``/``cost`` not tensors, ``budget`` not a real number
            (Python, NumPy or one-element tensor).
        ValueError: negative or non-finite budget, non-finite scores, non-positive
            costs, mismatched shapes, dtypes or devices.
    """
    thetas, costs, budget, single = validate_projection_args(theta, budget, cost)
    if _use_kernel(thetas):
        out = torch.ops.prunopt.project_budget(thetas, costs, budget)
        return out[0] if single else list(out)
    return project_budget_reference(thetas[0] if single else thetas, budget, costs[0] if (single and costs) else costs)


def project_budget_(theta: TensorOrList, budget: float, cost: Optional[TensorOrList] = None):
    r"""In-place :func:`project_budget`: overwrites ``theta`` with its projection.

    Validation (including finiteness of the data) happens before anything is
    written, so on error ``theta`` is unchanged. The tensors of ``theta`` must
    not share memory with each other (the same tensor twice, overlapping
    views) or within themselves (e.g. an ``expand()``-ed tensor): that is a
    ``ValueError`` (checked in eager mode). Returns ``theta``.
    """
    thetas, costs, budget, single = validate_projection_args(theta, budget, cost)
    if not torch.compiler.is_compiling():
        _check_no_overlap(thetas)
    if _use_kernel(thetas):
        torch.ops.prunopt.project_budget_(thetas, costs, budget)
    else:
        outs = project_budget_reference(thetas, budget, costs)
        with torch.no_grad():
            for t, o in zip(thetas, outs):
                t.copy_(o)
    return theta


def _element_offsets(t: Tensor) -> Tensor:
    """Offsets (in elements of ``t``'s dtype, from the start of its storage) of
    every element of ``t``; ``numel`` int64 values."""
    off = torch.full((), t.storage_offset(), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        off = off.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return off.reshape(-1)


def _has_internal_overlap(t: Tensor) -> bool:
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    reach = 0  # largest offset reachable with the dimensions of smaller stride
    for stride, size in dims:
        if stride <= reach:  # not provably free of overlap: count the distinct offsets
            return int(torch.unique(_element_offsets(t)).numel()) < t.numel()
        reach += stride * (size - 1)
    return False


def _check_no_overlap(thetas: List[Tensor], name: str = "theta") -> None:
    """ValueError if a tensor written in place overlaps itself or another one:
    the projection treats every element as a separate score, so aliased memory
    would be counted twice against the budget and written twice. ``name`` is
    the argument the tensors came in (``theta[i]``, or ``params[i]`` for
    :class:`prunopt.optim.BudgetProjection`)."""
    by_storage = {}
    for i, t in enumerate(thetas):
        if t.numel() == 0 or t.device.type == "meta":
            continue
        if _has_internal_overlap(t):
            raise ValueError(f"{name}[{i}] has elements sharing one memory location (e.g. an expand()-ed tensor); "
                             "clone() it before projecting in place")
        by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(i)
    for idx in by_storage.values():
        for a in range(len(idx)):
            for b in range(a + 1, len(idx)):
                i, j = idx[a], idx[b]
                ti, tj = thetas[i], thetas[j]
                lo_i, lo_j = ti.storage_offset(), tj.storage_offset()
                hi_i = lo_i + sum((n - 1) * st for n, st in zip(ti.shape, ti.stride()))
                hi_j = lo_j + sum((n - 1) * st for n, st in zip(tj.shape, tj.stride()))
                if hi_i < lo_j or hi_j < lo_i:
                    continue  # disjoint ranges of one storage
                if ti is tj or bool(torch.isin(_element_offsets(ti), _element_offsets(tj)).any()):
                    raise ValueError(f"{name}[{i}] and {name}[{j}] share memory (the same tensor twice or overlapping "
                                     "views): their elements would count twice against the budget; pass each "
                                     "tensor once (or clone() one)")

if extension_available():

    @torch.library.register_fake("prunopt::project_budget")
    def _project_budget_fake(theta, cost, budget):
        return [torch.empty_like(t) for t in theta]

    @torch.library.register_fake("prunopt::project_budget_")
    def _project_budget_inplace_fake(theta, cost, budget):
        return None

    # The projection is not differentiable (a step, not a layer): its Autograd
    # kernel runs the op below autograd, so the outputs never require grad (as the
    # fallback's, which computes on detached data) instead of carrying autograd's
    # "not implemented" node, whose backward only warns and leaves grad None.
    _PROJECTION_LIB = torch.library.Library("prunopt", "IMPL")

    def _project_budget_autograd(theta, cost, budget):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.prunopt.project_budget.default(theta, cost, budget)

    _PROJECTION_LIB.impl("project_budget", _project_budget_autograd, "Autograd")


# ---------------------------------------------------------------------------
# Interspace pruning: filter-basis convolution (SPEC.md §3, issue 4).
# Ops: fb_reconstruct (fused eq. 4) and its fused backward (eq. 7, A.13-A.14), fb_conv2d (eq. 6/8, dense or sparse path
# chosen by density inside the kernel), fb_conv2d_csr (eq. 8 on a cached CSR).
# ---------------------------------------------------------------------------
from prunopt.ops_interspace import (  # noqa: E402
    FBCompressed,
    fb_compress,
    fb_conv2d,
    fb_conv2d_compressed,
    fb_reconstruct,
    fb_reconstruct_backward,
)

__all__ += ["fb_reconstruct", "fb_reconstruct_backward", "fb_conv2d", "fb_compress", "fb_conv2d_compressed", "FBCompressed"]

if extension_available() and hasattr(torch.ops.prunopt, "fb_conv2d"):
    from prunopt.ops_interspace import fb_conv_out_shape as _fb_conv_out_shape  # noqa: E402
    from prunopt.ops_interspace import register_fb_autograd as _register_fb_autograd  # noqa: E402

    @torch.library.register_fake("prunopt::fb_reconstruct")
    def _fb_reconstruct_fake(coefficients, basis, mask):
        return coefficients.new_empty(coefficients.shape[0], coefficients.shape[1], basis.shape[1], basis.shape[2])

    if hasattr(torch.ops.prunopt, "fb_reconstruct_backward"):  # absent from extensions built before it

        @torch.library.register_fake("prunopt::fb_reconstruct_backward")
        def _fb_reconstruct_backward_fake(grad_h, coefficients, basis, mask, output_mask):
            return (coefficients.new_empty(coefficients.shape if output_mask[0] else (0,)),
                    basis.new_empty(basis.shape if output_mask[1] else (0,)))

    @torch.library.register_fake("prunopt::fb_conv2d")
    def _fb_conv2d_fake(input, coefficients, basis, mask, bias, stride, padding, dilation, groups, max_density):
        return input.new_empty(_fb_conv_out_shape(input, coefficients.shape[0], basis, stride, padding, dilation))

    @torch.library.register_fake("prunopt::fb_conv2d_csr")
    def _fb_conv2d_csr_fake(input, crow_indices, col_indices, values, basis, bias, stride, padding, dilation, groups):
        c_out = crow_indices.shape[0] - 1
        return input.new_empty(_fb_conv_out_shape(input, c_out, basis, stride, padding, dilation))

    _register_fb_autograd()

# prunAdag (SPEC.md section 2): global top-T threshold and the fused step.
# ---------------------------------------------------------------------------
from prunopt.reference.prunadag import topk_threshold_reference as _topk_threshold_reference  # noqa: E402

__all__ += ["topk_threshold", "PRUNADAG_DEVICES"]

PRUNADAG_DEVICES = _kernel_devices("prunadag_step_")
_THRESHOLD_DEVICES = _kernel_devices("topk_threshold")


def topk_threshold(values: TensorOrList, k: int) -> Tensor:
    r"""The ``k``-th largest :math:`|v|` over a tensor or a list of tensors
    (prunAdag eq. 2.6, the threshold :math:`\tau` of the relevant set
    :math:`\mathcal R = \{i : |g_i| \ge \tau\}`; also the LMO of eq. 1.2).

    Equals ``torch.kthvalue(cat(|v|), n - k + 1).values`` (ties included) but the
    kernel never concatenates: it is an exact radix select on the bit patterns of
    :math:`|v|` with per-chunk histograms (deterministic, nothing of size n).

    Args:
        values: a tensor or a list of tensors of one real floating dtype and device.
        k: ``1 <= k <= n`` (``n`` = total number of elements).

    Returns:
        A 0-dim tensor of the values' dtype.

    Raises:
        TypeError: not tensors, ``k`` not an int.
        ValueError: ``k`` out of range, mixed dtypes/devices, non-finite values.
    """
    if isinstance(values, Tensor):
        vals = [values]
    elif isinstance(values, (list, tuple)) and all(isinstance(v, Tensor) for v in values):
        vals = list(values)
    else:
        raise TypeError(f"values must be a Tensor or a list/tuple of Tensors, got {type(values).__name__}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    n = sum(v.numel() for v in vals)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    for i, v in enumerate(vals):
        if not v.is_floating_point():
            raise ValueError(f"values[{i}] must be a real floating tensor, got {v.dtype}")
        if v.dtype != vals[0].dtype or v.device != vals[0].device:
            raise ValueError(f"values[{i}] must have the dtype and device of values[0]")
    if vals[0].device.type in _THRESHOLD_DEVICES and vals[0].dtype in (torch.float32, torch.float64):
        return torch.ops.prunopt.topk_threshold(vals, k)
    for i, v in enumerate(vals):
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"values[{i}] contains a non-finite value")
    return _topk_threshold_reference(vals, k)

# Differentiable sparsification (SPEC.md §4) and two-temperature architecture
# pruning (SPEC.md §5): ops with custom backward (issue 6).
# ---------------------------------------------------------------------------
import math as _math  # noqa: E402
import numbers as _numbers  # noqa: E402

from prunopt.reference.architecture import two_temperature_sigmoid_composed  # noqa: E402
from prunopt.reference.sparsification import rgf_relu_composed, sparse_gate_composed  # noqa: E402

__all__ += ["rgf_relu", "sparse_gate", "two_temperature_sigmoid"]

_RGF_DEVICES = _kernel_devices("rgf_relu")
_GATE_DEVICES = _kernel_devices("sparse_gate")
_TTS_DEVICES = _kernel_devices("two_temperature_sigmoid")


def _check_float_tensor(t, name: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a real floating tensor, got {t.dtype}")


def _check_number(v, name: str, low: float, low_inclusive: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, _numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    v = float(v)
    ok = _math.isfinite(v) and (v >= low if low_inclusive else v > low)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>=' if low_inclusive else '>'} {low}, got {v}")
    return v


def rgf_relu(x: Tensor, alpha: float = 0.1) -> Tensor:
    r"""relu with rectified gradient flow (DS eq. 15).

    Forward :math:`y = \max(x, 0)`; backward the derivative of
    :math:`\mathrm{elu}(x; \alpha)`:

    .. math:: \frac{\partial y}{\partial x} := \begin{cases} 1 & x > 0 \\ \alpha e^{x} & x \le 0 \end{cases}

    so that thresholded (zero) entries keep receiving a learning signal.
    ``alpha = 0`` is the ordinary relu. Any shape; float16/bfloat16/float32/float64.

    Raises:
        TypeError: ``x`` not a tensor, ``alpha`` not a number.
        ValueError: integer ``x``; negative or non-finite ``alpha``.
    """
    _check_float_tensor(x, "x")
    alpha = _check_number(alpha, "alpha", 0.0, True)
    if x.device.type in _RGF_DEVICES:
        return torch.ops.prunopt.rgf_relu(x, alpha)
    return rgf_relu_composed(x, alpha)


def sparse_gate(
    alpha: Tensor, beta: Tensor, signed: bool = True, rgf: bool = True, rgf_alpha: float = 0.1, dim: int = -1
) -> Tensor:
    r"""Architecture parameters (gates) of differentiable sparsification.

    Every slice of ``alpha`` along ``dim`` is one competition group of ``n``
    components with its own threshold parameter (the matching entry of ``beta``,
    whose shape is ``alpha``'s without ``dim``). With :math:`s = \sigma(\beta)`:

    * signed (eq. 12): :math:`a_i = \mathrm{sign}(\alpha_i)\,(|\alpha_i| - s\|\alpha\|_1)_+`
    * non-negative (eq. 9-11): :math:`\gamma = e^{\alpha}`,
      :math:`\tilde\gamma_i = (\gamma_i - s\|\gamma\|_1)_+`,
      :math:`a = \tilde\gamma / \sum_j\tilde\gamma_j` (``a = 0`` in the degenerate
      case where every :math:`\tilde\gamma_j` is 0).

    With ``rgf=True`` the backward pass replaces the derivative of the
    thresholding :math:`(\cdot)_+` by that of :math:`\mathrm{elu}(\cdot; \text{rgf\_alpha})`
    (eq. 15); with ``rgf=False`` it is the exact (sub)gradient.

    Raises:
        TypeError: non-tensor inputs or flags of the wrong type.
        ValueError: integer tensors, an empty group (size 0 along ``dim``), a
            ``beta`` of the wrong shape/dtype/device, a bad ``rgf_alpha``.
    """
    _check_float_tensor(alpha, "alpha")
    _check_float_tensor(beta, "beta")
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool, got {type(signed).__name__}")
    if not isinstance(rgf, bool):
        raise TypeError(f"rgf must be a bool, got {type(rgf).__name__}")
    rgf_alpha = _check_number(rgf_alpha, "rgf_alpha", 0.0, True) if rgf else 0.0
    if alpha.dim() == 0:
        raise ValueError("alpha must have at least one dimension (the group of gates)")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -alpha.dim() <= dim < alpha.dim():
        raise ValueError(f"dim must be an int in [{-alpha.dim()}, {alpha.dim()}), got {dim!r}")
    n = alpha.shape[dim]
    if n == 0:
        raise ValueError(f"sparse_gate: empty group: alpha has size 0 along dim {dim} (shape {tuple(alpha.shape)})")
    group_shape = alpha.shape[:dim % alpha.dim()] + alpha.shape[dim % alpha.dim() + 1:]
    if beta.shape != group_shape:
        raise ValueError(f"beta must have shape {tuple(group_shape)} (alpha's shape without dim), got {tuple(beta.shape)}")
    if beta.dtype != alpha.dtype:
        raise ValueError(f"beta must have the dtype of alpha ({alpha.dtype}), got {beta.dtype}")
    if beta.device != alpha.device:
        raise ValueError(f"beta must be on the device of alpha ({alpha.device}), got {beta.device}")
    if alpha.dim() == 2 and dim in (-1, 1) and alpha.device.type in _GATE_DEVICES:
        # (groups, n) already: no views around the kernel (they cost as much as a small kernel)
        return torch.ops.prunopt.sparse_gate(alpha, beta, signed, rgf_alpha)
    moved = alpha.movedim(dim, -1)
    if alpha.device.type in _GATE_DEVICES:
        a = torch.ops.prunopt.sparse_gate(moved.reshape(-1, n), beta.reshape(-1), signed, rgf_alpha)
        a = a.reshape(moved.shape)
    else:
        a = sparse_gate_composed(moved, beta, signed, rgf_alpha)
    return a.movedim(-1, dim)


def two_temperature_sigmoid(w: Tensor, t_l: float = 1000.0, t_s: Optional[float] = None) -> Tensor:
    r"""Relaxed architecture mask with two temperatures (AP eq. 6-7).

    Forward :math:`v = \sigma(t_l w)` (nearly binary for large ``t_l``);
    backward the derivative of the softer sigmoid:

    .. math:: \frac{\partial v}{\partial w} := t_s\,\sigma(t_s w)\,(1 - \sigma(t_s w))

    ``t_l = 1000`` and ``t_s = t_l / 100`` (the default) are the paper's choice;
    ``t_s = t_l`` is the ordinary sigmoid.

    Raises:
        TypeError: ``w`` not a tensor or a temperature not a number.
        ValueError: integer ``w``; a temperature that is not finite and > 0.
    """
    _check_float_tensor(w, "w")
    t_l = _check_number(t_l, "t_l", 0.0, False)
    t_s = t_l / 100.0 if t_s is None else _check_number(t_s, "t_s", 0.0, False)
    if w.device.type in _TTS_DEVICES:
        return torch.ops.prunopt.two_temperature_sigmoid(w, t_l, t_s)
    return two_temperature_sigmoid_composed(w, t_l, t_s)


if extension_available():

    @torch.library.register_fake("prunopt::topk_threshold")
    def _topk_threshold_fake(values, k):
        return values[0].new_empty(())

    @torch.library.register_fake("prunopt::prunadag_step_")
    def _prunadag_step_fake(params, opt_sums, dec_sums, grads, hyper, relevant, version, found_nonfinite=None):
        return None

    @torch.library.register_fake("prunopt::rgf_relu")
    def _rgf_relu_fake(x, alpha):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("prunopt::rgf_relu_backward")
    def _rgf_relu_backward_fake(grad, x, alpha):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("prunopt::sparse_gate")
    def _sparse_gate_fake(alpha, beta, signed, rgf_alpha):
        torch._check(alpha.dim() == 2, lambda: "sparse_gate: alpha must be 2-D")
        return torch.empty_like(alpha, memory_format=torch.contiguous_format)

    @torch.library.register_fake("prunopt::sparse_gate_backward")
    def _sparse_gate_backward_fake(grad, alpha, beta, signed, rgf_alpha):
        return (
            torch.empty_like(alpha, memory_format=torch.contiguous_format),
            torch.empty_like(beta, memory_format=torch.contiguous_format),
        )

    @torch.library.register_fake("prunopt::two_temperature_sigmoid")
    def _tts_fake(w, t_l, t_s):
        return torch.empty_like(w, memory_format=torch.contiguous_format)

    @torch.library.register_fake("prunopt::two_temperature_sigmoid_backward")
    def _tts_backward_fake(grad, w, t_s):
        return torch.empty_like(w, memory_format=torch.contiguous_format)

    def _rgf_setup(ctx, inputs, output):
        x, alpha = inputs
        ctx.save_for_backward(x)
        ctx.alpha = alpha

    def _composed_vjp(fn, inputs, grad):
        """``grad``'s vector-Jacobian product through the composed (plain PyTorch)
        form of an op, differentiable in ``grad`` and in ``inputs``: the
        backward under ``create_graph=True`` (double backward, Hessian-vector
        products as GraSP takes them). The backward kernels have no autograd of
        their own, so their result would be a constant there and every
        second-order term through them silently wrong. Inputs that do not
        require grad are detached leaves (their vjp is then still a function of
        ``grad``)."""
        with torch.enable_grad():
            ins = [t if t.requires_grad else t.detach().requires_grad_() for t in inputs]
            out = fn(*ins)
            return torch.autograd.grad(out, ins, grad, create_graph=True, allow_unused=True)

    def _second_order(grad, *tensors) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in (grad,) + tensors)

    def _rgf_backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if _second_order(grad, x):
            return _composed_vjp(lambda x_: rgf_relu_composed(x_, ctx.alpha), (x,), grad)[0], None
        return torch.ops.prunopt.rgf_relu_backward(grad, x, ctx.alpha), None

    torch.library.register_autograd("prunopt::rgf_relu", _rgf_backward, setup_context=_rgf_setup)

    def _gate_setup(ctx, inputs, output):
        alpha, beta, signed, rgf_alpha = inputs
        ctx.save_for_backward(alpha, beta)
        ctx.signed = signed
        ctx.rgf_alpha = rgf_alpha

    def _gate_backward(ctx, grad):
        alpha, beta = ctx.saved_tensors
        if _second_order(grad, alpha, beta):
            ga, gb = _composed_vjp(lambda a, b: sparse_gate_composed(a, b, ctx.signed, ctx.rgf_alpha), (alpha, beta), grad)
        else:
            ga, gb = torch.ops.prunopt.sparse_gate_backward(grad, alpha, beta, ctx.signed, ctx.rgf_alpha)
        return ga, gb, None, None

    torch.library.register_autograd("prunopt::sparse_gate", _gate_backward, setup_context=_gate_setup)

    def _tts_setup(ctx, inputs, output):
        w, t_l, t_s = inputs
        ctx.save_for_backward(w)
        ctx.t_s = t_s

    def _tts_backward(ctx, grad):
        (w,) = ctx.saved_tensors
        if _second_order(grad, w):
            t_s = ctx.t_s
            # the composed form with t_l = t_s: sigmoid(t_s w), whose derivative is
            # the eq. 7 surrogate (the forward value does not enter the vjp)
            return _composed_vjp(lambda w_: torch.sigmoid(t_s * w_), (w,), grad)[0], None, None
        return torch.ops.prunopt.two_temperature_sigmoid_backward(grad, w, ctx.t_s), None, None

    torch.library.register_autograd("prunopt::two_temperature_sigmoid", _tts_backward, setup_context=_tts_setup)
