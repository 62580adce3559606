"""Pruning methods: PaI, lottery tickets (rewinding), SET/RigL, GMP, FT."""
import math

import pytest
import torch
import torch.nn.functional as F

from prunopt.pruning import (
    DynamicSparseTraining,
    FineTuning,
    GradualMagnitudePruning,
    LotteryTicket,
    Masker,
    PruningAtInit,
    cosine_drop_fraction,
    erk_counts,
    global_masks,
    gmp_sparsity,
    grasp_scores,
    kept_count,
    lottery_ticket_trainings,
    magnitude_prune,
    synflow_prune,
)

from _pruning_helpers import TinyNet, batch


def _train_step(model, opt, method, seed, closure=False):
    x, y = batch(seed=seed)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    if closure:
        method.step(closure=lambda: F.cross_entropy(model(x), y))
    else:
        method.step()


def _total(masker):
    return sum(pt.parameter.numel() for pt in masker.tensors.values())


@pytest.mark.parametrize("score", ["random", "magnitude", "snip", "grasp", "synflow"])
def test_pai_exact_global_count(score):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    masker = Masker(model, opt)
    pai = PruningAtInit(masker, score, 0.8, synflow_rounds=10, generator=torch.Generator().manual_seed(0))
    pai.prune(batches=[batch(seed=1)])
    assert sum(masker.counts().values()) == kept_count(0.8, _total(masker))
    for i in range(3):
        _train_step(model, opt, pai, i)
    assert sum(masker.counts().values()) == kept_count(0.8, _total(masker))
    assert pai.last_step == 3


def test_pai_grasp_keeps_largest_hg_w():
    torch.manual_seed(0)
    model = TinyNet()
    masker = Masker(model)
    b = [batch(seed=2)]
    expected = global_masks({n: -s for n, s in grasp_scores(masker, b).items()}, 0.6)
    PruningAtInit(masker, "grasp", 0.6).prune(batches=b)
    for n, m in masker.masks().items():
        assert torch.equal(m, expected[n])


def test_synflow_iterative_schedule_a81():
    model = TinyNet()
    masker = Masker(model)
    d = _total(masker)
    seen = []
    orig = masker.set_masks

    def record(masks, **kw):
        orig(masks, **kw)
        seen.append(sum(masker.counts().values()))

    masker.set_masks = record
    synflow_prune(masker, 0.9, (1, 6, 6), rounds=7)
    assert seen == [kept_count(1 - (1 - 0.9) ** (k / 7), d) if k < 7 else kept_count(0.9, d) for k in range(1, 8)]


def test_pai_errors():
    masker = Masker(TinyNet())
    with pytest.raises(ValueError, match="score"):
        PruningAtInit(masker, "l1", 0.5)
    with pytest.raises(ValueError, match="sparsity"):
        PruningAtInit(masker, "snip", 2.0)
    with pytest.raises(ValueError, match="batches"):
        PruningAtInit(masker, "snip", 0.5).prune()
    with pytest.raises(TypeError, match="masker"):
        PruningAtInit(TinyNet(), "snip", 0.5)


def test_lottery_ticket_rewinds_exactly_to_t0():
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    masker = Masker(model, opt)
    lt = LotteryTicket(masker, opt, sparsity=0.5, t0=2, scheduler=sched)
    assert lt.dense == ["fc.weight"]
    def it(i):  # LR-scheduler step before lt.step(): the t0 snapshot sees it
        x, y = batch(seed=i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        lt.step()

    for i in range(2):
        it(i)
    t0_model = {k: v.clone() for k, v in model.state_dict().items()}
    t0_opt = {id_: {k: v.clone() for k, v in st.items()} for id_, st in opt.state_dict()["state"].items()}
    t0_lr = opt.param_groups[0]["lr"]
    t0_sched = dict(sched.state_dict())
    for i in range(2, 6):
        it(i)
    names = lt.prunable
    kept_before = sum(masker.counts()[n] for n in names)
    lt.prune_and_rewind()
    masks = masker.masks()
    assert lt.last_step == 2
    assert sum(masker.counts()[n] for n in names) == math.floor(0.8 * kept_before)
    assert bool(masks["fc.weight"].all())  # classifier stays dense
    mask_keys = {f"{pt.module_name}.parametrizations.weight.0.mask": n for n, pt in masker.tensors.items()}
    orig_keys = {f"{pt.module_name}.parametrizations.weight.original": n for n, pt in masker.tensors.items()}
    for k, v in model.state_dict().items():
        if k in mask_keys:
            assert torch.equal(v.bool(), masks[mask_keys[k]])
        elif k in orig_keys:  # kept weights are the t0 weights, pruned ones 0
            m = masks[orig_keys[k]]
            assert torch.equal(v, torch.where(m, t0_model[k], torch.zeros_like(v))), k
        else:  # BN weights/buffers, biases
            assert torch.equal(v, t0_model[k]), k
    assert opt.param_groups[0]["lr"] == t0_lr
    assert sched.state_dict() == t0_sched
    params = opt.state_dict()["param_groups"][0]["params"]
    plist = [p for g in opt.param_groups for p in g["params"]]
    for pid, st in opt.state_dict()["state"].items():
        p = plist[params.index(pid)]
        pruned = None
        for n, pt in masker.tensors.items():
            if pt.parameter is p:
                pruned = ~masks[n]
        for k, v in st.items():
            expect = t0_opt[pid][k]
            if pruned is not None and torch.is_tensor(v) and v.shape == p.shape:
                expect = expect.masked_fill(pruned, 0)
            assert torch.equal(v, expect), (pid, k)


def test_lottery_ticket_rounds_follow_a75():
    assert lottery_ticket_trainings(0.9) == 1 + math.ceil(math.log(0.1) / (math.log(4) - math.log(5)))
    assert lottery_ticket_trainings(0.2) == 2 and lottery_ticket_trainings(0.0) == 1
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masker = Masker(model, opt)
    lt = LotteryTicket(masker, opt, sparsity=0.7)
    rounds = 0
    while not lt.done:
        _train_step(model, opt, lt, rounds)
        lt.prune_and_rewind()
        rounds += 1
    assert rounds + 1 == lottery_ticket_trainings(0.7)
    total = sum(masker[n].parameter.numel() for n in lt.prunable)
    assert sum(masker.counts()[n] for n in lt.prunable) == kept_count(0.7, total)
    with pytest.raises(ValueError, match="unknown layer name"):
        LotteryTicket(masker, opt, 0.5, dense=["head"])


@pytest.mark.parametrize("mode", ["set", "rigl"])
def test_dst_keeps_per_layer_counts(mode):
    torch.manual_seed(0)
    model = TinyNet(c=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    masker = Masker(model, opt)
    dst = DynamicSparseTraining(masker, 0.6, total_steps=12, mode=mode, update_interval=2,
                                generator=torch.Generator().manual_seed(1))
    counts = dict(masker.counts())
    shapes = {n: pt.spatial_shape for n, pt in masker.tensors.items()}
    assert counts == dict(erk_counts(shapes, 0.4))
    changed = 0
    for i in range(12):
        before = masker.masks()
        x, y = batch(seed=i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if mode == "rigl" and (i + 1) % 2 == 0:
            dense = masker.dense_gradients(lambda: F.cross_entropy(model(x), y))
        dst.step(closure=lambda: F.cross_entropy(model(x), y))
        after = masker.masks()
        assert dict(masker.counts()) == counts  # at every step, every layer
        for n in after:
            grown = after[n] & ~before[n]
            changed += int(grown.sum())
            # regrown weights start at zero (paper App. G.3)
            assert torch.equal(masker[n].parameter.detach()[grown], torch.zeros(int(grown.sum())))
            if mode == "rigl" and grown.any() and (~before[n] & ~after[n]).any():
                g = dense[n].abs()
                cand = ~before[n]
                assert g[grown].min() >= g[cand & ~after[n]].max() - 1e-12
    assert changed > 0 and dst.updates == 5  # updates at t = 2, 4, ..., 10 (< T)


def test_dst_drop_fraction_a77_and_errors():
    assert cosine_drop_fraction(0, 100) == pytest.approx(0.5)
    assert cosine_drop_fraction(100, 100) == pytest.approx(0.005)
    assert cosine_drop_fraction(50, 100) == pytest.approx(0.005 + 0.5 * 0.495)
    masker = Masker(TinyNet())
    dst = DynamicSparseTraining(masker, 0.5, total_steps=10, mode="rigl", update_interval=1)
    with pytest.raises(ValueError, match="closure"):
        dst.update()
    with pytest.raises(ValueError, match="mode"):
        DynamicSparseTraining(masker, 0.5, total_steps=10, mode="snip")
    with pytest.raises(ValueError, match="total_steps"):
        DynamicSparseTraining(masker, 0.5, total_steps=0)
    with pytest.raises(ValueError, match="total_steps"):
        cosine_drop_fraction(0, 0)  # was a ZeroDivisionError
    with pytest.raises(ValueError, match="t must"):
        cosine_drop_fraction(-1, 10)
    with pytest.raises(TypeError, match="total_steps"):
        cosine_drop_fraction(0, 10.0)


def test_rigl_step_without_closure_loses_nothing():
    torch.manual_seed(0)
    model = TinyNet(c=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masker = Masker(model, opt)
    dst = DynamicSparseTraining(masker, 0.5, total_steps=100, mode="rigl", update_interval=2,
                                generator=torch.Generator().manual_seed(1))
    _train_step(model, opt, dst, 0)  # t = 1: not an update step, no closure needed
    masks = masker.masks()
    with pytest.raises(ValueError, match="closure"):
        dst.step()  # t = 2 is an update step
    assert dst.last_step == 1 and dst.updates == 0
    assert all(torch.equal(masks[n], m) for n, m in masker.masks().items())
    x, y = batch(seed=1)
    with pytest.raises(TypeError, match="scalar"):
        dst.step(closure=lambda: model(x))  # a failing update restores the counter too
    assert dst.last_step == 1 and dst.updates == 0
    dst.step(closure=lambda: F.cross_entropy(model(x), y))  # the retry performs the update
    assert dst.last_step == 2 and dst.updates == 1
    assert any(not torch.equal(masks[n], m) for n, m in masker.masks().items())


def test_lottery_ticket_with_nothing_to_prune_is_a_value_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masker = Masker(model)
    with pytest.raises(ValueError, match="nothing to prune"):
        LotteryTicket(masker, opt, 0.5)  # its only layer is the classifier, dense by default
    assert masker.optimizers == []  # nothing was attached
    with pytest.raises(TypeError, match="dense"):
        LotteryTicket(masker, opt, 0.5, dense="0")
    lt = LotteryTicket(masker, opt, 0.5, dense=[])
    assert lt.current_sparsity() == 0.0
    lt.prune_and_rewind()
    assert lt.current_sparsity() == pytest.approx(0.2, abs=1 / 12)


def test_gmp_follows_a82():
    assert gmp_sparsity(5, 0.8, 10, 20) == 0.0
    assert gmp_sparsity(15, 0.8, 10, 20) == pytest.approx(0.8 * (1 - 0.5 ** 3))
    assert gmp_sparsity(25, 0.8, 10, 20) == 0.8
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    masker = Masker(model, opt)
    gmp = GradualMagnitudePruning(masker, 0.8, t0=2, t1=8, interval=2)
    d = _total(masker)
    for t in range(1, 11):
        prev = masker.masks()
        _train_step(model, opt, gmp, t)
        p_last = gmp_sparsity(t - t % 2, 0.8, 2, 8) if t >= 2 else 0.0
        assert sum(masker.counts().values()) == kept_count(p_last, d), t
        for n, m in masker.masks().items():
            assert not bool((m & ~prev[n]).any())  # never revived
    with pytest.raises(ValueError, match="t1"):
        GradualMagnitudePruning(masker, 0.5, t0=5, t1=1, interval=1)


def test_fine_tuning_prunes_smallest_magnitudes():
    torch.manual_seed(0)
    model = TinyNet()
    masker = Masker(model)
    weights = torch.cat([pt.parameter.detach().abs().reshape(-1) for pt in masker.tensors.values()])
    ft = FineTuning(masker, 0.75)
    ft.prune()
    keep = torch.cat([m.reshape(-1) for m in masker.masks().values()])
    assert int(keep.sum()) == kept_count(0.75, weights.numel())
    assert weights[keep].min() >= weights[~keep].max()


def test_method_state_dict_round_trip():
    masker = Masker(TinyNet())
    gmp = GradualMagnitudePruning(masker, 0.5, t0=0, t1=4, interval=1)
    gmp.step(); gmp.step()
    sd = gmp.state_dict()
    gmp2 = GradualMagnitudePruning(masker, 0.5, t0=0, t1=4, interval=1)
    gmp2.load_state_dict(sd)
    assert gmp2.last_step == 2 and gmp2.current_sparsity == gmp.current_sparsity
    with pytest.raises(ValueError, match="lacks"):
        gmp2.load_state_dict({})


# ------------------------------------------------ lottery ticket: resume a run
def _lt_run(interrupt_at=None, seed=0):
    """Train 6 steps (t0 = 2), prune and rewind, train 3 more, prune and rewind
    again.  With ``interrupt_at``, everything is saved (torch.save) after that
    many steps and loaded into objects rebuilt from another seed."""
    import io

    def build(s):
        torch.manual_seed(s)
        model = TinyNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        masker = Masker(model, opt)
        lt = LotteryTicket(masker, opt, sparsity=0.6, t0=2, scheduler=sched)
        return model, opt, sched, masker, lt

    model, opt, sched, masker, lt = build(seed)

    def it(i):
        x, y = batch(seed=i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        lt.step()

    schedule = [("step", i) for i in range(6)] + [("prune", None)] + [("step", i) for i in range(6, 9)]
    schedule += [("prune", None)]
    for k, (what, i) in enumerate(schedule):
        if k == interrupt_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "masker": masker.state_dict(), "lt": lt.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            model, opt, sched, masker, lt = build(seed + 1)  # other initial weights: a wrong rewind shows
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
            masker.load_state_dict(saved["masker"])
            lt.load_state_dict(saved["lt"])
        if what == "step":
            it(i)
        else:
            lt.prune_and_rewind()
    return model, opt, sched, masker, lt


@pytest.mark.parametrize("interrupt_at", [1, 4, 7, 8])
def test_lottery_ticket_resumes_from_its_state_dict(interrupt_at):
    ref = _lt_run()
    got = _lt_run(interrupt_at)
    assert got[4].state_dict()["last_step"] == ref[4].last_step == 2 and got[4].rounds_done == 2
    for k, v in ref[0].state_dict().items():
        assert torch.equal(got[0].state_dict()[k], v), k
    for n, m in ref[3].masks().items():
        assert torch.equal(got[3].masks()[n], m), n
    assert got[2].state_dict() == ref[2].state_dict()
    ref_state, got_state = ref[1].state_dict()["state"], got[1].state_dict()["state"]
    assert set(ref_state) == set(got_state)
    for pid, st in ref_state.items():
        for k, v in st.items():
            assert torch.equal(got_state[pid][k], v), (pid, k)


def test_lottery_ticket_state_dict_checks():
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lt = LotteryTicket(Masker(model, opt), opt, sparsity=0.5, t0=0)
    sd = lt.state_dict()
    assert set(sd["t0_state"]) == {"model", "optimizer", "scheduler"}
    old = {"last_step": 3, "rounds_done": 0}  # no snapshot, saved after t0: cannot rewind
    with pytest.raises(ValueError, match="t0_state"):
        lt.load_state_dict(old)
    bad = dict(sd, t0_state=dict(sd["t0_state"], model={"nope": torch.zeros(1)}))
    with pytest.raises(ValueError, match="does not fit the model"):
        lt.load_state_dict(bad)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(ValueError, match="scheduler"):
        LotteryTicket(Masker(TinyNet(), opt), opt, 0.5, scheduler=sched).load_state_dict(sd)
    assert lt.last_step == 0 and lt._snapshot is not None  # unchanged by the failed loads
    lt2 = LotteryTicket(Masker(TinyNet(), opt), opt, 0.5, t0=5)
    lt2.load_state_dict({"last_step": 2, "rounds_done": 0})  # before t0: nothing to rewind to yet
    assert lt2.last_step == 2 and lt2._snapshot is None


# ----------------------------------------------------------- never revive
@pytest.mark.parametrize("scope", ["global", "layerwise"])
def test_magnitude_prune_keep_pruned_never_revives(scope):
    torch.manual_seed(0)
    masker = Masker(TinyNet())
    magnitude_prune(masker, 0.8, scope)
    before = masker.masks()
    magnitude_prune(masker, 0.5, scope, keep_pruned=True)  # already sparser: nothing changes
    for n, m in masker.masks().items():
        assert torch.equal(m, before[n]), n
    assert sum(masker.counts().values()) == sum(int(m.sum()) for m in before.values())
    magnitude_prune(masker, 0.9, scope, keep_pruned=True)  # sparser: prunes among the kept entries only
    d = _total(masker)
    if scope == "global":
        assert sum(masker.counts().values()) == kept_count(0.9, d)
    for n, m in masker.masks().items():
        assert not bool((m & ~before[n]).any()), n
        if scope == "layerwise":
            assert int(m.sum()) == kept_count(0.9, m.numel())
    magnitude_prune(masker, 0.5, scope, keep_pruned=False)  # recomputed from all entries
    assert sum(masker.counts().values()) == (kept_count(0.5, d) if scope == "global" else
                                             sum(kept_count(0.5, m.numel()) for m in before.values()))


def test_gmp_starts_from_the_maskers_real_sparsity():
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    masker = Masker(model, opt)
    magnitude_prune(masker, 0.6)
    gmp = GradualMagnitudePruning(masker, 0.8, t0=0, t1=4, interval=1)
    assert gmp.current_sparsity == pytest.approx(masker.sparsity())
    d = _total(masker)
    for t in range(1, 6):
        prev = masker.masks()
        _train_step(model, opt, gmp, t)
        for n, m in masker.masks().items():
            assert not bool((m & ~prev[n]).any()), (t, n)  # never revived
        expected = min(kept_count(0.6, d), kept_count(gmp_sparsity(t, 0.8, 0, 4), d))
        assert sum(masker.counts().values()) == expected, t
    assert sum(masker.counts().values()) == kept_count(0.8, d)


def test_synflow_prune_never_revives():
    masker = Masker(TinyNet())
    magnitude_prune(masker, 0.7)
    before = masker.masks()
    synflow_prune(masker, 0.5, (1, 6, 6), rounds=3)
    for n, m in masker.masks().items():
        assert torch.equal(m, before[n]), n


def test_pai_synflow_takes_inputs_of_one_batch_tuple(monkeypatch):
    import prunopt.pruning.methods as methods

    x, y = batch(n=4)
    seen = []
    masker = Masker(TinyNet())
    with monkeypatch.context() as mp:
        mp.setattr(methods, "synflow_prune", lambda m, p, example_input, rounds: seen.append(example_input.shape))
        PruningAtInit(masker, "synflow", 0.5).prune(batches=(x, y))
        PruningAtInit(masker, "synflow", 0.5).prune(batches=[(x, y)])
    assert seen == [x.shape, x.shape]  # the batch, not its first sample
    PruningAtInit(masker, "synflow", 0.5, synflow_rounds=2).prune(batches=(x, y))
    assert sum(masker.counts().values()) == kept_count(0.5, _total(masker))


def test_gmp_sparsity_argument_errors():
    with pytest.raises(ValueError, match="t1"):
        gmp_sparsity(5, 0.5, 10, 2)
    with pytest.raises(ValueError, match="t must"):
        gmp_sparsity(-1, 0.5, 0, 10)
    with pytest.raises(TypeError, match="t must"):
        gmp_sparsity(1.5, 0.5, 0, 10)
    with pytest.raises(TypeError, match="t0"):
        gmp_sparsity(1, 0.5, None, 10)
    with pytest.raises(ValueError, match="t0"):
        gmp_sparsity(1, 0.5, -2, 10)
    assert gmp_sparsity(3, 0.5, 3, 3) == 0.5


def test_pai_works_under_no_grad():
    torch.manual_seed(0)
    for score in ("snip", "grasp", "synflow"):
        masker = Masker(TinyNet())
        with torch.no_grad():
            PruningAtInit(masker, score, 0.7, synflow_rounds=2).prune(batches=[batch()])
        assert sum(masker.counts().values()) == kept_count(0.7, _total(masker)), score
