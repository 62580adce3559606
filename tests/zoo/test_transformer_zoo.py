"""prunopt on transformers' language models (random weights, small configs):
GPT-2 (its linear layers are ``Conv1D`` with weight ``(in, out)``) and BERT.
Masks and every pruning method, probabilistic masks in a budget, and PrunAdag
as the optimizer of ``transformers.Trainer`` with a checkpoint resumed."""
import copy
import os

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

from _zoo import bert, gpt2, logits, tokens  # noqa: E402
from prunopt.nn import (apply_probmask, finalize_probmask, probmask_modules, probmask_scores,  # noqa: E402
                        remove_channels)
from prunopt.optim import BudgetProjection, PrunAdag  # noqa: E402
from prunopt.pruning import (  # noqa: E402
    DynamicSparseTraining,
    FineTuning,
    GradualMagnitudePruning,
    LotteryTicket,
    Masker,
    PruningAtInit,
    is_hf_conv1d,
)


def _lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


MODELS = {
    # (build, layer type masked, masker kwargs, targets of a batch, loss on the logits)
    "gpt2": (gpt2, Conv1D, dict(exclude=["lm_head"]), lambda ids: ids, _lm_loss),
    "bert": (bert, nn.Linear, {}, lambda ids: ids[:, 0] % 3, F.cross_entropy),
}


def _close(a, b, tol=1e-5):
    a, b = a.detach(), b.detach()
    torch.testing.assert_close(a, b, atol=tol * (1 + float(b.abs().max())), rtol=tol)


def _global_topk(scores, keep):
    flat = torch.cat([s.reshape(-1) for s in scores.values()])
    thresh = flat.topk(keep).values.min()
    return {n: s >= thresh for n, s in scores.items()}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_masker_and_every_pruning_method_on_the_linear_layers(kind):
    build, layer_type, kw, targets, loss_fn = MODELS[kind]
    model = build().eval()
    x = tokens()
    y = targets(x)
    names = Masker(copy.deepcopy(model), **kw).names()
    assert names and all(isinstance(model.get_submodule(n.rsplit(".", 1)[0]), layer_type) for n in names)
    assert all(is_hf_conv1d(model.get_submodule(n.rsplit(".", 1)[0])) == (kind == "gpt2") for n in names)

    with pytest.raises(RuntimeError, match="second derivatives.*set_attn_implementation"):
        PruningAtInit(Masker(copy.deepcopy(model), **kw), "grasp", 0.8, loss_fn=loss_fn).prune(batches=[(x, y)])
    for score in ("random", "magnitude", "snip", "grasp", "synflow"):
        m, fresh = copy.deepcopy(model), copy.deepcopy(model)
        if score == "grasp":  # SDPA's fused CPU attention has no double backward
            m.set_attn_implementation("eager")
        masker = Masker(m, **kw)
        PruningAtInit(masker, score, 0.8, synflow_rounds=2, generator=torch.Generator().manual_seed(0),
                      loss_fn=loss_fn).prune(batches=[(x, y)], example_input=x)
        masks = masker.masks()
        total = sum(mk.numel() for mk in masks.values())
        assert masker.sparsity() == pytest.approx(0.8, abs=1.5 / total)
        with torch.no_grad():  # the masks multiplied into the (in, out) / (out, in) weights by hand
            for n, mask in masks.items():
                fresh.get_submodule(n.rsplit(".", 1)[0]).weight.mul_(mask)
        _close(logits(m(x)), logits(fresh(x)))
        kept = int(sum(mk.sum() for mk in masks.values()))
        if score == "magnitude":
            w = {n: model.get_submodule(n.rsplit(".", 1)[0]).weight.detach().abs() for n in masks}
            want = _global_topk(w, kept)
            assert all(torch.equal(masks[n], want[n]) for n in masks)
        if score == "snip":  # |dL/dw * w| computed here by hand
            ref = copy.deepcopy(model).train()
            params = [ref.get_submodule(n.rsplit(".", 1)[0]).weight for n in masks]
            grads = torch.autograd.grad(loss_fn(logits(ref(x)), y), params)
            want = _global_topk({n: (g * p).abs() for n, g, p in zip(masks, grads, params)}, kept)
            assert all(torch.equal(masks[n], want[n]) for n in masks)

    def train_step(m, opt, method, closure=None):
        opt.zero_grad()
        loss_fn(logits(m(x)), y).backward()
        opt.step()
        method.step(closure) if closure is not None else method.step()

    m = copy.deepcopy(model).train()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    masker = Masker(m, opt, **kw)
    lt = LotteryTicket(masker, opt, sparsity=0.5, rate=0.2, dense=[])
    t0 = {n: pt.parameter.detach().clone() for n, pt in masker.tensors.items()}
    train_step(m, opt, lt)
    assert lt.prune_and_rewind() == pytest.approx(0.2, abs=1e-3)
    masks = masker.masks()
    assert all(torch.equal(pt.parameter.detach(), t0[n] * masks[n]) for n, pt in masker.tensors.items())

    for mode in ("set", "rigl"):
        m = copy.deepcopy(model).train()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        masker = Masker(m, opt, **kw)
        dst = DynamicSparseTraining(masker, 0.8, total_steps=10, mode=mode, update_interval=1,
                                    generator=torch.Generator().manual_seed(0))
        before = masker.masks()
        train_step(m, opt, dst, (lambda: loss_fn(logits(m(x)), y)) if mode == "rigl" else None)
        after = masker.masks()
        assert any(not torch.equal(before[n], after[n]) for n in after)
        assert masker.counts() == dst.layer_counts
        for n, pt in masker.tensors.items():  # Adam's moments of the pruned entries are zero too
            assert not pt.parameter[~after[n]].any()
            assert not opt.state[pt.parameter]["exp_avg"][~after[n]].any()

    m = copy.deepcopy(model).train()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    masker = Masker(m, opt, **kw)
    gmp = GradualMagnitudePruning(masker, 0.8, t0=0, t1=2, interval=1)
    for _ in range(2):
        train_step(m, opt, gmp)
    assert masker.sparsity() == pytest.approx(0.8, abs=1.5 / sum(mk.numel() for mk in masker.masks().values()))

    m = copy.deepcopy(model)
    masker = Masker(m, **kw)
    FineTuning(masker, 0.9).prune()
    assert masker.sparsity() == pytest.approx(0.9, abs=1.5 / sum(mk.numel() for mk in masker.masks().values()))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_probmask_in_a_budget_on_the_linear_layers(kind):
    build, layer_type, _, targets, loss_fn = MODELS[kind]
    model = build()
    x = tokens()
    y = targets(x)
    masked = apply_probmask(model, layer_types=(layer_type,), exclude=["classifier"] if kind == "bert" else ())
    assert masked and all(isinstance(model.get_submodule(n), layer_type) for n, _ in masked)
    scores = probmask_scores(model)
    opt = torch.optim.Adam(scores, lr=0.1)
    proj = BudgetProjection(scores, density=0.3)
    proj.attach(opt)
    model.train()
    for _ in range(2):
        opt.zero_grad()
        loss_fn(logits(model(x)), y).backward()
        opt.step()  # the projection runs after it
    total = sum(s.numel() for s in scores)
    assert sum(float(s.detach().sum()) for s in scores) <= 0.3 * total * (1 + 1e-5)
    assert all(float(s.detach().min()) >= 0 and float(s.detach().max()) <= 1 for s in scores)
    kept = finalize_probmask(model, 0.3)
    assert kept == round(0.3 * total) == sum(int(pm.mask().sum()) for _, pm in probmask_modules(model))
    # eval: each weight times its fixed binary mask, checked against a hand-masked copy
    model.eval()
    ref = build().eval()
    with torch.no_grad():
        for name, pm in probmask_modules(model):
            layer = ref.get_submodule(name)
            original = model.get_submodule(name).parametrizations.weight.original
            layer.weight.copy_(original * pm.mask())
    _close(logits(model(x)), logits(ref(x)))


def test_scores_of_a_model_returning_a_tuple_are_a_clear_error():
    model = bert()
    model.config.return_dict = False  # returns (logits,): no tensor and no "logits" to take
    x = tokens()
    with pytest.raises(TypeError, match="tuple.*logits"):
        PruningAtInit(Masker(model), "snip", 0.5).prune(batches=[(x, x[:, 0] % 3)])


def test_probmask_on_gpt2_tied_head_is_a_clear_error():
    model = gpt2()  # lm_head shares its weight with the token embedding
    with pytest.raises(ValueError, match="lm_head.*transformer.wte.weight"):
        apply_probmask(model)  # default layer types: the only nn.Linear is the tied head
    assert not any(n.endswith("parametrizations") for n, _ in model.named_modules())


def test_remove_channels_shrinks_bert_feed_forward_layers():
    """BERT's linear layers read the last dimension of (B, L, C) activations:
    with nothing exactly zero the copy keeps every layer's size; hidden
    feed-forward features whose rows (weights and bias) are zero go, with the
    matching inputs of the layer that reads them, and the outputs stay."""
    model = bert().eval()
    x = tokens()
    same = remove_channels(model, example_input=x)
    assert sum(p.numel() for p in same.parameters()) == sum(p.numel() for p in model.parameters())
    _close(logits(same(x)), logits(model(x)))
    with torch.no_grad():
        for layer, rows in zip(model.bert.encoder.layer, ([0, 5, 9], list(range(0, 64, 2)))):
            layer.intermediate.dense.weight[rows] = 0.0
            layer.intermediate.dense.bias[rows] = 0.0
    small = remove_channels(model, example_input=x)
    for layer, n in zip(small.bert.encoder.layer, (61, 32)):
        assert layer.intermediate.dense.out_features == layer.output.dense.in_features == n
        assert layer.attention.self.query.in_features == 32  # the residual stream keeps its width
    _close(logits(small(x)), logits(model(x)))


# ------------------------------------------------------------------------------ Trainer
def _args(out, steps, save_steps=None):
    return TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, seed=0, max_grad_norm=0.0, logging_steps=1000, disable_tqdm=True,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 1000)


def _prunadag(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = PrunAdag([{"params": decay}, {"params": other, "prune": False}], lr=0.05, relevant=0.3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.5 * k))
    return opt, sched


def _rows(kind, n, same=False):
    """Training rows. GPT-2: language-model rows whose first label is ignored
    (-100): it is never a prediction target, and so the token count the
    Trainer normalises the loss by is the same whether it counts the labels
    before or after the shift. BERT: a sequence and its class."""
    ids = [tokens(1, 8, seed=0 if same else i)[0] for i in range(n)]
    if kind == "gpt2":
        return [{"input_ids": r, "labels": torch.cat([torch.tensor([-100]), r[1:]])} for r in ids]
    return [{"input_ids": r, "labels": r[0] % 3} for r in ids]


TRAINER_MODELS = {"gpt2": gpt2, "bert": bert}


@pytest.mark.parametrize("kind", sorted(TRAINER_MODELS))
def test_prunadag_in_the_trainer_matches_a_plain_loop(tmp_path, kind):
    build = TRAINER_MODELS[kind]
    data = _rows(kind, 6, same=True)  # one batch repeated: the Trainer's sampling order does not matter
    model = build()
    opt, sched = _prunadag(model)
    Trainer(model=model, args=_args(str(tmp_path), 3), train_dataset=data, optimizers=(opt, sched)).train()

    ref = build()
    ref.train()
    ropt, rsched = _prunadag(ref)
    batch = {k: torch.stack([r[k] for r in data[:2]]) for k in data[0]}
    for _ in range(3):
        ref(**batch).loss.backward()
        ropt.step()
        rsched.step()
        ropt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5, msg=n)
    assert float(opt.state[next(model.parameters())]["step"]) == 3


@pytest.mark.parametrize("kind", sorted(TRAINER_MODELS))
def test_trainer_checkpoint_resume_continues_exactly(tmp_path, kind):
    """A run saved at step 2 of 4 and resumed from that checkpoint (into a
    model built with other weights) ends where the uninterrupted run ends:
    parameters, optimizer state and scheduler, bit for bit."""
    build = TRAINER_MODELS[kind]
    data = _rows(kind, 8)
    out = str(tmp_path / "run")
    model = build()
    opt, sched = _prunadag(model)
    Trainer(model=model, args=_args(out, 4, save_steps=2), train_dataset=data, optimizers=(opt, sched)).train()
    ckpt = os.path.join(out, "checkpoint-2")
    assert os.path.exists(os.path.join(ckpt, "optimizer.pt"))

    resumed = build(seed=1)  # other weights: they must come from the checkpoint
    ropt, rsched = _prunadag(resumed)
    Trainer(model=resumed, args=_args(out, 4), train_dataset=data, optimizers=(ropt, rsched)).train(
        resume_from_checkpoint=ckpt)
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=0, rtol=0, msg=n)
    for p, q in zip(model.parameters(), resumed.parameters()):
        for key in ("sum", "decrease_sum", "step"):
            torch.testing.assert_close(ropt.state[q][key], opt.state[p][key], atol=0, rtol=0)
    assert rsched.last_epoch == sched.last_epoch == 4

    # the optimizer state matters: resuming without it does not continue the run
    os.remove(os.path.join(ckpt, "optimizer.pt"))
    cold = build(seed=1)
    copt, csched = _prunadag(cold)
    Trainer(model=cold, args=_args(str(tmp_path / "cold"), 4), train_dataset=data,
            optimizers=(copt, csched)).train(resume_from_checkpoint=ckpt)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), cold.parameters()))
