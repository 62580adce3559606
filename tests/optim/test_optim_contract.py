"""The torch.optim contract for PrunAdag and SFW: our own versions of the
checks PyTorch runs on its optimizers (``TestOptimRenewed`` in PyTorch's
``test/test_optim.py``), driven by the ``OptimizerInfo`` entries of
``_optim_infos.py``. Each check names the PyTorch test it follows.

Not run here, with the reason:

* complex parameters (``test_complex``, ``test_complex_2d``): rejected by
  design (``TypeError``, see ``test_errors``): prunAdag's relevant set orders
  ``|g|`` and its sets M, A compare signs (``x g > 0``), and the T-support-norm
  LMO of SFW selects real coordinates; a complex number has no sign and its
  real and imaginary parts would be selected separately.
* sparse gradients (``test_rosenbrock_sparse``) and ``differentiable=True``:
  not supported (``TypeError`` / ``ValueError``, see ``test_errors``).
* CUDA-only checks (``test_mixed_device_dtype``, ``test_fused_cpu_matches_cuda``,
  ``test_state_dict_with_cuda_params``, ``test_cpu_load_state_dict``,
  ``test_defaults_changed_to_foreach``, ``test_peak_memory_foreach``,
  ``test_set_default_dtype_works_with_foreach``,
  ``test_forloop_goes_right_direction_multigpu``): skipped without a GPU
  (``tests/ops/test_cuda_kernels.py`` covers the CUDA kernels).
* ``test_foreach_large_tensor`` / ``test_fused_large_tensor``: a 2**32-element
  parameter (PyTorch asks for 64-72 GB), beyond a test machine.
* ``test_fused_does_not_step_if_foundinf``: the fused step's ``grad_scale`` /
  ``found_inf`` attributes are the protocol of optimizers that declare
  ``_step_supports_amp_scaling``; PrunAdag and SFW do not, so
  ``torch.amp.GradScaler`` unscales the gradients and skips a non-finite step
  itself (``test_grad_scaler_unscales_and_skips_nonfinite_steps``).
* ``test_second_order_optims_return_consistent_types``: only for optimizers
  whose step requires a closure (LBFGS).
* param groups with different ``relevant`` / ``version`` (PrunAdag with
  ``scope="global"``) or ``radius`` / ``relevant`` (SFW): one global top-T set
  spans all groups, so these must agree (``ValueError``, see ``test_errors``);
  the param-group checks below vary ``lr`` and ``weight_decay`` only.
"""
from __future__ import annotations

import functools
import math
import tempfile
from copy import deepcopy

import pytest
import torch
from torch.nn import Parameter
from torch.optim.lr_scheduler import OneCycleLR, ReduceLROnPlateau
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_inputs_func_adagrad

import prunopt
from prunopt.optim import SFW, PrunAdag

from _optim_infos import all_inputs, impl_kwargs, optim_db, prunadag_info, sfw_info

needs_ext = pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built")
INFOS = pytest.mark.parametrize("info", optim_db, ids=lambda i: i.name)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Every tensor here is tiny: one thread (no parallel-region overhead)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cases(skip=()):
    return [pytest.param(info, kw, id=f"{info.name}-{desc}") for info in optim_db
            for desc, kw in all_inputs(info, skip=skip)]


def _forloop_cases():
    """Each input once, on the forloop (single-tensor) implementation."""
    return [pytest.param(info, kw, id=f"{info.name}-{desc}") for info in optim_db
            for desc, kw in all_inputs(info) if not any(kw.get(f) for f in ("foreach", "fused"))]


def _linear(dtype=torch.float32, contiguous=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        w, b = torch.randn(10, 5, generator=g, dtype=dtype), torch.randn(10, generator=g, dtype=dtype)
    else:
        w = torch.randn(10, 5, 2, generator=g, dtype=dtype)[..., 0]
        b = torch.randn(10, 2, generator=g, dtype=dtype)[..., 0]
    return Parameter(w), Parameter(b), torch.randn(5, generator=g, dtype=dtype)


def _loss(w, b, x):
    return (w.mv(x) + b).pow(2).sum()


def _assert_same(a, b, path="state_dict"):
    """Nested equality of state dicts: tensors bit for bit, the rest with ==."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, set(a), set(b))
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b), path
        torch.testing.assert_close(b, a, atol=0, rtol=0, equal_nan=True, msg=path)
    else:
        assert a == b, (path, a, b)


# keys one global top-T set needs equal in every group (given to the constructor, not to a group)
_GLOBAL_KEYS = {"PrunAdag": ("relevant", "version", "scope"), "SFW": ("radius", "relevant")}


def _split_global(info, kwargs):
    """(group kwargs, constructor kwargs): the implementation flags and the
    keys that must agree across groups go to the constructor."""
    keys = _GLOBAL_KEYS[info.name] + ("foreach", "fused")
    return ({k: v for k, v in kwargs.items() if k not in keys}, {k: v for k, v in kwargs.items() if k in keys})


# ---------------------------------------------------------------- construction and errors


@INFOS
def test_infos_do_not_specify_implementation_flags(info):
    """test_optim_infos_do_not_specify_global_cliquey_kwargs"""
    for inp in info.optim_inputs_func(device="cpu"):
        assert not {"foreach", "fused", "differentiable"} & set(inp.kwargs)


@INFOS
def test_errors(info):
    """test_errors: each bad input raises its error type and message, at
    construction or at the step as declared, with nothing updated by a step
    that raises."""
    for error_input in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        inp = error_input.optimizer_error_input
        if error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
            if issubclass(error_input.error_type, Warning):
                with pytest.warns(error_input.error_type, match=error_input.error_regex):
                    info.optim_cls(inp.params, **inp.kwargs)
            else:
                with pytest.raises(error_input.error_type, match=error_input.error_regex):
                    info.optim_cls(inp.params, **inp.kwargs)
        else:
            opt = info.optim_cls(inp.params, **inp.kwargs)
            before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
            state = deepcopy(opt.state_dict())
            with pytest.raises(error_input.error_type, match=error_input.error_regex):
                opt.step()
            after = [p.detach() for g in opt.param_groups for p in g["params"]]
            assert all(torch.equal(a, b) for a, b in zip(after, before)), inp.desc
            _assert_same(opt.state_dict(), state)


@pytest.mark.parametrize("info, kwargs", _cases())
def test_optimizer_can_be_printed(info, kwargs):
    """test_optimizer_can_be_printed"""
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    text = repr(info.optim_cls(params, **kwargs))
    assert info.optim_cls.__name__ in text and "Parameter Group 0" in text


# ---------------------------------------------------------------- the step goes the right way


def _direction_cases():
    """Every forloop input on contiguous and non-contiguous parameters; with
    each scheduler of the info: every SFW input (its lr is new) and PrunAdag's
    default, tensor-lr and paper inputs."""
    out = []
    for c in _forloop_cases():
        info, kwargs = c.values
        out += [pytest.param(info, kwargs, True, False, id=c.id + "-contiguous"),
                pytest.param(info, kwargs, False, False, id=c.id + "-noncontiguous")]
        if info is sfw_info or any(k in c.id for k in ("-default", "Tensor lr", "paper")):
            out.append(pytest.param(info, kwargs, True, True, id=c.id + "-lrsched"))
    return out


@pytest.mark.parametrize("info, kwargs, contiguous, with_lrsched", _direction_cases())
def test_forloop_goes_right_direction(info, kwargs, contiguous, with_lrsched):
    """test_forloop_goes_right_direction: 20 steps (with each scheduler of the
    info when asked) lower the loss, or raise it under maximize."""
    for sched_ctors in (info.scheduler_inputs if with_lrsched else [[]]):
        w, b, x = _linear(contiguous=contiguous)
        opt = info.optim_cls([w, b], **deepcopy(kwargs))
        scheds = [c(opt) for c in sched_ctors]

        def closure():
            opt.zero_grad()
            loss = _loss(w, b, x)
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(20):
            loss = opt.step(closure)
            for s in scheds:
                s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
        final = closure().item()
        assert (final > initial) if kwargs.get("maximize") else (final < initial), (initial, final)


@INFOS
def test_param_group_with_lrscheduler_goes_right_direction(info):
    """test_param_group_with_lrscheduler_goes_right_direction"""
    for sched_ctors in info.scheduler_inputs:
        w1, _, x = _linear(seed=1)
        w2, _, _ = _linear(seed=2)
        opt = info.optim_cls([{"params": [w1]}, {"params": [w2], "lr": 0.01}])
        scheds = [c(opt) for c in sched_ctors]

        def closure():
            opt.zero_grad()
            loss = (w1.mv(x) + w2.mv(x)).pow(2).sum()
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(20):
            loss = opt.step(closure)
            for s in scheds:
                s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
        assert closure().item() < initial


@pytest.mark.parametrize("info, kwargs", _cases())
def test_param_groups_lr(info, kwargs):
    """test_param_groups_lr: a group with lr ~ 0 does not move; the other goes
    the right way (its lr given in the group)."""
    kwargs = deepcopy(kwargs)
    if "lr" not in kwargs or (not torch.is_tensor(kwargs["lr"]) and kwargs["lr"] == 0):
        kwargs["lr"] = 1e-3 if info is prunadag_info else 0.1
    w, b, x = _linear()
    irrelevant = Parameter(torch.randn(2, 2))
    before = irrelevant.detach().clone()
    kwargs, outer = _split_global(info, kwargs)
    opt = info.optim_cls([dict(params=[w, b], **kwargs), dict(params=[irrelevant])], lr=1e-28, **outer)
    initial = _loss(w, b, x).item()
    for _ in range(20):
        opt.zero_grad()
        loss = _loss(w, b, x)
        loss.backward()
        irrelevant.grad = torch.rand_like(irrelevant)
        opt.step()
    final = _loss(w, b, x).item()
    assert (final > initial) if kwargs.get("maximize") else (final < initial)
    torch.testing.assert_close(irrelevant.detach(), before, atol=0, rtol=0)


@pytest.mark.parametrize("desc, kwargs", all_inputs(prunadag_info))
def test_param_groups_weight_decay(desc, kwargs):
    """test_param_groups_weight_decay (PrunAdag: SFW has no weight decay)"""
    w1, _, x = _linear(seed=1)
    w2, _, _ = _linear(seed=2)
    kwargs, outer = _split_global(prunadag_info, kwargs)
    opt = PrunAdag([dict(params=[w1], **kwargs), dict(params=[w2], **{**kwargs, "weight_decay": 0.0})], **outer)
    initial = (w1.mv(x) + w2.mv(x)).pow(2).sum().item()
    for _ in range(20):
        opt.zero_grad()
        (w1.mv(x) + w2.mv(x)).pow(2).sum().backward()
        opt.step()
    final = (w1.mv(x) + w2.mv(x)).pow(2).sum().item()
    assert (final > initial) if kwargs.get("maximize") else (final < initial)


def _tensor_lr_cases():
    out = [pytest.param(*c.values, 0, id=c.id + "-0d") for c in _cases()]
    for info in optim_db:
        out += [pytest.param(info, kw, d, id=f"{info.name}-{desc}-{d}d") for desc, kw in all_inputs(info)[:3]
                for d in (1, 2)]
    return out


@pytest.mark.parametrize("info, kwargs, num_dim", _tensor_lr_cases())
def test_tensor_lr(info, kwargs, num_dim):
    """test_tensor_lr: a one-element tensor lr of any shape gives the steps a
    float lr of the same value gives."""
    kwargs = deepcopy(kwargs)
    kwargs.pop("lr", None)
    w, b, x = _linear()
    wc, bc = (Parameter(t.detach().clone()) for t in (w, b))
    opt = info.optim_cls([w, b], lr=1e-3, **kwargs)
    opt_t = info.optim_cls([wc, bc], lr=torch.tensor(1e-3).reshape([1] * num_dim), **kwargs)
    for _ in range(5):
        for o, (pw, pb) in ((opt, (w, b)), (opt_t, (wc, bc))):
            o.zero_grad()
            _loss(pw, pb, x).backward()
            o.step()
        torch.testing.assert_close(wc, w)
        torch.testing.assert_close(bc, b)


# ---------------------------------------------------------------- implementations agree


def _compare_impls(info, kwargs, flag, dtype, tol=None):
    """_test_derived_optimizers / _compare_between: the flagged implementation
    against the forloop over 7 steps of a small network with an empty last
    parameter, a step without gradients (i == 2) and a layer frozen for two
    steps (i == 3, 4); parameters and every state tensor are compared and
    re-aligned after each step (so differences cannot accumulate)."""
    models, opts = [], []
    for value in (False, True):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                                    torch.nn.Sigmoid()).to(dtype)
        empty = torch.empty((), dtype=dtype, requires_grad=True)
        empty.grad = torch.rand_like(empty)
        opts.append(info.optim_cls(list(model.parameters()) + [empty], **{**deepcopy(kwargs), flag: value}))
        models.append(model)
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
    for i in range(7):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            if i == 3:
                model[2].requires_grad_(False)
            if i == 5:
                model[2].requires_grad_(True)
            if i != 2:
                model(x).sum().backward()
            opt.step()
        for p_ref, p_new in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(p_new, p_ref, **(tol or {}))
            st_ref, st_new = opts[0].state[p_ref], opts[1].state[p_new]
            assert set(st_ref) == set(st_new)
            for key in st_ref:
                torch.testing.assert_close(st_new[key], st_ref[key], **(tol or {}))
                with torch.no_grad():
                    st_new[key].copy_(st_ref[key])
            with torch.no_grad():
                p_new.copy_(p_ref)


@pytest.mark.parametrize("desc, kwargs", [(d, k) for d, k in all_inputs(prunadag_info) if not k.get("foreach")
                                           and not k.get("fused")])
def test_foreach_matches_forloop(desc, kwargs):
    """test_foreach_matches_forloop (float64)"""
    _compare_impls(prunadag_info, kwargs, "foreach", torch.float64)


_FUSED_TOL = {torch.float64: None, torch.float32: None,
              # the forloop computes in the reduced dtype, the fused kernel in
              # float32 (PyTorch's tolerances for Adagrad's fused check)
              torch.bfloat16: dict(atol=5e-3, rtol=5e-3), torch.float16: dict(atol=5e-3, rtol=5e-3)}


def _compare_fused_reduced_with_float32(kwargs, dtype):
    """The fused step on float16/bfloat16 parameters against the fused float32
    step on the same values, state and gradients, upcast: equal after rounding
    to the dtype, bit for bit (parameters and every state tensor), over the 7
    steps of :func:`_compare_impls` (an empty parameter, a step without
    gradients, a layer frozen for two steps). The float32 run restarts from
    the rounded values before each step."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                                torch.nn.Sigmoid()).to(dtype)
    empty = torch.zeros((), dtype=dtype, requires_grad=True)  # compared too: no uninitialised value (NaN)
    empty.grad = torch.rand_like(empty)
    params = list(model.parameters()) + [empty]
    wide = [Parameter(p.detach().float()) for p in params]
    opt = PrunAdag(params, fused=True, **deepcopy(kwargs))
    ref = PrunAdag(wide, fused=True, **deepcopy(kwargs))
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
    for i in range(7):
        opt.zero_grad()
        if i == 3:
            model[2].requires_grad_(False)
        if i == 5:
            model[2].requires_grad_(True)
        if i != 2:
            model(x).sum().backward()
        with torch.no_grad():
            for p, w in zip(params, wide):
                w.copy_(p)
                w.grad = None if p.grad is None else p.grad.float()
                for key, t in opt.state[p].items():
                    ref.state[w][key] = t.float() if t.is_floating_point() and key != "step" else t.clone()
        opt.step()
        ref.step()
        for k, (p, w) in enumerate(zip(params, wide)):
            torch.testing.assert_close(p.detach(), w.detach().to(dtype), atol=0, rtol=0, msg=f"step {i} param {k}")
            assert set(opt.state[p]) == set(ref.state[w])
            for key, t in opt.state[p].items():
                assert t.dtype == (dtype if key != "step" else ref.state[w][key].dtype), (key, t.dtype)
                want = ref.state[w][key].to(t.dtype)
                torch.testing.assert_close(t, want, atol=0, rtol=0, msg=f"step {i} param {k} {key}")


@needs_ext
@pytest.mark.parametrize("dtype", list(_FUSED_TOL), ids=str)
@pytest.mark.parametrize("desc, kwargs", [(d, k) for d, k in all_inputs(prunadag_info) if not k.get("foreach")
                                           and not k.get("fused")])
def test_fused_matches_forloop(desc, kwargs, dtype):
    """test_fused_matches_forloop (float64, float32, bfloat16, float16).

    In float16/bfloat16 with ``relevant < 1`` the fused step is checked
    against the fused float32 step rounded once instead (by design): the
    forloop rounds g + wd x, s and the bounds a, b to the dtype, the fused
    kernel computes them in float32 (as torch's fused Adagrad), so an element
    near a threshold of R, A or D can take the other branch in the forloop,
    and its update differs by far more than rounding. The float32 step itself
    is checked against the forloop in float32."""
    kwargs = {k: v for k, v in kwargs.items() if k != "foreach"}
    if dtype in (torch.float16, torch.bfloat16) and kwargs.get("relevant", 0.1) != 1.0:
        kwargs.pop("fused")
        _compare_fused_reduced_with_float32(kwargs, dtype)
        return
    _compare_impls(prunadag_info, kwargs, "fused", dtype, _FUSED_TOL[dtype])


@needs_ext
def test_fused_error_on_params_on_meta():
    """test_fused_error_on_params_on_meta: meta parameters raise at the fused
    step (RuntimeError, torch's message); once materialised the step runs."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1))
    opt = PrunAdag(model.parameters(), fused=True)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point Tensors"):
        opt.step()
    opt.zero_grad(set_to_none=True)
    model.to_empty(device="cpu")  # new Parameter objects: the optimizer still holds the meta ones
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    opt.step()
    # an optimizer over materialised (not meta) parameters whose state was
    # created on the meta device: the state starts afresh on the parameters' device
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(3))]
    opt = PrunAdag(params, fused=True, initial_accumulator_value=0.1)
    for p in params:
        opt.state[p] = {k: v.to("meta") for k, v in opt.state[p].items()}
        p.grad = torch.rand_like(p)
    opt.step()
    assert all(not t.is_meta for s in opt.state.values() for t in s.values())
    assert all(s["step"].item() == 1 for s in opt.state.values())


@pytest.mark.parametrize("desc, kwargs", [(i.desc, i.kwargs) for i in optim_inputs_func_adagrad("cpu")])
@pytest.mark.parametrize("impl", [i for i, _ in impl_kwargs(prunadag_info)])
def test_relevant_one_is_adagrad_for_torch_adagrad_inputs(desc, kwargs, impl):
    """PrunAdag(relevant=1.0) with each of PyTorch's own Adagrad test inputs
    (``optim_inputs_func_adagrad``) is torch.optim.Adagrad, on every path."""
    flags = dict(impl_kwargs(prunadag_info))[impl]
    w, b, x = _linear()
    wc, bc = (Parameter(t.detach().clone()) for t in (w, b))
    ref = torch.optim.Adagrad([w, b], **deepcopy(kwargs))
    opt = PrunAdag([wc, bc], relevant=1.0, **deepcopy(kwargs), **flags)
    for _ in range(5):
        for o, (pw, pb) in ((ref, (w, b)), (opt, (wc, bc))):
            o.zero_grad()
            _loss(pw, pb, x).backward()
            o.step()
        torch.testing.assert_close(wc, w, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(bc, b, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(opt.state[wc]["sum"], ref.state[w]["sum"])


def _scaler_cases():
    """Every input on the forloop; the default input on each implementation."""
    out = _forloop_cases()
    for info in optim_db:
        out += [pytest.param(info, kw, id=f"{info.name}-{desc}")
                for desc, kw in all_inputs(info)[1:len(impl_kwargs(info))]]
    return out


@pytest.mark.parametrize("info, kwargs", _scaler_cases())
def test_grad_scaler_unscales_and_skips_nonfinite_steps(info, kwargs):
    """Under ``torch.amp.GradScaler`` (the CPU one) the optimizer takes the
    unscaled step (that of an unscaled run) and a step whose scaled gradients
    overflow is skipped, the scale halved, the state untouched."""
    w, b, x = _linear()
    wc, bc = (Parameter(t.detach().clone()) for t in (w, b))
    opt = info.optim_cls([w, b], **deepcopy(kwargs))
    ref = info.optim_cls([wc, bc], **deepcopy(kwargs))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    for i in range(4):
        opt.zero_grad()
        loss = _loss(w, b, x) * (math.inf if i == 2 else 1.0)
        scaler.scale(loss).backward()
        state = deepcopy(opt.state_dict())
        scaler.step(opt)
        scaler.update()
        if i == 2:
            assert scaler.get_scale() == 2.0 ** 9
            _assert_same(opt.state_dict(), state)
        else:
            ref.zero_grad()
            _loss(wc, bc, x).backward()
            ref.step()
        torch.testing.assert_close(w, wc, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(b, bc, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- no-op steps, grads untouched


@pytest.mark.parametrize("info, kwargs", _cases())
def test_step_is_noop_when_params_have_no_grad(info, kwargs):
    """test_step_is_noop_when_params_have_no_grad"""
    params = [torch.randn(2, 3) for _ in range(2)]
    before = [p.clone() for p in params]
    opt = info.optim_cls(params, **kwargs)
    assert opt.step(lambda: torch.tensor([1.0])).item() == 1.0
    assert all(torch.equal(p, q) for p, q in zip(params, before))


@pytest.mark.parametrize("info, kwargs", _cases())
def test_step_is_noop_for_zero_grads(info, kwargs):
    """test_step_is_noop_for_zero_grads (inputs with weight decay excepted, as
    in PyTorch: the decay moves the parameters). For SFW a zero direction has a
    zero Frank-Wolfe gap and leaves the parameters where they are."""
    if kwargs.get("weight_decay", 0) != 0:
        pytest.skip("weight decay moves the parameters without a gradient")
    param = torch.randn(5, 1, requires_grad=True)
    before = param.detach().clone()
    opt = info.optim_cls([param], **kwargs)
    param.grad = torch.zeros_like(param)
    opt.step(lambda: torch.tensor([1.0]))
    torch.testing.assert_close(param.detach(), before, atol=0, rtol=0)


@pytest.mark.parametrize("info, kwargs", _cases())
def test_grads_are_never_inplaced_into(info, kwargs):
    """test_grads_are_never_inplaced_into"""
    param = torch.randn(5, 1, requires_grad=True)
    opt = info.optim_cls([param], **kwargs)
    param.grad = torch.rand_like(param)
    version, grad = param.grad._version, param.grad.clone()
    for _ in range(5):
        opt.step()
        assert param.grad._version == version
    assert torch.equal(param.grad, grad)


@pytest.mark.parametrize("info, kwargs", _cases())
def test_non_empty_state(info, kwargs):
    """test_non_empty_state"""
    model = torch.nn.Linear(5, 5, bias=False)
    opt = info.optim_cls(model.parameters(), **kwargs)
    model(torch.rand(2, 5)).sum().backward()
    opt.step()
    assert opt.state and all(len(s) > 0 for s in opt.state.values())


# ---------------------------------------------------------------- state dicts


def _make_named(params, named):
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


def _named_cases():
    """Every input unnamed; the default input of each optimizer with every
    combination of named and unnamed parameters."""
    out = [pytest.param(*c.values, False, False, id=c.id + "-unnamed") for c in _cases()]
    for info in optim_db:
        desc, kw = all_inputs(info)[0]
        out += [pytest.param(info, kw, n0, n1, id=f"{info.name}-{desc}-named{int(n0)}{int(n1)}")
                for n0, n1 in ((True, False), (False, True), (True, True))]
    return out


@pytest.mark.parametrize("info, kwargs, named0, named1", _named_cases())
def test_state_dict_deterministic(info, kwargs, named0, named1):
    """test_state_dict_deterministic: a deep copy of the state dict loaded into
    a fresh optimizer over equal (not identical) parameters continues exactly
    like the original; the state dicts then agree (param names aside)."""
    w = Parameter(torch.randn(2, 3))
    b = Parameter(torch.randn(2))
    x = torch.randn(3)

    def fwd_bwd(opt, w, b):
        opt.zero_grad()
        loss = (w.mv(x) + b).pow(2).sum()
        loss.backward()
        return loss

    opt = info.optim_cls(_make_named([w, b], named0), **deepcopy(kwargs))
    for _ in range(5):
        opt.step(functools.partial(fwd_bwd, opt, w, b))
    wc, bc = Parameter(w.detach().clone()), Parameter(b.detach().clone())
    opt_c = info.optim_cls(_make_named([wc, bc], named1), **deepcopy(kwargs))
    opt_c.load_state_dict(deepcopy(opt.state_dict()))
    for _ in range(5):
        opt.step(functools.partial(fwd_bwd, opt, w, b))
        opt_c.step(functools.partial(fwd_bwd, opt_c, wc, bc))
        torch.testing.assert_close(wc, w, atol=0, rtol=0)
        torch.testing.assert_close(bc, b, atol=0, rtol=0)

    def without_names(sd):
        sd = deepcopy(sd)
        for g in sd["param_groups"]:
            g.pop("param_names", None)
        return sd

    _assert_same(without_names(opt_c.state_dict()), without_names(opt.state_dict()))
    opt_c.param_groups.extend(opt_c.param_groups)  # repeated groups: identical representation
    assert without_names(opt.state_dict())["param_groups"][-1] == without_names(opt_c.state_dict())["param_groups"][-1]


def _conv_bn():
    """A convolution and a batch norm (parameters of four shapes, buffers that
    are not parameters), small."""
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2)), torch.rand(2, 4, 4, 4)


@pytest.mark.parametrize("info, kwargs", _cases())
def test_can_load_older_state_dict(info, kwargs):
    """test_can_load_older_state_dict: a state dict without the flags added
    after the first release (and, for PrunAdag, without the prunAdag keys and
    ``decrease_sum``, as a torch.optim.Adagrad one) loads and steps."""
    model, x = _conv_bn()
    opt = info.optim_cls(model.parameters(), **deepcopy(kwargs))
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    old = deepcopy(opt.state_dict())
    extra = ("relevant", "version", "scope", "prune") if info is prunadag_info else ()
    for group in old["param_groups"]:
        for flag in info.not_og_supported_flags + extra:
            group.pop(flag, None)
    if info is prunadag_info:
        for s in old["state"].values():
            s.pop("decrease_sum")
    opt.load_state_dict(old)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if info is prunadag_info:
        assert all("decrease_sum" in s for s in opt.state.values())
        assert opt.param_groups[0]["relevant"] == opt.defaults["relevant"]


@pytest.mark.parametrize("named0, named1", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("info", optim_db, ids=lambda i: i.name)
def test_can_load_from_to_named_state_dict(info, named0, named1):
    """test_can_load_from_to_named_state_dict (the default input on each
    implementation: names do not interact with the hyper-parameters)"""
    for desc, kwargs in all_inputs(info)[:len(impl_kwargs(info))]:
        model, x = _conv_bn()
        opt = info.optim_cls(model.named_parameters() if named0 else model.parameters(), **deepcopy(kwargs))
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        opt2 = info.optim_cls(model.named_parameters() if named1 else model.parameters(), **deepcopy(kwargs))
        opt2.load_state_dict(deepcopy(opt.state_dict()))
        opt2.zero_grad()
        model(x).sum().backward()
        opt2.step()
        if named0 or named1:
            assert opt2.state_dict()["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize("info, kwargs", _cases())
def test_save_load_equality_with_weights_only(info, kwargs):
    """test_save_load_equality_with_weights_only"""
    w, b, x = _linear()
    opt = info.optim_cls([w, b], **deepcopy(kwargs))
    for _ in range(3):
        opt.zero_grad()
        _loss(w, b, x).backward()
        opt.step()
    sd = opt.state_dict()
    with tempfile.TemporaryFile() as f:
        torch.save(sd, f)
        f.seek(0)
        _assert_same(torch.load(f, weights_only=True), sd)


@pytest.mark.parametrize("info, kwargs", _cases())
def test_load_nontensor_step(info, kwargs):
    """test_load_nontensor_step: Python-number step counts load as tensors and
    the optimizer goes on as with tensor ones."""
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    opt = info.optim_cls(params, **deepcopy(kwargs))
    for _ in range(3):
        opt.step()
    sd = deepcopy(opt.state_dict())
    ref_params = [Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, ref_params):
        q.grad = p.grad.clone()
    ref = info.optim_cls(ref_params, **deepcopy(kwargs))
    ref.load_state_dict(deepcopy(sd))  # tensor step counts
    for s in sd["state"].values():
        s["step"] = s["step"].item()
    opt.load_state_dict(sd)
    assert all(torch.is_tensor(s["step"]) for s in opt.state.values())
    opt.step()
    ref.step()
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


@pytest.mark.parametrize("info", optim_db, ids=lambda i: i.name)
@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_invalid_step_count_in_state_dict(info, bad):
    """A state dict with a step count that is not finite and >= 0 raises
    ValueError (PrunAdag: ``lr_k / (k + 1)`` divides by ``k + 1``; SFW: FW1's
    ``1 / (k + 1)``) and the optimizer keeps its state."""
    p = Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    opt = info.optim_cls([p])
    opt.step()
    sd = deepcopy(opt.state_dict())
    sd["state"][0]["step"] = torch.tensor(bad)
    with pytest.raises(ValueError, match="step"):
        opt.load_state_dict(sd)
    assert opt.state[p]["step"].item() == 1


@pytest.mark.parametrize("info, kwargs", _cases())
def test_deepcopy_copies_all_public_attrs(info, kwargs):
    """test_deepcopy_copies_all_public_attrs"""
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    opt = info.optim_cls(params, **kwargs)
    for _ in range(3):
        opt.step()

    def public(o):
        return {k for k in o.__dict__ if not k.startswith("_")}

    assert public(opt) == public(deepcopy(opt))


# ---------------------------------------------------------------- hooks


@pytest.mark.parametrize("info, kwargs", _cases())
def test_step_hooks(info, kwargs):
    """test_step_pre_hook, test_step_post_hook, test_step_all_hooks: local and
    global hooks fire in order around each step and not after removal."""
    params = [torch.tensor([[1.0, 1.0]])]
    opt = info.optim_cls(params, **kwargs)
    other = torch.optim.SGD(params)
    data = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
               register_optimizer_step_post_hook(lambda o, a, k: data.append(5)),
               opt.register_step_pre_hook(lambda o, a, k: data.append(1)),
               opt.register_step_post_hook(lambda o, a, k: data.append(2)),
               other.register_step_pre_hook(lambda o, a, k: data.append(3)),
               other.register_step_post_hook(lambda o, a, k: data.append(4))]
    try:
        opt.step()
        other.step()
        opt.step()
    finally:
        for h in handles:
            h.remove()
    assert data == [0, 1, 2, 5, 0, 3, 4, 5, 0, 1, 2, 5]
    opt.step()
    other.step()
    assert len(data) == 12


@pytest.mark.parametrize("info, kwargs", _cases())
def test_state_dict_hooks(info, kwargs):
    """test_state_dict_pre_hook, test_state_dict_post_hook,
    test_load_state_dict_pre_hook_and_prepend, test_load_state_dict_post_hook"""
    param = torch.rand(2, 3, requires_grad=True)
    opt = info.optim_cls([param], **kwargs)

    def pre(o):
        o.state["test"] = 1

    def post(o, sd):
        sd["ran_pre_hook"] = sd["state"].pop("test", None) == 1
        return sd

    opt.register_state_dict_pre_hook(pre)
    assert opt.state_dict()["state"]["test"] == 1
    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert sd["ran_pre_hook"] and "test" not in sd["state"]
    opt.state.pop("test")

    opt2 = info.optim_cls([param], **kwargs)
    sd = opt2.state_dict()
    opt2.register_load_state_dict_pre_hook(lambda o, s: s["param_groups"][0].__setitem__("lr", 0.002))
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.002

    def replace(o, s):
        s = deepcopy(s)
        s["param_groups"][0]["lr"] = 0.003
        return s

    opt2.register_load_state_dict_pre_hook(replace, prepend=True)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.002  # the prepended hook ran first, the other overrides it
    seen = []
    opt2.register_load_state_dict_post_hook(lambda o: seen.append(o.param_groups[0]["lr"]))
    opt2.load_state_dict(sd)
    assert seen == [0.002]


# ---------------------------------------------------------------- state follows the parameters


@pytest.mark.parametrize("impl", [i for i, _ in impl_kwargs(prunadag_info)])
def test_state_follows_a_dtype_change_like_adagrad(impl):
    """An optimizer built before ``model.double()`` carries on, as Adagrad
    does; with relevant=1.0 both give the same parameters, and PrunAdag's
    accumulators now have the parameters' dtype."""
    flags = dict(impl_kwargs(prunadag_info))[impl]
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    ref = torch.optim.Adagrad(models[0].parameters(), lr=0.1)
    opt = PrunAdag(models[1].parameters(), lr=0.1, relevant=1.0, **flags)
    x = torch.randn(5, 4)
    for step in range(4):
        if step == 2:
            for m in models:
                m.double()
            x = x.double()
        for m, o in zip(models, (ref, opt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for a, b in zip(models[1].parameters(), models[0].parameters()):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert all(s["sum"].dtype == torch.float64 and s["decrease_sum"].dtype == torch.float64
               for s in opt.state.values())


def test_sfw_state_follows_a_dtype_change():
    """SFW built before ``model.double()`` carries on: its momentum buffers take
    the parameters' dtype, and the run equals one whose parameters and buffers
    were converted to float64 by hand at the same point."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [SFW(m.parameters(), lr=0.1, momentum=0.9, rescale="gradient", relevant=0.5) for m in models]
    x = torch.randn(5, 4)
    for step in range(4):
        if step == 2:
            models[0].double()  # the optimizer is not told
            with torch.no_grad():  # the reference converts everything itself
                for p in models[1].parameters():
                    buf = opts[1].state[p]["momentum_buffer"]
                    p.data = p.data.double()
                    opts[1].state[p]["momentum_buffer"] = buf.double()
                models[1].double()
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x.to(m.weight.dtype)).pow(2).sum().backward()
            o.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert all(s["momentum_buffer"].dtype == torch.float64 for s in opts[0].state.values())


@pytest.mark.parametrize("scope", ["global", "group", "tensor"])
@pytest.mark.parametrize("impl", [i for i, _ in impl_kwargs(prunadag_info)])
def test_expanded_parameter_raises_before_any_write(impl, scope):
    """A stride-0 (expanded) parameter cannot be updated in place: the step
    raises before any parameter or state is written (it used to update the
    others first)."""
    flags = dict(impl_kwargs(prunadag_info))[impl]
    ok = [torch.randn(6, requires_grad=True), torch.randn(3, 2, requires_grad=True)]
    bad = torch.zeros(1).expand(5).requires_grad_()
    opt = PrunAdag([{"params": ok}, {"params": [bad]}], relevant=0.5, scope=scope, **flags)
    for p in ok + [bad]:
        p.grad = torch.randn(p.shape)
    before = [p.detach().clone() for p in ok]
    state = deepcopy(opt.state_dict())
    with pytest.raises(RuntimeError, match="single memory location"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ok, before))
    _assert_same(opt.state_dict(), state)


def test_sfw_expanded_parameter_raises_before_any_write():
    ok = torch.randn(6, requires_grad=True)
    bad = torch.zeros(1).expand(5).requires_grad_()
    opt = SFW([ok, bad], momentum=0.5)
    ok.grad, bad.grad = torch.randn(6), torch.randn(5)
    before = ok.detach().clone()
    with pytest.raises(RuntimeError, match="single memory location"):
        opt.step()
    assert torch.equal(ok, before) and len(opt.state) == 0


# ---------------------------------------------------------------- torch.compile


def _compile_run(make, lr_tensor, steps, eager_too=True, nan_step=False):
    """Runs torch.compile(opt.step) over a OneCycleLR schedule; returns the
    number of distinct graphs, of graph breaks, and the parameters of the
    compiled and (if asked) the eager run. The step is compiled before the
    scheduler wraps ``opt.step`` (its call counter is not traced and would add
    graph breaks of its own)."""
    import warnings

    import torch._dynamo
    from torch._dynamo.utils import counters

    def run(compiled):
        torch.manual_seed(0)
        ps = [torch.randn(30, 20, requires_grad=True), torch.randn(20, requires_grad=True)]
        opt = make(ps, torch.tensor(0.01) if lr_tensor else 0.01)
        step = torch.compile(opt.step) if compiled else opt.step
        sched = OneCycleLR(opt, max_lr=0.05, total_steps=steps + 2, cycle_momentum=False)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            step()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": see above
                sched.step()
        if compiled and nan_step:
            # a non-finite gradient under torch.compile: the step is skipped and
            # flagged (raising would need a graph break), with the same graph
            before = [p.detach().clone() for p in ps]
            steps_before = [opt.state[p]["step"].clone() for p in ps]
            ps[1].grad[3] = float("nan")
            step()
            assert all(torch.equal(p, b) for p, b in zip(ps, before))
            assert all(torch.equal(opt.state[p]["step"], s) for p, s in zip(ps, steps_before))
            assert opt.found_nonfinite.item() == 1.0
        return ps

    torch._dynamo.reset()
    counters.clear()
    out = run(True)
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    return graphs, breaks, out, (run(False) if eager_too else None)


@functools.lru_cache(maxsize=None)
def _adagrad_graphs(lr_tensor, steps):
    graphs, _, _, _ = _compile_run(lambda ps, lr: torch.optim.Adagrad(ps, lr=lr, foreach=True), lr_tensor, steps,
                                   eager_too=False)
    return graphs


@needs_ext
@pytest.mark.parametrize("lr_tensor", [False, True], ids=["float lr", "tensor lr"])
@pytest.mark.parametrize("impl", ["fused", pytest.param("foreach", marks=pytest.mark.slow)])
def test_compiled_step_no_graph_breaks_recompiles_like_adagrad(impl, lr_tensor):
    """torch.compile(optimizer.step) over an LR schedule: no graph break, no
    more distinct graphs than torch.optim.Adagrad (foreach) needs (2 with a
    float lr, 1 with a tensor lr), and the parameters of the eager run; then a
    non-finite gradient is skipped and flagged (found_nonfinite) by the same graph."""
    flags = dict(fused=True) if impl == "fused" else dict(foreach=True, fused=False)
    steps = 5
    graphs, breaks, out, eager = _compile_run(
        lambda ps, lr: PrunAdag(ps, lr=lr, relevant=0.2, weight_decay=0.01, **flags), lr_tensor, steps, nan_step=True)
    assert breaks == 0
    assert graphs <= _adagrad_graphs(lr_tensor, steps), (graphs, _adagrad_graphs(lr_tensor, steps))
    for a, b in zip(out, eager):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
