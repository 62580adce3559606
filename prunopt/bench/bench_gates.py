"""Fused sparsification kernels vs the equivalent plain-PyTorch autograd
composition (forward + backward): rgf_relu, sparse_gate (signed and
non-negative, rgf) and two_temperature_sigmoid.

Each row checks that both paths give the same values and gradients (float32 vs
a float64 reference) before timing ``forward + backward`` and the forward alone
with torch.utils.benchmark in one process. Fused and composed are timed in
alternation for ``ROUNDS`` rounds and each keeps its smallest median, so a burst
of load on a shared machine hits both sides alike; it reports those medians and
the ratios composed / fused (> 1: the fused kernel is faster), with the load
average beside them.

On an oversubscribed machine wall-clock figures with 2 threads are dominated by
scheduler time slices (every parallel region waits for both threads).
``python -m bench.bench_gates --cpu-time`` prints a second table that is immune
to that: one thread, the smallest per-call CPU time (``time.thread_time``) of
each side.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from prunopt.bench.common import environment, median_time, write_results
from prunopt.ops import rgf_relu, sparse_gate, two_temperature_sigmoid
from prunopt.reference import rgf_relu_composed, sparse_gate_composed, two_temperature_sigmoid_composed


def _cases(quick: bool):
    sizes = [1 << 16] if quick else [1 << 16, 1 << 20, 1 << 22]
    gate_shapes = [(256, 64)] if quick else [(256, 64), (4096, 256), (64, 16384)]
    for n in sizes:
        yield ("rgf_relu", f"n={n}", lambda x: rgf_relu(x, 0.1), lambda x: rgf_relu_composed(x, 0.1), [(n,)])
        yield ("two_temperature_sigmoid", f"n={n}", lambda w: two_temperature_sigmoid(w * 1e-2, 1000.0, 10.0),
               lambda w: two_temperature_sigmoid_composed(w * 1e-2, 1000.0, 10.0), [(n,)])
    for g, k in gate_shapes:
        for signed in (True, False):
            name = "sparse_gate_signed" if signed else "sparse_gate_nonneg"
            yield (name, f"{g}x{k}", lambda a, b, s=signed: sparse_gate(a, b, signed=s),
                   lambda a, b, s=signed: sparse_gate_composed(a, b, s, 0.1), [(g, k), (g,)])


def _fwd_bwd(fn, inputs, grad):
    out = fn(*inputs)
    return torch.autograd.grad(out, inputs, grad)


ROUNDS = 3


def _paired_times(fused, composed, min_time, threads, rounds):
    """Smallest median of each side over `rounds` alternating measurements."""
    t_f, t_c = float("inf"), float("inf")
    for _ in range(rounds):
        t_f = min(t_f, median_time(fused, min_time, threads))
        t_c = min(t_c, median_time(composed, min_time, threads))
    return t_f, t_c


def run(quick: bool = False, threads: int = 2, out=None) -> str:
    torch.set_num_threads(threads)
    rows = []
    min_time = 0.2 if quick else 0.5
    rounds = 1 if quick else ROUNDS
    for name, size, fused, composed, shapes in _cases(quick):
        gen = torch.Generator().manual_seed(0)
        inputs = [torch.randn(s, generator=gen).requires_grad_(True) for s in shapes]
        grad = torch.randn(shapes[0], generator=gen)
        # verify before timing: fused float32 vs composed float64
        f_out, c_out = fused(*inputs), composed(*[i.detach().double().requires_grad_(True) for i in inputs])
        assert torch.allclose(f_out.double(), c_out, atol=1e-5), name
        fg = _fwd_bwd(fused, inputs, grad)
        d_in = [i.detach().double().requires_grad_(True) for i in inputs]
        cg = torch.autograd.grad(composed(*d_in), d_in, grad.double())
        for u, v in zip(fg, cg):
            assert torch.allclose(u.double(), v, atol=1e-4 * (1 + v.abs().max().item())), name
        t_f, t_c = _paired_times(lambda: _fwd_bwd(fused, inputs, grad), lambda: _fwd_bwd(composed, inputs, grad),
                                 min_time, threads, rounds)
        with torch.no_grad():
            f_f, f_c = _paired_times(lambda: fused(*inputs), lambda: composed(*inputs), min_time, threads, rounds)
        rows.append(dict(op=name, size=size, fused_ms=t_f * 1e3, composed_ms=t_c * 1e3, speedup=t_c / t_f,
                         fwd_fused_ms=f_f * 1e3, fwd_composed_ms=f_c * 1e3, fwd_speedup=f_c / f_f))
    loadavg = os.getloadavg()
    load = ", ".join(f"{v:.1f}" for v in loadavg)
    busy = (" The machine was oversubscribed: wall-clock figures are dominated by scheduler time slices (multiples "
            "of ~4-16 ms); compare with `python -m bench.bench_gates --cpu-time` or rerun on an idle machine."
            if loadavg[0] > (os.cpu_count() or 1) else "")
    notes = (f"load average (1, 5, 15 min) at the end: {load} on {os.cpu_count()} logical CPUs.{busy} "
             "forward+backward (fused_ms, composed_ms, speedup) and forward alone under no_grad (fwd_*), float32, "
             "CPU; fused = prunopt kernels, composed = the plain-PyTorch autograd composition in prunopt.reference "
             "(straight-through relu/elu and sigmoid pairs); speedup = composed/fused; each figure is the smallest "
             f"median of {rounds} alternating rounds. "
             "Rerun: `PYTHONPATH=. python -m bench.run --only gates` (add --quick for small sizes).")
    return write_results("gates", rows, environment(threads), notes, out,
                         columns=["op", "size", "fused_ms", "composed_ms", "speedup", "fwd_fused_ms", "fwd_composed_ms",
                                  "fwd_speedup"])


def _cpu_min(fn, budget: float = 0.4) -> float:
    """Smallest CPU time of one call of ``fn`` (this thread), over ``budget`` seconds of calls."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while spent < budget or calls < 5:
        t = time.thread_time()
        fn()
        d = time.thread_time() - t
        best, spent, calls = min(best, d), spent + d, calls + 1
    return best


def cpu_time_table(quick: bool = False) -> str:
    """Markdown table of 1-thread CPU times, fused vs composed (forward+backward and forward)."""
    torch.set_num_threads(1)
    lines = ["| op | size | fused ms | composed ms | speedup | fwd fused ms | fwd composed ms | fwd speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for name, size, fused, composed, shapes in _cases(quick):
        gen = torch.Generator().manual_seed(0)
        inputs = [torch.randn(s, generator=gen).requires_grad_(True) for s in shapes]
        grad = torch.randn(shapes[0], generator=gen)
        t_f = _cpu_min(lambda: _fwd_bwd(fused, inputs, grad))
        t_c = _cpu_min(lambda: _fwd_bwd(composed, inputs, grad))
        with torch.no_grad():
            f_f, f_c = _cpu_min(lambda: fused(*inputs)), _cpu_min(lambda: composed(*inputs))
        lines.append(f"| {name} | {size} | {t_f * 1e3:.3f} | {t_c * 1e3:.3f} | {t_c / t_f:.2f} | {f_f * 1e3:.3f} | "
                     f"{f_c * 1e3:.3f} | {f_c / f_f:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-time", action="store_true", help="1-thread CPU-time table (printed, not written)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(cpu_time_table(args.quick) if args.cpu_time else run(quick=args.quick))
