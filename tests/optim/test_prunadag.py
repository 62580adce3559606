"""PrunAdag (Porcelli et al.): the three paths against each other and against
torch.optim.Adagrad, state dicts, schedulers, compile, errors."""
import copy
import math

import pytest
import torch

import prunopt
import sys

from prunopt.optim import PrunAdag
from prunopt.optim.prunadag import prunadag
from prunopt.reference.prunadag import TensorHyper, prunadag_step_reference

needs_ext = pytest.mark.skipif(not prunopt.extension_available(), reason="compiled extension not built")

SIZES = [(3, 5), (0,), (1,), (13,), (4097,), (7, 11), (2, 3, 4)]
PATHS = ["single", "foreach"] + (["fused"] if prunopt.extension_available() else [])


def _path_kwargs(path):
    return {"single": dict(foreach=False), "foreach": dict(foreach=True, fused=False), "fused": dict(fused=True)}[path]


def _params(dtype, seed=0, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in sizes]


def _set_grads(ps, it, dtype, scale=1.0):
    g = torch.Generator().manual_seed(1000 + it)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, dtype=dtype) * scale


def _run(make_opt, dtype, steps=6, sizes=SIZES, groups=None):
    ps = _params(dtype, sizes=sizes)
    opt = make_opt(groups(ps) if groups else ps)
    for it in range(steps):
        _set_grads(ps, it, dtype)
        opt.step()
    return ps, opt


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)


def _torch_sqrt_is_ieee(dtype):
    from prunopt.reference.prunadag import _torch_sqrt_is_ieee as probe

    return dtype == torch.float64 or probe(torch.device("cpu"), dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype, hp", [(torch.float64, dict())] + [
    (torch.float32, hp) for hp in [dict(), dict(weight_decay=0.05), dict(maximize=True), dict(lr_decay=0.3),
                                   dict(initial_accumulator_value=0.5, eps=1e-3),
                                   dict(maximize=True, weight_decay=0.05)]])
def test_relevant_one_is_adagrad(path, dtype, hp):
    """prunAdag (Porcelli et al.): relevant=1.0 (T = n) is torch.optim.Adagrad step for step."""
    kw = dict(lr=0.3, initial_accumulator_value=hp.get("initial_accumulator_value", 0.01), eps=hp.get("eps", 1e-10),
              weight_decay=hp.get("weight_decay", 0.0), lr_decay=hp.get("lr_decay", 0.0), maximize=hp.get("maximize", False))
    ref, _ = _run(lambda p: torch.optim.Adagrad(p, foreach=False, **kw), dtype)
    out, _ = _run(lambda p: PrunAdag(p, relevant=1.0, **kw, **_path_kwargs(path)), dtype)
    # The single-tensor path is torch.optim.Adagrad's arithmetic except for the
    # square root, which it takes correctly rounded (reference.ieee_sqrt, as
    # the kernels): bit for bit where torch.sqrt is too (e.g. AVX-512 hosts),
    # within an ulp where torch uses its 0.5001-ulp AVX2 routine.
    exact = path == "single" and _torch_sqrt_is_ieee(dtype)
    tol = dict(atol=0, rtol=0) if exact else _tol(dtype)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, **tol)


def _groups_with_bias(ps):
    return [dict(params=ps[:4]), dict(params=ps[4:], prune=False)]


@pytest.mark.parametrize("path", [p for p in PATHS if p != "single"])
@pytest.mark.parametrize("version", [1, 2, 3, 4, "relevant_only"])
@pytest.mark.parametrize("scope, dtype, maximize", [("global", torch.float32, False), ("global", torch.float64, True),
                                                    ("group", torch.float64, False), ("tensor", torch.float32, True)])
def test_paths_match_single_tensor(path, version, scope, dtype, maximize):
    hp = dict(lr=0.5, relevant=0.15, version=version, scope=scope, weight_decay=0.01, lr_decay=0.05,
              initial_accumulator_value=0.01, eps=1e-10, maximize=maximize)
    ref, ro = _run(lambda p: PrunAdag(p, foreach=False, **hp), dtype, groups=_groups_with_bias)
    out, oo = _run(lambda p: PrunAdag(p, **hp, **_path_kwargs(path)), dtype, groups=_groups_with_bias)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, **_tol(dtype))
    for p_ref, p_out in zip(ref, out):
        for key in ("sum", "decrease_sum", "step"):
            torch.testing.assert_close(oo.state[p_out][key], ro.state[p_ref][key], **_tol(dtype))


@pytest.mark.parametrize("path", PATHS)
def test_maximize_and_int_relevant(path):
    hp = dict(lr=1.0, relevant=40, version=3, maximize=True, eps=0.0)
    ref, _ = _run(lambda p: PrunAdag(p, foreach=False, **hp), torch.float64)
    out, _ = _run(lambda p: PrunAdag(p, **hp, **_path_kwargs(path)), torch.float64)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_reference_semantics():
    """Algorithm 2.1 invariants: relevant elements take the Adagrad step; D ∩ M
    elements shrink by at most a_i without changing sign; other D elements stay."""
    torch.manual_seed(0)
    n, T = 200, 20
    x = torch.randn(n, dtype=torch.float64)
    g = torch.randn(n, dtype=torch.float64)
    so = torch.full_like(x, 0.01)
    sd = torch.full_like(x, 0.01)
    x0, so0, sd0 = x.clone(), so.clone(), sd.clone()
    hp = TensorHyper(lr=1.0, k=3.0, eps=0.0)
    prunadag_step_reference([x], [g], [so], [sd], [hp], T, 3)
    tau = g.abs().topk(T).values[-1]
    rel = g.abs() >= tau
    adagrad = x0 - g / (so0 + g * g).sqrt()
    torch.testing.assert_close(x[rel], adagrad[rel], atol=1e-14, rtol=1e-14)
    opt = so != so0
    assert torch.equal(opt, sd == sd0)  # each element updates exactly one accumulator
    dec = ~opt
    m = (~rel) & (x0 * g > 0)
    r = (g[rel].pow(2).sum().sqrt() / x0[m].pow(2).sum().sqrt()).item()
    a = x0.abs() / (hp.k + 1) * r
    assert torch.all(x[dec & m].abs() <= x0[dec & m].abs())
    assert torch.all((x0[dec & m] - x[dec & m]).abs() <= a[dec & m] + 1e-15)
    assert torch.all(torch.sign(x[dec & m]) * torch.sign(x0[dec & m]) >= 0)
    assert torch.equal(x[dec & ~m], x0[dec & ~m])
    # acceptable elements (version 3): a <= |s| <= |x|, and they moved towards 0
    acc = opt & ~rel
    s = (x - x0)[acc]
    assert torch.all(s.abs() <= x0[acc].abs() + 1e-15) and torch.all(s.abs() >= a[acc] - 1e-15)
    assert acc.any() and (dec & m).any()


@pytest.mark.parametrize("path", PATHS)
def test_state_dict_round_trip(path):
    dtype = torch.float32
    hp = dict(lr=0.5, relevant=0.2, version=1, **_path_kwargs(path))
    ps, opt = _run(lambda p: PrunAdag(p, **hp), dtype, steps=3)
    ps2 = [p.detach().clone().requires_grad_() for p in ps]
    opt2 = PrunAdag(ps2, **hp)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for it in range(3, 6):
        _set_grads(ps, it, dtype)
        _set_grads(ps2, it, dtype)
        opt.step()
        opt2.step()
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "sum", "decrease_sum"}
    assert torch.is_tensor(sd["state"][0]["step"]) and sd["state"][0]["step"].item() == 6


def test_setstate_fills_new_keys():
    ps = _params(torch.float32)
    opt = PrunAdag(ps)
    state = opt.__getstate__()
    for g in state["param_groups"]:
        for key in ("version", "scope", "prune", "relevant"):
            g.pop(key)
    opt2 = PrunAdag(_params(torch.float32))
    opt2.__setstate__(state)
    assert opt2.param_groups[0]["version"] == 3 and opt2.param_groups[0]["scope"] == "global"


@pytest.mark.parametrize("path", PATHS)
def test_lr_scheduler(path):
    dtype = torch.float64
    ps = _params(dtype)
    opt = PrunAdag(ps, lr=1.0, relevant=0.2, **_path_kwargs(path))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ps2 = _params(dtype)
    opt2 = PrunAdag(ps2, lr=1.0, relevant=0.2, foreach=False)
    for it in range(5):
        _set_grads(ps, it, dtype)
        _set_grads(ps2, it, dtype)
        opt.step()
        sched.step()
        opt2.step()
        opt2.param_groups[0]["lr"] = 1.0 * 0.5 ** ((it + 1) // 2)
    assert opt.param_groups[0]["lr"] == 0.25
    for a, b in zip(ps, ps2):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_functional_matches_class():
    dtype = torch.float64
    ps, _ = _run(lambda p: PrunAdag(p, lr=0.5, relevant=0.1, version=4, initial_accumulator_value=0.01,
                                    foreach=False), dtype)
    ps2 = _params(dtype)
    so = [torch.full_like(p, 0.01) for p in ps2]
    sd = [torch.full_like(p, 0.01) for p in ps2]
    steps = [torch.tensor(0.0) for _ in ps2]
    for it in range(6):
        _set_grads(ps2, it, dtype)
        with torch.no_grad():
            prunadag([p for p in ps2], [p.grad for p in ps2], so, sd, steps, lr=0.5, relevant=0.1, version=4)
    for a, b in zip(ps, ps2):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert steps[0].item() == 6


def test_fallback_without_extension(monkeypatch):
    """Without the extension the default path is, as in torch.optim, the
    single-tensor loop on the CPU (foreach on CUDA), and results agree."""
    pa_mod = sys.modules["prunopt.optim.prunadag"]
    monkeypatch.setattr(pa_mod, "extension_available", lambda: False)
    assert pa_mod._choose_impl([torch.zeros(3)], None, None) == "single"
    assert pa_mod._choose_impl([torch.zeros(3)], True, None) == "foreach"
    with pytest.raises(RuntimeError, match="fused"):
        PrunAdag(_params(torch.float32), fused=True)
    out, _ = _run(lambda p: PrunAdag(p, relevant=0.2), torch.float64)
    ref, _ = _run(lambda p: PrunAdag(p, relevant=0.2, foreach=False), torch.float64)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p != "fused" else p
                                  for p in PATHS if p != "foreach"])  # foreach: same Python ops, 40 s to compile
def test_compiled_step(path):
    dtype = torch.float32
    ps, opt = _params(dtype), None
    ps2 = _params(dtype)
    opt = PrunAdag(ps, lr=0.3, relevant=0.2, lr_decay=0.1, **_path_kwargs(path))
    opt2 = PrunAdag(ps2, lr=0.3, relevant=0.2, lr_decay=0.1, **_path_kwargs(path))

    @torch.compile(backend="inductor")
    def compiled_step():
        opt.step()

    for it in range(3):
        _set_grads(ps, it, dtype)
        _set_grads(ps2, it, dtype)
        compiled_step()
        opt2.step()
    for a, b in zip(ps, ps2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(relevant=0.0), "relevant"),
        (dict(relevant=-0.5), "relevant"),
        (dict(relevant=1.5), "relevant"),
        (dict(relevant=0), "relevant"),
        (dict(relevant=10**9), "relevant"),
        (dict(version=5), "version"),
        (dict(version="v3"), "version"),
        (dict(scope="layer"), "scope"),
        (dict(lr=-1.0), "lr"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(lr_decay=-0.1), "lr_decay"),
        (dict(initial_accumulator_value=-1.0), "initial_accumulator_value"),
        (dict(lr=torch.tensor([0.1, 0.2])), "Tensor lr must be 1-element"),
        (dict(differentiable=True), "differentiable"),
    ],
)
def test_invalid_hyper_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrunAdag(_params(torch.float32), **kwargs)


def test_flag_errors_are_torch_optims():
    """torch.optim.Adagrad's error types and messages for its flags."""
    for cls in (torch.optim.Adagrad, PrunAdag):
        with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
            cls(_params(torch.float32), foreach=True, fused=True)
        with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
            cls(_params(torch.float32), lr=torch.tensor([0.1, 0.2]))
        with pytest.raises(ValueError, match="Invalid lr_decay value: -0.5"):
            cls(_params(torch.float32), lr_decay=-0.5)
        with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
            cls(_params(torch.float32), lr=-1.0)


def test_signature_defaults_and_flags_are_adagrads():
    """Adagrad's positional parameters, defaults and flags; the prunAdag
    arguments are keyword-only (a fourth positional is weight_decay, as in
    Adagrad, never relevant)."""
    import inspect

    sig, ada = inspect.signature(PrunAdag), inspect.signature(torch.optim.Adagrad)
    for name, p in ada.parameters.items():
        assert sig.parameters[name].kind == p.kind and sig.parameters[name].default == p.default, name
    assert list(sig.parameters)[:len(ada.parameters)] == list(ada.parameters)
    for name in ("relevant", "version", "scope"):
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
    ps = _params(torch.float32, sizes=[(4, 5)])
    ref = [p.detach().clone().requires_grad_() for p in ps]
    opt = PrunAdag(ps, 0.1, 0.0, 0.5, 0.2, relevant=1.0)  # lr, lr_decay, weight_decay, initial_accumulator_value
    ada_opt = torch.optim.Adagrad(ref, 0.1, 0.0, 0.5, 0.2)
    group, ada_group = opt.param_groups[0], ada_opt.param_groups[0]
    assert {k: v for k, v in group.items() if k in ada_group and k != "params"} == \
        {k: v for k, v in ada_group.items() if k != "params"}
    for it in range(3):
        _set_grads(ps, it, torch.float32)
        _set_grads(ref, it, torch.float32)
        opt.step()
        ada_opt.step()
    torch.testing.assert_close(ps[0], ref[0])


def test_default_is_adagrad_default():
    """PrunAdag(params, relevant=1.0) with every other argument at its default
    is torch.optim.Adagrad(params) (initial_accumulator_value 0, not the
    paper's 0.01), on every path."""
    for path in PATHS:
        ref, _ = _run(lambda p: torch.optim.Adagrad(p), torch.float64)
        out, _ = _run(lambda p: PrunAdag(p, relevant=1.0, **_path_kwargs(path)), torch.float64)
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-14)


@pytest.mark.parametrize("path", PATHS)
def test_maximize_with_weight_decay_shrinks_like_adagrad(path):
    """maximize flips the sign first, then weight decay is added: a zero
    gradient with weight decay shrinks |x| when maximising too."""
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    y = x.detach().clone().requires_grad_()
    opt = PrunAdag([x], lr=0.1, relevant=1.0, weight_decay=1.0, maximize=True, **_path_kwargs(path))
    ada = torch.optim.Adagrad([y], lr=0.1, weight_decay=1.0, maximize=True)
    x.grad, y.grad = torch.zeros(2), torch.zeros(2)
    opt.step()
    ada.step()
    torch.testing.assert_close(x.detach(), torch.tensor([0.9, -1.9]))
    torch.testing.assert_close(x, y)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_functional_rejects_bad_step_counts(path, bad):
    """prunadag(...) with a step count that is not finite and >= 0: ValueError,
    nothing written (it used to divide by zero, or turn every parameter NaN)."""
    x = [torch.randn(5), torch.randn(3)]
    x0 = [t.clone() for t in x]
    so = [torch.full_like(t, 0.01) for t in x]
    sd = [torch.full_like(t, 0.01) for t in x]
    steps = [torch.tensor(2.0), torch.tensor(bad)]
    with pytest.raises(ValueError, match="step"):
        prunadag(x, [torch.randn(5), torch.randn(3)], so, sd, steps, relevant=0.5, **_path_kwargs(path))
    assert all(torch.equal(a, b) for a, b in zip(x, x0))
    assert steps[0].item() == 2.0
    assert all(torch.equal(t, torch.full_like(t, 0.01)) for t in so + sd)


def test_paper_settings_are_documented_and_used_by_repro():
    doc = PrunAdag.__doc__
    assert "lr=1.0, eps=0.0, initial_accumulator_value=0.01" in doc
    from prunopt.repro.prunadag import make_optimizer

    opt = make_optimizer("V3", torch.zeros(10, dtype=torch.float64, requires_grad=True), 2)
    g = opt.param_groups[0]
    assert (g["lr"], g["eps"], g["initial_accumulator_value"]) == (1.0, 0.0, 0.01)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_reduced_precision_is_float32_rounded_once(dtype):
    """fused=True on float16/bfloat16 as torch.optim.Adagrad(fused=True) does
    it: the float32 step on the stored values, parameters and accumulators
    rounded once to the dtype (bit for bit), state in the parameters' dtype."""
    ps = [p.detach().to(dtype).requires_grad_() for p in _params(torch.float32, sizes=[(70, 30), (13,)])]
    ref = [p.detach().float().requires_grad_() for p in ps]
    kw = dict(lr=0.05, relevant=0.2, weight_decay=0.01, maximize=True, initial_accumulator_value=0.01, fused=True)
    opt, opt_ref = PrunAdag(ps, **kw), PrunAdag(ref, **kw)
    for p, r in zip(ps, ref):  # the accumulators start at 0.01 rounded to the dtype
        for key in ("sum", "decrease_sum"):
            opt_ref.state[r][key].copy_(opt.state[p][key])
    for it in range(4):
        _set_grads(ps, it, dtype)
        for p, r in zip(ps, ref):
            r.grad = p.grad.float()
        opt.step()
        opt_ref.step()
        for p, r in zip(ps, ref):
            assert opt.state[p]["sum"].dtype == dtype and opt.state[p]["decrease_sum"].dtype == dtype
            assert torch.equal(p.detach(), r.detach().to(dtype))
            for key in ("sum", "decrease_sum"):
                assert torch.equal(opt.state[p][key], opt_ref.state[r][key].to(dtype))
            with torch.no_grad():  # the float32 run continues from the rounded values
                r.copy_(p)
                for key in ("sum", "decrease_sum"):
                    opt_ref.state[r][key].copy_(opt.state[p][key])


def test_invalid_param_groups():
    ps = _params(torch.float32)
    with pytest.raises(ValueError, match="scope"):
        PrunAdag([dict(params=ps[:2], scope="tensor"), dict(params=ps[2:])])
    with pytest.raises(ValueError, match="relevant"):
        PrunAdag([dict(params=ps[:2], relevant=0.5), dict(params=ps[2:])])
    with pytest.raises(TypeError, match="relevant"):
        PrunAdag(ps, relevant="many")
    opt = PrunAdag(ps[:2])
    with pytest.raises(ValueError, match="version"):
        opt.add_param_group(dict(params=ps[2:], version=7))
    assert len(opt.param_groups) == 1


def test_int_relevant_larger_than_scope_raises_before_update():
    ps = _params(torch.float32, sizes=[(3,), (50,)])
    opt = PrunAdag(ps, relevant=10, scope="tensor")
    _set_grads(ps, 0, torch.float32)
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ValueError, match="relevant"):
        opt.step()
    for p, b in zip(ps, before):
        assert torch.equal(p, b)


def test_float_relevant_is_the_decimal_fraction():
    """T = ceil(relevant * n) for the decimal the user wrote: 0.07 of 100 is 7
    (the float product is 7.000000000000001), on every path."""
    from prunopt.reference.prunadag import resolve_relevant

    for pct in range(1, 101):
        for n in (100, 300, 1000, 70_000):
            assert resolve_relevant(pct / 100, n) == pct * n // 100, (pct, n)
    assert resolve_relevant(0.5, 2_000_000_001) == 1_000_000_001  # a real excess rounds up
    assert resolve_relevant(0.1 + 1e-12, 10) == 2
    assert resolve_relevant(1e-9, 10) == 1 and resolve_relevant(0.3, 0) == 0
    # the optimizer relevant-selects exactly 7 of 100 distinct |g| (ties none)
    for path in PATHS:
        p = torch.zeros(100, requires_grad=True)
        p.grad = torch.arange(1.0, 101.0)
        PrunAdag([p], lr=1.0, relevant=0.07, initial_accumulator_value=0.0, **_path_kwargs(path)).step()
        assert int((p != 0).sum()) == 7, path  # x = 0: only R moves (M needs x g > 0)


@pytest.mark.parametrize("path", PATHS)
def test_sparse_and_complex_grads(path):
    p = torch.randn(5, requires_grad=True)
    opt = PrunAdag([p], **_path_kwargs(path))
    p.grad = torch.randn(5).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    c = torch.randn(5, dtype=torch.complex64, requires_grad=True)
    opt = PrunAdag([c], foreach=False)
    c.grad = torch.randn(5, dtype=torch.complex64)
    with pytest.raises(TypeError, match="complex"):
        opt.step()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad, scope", [(math.nan, "global"), (-math.inf, "global"), (math.inf, "tensor")])
def test_non_finite_grad_skips_step_and_raises(path, bad, scope):
    """Documented: a non-finite gradient rejects the whole step (ValueError) and
    leaves every parameter, accumulator and step counter unchanged."""
    dtype = torch.float32
    ps = _params(dtype)
    opt = PrunAdag([dict(params=ps[:5]), dict(params=ps[5:], prune=False)], relevant=0.3, scope=scope,
                   **_path_kwargs(path))
    _set_grads(ps, 0, dtype)
    opt.step()
    _set_grads(ps, 1, dtype)
    ps[-1].grad.view(-1)[3] = bad
    before = [p.detach().clone() for p in ps]
    state = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()
    for p, b in zip(ps, before):
        assert torch.equal(p, b)
    after = opt.state_dict()
    for k, s in state["state"].items():
        for key in s:
            assert torch.equal(after["state"][k][key], s[key])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["first", "last", "preset"])
def test_non_finite_flag_mode_skips_without_raising(path, where):
    """The no-sync mode PrunAdag uses on CUDA, run on the CPU through the
    functional form: a non-finite gradient (or a flag already set by an earlier
    part of the step) writes nothing, sets the flag and does not advance the
    step counters; a finite step leaves the flag at 0 and matches the raising mode."""
    dtype = torch.float32
    ps = [p.detach() for p in _params(dtype, sizes=(70_000, 13, 4097))]
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=g) for p in ps]
    so = [torch.full_like(p, 0.01) for p in ps]
    sd = [torch.full_like(p, 0.01) for p in ps]
    steps = [torch.tensor(2.0) for _ in ps]
    kw = dict(lr=0.3, relevant=0.1, version=3, **_path_kwargs(path))

    ref = [[t.clone() for t in lst] for lst in (ps, so, sd, steps)]
    prunadag(ref[0], grads, ref[1], ref[2], ref[3], **kw)
    flag = torch.zeros(1)
    out = [[t.clone() for t in lst] for lst in (ps, so, sd, steps)]
    prunadag(out[0], grads, out[1], out[2], out[3], found_nonfinite=flag, **kw)
    assert flag.item() == 0.0
    for lo, lr in zip(out, ref):
        for a, b in zip(lo, lr):
            assert torch.equal(a, b)

    flag = torch.ones(1) if where == "preset" else torch.zeros(1)
    bad = [gr.clone() for gr in grads]
    if where != "preset":
        bad[0 if where == "first" else -1].view(-1)[-1] = math.nan
    before = [[t.clone() for t in lst] for lst in (ps, so, sd, steps)]
    prunadag(ps, bad, so, sd, steps, found_nonfinite=flag, **kw)
    assert flag.item() == 1.0
    for lo, lb in zip((ps, so, sd, steps), before):
        for a, b in zip(lo, lb):
            assert torch.equal(a, b)


@needs_ext
def test_fused_op_flag_argument_errors():
    x, g = torch.randn(5), torch.randn(5)
    hyper = torch.tensor([[0.1, 0.1, 0.0, 1e-10, 0.0, 1.0]], dtype=torch.float64)
    for flag in (torch.zeros(2), torch.zeros(1, dtype=torch.float64)):
        with pytest.raises(ValueError, match="found_nonfinite"):
            torch.ops.prunopt.prunadag_step_([x], [x.clone()], [x.clone()], [g], hyper, 2, 3, flag)


def _snapshot(opt, ps):
    return [p.detach().clone() for p in ps], {k: v.clone() for p in ps for k, v in
                                               ((f"{id(p)}{n}", t) for n, t in opt.state[p].items())}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_state_of_another_shape_raises_before_any_write(path, scope):
    """A state dict loaded into an optimizer whose parameters come in another
    order gives each parameter a state of another shape: ValueError before
    anything is written (it used to update the parameters, then raise)."""
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    opt = PrunAdag([a, b], relevant=0.5, scope=scope, **_path_kwargs(path))
    a.grad, b.grad = torch.randn(4, 3), torch.randn(3)
    opt.step()
    opt2 = PrunAdag([b, a], relevant=0.5, scope=scope, **_path_kwargs(path))
    opt2.load_state_dict(opt.state_dict())
    a.grad, b.grad = torch.randn(4, 3), torch.randn(3)
    before, state = _snapshot(opt2, [a, b])
    with pytest.raises(ValueError, match="does not match its parameter"):
        opt2.step()
    after, state_after = _snapshot(opt2, [a, b])
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert all(torch.equal(state[k], state_after[k]) for k in state)


@pytest.mark.parametrize("path", PATHS)
def test_state_transposed_raises(path):
    """Same number of elements, other shape: rejected too (the foreach path
    used to step on the scrambled state)."""
    p = torch.randn(4, 3, requires_grad=True)
    opt = PrunAdag([p], relevant=0.5, **_path_kwargs(path))
    p.grad = torch.randn(4, 3)
    opt.state[p]["sum"] = torch.full((3, 4), 0.01)
    opt.state[p]["decrease_sum"] = torch.full((3, 4), 0.01)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="'sum'"):
        opt.step()
    assert torch.equal(p, before)


@pytest.mark.parametrize("path", PATHS)
def test_functional_list_lengths_and_shapes(path):
    x = [torch.randn(5) for _ in range(3)]
    x0 = [t.clone() for t in x]
    grads = [torch.randn(5) for _ in range(3)]
    full = lambda n: [torch.full((5,), 0.01) for _ in range(n)]  # noqa: E731
    steps = [torch.tensor(0.0) for _ in range(3)]
    kw = dict(relevant=0.5, **_path_kwargs(path))
    for args, name in [((grads, full(2), full(3), steps), "opt_sums"), ((grads, full(3), full(3), steps[:2]), "state_steps"),
                       ((grads[:2], full(3), full(3), steps), "grads"), ((grads, full(3), full(4), steps), "dec_sums")]:
        with pytest.raises(ValueError, match=name):
            prunadag(x, *args, **kw)
    bad = full(3)
    bad[2] = torch.full((4,), 0.01)
    with pytest.raises(ValueError, match="'sum'"):
        prunadag(x, grads, bad, full(3), steps, **kw)
    with pytest.raises(TypeError, match=r"dec_sums\[1\]"):
        prunadag(x, grads, full(3), [bad[0], 0.01, bad[1]], steps, **kw)
    assert all(torch.equal(a, b) for a, b in zip(x, x0))
    assert all(s.item() == 0 for s in steps)


@pytest.mark.parametrize("kwargs, match", [(dict(maximize=None), "maximize"), (dict(maximize="yes"), "maximize"),
                                           (dict(foreach="yes"), "foreach"), (dict(fused=1), "fused")])
def test_flag_arguments_must_be_bools(kwargs, match):
    with pytest.raises(TypeError, match=match):
        PrunAdag(_params(torch.float32), **kwargs)


def test_numpy_scalars_are_accepted_like_torch_optim():
    np = pytest.importorskip("numpy")
    ps = _params(torch.float32, sizes=[(50,)])
    ref = [p.detach().clone().requires_grad_() for p in ps]
    opt = PrunAdag(ps, lr=np.float32(0.1), relevant=np.int64(7), eps=np.float64(1e-10))
    opt_ref = PrunAdag(ref, lr=float(np.float32(0.1)), relevant=7, eps=1e-10)
    assert type(opt.param_groups[0]["relevant"]) is int  # an int T, not a fraction
    for it in range(3):
        _set_grads(ps, it, torch.float32)
        _set_grads(ref, it, torch.float32)
        opt.step()
        opt_ref.step()
    assert torch.equal(ps[0], ref[0])
    opt.add_param_group(dict(params=[torch.randn(3, requires_grad=True)], relevant=np.int64(7)))
    assert type(opt.param_groups[1]["relevant"]) is int


def test_found_nonfinite_survives_pickle_and_deepcopy():
    import pickle

    opt = PrunAdag(_params(torch.float32))
    for other in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        flag = other.found_nonfinite
        assert flag.dtype == torch.float32 and flag.shape == (1,) and flag.item() == 0.0


def test_adagrad_state_dict_gives_decrease_sum_the_initial_value():
    p = torch.randn(5, requires_grad=True)
    ad = torch.optim.Adagrad([p], initial_accumulator_value=0.5)
    p.grad = torch.randn(5)
    ad.step()
    opt = PrunAdag([p])
    opt.load_state_dict(ad.state_dict())
    assert torch.equal(opt.state[p]["sum"], ad.state[p]["sum"])
    assert torch.equal(opt.state[p]["decrease_sum"], torch.full((5,), 0.5))


@needs_ext
def test_complex_with_fused_true_is_a_type_error():
    c = torch.randn(5, dtype=torch.complex64, requires_grad=True)
    c.grad = torch.randn(5, dtype=torch.complex64)
    with pytest.raises(TypeError, match="complex"):
        PrunAdag([c], fused=True).step()


@pytest.mark.parametrize("path", PATHS)
def test_step_bumps_parameter_versions(path):
    # like torch.optim's in-place updates: a tensor saved for backward before
    # the step is known to be stale (the fused op used to leave _version alone)
    ps = [torch.randn(s, dtype=torch.float32).requires_grad_() for s in [(13,), (4, 5)]]
    opt = PrunAdag(ps, relevant=0.5, **_path_kwargs(path))
    _set_grads(ps, 0, torch.float32)
    before = [p._version for p in ps]
    opt.step()
    assert all(p._version > v for p, v in zip(ps, before))
    assert all(opt.state[p]["sum"]._version > 0 for p in ps)
    saved = ps[1].detach()  # shares the version counter with ps[1]
    w = torch.ones(4, 5, requires_grad=True)
    loss = (w * saved).sum()  # saves the parameter's current value
    _set_grads(ps, 1, torch.float32)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
