"""Where a CUDA FBConv2d training step spends its time against nn.Conv2d (run
where a GPU is lent): ``PYTHONPATH=. python tools/profile_fb_cuda.py``.

One VGG16-CIFAR layer (64->64 @32x32, batch 32, 50% mask): the wall time of a
synchronised step, the host time to issue one (the device kept busy by a sleep
kernel), synchronising calls inside it, and the host-side operators by self
CPU time (torch.profiler). A diagnostic, not a benchmark (``prunopt/bench/bench_gpu.py``).
"""
from __future__ import annotations

import torch
from cuda_step_timing import measure  # tools/, the script's own folder
from torch import nn

from prunopt.nn import FBConv2d, FilterBasis


def _report(name, step):
    wall, host, syncs, prof = measure(step)
    print(f"\n== {name}: wall {wall * 1e3:.3f} ms/step, host issue {host * 1e3:.3f} ms/step, syncs {syncs}")
    launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                     "cudaLaunchKernelExC")) / 10
    print(f"  kernel launches per step: {launches:.1f}")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]:
        d = getattr(e, "self_device_time_total", 0)
        print(f"  cpu {e.self_cpu_time_total / 10 / 1e3:7.4f} ms  dev {d / 10 / 1e3:7.4f} ms  x{e.count / 10:<5.1f} "
              f"{e.key[:80]}")


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 64, 3, padding=1)
    fb = FBConv2d.from_conv2d(conv, FilterBasis(3, init="orthonormal"))
    fb.mask.bernoulli_(0.5)
    conv, fb = conv.cuda(), fb.cuda()
    x = torch.randn(32, 64, 32, 32, device="cuda", requires_grad=True)

    def step(m):
        y = m(x)
        y.backward(torch.ones_like(y))

    _report("nn.Conv2d", lambda: step(conv))
    _report("FBConv2d", lambda: step(fb))
    _report("FBConv2d forward", lambda: fb(x))
    _report("nn.Conv2d forward", lambda: conv(x))


if __name__ == "__main__":
    main()
