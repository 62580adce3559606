"""Argument checks of the fake (meta) kernels: the checks of the C++ kernels
(``csrc/include/prunopt/{checks,fb_checks,sparsification_checks}.h``) on the
metadata alone, so that a call traced with fake tensors (``torch.compile``,
``torch.library.opcheck``, meta tensors) fails as the real kernel does, with a
``ValueError`` naming the argument, instead of an ``AttributeError`` or a
``ZeroDivisionError`` from the shape arithmetic. Checks that read the data
(finite scores, positive costs) stay with the real kernels."""
from __future__ import annotations

import math
import struct
from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["check_projection", "check_fb_reconstruct", "check_fb_grad_h", "check_fb_conv", "check_fb_csr",
           "check_float_tensor", "check_like", "check_rgf_alpha", "check_temperature", "check_gate",
           "check_topk_values", "check_projection_apply", "check_prunadag_step", "check_prunadag_norms",
           "check_prunadag_bracket", "representable", "check_disjoint_writes"]


def _tensor(t, name: str, op: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise ValueError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    return t


def _number(v, name: str, op: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{op}: {name} must be a number, got {type(v).__name__}")
    return float(v)


def representable(v: float, dtype: torch.dtype) -> bool:
    """Whether the double ``v`` is a value of ``dtype`` (float32 or float64);
    no tensor is made (a fake kernel's tensors would be fake)."""
    if dtype == torch.float64:
        return True
    try:
        return struct.unpack("f", struct.pack("f", v))[0] == v or math.isnan(v)
    except OverflowError:  # finite beyond float32's range
        return False


def _opmath_max(dtype: torch.dtype) -> float:
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max


def check_float_tensor(t, name: str, op: str) -> Tensor:
    """A real floating tensor (``check_float_tensor``)."""
    _tensor(t, name, op)
    if not t.is_floating_point():
        raise ValueError(f"{op}: {name} must be a real floating tensor, got {t.dtype}")
    return t


def check_like(t, ref: Tensor, name: str, ref_name: str, op: str) -> None:
    """The shape, dtype and device of ``ref`` (``check_like``)."""
    _tensor(t, name, op)
    if t.shape != ref.shape:
        raise ValueError(f"{op}: {name} must have the shape of {ref_name} {list(ref.shape)}, got {list(t.shape)}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{op}: {name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{op}: {name} must be on the device of {ref_name} ({ref.device}), got {t.device}")


def check_rgf_alpha(alpha, dtype: torch.dtype, op: str) -> None:
    """A finite elu slope >= 0 within the kernels' compute type."""
    a = _number(alpha, "alpha", op)
    if not (math.isfinite(a) and a >= 0.0):
        raise ValueError(f"{op}: alpha (the elu slope of the rectified gradient flow) must be a finite number >= 0, "
                         f"got {a}")
    if a > _opmath_max(dtype):
        raise ValueError(f"{op}: alpha (the elu slope of the rectified gradient flow) must be at most "
                         f"{_opmath_max(dtype):g} for {dtype} tensors, got {a:g}")


def check_temperature(t, name: str, dtype: torch.dtype, op: str) -> None:
    """A finite temperature > 0 within the kernels' compute type."""
    v = _number(t, name, op)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{op}: {name} must be a finite temperature > 0, got {v}")
    if v > _opmath_max(dtype):
        raise ValueError(f"{op}: {name} must be at most {_opmath_max(dtype):g} for {dtype} tensors, got {v:g}")


def check_gate(alpha, beta, rgf_alpha, op: str) -> None:
    """alpha (groups, n), beta (groups,) (``check_gate_args``)."""
    check_float_tensor(alpha, "alpha", op)
    _tensor(beta, "beta", op)
    if alpha.dim() != 2:
        raise ValueError(f"{op}: alpha must be 2-D (groups, gates), got {alpha.dim()}-D")
    if alpha.shape[1] < 1 and alpha.shape[0] != 0:
        raise ValueError(f"{op}: every group needs at least one gate, got alpha of shape {list(alpha.shape)}")
    if beta.dim() != 1 or beta.shape[0] != alpha.shape[0]:
        raise ValueError(f"{op}: beta must have shape (groups,) = ({alpha.shape[0]},), got {list(beta.shape)}")
    if beta.dtype != alpha.dtype:
        raise ValueError(f"{op}: beta must have the dtype of alpha ({alpha.dtype}), got {beta.dtype}")
    if beta.device != alpha.device:
        raise ValueError(f"{op}: beta must be on the device of alpha ({alpha.device}), got {beta.device}")
    check_rgf_alpha(rgf_alpha, alpha.dtype, op)


def _offsets(t: Tensor) -> set:
    """The storage offsets of every element of ``t`` (from its metadata; real
    tensors, outside any fake mode)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        off = torch.full((), t.storage_offset(), dtype=torch.int64)
        for size, stride in zip(t.shape, t.stride()):
            off = off.unsqueeze(-1) + torch.arange(int(size), dtype=torch.int64) * int(stride)
        return set(off.reshape(-1).tolist())


def check_disjoint_writes(named, op: str) -> None:
    """``check_disjoint_writes`` of csrc/include/prunopt/checks.h on the
    metadata: no written tensor overlaps itself (a stride-0 dimension of size
    > 1, e.g. an expand()-ed tensor) or another (same storage, common
    elements). ``named``: (name, tensor) pairs."""
    named = [(n, t) for n, t in named if isinstance(t, Tensor) and t.numel() > 0 and not t.is_meta]
    for name, t in named:
        if _self_overlapping(t):
            raise ValueError(f"{op}: {name} has elements sharing one memory location (e.g. an expand()-ed tensor); "
                             "clone() it before writing it in place")
    groups = {}  # tensors of one storage (no quadratic cost for long lists)
    for name, t in named:
        groups.setdefault((t.untyped_storage()._cdata, t.element_size()), []).append((name, t))
    for group in groups.values():
        for i, (na, a) in enumerate(group):
            for nb, b in group[i + 1:]:
                if a is b or _offsets(a) & _offsets(b):
                    raise ValueError(f"{op}: {na} and {nb} share memory (the same tensor twice or overlapping views): "
                                     "each element must be written once; pass each tensor once (or clone() one)")


def check_projection(theta, cost, budget, op: str) -> None:
    """theta / cost / budget of the projection ops (``check_projection_args``)."""
    b = _number(budget, "budget", op)
    if not (math.isfinite(b) and b >= 0.0):
        raise ValueError(f"{op}: budget must be a finite number >= 0, got {b}")
    if not isinstance(theta, (list, tuple)):
        raise ValueError(f"{op}: theta must be a list of tensors, got {type(theta).__name__}")
    for i, t in enumerate(theta):
        _tensor(t, f"theta[{i}]", op)
    if cost is not None:
        if not isinstance(cost, (list, tuple)):
            raise ValueError(f"{op}: cost must be a list of tensors or None, got {type(cost).__name__}")
        for i, c in enumerate(cost):
            _tensor(c, f"cost[{i}]", op)
    if not theta:
        if cost:
            raise ValueError(f"{op}: cost must have as many tensors as theta (0), got {len(cost)}")
        return
    t0 = theta[0]
    for i, t in enumerate(theta):
        if not t.is_floating_point():
            raise ValueError(f"{op}: theta[{i}] must be a real floating tensor, got {t.dtype}")
        if t.dtype != t0.dtype:
            raise ValueError(f"{op}: all theta tensors must share one dtype, theta[{i}] is {t.dtype} but theta[0] is "
                             f"{t0.dtype}")
        if t.device != t0.device:
            raise ValueError(f"{op}: all theta tensors must be on one device, theta[{i}] is on {t.device} but "
                             f"theta[0] is on {t0.device}")
    if cost is not None:
        if len(cost) != len(theta):
            raise ValueError(f"{op}: cost must have as many tensors as theta ({len(theta)}), got {len(cost)}")
        for i, (c, t) in enumerate(zip(cost, theta)):
            check_like(c, t, f"cost[{i}]", f"theta[{i}]", op)


def check_projection_apply(out, theta, cost, lam, op: str = "project_budget_apply_") -> None:
    """out / theta / cost / lam of ``project_budget_apply_`` (``check_projection_apply_args``)."""
    check_projection(theta, cost, 0.0, op)
    lam = _number(lam, "lam", op)
    if not lam >= 0.0:
        raise ValueError(f"{op}: lam must be >= 0 (inf allowed), got {lam}")
    if not isinstance(out, (list, tuple)):
        raise ValueError(f"{op}: out must be a list of tensors, got {type(out).__name__}")
    if len(out) != len(theta):
        raise ValueError(f"{op}: out must have as many tensors as theta ({len(theta)}), got {len(out)}")
    for i, (o, t) in enumerate(zip(out, theta)):
        _tensor(o, f"out[{i}]", op)
        if o.shape != t.shape or o.dtype != t.dtype or o.device != t.device:
            raise ValueError(f"{op}: out[{i}] must have the shape, dtype and device of theta[{i}] "
                             f"({list(t.shape)}, {t.dtype}, {t.device}), got {list(o.shape)}, {o.dtype}, {o.device}")


def _check_basis(basis, n: int, dtype: torch.dtype, device, op: str) -> None:
    _tensor(basis, "basis", op)
    if basis.dim() != 3:
        raise ValueError(f"{op}: basis must have shape (N, kh, kw), got {list(basis.shape)}")
    if basis.shape[0] != n:
        raise ValueError(f"{op}: basis has {basis.shape[0]} elements but the coefficients have N = {n}")
    if basis.dtype != dtype:
        raise ValueError(f"{op}: basis must have dtype {dtype}, got {basis.dtype}")
    if basis.device != device:
        raise ValueError(f"{op}: basis must be on {device}, got {basis.device}")


def check_fb_reconstruct(coefficients, basis, mask: Optional[Tensor], op: str) -> None:
    """``check_fb_reconstruct_args``."""
    _tensor(coefficients, "coefficients", op)
    if coefficients.dim() != 3:
        raise ValueError(f"{op}: coefficients must have shape (C_out, C_in/groups, N), got "
                         f"{list(coefficients.shape)}")
    if not coefficients.is_floating_point():
        raise ValueError(f"{op}: coefficients must be a floating tensor, got {coefficients.dtype}")
    _check_basis(basis, coefficients.shape[2], coefficients.dtype, coefficients.device, op)
    if mask is not None:
        check_like(mask, coefficients, "mask", "coefficients", op)


def check_fb_grad_h(grad_h, coefficients: Tensor, basis: Tensor, op: str) -> None:
    """``check_fb_grad_h``."""
    _tensor(grad_h, "grad_h", op)
    want = (coefficients.shape[0], coefficients.shape[1], basis.shape[1], basis.shape[2])
    if tuple(grad_h.shape) != want:
        raise ValueError(f"{op}: grad_h must have the shape of the filters {want}, got {list(grad_h.shape)}")
    if grad_h.dtype != coefficients.dtype:
        raise ValueError(f"{op}: grad_h must have dtype {coefficients.dtype}, got {grad_h.dtype}")
    if grad_h.device != coefficients.device:
        raise ValueError(f"{op}: grad_h must be on {coefficients.device}")


def _pair(v, name: str, op: str) -> Sequence[int]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ValueError(f"{op}: stride, padding and dilation must have two entries, got {name}={v!r}")
    return v


def check_fb_conv(input, c_out: int, c_in_g: int, basis: Tensor, bias, stride, padding, dilation, groups,
                  op: str) -> tuple:
    """``check_fb_conv_args``; returns the output shape ``(B, C_out, Ho, Wo)``."""
    _tensor(input, "input", op)
    if input.dim() != 4:
        raise ValueError(f"{op}: input must have shape (B, C_in, H, W), got {list(input.shape)}")
    if input.shape[2] < 1 or input.shape[3] < 1:
        raise ValueError(f"{op}: input must have an image of at least 1 x 1, got {list(input.shape)}")
    if input.dtype != basis.dtype:
        raise ValueError(f"{op}: input must have dtype {basis.dtype}, got {input.dtype}")
    if input.device != basis.device:
        raise ValueError(f"{op}: input must be on {basis.device}")
    stride, padding, dilation = (_pair(v, n, op) for v, n in ((stride, "stride"), (padding, "padding"),
                                                               (dilation, "dilation")))
    if not (stride[0] >= 1 and stride[1] >= 1):
        raise ValueError(f"{op}: stride must be >= 1, got {list(stride)}")
    if not (padding[0] >= 0 and padding[1] >= 0):
        raise ValueError(f"{op}: padding must be >= 0, got {list(padding)}")
    if not (dilation[0] >= 1 and dilation[1] >= 1):
        raise ValueError(f"{op}: dilation must be >= 1, got {list(dilation)}")
    for v, name in ((stride, "stride"), (padding, "padding"), (dilation, "dilation")):
        if max(v) > 2**31 - 1:
            raise ValueError(f"{op}: {name} must be at most {2**31 - 1}, got {list(v)}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or c_out % groups != 0:
        raise ValueError(f"{op}: groups must be >= 1 and divide C_out = {c_out}, got {groups}")
    if input.shape[1] != c_in_g * groups:
        raise ValueError(f"{op}: input has {input.shape[1]} channels but the coefficients with groups={groups} "
                         f"expect {c_in_g * groups}")
    if bias is not None:
        _tensor(bias, "bias", op)
        if bias.dim() != 1 or bias.shape[0] != c_out:
            raise ValueError(f"{op}: bias must have shape ({c_out},), got {list(bias.shape)}")
        if bias.dtype != basis.dtype or bias.device != basis.device:
            raise ValueError(f"{op}: bias must have the dtype and device of basis")
    ho = (input.shape[2] + 2 * padding[0] - dilation[0] * (basis.shape[1] - 1) - 1) // stride[0] + 1
    wo = (input.shape[3] + 2 * padding[1] - dilation[1] * (basis.shape[2] - 1) - 1) // stride[1] + 1
    if ho < 1 or wo < 1:
        raise ValueError(f"{op}: input {list(input.shape)} is smaller than the dilated kernel")
    return (input.shape[0], c_out, ho, wo)


def check_fb_csr(crow, col, values, basis, op: str) -> None:
    """``check_fb_csr_args`` (and a basis of three dimensions)."""
    for t, name in ((crow, "crow_indices"), (col, "col_indices"), (values, "values"), (basis, "basis")):
        _tensor(t, name, op)
    if basis.dim() != 3:
        raise ValueError(f"{op}: basis must have shape (N, kh, kw), got {list(basis.shape)}")
    if crow.dim() != 1 or crow.numel() < 2 or crow.dtype != torch.int32:
        raise ValueError(f"{op}: crow_indices must be a 1-D int32 tensor of length C_out + 1, got "
                         f"{list(crow.shape)} {crow.dtype}")
    if col.dim() != 1 or col.dtype != torch.int32:
        raise ValueError(f"{op}: col_indices must be a 1-D int32 tensor, got {list(col.shape)} {col.dtype}")
    if values.dim() != 1 or values.numel() != col.numel():
        raise ValueError(f"{op}: values must be 1-D with as many entries as col_indices ({col.numel()}), got "
                         f"{list(values.shape)}")
    if values.dtype != basis.dtype:
        raise ValueError(f"{op}: values must have dtype {basis.dtype}, got {values.dtype}")
    if not (crow.device == basis.device and col.device == basis.device and values.device == basis.device):
        raise ValueError(f"{op}: crow_indices, col_indices and values must be on {basis.device}")


# ------------------------------------------------------------------- prunAdag
# (csrc/cpu/prunadag.cpp: check_list, and the entries of topk_threshold,
# topk_bracket, prunadag_step_ and prunadag_norms)

_PRUNADAG_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_list(ts, ref: Tensor, count: int, name: str, op: str) -> None:
    if not isinstance(ts, (list, tuple)):
        raise ValueError(f"{op}: {name} must be a list of tensors, got {type(ts).__name__}")
    if len(ts) != count:
        raise ValueError(f"{op}: {name} must have {count} tensors, got {len(ts)}")
    for i, t in enumerate(ts):
        _tensor(t, f"{name}[{i}]", op)
        if t.dtype != ref.dtype:
            raise ValueError(f"{op}: {name}[{i}] must have dtype {ref.dtype}, got {t.dtype}")
        if t.device != ref.device:
            raise ValueError(f"{op}: {name}[{i}] must be on {ref.device}")
        if t.layout != torch.strided:
            raise ValueError(f"{op}: {name}[{i}] must be a dense (strided) tensor")


def check_topk_values(values, op: str) -> None:
    """values of ``topk_threshold`` / ``topk_bracket``: a non-empty list of
    float32 or float64 tensors of one dtype and device."""
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{op}: values must not be empty")
    v0 = _tensor(values[0], "values[0]", op)
    if v0.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: values must be float32 or float64, got {v0.dtype}")
    _check_list(values, v0, len(values), "values", op)


def check_slice_args(buckets: int, cap: int, sample, op: str) -> None:
    """``buckets``, ``cap`` and ``sample`` of ``topk_slice`` / ``prunadag_slice``
    (csrc/cpu/topk_slice.cpp)."""
    if buckets < 1:
        raise ValueError(f"{op}: buckets must be >= 1, got {buckets}")
    if cap < 0:
        raise ValueError(f"{op}: cap must be >= 0, got {cap}")
    if not (len(sample) == 3 and 1 <= sample[0] <= sample[1] and 1 <= sample[2] <= 4096):
        raise ValueError(f"{op}: sample must be [min, max, block] with 1 <= min <= max and 1 <= block <= 4096, "
                         f"got {list(sample)}")


def _self_overlapping(t: Tensor) -> bool:
    """A dimension of size > 1 with stride 0 (an expand()-ed tensor): the cases
    that metadata alone decides (the eager kernel checks every layout)."""
    return any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride()))


def check_prunadag_step(params, opt_sums, dec_sums, grads, hyper, version, found_nonfinite, selection,
                        op: str = "prunadag_step_") -> None:
    """The checks of ``prunadag_step_`` that need no data (the range of
    ``relevant`` depends on the prune flags in ``hyper``, the selection's
    values and the gradients' finiteness on the data: the eager kernel's)."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= 4:
        raise ValueError(f"{op}: version must be 0 (relevant_only) or 1..4, got {version}")
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"{op}: params must be a list of tensors, got {type(params).__name__}")
    check_disjoint_writes([(f"{name}[{i}]", t) for name, lst in (("params", params), ("opt_sums", opt_sums),
                                                                   ("dec_sums", dec_sums))
                           if isinstance(lst, (list, tuple)) for i, t in enumerate(lst)], op)
    if selection is not None:
        _tensor(selection, "selection", op)
        if selection.dtype != torch.float64 or selection.numel() not in (2, 3):
            raise ValueError(f"{op}: selection must be a float64 tensor of 2 elements [tau, r] (or 3: [tau, r, "
                             f"checked]), got {selection.dtype} of shape {list(selection.shape)}")
    if found_nonfinite is not None:
        _tensor(found_nonfinite, "found_nonfinite", op)
        if found_nonfinite.dtype != torch.float32 or found_nonfinite.numel() != 1:
            raise ValueError(f"{op}: found_nonfinite must be a one-element float32 tensor, got "
                             f"{found_nonfinite.dtype} of shape {list(found_nonfinite.shape)}")
    if not params:
        return
    p0 = _tensor(params[0], "params[0]", op)
    if p0.dtype not in _PRUNADAG_DTYPES:
        raise ValueError(f"{op}: params must be float16, bfloat16, float32 or float64, got {p0.dtype}")
    nt = len(params)
    for name, lst in (("params", params), ("opt_sums", opt_sums), ("dec_sums", dec_sums), ("grads", grads)):
        _check_list(lst, p0, nt, name, op)
    _tensor(hyper, "hyper", op)
    if hyper.dtype != torch.float64 or hyper.dim() != 2 or tuple(hyper.shape) != (nt, 6):
        raise ValueError(f"{op}: hyper must be a float64 tensor of shape ({nt}, 6), got {hyper.dtype} "
                         f"{list(hyper.shape)}")
    for i in range(nt):
        if not (opt_sums[i].shape == dec_sums[i].shape == grads[i].shape == params[i].shape):
            raise ValueError(f"{op}: opt_sums[{i}], dec_sums[{i}] and grads[{i}] must have the shape of params[{i}] "
                             f"{list(params[i].shape)}")


def check_prunadag_norms(params, grads, hyper, tau, op: str = "prunadag_norms") -> None:
    """The checks of ``prunadag_norms`` that need no data."""
    nt = _check_lists_and_hyper(params, grads, hyper, op)
    _tensor(tau, "tau", op)
    if tau.dtype != torch.float64 or tau.numel() != 1:
        raise ValueError(f"{op}: tau must be a one-element float64 tensor, got {tau.dtype} {list(tau.shape)}")
    if not params:
        return
    p0 = _tensor(params[0], "params[0]", op)
    if p0.dtype not in _PRUNADAG_DTYPES:
        raise ValueError(f"{op}: params must be float16, bfloat16, float32 or float64, got {p0.dtype}")
    _check_pairs(params, grads, p0, op)


def _check_lists_and_hyper(params, grads, hyper, op: str) -> int:
    """params and grads lists of one length ``nt`` and hyper float64 ``(nt, 6)``; returns ``nt``."""
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"{op}: params must be a list of tensors, got {type(params).__name__}")
    nt = len(params)
    if not isinstance(grads, (list, tuple)) or len(grads) != nt:
        raise ValueError(f"{op}: grads must have {nt} tensors, got "
                         f"{len(grads) if isinstance(grads, (list, tuple)) else type(grads).__name__}")
    _tensor(hyper, "hyper", op)
    if hyper.dtype != torch.float64 or hyper.dim() != 2 or tuple(hyper.shape) != (nt, 6):
        raise ValueError(f"{op}: hyper must be a float64 tensor of shape ({nt}, 6), got {hyper.dtype} "
                         f"{list(hyper.shape)}")
    return nt


def _check_pairs(params, grads, p0: Tensor, op: str) -> None:
    """params and grads of the dtype, device and layout of ``p0``, each grads[i] shaped like params[i]."""
    nt = len(params)
    _check_list(params, p0, nt, "params", op)
    _check_list(grads, p0, nt, "grads", op)
    for i in range(nt):
        if grads[i].shape != params[i].shape:
            raise ValueError(f"{op}: grads[{i}] must have the shape of params[{i}] {list(params[i].shape)}")


def check_prunadag_bracket(params, grads, hyper, lo, hi, op: str = "prunadag_bracket") -> None:
    """The checks of ``prunadag_bracket`` that need no data."""
    _check_lists_and_hyper(params, grads, hyper, op)
    if not (math.isfinite(lo) and lo >= 0.0):
        raise ValueError(f"{op}: lo must be finite and >= 0, got {lo}")
    if not hi >= lo:
        raise ValueError(f"{op}: hi must be >= lo (inf allowed), got lo={lo}, hi={hi}")
    if not params:
        return
    p0 = _tensor(params[0], "params[0]", op)
    if p0.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: params must be float32 or float64, got {p0.dtype}")
    _check_pairs(params, grads, p0, op)
    if hyper.device != p0.device:
        raise ValueError(f"{op}: hyper must be on {p0.device}, got {hyper.device}")
    if not (representable(lo, p0.dtype) and representable(hi, p0.dtype)):
        raise ValueError(f"{op}: lo and hi must be values of the params' dtype, got lo={lo}, hi={hi}")
