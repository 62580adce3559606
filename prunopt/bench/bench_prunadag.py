"""prunAdag step and top-T threshold: fused PrunAdag vs
torch.optim.Adagrad(fused=True), the foreach and single-tensor PrunAdag paths,
and the threshold op vs torch.kthvalue on the concatenation.

float32, ``relevant=0.1``, version 3, global scope; one tensor of N elements
and a model-like list of 50 tensors totalling N (N = 10M, quick: 1M). Every
contender is verified against the single-tensor path (and kthvalue) before it
is timed; medians from torch.utils.benchmark.
"""
from __future__ import annotations

import torch

from prunopt.bench.common import environment, interleaved_times, median_time, write_results


def _sizes(total: int, count: int, seed: int = 0):
    if count == 1:
        return [total]
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(count, generator=g) ** 3 + 0.01  # a few large layers, many small ones
    sizes = (w / w.sum() * total).long().clamp(min=1)
    sizes[0] += total - int(sizes.sum())
    return [int(s) for s in sizes]


def _setup(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).requires_grad_() for s in sizes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def _clone(ps):
    out = [p.detach().clone().requires_grad_() for p in ps]
    for o, p in zip(out, ps):
        o.grad = p.grad.clone()
    return out


def _verify(sizes, version: int = 3, paths=("foreach", "fused")):
    from prunopt.optim import PrunAdag

    base = _setup(sizes)
    results = {}
    kws = {"single": dict(foreach=False), "foreach": dict(foreach=True, fused=False), "fused": dict(fused=True)}
    for name in ("single",) + tuple(paths):
        ps = _clone(base)
        PrunAdag(ps, lr=0.1, relevant=0.1, version=version, **kws[name]).step()
        results[name] = torch.cat([p.detach().reshape(-1) for p in ps])
    for name in paths:
        err = (results[name] - results["single"]).abs().max().item()
        if err > 1e-5:
            raise AssertionError(f"{name} PrunAdag (version {version}) differs from the single-tensor path by {err}")


def _median_of_steps(step, count: int, threads: int) -> float:
    """Median seconds of ``count`` consecutive calls (each call timed alone)."""
    import statistics
    import time

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ts = []
        for _ in range(count):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    return statistics.median(ts)


def run(quick: bool, threads: int, out) -> str:
    from prunopt.ops import topk_threshold
    from prunopt.optim import PrunAdag

    torch.set_num_threads(threads)
    total = 1_000_000 if quick else 10_000_000
    min_t = 0.3 if quick else 1.0
    rows = []
    for layout, count in (("1 tensor", 1), ("50 tensors", 50)):
        sizes = _sizes(total, count)
        _verify(sizes)
        ps = _setup(sizes)
        T = max(1, int(0.1 * total))
        flat_abs = torch.cat([p.grad.reshape(-1).abs() for p in ps])
        if not torch.equal(topk_threshold([p.grad for p in ps], T), torch.kthvalue(flat_abs, total - T + 1).values):
            raise AssertionError("topk_threshold differs from torch.kthvalue")
        ada = torch.optim.Adagrad(_clone(ps), lr=0.1, fused=True)
        gs = [p.grad for p in ps]
        # the fast contenders in alternating rounds (their ratios are the targets)
        fused_opt = PrunAdag(_clone(ps), lr=0.1, relevant=0.1, fused=True)
        contenders = {
            "Adagrad(fused=True)": ada.step,
            "PrunAdag fused": fused_opt.step,
            "topk_threshold": lambda: topk_threshold(gs, T),
        }
        if count == 1:
            # Version 4 has version 3's element pass (the b = |x| bound) but no
            # ratio r, so its scan reads g only: 8 streams against version 3's 9
            # (the scan's x feeds ||x||_M). The issue's "memory-traffic floor
            # about 1.6x" (8 streams / Adagrad's 5) is this version's floor.
            _verify(sizes, version=4, paths=("fused",))
            contenders["PrunAdag fused, version 4"] = PrunAdag(_clone(ps), lr=0.1, relevant=0.1, version=4,
                                                               fused=True).step
            # The reads the step cannot avoid, as plain reductions: the scan
            # reads g and x, the element pass g, x and both sums (its writes go
            # to lines it has just read). Adagrad reads 3 streams, so on a host
            # where reads set the pace this row / Adagrad is the step's floor.
            fused_opt.step()
            (xp,) = fused_opt.param_groups[0]["params"]
            st = fused_opt.state[xp]
            streams = [xp.grad, xp.detach(), xp.grad, xp.detach(), st["sum"], st["decrease_sum"]]
            contenders["read floor: 6 streams (torch.sum each)"] = lambda: [t.sum() for t in streams]
        times = interleaved_times(contenders, 3 * min_t, threads)
        t_ada = times["Adagrad(fused=True)"]
        if count == 1:
            # the same step later in a run: the gradients stay fixed, so the
            # decreased weights decay geometrically (below 1e-19 by step ~800,
            # where x * x underflows) and the share of vectors the float32
            # shortcut cannot decide grows; the step must not slow down
            # (steps 1001-1100 exactly: from step ~1300 on they reach float32's
            # denormals, where x86 takes assists on every operation; see
            # docs/prunadag.md for torch.set_flush_denormal)
            late = PrunAdag(_clone(ps), lr=0.1, relevant=0.1, fused=True)
            for _ in range(1000):
                late.step()
            times["PrunAdag fused, steps 1001-1100"] = _median_of_steps(late.step, 100, threads)
        times["PrunAdag foreach"] = median_time(
            PrunAdag(_clone(ps), lr=0.1, relevant=0.1, foreach=True, fused=False).step, min_t, threads)
        times["PrunAdag single-tensor"] = median_time(
            PrunAdag(_clone(ps), lr=0.1, relevant=0.1, foreach=False).step, min_t / 3, threads)
        times["torch.kthvalue(cat)"] = median_time(
            lambda: torch.kthvalue(torch.cat([g.reshape(-1).abs() for g in gs]), total - T + 1), min_t, threads)
        fused = times["PrunAdag fused"]
        order = ["Adagrad(fused=True)", "PrunAdag fused", "PrunAdag fused, steps 1001-1100", "PrunAdag fused, version 4",
                 "PrunAdag foreach",
                 "PrunAdag single-tensor", "topk_threshold", "torch.kthvalue(cat)",
                 "read floor: 6 streams (torch.sum each)"]
        for name in [c for c in order if c in times]:
            t = times[name]
            rows.append({
                "layout": layout,
                "contender": name,
                "median_ms": 1e3 * t,
                "vs_fused_adagrad": t / t_ada,
                "vs_fused_prunadag": t / fused,
            })
        rows.append({"layout": layout, "contender": "kthvalue / topk_threshold", "median_ms": "",
                     "vs_fused_adagrad": "", "vs_fused_prunadag": times["torch.kthvalue(cat)"] / times["topk_threshold"]})
    notes = (f"float32, N = {total:,} elements, relevant = 0.1, version 3, global scope, {threads} threads. "
             "Adagrad, fused PrunAdag, topk_threshold and the read floor are timed in 5 alternating rounds "
             "(median of the round medians), the slow paths one after the other. 'read floor': torch.sum over the "
             "six streams the step must read (g, x for the scan; g, x and both accumulators for the element "
             "pass), against Adagrad's three. 'version 4' (1 tensor, same rounds): no ratio r, so its scan reads g "
             "only (8 streams to version 3's 9; Adagrad makes 5). Targets: fused step <= 2.0x fused Adagrad; threshold <= 1.25x fused Adagrad and >= 30x "
             "faster than torch.kthvalue; fused >= 100x faster than the single-tensor path. "
             "Rerun: `PYTHONPATH=. python -m bench.run --only prunadag`.")
    md = write_results("prunadag", rows, environment(threads), notes, out)
    return (md + "\n" + _bracket_pass(quick, threads, out) + "\n" + _slice_pass(quick, threads, out) + "\n"
            + _prunadag_slice_pass(quick, threads, out))


def _bracket_pass(quick: bool, threads: int, out) -> str:
    """The local work of a sharded PrunAdag step once the bracket is known:
    the fused ``prunadag_bracket`` (one read of g and x: count, the norms
    outside the bracket, candidates with their x) against the two passes it
    replaces (``topk_bracket`` over |g|, then ``prunadag_norms`` for the
    selected tau, which reads g and x twice: its finiteness check and the
    norms). Verified first: the same candidates, and the norms completed from
    the candidates equal prunadag_norms' within float rounding."""
    import prunopt.distributed as D
    from prunopt.ops import prunadag_bracket, prunadag_norms, topk_bracket, topk_slice
    from prunopt.reference.prunadag import TensorHyper

    torch.set_num_threads(threads)
    total = 1_000_000 if quick else 10_000_000
    min_t = 0.3 if quick else 1.0
    rows = []
    for layout, count in (("1 tensor", 1), ("50 tensors", 50)):
        ps = _setup(_sizes(total, count))
        xs, gs = [p.detach() for p in ps], [p.grad for p in ps]
        hyper = torch.tensor([[0.1, 0.1, 0.0, 1e-10, 0.0, 1.0]] * len(ps), dtype=torch.float64)
        T = max(1, int(0.1 * total))
        # the bracket a rank of 2 takes for its share (here the whole set: one "rank")
        head = topk_slice(gs, T, D._rank_buckets(1), 0)[0].tolist()
        lo, hi = D._bits_value(head[10], torch.float32), D._bits_value(head[11] - 1, torch.float32)
        above, cands = topk_bracket(gs, lo, hi)
        summary, keys, m = prunadag_bracket(xs, gs, hyper, lo, hi)
        if int(summary[0]) != int(above) or not torch.equal(keys, cands):
            raise AssertionError("prunadag_bracket and topk_bracket disagree")
        tau = torch.topk(cands, T - int(above)).values[-1]
        rel = keys >= tau
        g_r2 = float(summary[1]) + float((keys.double() ** 2)[rel].sum())
        x_m2 = float(summary[2]) + float(m[~rel].sum())
        want = prunadag_norms(xs, gs, hyper, tau.double().reshape(1))
        if abs(g_r2 - float(want[0])) > 1e-6 * float(want[0]) or abs(x_m2 - float(want[1])) > 1e-6 * float(want[1]):
            raise AssertionError("the norms completed from the bracket pass differ from prunadag_norms")
        t64 = tau.double().reshape(1)
        times = interleaved_times({
            "prunadag_bracket (one pass over g, x)": lambda: prunadag_bracket(xs, gs, hyper, lo, hi),
            "topk_bracket + prunadag_norms (3 passes)": lambda: (topk_bracket(gs, lo, hi),
                                                                 prunadag_norms(xs, gs, hyper, t64)),
        }, 3 * min_t, threads)
        base = times["topk_bracket + prunadag_norms (3 passes)"]
        for name, t in times.items():
            rows.append({"layout": layout, "contender": name, "median_ms": 1e3 * t, "vs_two_ops": t / base,
                         "candidates": keys.numel()})
    notes = (f"float32, N = {total:,} elements, the bracket of the top 10 % from the sample the sharded "
             f"threshold takes, {threads} threads, 5 alternating rounds. The fused pass is what each rank runs in "
             "a sharded PrunAdag step (then only the candidates enter the radix passes, whose collectives also "
             "carry the norms); the pair is what it replaces. Rerun: `prunopt bench --only prunadag --out DIR`.")
    return write_results("prunadag_bracket", rows, environment(threads), notes, out)


def _slice_pass(quick: bool, threads: int, out) -> str:
    """A rank's first round of the sharded threshold: the fused
    ``topk_slice`` (sample, bracket, one pass, histogram, window in one call)
    against the same steps as separate calls (the reference's steps,
    ``prunopt.reference.prunadag._slice_rounds``, with the compiled ops: a
    strided sample, two ``topk_threshold`` calls on it, ``topk_bracket``, the
    histogram and the window in tensor operations), and beside them the pass
    alone (``topk_bracket`` over the same bracket: the floor of
    any exact select, which reads every value once). Verified first: the
    composition gives the op's slice and window."""
    import prunopt.distributed as D
    import prunopt.reference.prunadag as R
    from prunopt.ops import topk_bracket, topk_slice, topk_threshold

    torch.set_num_threads(threads)
    total = 1_000_000 if quick else 5_000_000  # a rank's half of 10M
    min_t = 0.3 if quick else 1.0
    world, k = 2, int(0.2 * total)  # (the rank's share of the top 10 % of 2 x total)
    buckets, slots = D._rank_buckets(world), D._window_slots(world)
    cap = 2 * slots
    rows = []
    for layout, count in (("1 tensor", 1), ("50 tensors", 50)):
        gs = [p.grad for p in _setup(_sizes(total, count))]
        keys = [g.reshape(-1) for g in gs]

        def composed():
            # the reference's steps with the compiled ops: the strided sample,
            # two topk_threshold calls on it, topk_bracket, the histogram and
            # the window in tensor operations
            def scan(lo, hi):
                above, inside = topk_bracket(keys, lo, hi)
                return False, int(above), inside, None

            head, hist, inside, _, window = R._slice_rounds(
                torch.float32, total, -(-k // world), buckets, cap,
                lambda: R._slice_sample(keys, total, R.SLICE_SAMPLE), scan, topk_threshold)
            bits = inside.view(torch.int32)
            return head, hist, bits[(bits >= window[0]) & (bits < window[1])] if window else bits[:0]

        head, hist, window, inside = topk_slice(gs, -(-k // world), buckets, cap)
        c_head, c_hist, c_window = composed()
        h = head.tolist()
        if h != c_head or not torch.equal(hist, c_hist) or not torch.equal(window, c_window):
            raise AssertionError("topk_slice and the composed steps disagree")
        lo, hi = D._bits_value(h[10], torch.float32), D._bits_value(h[11] - 1, torch.float32)
        times = interleaved_times({
            "topk_slice (one call)": lambda: topk_slice(gs, -(-k // world), buckets, cap),
            "composed (sample, 2 topk_threshold, topk_bracket, histogram, window in tensor ops)": composed,
            "pass alone (topk_bracket over the same bracket)": lambda: topk_bracket(gs, lo, hi),
        }, 3 * min_t, threads)
        base = times["composed (sample, 2 topk_threshold, topk_bracket, histogram, window in tensor ops)"]
        for name, t in times.items():
            rows.append({"layout": layout, "contender": name, "median_ms": 1e3 * t, "vs_composed": t / base,
                         "candidates": inside.numel(), "window": h[9]})
    notes = (f"float32, N = {total:,} elements (one rank's half of a 2-rank threshold of the top 10 %), share "
             f"{-(-k // world):,}, {buckets} grid buckets, windows of at most {cap} values, {threads} threads, 5 "
             "alternating rounds. The op is what each rank runs before the sharded threshold's first collective; "
             "the composition is the same steps as separate calls in Python and tensor operations; "
             "the pass alone is the floor. Rerun: `prunopt bench --only prunadag --out DIR`.")
    return write_results("topk_slice", rows, environment(threads), notes, out)


def _prunadag_slice_pass(quick: bool, threads: int, out) -> str:
    """A rank's first round of the sharded PrunAdag select: the fused
    ``prunadag_slice`` (the effective gradients' sample, the bracket, one
    ``prunadag_bracket`` pass, the histogram, the window with its sums in one
    call) against the same steps as separate calls (the reference's steps
    with the compiled ops: the sample in tensor operations, two
    ``topk_threshold`` calls, ``prunadag_bracket``, the histogram and the
    window's split in tensor operations), and the pass alone. Verified first:
    the composition gives the op's slice, window and (to rounding) sums."""
    import prunopt.distributed as D
    import prunopt.reference.prunadag as R
    from prunopt.ops import prunadag_bracket, prunadag_slice, topk_threshold

    torch.set_num_threads(threads)
    total = 1_000_000 if quick else 5_000_000  # a rank's half of 10M
    min_t = 0.3 if quick else 1.0
    world, T = 2, int(0.2 * total)  # (the rank's share of the top 10 % of 2 x total)
    buckets = D._rank_buckets(world)
    cap = D._window_slots(world) - 2  # (float32: one slot per candidate after the two sums)
    rows = []
    for layout, count in (("1 tensor", 1), ("50 tensors", 50)):
        ps = _setup(_sizes(total, count))
        xs, gs = [p.detach() for p in ps], [p.grad for p in ps]
        hyper = torch.tensor([[0.1, 0.1, 0.01, 1e-10, 0.0, 1.0]] * len(ps), dtype=torch.float64)
        hypers = [R.TensorHyper(lr=0.1, weight_decay=0.01) for _ in ps]
        share = -(-T // world)

        def composed():
            def draw():  # (ge at the sample's positions only)
                gv = R._slice_sample_views([g.reshape(-1) for g in gs], total, R.SLICE_SAMPLE)
                xv = R._slice_sample_views([x.reshape(-1) for x in xs], total, R.SLICE_SAMPLE)
                return torch.cat([g + x * 0.01 for g, x in zip(gv, xv)]).abs()

            def scan(lo, hi):
                summary, keys, m = prunadag_bracket(xs, gs, hyper, lo, hi)
                return False, int(summary[0]), keys, (float(summary[1]), float(summary[2]), m)

            head, hist, keys, (G, X, m), window = R._slice_rounds(torch.float32, total, share, buckets, cap, draw,
                                                                  scan, topk_threshold)
            bits = keys.view(torch.int32)
            inw = (bits >= window[0]) & (bits < window[1])
            sums = [G, X, G + float(keys.double().square()[bits >= window[1]].sum()),
                    X + float(m[bits < window[0]].sum())]
            return head, hist, bits[inw], m[inw], sums

        got = prunadag_slice(xs, gs, hyper, share, buckets, cap)
        c_head, c_hist, c_bits, c_m, c_sums = composed()
        h = got[0].tolist()
        if (h != c_head or not torch.equal(got[2], c_hist) or not torch.equal(got[3], c_bits)
                or not torch.equal(got[4], c_m)
                or not all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got[1].tolist(), c_sums))):
            raise AssertionError("prunadag_slice and the composed steps disagree")
        lo, hi = D._bits_value(h[10], torch.float32), D._bits_value(h[11] - 1, torch.float32)
        name = "composed (sample, 2 topk_threshold, prunadag_bracket, histogram, window in tensor ops)"
        times = interleaved_times({
            "prunadag_slice (one call)": lambda: prunadag_slice(xs, gs, hyper, share, buckets, cap),
            name: composed,
            "pass alone (prunadag_bracket over the same bracket)": lambda: prunadag_bracket(xs, gs, hyper, lo, hi),
        }, 3 * min_t, threads)
        for contender, t in times.items():
            rows.append({"layout": layout, "contender": contender, "median_ms": 1e3 * t,
                         "vs_composed": t / times[name], "candidates": got[5].numel(), "window": h[9]})
    notes = (f"float32, N = {total:,} elements (one rank's half of a 2-rank PrunAdag select of the top 10 %, weight "
             f"decay 0.01), share {-(-T // world):,}, {buckets} grid buckets, windows of at most {cap} candidates, "
             f"{threads} threads, 5 alternating rounds. The op is what each rank runs before the sharded PrunAdag "
             "step's first collective; the composition is the same steps as separate calls in Python and tensor "
             "operations; the pass alone is the floor. Rerun: `prunopt bench --only prunadag --out DIR`.")
    return write_results("prunadag_slice", rows, environment(threads), notes, out)
