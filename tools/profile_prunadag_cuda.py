"""Where a fused CUDA PrunAdag step spends its time (run where a GPU is lent):

    PYTHONPATH=. python tools/profile_prunadag_cuda.py

For one tensor of 10M and 50 model-like tensors totalling 10M (float32,
version 3, relevant=0.1, global scope): the wall time of a synchronised step,
the host time to issue one (no synchronisation), the summed device time of
its kernels, and the kernels by device time (torch.profiler). The same for
``torch.optim.Adagrad(foreach=True)`` beside it. A diagnostic, not a benchmark:
the benchmark is ``prunopt/bench/bench_gpu.py``.
"""
from __future__ import annotations

import torch
from cuda_step_timing import measure  # tools/, the script's own folder

from prunopt.bench.bench_prunadag import _sizes
from prunopt.optim import PrunAdag


def _params(sizes):
    g = torch.Generator(device="cuda").manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda")) for s in sizes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, device="cuda")
    return ps


def _report(name, step):
    wall, host, syncs, prof = measure(step)
    dev_total = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 10
    print(f"\n== {name}: wall {wall * 1e3:.3f} ms/step, host issue {host * 1e3:.3f} ms/step, "
          f"device kernels {dev_total / 1e3:.3f} ms/step")
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))
    for e in rows[:12]:
        d = getattr(e, "self_device_time_total", 0)
        if d <= 0:
            break
        print(f"  {d / 10 / 1e3:8.4f} ms  x{e.count / 10:<5.1f} {e.key[:90]}")
    print("  host side (self CPU time per step, profiler overhead included):")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"  {e.self_cpu_time_total / 10 / 1e3:8.4f} ms  x{e.count / 10:<5.1f} {e.key[:90]}")
    print(f"  synchronising calls in one step: {len(syncs)}", *syncs[:3], sep="\n    ")


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for label, count in (("1 tensor", 1), ("50 tensors", 50)):
        sizes = _sizes(10_000_000, count)
        ps = _params(sizes)
        opt = PrunAdag(ps, lr=0.1, relevant=0.1, fused=True)
        _report(f"PrunAdag fused, {label}", opt.step)
        grads = [p.grad for p in ps]
        _report(f"topk_threshold, {label}", lambda: torch.ops.prunopt.topk_threshold(grads, 1_000_000))
        pa = _params(sizes)
        ada = torch.optim.Adagrad(pa, lr=0.1, foreach=True)
        _report(f"Adagrad(foreach=True), {label}", ada.step)


if __name__ == "__main__":
    main()
