"""The registered ops (``torch.ops.prunopt.*``) guard themselves, as the
Python wrappers do: ``torch.compile`` and other callers reach them directly.

Each test is one defect that fuzzing found: aliased or self-overlapping
members of the in-place projection (silent zeros, or a write before the
error), in-place writes into tensors that require grad, scalars beyond the
kernels' float range (NaN where the reference is finite), conv arguments that
overflowed the index arithmetic, None for a tensor, NaN max_density, and fake
kernels that failed with AttributeError / ZeroDivisionError instead of the
real kernel's ValueError. tools/sanitize.sh runs this file under
AddressSanitizer (the small-list projection read out of bounds there)."""
import math

import pytest
import torch

import prunopt
from prunopt.ops import project_budget, project_budget_, rgf_relu, sparse_gate, two_temperature_sigmoid
from prunopt.reference import (project_budget_sort, two_temperature_sigmoid_backward_reference,
                               two_temperature_sigmoid_reference)

pytestmark = pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built")

ops = torch.ops.prunopt
FLOAT_MAX = torch.finfo(torch.float32).max


def _fake(fn, *args):
    """Calls ``fn`` with every tensor argument (and list member) made fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()

    def f(o):
        if isinstance(o, torch.Tensor):
            return mode.from_tensor(o)
        if isinstance(o, list):
            return [f(x) for x in o]
        return o

    fargs = [f(a) for a in args]
    with mode:
        return fn(*fargs)


# ------------------------------------------------------------------ projection

@pytest.mark.parametrize("sizes", [(6, 4), (1, 1, 1), (7, 9, 3), (13, 2, 1, 5), (4095, 3), (2049, 2047, 1)])
@pytest.mark.parametrize("with_cost", [False, True])
def test_small_lists_are_sampled_within_their_tensors(sizes, with_cost):
    """Totals below the sample size and not a multiple of its 8-element runs:
    the runs overlapped and read element -1 of the next tensor (an ASan
    heap-buffer-overflow; here the result against the oracle)."""
    g = torch.Generator().manual_seed(sum(sizes))
    theta = [torch.rand(n, generator=g) * 1.2 for n in sizes]
    cost = [torch.rand(n, generator=g) + 0.5 for n in sizes] if with_cost else None
    budget = 0.3 * sum(sizes)
    out = project_budget(theta, budget, cost)
    ref = project_budget_sort(theta, budget, cost)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=0)


def test_raw_inplace_projection_refuses_the_same_tensor_twice():
    """It returned silent zeros (each element counted twice against the budget)."""
    b = torch.rand(5) * 2
    before = b.clone()
    with pytest.raises(ValueError, match=r"theta\[0\] and theta\[1\] share memory"):
        ops.project_budget_([b, b], None, 2.0)
    assert torch.equal(b, before)


def test_raw_inplace_projection_refuses_overlapping_views():
    base = torch.rand(9) * 2
    before = base.clone()
    with pytest.raises(ValueError, match=r"theta\[0\] and theta\[1\] share memory"):
        ops.project_budget_([base[:5], base[4:]], None, 2.0)
    assert torch.equal(base, before)
    # disjoint views of one storage are fine, as are strided views that interleave
    ops.project_budget_([base[:4], base[4:]], None, 2.0)
    ops.project_budget_([base[0::2], base[1::2]], None, 2.0)


def test_raw_inplace_projection_refuses_a_stride_zero_member_before_writing():
    """It wrote the first tensor, then raised on the expanded one."""
    first = torch.rand(5) * 2
    before = first.clone()
    expanded = torch.full((1,), 1.5).expand(4)
    with pytest.raises(ValueError, match=r"theta\[1\] has elements sharing one memory location"):
        ops.project_budget_([first, expanded], None, 2.0)
    assert torch.equal(first, before)
    # a self-overlapping view that ATen cannot classify (as_strided): exact check
    base = torch.rand(6)
    tricky = base.as_strided((3, 2), (1, 2))  # offsets 0 2 1 3 2 4: 2 twice
    with pytest.raises(ValueError, match=r"theta\[0\] has elements sharing one memory location"):
        ops.project_budget_([tricky], None, 1.0)


@pytest.mark.parametrize("raw", [True, False])
def test_inplace_projection_refuses_tensors_that_require_grad_outside_no_grad(raw):
    """As ATen's in-place ops: a leaf that requires grad (or a view of one, or a
    tensor inside a graph) is written only with grad mode off."""
    run = (lambda ts: ops.project_budget_(ts, None, 1.0)) if raw else (lambda ts: project_budget_(ts, 1.0))
    leaf = torch.rand(5, requires_grad=True)
    before = leaf.detach().clone()
    with pytest.raises(RuntimeError, match=r"theta\[0\]: a leaf Variable that requires grad"):
        run([leaf])
    with pytest.raises(RuntimeError, match=r"theta\[1\]: a view of a leaf Variable"):
        run([torch.rand(3), leaf[:2]])
    with pytest.raises(RuntimeError, match=r"theta\[0\] requires grad, but the op writes it in place"):
        run([leaf * 2])
    assert torch.equal(leaf.detach(), before)
    with torch.no_grad():
        run([leaf])
    assert float(leaf.detach().sum()) == pytest.approx(1.0, abs=1e-5)


def test_projection_fake_kernels_check_their_arguments():
    with pytest.raises(ValueError, match="budget"):
        _fake(ops.project_budget, [torch.rand(3)], None, math.nan)
    with pytest.raises(ValueError, match=r"theta\[1\]"):
        _fake(ops.project_budget_, [torch.rand(3), torch.rand(2).double()], None, 1.0)
    with pytest.raises(ValueError, match=r"cost\[0\]"):
        _fake(ops.project_budget, [torch.rand(3)], [torch.rand(4)], 1.0)


# ---------------------------------------------------------------------- gates

def test_temperature_beyond_the_float_range_is_a_value_error():
    """10**400 was an OverflowError; 1e300 (finite as a double, inf as the
    float the kernel computes with) gave NaN at w = 0 and NaN gradients where
    the reference gives 0."""
    w = torch.tensor([-1.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="t_l"):
        two_temperature_sigmoid(w, 10**400)
    with pytest.raises(ValueError, match="t_l"):
        two_temperature_sigmoid(w, 1e300)
    with pytest.raises(ValueError, match="t_s"):
        two_temperature_sigmoid(w, 1.0, 1e39)
    with pytest.raises(ValueError, match="t_l must be at most"):
        ops.two_temperature_sigmoid(w, 1e300, 1.0)
    with pytest.raises(ValueError, match="t_s must be at most"):
        ops.two_temperature_sigmoid_backward(torch.ones(3), w, 1e300)
    with pytest.raises(ValueError, match="t_l"):
        _fake(ops.two_temperature_sigmoid, w, 1e300, 1.0)
    # float64 computes in float64: 1e300 is a valid temperature there
    w64 = w.double().requires_grad_()
    y = two_temperature_sigmoid(w64, 1e300, 1e300)
    y.sum().backward()
    torch.testing.assert_close(y.detach(), two_temperature_sigmoid_reference(w64.detach(), 1e300, 1e300))
    assert torch.equal(w64.grad[[0, 2]], torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_slope_temperature_with_large_gradients_matches_the_reference(dtype):
    """grad * t_s overflowed before the zero (or small) slope multiplied it:
    NaN, or inf where the reference is finite."""
    t_s = 3e38 if dtype == torch.float32 else 1e307
    w = torch.tensor([0.0, 1e-38, -5.0, 3.0], dtype=dtype)
    g = torch.tensor([1e-30, 4.0, 7.0, -9.0], dtype=dtype)
    out = ops.two_temperature_sigmoid_backward(g, w, t_s)
    ref = two_temperature_sigmoid_backward_reference(g, w, t_s)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref)


def test_rgf_alpha_beyond_the_float_range_is_a_value_error():
    x = torch.tensor([-200.0, -1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="alpha"):
        rgf_relu(x, 1e300)
    with pytest.raises(ValueError, match="alpha"):
        ops.rgf_relu_backward(torch.ones(4), x, 1e300)
    with pytest.raises(ValueError, match="rgf_alpha"):
        sparse_gate(x.reshape(1, 4), torch.zeros(1), rgf_alpha=10**400)
    with pytest.raises(ValueError, match="alpha"):
        ops.sparse_gate(x.reshape(1, 4), torch.zeros(1), True, 1e300)
    ops.rgf_relu_backward(torch.ones(4, dtype=torch.float64), x.double(), 1e300)  # float64: in range


def test_gate_fake_kernels_check_their_arguments():
    """The fake kernel of sparse_gate raised AttributeError for a None alpha."""
    with pytest.raises(ValueError, match="alpha"):
        _fake(ops.sparse_gate, None, torch.zeros(3), True, 0.0)
    with pytest.raises(ValueError, match="beta"):
        _fake(ops.sparse_gate, torch.zeros(3, 4), torch.zeros(4), True, 0.0)
    with pytest.raises(ValueError, match="grad"):
        _fake(ops.rgf_relu_backward, torch.zeros(3), torch.zeros(4), 0.1)
    with pytest.raises(ValueError, match="x"):
        _fake(ops.rgf_relu, torch.zeros(3, dtype=torch.int64), 0.1)


# ----------------------------------------------------------------- interspace

def _csr_args():
    x = torch.rand(1, 2, 5, 5)
    crow = torch.tensor([0, 1, 2], dtype=torch.int32)
    col = torch.tensor([0, 3], dtype=torch.int32)
    return [x, crow, col, torch.rand(2), torch.rand(4, 3, 3), None, [1, 1], [0, 0], [1, 1], 1]


def test_fb_conv2d_csr_fake_kernel_checks_the_stride():
    """It raised ZeroDivisionError for stride 0."""
    args = _csr_args()
    args[6] = [0, 0]
    with pytest.raises(ValueError, match="stride must be >= 1"):
        _fake(ops.fb_conv2d_csr, *args)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        ops.fb_conv2d_csr(*args)
    assert _fake(ops.fb_conv2d_csr, *_csr_args()).shape == ops.fb_conv2d_csr(*_csr_args()).shape


@pytest.mark.parametrize("which, value", [(6, [2**62, 1]), (7, [2**62, 0]), (8, [1, 2**62])])
def test_conv_arguments_that_overflow_int64_arithmetic_are_value_errors(which, value):
    """A padding of 2**62 overflowed in + 2 pad (undefined behaviour; it read
    as "input is smaller than the dilated kernel"), a stride of 2**62 was
    accepted."""
    name = {6: "stride", 7: "padding", 8: "dilation"}[which]
    args = _csr_args()
    args[which] = value
    with pytest.raises(ValueError, match=f"{name} must be at most"):
        ops.fb_conv2d_csr(*args)
    with pytest.raises(ValueError, match=f"{name} must be at most"):
        _fake(ops.fb_conv2d_csr, *args)
    coeff, basis = torch.rand(3, 2, 4), torch.rand(4, 3, 3)
    conv = [torch.rand(1, 2, 5, 5), coeff, basis, None, None, [1, 1], [0, 0], [1, 1], 1, 1.0]
    conv[which - 1] = value
    with pytest.raises(ValueError, match=f"{name} must be at most"):
        ops.fb_conv2d(*conv)
    with pytest.raises(ValueError, match=name):
        prunopt.ops.fb_conv2d(torch.rand(1, 2, 5, 5), coeff, basis, **{name: value})


def test_fb_ops_name_a_missing_tensor():
    """None for a tensor argument was "tensor does not have a device"."""
    with pytest.raises(ValueError, match="basis must be a tensor, got None"):
        ops.fb_reconstruct(torch.rand(3, 2, 4), None, None)
    with pytest.raises(ValueError, match="coefficients must be a tensor, got None"):
        ops.fb_reconstruct_backward(torch.rand(3, 2, 3, 3), None, torch.rand(4, 3, 3), None, [True, True])
    args = _csr_args()
    args[0] = None
    with pytest.raises(ValueError, match="input must be a tensor, got None"):
        ops.fb_conv2d_csr(*args)
    with pytest.raises(ValueError, match="input must be a tensor"):
        _fake(ops.fb_conv2d_csr, *args)


def test_fb_conv2d_refuses_a_nan_max_density():
    """NaN compared false with every density: silently the sparse path."""
    args = [torch.rand(1, 2, 5, 5), torch.rand(3, 2, 4), torch.rand(4, 3, 3), None, None, [1, 1], [0, 0], [1, 1], 1,
            math.nan]
    with pytest.raises(ValueError, match="max_density"):
        ops.fb_conv2d(*args)
    with pytest.raises(ValueError, match="max_density"):
        _fake(ops.fb_conv2d, *args)


def test_float_max_is_a_valid_temperature_for_float32():
    w = torch.tensor([-1.0, 0.0, 1.0])
    out = two_temperature_sigmoid(w, FLOAT_MAX, FLOAT_MAX)
    assert torch.equal(out, torch.tensor([0.0, 0.5, 1.0]))


# ------------------------------------------------------------- every op

def _schema_names():
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "csrc", "ops.cpp")) as f:
        return sorted(set(re.findall(r'"([a-z_0-9]+)\(', f.read())))


@pytest.mark.parametrize("name", _schema_names())
def test_every_op_refuses_a_call_without_tensors_by_name(name):
    """With no tensor argument the dispatcher found no kernel and raised
    NotImplementedError ("There were no tensor arguments to this function")
    before any check: a kernel at BackendSelect now names the argument."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"prunopt::{name}", "BackendSelect")
    schema = getattr(ops, name).default._schema
    args, first = [], None
    for a in schema.arguments:
        t = str(a.type)
        if a.has_default_value():
            break
        if t == "Tensor":
            args.append(None)
        elif t == "List[Tensor]":
            args.append([])
        elif t == "Optional[List[Tensor]]" or t == "Optional[Tensor]":
            args.append(None)
        elif t == "float":
            args.append(1.0)
        elif t == "int":
            args.append(1)
        elif t == "bool":
            args.append(True)
        elif t == "List[int]":
            args.append([1, 1])
        elif t == "List[bool]":
            args.append([True, True])
        else:
            raise AssertionError(f"{name}: argument type {t} not covered")
        if first is None and t in ("Tensor", "List[Tensor]"):
            first = a.name
    with pytest.raises(ValueError, match=rf"{name}: {first} must"):
        getattr(ops, name)(*args)


def test_topk_bracket_candidates_are_magnitudes():
    """A -0.0 inside the bracket came back as -0.0 (the candidates are |v|)."""
    above, cands = ops.topk_bracket([torch.tensor([-0.0, 0.5, -2.0, 0.0])], 0.0, 1.0)
    assert int(above) == 1
    assert torch.equal(cands.view(torch.int32), torch.tensor([0.0, 0.5, 0.0]).view(torch.int32))
