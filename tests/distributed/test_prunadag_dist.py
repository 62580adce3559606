"""PrunAdag and SFW under FSDP2 and DDP (2 gloo ranks on CPU), against one
process on the full parameters: every path (fused, foreach, single-tensor)
with versions 1-4 and relevant_only and every scope (each pair of the three
covered), over 10 steps; non-finite
gradients on one rank; ``torch.distributed.checkpoint`` save and resume.

Each scenario is a module-level function ``f(rank, ...)``: with ``rank=None``
(in the test process) it is the one-process run; on the ranks it wraps the
model. Every rank trains on the same full batch, so the gradients that FSDP2
and DDP average over the ranks are the one-process gradients exactly
(float64: the average of two equal values is that value). The thresholds are
then bit-identical and the parameters agree to the rounding of the ratio's
norms, which are summed in another order.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunopt.optim import SFW, PrunAdag

from _dist import error, ok, run_scenarios

WORLD = 2
STEPS = 10
SCENARIOS = []
PATHS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "single": dict(foreach=False)}
VERSIONS = (1, 2, 3, 4, "relevant_only")
SCOPES = ("global", "group", "tensor")


def _name(prefix, case):
    return prefix + "_" + "_".join(str(c).replace(".", "p") for c in case)


def _scenario(name, fn, *args):
    def scenario(rank, world_size):
        assert world_size == WORLD
        return fn(rank, *args)

    scenario.__name__ = scenario.__qualname__ = name
    globals()[name] = scenario
    SCENARIOS.append(scenario)
    return name


@pytest.fixture(scope="module")
def results():
    return run_scenarios(SCENARIOS, world_size=WORLD, timeout=300)


# ------------------------------------------------------------------ model and data
def _model():
    """Float64 MLP whose first dimensions shard unevenly over 2 ranks (7 rows:
    4 + 3; the last layer's single row leaves rank 1 an empty shard)."""
    g = torch.Generator().manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.7)
    return model


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(1, keepdim=True))


def _wrap(model, rank, kind):
    if rank is None:
        return model
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    return fully_shard(model)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _params(model):
    return [_full(p.detach()).clone() for p in model.parameters()]


def _groups(model):
    """Two pruned groups (weights of the first two layers; the rest)."""
    lin = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return [{"params": [lin[0].weight, lin[1].weight]},
            {"params": [lin[2].weight] + [m.bias for m in lin]}]


def _step(model, opt, step):
    x, y = _batch(step)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def _prunadag_run(rank, kind, path, version, scope, steps=STEPS):
    model = _wrap(_model(), rank, kind)
    opt = PrunAdag(_groups(model), lr=0.05, relevant=0.2, version=version, scope=scope, weight_decay=1e-3,
                   initial_accumulator_value=0.01, **PATHS[path])
    for s in range(steps):
        _step(model, opt, s)
    states = [(_full(opt.state[p]["sum"]).clone(), _full(opt.state[p]["decrease_sum"]).clone())
              for p in model.parameters()]
    return _params(model), states


# every (path, version) pair, each with one of the scopes in turn, so that
# every (path, scope) and (version, scope) pair is covered as well
CASES = [("fsdp", path, version, SCOPES[i % len(SCOPES)])
         for i, (path, version) in enumerate(itertools.product(PATHS, VERSIONS))]
CASES += [("ddp", path, 3, "global") for path in PATHS]
for _case in CASES:
    _scenario(_name("prunadag", _case), _prunadag_run, *_case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_prunadag_equals_one_process(results, case):
    ref_params, ref_states = _prunadag_run(None, *case)
    for rank_params, rank_states in ok(results[_name("prunadag", case)]):
        for p, q in zip(rank_params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
        for (so, sd), (so_r, sd_r) in zip(rank_states, ref_states):
            torch.testing.assert_close(so, so_r, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(sd, sd_r, rtol=1e-12, atol=1e-12)


def _per_shard_differs(rank):
    """The sharded step is not the per-shard algorithm: with a global top-20 %
    a per-shard selection keeps other elements (checked on the first step)."""
    from prunopt.distributed import topk_threshold
    from prunopt.ops import topk_threshold as one_process

    model = _wrap(_model(), rank, "fsdp")
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    n = sum(g.numel() for g in grads)
    k = -(-n // 5)
    tau = topk_threshold(grads, k)
    full = [g.full_tensor() for g in grads]
    local = [g.to_local() for g in grads if g.to_local().numel()]
    return (tau.item(), one_process(full, k).item(), one_process(local, -(-sum(t.numel() for t in local) // 5)).item())


_scenario("threshold_is_global", _per_shard_differs)


def test_sharded_threshold_is_the_global_one_not_the_shards(results):
    for tau, one, per_shard in ok(results["threshold_is_global"]):
        assert tau == one
    assert any(per_shard != one for _, one, per_shard in ok(results["threshold_is_global"]))


# ------------------------------------------------------------------ fused select
def _fused_select_run(rank, weight_decay, width=300):
    """A float32 FSDP2 model of ``2 * 64 * width`` weights, the fused path:
    every step's threshold and ratio norms come from one bracket pass and the
    selection's own collectives (no norms pass, no norms all_reduce). Records
    the bytes of every all_reduce of each step and whether a rank read x and g
    a second time."""
    import torch.distributed as dist

    import prunopt.optim.prunadag as P

    g = torch.Generator().manual_seed(11)
    model = nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, 64))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model = _wrap(model, rank, "fsdp")
    opt = PrunAdag(model.parameters(), lr=0.01, relevant=0.1, fused=True, weight_decay=weight_decay)
    x = torch.randn(32, 64, generator=g)
    seen = {"calls": [], "norms": 0, "fused": [], "rereads": 0}
    if rank is not None:
        reduce, norms, fused, candidates = dist.all_reduce, P._local_norms, P._fused_select, P._FusedShare.candidates

        def counting(tensor, *a, **kw):
            seen["calls"][-1].append(tensor.numel() * tensor.element_size())
            return reduce(tensor, *a, **kw)

        def counting_norms(*a, **kw):
            seen["norms"] += 1
            return norms(*a, **kw)

        def recording(*a, **kw):
            got = fused(*a, **kw)
            seen["fused"].append(got is not None and got is not P._NONFINITE and got[1] is not None)
            return got

        def recording_rereads(share, *a, **kw):
            got = candidates(share, *a, **kw)
            seen["rereads"] += share.reread
            return got
    for step in range(3):
        opt.zero_grad()
        (model(x + step).square().mean()).backward()
        if rank is None:
            opt.step()
            continue
        seen["calls"].append([])
        dist.all_reduce, P._local_norms, P._fused_select = counting, counting_norms, recording
        P._FusedShare.candidates = recording_rereads
        try:
            opt.step()
        finally:
            dist.all_reduce, P._local_norms, P._fused_select = reduce, norms, fused
            P._FusedShare.candidates = candidates
    return _params(model), seen


for _wd in (0.0, 0.01):
    _scenario(_name("fused_select", (_wd,)), _fused_select_run, _wd)
# 2 x 64 x 1024 weights: 65 536 per rank, more than the sample of a shard (32 768)
_scenario("fused_select_sampled", _fused_select_run, 0.01, 1024)

def _one_thread(fn, *args):
    """``fn(*args)`` with one torch thread, as on the ranks: float32 matmuls
    of this size round differently on more threads, and the one-process run
    must see the ranks' gradients bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


# The first collective (int64: a 2048-slot area holding every rank's slice, 8192
# slots of windows, 9 agreement integers: the size of every select's first
# collective), then, where the windows miss, radix passes in float64 (per
# bucket the count and both norms' weights; the first also sums the counts
# above the bracket, the candidates' count, the non-finite flag, G and X)
_FIRST = (2048 + 8192 + 9) * 8
_FIRST_RADIX = (3 * 2048 + 3 + 2) * 8


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_fused_select_takes_the_norms_from_the_selection(results, weight_decay):
    """Each step: the first collective (every rank's slice and window), and
    1-3 radix passes where the windows do not hold tau, no norms pass and no
    norms all_reduce; the parameters those of one process (float32: the same
    tau, the ratio to the rounding of its sums). (The shards here are smaller
    than a sample, so each rank's bracket is all of its values within half a
    window of its share: the windows hold tau unless the ranks' shares lie
    far apart.)"""
    want, _ = _one_thread(_fused_select_run, None, weight_decay)
    for params, seen in ok(results[_name("fused_select", (weight_decay,))]):
        assert seen["fused"] == [True] * 3 and seen["norms"] == 0
        for calls in seen["calls"]:
            assert 1 <= len(calls) <= 4 and calls[0] == _FIRST, calls
            assert len(calls) == 1 or calls[1] == _FIRST_RADIX, calls
            assert all(c <= 3 * 2048 * 8 for c in calls[2:]), calls
        for p, q in zip(params, want):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_fused_select_on_alike_shards_takes_one_collective(results):
    """Shards larger than the sample (alike: halves of the same layers): tau
    lies inside every rank's window, so the first collective gives it and
    both norms, and no rank reads x and g again: 1 all_reduce call per step,
    82 KB per rank; the parameters those of one process."""
    want, _ = _one_thread(_fused_select_run, None, 0.01, 1024)
    for params, seen in ok(results["fused_select_sampled"]):
        assert seen["fused"] == [True] * 3 and seen["norms"] == 0 and seen["rereads"] == 0
        assert seen["calls"] == [[_FIRST]] * 3, seen["calls"]
        for p, q in zip(params, want):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ errors
def _nonfinite_on_one_rank(rank, path):
    model = _wrap(_model(), rank, "fsdp")
    opt = PrunAdag(model.parameters(), lr=0.05, relevant=0.2, **PATHS[path])
    _step(model, opt, 0)
    before = [p.detach().to_local().clone() for p in model.parameters()]
    state = [opt.state[p]["sum"].to_local().clone() for p in model.parameters()]
    x, y = _batch(1)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    if rank == 1:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("nan")
    try:
        opt.step()
    finally:
        unchanged = all(torch.equal(p.detach().to_local(), b) for p, b in zip(model.parameters(), before))
        unchanged &= all(torch.equal(opt.state[p]["sum"].to_local(), s) for p, s in zip(model.parameters(), state))
        steps = {float(opt.state[p]["step"]) for p in model.parameters()}
        if not unchanged or steps != {1.0}:
            raise AssertionError(f"the step wrote something: unchanged={unchanged}, steps={steps}")


for _path in PATHS:
    _scenario(f"nonfinite_{_path}", _nonfinite_on_one_rank, _path)


@pytest.mark.parametrize("path", PATHS)
def test_nonfinite_gradient_on_one_rank_raises_on_every_rank_and_writes_nothing(results, path):
    for kind, msg in error(results[f"nonfinite_{path}"]):
        assert kind == "ValueError" and "non-finite" in msg and "nothing was updated" in msg


# ------------------------------------------------------------------ checkpoints
def _dcp_resume(rank):
    """Five steps, a torch.distributed.checkpoint save, five more; then a fresh
    model and optimizer load the checkpoint and take the same five steps."""
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make():
        model = _wrap(_model(), rank, "fsdp")
        return model, PrunAdag(model.parameters(), lr=0.05, relevant=0.2, initial_accumulator_value=0.01)

    box = [tempfile.mkdtemp(prefix="prunopt-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    model, opt = make()
    for s in range(5):
        _step(model, opt, s)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    for s in range(5, 10):
        _step(model, opt, s)
    straight = _params(model)
    model2, opt2 = make()
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=root)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    sharded = all(hasattr(opt2.state[p]["sum"], "to_local") for p in model2.parameters())
    for s in range(5, 10):
        _step(model2, opt2, s)
    resumed = _params(model2)
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return straight, resumed, sharded


_scenario("dcp_resume", _dcp_resume)


def test_dcp_save_and_resume_is_exact_and_state_stays_sharded(results):
    for straight, resumed, sharded in ok(results["dcp_resume"]):
        assert sharded
        for a, b in zip(straight, resumed):
            assert torch.equal(a, b)


# ------------------------------------------------------------------ SFW
def _sfw_run(rank, kind, rescale, momentum):
    model = _wrap(_model(), rank, kind)
    opt = SFW(model.parameters(), lr=0.1, rescale=rescale, momentum=momentum, radius=3.0, relevant=0.2)
    for s in range(STEPS):
        _step(model, opt, s)
    return _params(model)


SFW_CASES = [("fsdp", r, m) for r in ("diameter", "gradient", "fw2") for m in (0.0, 0.9)] + [("ddp", "gradient", 0.9)]
for _case in SFW_CASES:
    _scenario(_name("sfw", _case), _sfw_run, *_case)


@pytest.mark.parametrize("case", SFW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sfw_equals_one_process(results, case):
    ref = _sfw_run(None, *case)
    for params in ok(results[_name("sfw", case)]):
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
