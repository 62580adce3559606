"""The one-process side of the distributed support of the pruning methods.

The generators of the random choices of DynamicSparseTraining (SET/RigL) and
PruningAtInit("random"): a resumed SET run draws what an uninterrupted one
does (the state dict carries the generator), runs are reproducible from
torch.manual_seed, bad states change nothing. The Masker's process_group
argument, and the dtype of the masked weight under mixed precision.
"""
import io

import pytest
import torch
import torch.nn.functional as F

from prunopt.pruning import DynamicSparseTraining, Masker, PruningAtInit

from _pruning_helpers import TinyNet, batch


def _set_run(steps=9, interrupt_at=None, generator_seed=None):
    """SET with an update every 2 steps; with ``interrupt_at`` everything is
    saved (torch.save) after that many steps and loaded into objects rebuilt
    from other seeds (other weights, other generator states)."""

    def build(seed):
        torch.manual_seed(seed)
        model = TinyNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        masker = Masker(model, opt)
        gen = None if generator_seed is None else torch.Generator().manual_seed(generator_seed + seed)
        dst = DynamicSparseTraining(masker, 0.7, total_steps=100, mode="set", update_interval=2, generator=gen)
        return model, opt, masker, dst

    model, opt, masker, dst = build(0)
    history = []
    for i in range(steps):
        if i == interrupt_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "masker": masker.state_dict(),
                        "dst": dst.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            model, opt, masker, dst = build(1)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            masker.load_state_dict(saved["masker"])
            dst.load_state_dict(saved["dst"])
        x, y = batch(seed=i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        dst.step()
        history.append(masker.masks())
    return history, dst


@pytest.mark.parametrize("generator_seed", [None, 5])
@pytest.mark.parametrize("interrupt_at", [1, 4, 7])
def test_resumed_set_run_regrows_as_an_uninterrupted_one(interrupt_at, generator_seed):
    ref, ref_dst = _set_run(generator_seed=generator_seed)
    got, got_dst = _set_run(interrupt_at=interrupt_at, generator_seed=generator_seed)
    assert got_dst.updates == ref_dst.updates == 4
    for step, (a, b) in enumerate(zip(got, ref)):
        for n in b:
            assert torch.equal(a[n], b[n]), (step, n)
    assert torch.equal(got_dst.generator.get_state(), ref_dst.generator.get_state())


def test_set_regrowth_depends_on_the_generator_state():
    """The round trip above is not vacuous: without the saved generator the
    regrowth of the resumed run differs."""
    ref, _ = _set_run()
    history, dst = _set_run(steps=4)
    state = dst.state_dict()
    del state["generator"]  # as saved before the state was recorded: the current state is kept
    torch.manual_seed(1)
    masker = Masker(TinyNet())
    fresh = DynamicSparseTraining(masker, 0.7, total_steps=100, mode="set", update_interval=2)
    before = fresh.generator.get_state()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.generator.get_state(), before) and fresh.last_step == 4
    assert not torch.equal(before, dst.generator.get_state())


def test_dst_and_random_pai_are_reproducible_from_manual_seed():
    def masks(cls):
        torch.manual_seed(3)
        masker = Masker(TinyNet())
        if cls is DynamicSparseTraining:
            DynamicSparseTraining(masker, 0.6, total_steps=10)
        else:
            PruningAtInit(masker, "random", 0.6).prune()
        return masker.masks()

    for cls in (DynamicSparseTraining, PruningAtInit):
        a, b = masks(cls), masks(cls)
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_generator_state_checks_change_nothing():
    torch.manual_seed(0)
    dst = DynamicSparseTraining(Masker(TinyNet()), 0.6, total_steps=10, update_interval=2)
    good = dst.state_dict()
    before = dst.generator.get_state()
    for bad in (torch.zeros(3, dtype=torch.uint8), torch.zeros(5056, dtype=torch.int64), "state"):
        with pytest.raises(ValueError, match="generator"):
            dst.load_state_dict(dict(good, generator=bad, last_step=7))
        assert dst.last_step == 0 and torch.equal(dst.generator.get_state(), before)
    with pytest.raises(TypeError, match="generator"):
        DynamicSparseTraining(Masker(TinyNet()), 0.6, total_steps=10, generator=0)
    with pytest.raises(TypeError, match="generator"):
        PruningAtInit(Masker(TinyNet()), "random", 0.6, generator="seed")


def test_masker_process_group_is_checked_and_resolves_to_none_in_one_process():
    with pytest.raises(TypeError, match="process_group"):
        Masker(TinyNet(), process_group="world")
    assert Masker(TinyNet()).group() is None  # no process group: nothing to average over


def test_weight_mask_computes_in_the_weight_dtype():
    """FSDP2's mixed precision hands the parametrization a bfloat16 weight while
    the mask buffer stays float32: the masked weight keeps the weight's dtype."""
    from prunopt.pruning import WeightMask

    wm = WeightMask(torch.tensor([1.0, 0.0, 1.0]))
    w = torch.tensor([2.0, 3.0, 4.0], dtype=torch.bfloat16)
    out = wm(w)
    assert out.dtype == torch.bfloat16 and out.tolist() == [2.0, 0.0, 4.0]


def test_random_pai_state_dict_carries_its_generator():
    torch.manual_seed(0)
    a = PruningAtInit(Masker(TinyNet()), "random", 0.6)
    state = a.state_dict()
    a.prune()
    torch.manual_seed(1)  # another global seed: another generator, until the state is loaded
    masker = Masker(TinyNet())
    b = PruningAtInit(masker, "random", 0.6)
    b.load_state_dict(state)
    b.prune()
    assert all(torch.equal(m, a.masker.masks()[n]) for n, m in masker.masks().items())
    assert "generator" not in PruningAtInit(Masker(TinyNet()), "magnitude", 0.6).state_dict()
