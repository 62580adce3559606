"""Masks and pruning methods under DDP and FSDP2 (2 gloo ranks on CPU): every
mask is the same on every rank at every step and equals the mask of one
process that sees every rank's data; wrapping-order errors.

Each scenario is a module-level function ``f(rank, ...)``: run with
``rank=None`` in the test process it is the one-process reference (the global
batch, no wrapper); run on the ranks it shards the data and wraps the model.
Models are float64 so that averaging over ranks and over the global batch
differ by rounding only, far below the gaps between the scores that decide
the masks.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunopt.nn import apply_probmask, remove_probmask, to_interspace
from prunopt.pruning import (
    DynamicSparseTraining,
    GradualMagnitudePruning,
    LotteryTicket,
    Masker,
    PruningAtInit,
    global_masks,
    layerwise_masks,
    magnitude_prune,
    magnitude_prune_,
    magnitude_scores,
    remove_masks,
    sparsity,
)

from _dist import ok, run_scenarios

WORLD = 2
SCENARIOS = []


def _scenario(name, fn, *args):
    """Register ``fn(rank, *args)`` as the module-level scenario ``name`` (the
    spawned ranks import it by that name)."""

    def scenario(rank, world_size):
        assert world_size == WORLD
        return fn(rank, *args)

    scenario.__name__ = scenario.__qualname__ = name
    globals()[name] = scenario
    SCENARIOS.append(scenario)
    return name


@pytest.fixture(scope="module")
def results():
    """Every scenario of the module, in one process group of 2 ranks."""
    return run_scenarios(SCENARIOS, world_size=WORLD, timeout=300)


# ------------------------------------------------------------------ models and data
def _mlp():
    g = torch.Generator().manual_seed(1234)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 4)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return model


class _Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        return self.fc(torch.relu(self.conv2(x)).mean((2, 3)))


def _cnn():
    g = torch.Generator().manual_seed(99)
    model = _Cnn().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.4)
    return model


def _batch(seed, n=8, image=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, 1, 5, 5) if image else (n, 6), generator=g, dtype=torch.float64)
    y = torch.randint(0, 3 if image else 4, (n,), generator=g)
    return x, y


def _shard(batch, rank):
    """Rank ``rank``'s rows of a global batch (all of it for ``None``)."""
    if rank is None:
        return batch
    return tuple(t.chunk(WORLD)[rank] for t in batch)


def _fsdp(model):
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            fully_shard(m)
    fully_shard(model)
    return model


def _wrap(model, rank, kind, broadcast_buffers=True):
    if rank is None:
        return model
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, broadcast_buffers=broadcast_buffers)
    return _fsdp(model)


def _masks(masker):
    return {n: m.clone() for n, m in masker.masks().items()}


def _weights(model):
    from prunopt.pruning import _dist

    return [_dist.full_tensor(p.detach()).clone() for p in model.parameters()]


def _assert_same(got, ref, what):
    """Masks of every rank equal each other and the one-process masks exactly."""
    for r, masks in enumerate(got):
        assert masks.keys() == ref.keys(), what
        for n in ref:
            assert torch.equal(masks[n], ref[n]), f"{what}: rank {r}, {n}: " \
                f"{int((masks[n] != ref[n]).sum())} entries differ from one process"


# ------------------------------------------------------------------ methods during training
def _train_with_method(rank, kind, method, broadcast_buffers=True):
    """Five SGD steps with a pruning method; rank-dependent global RNG seeds
    (the methods must not depend on them). Returns the masks after every step
    and the final weights."""
    torch.manual_seed(100 if rank is None else 100 + rank)
    model = _mlp()
    masker = Masker(model)
    if kind == "fsdp":
        model = _wrap(model, rank, kind)  # FSDP2: methods built on the sharded model
    if method == "set":
        pm = DynamicSparseTraining(masker, 0.6, total_steps=50, mode="set", update_interval=2)
    elif method == "set_own_generator":
        gen = torch.Generator().manual_seed(7 if rank is None else 7 + rank)  # per-rank seeds: synchronised
        pm = DynamicSparseTraining(masker, 0.6, total_steps=50, mode="set", update_interval=2, generator=gen)
    elif method == "rigl":
        pm = DynamicSparseTraining(masker, 0.6, total_steps=50, mode="rigl", update_interval=2)
    elif method == "gmp":
        pm = GradualMagnitudePruning(masker, 0.7, t0=1, t1=5, interval=1)
    elif method == "gmp_layerwise":
        pm = GradualMagnitudePruning(masker, 0.7, t0=1, t1=5, interval=2, scope="layerwise")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    masker.attach(opt)
    if method == "lt":
        pm = LotteryTicket(masker, opt, 0.6, t0=1, dense=[])
    net = model if kind == "fsdp" else _wrap(model, rank, kind, broadcast_buffers)
    history = []
    for step in range(5):
        x, y = _shard(_batch(step), rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if method == "rigl":
            xc, yc = _shard(_batch(1000 + step), rank)
            pm.step(closure=lambda: F.cross_entropy(net(xc), yc))
        else:
            pm.step()
        if method == "lt" and step == 3:
            pm.prune_and_rewind()
        history.append(_masks(masker))
    return history, _weights(model)


# (layerwise selection under DDP is the one-process code: covered once, under FSDP2)
METHODS = [("ddp", m) for m in ("set", "set_own_generator", "rigl", "gmp", "lt")] + \
          [("fsdp", m) for m in ("set", "rigl", "gmp", "gmp_layerwise", "lt")]
for _kind, _method in METHODS:
    _scenario(f"train_{_kind}_{_method}", _train_with_method, _kind, _method)
for _method in ("set", "rigl"):
    _scenario(f"train_ddp_{_method}_no_buffer_broadcast", _train_with_method, "ddp", _method, False)


@pytest.mark.parametrize("kind,method", METHODS)
def test_methods_identical_on_ranks_and_equal_to_one_process(results, kind, method):
    ref_history, ref_weights = _train_with_method(None, kind, method)
    got = ok(results[f"train_{kind}_{method}"])
    for step in range(len(ref_history)):
        _assert_same([h[step] for h, _ in got], ref_history[step], f"{method} under {kind}, step {step}")
    for (_, w0), (_, w1) in zip(got, got[1:]):
        assert all(torch.equal(a, b) for a, b in zip(w0, w1)), "weights differ between ranks"
    for a, b in zip(got[0][1], ref_weights):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["set", "rigl"])
def test_dst_under_ddp_without_buffer_broadcast(results, method):
    """broadcast_buffers=False: nothing re-synchronises the mask buffers, so
    they must come out equal; per-rank seeds and per-rank RigL batches."""
    ref_history, ref_weights = _train_with_method(None, "ddp", method)
    got = ok(results[f"train_ddp_{method}_no_buffer_broadcast"])
    for step in range(len(ref_history)):
        _assert_same([h[step] for h, _ in got], ref_history[step], f"{method}, step {step}")
    assert all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1]))
    for a, b in zip(got[0][1], ref_weights):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ scores at initialisation
def _prune_at_init(rank, kind, score):
    """PruningAtInit with every rank's own two batches (the reference sees all
    four); the global RNG is seeded per rank."""
    torch.manual_seed(100 if rank is None else 100 + rank)
    model = _cnn()
    masker = Masker(model)
    if rank is None:
        batches = [_shard(_batch(i, image=True), r) for r in range(WORLD) for i in range(2)]
    else:
        batches = [_shard(_batch(i, image=True), rank) for i in range(2)]
    if kind == "fsdp":
        model = _wrap(model, rank, kind)
    pai = PruningAtInit(masker, score, 0.7, synflow_rounds=3)
    pai.prune(batches=batches, example_input=batches[0][0])
    return _masks(masker)


PAI = [("ddp", s) for s in ("random", "snip", "grasp", "synflow")] + \
      [("fsdp", s) for s in ("random", "magnitude", "snip", "synflow")]
for _kind, _score in PAI:
    _scenario(f"pai_{_kind}_{_score}", _prune_at_init, _kind, _score)


@pytest.mark.parametrize("kind,score", PAI)
def test_pruning_at_init_identical_and_equal_to_one_process(results, kind, score):
    ref = _prune_at_init(None, kind, score)
    _assert_same(ok(results[f"pai_{kind}_{score}"]), ref, f"{score} under {kind}")


def _grasp_fsdp(rank):
    model = _cnn()
    masker = Masker(model)
    _fsdp(model)
    try:
        PruningAtInit(masker, "grasp", 0.5).prune(batches=[_batch(0, image=True)])
    except NotImplementedError as e:
        return str(e)
    return None


_scenario("grasp_fsdp", _grasp_fsdp)


def test_grasp_under_fsdp_says_it_needs_the_unsharded_model(results):
    for msg in ok(results["grasp_fsdp"]):
        assert msg is not None and "fully_shard" in msg


# ------------------------------------------------------------------ selections of sharded tensors
def _selections(rank):
    """global/layerwise masks and magnitude_prune_ of sharded tensors with many
    ties (values on a coarse grid), against the full tensors in one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(5)
    shapes = [(7, 3), (4, 5, 2), (3,), (1, 9)]
    full = [torch.randint(-4, 5, s, generator=g).double() / 2 for s in shapes]
    if rank is None:
        sharded = full
    else:
        mesh = init_device_mesh("cpu", (WORLD,))
        sharded = [distribute_tensor(t, mesh, [Shard(1 if i == 1 else 0)]) for i, t in enumerate(full)]
    out = {}
    scores = {f"t{i}": s for i, s in enumerate(sharded)}
    from prunopt.pruning import _dist

    for p in (0.0, 0.3, 0.55, 0.9, 1.0):
        out[f"global{p}"] = {n: _dist.full_tensor(m) for n, m in global_masks(scores, p).items()}
        out[f"layer{p}"] = {n: _dist.full_tensor(m) for n, m in layerwise_masks(scores, p).items()}
    for sigma in (0.2, 0.5):
        params = [s.clone() for s in sharded]
        masks = magnitude_prune_(params, sigma=sigma)
        out[f"sigma{sigma}"] = {f"t{i}": _dist.full_tensor(m) for i, m in enumerate(masks)}
        out[f"pruned{sigma}"] = {f"t{i}": _dist.full_tensor(p) for i, p in enumerate(params)}
        out[f"sparsity{sigma}"] = {"s": torch.tensor(sparsity(params))}
    masks = magnitude_prune_([s.clone() for s in sharded], delta=1.0)
    out["delta"] = {f"t{i}": _dist.full_tensor(m) for i, m in enumerate(masks)}
    return out


_scenario("selections", _selections)


def test_sharded_selections_equal_one_process_with_ties(results):
    ref = _selections(None)
    got = ok(results["selections"])
    for key in ref:
        _assert_same([o[key] for o in got], ref[key], key)


# ------------------------------------------------------------------ masker state under FSDP2
def _masker_fsdp(rank):
    """Masker.step zeroes each shard and its optimizer state by the rank's
    block of the mask; magnitude scores are sharded like the parameters."""
    model = _mlp()
    masker = Masker(model)
    magnitude_prune(masker, 0.5)
    if rank is not None:
        _fsdp(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, weight_decay=0.1)
    masker.attach(opt)
    x, y = _shard(_batch(3), rank)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        masker.step()
    from prunopt.pruning import _dist

    out = {"masks": _masks(masker), "density": torch.tensor(masker.density())}
    for n, pt in masker.tensors.items():
        p = pt.parameter
        st = opt.state[p]
        out[n] = _dist.full_tensor(p.detach())
        out[n + ".exp_avg"] = _dist.full_tensor(st["exp_avg"])
        out[n + ".score"] = _dist.full_tensor(magnitude_scores(masker)[n])
    return out


_scenario("masker_fsdp", _masker_fsdp)


def test_masker_step_masks_shards_and_their_state(results):
    ref = _masker_fsdp(None)
    got = ok(results["masker_fsdp"])
    for o in got:
        _assert_same([o["masks"]], ref["masks"], "masks")
        for n, m in ref["masks"].items():
            assert bool((o[n][~m] == 0).all()) and bool((o[n + ".exp_avg"][~m] == 0).all())
            torch.testing.assert_close(o[n], ref[n], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(o[n + ".score"], ref[n + ".score"], rtol=1e-10, atol=1e-12)
        assert float(o["density"]) == float(ref["density"])


def _interspace_fsdp(rank):
    """FB coefficients (interspace pruning) under FSDP2: magnitude pruning and
    SET updates of the sharded coefficients, the layer's own mask buffer."""
    torch.manual_seed(100 if rank is None else 100 + rank)
    model = to_interspace(_cnn())
    masker = Masker(model)
    if rank is not None:
        _fsdp(model)
    magnitude_prune(masker, 0.6)
    first = _masks(masker)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    masker.attach(opt)
    dst = DynamicSparseTraining(masker, 0.7, total_steps=50, mode="set", update_interval=1)
    x, y = _shard(_batch(0, image=True), rank)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    dst.step()
    from prunopt.distributed import is_distributed_tensor

    sharded = all(is_distributed_tensor(pt.parameter) for pt in masker.tensors.values())
    return {"magnitude": first, "set": _masks(masker), "sharded": {"all": torch.tensor(sharded)}}


_scenario("interspace_fsdp", _interspace_fsdp)


def test_interspace_coefficients_under_fsdp(results):
    ref = _interspace_fsdp(None)
    got = ok(results["interspace_fsdp"])
    assert all(bool(o["sharded"]["all"]) for o in got)  # coefficients and weights are DTensor shards
    for key in ("magnitude", "set"):
        _assert_same([o[key] for o in got], ref[key], key)
    assert any(n.endswith("coefficients") for n in ref["set"])


# ------------------------------------------------------------------ ProbMask with a budget
def _probmask(rank, kind):
    """ProbMask scores trained in the budget (BudgetProjection after every
    step), then finalised. Each rank draws its own Gumbel noise (a sample of
    the masks, like its batch); the gradients, hence the scores, are averaged."""
    from prunopt.nn import finalize_probmask, probmask_modules, probmask_scores
    from prunopt.optim import BudgetProjection
    from prunopt.pruning import _dist

    torch.manual_seed(100 + rank)
    model = _mlp()
    apply_probmask(model, init=0.8)
    net = _wrap(model, rank, kind)  # FSDP2 replaces the parameters: the optimizer and projection come after
    scores = probmask_scores(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    proj = BudgetProjection(scores, density=0.4)
    proj.attach(opt)
    for step in range(3):
        x, y = _shard(_batch(step), rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    full = [_dist.full_tensor(s.detach()).clone() for s in scores]
    k = finalize_probmask(model, 0.3)
    return {"scores": full, "fixed": [pm.fixed.clone() for _, pm in probmask_modules(model)], "k": k,
            "total": proj.total}


for _kind in ("ddp", "fsdp"):
    _scenario(f"probmask_{_kind}", _probmask, _kind)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_probmask_budget_and_finalize(results, kind):
    from prunopt.nn import finalize_probmask, probmask_modules

    got = ok(results[f"probmask_{kind}"])
    first = got[0]
    total = sum(s.numel() for s in first["scores"])
    assert first["total"] == total
    for o in got:  # the same scores and masks on every rank
        assert all(torch.equal(a, b) for a, b in zip(o["scores"], first["scores"]))
        assert all(torch.equal(a, b) for a, b in zip(o["fixed"], first["fixed"]))
    flat = torch.cat([s.reshape(-1) for s in first["scores"]])
    assert float(flat.min()) >= 0 and float(flat.max()) <= 1
    assert float(flat.sum()) <= 0.4 * total + 1e-9  # in the budget
    # finalize_probmask of one process on the same scores fixes the same masks
    model = _mlp()
    apply_probmask(model)
    with torch.no_grad():
        for (_, pm), s in zip(probmask_modules(model), first["scores"]):
            pm.scores.copy_(s)
    assert finalize_probmask(model, 0.3) == first["k"]
    for (_, pm), fixed in zip(probmask_modules(model), first["fixed"]):
        assert torch.equal(pm.fixed, fixed)


# ------------------------------------------------------------------ read outside the forward pass
class _GatedCnn(nn.Module):
    """Conv - sparse BN - ReLU - conv - sparse BN - pool - linear, in float64."""

    def __init__(self):
        super().__init__()
        from prunopt.nn import SparseBatchNorm2d

        self.conv1 = nn.Conv2d(1, 6, 3, padding=1, bias=False)
        self.bn1 = SparseBatchNorm2d(6, dtype=torch.float64)
        self.conv2 = nn.Conv2d(6, 5, 3, padding=1, bias=False)
        self.bn2 = SparseBatchNorm2d(5, dtype=torch.float64)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(torch.relu(self.bn2(self.conv2(x))).mean((2, 3)))


def _outside_forward(rank):
    """Penalties, densities and exports read from the parameters outside the
    forward pass, where FSDP2 holds them as shards: two-temperature masks
    (``mask_regularizer``, ``mask_density``, ``layer_densities``,
    ``stop_at_sparsity``), sparse gates (``l1_regularizer`` of
    ``sparse_gates``, ``gate_density``), ``pruning_rates`` and ``export_csr``
    of a masker, and ``sum_over_shards`` itself; values and gradients."""
    from prunopt.distributed import local_tensor, sum_over_shards
    from prunopt.nn import (gate_density, l1_regularizer, layer_densities, mask_density, mask_regularizer,
                            sparse_gates, stop_at_sparsity, two_temperature_masks, wrap_two_temperature_masks)
    from prunopt.pruning import _dist, export_csr, pruning_rates

    g = torch.Generator().manual_seed(7)
    model = _GatedCnn().double()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.4)
        model.bn1.gate.alpha.copy_(torch.tensor([0.9, -0.05, 0.4, 0.02, -0.7, 0.3]))  # two gates below threshold
    wrap_two_temperature_masks(model, generator=torch.Generator().manual_seed(3))
    masks = two_temperature_masks(model)
    with torch.no_grad():
        for m in masks:  # logits of both signs
            m.w.copy_(torch.randn(m.w.shape, generator=g, dtype=torch.float64) * 0.01)
    if rank is not None:
        from torch.distributed.fsdp import fully_shard

        whole = {p for p in model.parameters() if p.dim() == 0}  # the gates' thresholds: FSDP2 refuses 0-dim
        for m in masks:
            fully_shard(m, ignored_params=whole)
        fully_shard(model, ignored_params=whole)
    out = {"mask_density": torch.tensor(mask_density(masks)),
           "layer_densities": torch.tensor(layer_densities(masks)),
           "gate_density": torch.tensor(gate_density(model))}
    penalty = mask_regularizer(masks, 0.5) + 0.1 * l1_regularizer(sparse_gates(model))
    x = next(m.w for m in masks)
    square = sum_over_shards((local_tensor(x) ** 3).sum(), x)
    (penalty + square).backward()
    out["penalty"], out["square"] = penalty.detach(), square.detach()
    for n, p in model.named_parameters():
        if p.grad is not None:
            out["grad " + n] = _dist.full_tensor(p.grad).clone()
    out["stopped"] = torch.tensor([stop_at_sparsity(masks, 0.4), stop_at_sparsity(masks, 0.6)])
    out["frozen"] = torch.tensor([not m.w.requires_grad for m in masks])
    # a masker's rates and export over sharded weights
    plain = _mlp()
    masker = Masker(plain)
    magnitude_prune(masker, 0.6)
    if rank is not None:
        _fsdp(plain)
    rates = pruning_rates(masker)
    export = export_csr(masker)
    out["rates"] = torch.tensor([rates["p_sp"], rates["nonzero"], export["csr_bytes"], export["sparsity"]])
    out["csr"] = {n: c.to_dense() for n, c in export["tensors"].items()}
    return out


_scenario("outside_forward", _outside_forward)


def test_penalties_densities_and_exports_of_sharded_parameters(results):
    ref = _outside_forward(None)
    assert 0 < float(ref["gate_density"]) < 1 and 0 < float(ref["mask_density"]) < 1
    assert ref["stopped"].tolist() == [True, False]  # the first call freezes every mask
    for o in ok(results["outside_forward"]):
        assert o.keys() == ref.keys()
        for key in ("mask_density", "layer_densities", "gate_density", "stopped", "frozen", "rates"):
            assert torch.equal(o[key], ref[key]), (key, o[key], ref[key])
        for key in ref:
            if key.startswith("grad ") or key in ("penalty", "square"):
                torch.testing.assert_close(o[key], ref[key], rtol=1e-12, atol=1e-14, msg=key)
        for n in ref["csr"]:
            assert torch.equal(o["csr"][n], ref["csr"][n]), n
    assert any(k.endswith("gate.beta") for k in ref) and any(k.endswith(".w") for k in ref)


# ------------------------------------------------------------------ wrapping order
def _order_errors(rank):
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    alive = []  # the DDP of "ddp_inner" stays alive, as in training

    def inner():
        alive.append(DistributedDataParallel(_mlp()))
        return alive[-1].module

    cases = {
        "ddp": lambda: DistributedDataParallel(_mlp()),
        "ddp_inner": inner,
        "fsdp": lambda: _fsdp(_mlp()),
    }
    for where, build in cases.items():
        for what, apply in (("Masker", Masker), ("apply_probmask", apply_probmask)):
            model = build()
            try:
                apply(model)
                out[f"{what}/{where}"] = "no error"
            except ValueError as e:
                out[f"{what}/{where}"] = str(e)
    conv = nn.Sequential(nn.Conv2d(1, 2, 3))
    for where, model in (("ddp", DistributedDataParallel(conv)), ("fsdp", _fsdp(nn.Sequential(nn.Conv2d(1, 2, 3))))):
        try:
            to_interspace(model)
            out[f"to_interspace/{where}"] = "no error"
        except ValueError as e:
            out[f"to_interspace/{where}"] = str(e)
    # a masker over already-masked layers registers nothing: allowed after wrapping
    model = _mlp()
    Masker(model)
    _fsdp(model)
    masker = Masker(model)
    magnitude_prune(masker, 0.5)
    out["remasking"] = masker.density()
    # baking the masks in removes the parametrizations: not on a wrapped model either
    for what, bake in (("Masker.remove", masker.remove), ("remove_masks", lambda: remove_masks(model))):
        try:
            bake()
            out[f"{what}/fsdp"] = "no error"
        except ValueError as e:
            out[f"{what}/fsdp"] = str(e)
    plain = _mlp()
    apply_probmask(plain)
    ddp = DistributedDataParallel(plain)
    try:
        remove_probmask(ddp)
        out["remove_probmask/ddp"] = "no error"
    except ValueError as e:
        out["remove_probmask/ddp"] = str(e)
    return out


_scenario("order_errors", _order_errors)


def test_wrapping_before_masking_is_a_value_error(results):
    for out in ok(results["order_errors"]):
        for key, msg in out.items():
            if key == "remasking":
                assert msg == pytest.approx(0.5, abs=0.02)
                continue
            assert "before wrapping" in msg, (key, msg)
