"""Gate ops of differentiable sparsification (``rgf_relu``, ``sparse_gate``)
and of differentiable architecture pruning (``two_temperature_sigmoid``), with
their fake kernels and autograd. Kernels: ``csrc/cpu/{rgf_relu,sparse_gate,
two_temperature_sigmoid}.cpp`` and their ``csrc/cuda`` twins; references:
:mod:`prunopt.reference.gates`, :mod:`prunopt.reference.gates`."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from prunopt._extension import extension_available
from prunopt.ops import _fake_checks as _fc
from prunopt.ops._registry import _kernel_devices
from prunopt.reference.gates import rgf_relu_composed, sparse_gate_composed, two_temperature_sigmoid_composed
from prunopt.validation import check_float_tensor as _check_float_tensor
from prunopt.validation import check_number as _check_number
from prunopt.validation import check_opmath_range as _check_range

__all__ = ["rgf_relu", "sparse_gate", "two_temperature_sigmoid"]

_RGF_DEVICES = _kernel_devices("rgf_relu")
_GATE_DEVICES = _kernel_devices("sparse_gate")
_TTS_DEVICES = _kernel_devices("two_temperature_sigmoid")


def rgf_relu(x: Tensor, alpha: float = 0.1) -> Tensor:
    r"""relu with rectified gradient flow (DS eq. 15).

    Forward :math:`y = \max(x, 0)`; backward the derivative of
    :math:`\mathrm{elu}(x; \alpha)`:

    .. math:: \frac{\partial y}{\partial x} := \begin{cases} 1 & x > 0 \\ \alpha e^{x} & x \le 0 \end{cases}

    so that thresholded (zero) entries keep receiving a learning signal.
    ``alpha = 0`` is the ordinary relu. Any shape; float16/bfloat16/float32/float64.

    Raises:
        TypeError: ``x`` not a tensor, ``alpha`` not a number.
        ValueError: integer ``x``; negative or non-finite ``alpha``, or one
            above float32's range for a float16/bfloat16/float32 ``x``.
    """
    _check_float_tensor(x, "x")
    alpha = _check_range(_check_number(alpha, "alpha", 0.0, True), "alpha", x.dtype)
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
            ``beta`` of the wrong shape/dtype/device, a bad ``rgf_alpha`` (negative,
            not finite, or above float32's range for a float16/bfloat16/float32
            ``alpha``).
    """
    _check_float_tensor(alpha, "alpha")
    _check_float_tensor(beta, "beta")
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool, got {type(signed).__name__}")
    if not isinstance(rgf, bool):
        raise TypeError(f"rgf must be a bool, got {type(rgf).__name__}")
    rgf_alpha = _check_range(_check_number(rgf_alpha, "rgf_alpha", 0.0, True), "rgf_alpha", alpha.dtype) if rgf else 0.0
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
        ValueError: integer ``w``; a temperature that is not finite and > 0, or
            above float32's range for a float16/bfloat16/float32 ``w`` (the
            kernels compute in float32 there).
    """
    _check_float_tensor(w, "w")
    t_l = _check_range(_check_number(t_l, "t_l", 0.0, False), "t_l", w.dtype)
    t_s = t_l / 100.0 if t_s is None else _check_range(_check_number(t_s, "t_s", 0.0, False), "t_s", w.dtype)
    if w.device.type in _TTS_DEVICES:
        return torch.ops.prunopt.two_temperature_sigmoid(w, t_l, t_s)
    return two_temperature_sigmoid_composed(w, t_l, t_s)


if extension_available():

    # (each fake runs the real kernel's argument checks first: prunopt/ops/_fake_checks.py)
    @torch.library.register_fake("prunopt::rgf_relu")
    def _rgf_relu_fake(x, alpha):
        _fc.check_float_tensor(x, "x", "rgf_relu")
        _fc.check_rgf_alpha(alpha, x.dtype, "rgf_relu")
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("prunopt::rgf_relu_backward")
    def _rgf_relu_backward_fake(grad, x, alpha):
        _fc.check_float_tensor(x, "x", "rgf_relu_backward")
        _fc.check_like(grad, x, "grad", "x", "rgf_relu_backward")
        _fc.check_rgf_alpha(alpha, x.dtype, "rgf_relu_backward")
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("prunopt::sparse_gate")
    def _sparse_gate_fake(alpha, beta, signed, rgf_alpha):
        _fc.check_gate(alpha, beta, rgf_alpha, "sparse_gate")
        return torch.empty_like(alpha, memory_format=torch.contiguous_format)

    @torch.library.register_fake("prunopt::sparse_gate_backward")
    def _sparse_gate_backward_fake(grad, alpha, beta, signed, rgf_alpha):
        _fc.check_gate(alpha, beta, rgf_alpha, "sparse_gate_backward")
        _fc.check_like(grad, alpha, "grad", "alpha", "sparse_gate_backward")
        return (
            torch.empty_like(alpha, memory_format=torch.contiguous_format),
            torch.empty_like(beta, memory_format=torch.contiguous_format),
        )

    @torch.library.register_fake("prunopt::two_temperature_sigmoid")
    def _tts_fake(w, t_l, t_s):
        _fc.check_float_tensor(w, "w", "two_temperature_sigmoid")
        _fc.check_temperature(t_l, "t_l", w.dtype, "two_temperature_sigmoid")
        _fc.check_temperature(t_s, "t_s", w.dtype, "two_temperature_sigmoid")
        return torch.empty_like(w, memory_format=torch.contiguous_format)

    @torch.library.register_fake("prunopt::two_temperature_sigmoid_backward")
    def _tts_backward_fake(grad, w, t_s):
        _fc.check_float_tensor(w, "w", "two_temperature_sigmoid_backward")
        _fc.check_like(grad, w, "grad", "w", "two_temperature_sigmoid_backward")
        _fc.check_temperature(t_s, "t_s", w.dtype, "two_temperature_sigmoid_backward")
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
